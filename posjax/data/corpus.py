"""Text corpora as streams of documents (each a list of sentences), from TFDS or local text files.

Local files: a glob; documents are separated by blank lines and every other line is a sentence.
TFDS: any text data set by name (``wikipedia/20190301.en``, ``c4/en``, ``lm1b``, ...) with an optional
``data_dir``; each example's text field is one document, its lines the sentences.
Each process of a multi-host run reads only its own shard: every ``shard_count``-th document.
"""

from __future__ import annotations

import glob
import itertools
from typing import Iterator

Document = list[str]


def text_documents(pattern: str) -> Iterator[Document]:
  files = sorted(glob.glob(pattern))
  if not files:
    raise FileNotFoundError(f"no text files match {pattern!r}")
  for path in files:
    document: Document = []
    with open(path, encoding="utf-8") as f:
      for line in f:
        line = line.strip()
        if line:
          document.append(line)
        elif document:
          yield document
          document = []
    if document:
      yield document


def tfds_documents(name: str, split: str, data_dir: str | None = None, text_key: str = "text") -> Iterator[Document]:
  import tensorflow_datasets as tfds  # imported here: TensorFlow is slow to load and only this source needs it

  dataset = tfds.load(name, split=split, data_dir=data_dir, shuffle_files=False)
  for example in tfds.as_numpy(dataset):
    if text_key not in example:
      raise KeyError(f"TFDS data set {name!r} has no field {text_key!r}; fields: {sorted(example)}")
    text = example[text_key]
    text = text.decode("utf-8") if isinstance(text, bytes) else str(text)
    document = [line.strip() for line in text.split("\n") if line.strip()]
    if document:
      yield document


def documents(data_config, split: str, shard_index: int = 0, shard_count: int = 1) -> Iterator[Document]:
  """The documents of ``split`` (``train`` or ``eval``) for one process, as ``data_config`` describes."""
  if data_config.source == "text":
    pattern = data_config.train_files if split == "train" else data_config.eval_files
    if not pattern:
      raise ValueError(f"data.source='text' needs data.{split}_files (a glob of text files)")
    stream = text_documents(pattern)
  elif data_config.source == "tfds":
    if not data_config.tfds_name:
      raise ValueError("data.source='tfds' needs data.tfds_name")
    tfds_split = data_config.train_split if split == "train" else data_config.eval_split
    stream = tfds_documents(data_config.tfds_name, tfds_split, data_config.get("data_dir"),
                            data_config.get("text_key", "text"))
  else:
    raise ValueError(f"unknown data.source {data_config.source!r}; allowed: 'text', 'tfds'")
  return itertools.islice(stream, shard_index, None, shard_count)
