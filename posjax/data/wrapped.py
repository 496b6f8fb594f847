"""Training batches changed one batch at a time by a seeded draw, resumable like the batches they wrap."""

from __future__ import annotations

import jax
import numpy as np


class Wrapped:
  """``batches`` (with ``state`` / ``restore``), each batch given to :meth:`change` with a generator drawn from the
  seed, the process, the batch's index and ``salt``: a resumed run draws the same. Subclasses define ``change``."""

  salt: tuple[int, ...] = ()

  def __init__(self, batches, seed: int):
    self.batches, self.seed, self.drawn = batches, seed, 0

  def change(self, batch: dict, rng: np.random.Generator) -> dict:
    raise NotImplementedError

  def state(self) -> dict:
    return {"batches": self.batches.state(), "drawn": self.drawn}

  def restore(self, state: dict) -> None:
    self.batches.restore(state["batches"])
    self.drawn = int(state["drawn"])

  def close(self) -> None:
    if hasattr(self.batches, "close"):
      self.batches.close()

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    batch = {k: np.array(v) for k, v in next(self.batches).items()}
    rng = np.random.default_rng([self.seed, jax.process_index(), self.drawn, *self.salt])
    self.drawn += 1
    return self.change(batch, rng)
