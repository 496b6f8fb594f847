"""KERPLE (Chi, Fan, Ramadge, Rudnicky; NeurIPS 2022): a conditionally positive definite kernel of the distance as
each layer's bias, two learned positive scalars per head.

| method         | bias at (i, j), r = p_j - p_i        |
|----------------|--------------------------------------|
| kerple_log     | ``-r1 log(1 + r2 |r|)``              |
| kerple_power   | ``-r1 |r|^r2``, ``0 < r2 <= 2``       |

As the official code (chijames/KERPLE, ``ParallelKerpleLog`` / ``ParallelKerplePower``): one ``(r1, r2)`` per head in
every layer, kept at or above ``eps = 0.01``; the log kernel draws ``r1 ~ U(0, 2)``, ``r2 ~ U(0, 1)``, the power
kernel its exponent ``r2 ~ U(0, 2)`` (kept at or below 2, the paper's condition) and its scale ``r1 ~ U(0, 1)``. The
official code clamps the stored parameters after each step; posjax clamps them where they are read, with the
gradient passed straight through the clamp, so a parameter below ``eps`` keeps training (the forward pass is the
official one; the stored value may sit below ``eps`` where the official one is reset to it). The encoder's form is
symmetric in ``|r|``, the decoders' the same under the causal mask. It is a :class:`posjax.kernels.Kerple` term:
every kernel computes it (the Pallas kernels per tile, with ``r1`` and ``r2``'s gradients as per-tile sums).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from posjax import kernels
from posjax.positions import base


@dataclasses.dataclass(frozen=True)
class KerpleOptions:
  """eps: the smallest value of r1 and r2 (the official 0.01)."""

  eps: float = 1e-2

  def __post_init__(self):
    if not self.eps > 0:
      raise ValueError(f"eps={self.eps} must be positive")


def clamp_straight_through(x, low: float, high: float | None = None):
  """``clip(x, low, high)`` forward, the identity backward: a clamped parameter keeps its gradient."""
  return x + jax.lax.stop_gradient(jnp.clip(x, low, high) - x)


def uniform_init(high: float):
  """U(0, high) with the heads' logical axis."""
  return nn.with_logical_partitioning(lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, 0.0, high),
                                      (base.HEADS,))


class KerpleLayer(nn.Module):
  """Each layer's ``r1``, ``r2`` and its :class:`posjax.kernels.Kerple` term."""

  spec: base.PositionSpec

  @nn.compact
  def __call__(self, q, k, state, scale):
    spec, eps = self.spec, self.spec.options.eps
    kind = spec.name.removeprefix("kerple_")
    power = kind == "power"
    r1 = clamp_straight_through(self.param("r1", uniform_init(1.0 if power else 2.0), (spec.num_heads,),
                                           spec.param_dtype), eps)
    r2 = clamp_straight_through(self.param("r2", uniform_init(2.0 if power else 1.0), (spec.num_heads,),
                                           spec.param_dtype), eps, 2.0 if power else None)
    return base.LayerTerms(q, k, terms=kernels.Terms(kerple=kernels.Kerple(r1, r2, kind)))


base.register(base.Method("kerple_log", KerpleOptions, layer=KerpleLayer,
                          summary="KERPLE log kernel: -r1 log(1 + r2 |j-i|) per head and layer (Chi et al. 2022)"))
base.register(base.Method("kerple_power", KerpleOptions, layer=KerpleLayer,
                          summary="KERPLE power kernel: -r1 |j-i|^r2 per head and layer (Chi et al. 2022)"))
