"""Batches of a fixed list of examples (fine-tuning): an endless shuffled stream for training, one padded pass
for evaluation, each process taking its rows of every global batch.

A feature is a dict of 1-D arrays (``input_ids``, ``token_type_ids``: the tokens, unpadded) and scalars
(``label``, ``start_position``, ...). :func:`collate` pads the tokens to ``max_len`` and adds
``attention_mask``, ``weight`` (1 for a real example, 0 for padding) and ``index`` (the feature's place in the
list, -1 for padding), so predictions can be matched to their examples whatever batch they were in.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

TOKEN_FIELDS = ("input_ids", "token_type_ids")


def collate(features: Sequence[dict], indices: Sequence[int], *, rows: int, max_len: int, pad_id: int) -> dict:
  """``rows`` rows: the features (with their ``indices``), then padding rows of weight 0."""
  if not features:
    raise ValueError("collate needs at least one feature (for the field names)")
  template = features[0]
  batch = {}
  for key, value in template.items():
    if key in TOKEN_FIELDS:
      batch[key] = np.full((rows, max_len), pad_id if key == "input_ids" else 0, np.int32)
    else:
      batch[key] = np.zeros((rows,), np.asarray(value).dtype)
  batch["attention_mask"] = np.zeros((rows, max_len), np.int32)
  batch["weight"] = np.zeros((rows,), np.float32)
  batch["index"] = np.full((rows,), -1, np.int32)
  for row, (feature, index) in enumerate(zip(features, indices)):
    length = len(feature["input_ids"])
    if length > max_len:
      raise ValueError(f"feature {index} has {length} tokens; max_len is {max_len}")
    for key, value in feature.items():
      if key in TOKEN_FIELDS:
        batch[key][row, :length] = value
      else:
        batch[key][row] = value
    batch["attention_mask"][row, :length] = 1
    batch["weight"][row] = 1.0
    batch["index"][row] = index
  return batch


def process_rows(global_batch: int) -> slice:
  """This process's rows of a global batch (contiguous, in process order)."""
  import jax

  local = global_batch // jax.process_count()
  return slice(jax.process_index() * local, (jax.process_index() + 1) * local)


class ExampleBatches:
  """Endless training batches over ``features``: a fresh permutation per epoch, drawn from ``[seed, epoch]``,
  read as one continuous stream (a batch may span two epochs). The state is the number of examples consumed,
  so restoring costs nothing; the batches depend on the seed alone, not on the number of processes."""

  def __init__(self, features: Sequence[dict], *, global_batch: int, max_len: int, pad_id: int, seed: int):
    if not features:
      raise ValueError("no training examples")
    self.features, self.global_batch, self.max_len, self.pad_id, self.seed = (
        features, global_batch, max_len, pad_id, seed)
    self.consumed = 0
    self._rows = process_rows(global_batch)

  def _order(self, epoch: int) -> np.ndarray:
    return np.random.default_rng([self.seed, epoch]).permutation(len(self.features))

  def global_indices(self, start: int, count: int) -> np.ndarray:
    """Indices of the ``count`` examples after the first ``start`` of the stream."""
    n = len(self.features)
    out = []
    while count > 0:
      epoch, offset = divmod(start, n)
      take = min(count, n - offset)
      out.append(self._order(epoch)[offset:offset + take])
      start, count = start + take, count - take
    return np.concatenate(out)

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    indices = self.global_indices(self.consumed, self.global_batch)[self._rows]
    self.consumed += self.global_batch
    return collate([self.features[i] for i in indices], indices, rows=len(indices), max_len=self.max_len,
                   pad_id=self.pad_id)

  def state(self) -> dict:
    return {"examples_consumed": self.consumed}

  def restore(self, state: dict) -> None:
    if "examples_consumed" not in state:
      raise ValueError(f"the saved input position {state} is not a fine-tuning one (examples_consumed); was this "
                       "workdir written by another task?")
    self.consumed = int(state["examples_consumed"])


def eval_batches(features: Sequence[dict], *, global_batch: int, max_len: int, pad_id: int) -> list[dict]:
  """This process's rows of every global batch of one pass over ``features`` (the last one padded)."""
  rows = process_rows(global_batch)
  local = rows.stop - rows.start
  batches = []
  for start in range(0, len(features), global_batch):
    indices = list(range(start, min(start + global_batch, len(features))))[rows]
    chosen = [features[i] for i in indices] or features[:1]  # a process whose rows are all padding: a template
    batches.append(collate(chosen, indices, rows=local, max_len=max_len, pad_id=pad_id))
  return batches


def empty_like(batch: dict) -> dict:
  """Padding rows only (weight 0, index -1), shaped like ``batch``."""
  out = {k: np.zeros_like(v) for k, v in batch.items()}
  out["index"] = np.full_like(batch["index"], -1)
  return out
