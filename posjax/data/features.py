"""Batches of a fixed list of examples (fine-tuning): an endless shuffled stream for training, one padded pass
for evaluation, each process taking its rows of every global batch.

A feature is a dict of 1-D arrays (``input_ids``, ``token_type_ids``: the tokens, unpadded) and scalars
(``label``, ``start_position``, ...). :func:`collate` pads the tokens to a length and adds ``attention_mask``,
``weight`` (1 for a real example, 0 for padding) and ``index`` (the feature's place in the list, -1 for
padding), so predictions can be matched to their examples whatever batch they were in.

How long a batch is (``batching``), so that the cost follows the examples, not ``max_len``:
- ``fixed``: every batch padded to ``max_len``;
- ``dynamic`` (fairseq's, which TUPE fine-tuned with; Hugging Face's dynamic padding): the same batches as
  ``fixed``, each padded to the smallest of ``buckets`` that holds its longest example, so few shapes compile;
- ``grouped`` (Hugging Face's ``group_by_length``): as ``dynamic``, and each epoch's order is cut into
  mega-batches of ``group_size`` batches (0: the whole epoch) whose examples are sorted by length, so a batch
  holds examples of similar lengths, the batches of a mega-batch in a random order; the stream is another one
  than ``fixed``'s, drawn from the seed alone.
Evaluation (:func:`eval_batches`) sorts the examples by length for any batching but ``fixed``; predictions
are per row, so metrics do not depend on the batching or the batch size.
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


BATCHINGS = ("fixed", "dynamic", "grouped")


def length_buckets(max_len: int, per_doubling: int = 4) -> tuple[int, ...]:
  """The padded lengths a batch may have: ``per_doubling`` steps between two powers of two from 64 on, steps of
  ``32 // per_doubling`` below, and ``max_len``. The default (8, 16, ..., 64, 80, ..., 128, 160, ..., 512: 20
  shapes) pads at most 7 tokens or a fifth of a batch's length past its longest example; ``per_doubling=8`` halves
  that in 40 shapes."""
  lengths, n = [], 0
  while n < max_len:
    n += max(32, 1 << max(n.bit_length() - 1, 0)) // per_doubling
    lengths.append(min(n, max_len))
  return tuple(lengths)


def padded_length(longest: int, buckets: Sequence[int]) -> int:
  """The smallest of ``buckets`` that holds ``longest`` tokens."""
  for length in buckets:
    if length >= longest:
      return length
  raise ValueError(f"a batch holds {longest} tokens, more than the longest length {max(buckets)}")


def _check_batching(batching: str, buckets: Sequence[int] | None, max_len: int) -> tuple[int, ...]:
  """The sorted bucket lengths (``max_len`` always among them); a bad batching or length is an error."""
  if batching not in BATCHINGS:
    raise ValueError(f"data.batching={batching!r}; allowed: {list(BATCHINGS)}")
  if not buckets:
    return length_buckets(max_len)
  if isinstance(buckets, int):
    if buckets not in (1, 2, 4, 8, 16, 32):
      raise ValueError(f"data.buckets_per_doubling={buckets}; allowed: 1, 2, 4, 8, 16, 32")
    return length_buckets(max_len, buckets)
  if any(int(b) != b or not 0 < b <= max_len for b in buckets):
    raise ValueError(f"data.length_buckets={tuple(buckets)} must be whole numbers in [1, max_len={max_len}]")
  return tuple(sorted({int(b) for b in buckets} | {max_len}))


def lengths_of(features: Sequence[dict], max_len: int) -> np.ndarray:
  """Every feature's number of tokens; one longer than ``max_len`` is an error that names it."""
  lengths = getattr(features, "lengths", None)
  if lengths is None:
    lengths = np.fromiter((len(f["input_ids"]) for f in features), np.int64, len(features))
  if len(lengths) and lengths.max() > max_len:
    index = int(np.argmax(lengths))
    raise ValueError(f"feature {index} has {int(lengths[index])} tokens; max_len is {max_len}")
  return np.asarray(lengths)


def join_outputs(outputs: Sequence[dict]) -> dict:
  """Per-batch outputs as one array per key, in batch order; per-token outputs of batches padded to other
  lengths are padded with 0 to the longest."""
  joined = {}
  for key in outputs[0]:
    parts = [np.asarray(o[key]) for o in outputs]
    width = max(p.shape[1] for p in parts) if parts[0].ndim > 1 else None
    if width is not None:
      parts = [np.pad(p, [(0, 0), (0, width - p.shape[1])] + [(0, 0)] * (p.ndim - 2)) for p in parts]
    joined[key] = np.concatenate(parts)
  return joined


def process_rows(global_batch: int) -> slice:
  """This process's rows of a global batch (contiguous, in process order)."""
  import jax

  local = global_batch // jax.process_count()
  return slice(jax.process_index() * local, (jax.process_index() + 1) * local)


class ExampleBatches:
  """Endless training batches over ``features``: a fresh permutation per epoch, drawn from ``[seed, epoch]``,
  read as one continuous stream (a batch may span two epochs), padded as ``batching`` says (module docstring).
  The state is the number of examples consumed, so restoring costs nothing; the batches depend on the seed
  alone, not on the number of processes (each process pads its rows to the global batch's length)."""

  def __init__(self, features: Sequence[dict], *, global_batch: int, max_len: int, pad_id: int, seed: int,
               batching: str = "fixed", buckets: Sequence[int] | int | None = None, group_size: int = 50):
    if not features:
      raise ValueError("no training examples")
    self.buckets = _check_batching(batching, buckets, max_len)
    self.features, self.global_batch, self.max_len, self.pad_id, self.seed = (
        features, global_batch, max_len, pad_id, seed)
    self.batching, self.group_size = batching, group_size
    self.lengths = lengths_of(features, max_len)
    self.consumed = 0
    self._rows = process_rows(global_batch)
    self._orders: dict[int, np.ndarray] = {}

  def _order(self, epoch: int) -> np.ndarray:
    """The epoch's order of examples (the last two kept: a batch may span two epochs)."""
    if epoch not in self._orders:
      rng = np.random.default_rng([self.seed, epoch])
      order = rng.permutation(len(self.features))
      if self.batching == "grouped":
        order = self._grouped(order, rng, epoch)
      self._orders = {e: o for e, o in self._orders.items() if e == epoch - 1} | {epoch: order}
    return self._orders[epoch]

  def _grouped(self, order: np.ndarray, rng: np.random.Generator, epoch: int) -> np.ndarray:
    """Mega-batches of ``group_size`` batches sorted by length, cut into batches where the stream cuts them (the
    first ``shift`` examples finish the previous epoch's last batch), the batches of each in a random order."""
    batch, mega = self.global_batch, (self.group_size * self.global_batch) or len(order)
    shift = (-epoch * len(order)) % batch
    parts = [order[:shift]]
    for chunk in np.split(order[shift:], range(mega, len(order) - shift, mega)):
      ordered = chunk[np.argsort(-self.lengths[chunk], kind="stable")]
      full = len(ordered) // batch * batch  # an incomplete last batch stays last, where the stream cuts
      batches = np.split(ordered[:full], range(batch, full, batch))
      parts += [batches[i] for i in rng.permutation(len(batches))] + [ordered[full:]]
    return np.concatenate(parts)

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

  def length(self, indices: np.ndarray) -> int:
    """The padded length of a global batch of these examples."""
    if self.batching == "fixed":
      return self.max_len
    return padded_length(int(self.lengths[indices].max()), self.buckets)

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    chosen = self.global_indices(self.consumed, self.global_batch)
    indices = chosen[self._rows]
    self.consumed += self.global_batch
    return collate([self.features[i] for i in indices], indices, rows=len(indices), max_len=self.length(chosen),
                   pad_id=self.pad_id)

  def state(self) -> dict:
    return {"examples_consumed": self.consumed}

  def restore(self, state: dict) -> None:
    if "examples_consumed" not in state:
      raise ValueError(f"the saved input position {state} is not a fine-tuning one (examples_consumed); was this "
                       "workdir written by another task?")
    self.consumed = int(state["examples_consumed"])


def eval_batches(features: Sequence[dict], *, global_batch: int, max_len: int, pad_id: int, batching: str = "fixed",
                 buckets: Sequence[int] | int | None = None) -> list[dict]:
  """This process's rows of every global batch of one pass over ``features`` (the last one padded with rows of
  weight 0): in order for ``fixed`` batching, else longest first, each batch padded to its bucket."""
  buckets = _check_batching(batching, buckets, max_len)
  lengths = lengths_of(features, max_len)
  order = np.arange(len(features)) if batching == "fixed" else np.argsort(-lengths, kind="stable")
  rows = process_rows(global_batch)
  local = rows.stop - rows.start
  batches = []
  for start in range(0, len(features), global_batch):
    chosen = order[start:start + global_batch]
    length = max_len if batching == "fixed" else padded_length(int(lengths[chosen].max()), buckets)
    indices = list(chosen[rows])
    picked = [features[i] for i in indices] or [features[0]]  # a process whose rows are all padding: a template
    batches.append(collate(picked, indices, rows=local, max_len=length, pad_id=pad_id))
  return batches


def empty_like(batch: dict) -> dict:
  """Padding rows only (weight 0, index -1), shaped like ``batch``."""
  out = {k: np.zeros_like(v) for k, v in batch.items()}
  out["index"] = np.full_like(batch["index"], -1)
  return out
