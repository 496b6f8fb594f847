"""RULER's synthetic long-context tasks (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your Long-Context
Language Models?", NVIDIA/RULER ``scripts/data/synthetic``) as text prompts with their answers, and RULER's scoring.

Each generator takes a ``numpy.random.Generator`` and the haystack's size in sentences (:func:`fit` finds the largest
that fits a token budget under a tokenizer), and returns a :class:`Sample`: the prompt (RULER's template, its answer
prefix appended as RULER's ``--template`` with the prefix does), the answers, and where the needles sit. Nothing is
downloaded: the haystacks are RULER's ``noise`` (the "repeat" sentences) and ``needle`` ones (other keys' needles as
distractors); the essay haystack needs Paul Graham's essays and is left to a text file of the user's.

- :func:`niah`: needle in a haystack with ``keys`` needles of ``values`` values each, ``queries`` of the keys asked
  (RULER's ``niah_single_*``, ``niah_multikey_*``, ``niah_multivalue``, ``niah_multiquery``); keys are RULER's
  adjective-noun words (from the short lists here) or 7-digit numbers, values 7-digit numbers or words; ``depth``
  (a fraction, single needle) places it for a depth grid, otherwise RULER's uniform positions.
- :func:`variable_tracking`: ``chains`` chains of ``hops`` assignments ``VAR B = VAR A`` from ``VAR A = <5 digits>``,
  asked for every variable holding the first chain's value.
- :func:`common_words`: a numbered list of ``size`` different words, ``common`` of them repeated ``common_times``
  times and the others ``rare_times``, asked for the 10 most common.
- :func:`frequent_words`: coded words drawn from a Zipf distribution (exponent ``alpha``), asked for the 3 most
  frequent.

Scoring (:func:`string_match_all`, :func:`string_match_part`) is RULER's: an answer counts when it occurs in the
prediction, case-insensitively; ``all`` averages the share of each sample's answers found, ``part`` whether any is.
"""

from __future__ import annotations

import string
from typing import Callable, NamedTuple, Sequence

import numpy as np

REPEAT = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_v} for {key} is: {value}."
NIAH = ("Some special magic {type_v} are hidden within the following text. Make sure to memorize it. I will quiz you "
        "about the {type_v} afterwards.\n{context}\nWhat are all the special magic {type_v} for {query} mentioned in "
        "the provided text? The special magic {type_v} for {query} mentioned in the provided text are")
VARIABLES = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
             "Question: Find all variables that are assigned the value {query} in the text above. Answer: According "
             "to the chain(s) of variable assignment in the text above, {count} variables are assigned the value "
             "{query}, they are: ")
COMMON = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones "
          "that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list? Answer: "
          "The top 10 words that appear most often in the list are:")
FREQUENT = ("Read the following coded text and track the frequency of each coded word. Find the three most frequently "
            "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
            "What are the three most frequently appeared words in the above coded text? Answer: According to the coded "
            "text above, the three most frequently appeared words are:")
# Words for keys (adjective-noun, as RULER's wonderwords pairs) and for the word-list tasks.
ADJECTIVES = ("amber", "bitter", "brave", "calm", "clever", "crisp", "dusty", "eager", "faint", "fierce", "gentle",
              "giant", "hollow", "humble", "icy", "jolly", "keen", "lazy", "lively", "loud", "mellow", "misty", "noble",
              "odd", "pale", "proud", "quiet", "rapid", "rough", "rusty", "shiny", "silent", "silly", "sleepy", "smooth",
              "solid", "sour", "swift", "tidy", "vivid")
NOUNS = ("anchor", "apple", "badge", "barrel", "basket", "beacon", "bottle", "bridge", "button", "candle", "canyon",
         "castle", "cloud", "comet", "desert", "dragon", "engine", "falcon", "forest", "garden", "glacier", "hammer",
         "harbor", "island", "jacket", "kettle", "ladder", "lantern", "meadow", "mirror", "needle", "orchard",
         "pencil", "planet", "rocket", "saddle", "signal", "tunnel", "violin", "window")
KINDS = ("words", "numbers")


class Sample(NamedTuple):
  """A prompt, the strings a correct answer contains, and the inserted needles' sentence indices."""
  prompt: str
  answers: tuple[str, ...]
  positions: tuple[int, ...] = ()


def _number(rng, digits: int = 7) -> str:
  return str(int(rng.integers(10 ** (digits - 1), 10 ** digits)))


def _word(rng) -> str:
  return f"{ADJECTIVES[rng.integers(len(ADJECTIVES))]}-{NOUNS[rng.integers(len(NOUNS))]}"


def _distinct(rng, kind: str, count: int, taken: set | None = None, words: Sequence[str] = ()) -> list[str]:
  """``count`` different keys or values of ``kind`` (``words``: from ``words`` where given, else adjective-noun
  pairs; ``numbers``), none in ``taken``."""
  if kind not in KINDS:
    raise ValueError(f"a needle's kind {kind!r}; allowed: {list(KINDS)}")
  available = len(set(words)) if words else len(ADJECTIVES) * len(NOUNS)
  if kind == "words" and count + len(taken or ()) > available:
    raise ValueError(f"{count} different words asked beside {len(taken or ())} taken; the word list gives "
                     f"{available}")
  found, taken = [], set(taken or ())
  while len(found) < count:
    item = (words[rng.integers(len(words))] if words else _word(rng)) if kind == "words" else _number(rng)
    if item not in taken:
      taken.add(item)
      found.append(item)
  return found


def _insert(rng, sentences: list[str], needles: Sequence[str], depth: float | None) -> tuple[list[str], tuple]:
  """``sentences`` with ``needles`` inserted in order: at ``depth`` (a fraction of the haystack: 0 first, 1 last; one
  needle) or each at a uniform position (RULER's); their indices in the result."""
  n = len(sentences)
  if depth is not None:
    if len(needles) != 1 or not 0.0 <= depth <= 1.0:
      raise ValueError(f"depth={depth!r} places one needle at a fraction in [0, 1]; here {len(needles)} needles")
    slots = [int(round(depth * n))]
  else:
    slots = sorted(int(i) for i in rng.choice(n + 1, size=len(needles), replace=True))
  out, placed, start = [], [], 0
  for slot, needle in zip(slots, needles):
    out.extend(sentences[start:slot])
    placed.append(len(out))
    out.append(needle)
    start = slot
  out.extend(sentences[start:])
  return out, tuple(placed)


def niah(rng, haystack_size: int, *, keys: int = 1, values: int = 1, queries: int = 1, haystack: str = "repeat",
         type_k: str = "words", type_v: str = "numbers", depth: float | None = None, words: Sequence[str] = (),
         filler: str = REPEAT, template: str = NIAH, needle: str = NEEDLE) -> Sample:
  """Needle in a haystack of ``haystack_size`` sentences (``repeat``: RULER's noise, ``filler``; ``needle``: needles
  of other keys): ``keys`` keys, ``values`` values each, ``queries`` of them asked; the answers are the asked keys'
  values. ``words``: the keys and values of kind ``words`` (default RULER's adjective-noun pairs; a small
  vocabulary's own words for a model that has no others); ``template`` and ``needle``: other texts with RULER's
  fields (``{type_v}``, ``{context}``, ``{query}``; ``{type_v}``, ``{key}``, ``{value}``), for a model too small for
  RULER's 70-word prompt."""
  if not 1 <= queries <= keys or values < 1:
    raise ValueError(f"niah: keys={keys}, values={values}, queries={queries}; need 1 <= queries <= keys, values >= 1")
  if haystack not in ("repeat", "needle"):
    raise ValueError(f"niah: haystack={haystack!r}; allowed: ['repeat', 'needle']")
  key_list = _distinct(rng, type_k, keys, words=words)
  value_lists: list[list[str]] = []
  for _ in key_list:  # every value different from the keys and the other values (one answer, one string)
    value_lists.append(_distinct(rng, type_v, values, {*key_list, *(v for vs in value_lists for v in vs)}, words))
  needles = [needle.format(type_v=type_v, key=k, value=v) for k, vs in zip(key_list, value_lists) for v in vs]
  needles = [needles[i] for i in rng.permutation(len(needles))]
  if haystack == "repeat":
    sentences = [filler] * haystack_size
  else:  # distractors: needles of keys never asked
    fillers_k = _distinct(rng, type_k, haystack_size, set(key_list), words)
    sentences = [needle.format(type_v=type_v, key=k, value=_distinct(rng, type_v, 1, words=words)[0])
                 for k in fillers_k]
  context, placed = _insert(rng, sentences, needles, depth)
  asked = sorted(int(i) for i in rng.choice(keys, size=queries, replace=False))
  query = ", ".join(key_list[i] for i in asked[:-1]) + ", and " + key_list[asked[-1]] if queries > 1 else \
      key_list[asked[0]]
  label = type_v
  if queries * values == 1:  # one answer: RULER's singular wording
    template = template.replace("Some", "A").replace("are all", "is").replace("are", "is")
    label = type_v[:-1]
  prompt = template.format(type_v=label, context="\n".join(context), query=query)
  return Sample(prompt, tuple(v for i in asked for v in value_lists[i]), placed)


def variable_tracking(rng, haystack_size: int, *, chains: int = 1, hops: int = 4) -> Sample:
  """``chains`` chains of ``hops`` assignments among ``repeat`` sentences; the answers are the first chain's
  variables."""
  if chains < 1 or hops < 1:
    raise ValueError(f"variable_tracking: chains={chains}, hops={hops}; both must be >= 1")
  names: list[str] = []
  while len(names) < chains * (hops + 1):
    name = "".join(string.ascii_uppercase[i] for i in rng.integers(26, size=5))
    if name not in names:
      names.append(name)
  groups = [names[i * (hops + 1):(i + 1) * (hops + 1)] for i in range(chains)]
  values: list[str] = []
  while len(values) < chains:  # RULER's 5-digit values, one per chain
    value = _number(rng, 5)
    values += [value] if value not in values else []
  sentences = [REPEAT] * haystack_size
  for group, value in zip(groups, values):  # each chain in order, at uniform positions
    lines = [f"VAR {group[0]} = {value}."] + [f"VAR {group[j + 1]} = VAR {group[j]}." for j in range(hops)]
    sentences, _ = _insert(rng, sentences, lines, None)
  prompt = VARIABLES.format(context="\n".join(sentences), query=values[0], count=hops + 1)
  return Sample(prompt, tuple(groups[0]), tuple(i for i, s in enumerate(sentences) if s.startswith("VAR ")))


def common_words(rng, size: int, *, common: int = 10, common_times: int = 30, rare_times: int = 3) -> Sample:
  """A numbered list of ``size`` different words (RULER's ``num_words``), ``common`` of them ``common_times`` times
  each and the others ``rare_times``, shuffled, on one line as RULER's ``1. w 2. w ...``; the answers are the common
  words (RULER's few-shot example before the question is left out)."""
  if size <= common:
    raise ValueError(f"common_words: size={size} different words, more than common={common} needed")
  pool = _distinct(rng, "words", size)
  words = pool[:common] * common_times + pool[common:] * rare_times
  words = [words[i] for i in rng.permutation(len(words))]
  context = " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))
  return Sample(COMMON.format(context=context), tuple(pool[:common]))


def frequent_words(rng, size: int, *, alpha: float = 2.0, vocabulary: int = 1000) -> Sample:
  """``size`` coded words (6 random lowercase letters each, ``vocabulary`` of them, drawn with Zipf weights
  ``1 / rank ** alpha``) separated by RULER's " .... "; the answers are the 3 most frequent."""
  codes: list[str] = []
  while len(codes) < vocabulary:
    code = "".join(string.ascii_lowercase[i] for i in rng.integers(26, size=6))
    if code not in codes:
      codes.append(code)
  weights = 1.0 / np.arange(1, vocabulary + 1) ** alpha
  drawn = rng.choice(vocabulary, size=size, p=weights / weights.sum())
  counts = np.bincount(drawn, minlength=vocabulary)
  top = [codes[i] for i in np.argsort(-counts, kind="stable")[:3]]
  context = " .... ".join(codes[i] for i in drawn)
  return Sample(FREQUENT.format(context=context), tuple(top))


def fit(make: Callable[[int], Sample], count: Callable[[str], int], max_tokens: int, *, low: int = 1,
        high: int = 1 << 20) -> tuple[int, Sample]:
  """``(size, sample)``: the largest haystack size in ``[low, high]`` whose ``make(size)``'s prompt has at most
  ``max_tokens`` tokens by ``count`` (RULER's binary search; ``make`` draws with a fixed seed per call, so a size
  always gives the same sample). Raises when even ``low`` does not fit."""
  best = None
  while low <= high:
    mid = (low + high) // 2
    sample = make(mid)
    if count(sample.prompt) <= max_tokens:
      best, low = (mid, sample), mid + 1
    else:
      high = mid - 1
  if best is None:
    raise ValueError(f"no haystack fits {max_tokens} tokens: the smallest prompt is longer")
  return best


def _check(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> None:
  if len(predictions) != len(references) or not predictions:
    raise ValueError(f"{len(predictions)} predictions for {len(references)} references; both must be the same "
                     "non-zero number")


def string_match_all(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
  """RULER's score (%, 2 decimals): per sample the share of its references found in its prediction
  (case-insensitive), averaged over the samples."""
  _check(predictions, references)
  score = sum(sum(r.lower() in p.lower() for r in refs) / len(refs) for p, refs in zip(predictions, references))
  return round(100.0 * score / len(predictions), 2)


def string_match_part(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
  """RULER's QA score (%, 2 decimals): per sample 1 if any of its references is in its prediction."""
  _check(predictions, references)
  score = sum(max(r.lower() in p.lower() for r in refs) for p, refs in zip(predictions, references))
  return round(100.0 * score / len(predictions), 2)
