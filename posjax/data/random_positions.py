"""Randomised positions (Ruoss, Delétang, Genewein, Grau-Moya, Csordás, Bennani, Legg, Veness; ACL 2023,
"Randomized Positional Encodings Boost Length Generalization of Transformers"): in training, the positions of a
run of n tokens are a sorted draw of n distinct integers, from a range ``[0, N)`` with ``N`` larger than any length
to be evaluated, so every position and distance up to ``N`` is trained while the rows stay short. It works with any
position method, since every method reads the batch's ``positions``; evaluation keeps the ordinary ``0..n-1``.

``data.random_positions=N`` turns it on for the training batches (:class:`RandomPositions`). Each run of positions
counting from 0 (a row, or a packed document under ``documents`` / ``stream_documents`` packing) is drawn apart.
``data.random_positions_first`` (:data:`FIRSTS`) says what the run's first token gets:

- ``drawn`` (the default; the paper's draw, the official ``noisy_fixed_positional_encodings`` of
  google-deepmind/randomized_positional_encodings): all n positions are drawn from ``[0, N)``, the first as the
  others. At n = 2 the distance is d with probability ``(N - d) / C(N, 2)``, mean ``(N + 1) / 3``.
- ``zero``: the first token keeps position 0 and the other n-1 are drawn from ``[1, N)``. This is not a shift of
  the paper's draw: every distance from the first token is then as likely as any other (at n = 2 uniform on
  ``[1, N)``, mean ``N / 2``: 256 where the paper's is 171 at N = 512), so long distances are trained more often.
  It is the draw for a method that reads position 0 as the run's [CLS] (TUPE's ``cls_reset``), which refuses
  ``drawn`` (:func:`posjax.tasks.mlm.check_random_positions`).

What reads position 0 as a run's start: TUPE's [CLS] untying (refused with ``drawn``, above), RoPE's ``dynamic`` and
``longrope`` scalings, which read a packed document's length from its run of positions
(:func:`posjax.positions.rotary.run_lengths`; ``drawn`` is refused with them under the packings that restart
positions, ``documents`` and ``stream_documents``), and the Forgetting Transformer's cumulative gate sums, which restart at each position 0 (:func:`posjax.kernels.terms.forget_sums`).
[choice] FoX takes ``drawn``: its sums then restart only where a run's first token drew 0 and otherwise run on
from an earlier start of the row, which leaves every difference ``c_i - c_j`` within a document as it was (packed
documents are kept apart by their segment ids, not by the positions), to float32 rounding over at most a row.
Decoding never sees drawn positions. [choice] Ruoss et al. also draw positions at test time; posjax evaluates
with the ordinary positions, the comparison every other row of a length table makes.
"""

from __future__ import annotations

import numpy as np

from posjax.data import wrapped

# What a run's first token gets (``data.random_positions_first``): drawn as the others (the paper's), or 0.
FIRSTS = ("drawn", "zero")


def check_first(first: str) -> str:
  """``data.random_positions_first``, checked."""
  if first not in FIRSTS:
    raise ValueError(f"data.random_positions_first={first!r} is not one of {list(FIRSTS)}")
  return first


def draw(positions_BxL: np.ndarray, real_BxL: np.ndarray, limit: int, rng: np.random.Generator,
         first: str = "drawn") -> np.ndarray:
  """``[B, L]`` int32: each run of ``positions`` that counts from 0 (among the real tokens) given a sorted draw of
  distinct positions below ``limit`` (``first``: :data:`FIRSTS`, the paper's draw by default); padding keeps its
  positions."""
  low = 1 if check_first(first) == "zero" else 0
  out_BxL = np.array(positions_BxL, np.int32)
  for b in range(out_BxL.shape[0]):
    real = np.flatnonzero(real_BxL[b])
    starts = real[positions_BxL[b, real] == 0]
    for start, end in zip(starts, [*starts[1:], real[-1] + 1] if len(real) else []):
      n = int(end - start)
      if n > limit:
        raise ValueError(f"data.random_positions={limit}: a run of {n} tokens cannot take {n} distinct positions "
                         f"below {limit}; set it to at least the training length")
      out_BxL[b, start + low:end] = np.sort(rng.choice(np.arange(low, limit), n - low, replace=False))
  return out_BxL


class RandomPositions(wrapped.Wrapped):
  """Training batches whose ``positions`` are drawn (:func:`draw`), a resumed run drawing the same."""

  salt = (7,)

  def __init__(self, batches, limit: int, seed: int, first: str = "drawn"):
    super().__init__(batches, seed)
    self.limit, self.first = limit, check_first(first)

  def change(self, batch: dict, rng: np.random.Generator) -> dict:
    batch["positions"] = draw(batch["positions"], batch["attention_mask"] > 0, self.limit, rng, self.first)
    return batch
