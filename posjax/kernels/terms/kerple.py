"""KERPLE (Chi, Fan, Ramadge, Rudnicky; NeurIPS 2022): a conditionally positive definite kernel of the distance
with two learned scalars per head, as an open term (:mod:`posjax.kernels.term`)."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from posjax.kernels.term import HEAD, Term

KERPLES = ("log", "power")


@flax.struct.dataclass
class Kerple(Term):
  """KERPLE's kernels (Chi et al. 2022), ``r1, r2 > 0`` per head: ``log``: ``-r1 log(1 + r2 |r|)``; ``power``:
  ``-r1 |r|^r2`` (``0 < r2 <= 2``)."""

  r1: jax.Array  # [H]
  r2: jax.Array  # [H]
  kind: str = flax.struct.field(pytree_node=False, default="log")
  KINDS = {"r1": HEAD, "r2": HEAD}

  def bias(self, rel_S):
    """``[S..., H]`` float32: the kernel at each distance."""
    distance_Sx1 = jnp.abs(rel_S).astype(jnp.float32)[..., None]
    r1_H, r2_H = self.r1.astype(jnp.float32), self.r2.astype(jnp.float32)
    if self.kind == "log":
      return -r1_H * jnp.log1p(r2_H * distance_Sx1)
    positive_Sx1 = distance_Sx1 > 0  # |r|^r2 at r = 0 is 0, with a finite gradient for r2
    return -r1_H * jnp.where(positive_Sx1, jnp.where(positive_Sx1, distance_Sx1, 1.0) ** r2_H, 0.0)

  def check(self, batch: int, num_heads: int, head_dim: int, length: int) -> None:
    """Shapes and options, with errors that say what was given and what is allowed."""
    del batch, head_dim, length
    if self.kind not in KERPLES:
      raise ValueError(f"Kerple.kind={self.kind!r}; allowed: {list(KERPLES)}")
    for name in ("r1", "r2"):
      if jnp.shape(getattr(self, name)) != (num_heads,):
        raise ValueError(f"Kerple.{name} has shape {jnp.shape(getattr(self, name))}; expected ({num_heads},)")

  def logits(self, tile, s):
    """The kernel per tile (its gradients in ``r1``, ``r2`` derived by the kernels); ``|r|^r2`` as ``exp(r2 log|r|)``,
    0 at ``r = 0`` with a finite gradient."""
    d = jnp.abs(tile.k_positions - tile.q_positions).astype(jnp.float32)
    r1, r2 = tile.head("r1"), tile.head("r2")
    if self.kind == "log":
      return s - r1 * jnp.log1p(r2 * d)
    positive = d > 0
    return s - r1 * jnp.where(positive, jnp.exp(r2 * jnp.log(jnp.where(positive, d, 1.0))), 0.0)
