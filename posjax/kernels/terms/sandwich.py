"""Sandwich (Chi, Fan, Rudnicky, Ramadge; ACL 2023): sinusoidal embeddings' inner product as a bias, as an open term
(:mod:`posjax.kernels.term`) whose kernel input is the embeddings."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from posjax.kernels.term import EMBEDDINGS, Term


@flax.struct.dataclass
class Sandwich(Term):
  """Sandwich (Chi, Fan, Rudnicky, Ramadge; ACL 2023): the inner product of the two positions' sinusoidal embeddings
  of dimension ``dim`` as a bias, ``λ (pe(p_i)·pe(p_j) - F) = λ (Σ_f cos(r ω_f / ρ_h) - F)``, ``ω_f =
  base^(-2(f + first)/dim)``, ``f < F = dim / 2`` (the offset makes the bias 0 at ``r = 0`` and changes no attention
  weight), with each head's positions compressed by its ratio ``ρ_h > 0`` (``divide="positions"``) or, as NVIDIA
  NeMo's implementation does, its bias divided by it (``divide="bias"``: ``λ (Σ_f cos(r ω_f) - F) / ρ_h``; the
  kernels add it less the per-head constant ``λ F (1 - 1/ρ_h)``, which changes no attention weight). Computed as that
  inner product (rank ``dim`` per head, float32-accurate: HIGHEST, three TF32 passes in the compiled GPU kernels), as
  the paper states it: the kernels take the embeddings (:meth:`embeddings`, ``[B, H, L, dim]`` float32: an
  :data:`EMBEDDINGS` input, rebuilt for the backward) and multiply them per tile. Float32 sinusoids of large positions round: the bias errs by about 3e-5
  at positions below 64, 3e-4 near 1,000, 1e-3 near 5,000 (dim 128, against float64)."""

  ratios: jax.Array  # [H] ρ (constants: no gradient)
  dim: int = flax.struct.field(pytree_node=False, default=128)
  base: float = flax.struct.field(pytree_node=False, default=10_000.0)
  scale: float = flax.struct.field(pytree_node=False, default=1.0)
  divide: str = flax.struct.field(pytree_node=False, default="positions")  # or "bias"
  first: int = flax.struct.field(pytree_node=False, default=0)  # the first frequency's index f (NeMo's: 1)
  KINDS = {"e": EMBEDDINGS}
  CONSTANTS = frozenset({"e"})  # the ratios are constants: no gradient is accumulated

  def _ratios(self):
    return jax.lax.stop_gradient(self.ratios.astype(jnp.float32))

  def frequencies(self):
    """``[H, F]`` float32: ``ω_f / ρ_h`` (``ω_f`` when the bias is divided)."""
    f_F = jnp.arange(self.first, self.first + self.dim // 2, dtype=jnp.float32)
    omega_F = self.base ** (-2.0 * f_F / self.dim)
    if self.divide == "bias":
      return jnp.broadcast_to(omega_F[None, :], (self.ratios.shape[0], self.dim // 2))
    return omega_F[None, :] / self._ratios()[:, None]

  def embeddings(self, positions_BxL):
    """``[B, H, L, 2F]`` float32: each head's ``[cos, sin](p ω_f / ρ_h)`` (``[cos, sin](p ω_f) / sqrt(ρ_h)`` when the
    bias is divided), whose inner products are the bias (plus ``F``)."""
    angle_BxHxLxF = (positions_BxL.astype(jnp.float32)[:, None, :, None] * self.frequencies()[None, :, None, :])
    e_BxHxLxE = jnp.concatenate([jnp.cos(angle_BxHxLxF), jnp.sin(angle_BxHxLxF)], axis=-1)
    if self.divide == "bias":
      e_BxHxLxE = e_BxHxLxE * jax.lax.rsqrt(self._ratios())[None, :, None, None]
    return e_BxHxLxE

  def bias(self, positions_BxQ, positions_BxL):
    """``[B, H, Q, L]`` float32 between query positions and key positions."""
    inner_BxHxQxL = jnp.einsum("bhqf,bhkf->bhqk", self.embeddings(positions_BxQ), self.embeddings(positions_BxL),
                               precision=jax.lax.Precision.HIGHEST)
    offset_H = self.dim // 2 / (self._ratios() if self.divide == "bias" else jnp.ones_like(self._ratios()))
    return self.scale * (inner_BxHxQxL - offset_H[None, :, None, None])

  def check(self, batch: int, num_heads: int, head_dim: int, length: int) -> None:
    """Shapes and options, with errors that say what was given and what is allowed."""
    del batch, head_dim, length
    if jnp.shape(self.ratios) != (num_heads,):
      raise ValueError(f"Sandwich.ratios has shape {jnp.shape(self.ratios)}; expected ({num_heads},)")
    if not (isinstance(self.dim, (int, np.integer)) and self.dim >= 2 and self.dim % 2 == 0):
      raise ValueError(f"Sandwich.dim={self.dim!r} must be an even integer >= 2")
    if self.divide not in ("positions", "bias"):
      raise ValueError(f"Sandwich.divide={self.divide!r}; allowed: ['positions', 'bias']")

  def kernel_inputs(self, positions_BxL) -> dict:
    return {"e": self.embeddings(positions_BxL)}

  def logits(self, tile, s):
    return s + self.scale * (tile.inner(tile.embed_q("e"), tile.embed_k("e")) - self.dim // 2)
