"""Text corpora as streams of documents (each a list of sentences), from TFDS or local text files.

Local files: a glob; documents are separated by blank lines and every other line is a sentence.
TFDS: any text data set by name (``wikipedia/20190301.en``, ``c4/en``, ``lm1b``, ...) with an optional
``data_dir``; each example's text field is one document, its lines the sentences. Training never downloads:
TFDS prepares a data set once, before any run (``tfds build wikipedia/20190301.en --data_dir=DIR``).
Each process of a multi-host run reads only its own shard: every ``shard_count``-th document.
"""

from __future__ import annotations

import itertools
import os
from typing import Iterator, Sequence

from posjax.data import synthetic
from posjax.data.files import text_files

Document = list[str]
SOURCES = ("text", "tfds")


RULE = "a document is a run of non-blank lines, documents are separated by blank lines"


def text_documents(pattern: str, field: str = "data.train_files") -> Iterator[Document]:
  """The documents of the text files ``pattern`` matches, in file-name order: a blank line ends a document, any
  other line is a sentence. No match, a directory, a file that is not UTF-8 or one without a document (empty,
  or blank lines only) is an error that names it."""
  for path in text_files(pattern, field):
    document: Document = []
    found = False
    with open(path, encoding="utf-8") as f:
      for line in _lines(f, path):
        line = line.strip()
        if line:
          document.append(line)
        elif document:
          found = True
          yield document
          document = []
    if document:
      found = True
      yield document
    if not found:
      raise ValueError(f"text file {path} ({field}) holds no document: it is empty or blank lines only ({RULE})")


def _lines(f, path: str) -> Iterator[str]:
  try:
    yield from f
  except UnicodeDecodeError as error:
    raise ValueError(f"text file {path} is not UTF-8 text ({error.reason})") from None


def _check_text_file(path: str, field: str) -> None:
  """A text file holds a document: it has a non-blank line (read up to the first), and is UTF-8 up to there."""
  with open(path, encoding="utf-8") as f:
    if not any(line.strip() for line in _lines(f, path)):
      raise ValueError(f"text file {path} ({field}) holds no document: it is empty or blank lines only ({RULE})")


def tfds_documents(name: str, split: str, data_dir: str | None = None, text_key: str = "text") -> Iterator[Document]:
  """Each example's ``text_key`` field of a prepared TFDS data set as a document, its non-empty lines the
  sentences; a data set not prepared yet is an error that says how to prepare it (training never downloads)."""
  import tensorflow_datasets as tfds  # imported here: TensorFlow is slow to load and only this source needs it

  try:
    dataset = tfds.load(name, split=split, data_dir=data_dir or None, shuffle_files=False, download=False)
  except AssertionError as error:  # TFDS's way of saying the data set is not prepared
    if "could not find data" not in str(error):
      raise
    how = (f"`tfds build {name} --data_dir={data_dir}`" if data_dir else
           f"`tfds build {name}` (into ~/tensorflow_datasets; elsewhere: --data_dir=DIR, and the same "
           "--config.data.data_dir=DIR here)")
    raise FileNotFoundError(f"TFDS data set {name!r} is not prepared{f' in {data_dir}' if data_dir else ''}. TFDS "
                            f"downloads and prepares it once, before training: run {how}") from None
  for example in tfds.as_numpy(dataset):
    if text_key not in example:
      raise ValueError(f"TFDS data set {name!r} has no field {text_key!r} (data.text_key); fields: {sorted(example)}")
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
    stream = text_documents(pattern, f"data.{split}_files")
  elif data_config.source == "tfds":
    if not data_config.tfds_name:
      raise ValueError("data.source='tfds' needs data.tfds_name")
    tfds_split = data_config.train_split if split == "train" else data_config.eval_split
    stream = tfds_documents(data_config.tfds_name, tfds_split, data_config.get("data_dir"),
                            data_config.get("text_key", "text"))
  else:
    raise ValueError(f"unknown data.source {data_config.source!r}; allowed: {list(SOURCES)}")
  return itertools.islice(stream, shard_index, None, shard_count)


def _is_builtin(pattern: str) -> bool:
  return bool(pattern) and os.path.abspath(pattern).startswith(synthetic.BUILTIN_DIR + os.sep)


def check(data_config, splits: Sequence[str], train_shards: Sequence[int] = (0,), num_shards: int = 1) -> None:
  """Fails before a run writes anything: the source is known, every split yields a document (the train split
  in each of ``train_shards`` of ``num_shards``), and runlocal's built-in synthetic corpus (its text files and
  vocabulary) is not mixed with one's own data."""
  if data_config.source not in SOURCES:
    raise ValueError(f"unknown data.source {data_config.source!r}; allowed: {list(SOURCES)}")
  fields = {"vocab_file": _is_builtin(data_config.vocab_file)}
  if data_config.source == "text":
    fields.update({f"{split}_files": _is_builtin(data_config.get(f"{split}_files", "")) for split in splits})
  else:
    fields["tfds_name"] = False
  if data_config.source == "text":  # every file, before a run writes anything: not only the first document's
    for split in splits:
      pattern = data_config.get(f"{split}_files", "")
      for path in text_files(pattern, f"data.{split}_files") if pattern else ():
        _check_text_file(path, f"data.{split}_files")
  builtin = sorted(f for f, is_builtin in fields.items() if is_builtin)
  own = sorted(f for f, is_builtin in fields.items() if not is_builtin)
  if builtin and own:
    raise ValueError(
        f"data.{', data.'.join(builtin)} {'is' if len(builtin) == 1 else 'are'} runlocal's built-in synthetic corpus "
        f"({synthetic.BUILTIN_DIR}) but data.{', data.'.join(own)} {'is' if len(own) == 1 else 'are'} your own: set "
        + " and ".join(f"--config.data.{f}=..." for f in builtin) + " to your data as well" + (
            " (train a vocabulary with python -m posjax.data.vocab)" if "vocab_file" in builtin else "") + (
            ", or --config.eval_every_steps=0 to train without evaluation" if builtin == ["eval_files"] else ""))
  for split in splits:
    for shard in train_shards if split == "train" else (0,):
      count = num_shards if split == "train" else 1
      if next(iter(documents(data_config, split, shard, count)), None) is None:
        where = f"shard {shard} of the {num_shards} data shards (data.num_shards)" if count > 1 else "it"
        raise ValueError(f"the {split} split of the corpus holds no document for {where}")
