"""TUPE's untied positional term (Ke, He, Liu; ICLR 2021) with its [CLS] reset: the other term whose kernels stay
special.

Shapes: Bp batch of the factors (1 or B), L length, H heads, K head dim.
"""

from __future__ import annotations

import flax.struct
import jax

RESETS = ("official", "paper", "none")


@flax.struct.dataclass
class Untied:
  """TUPE's untied positional term ``u_q,i · u_k,j`` (rank K per head, already scaled), with the [CLS]
  reset: ``official`` (the row of a [CLS] query is θ1, the column of a [CLS] key θ2, added to any bucket
  term), ``paper`` (θ replaces the whole positional term, bucket term included) or ``none``.

  Not an open term: its kernels stay written for it (its rank-K factors tiled like q and k, the [CLS] reset's θ
  gradients, the bf16 products of its factors), in :mod:`posjax.kernels.tile`, :mod:`posjax.kernels.triton` and
  :mod:`posjax.kernels.mosaic`; :mod:`posjax.kernels.fold` folds it into q and k instead (``untied="fold"``, and
  for cuDNN). Its ``paper`` reset reaches the bucket term through :meth:`posjax.kernels.terms.Terms.kernel_form`."""

  u_q: jax.Array  # [Bp, L, H, K]
  u_k: jax.Array  # [Bp, L, H, K]
  theta: jax.Array | None = None  # [2, H]
  reset: str = flax.struct.field(pytree_node=False, default="official")
