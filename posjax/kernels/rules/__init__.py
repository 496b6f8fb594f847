"""Rules that replace the softmax on the masked logits: CoPE (positions counted by gates over the allowed keys) and
stick-breaking (weights that are not a softmax). Each reads a query's whole row, so each has its own kernel family,
above the backends' plumbing: ``<rule>.py`` (its dataclass and dense form, the ``xla`` oracle), ``<rule>_gpu.py``
(Triton) and ``<rule>_tpu.py`` (Mosaic); ``walk_gpu.py`` and ``walk_tpu.py`` hold what both rules' kernels share
(each query tile's key tiles walked from the diagonal back with per-row carries), ``common.py`` the in-tile sums.
:func:`posjax.kernels.relative_attention` takes a rule as ``rule=`` (or as the ``Terms`` field of its name).

Shapes: B batch, H heads, Q query rows, L keys.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def suffix_sums(x_BxHxQxL, inclusive: bool):
  """``Σ_{t >= j}`` (``inclusive``) or ``Σ_{t > j}`` of ``x`` along the keys, summed from the last key back (no
  difference of two long sums: an exclusive sum is the next key's inclusive one)."""
  sums_BxHxQxL = jax.lax.cumsum(x_BxHxQxL, axis=x_BxHxQxL.ndim - 1, reverse=True)
  if inclusive:
    return sums_BxHxQxL
  return jnp.concatenate([sums_BxHxQxL[..., 1:], jnp.zeros_like(sums_BxHxQxL[..., :1])], axis=-1)
