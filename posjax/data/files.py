"""The text files a glob names, checked: what the corpora and the vocabulary tool both read."""

from __future__ import annotations

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
