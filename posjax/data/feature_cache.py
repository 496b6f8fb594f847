"""Encoded fine-tuning features, built once and read back by every run: keyed by everything they depend on.

A task's training (or evaluation) features depend on its files, the tokenizer, ``max_len`` and the encoding's
own options; :func:`cached` hashes all of them (file contents, not names or times) into a directory name under
``data.cache_dir``, so a changed vocabulary or file never reads a stale cache, and every run of a sweep with the
same inputs reads the same features. A table is stored as NumPy files (the tokens of all features end to end,
their offsets, one array per scalar field) and read memory-mapped: a process touches only the rows it batches.
A cache is written to a temporary directory and renamed into place, so a reader sees all of it or none.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import uuid
from typing import Callable, Sequence

import numpy as np

VERSION = 1  # of the stored encoding: raise it when the features' meaning changes
TOKEN_FIELDS = ("input_ids", "token_type_ids")


def file_digest(path: str) -> str:
  """The SHA-256 (hex) of a file's contents, read in 1 MiB pieces: cache keys depend on what a file holds, not
  its name or time."""
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      digest.update(chunk)
  return digest.hexdigest()


class Table(Sequence):
  """Stored features: ``table[i]`` is feature ``i`` as a dict of arrays; ``lengths`` their token counts."""

  def __init__(self, path: str):
    load = lambda name: np.load(os.path.join(path, f"{name}.npy"), mmap_mode="r")  # noqa: E731
    with open(os.path.join(path, "fields.json")) as f:
      stored = json.load(f)
    self.fields, self.meta = stored["fields"], stored["meta"]
    self.offsets = np.asarray(load("offsets"))
    self.columns = {name: load(name) for name in self.fields}
    self.lengths = np.diff(self.offsets)

  def __len__(self) -> int:
    return len(self.lengths)

  def __getitem__(self, i: int) -> dict:
    if not 0 <= i < len(self):
      raise IndexError(f"feature {i} of {len(self)}")
    start, stop = self.offsets[i], self.offsets[i + 1]
    return {name: np.asarray(column[start:stop]) if name in TOKEN_FIELDS else column[i][()]
            for name, column in self.columns.items()}


def _write(path: str, features: Sequence[dict], meta: dict) -> None:
  fields = list(features[0])
  np.save(os.path.join(path, "offsets.npy"), np.cumsum([0] + [len(f["input_ids"]) for f in features]))
  for name in fields:
    values = [f[name] for f in features]
    np.save(os.path.join(path, f"{name}.npy"), np.concatenate(values) if name in TOKEN_FIELDS else np.asarray(values))
  with open(os.path.join(path, "fields.json"), "w") as f:
    json.dump({"fields": fields, "meta": meta}, f)


def cached(directory: str, key: dict, build: Callable[[], tuple[list[dict], dict]]) -> tuple[Sequence[dict], dict]:
  """``(features, meta)``: read from ``directory`` under ``key``'s hash, or ``build()`` and stored there; with no
  ``directory``, built in memory."""
  if not directory:
    return build()
  name = hashlib.sha256(json.dumps({**key, "version": VERSION}, sort_keys=True).encode()).hexdigest()[:32]
  path = os.path.join(os.path.expanduser(directory), name)
  if not os.path.isfile(os.path.join(path, "fields.json")):
    features, meta = build()
    if not features:
      return features, meta
    partial = f"{path}.tmp-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex}"  # unique on a shared disk
    try:
      os.makedirs(partial)
      _write(partial, features, meta)
      os.rename(partial, path)
    except OSError:
      if not os.path.isfile(os.path.join(path, "fields.json")):
        raise
    finally:  # another process stored it first (the same features), or this one failed
      shutil.rmtree(partial, ignore_errors=True)
  table = Table(path)
  return table, table.meta
