"""GLUE tasks (Wang et al. 2019) as (texts, label) examples, from TFDS or the GLUE distribution's TSV files, and
their encoding as BERT sentence pairs.

Sources, one interface (:func:`examples`):
- ``tfds``: ``glue/<task>`` (``data_dir`` as for any TFDS data set; prepared beforehand with ``tfds build``).
- ``tsv``: the directory the GLUE download script writes (``CoLA/``, ``SST-2/``, ``MRPC/``, ``STS-B/``,
  ``QQP/``, ``MNLI/``, ``QNLI/``, ``RTE/``, ``WNLI/``, each with ``train.tsv`` and ``dev.tsv``; MNLI with
  ``dev_matched.tsv`` and ``dev_mismatched.tsv``). Columns are found by the header's names; CoLA's files have no
  header (source, label, original label, sentence). Read as the references read them: a leading byte-order mark
  is skipped (MRPC's files have one), and QQP's lines with fewer fields than its header are dropped and counted
  (GLUE's preprocessing drops them); a short line of any other task is an error naming it.

Labels are class ids in TFDS's order (MNLI: entailment, neutral, contradiction; QNLI/RTE: entailment,
not_entailment) or, for STS-B, the similarity score. Splits: ``train``, ``validation`` (MNLI:
``validation_matched`` and ``validation_mismatched``).
"""

from __future__ import annotations

import csv
import dataclasses
import os
import sys
from typing import Iterator, Sequence

import numpy as np
from absl import logging

from posjax import results as results_lib
from posjax.data.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class Task:
  """One GLUE task: where its texts and label are in TFDS and in the TSV files, its class names, and its
  validation splits."""
  name: str
  tfds_keys: tuple[str, ...]  # the text fields of glue/<name>, in pair order
  labels: tuple[str, ...] | None  # class names in id order; None: a regression (STS-B)
  tsv_dir: str
  tsv_columns: tuple[str, ...]  # the TSV's text columns, then its label column
  validation_splits: tuple[str, ...] = ("validation",)
  drop_short_rows: bool = False  # rows with fewer fields than the header: dropped (QQP's), else an error
  unordered: bool = False  # the pair means the same in either order (ELECTRA's double_unordered trains on both)

  @property
  def num_labels(self) -> int:
    return 1 if self.labels is None else len(self.labels)


TASKS = {t.name: t for t in [
    Task("cola", ("sentence",), ("0", "1"), "CoLA", ("3", "1")),  # no header: columns by index
    Task("sst2", ("sentence",), ("0", "1"), "SST-2", ("sentence", "label")),
    Task("mrpc", ("sentence1", "sentence2"), ("0", "1"), "MRPC", ("#1 String", "#2 String", "Quality"),
         unordered=True),
    Task("stsb", ("sentence1", "sentence2"), None, "STS-B", ("sentence1", "sentence2", "score"), unordered=True),
    Task("qqp", ("question1", "question2"), ("0", "1"), "QQP", ("question1", "question2", "is_duplicate"),
         drop_short_rows=True),
    Task("mnli", ("premise", "hypothesis"), ("entailment", "neutral", "contradiction"), "MNLI",
         ("sentence1", "sentence2", "gold_label"), ("validation_matched", "validation_mismatched")),
    Task("qnli", ("question", "sentence"), ("entailment", "not_entailment"), "QNLI", ("question", "sentence", "label")),
    Task("rte", ("sentence1", "sentence2"), ("entailment", "not_entailment"), "RTE", ("sentence1", "sentence2", "label")),
    Task("wnli", ("sentence1", "sentence2"), ("0", "1"), "WNLI", ("sentence1", "sentence2", "label")),
]}
SOURCES = ("tfds", "tsv")


def get(name: str) -> Task:
  """The task named ``name`` (``cola``, ``sst2``, ..., ``wnli``); an unknown name is an error that lists them."""
  if name not in TASKS:
    raise ValueError(f"unknown GLUE task {name!r}; allowed: {list(TASKS)}")
  return TASKS[name]


def test_split(validation_split: str) -> str:
  """The test split beside a validation split (``validation_matched`` -> ``test_matched``)."""
  return "test" + validation_split.removeprefix("validation")


def tsv_file(task: Task, split: str, root: str) -> str:
  """The path of a split's TSV file under the GLUE root ``root``: ``train.tsv``, ``dev.tsv`` (MNLI's
  ``dev_matched.tsv`` / ``dev_mismatched.tsv``) or a test split's ``test*.tsv``; another split is an error."""
  if split == "train":
    name = "train.tsv"
  elif split in task.validation_splits:
    name = "dev.tsv" if split == "validation" else f"dev_{split.removeprefix('validation_')}.tsv"
  elif split in map(test_split, task.validation_splits):
    name = f"{split}.tsv"
  else:
    raise ValueError(f"{task.name} has no split {split!r}; allowed: {['train', *task.validation_splits]}")
  return os.path.join(root, task.tsv_dir, name)


def tsv_examples(task: Task, split: str, root: str) -> Iterator[tuple[tuple[str, ...], float | int]]:
  """``(texts, label)`` of a labelled split, from the GLUE download's TSV file (its quirks: the module
  docstring); a missing file is an error naming it."""
  if split != "train" and split not in task.validation_splits:  # test splits have no labels: test_examples
    raise ValueError(f"{task.name} has no split {split!r}; allowed: {['train', *task.validation_splits]}")
  path = tsv_file(task, split, root)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"GLUE {task.name} {split}: no file {path} (data.glue_dir is the directory the GLUE "
                            f"download script writes, holding {task.tsv_dir}/)")
  csv.field_size_limit(sys.maxsize)
  dropped = 0
  # utf-8-sig: the GLUE download's MRPC files start with a byte-order mark (the header reads '\ufeffQuality').
  with open(path, encoding="utf-8-sig", newline="") as f:
    rows = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
    if task.name == "cola":
      columns, first_line, fields = [int(c) for c in task.tsv_columns], 1, 0
    else:
      header = next(rows, None) or []
      missing = [c for c in task.tsv_columns if c not in header]
      if missing:
        raise ValueError(f"{path}: the header has no column(s) {missing}; it has {header}")
      columns, first_line, fields = [header.index(c) for c in task.tsv_columns], 2, len(header)
    for line, row in enumerate(rows, first_line):
      if task.drop_short_rows and len(row) < fields:
        dropped += 1  # GLUE's own QQP preprocessing skips these malformed lines
        continue
      if len(row) <= max(columns):
        raise ValueError(f"{path}:{line}: {len(row)} tab-separated fields, need at least {max(columns) + 1}")
      *texts, label = (row[c] for c in columns)
      yield tuple(texts), _label(task, label, f"{path}:{line}")
  if dropped:
    logging.warning("%s: dropped %d line(s) with fewer than the header's %d fields (as GLUE's preprocessing does)",
                    path, dropped, fields)


def _label(task: Task, value, where: str) -> float | int:
  if task.labels is None:
    try:
      return float(value)
    except ValueError:
      raise ValueError(f"{where}: {task.name} label {value!r} is not a number") from None
  text = value.decode() if isinstance(value, bytes) else str(value)
  if text not in task.labels:
    raise ValueError(f"{where}: {task.name} label {text!r} is not one of {list(task.labels)}")
  return task.labels.index(text)


def tfds_examples(task: Task, split: str, data_dir: str | None = None):
  """``(texts, label)`` of a labelled split of TFDS's ``glue/<task>`` (prepared beforehand: it never
  downloads); a label outside the task's classes is an error."""
  import tensorflow_datasets as tfds  # imported here: TensorFlow is slow to load

  if split != "train" and split not in task.validation_splits:
    raise ValueError(f"{task.name} has no split {split!r}; allowed: {['train', *task.validation_splits]}")
  dataset = tfds.load(f"glue/{task.name}", split=split, data_dir=data_dir or None, shuffle_files=False, download=False)
  for example in tfds.as_numpy(dataset):
    texts = tuple(example[k].decode("utf-8") for k in task.tfds_keys)
    label = example["label"]
    if task.labels is not None:
      if not 0 <= int(label) < len(task.labels):
        raise ValueError(f"glue/{task.name} {split}: label {int(label)} outside 0..{len(task.labels) - 1}")
      yield texts, int(label)
    else:
      yield texts, float(label)


def examples(name: str, split: str, source: str = "tfds", data_dir: str = "") -> Iterator[tuple[tuple[str, ...], float | int]]:
  """``(texts, label)`` pairs of one GLUE task and split; ``data_dir`` is TFDS's directory or the GLUE TSV root."""
  task = get(name)
  if source == "tsv":
    return tsv_examples(task, split, data_dir)
  if source == "tfds":
    return tfds_examples(task, split, data_dir)
  raise ValueError(f"unknown GLUE source {source!r}; allowed: {list(SOURCES)}")


def has_test(name: str, split: str, source: str, data_dir: str = "") -> bool:
  """Whether the test split of ``split`` (a validation split) is there to predict."""
  task, test = get(name), test_split(split)
  if source == "tsv":
    return os.path.isfile(tsv_file(task, test, data_dir))
  import tensorflow_datasets as tfds  # imported here: TensorFlow is slow to load

  # An error here is an error on every process alike (the training split was just read from the same builder).
  return test in tfds.builder(f"glue/{task.name}", data_dir=data_dir or None).info.splits


def test_examples(name: str, split: str, source: str, data_dir: str = "") -> Iterator[tuple[str, tuple[str, ...]]]:
  """``(id, texts)`` of a test split (``test``, MNLI's ``test_matched`` / ``test_mismatched``), without labels.
  The GLUE download's test files all have a header (CoLA's too) and an ``index`` column (QQP's: ``id``)."""
  task = get(name)
  if source == "tfds":
    import tensorflow_datasets as tfds  # imported here: TensorFlow is slow to load

    dataset = tfds.load(f"glue/{task.name}", split=split, data_dir=data_dir or None, shuffle_files=False,
                        download=False)
    for example in tfds.as_numpy(dataset):
      yield str(int(example["idx"])), tuple(example[k].decode("utf-8") for k in task.tfds_keys)
    return
  path = tsv_file(task, split, data_dir)
  csv.field_size_limit(sys.maxsize)
  with open(path, encoding="utf-8-sig", newline="") as f:
    rows = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
    header = next(rows, None) or []
    wanted = ["id" if task.name == "qqp" else "index",
              *(("sentence",) if task.name == "cola" else task.tsv_columns[:-1])]
    missing = [c for c in wanted if c not in header]
    if missing:
      raise ValueError(f"{path}: the header has no column(s) {missing}; it has {header}")
    columns = [header.index(c) for c in wanted]
    for line, row in enumerate(rows, 2):
      if len(row) <= max(columns):
        raise ValueError(f"{path}:{line}: {len(row)} tab-separated fields, need at least {max(columns) + 1}")
      example_id, *texts = (row[c] for c in columns)
      yield example_id, tuple(texts)


SUBMISSION = {"cola": "CoLA", "sst2": "SST-2", "mrpc": "MRPC", "stsb": "STS-B", "qqp": "QQP", "qnli": "QNLI",
              "rte": "RTE", "wnli": "WNLI", "mnli_matched": "MNLI-m", "mnli_mismatched": "MNLI-mm"}


def write_submission(path: str, name: str, ids: Sequence[str], predictions: Sequence) -> None:
  """The GLUE server's file for one task: ``index<TAB>prediction`` lines, labels by name (MNLI, QNLI, RTE) or
  id, STS-B's score as predicted."""
  task = get(name)
  labels = (f"{float(value):.3f}" if task.labels is None else task.labels[int(value)] for value in predictions)
  rows = [f"{example_id}\t{label}\n" for example_id, label in zip(ids, labels, strict=True)]
  results_lib.write_text(path, "index\tprediction\n" + "".join(rows))


def truncate_longest_first(pieces: Sequence[list[int]], budget: int) -> list[list[int]]:
  """Drops tokens from the end of the longest text until all fit in ``budget``; on a tie, from the later text
  (BERT's ``_truncate_seq_pair``)."""
  pieces = [list(p) for p in pieces]
  while sum(map(len, pieces)) > budget:
    longest = max(range(len(pieces)), key=lambda i: (len(pieces[i]), i))
    pieces[longest].pop()
  return pieces


def pair(tokenizer: Tokenizer, pieces: Sequence[list[int]], max_len: int) -> tuple[list[int], list[int]]:
  """Token ids of one or two tokenized texts as ``[CLS] a [SEP]`` or ``[CLS] a [SEP] b [SEP]``, truncated
  longest-first to ``max_len``, and their token types (0, then 1): unpadded."""
  if not 1 <= len(pieces) <= 2:
    raise ValueError(f"one or two texts per example, got {len(pieces)}")
  specials = len(pieces) + 1
  if max_len <= specials:
    raise ValueError(f"max_len={max_len} leaves no room for text beside {specials} special tokens")
  ids, types = [tokenizer.cls_id], [0]
  for segment, piece in enumerate(truncate_longest_first(pieces, max_len - specials)):
    ids += piece + [tokenizer.sep_id]
    types += [segment] * (len(piece) + 1)
  return ids, types


def encode(tokenizer: Tokenizer, texts: Sequence[str], max_len: int) -> dict[str, np.ndarray]:
  """:func:`pair` of the texts, padded to ``max_len``, with the attention mask."""
  ids, types = pair(tokenizer, tokenizer.encode_batch(list(texts)), max_len)
  pad = max_len - len(ids)
  return {"input_ids": np.asarray(ids + [tokenizer.pad_id] * pad, np.int32),
          "token_type_ids": np.asarray(types + [0] * pad, np.int32),
          "attention_mask": np.asarray([1] * len(ids) + [0] * pad, np.int32)}
