"""The text files a glob names, checked: what the corpora and the vocabulary tool both read."""

from __future__ import annotations

import codecs
import glob
import os


def text_files(pattern: str, field: str = "data.train_files") -> list[str]:
  """The files ``pattern`` matches, in name order; no match, or a directory among them, is an error naming
  ``field``."""
  files = sorted(glob.glob(pattern))
  if not files:
    raise FileNotFoundError(f"no text files match {pattern!r} ({field})")
  for path in files:
    if os.path.isdir(path):
      raise IsADirectoryError(f"{field}={pattern!r} matches the directory {path}; give a glob of its text files, "
                              f"e.g. {os.path.join(path, '*.txt')!r}")
  return files


def check_utf8(path: str, field: str) -> None:
  """The whole of ``path`` is UTF-8 text; else a ``ValueError`` naming it, ``field`` and the first bad byte."""
  decoder = codecs.getincrementaldecoder("utf-8")()
  offset = 0  # of the chunk read last
  with open(path, "rb") as f:
    while True:
      chunk = f.read(1 << 20)
      pending = len(decoder.getstate()[0])  # the bytes of a character the last chunk ended inside
      try:
        decoder.decode(chunk, final=not chunk)
      except UnicodeDecodeError as error:
        raise ValueError(f"text file {path} ({field}) is not UTF-8 text ({error.reason} at byte "
                         f"{offset - pending + error.start}); text files are read as UTF-8: convert it first") from None
      if not chunk:
        return
      offset += len(chunk)
