"""SQuAD v1.1 (Rajpurkar et al. 2016): examples from the official JSON files or TFDS, windowed features with
answer labels, and predictions mapped back to the context's own characters.

Features follow BERT's recipe: ``[CLS] question [SEP] context window [SEP]``, the question cut to
``max_query_len`` tokens, the context split into windows of the remaining room every ``doc_stride`` tokens.
A window that holds the whole answer labels its first and last tokens; any other window labels [CLS] (index
0). The tokenizer's character offsets are kept for every context token, so a predicted span is read from the
original context text (accents, case and punctuation intact). Predictions: the best of the ``n_best`` start
and end candidates of every window of an example, at most ``max_answer_len`` tokens long, as ``{id: text}``
(the format of the official evaluation script; score with :func:`posjax.finetune.metrics.squad`).
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
  import tensorflow_datasets as tfds  # imported here: TensorFlow is slow to load

  dataset = tfds.load("squad/v1.1", split=split, data_dir=data_dir or None, shuffle_files=False, download=False)
  for ex in tfds.as_numpy(dataset):
    text = lambda value: value.decode("utf-8") if isinstance(value, bytes) else str(value)  # noqa: E731
    yield Example(text(ex["id"]), text(ex["question"]), text(ex["context"]),
                  tuple(text(a) for a in ex["answers"]["text"]), tuple(int(s) for s in ex["answers"]["answer_start"]))


def windows(tokenizer: Tokenizer, example: Example, *, max_len: int, doc_stride: int = 128,
            max_query_len: int = 64) -> list[Window]:
  """The example's features; labels from its first answer (SQuAD's training answers are single)."""
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
  features = []
  for start in starts:
    span = range(start, min(start + room, len(context)))
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
    features.append(Window(example.id, np.asarray(ids + [tokenizer.pad_id] * pad, np.int32),
                           np.asarray([0] * first + [1] * (len(ids) - first) + [0] * pad, np.int32),
                           np.asarray([1] * len(ids) + [0] * pad, np.int32), position_offsets + [None] * pad,
                           start_position, end_position))
  return features


def predictions(examples: Mapping[str, Example], features: Sequence[Window], start_logits: np.ndarray,
                end_logits: np.ndarray, *, n_best: int = 20, max_answer_len: int = 30) -> dict[str, str]:
  """``{id: answer text}``: the best-scoring span (start + end logit) over every window of each example."""
  best: dict[str, tuple[float, str]] = {}
  for feature, starts, ends in zip(features, start_logits, end_logits, strict=True):
    context = examples[feature.example_id].context
    valid = [p for p, o in enumerate(feature.offsets) if o is not None]
    top_starts = sorted(valid, key=lambda p: -starts[p])[:n_best]
    top_ends = sorted(valid, key=lambda p: -ends[p])[:n_best]
    for s in top_starts:
      for e in top_ends:
        if s <= e < s + max_answer_len:
          score = float(starts[s] + ends[e])
          if feature.example_id not in best or score > best[feature.example_id][0]:
            best[feature.example_id] = (score, context[feature.offsets[s][0]:feature.offsets[e][1]])
  return {example_id: best[example_id][1] if example_id in best else "" for example_id in examples}
