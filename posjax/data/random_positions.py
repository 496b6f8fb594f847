"""Randomised positions (Ruoss, Delétang, Genewein, Grau-Moya, Csordás, Bennani, Legg, Veness; ACL 2023,
"Randomized Positional Encodings Boost Length Generalization of Transformers"): in training, the positions of a
sequence of n tokens are a sorted draw of n distinct integers from ``[0, N)``, ``N`` larger than any length to be
evaluated, so every position and distance up to ``N`` is trained while the rows stay short. It works with any
position method, since every method reads the batch's ``positions``; evaluation keeps the ordinary ``0..n-1``.

``data.random_positions=N`` turns it on for the training batches (:class:`RandomPositions`). Each run of positions
counting from 0 (a row, or a packed document under ``documents`` / ``stream_documents`` packing) is drawn apart.
[choice] The run's first token keeps position 0 and the other n-1 are drawn from ``[1, N)``: the [CLS] and
document-start conventions that read position 0 (TUPE's [CLS] reset, segment starts) hold, and relative distances
are drawn as in the paper, whose draw starts anywhere in ``[0, N)`` (the difference is a shift of the whole run,
which changes no relative method). [choice] Ruoss et al. also draw positions at test time; posjax evaluates with
the ordinary positions, the comparison every other row of a length table makes.
"""

from __future__ import annotations

import numpy as np

from posjax.data import wrapped


def draw(positions_BxL: np.ndarray, real_BxL: np.ndarray, limit: int, rng: np.random.Generator) -> np.ndarray:
  """``[B, L]`` int32: each run of ``positions`` that counts from 0 (among the real tokens) given a sorted draw of
  distinct positions below ``limit``, its first kept at 0; padding keeps its positions."""
  out_BxL = np.array(positions_BxL, np.int32)
  for b in range(out_BxL.shape[0]):
    real = np.flatnonzero(real_BxL[b])
    starts = real[positions_BxL[b, real] == 0]
    for start, end in zip(starts, [*starts[1:], real[-1] + 1] if len(real) else []):
      n = int(end - start)
      if n > limit:
        raise ValueError(f"data.random_positions={limit}: a run of {n} tokens cannot take {n} distinct positions "
                         f"below {limit}; set it to at least the training length")
      out_BxL[b, start + 1:end] = np.sort(rng.choice(np.arange(1, limit), n - 1, replace=False))
  return out_BxL


class RandomPositions(wrapped.Wrapped):
  """Training batches whose ``positions`` are drawn (:func:`draw`), a resumed run drawing the same."""

  salt = (7,)

  def __init__(self, batches, limit: int, seed: int):
    super().__init__(batches, seed)
    self.limit = limit

  def change(self, batch: dict, rng: np.random.Generator) -> dict:
    batch["positions"] = draw(batch["positions"], batch["attention_mask"] > 0, self.limit, rng)
    return batch
