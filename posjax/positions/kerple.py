"""KERPLE (Chi, Fan, Ramadge, Rudnicky; NeurIPS 2022): a conditionally positive definite kernel of the distance as
each layer's bias, two learned positive scalars per head.

| method         | bias at (i, j), r = p_j - p_i        |
|----------------|--------------------------------------|
| kerple_log     | ``-r1 log(1 + r2 |r|)``              |
| kerple_power   | ``-r1 |r|^r2``, ``0 < r2 <= 2``       |

As the official code (chijames/KERPLE, ``megatron/model/gpt2_model.py``: one ``ParallelKerpleLog`` /
``ParallelKerplePower`` built once and handed to every layer): one ``(r1, r2)`` per head for the whole model
(``share_across_layers=True``, the default; ``False``: a pair per head in every layer), kept at or above
``eps = 0.01``; the log kernel draws ``r1 ~ U(0, 2)``, ``r2 ~ U(0, 1)``, the power
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
  """eps: the smallest value of r1 and r2 (the official 0.01). share_across_layers: one (r1, r2) per head for every
  layer (the official code's; False: one per layer)."""

  eps: float = 1e-2
  share_across_layers: bool = True

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


def kerple_terms(module: nn.Module, spec: base.PositionSpec) -> kernels.Terms:
  """``module``'s ``r1``, ``r2`` (declared in it: the encoder's when shared, else the layer's) as a
  :class:`posjax.kernels.Kerple` term."""
  eps, kind = spec.options.eps, spec.name.removeprefix("kerple_")
  power = kind == "power"
  r1 = clamp_straight_through(module.param("r1", uniform_init(1.0 if power else 2.0), (spec.num_heads,),
                                           spec.param_dtype), eps)
  r2 = clamp_straight_through(module.param("r2", uniform_init(2.0 if power else 1.0), (spec.num_heads,),
                                           spec.param_dtype), eps, 2.0 if power else None)
  return kernels.Terms(kerple=kernels.Kerple(r1, r2, kind))


class KerpleEncoder(base.SharedTermsEncoder):
  """Encoder-level part: the shared ``r1``, ``r2``, when ``share_across_layers``."""

  def layer_terms(self):
    return kerple_terms(self, self.spec)


class KerpleLayer(base.SharedTermsLayer):
  """Per-layer part: the shared kernel's term, or this layer's own ``r1``, ``r2``."""

  def layer_terms(self):
    return kerple_terms(self, self.spec)


base.register(base.Method("kerple_log", KerpleOptions, encoder=KerpleEncoder, layer=KerpleLayer,
                          summary="KERPLE log kernel: -r1 log(1 + r2 |j-i|) per head (Chi et al. 2022)"))
base.register(base.Method("kerple_power", KerpleOptions, encoder=KerpleEncoder, layer=KerpleLayer,
                          summary="KERPLE power kernel: -r1 |j-i|^r2 per head (Chi et al. 2022)"))
