"""PoPE (Gopalakrishnan, Csordás, Schmidhuber, Mozer 2025, "Decoupling the 'What' and 'Where' with Polar Coordinate
Positional Embeddings", arXiv 2509.10534): each of a head's ``d`` features becomes a complex number whose magnitude
is ``softplus`` of the feature (the "what", never negative) and whose phase is the token's position times a frequency
(the "where"), the key's phase shifted by a learned bias per head and frequency:

    q' = [softplus(q) cos(p θ), softplus(q) sin(p θ)],   k' = [softplus(k) cos(p θ + δ), softplus(k) sin(p θ + δ)]

so ``q'_i · k'_j = Σ_c softplus(q_c) softplus(k_c) cos((p_i - p_j) θ_c - δ_c)``: the logit depends on positions only
through ``p_i - p_j``, and, unlike RoPE's, a feature's contribution cannot change sign with its content. There are
``d`` frequencies ``θ_c = base^(-c/d)`` (RoPE has ``d/2``), and q and k come out ``2d`` wide; v keeps ``d``.

As x-transformers' ``PolarEmbedding`` / ``apply_polar_pos_emb`` (``polar_pos_emb=True``): the logits' scale stays
``1/sqrt(d)``; the bias is a parameter ``δ`` of ``[heads, d]``, clamped to ``[-2π, 0]`` where it is read
(``clamp=False``: not clamped), starting at zero (``bias_init="zero"``, x-transformers' default) or uniform in
``[-2π, 0]`` (``"uniform"``). [choice] With grouped-query attention the bias is per key/value head, since it shifts
the keys (x-transformers' heads are never grouped). Every kernel computes it (it only transforms q and k, in float32:
``softplus`` and the angles), and decoding caches the keys already transformed, as RoPE's.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from posjax.positions import base

BIAS_INITS = ("zero", "uniform")


@dataclasses.dataclass(frozen=True)
class PopeOptions:
  """max_timescale: the frequencies' base (10,000). bias_init: ``zero`` | ``uniform`` (in ``[-2π, 0]``). clamp: read
  the bias clamped to ``[-2π, 0]`` (True, as x-transformers)."""

  max_timescale: float = 10_000.0
  bias_init: str = "zero"
  clamp: bool = True

  def __post_init__(self):
    base.check_choice("bias_init", self.bias_init, BIAS_INITS)
    if not self.max_timescale > 0:
      raise ValueError(f"max_timescale={self.max_timescale} must be positive")


@flax.struct.dataclass(kw_only=True)
class PolarState(base.PositionState):
  """PoPE's state: every position's phases ``p θ_c``, ``[Bp, L, 1, d]`` float32."""

  phase: jax.Array


def phases(positions_BxL, head_dim: int, max_timescale: float):
  """``[B, L, 1, d]`` float32: ``p · base^(-c/d)`` for the ``d`` features."""
  base.check_rows("positions", positions_BxL)
  inv_freq_K = max_timescale ** (-jnp.arange(head_dim, dtype=jnp.float32) / head_dim)
  return positions_BxL.astype(jnp.float32)[..., None, None] * inv_freq_K


class PolarPhases(nn.Module):
  """PoPE's encoder-level part: the phases of every position, computed once per forward pass."""

  spec: base.PositionSpec

  @nn.compact
  def __call__(self, positions_BxL):
    return PolarState(positions=positions_BxL,
                      phase=phases(positions_BxL, self.spec.head_dim, self.spec.options.max_timescale))


def polar(x_BxLxHxK, phase_BxLxHxK):
  """``[B, L, H, 2K]``: ``[softplus(x) cos φ, softplus(x) sin φ]`` (float32 inside, x's dtype out)."""
  magnitude = jax.nn.softplus(x_BxLxHxK.astype(jnp.float32))
  return jnp.concatenate([magnitude * jnp.cos(phase_BxLxHxK), magnitude * jnp.sin(phase_BxLxHxK)],
                         axis=-1).astype(x_BxLxHxK.dtype)


def _bias_init(kind: str):
  if kind == "zero":
    return nn.initializers.zeros_init()
  return lambda key, shape, dtype=jnp.float32: jax.random.uniform(key, shape, dtype, -2 * math.pi, 0.0)


class PolarQK(nn.Module):
  """PoPE inside each attention layer: q and k as magnitudes at their phases, the keys' shifted by the layer's bias."""

  spec: base.PositionSpec

  @nn.compact
  def __call__(self, q, k, state: PolarState, scale):
    spec, o = self.spec, self.spec.options
    bias_GxK = self.param("phase_bias", nn.with_logical_partitioning(_bias_init(o.bias_init), (base.HEADS, base.KV)),
                          (spec.kv_heads, spec.head_dim), spec.param_dtype).astype(jnp.float32)
    if o.clamp:
      bias_GxK = jnp.clip(bias_GxK, -2 * math.pi, 0.0)
    return base.LayerTerms(polar(q, state.phase), polar(k, state.phase + bias_GxK))


base.register(base.Method("pope", PopeOptions, encoder=PolarPhases, layer=PolarQK,
                          summary="PoPE: softplus magnitudes at position phases, a learned key phase bias "
                                  "(Gopalakrishnan et al. 2025)"))
