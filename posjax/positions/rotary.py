"""RoPE (Su et al. 2021): rotate q and k by angles proportional to their positions, in every layer.

``q_i·k_j`` after rotation depends on positions only through ``p_j - p_i``. Rotation pairs feature ``d``
with feature ``d + d_h/2`` (the GPT-NeoX / Llama layout).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from posjax.positions import base


@dataclasses.dataclass(frozen=True)
class RopeOptions:
  """max_timescale: the rotation base (10,000 in the paper)."""

  max_timescale: float = 10_000.0


def rotation(positions_BxL, head_dim: int, max_timescale: float = 10_000.0):
  """``(sin, cos)``, each ``[B, L, 1, d_h/2]``: the angles ``p / T^(2f/d_h)``."""
  if head_dim % 2:
    raise ValueError(f"rope needs an even head dimension, got head_dim={head_dim}")
  base.check_rows("positions", positions_BxL)
  inv_freq = max_timescale ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  angle = positions_BxL.astype(jnp.float32)[..., None, None] * inv_freq
  return jnp.sin(angle), jnp.cos(angle)


def rotate(x_BxLxHxK, sin, cos):
  """RoPE's rotation of each pair of halves of the head dimension by the position's angles (float32 inside)."""
  x1, x2 = jnp.split(x_BxLxHxK.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxLxHxK.dtype)


@flax.struct.dataclass(kw_only=True)
class RotaryState(base.PositionState):
  """RoPE's state: the angles' sines and cosines, each ``[Bp, L, 1, d_h/2]``."""

  sin: jax.Array
  cos: jax.Array


class Rotation(nn.Module):
  """RoPE's encoder-level part: the sines and cosines of every position, computed once per forward pass."""

  spec: base.PositionSpec

  @nn.compact
  def __call__(self, positions_BxL):
    sin, cos = rotation(positions_BxL, self.spec.head_dim, self.spec.options.max_timescale)
    return RotaryState(positions=positions_BxL, sin=sin, cos=cos)


class RotateQK(nn.Module):
  """RoPE inside each attention layer: q and k rotated by their positions' angles."""

  spec: base.PositionSpec

  @nn.compact
  def __call__(self, q, k, state: RotaryState, scale):
    return base.LayerTerms(rotate(q, state.sin, state.cos), rotate(k, state.sin, state.cos))


base.register(base.Method("rope", RopeOptions, encoder=Rotation, layer=RotateQK,
                          summary="rotary embedding of q and k (Su et al. 2021)"))
