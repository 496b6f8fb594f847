"""Training batches from a prepared corpus (:mod:`posjax.data.prepare`), read by index through grain.

Every epoch is a fresh permutation of all blocks drawn from the seed (grain's index shuffle: no permutation is
materialized), read as one stream cut into global batches; each process reads only its own rows of each batch,
and masks them at read time from ``[seed, position in the stream]``, so the batches depend on the seed alone,
not on the number of processes or reader threads, and every epoch is masked anew (RoBERTa's dynamic masking).
The state is the next batch's index: restoring it costs the same at any step.
"""

from __future__ import annotations

import json
import os

import numpy as np

from posjax.data import features, mlm, prepare
from posjax.data import tokenizer as tokenizer_lib
from posjax.data.tokenizer import Tokenizer


def read_metadata(directory: str) -> dict:
  """The prepared corpus's ``metadata.json``; a directory without one (not prepared, or not finished) is an
  error."""
  path = os.path.join(directory, "metadata.json")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"data.prepared_dir={directory!r} has no metadata.json (python -m posjax.data.prepare "
                            "writes it when it has finished)")
  with open(path) as f:
    return json.load(f)


def check(metadata: dict, directory: str, *, vocab_file: str, packing: str, max_len: int) -> list[str]:
  """The record files, after checking that the corpus was prepared for this run; any mismatch is an error."""
  wanted = {"tokenizer_sha256": tokenizer_lib.digest(vocab_file), "packing": packing, "max_len": max_len,
            "format": prepare.FORMAT}
  different = {k: (metadata.get(k), v) for k, v in wanted.items() if metadata.get(k) != v}
  if different:
    described = ", ".join(f"{k}: prepared {got!r}, this run {want!r}" for k, (got, want) in different.items())
    raise ValueError(f"{directory} was prepared for another run ({described}); prepare it again for this config")
  paths = [os.path.join(directory, entry["file"]) for entry in metadata["files"]]
  for path, entry in zip(paths, metadata["files"]):
    if not os.path.isfile(path):
      raise FileNotFoundError(f"prepared corpus file {path} is missing")
    blocks = _count(path)
    if blocks != entry["blocks"]:
      raise ValueError(f"prepared corpus file {path} holds {blocks} blocks, metadata.json says {entry['blocks']} "
                       "(truncated or replaced?); prepare the corpus again")
  return paths


def _count(path: str) -> int | str:
  """The records in an ArrayRecord file, or why it cannot be read."""
  from array_record.python.array_record_module import ArrayRecordReader  # imported here: an optional reader

  try:
    reader = ArrayRecordReader(path)
    count = reader.num_records()
    reader.close()  # a damaged file fails here at the latest
  except Exception as error:  # noqa: BLE001  (the C++ reader's errors are not typed)
    reason = (str(error).splitlines() or [""])[0][:120]
    return f"none readable ({type(error).__name__}{': ' + reason if reason else ''})"
  return count


class _MaskRows:
  """``(batch index, block indices) -> this process's rows, masked``: a class, not a closure, so that grain's
  worker processes receive it by pickling."""

  def __init__(self, source, tokenizer: Tokenizer, rows: slice, *, seed: int, global_batch: int, max_len: int,
               dtype, max_predictions: int, masking: mlm.Masking):
    self.source, self.tokenizer, self.rows, self.seed, self.global_batch = source, tokenizer, rows, seed, global_batch
    self.max_len, self.dtype, self.max_predictions = max_len, dtype, max_predictions
    self.masking = masking

  def __call__(self, step: int, indices_G: np.ndarray) -> dict:
    examples = []
    for row, index in zip(range(self.rows.start, self.rows.stop), indices_G[self.rows]):
      block = prepare.decode_block(self.source[int(index)], self.max_len, self.dtype)
      rng = np.random.default_rng([self.seed, step * self.global_batch + row])
      examples.append(mlm.example(block, rng, self.tokenizer, self.max_predictions, self.masking))
    return {k: np.stack([e[k] for e in examples]) for k in examples[0]}


class PreparedBatches:
  """This process's rows of every global MLM batch of a prepared corpus (see the module docstring).

  ``workers``: grain worker processes that read and mask (0: one reader thread in this process); each takes
  every ``workers``-th batch and grain interleaves them back in order, so the batches do not depend on it. The
  state is the number of batches consumed: a run may resume with another number of workers or processes.
  """

  def __init__(self, directory: str, tokenizer: Tokenizer, *, vocab_file: str, max_len: int, packing: str,
               global_batch: int, seed: int, masking: mlm.Masking | None = mlm.Masking(),
               max_predictions: int | None = None, workers: int = 0, prefetch: int = 4):
    import grain.python as grain  # imported here: only prepared corpora need it

    if workers < 0:
      raise ValueError(f"data.workers={workers}: the number of reader processes must be >= 0 (0: none)")
    metadata = read_metadata(directory)
    paths = check(metadata, directory, vocab_file=vocab_file, packing=packing, max_len=max_len)
    source = grain.ArrayRecordDataSource(paths)
    if len(source) != metadata["blocks"]:
      raise ValueError(f"{directory}: the record files hold {len(source)} blocks, metadata.json says "
                       f"{metadata['blocks']} (a truncated or replaced file?)")
    if not len(source):
      raise ValueError(f"{directory} holds no blocks")
    self.tokenizer, self.max_len, self.global_batch = tokenizer, max_len, global_batch
    self.max_predictions = 0 if masking is None else max_predictions or mlm.default_max_predictions(max_len, masking)
    self.masking = masking
    self.blocks, self.workers, self.prefetch = len(source), workers, prefetch
    load = _MaskRows(source, tokenizer, features.process_rows(global_batch), seed=seed, global_batch=global_batch,
                     max_len=max_len, dtype=np.dtype(metadata["record"]["dtype"]),
                     max_predictions=self.max_predictions, masking=masking)
    self._batches = (grain.MapDataset.range(len(source)).shuffle(seed=seed).repeat().batch(global_batch)
                     .map_with_index(load))
    self._iterator, self._next = None, 0

  def _start(self) -> None:
    """Starts reading at batch ``self._next`` (lazily: a restore right after construction spawns no workers
    twice)."""
    import grain.python as grain

    dataset = self._batches[self._next:].to_iter_dataset(
        grain.ReadOptions(num_threads=1, prefetch_buffer_size=self.prefetch))
    if self.workers:
      from absl import flags

      if not flags.FLAGS.is_parsed():  # grain reads its absl flags; a program without absl.app has not parsed them
        flags.FLAGS.mark_as_parsed()
      dataset = dataset.mp_prefetch(grain.MultiprocessingOptions(num_workers=self.workers,
                                                                 per_worker_buffer_size=self.prefetch))
    self._iterator = iter(dataset)

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    if self._iterator is None:
      self._start()
    batch = next(self._iterator)
    self._next += 1
    return batch

  def state(self) -> dict:
    return {"prepared": {"next_batch": self._next}}

  def restore(self, state: dict) -> None:
    position = state.get("prepared")
    if not isinstance(position, dict) or not isinstance(position.get("next_batch"), int):
      raise ValueError(f"the saved input position {state} is not a prepared corpus's (was this workdir trained on "
                       "a streaming source?)")
    self.close()
    self._next = position["next_batch"]

  def close(self) -> None:
    """Stops the worker processes, if any (also on garbage collection, but not at a guaranteed time)."""
    if self._iterator is not None and hasattr(self._iterator, "close"):
      self._iterator.close()
    self._iterator = None

  def empty(self) -> dict:
    row = mlm.empty_row(self.max_len, self.tokenizer.pad_id, self.max_predictions, self.masking)
    local = features.process_rows(self.global_batch)
    return {k: np.stack([v] * (local.stop - local.start)) for k, v in row.items()}
