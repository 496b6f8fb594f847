"""Masked-LM examples: packing sentences into blocks, BERT masking, and a resumable batch iterator.

Packing modes (``packing=``):

- ``full_sentence`` (the papers' RoBERTa-style packing): one [CLS] at position 0 of each block, then the
  sentences of consecutive documents, each followed by [SEP] (an extra [SEP] ends a document), up to
  ``max_len``; all tokens of a block attend to each other.
- ``documents``: every document starts with its own [CLS] at position 0 and gets its own ``segment_ids``
  and ``positions``, so it never attends to another document in the same block (a document longer than a
  block continues in the next one, again behind a [CLS]).
- ``stream`` (GPT-style decoders: nanoGPT, MaxText, levanter): the documents' tokens joined into one stream, each
  document followed by the end-of-document token (the tokenizer's [SEP], or a Hugging Face model's eos; its bos
  first where its tokenizer adds one), cut into full rows of ``max_len``: no
  [CLS], no padding (but in the stream's last row); positions ``0..L-1``, every token attends across documents.
- ``stream_documents``: the same rows, with ``segment_ids`` and ``positions`` restarting at each document, so a
  token attends only to its own document (a document cut by a row boundary continues at position 0).

Batches are dicts of numpy arrays: ``input_ids``, ``attention_mask``, ``positions``, ``segment_ids``
(``[B, L]``; padding has segment 0) and ``masked_positions``, ``masked_labels``, ``masked_weights``
(``[B, P]``). Masking of block ``k`` draws from ``default_rng([seed, shard, k])``, so the batches depend only
on the seed, and a restored iterator (``state()`` / ``restore()``) continues exactly where it stopped.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Iterable, Iterator

import numpy as np
from absl import logging

from posjax.data.tokenizer import Tokenizer

PACKINGS = ("full_sentence", "documents", "stream", "stream_documents")
SLOW_RESTORE_BLOCKS = 100_000  # a streaming restore this long says so


def _block(tokens: list[int], segments: list[int], positions: list[int], max_len: int, pad_id: int) -> dict:
  n = len(tokens)
  pad = max_len - n
  return {
      "input_ids": np.asarray(tokens + [pad_id] * pad, np.int32),
      "attention_mask": np.asarray([1] * n + [0] * pad, np.int32),
      "segment_ids": np.asarray(segments + [0] * pad, np.int32),
      "positions": np.asarray(positions + [0] * pad, np.int32),
  }


def pack_full_sentences(token_docs: Iterable[list[list[int]]], max_len: int, cls_id: int, sep_id: int,
                        pad_id: int) -> Iterator[dict]:
  """RoBERTa FULL-SENTENCES: ``[CLS] s1 [SEP] s2 [SEP] ... [SEP]`` across document boundaries."""
  block = [cls_id]

  def emit():
    return _block(block, [1] * len(block), list(range(len(block))), max_len, pad_id)

  for document in token_docs:
    for sentence in document:
      pieces = sentence + [sep_id]
      while pieces:
        room = max_len - len(block)
        if len(pieces) <= room:
          block, pieces = block + pieces, []
        elif len(block) > 1:  # the sentence starts the next block
          yield emit()
          block = [cls_id]
        else:  # a sentence longer than a whole block is split
          block, pieces = block + pieces[:room], pieces[room:]
          yield emit()
          block = [cls_id]
    if 1 < len(block) < max_len:
      block.append(sep_id)
  if len(block) > 1:
    yield emit()


def pack_documents(token_docs: Iterable[list[list[int]]], max_len: int, cls_id: int, sep_id: int,
                   pad_id: int) -> Iterator[dict]:
  """Isolated documents: each (piece of a) document is a segment that starts with [CLS] at position 0."""
  tokens, segments, positions = [], [], []
  for document in token_docs:
    flat = [t for sentence in document for t in sentence + [sep_id]]
    pieces = [[cls_id] + flat[i:i + max_len - 1] for i in range(0, len(flat), max_len - 1)]
    for piece in pieces:
      if len(tokens) + len(piece) > max_len:
        yield _block(tokens, segments, positions, max_len, pad_id)
        tokens, segments, positions = [], [], []
      segment = (segments[-1] + 1) if segments else 1
      tokens += piece
      segments += [segment] * len(piece)
      positions += list(range(len(piece)))
  if tokens:
    yield _block(tokens, segments, positions, max_len, pad_id)


def pack_stream(token_docs: Iterable[list[list[int]]], max_len: int, cls_id: int, sep_id: int, pad_id: int,
                first: tuple[int, ...] = (), apart: bool = False) -> Iterator[dict]:
  """Full rows cut from one token stream, each document ``first`` (the ids its tokenizer puts first: a Hugging
  Face model's bos, where it adds one) then its tokens then ``sep_id`` (its end-of-document token); no [CLS]
  (``cls_id`` unused). ``apart``: segment ids and positions per document within each row."""
  del cls_id
  tokens, segments, positions = [], [], []
  for document in token_docs:
    flat = list(first) + [t for sentence in document for t in sentence] + [sep_id]
    while flat:
      take = flat[:max_len - len(tokens)]
      flat = flat[len(take):]
      segment = (segments[-1] + 1) if segments and apart else 1
      start = 0 if apart else len(tokens)
      tokens += take
      segments += [segment] * len(take)
      positions += list(range(start, start + len(take)))
      if len(tokens) == max_len:
        yield _block(tokens, segments, positions, max_len, pad_id)
        tokens, segments, positions = [], [], []
  if tokens:
    yield _block(tokens, segments, positions, max_len, pad_id)


def packer(packing: str) -> Callable[..., Iterator[dict]]:
  """The packing function of a mode (:data:`PACKINGS`): ``(token_docs, max_len, cls_id, sep_id, pad_id) -> blocks``."""
  if packing not in PACKINGS:
    raise ValueError(f"unknown packing {packing!r}; allowed: {list(PACKINGS)}")
  return {"full_sentence": pack_full_sentences, "documents": pack_documents, "stream": pack_stream,
          "stream_documents": lambda *args, **kw: pack_stream(*args, **kw, apart=True)}[packing]


def pack_tokens(packing: str, token_docs: Iterable[list[list[int]]], max_len: int,
                tokenizer: Tokenizer) -> Iterator[dict]:
  """The blocks of ``packing`` from tokenized documents with ``tokenizer``'s special ids: [CLS] and [SEP] (a
  Hugging Face decoder's tokenizer: its bos and eos), and under the stream packings its documents' own first ids
  (:attr:`posjax.data.tokenizer.Tokenizer.start_ids`); a role the packing needs and the tokenizer lacks is an
  error."""
  pack = packer(packing)
  if packing.startswith("stream"):
    tokenizer.need("sep", purpose=f"packing={packing!r} (its end-of-document token: eos or [SEP])")
    return pack(token_docs, max_len, tokenizer.cls_id, tokenizer.sep_id, tokenizer.pad_id,
                first=tuple(tokenizer.start_ids))
  tokenizer.need("cls", "sep", purpose=f"packing={packing!r} (a row's first token and a sentence's last: [CLS] / "
                                       "bos and [SEP] / eos)")
  return pack(token_docs, max_len, tokenizer.cls_id, tokenizer.sep_id, tokenizer.pad_id)


# Packings whose segment ids keep documents apart (the model reads them; the others' rows attend across).
SEPARATE_DOCUMENTS = ("documents", "stream_documents")


# How the masked positions of a block are chosen (``data.mask_selection``, :func:`mask_block`).
SELECTIONS = ("permutation", "electra")


@dataclasses.dataclass(frozen=True)
class Masking:
  """What masking does: ``rate`` of the real non-special tokens (or ``whole_word`` s) are chosen, of which
  ``mask_token`` become [MASK], ``random_token`` a random token and the rest stay. BERT: 0.8 / 0.1 (the default);
  ELECTRA (Clark et al. 2020, the official ``pretrain_helpers.mask``): 0.85 / 0.0. ``selection``: how the positions
  are chosen (:func:`mask_block`): ``permutation`` (BERT's ``create_pretraining_data.py``: distinct positions,
  ``round(rate x candidates)`` of them) or ``electra`` (the official ELECTRA code's: drawn with replacement,
  ``round(rate x real tokens)`` draws, [CLS] and [SEP] counted). Fields of ``config.data``: ``mask_rate``,
  ``whole_word_masking``, ``mask_token_rate``, ``random_token_rate``, ``mask_selection``."""
  rate: float = 0.15
  whole_word: bool = False
  mask_token: float = 0.8
  random_token: float = 0.1
  selection: str = "permutation"

  def __post_init__(self):
    if not 0.0 < self.rate < 1.0:
      raise ValueError(f"data.mask_rate={self.rate} must be in (0, 1)")
    if self.selection not in SELECTIONS:
      raise ValueError(f"data.mask_selection={self.selection!r} is not one of {list(SELECTIONS)}")
    if self.selection == "electra" and self.whole_word:
      raise ValueError("data.whole_word_masking=True takes data.mask_selection='permutation' (ELECTRA's draws "
                       "are of single positions)")
    for field, value in (("mask_token_rate", self.mask_token), ("random_token_rate", self.random_token)):
      if not 0.0 <= value <= 1.0:
        raise ValueError(f"data.{field}={value} must be in [0, 1]")
    if self.mask_token + self.random_token > 1.0:
      raise ValueError(f"data.mask_token_rate + data.random_token_rate = {self.mask_token + self.random_token} "
                       "must be at most 1 (the rest of the chosen tokens stay as they are)")

  @classmethod
  def from_config(cls, data) -> "Masking":
    return cls(data.mask_rate, data.whole_word_masking, data.get("mask_token_rate", 0.8),
               data.get("random_token_rate", 0.1), data.get("mask_selection", "permutation"))


def mask_block(block: dict, rng: np.random.Generator, tokenizer: Tokenizer, max_predictions: int,
               masking: Masking = Masking()) -> dict:
  """Masking (:class:`Masking`) of one block: the masked positions (``[P]``, padded with weight 0) and the block
  with its chosen tokens replaced. The draws, in order:

  - ``permutation``: a permutation of the words (the real non-special tokens, or whole words); the first that fit
    ``min(max_predictions, max(1, round(rate * candidates)))`` are chosen.
  - ``electra``: ``min(max_predictions, max(1, round(rate * real tokens)))`` positions drawn uniformly with
    replacement from the real tokens but [CLS], [SEP] and [MASK], in draw order (ELECTRA's
    ``tf.random.categorical``); a position drawn twice is predicted twice (the generator's loss counts it twice).

  Then one uniform and one random token per draw: a uniform below ``mask_token`` makes [MASK] (a position drawn
  twice: if either says so), one in the next ``random_token`` a random token."""
  ids = block["input_ids"].copy()
  real = block["attention_mask"].astype(bool)
  electra = masking.selection == "electra"
  # ELECTRA's ``_get_candidates_mask`` leaves out [CLS], [SEP] and [MASK] only: [UNK] can be masked there.
  never = [tokenizer.cls_id, tokenizer.sep_id, tokenizer.mask_id] if electra else tokenizer.special_array
  candidates = np.flatnonzero(real & ~np.isin(ids, never))
  if electra:  # the official count: tf.round of float32 real tokens times the rate (29 of 190 at 15%, not 28)
    wanted = int(np.round(np.float32(real.sum()) * np.float32(masking.rate)))
  else:
    wanted = round(len(candidates) * masking.rate)
  budget = min(max_predictions, max(1, wanted)) if len(candidates) else 0
  if electra:
    chosen = candidates[rng.integers(0, len(candidates), budget)] if budget else np.zeros(0, np.int64)
  elif masking.whole_word:
    chosen = _whole_words(ids, candidates, budget, rng, tokenizer)
  else:  # every candidate is a word: the first ``budget`` of the permutation
    chosen = np.sort(candidates[rng.permutation(len(candidates))[:budget]])
  labels = ids[chosen]
  action = rng.random(len(chosen))
  random_tokens = rng.integers(0, tokenizer.vocab_size, len(chosen))
  replace = (action >= masking.mask_token) & (action < masking.mask_token + masking.random_token)
  ids[chosen[replace]] = random_tokens[replace]
  ids[chosen[action < masking.mask_token]] = tokenizer.mask_id
  pad = max_predictions - len(chosen)
  return {**block, "input_ids": ids,
          "masked_positions": np.concatenate([chosen, np.zeros(pad, np.int64)]).astype(np.int32),
          "masked_labels": np.concatenate([labels, np.zeros(pad, labels.dtype)]).astype(np.int32),
          "masked_weights": np.concatenate([np.ones(len(chosen)), np.zeros(pad)]).astype(np.float32)}


def _whole_words(ids, candidates, budget: int, rng: np.random.Generator, tokenizer: Tokenizer) -> np.ndarray:
  """Positions of the whole words chosen: words in permutation order, each taken if it still fits."""
  words: list[list[int]] = []
  for i in candidates:
    if words and words[-1][-1] == i - 1 and tokenizer.continues_word(int(ids[i])):
      words[-1].append(int(i))
    else:
      words.append([int(i)])
  chosen: list[int] = []
  for w in rng.permutation(len(words)):
    if len(chosen) >= budget:
      break
    if len(chosen) + len(words[w]) <= budget:
      chosen += words[w]
  return np.asarray(sorted(chosen), np.int64)


def default_max_predictions(max_len: int, masking: Masking) -> int:
  """The masked positions per block when none is given: ``rate`` of ``max_len``, rounded up (at least 1), so no
  block's masking is cut short; under ``selection="electra"`` the official ``max_predictions_per_seq``,
  ``int((rate + 0.005) * max_len)`` (79 of 512 at 15%), which caps a block's draws."""
  if masking.selection == "electra":
    return max(1, int((masking.rate + 0.005) * max_len))
  return max(1, math.ceil(max_len * masking.rate))


def example(block: dict, rng: np.random.Generator, tokenizer: Tokenizer, max_predictions: int,
            masking: Masking | None) -> dict:
  """A packed block masked as ``masking`` says (:func:`mask_block`), or as it is where ``masking`` is None (a causal
  language model's input: every token is a label)."""
  return block if masking is None else mask_block(block, rng, tokenizer, max_predictions, masking)


def empty_row(max_len: int, pad_id: int, max_predictions: int, masking: Masking | None) -> dict:
  """A padding row (no token, no masked position) of the examples :func:`example` makes."""
  row = _block([], [], [], max_len, pad_id)
  if masking is not None:
    row.update(masked_positions=np.zeros(max_predictions, np.int32), masked_labels=np.zeros(max_predictions, np.int32),
               masked_weights=np.zeros(max_predictions, np.float32))
  return row


def empty_like(example: dict) -> dict:
  """An all-zero example or batch (padding only, weight 0) shaped like ``example``."""
  return {k: np.zeros_like(v) for k, v in example.items()}


class MlmBatches:
  """An endless (or, with ``repeat=False``, one-pass) iterator of masked batches over a document stream.

  Args:
    documents: a function that returns a fresh stream of this shard's documents (called per epoch).
    tokenizer: text -> ids.
    batch_size: sequences per batch from this shard.
    shard: the shard index (part of the masking seed).
    masking: how the blocks are masked; None: not at all (a causal language model's batches).
  """

  def __init__(self, documents: Callable[[], Iterable[list[str]]], tokenizer: Tokenizer, *, max_len: int,
               batch_size: int, seed: int, packing: str = "full_sentence", masking: Masking | None = Masking(),
               max_predictions: int | None = None, repeat: bool = True, shard: int = 0):
    if packing not in PACKINGS:
      raise ValueError(f"unknown packing {packing!r}; allowed: {list(PACKINGS)}")
    self.documents, self.tokenizer = documents, tokenizer
    self.max_len, self.batch_size, self.seed, self.packing = max_len, batch_size, seed, packing
    self.masking, self.repeat, self.shard = masking, repeat, shard
    self.max_predictions = 0 if masking is None else max_predictions or default_max_predictions(max_len, masking)
    self.blocks_consumed = 0
    self._blocks = self._block_stream()

  def _block_stream(self) -> Iterator[dict]:
    tok = self.tokenizer
    while True:
      token_docs = (tok.encode_document(document) for document in self.documents())
      produced = False
      for block in pack_tokens(self.packing, token_docs, self.max_len, tok):
        produced = True
        yield block
      if not self.repeat:  # a one-pass stream (evaluation) may be empty on some shards
        return
      if not produced:
        raise ValueError(f"shard {self.shard} of the corpus produced no MLM blocks (is it empty, or smaller than "
                         "the number of data shards?)")

  def state(self) -> dict:
    return {"blocks_consumed": self.blocks_consumed}

  def empty(self) -> dict:
    """A batch of padding rows (no token, no masked position), shaped like this iterator's batches."""
    row = empty_row(self.max_len, self.tokenizer.pad_id, self.max_predictions, self.masking)
    return {k: np.stack([v] * self.batch_size) for k, v in row.items()}

  def restore(self, state: dict) -> None:
    """Continue after ``state["blocks_consumed"]`` blocks (re-reads and re-packs them: linear in their number, see
    docs/benchmarks.md; a prepared corpus restores at once)."""
    if int(state["blocks_consumed"]) >= SLOW_RESTORE_BLOCKS:
      logging.warning("resuming shard %d of the streaming corpus re-reads the %d blocks it consumed (about 1 s per "
                      "1,000); a prepared corpus (python -m posjax.data.prepare) resumes at once", self.shard,
                      int(state["blocks_consumed"]))
    self._blocks = self._block_stream()
    for _ in range(int(state["blocks_consumed"])):
      next(self._blocks)
    self.blocks_consumed = int(state["blocks_consumed"])

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    examples = []
    for _ in range(self.batch_size):
      try:
        block = next(self._blocks)
      except StopIteration:
        break
      rng = np.random.default_rng([self.seed, self.shard, self.blocks_consumed])
      examples.append(example(block, rng, self.tokenizer, self.max_predictions, self.masking))
      self.blocks_consumed += 1
    if not examples:
      raise StopIteration
    if len(examples) < self.batch_size:  # the last batch of a one-pass stream: pad with empty rows
      examples += [empty_like(examples[0])] * (self.batch_size - len(examples))
    return {k: np.stack([e[k] for e in examples]) for k in examples[0]}


class ShardedBatches:
  """Batches built from several shard streams, each contributing its rows in shard order.

  A run reads ``num_shards`` document shards however many processes it has: each process owns a
  contiguous range of them, so for a given ``num_shards`` the global batch (and so the training result) does not
  depend on the number of hosts. A restore from a position saved with another number of shards is an error:
  the batches would change.
  """

  def __init__(self, streams: list[MlmBatches], num_shards: int | None = None):
    if not streams:
      raise ValueError("no shard streams")
    self.streams = streams
    self.num_shards = num_shards

  def state(self) -> dict:
    return {"shards": {str(s.shard): s.blocks_consumed for s in self.streams}}

  def empty(self) -> dict:
    parts = [stream.empty() for stream in self.streams]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

  def restore(self, state: dict) -> None:
    consumed = state["shards"]
    if self.num_shards is not None and len(consumed) != self.num_shards:
      raise ValueError(f"the checkpoint's input position is for {len(consumed)} data shards and this run reads "
                       f"{self.num_shards} (data.num_shards; 0 is one per process): its batches would differ from "
                       f"the checkpoint's run. Resume with data.num_shards={len(consumed)} (and a process count that "
                       "divides it)")
    missing = [s.shard for s in self.streams if str(s.shard) not in consumed]
    if missing:
      raise ValueError(f"the saved input position has no entry for shard(s) {missing}; saved: {sorted(consumed)} "
                       "(data.num_shards must stay the same across a restart)")
    for stream in self.streams:
      stream.restore({"blocks_consumed": consumed[str(stream.shard)]})

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    parts, exhausted = [], 0
    for stream in self.streams:
      try:
        parts.append(next(stream))
      except StopIteration:
        exhausted += 1
        parts.append(None)
    if exhausted == len(self.streams):
      raise StopIteration
    template = next(p for p in parts if p is not None)
    parts = [p if p is not None else empty_like(template) for p in parts]
    return {k: np.concatenate([p[k] for p in parts]) for k in template}
