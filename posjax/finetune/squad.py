"""SQuAD v1.1 (Rajpurkar et al. 2016): examples from the official JSON files or TFDS, windowed features with
answer labels, and predictions mapped back to the context's own characters.

Features follow BERT's recipe: ``[CLS] question [SEP] context window [SEP]``, the question cut to
``max_query_len`` tokens, the context split into windows of the remaining room every ``doc_stride`` tokens.
A window that holds the whole answer labels its first and last tokens; any other window labels [CLS] (index
0). The tokenizer's character offsets are kept for every context token, so a predicted span is read from the
original context text (accents, case and punctuation intact). Training examples whose answer text is not at its
``answer_start`` are skipped, as BERT skips them (:func:`training_examples`). Predictions: BERT's n-best search
over every window of an example, a start scored only in the window where it has the most context
(:func:`n_best_answers`), the best as ``{id: text}`` (the format of the official evaluation script; score with
:func:`posjax.finetune.metrics.squad`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Iterator, Mapping, Sequence

import numpy as np

from posjax.data.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class Example:
  id: str
  question: str
  context: str
  answers: tuple[str, ...]
  answer_starts: tuple[int, ...]  # character offsets in context


@dataclasses.dataclass
class Window:
  example_id: str
  input_ids: np.ndarray  # [max_len]
  token_type_ids: np.ndarray
  attention_mask: np.ndarray
  offsets: list  # per position: (char start, char end) in the context, or None outside the context
  start_position: int  # the answer's first token, 0 ([CLS]) when the window does not hold it
  end_position: int
  max_context: list  # per position: whether this window is the one with the most context around that token


def json_examples(path: str) -> Iterator[Example]:
  """The official format: ``{"data": [{"paragraphs": [{"context", "qas": [{"id", "question", "answers"}]}]}]}``."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"SQuAD file {path} does not exist")
  try:
    with open(path, encoding="utf-8") as f:
      articles = json.load(f)["data"]
    for article in articles:
      for paragraph in article["paragraphs"]:
        for qa in paragraph["qas"]:
          yield Example(str(qa["id"]), qa["question"], paragraph["context"],
                        tuple(a["text"] for a in qa["answers"]), tuple(int(a["answer_start"]) for a in qa["answers"]))
  except (json.JSONDecodeError, KeyError, TypeError) as error:
    raise ValueError(f"SQuAD file {path} is not in the official v1.1 format ({type(error).__name__}: {error})") from None


def tfds_examples(split: str, data_dir: str | None = None) -> Iterator[Example]:
  """The examples of a split of TFDS's ``squad/v1.1`` (prepared beforehand: it never downloads)."""
  import tensorflow_datasets as tfds  # imported here: TensorFlow is slow to load

  dataset = tfds.load("squad/v1.1", split=split, data_dir=data_dir or None, shuffle_files=False, download=False)
  for ex in tfds.as_numpy(dataset):
    text = lambda value: value.decode("utf-8") if isinstance(value, bytes) else str(value)  # noqa: E731
    yield Example(text(ex["id"]), text(ex["question"]), text(ex["context"]),
                  tuple(text(a) for a in ex["answers"]["text"]), tuple(int(s) for s in ex["answers"]["answer_start"]))


def windows(tokenizer: Tokenizer, example: Example, *, max_len: int, doc_stride: int = 128,
            max_query_len: int = 64, causal: bool = False) -> list[Window]:
  """The example's features; labels from its first answer (SQuAD's training answers are single). ``causal``: each
  context token is predicted from the window where it has the most context to its left, the only side a causal
  model reads (:func:`_max_context_windows`)."""
  question = tokenizer.encode(example.question)[:max_query_len]
  room = max_len - len(question) - 3
  if room <= 0:
    raise ValueError(f"question {example.id!r}: {len(question)} tokens leave no room for context in max_len={max_len}")
  if doc_stride <= 0:
    raise ValueError(f"doc_stride={doc_stride} must be positive")
  encoding = tokenizer.backend.encode(example.context, add_special_tokens=False)
  context, offsets = encoding.ids, encoding.offsets
  answer = None
  if example.answers:
    start_char = example.answer_starts[0]
    answer = (start_char, start_char + len(example.answers[0]))
  starts = [0]
  while starts[-1] + room < len(context):
    starts.append(starts[-1] + min(doc_stride, room))
  spans = [range(start, min(start + room, len(context))) for start in starts]
  best = _max_context_windows(spans, len(context), causal)
  features = []
  for number, span in enumerate(spans):
    ids = [tokenizer.cls_id, *question, tokenizer.sep_id, *(context[i] for i in span), tokenizer.sep_id]
    first = len(question) + 2  # position of the window's first context token
    position_offsets = [None] * first + [offsets[i] for i in span] + [None]
    start_position = end_position = 0
    if answer is not None:
      inside = [p for p in range(first, first + len(span)) if position_offsets[p][1] > answer[0]
                and position_offsets[p][0] < answer[1]]
      if inside and offsets[span[0]][0] <= answer[0] and offsets[span[-1]][1] >= answer[1]:
        start_position, end_position = inside[0], inside[-1]
    pad = max_len - len(ids)
    max_context = [False] * first + [best[i] == number for i in span] + [False] * (pad + 1)
    features.append(Window(example.id, np.asarray(ids + [tokenizer.pad_id] * pad, np.int32),
                           np.asarray([0] * first + [1] * (len(ids) - first) + [0] * pad, np.int32),
                           np.asarray([1] * len(ids) + [0] * pad, np.int32), position_offsets + [None] * pad,
                           start_position, end_position, max_context))
  return features


def _max_context_windows(spans: Sequence[range], tokens: int, causal: bool = False) -> list[int]:
  """Per context token, the window where it has the most context: the highest min(tokens left of it, tokens right
  of it) + 0.01 x window length, the first on a tie (BERT's ``_check_is_max_context``); ``causal``: the most tokens
  left of it (a causal model reads no others)."""
  best, scores = [0] * tokens, [-1.0] * tokens
  for number, span in enumerate(spans):
    for i in span:
      left = i - span.start
      score = (left if causal else min(left, span.stop - 1 - i)) + 0.01 * len(span)
      if score > scores[i]:
        best[i], scores[i] = number, score
  return best


WHITESPACE = " \t\r\n\u202f"  # BERT's run_squad splits the context into words on these


def answer_at_start(example: Example) -> bool:
  """Whether the first answer's text lies in the context's words from ``answer_start`` on (BERT's check on
  training examples: the whitespace words the answer's characters fall in, joined by spaces, contain the
  answer's words)."""
  if not example.answers:
    return False
  word_of, words, previous_space = [], [], True
  for ch in example.context:
    if ch in WHITESPACE:
      previous_space = True
    else:
      if previous_space:
        words.append("")
      words[-1] += ch
      previous_space = False
    word_of.append(len(words) - 1)
  start, text = example.answer_starts[0], example.answers[0]
  end = start + len(text) - 1
  if not text or not 0 <= start <= end < len(example.context):
    return False
  found = " ".join(words[max(word_of[start], 0):word_of[end] + 1])
  return " ".join(text.split()) in found


def training_examples(examples: Sequence[Example]) -> tuple[list[Example], int]:
  """The examples whose answer is where ``answer_start`` says, and how many were skipped (BERT skips them)."""
  kept = [e for e in examples if answer_at_start(e)]
  return kept, len(examples) - len(kept)


def n_best_answers(examples: Mapping[str, Example], features: Sequence[Window], start_logits: Sequence[np.ndarray],
                   end_logits: Sequence[np.ndarray], *, n_best: int = 20, max_answer_len: int = 30
                   ) -> dict[str, list[dict]]:
  """``{id: [{text, probability, start_logit, end_logit}, ...]}``: up to ``n_best`` distinct answers of each
  example, best first (BERT's ``run_squad`` and Hugging Face's SQuAD pipeline): in every window the ``n_best``
  highest start and end logits over its tokens, then only pairs inside the context, with the start in the
  window where it has the most context, the end not before it and at most ``max_answer_len`` tokens; candidates
  of all windows ranked by start + end logit, duplicates of a text dropped, probabilities a softmax over the
  kept scores. Logits beyond a window's tokens (batch padding) are never read, so the answers do not depend on
  how the windows were batched. An example without a candidate gets the empty answer."""
  candidates: dict[str, list[tuple[float, float, float, str]]] = {e: [] for e in examples}
  for feature, starts, ends in zip(features, start_logits, end_logits, strict=True):
    length = int(feature.attention_mask.sum())
    context = examples[feature.example_id].context
    top_starts = sorted(range(length), key=lambda p: -starts[p])[:n_best]
    top_ends = sorted(range(length), key=lambda p: -ends[p])[:n_best]
    for s in top_starts:
      if feature.offsets[s] is None or not feature.max_context[s]:
        continue
      for e in top_ends:
        if feature.offsets[e] is not None and s <= e < s + max_answer_len:
          text = context[feature.offsets[s][0]:feature.offsets[e][1]]
          candidates[feature.example_id].append((float(starts[s] + ends[e]), float(starts[s]), float(ends[e]), text))
  out = {}
  for example_id, found in candidates.items():
    kept, seen = [], set()
    for score, start, end, text in sorted(found, key=lambda c: -c[0]):  # stable: earlier windows first on a tie
      if text not in seen:
        seen.add(text)
        kept.append((score, start, end, text))
      if len(kept) == n_best:
        break
    if not kept:
      kept = [(0.0, 0.0, 0.0, "")]
    scores = np.asarray([k[0] for k in kept])
    probabilities = np.exp(scores - scores.max())
    probabilities /= probabilities.sum()
    out[example_id] = [{"text": text, "probability": float(p), "start_logit": start, "end_logit": end}
                       for (_, start, end, text), p in zip(kept, probabilities)]
  return out


def predictions(examples: Mapping[str, Example], features: Sequence[Window], start_logits: Sequence[np.ndarray],
                end_logits: Sequence[np.ndarray], *, n_best: int = 20, max_answer_len: int = 30) -> dict[str, str]:
  """``{id: answer text}``: the best of :func:`n_best_answers` (the official evaluation script's input)."""
  found = n_best_answers(examples, features, start_logits, end_logits, n_best=n_best, max_answer_len=max_answer_len)
  return {example_id: answers[0]["text"] for example_id, answers in found.items()}
