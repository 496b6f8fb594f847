"""Training batches from a prepared corpus (:mod:`posjax.data.prepare`), read by index through grain.

Every epoch is a fresh permutation of all blocks drawn from the seed (grain's index shuffle: no permutation is
materialized), read as one stream cut into global batches; each process reads only its own rows of each batch,
and masks them at read time from ``[seed, position in the stream]``, so the batches depend on the seed alone,
not on the number of processes or reader threads, and every epoch is masked anew (RoBERTa's dynamic masking).
The iterator's state is grain's (the next batch's index): restoring it costs the same at any step.
"""

from __future__ import annotations

import json
import os

import numpy as np

from posjax.data import features, mlm, prepare
from posjax.data.tokenizer import Tokenizer


def read_metadata(directory: str) -> dict:
  path = os.path.join(directory, "metadata.json")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"data.prepared_dir={directory!r} has no metadata.json (python -m posjax.data.prepare "
                            "writes it when it has finished)")
  with open(path) as f:
    return json.load(f)


def check(metadata: dict, directory: str, *, vocab_file: str, packing: str, max_len: int) -> list[str]:
  """The record files, after checking that the corpus was prepared for this run; any mismatch is an error."""
  wanted = {"tokenizer_sha256": prepare.sha256(vocab_file), "packing": packing, "max_len": max_len,
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


class PreparedBatches:
  """This process's rows of every global MLM batch of a prepared corpus (see the module docstring)."""

  def __init__(self, directory: str, tokenizer: Tokenizer, *, vocab_file: str, max_len: int, packing: str,
               global_batch: int, seed: int, mask_rate: float = 0.15, whole_word: bool = False,
               max_predictions: int | None = None, threads: int = 2, prefetch: int = 4):
    import grain.python as grain  # imported here: only prepared corpora need it

    metadata = read_metadata(directory)
    paths = check(metadata, directory, vocab_file=vocab_file, packing=packing, max_len=max_len)
    source = grain.ArrayRecordDataSource(paths)
    if len(source) != metadata["blocks"]:
      raise ValueError(f"{directory}: the record files hold {len(source)} blocks, metadata.json says "
                       f"{metadata['blocks']} (a truncated or replaced file?)")
    if not len(source):
      raise ValueError(f"{directory} holds no blocks")
    self.tokenizer, self.max_len, self.global_batch = tokenizer, max_len, global_batch
    self.max_predictions = max_predictions or mlm.default_max_predictions(max_len, mask_rate)
    dtype = np.dtype(metadata["record"]["dtype"])
    rows = features.process_rows(global_batch)

    def load(step: int, indices: np.ndarray) -> dict:
      examples = []
      for row, index in zip(range(rows.start, rows.stop), indices[rows]):
        block = prepare.decode_block(source[int(index)], max_len, dtype)
        rng = np.random.default_rng([seed, step * global_batch + row])
        examples.append(mlm.mask_block(block, rng, tokenizer, self.max_predictions, mask_rate, whole_word))
      return {k: np.stack([e[k] for e in examples]) for k in examples[0]}

    dataset = (grain.MapDataset.range(len(source)).shuffle(seed=seed).repeat().batch(global_batch)
               .map_with_index(load))
    self._dataset = dataset.to_iter_dataset(grain.ReadOptions(num_threads=threads, prefetch_buffer_size=prefetch))
    self._iterator = iter(self._dataset)
    self.blocks = len(source)

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    return next(self._iterator)

  def state(self) -> dict:
    return {"prepared": self._iterator.get_state()}

  def restore(self, state: dict) -> None:
    if "prepared" not in state:
      raise ValueError(f"the saved input position {state} is not a prepared corpus's (was this workdir trained on "
                       "a streaming source?)")
    self._iterator = iter(self._dataset)
    self._iterator.set_state(state["prepared"])

  def empty(self) -> dict:
    row = {"input_ids": np.full(self.max_len, self.tokenizer.pad_id, np.int32),
           **{k: np.zeros(self.max_len, np.int32) for k in ("attention_mask", "segment_ids", "positions")},
           "masked_positions": np.zeros(self.max_predictions, np.int32),
           "masked_labels": np.zeros(self.max_predictions, np.int32),
           "masked_weights": np.zeros(self.max_predictions, np.float32)}
    local = features.process_rows(self.global_batch)
    return {k: np.stack([v] * (local.stop - local.start)) for k, v in row.items()}
