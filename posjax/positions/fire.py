"""FIRE (Li et al., ICLR 2024, "Functional Interpolation for Relative Positions Improves Long Context Transformers"):
each layer's bias is a small MLP of the log-scaled distance, normalised by the query's position::

    b(i, j) = f_θ( ψ(|r|) / (ψ(max(L, p_i)) + eps) ),   ψ(x) = log(c x + 1),   r = p_j - p_i

``f_θ`` is ``1 -> mlp_width -> H`` with a ReLU (a bias per head), ``c`` learned (initialised at 0.1) and ``L`` a
threshold learned as a multiplier of ``threshold`` (512): below ``L`` the normaliser is fixed, so the bias is a
function of the distance alone; past it, distances are interpolated into ``[0, 1]`` by the query's position. These
are the official defaults (their ``FIRE`` module: ``mlp_width=32``, ``init_c=0.1``, ``init_L=512``, ``eps=1e-6``).
[unconfirmed] The paper's form is causal; the encoders' form here reads ``|r|`` (symmetric), the decoders' the same
under the causal mask. The MLP takes flax's default initialisation (LeCun normal, zero biases; the official code
PyTorch's). One MLP per layer (``share_across_layers=True``: one for the encoder). It is a
:class:`posjax.kernels.Fire` term: every kernel computes it (the Pallas kernels per tile, a hidden unit at a time,
with the MLP's, ``c``'s and ``L``'s gradients as per-tile sums).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import flax.struct

from posjax import kernels
from posjax.positions import base


@dataclasses.dataclass(frozen=True)
class FireOptions:
  """mlp_width: the MLP's hidden width (32). c: ψ's initial scale (0.1). threshold: L's initial value (512).
  eps: added to the normaliser (1e-6). share_across_layers: one MLP for every layer (False: one per layer)."""

  mlp_width: int = 32
  c: float = 0.1
  threshold: float = 512.0
  eps: float = 1e-6
  share_across_layers: bool = False

  def __post_init__(self):
    if self.mlp_width < 1:
      raise ValueError(f"mlp_width={self.mlp_width} must be >= 1")
    if not self.threshold > 0 or not self.c > 0:
      raise ValueError(f"c={self.c} and threshold={self.threshold} must be positive")


class FireFunction(nn.Module):
  """The MLP, ``c`` and ``L`` of one FIRE bias, as :class:`posjax.kernels.Fire`."""

  spec: base.PositionSpec

  @nn.compact
  def __call__(self) -> kernels.Terms:
    spec, o = self.spec, self.spec.options
    lecun = nn.initializers.lecun_normal()
    param = lambda name, init, shape, axes: self.param(name, nn.with_logical_partitioning(init, axes), shape,
                                                       spec.param_dtype)
    w1 = param("w1", lambda key, shape, dtype: lecun(key, (1, shape[0]), dtype)[0], (o.mlp_width,), (None,))
    b1 = param("b1", nn.initializers.zeros_init(), (o.mlp_width,), (None,))
    w2 = param("w2", lecun, (o.mlp_width, spec.num_heads), (None, base.HEADS))
    b2 = param("b2", nn.initializers.zeros_init(), (spec.num_heads,), (base.HEADS,))
    c = param("c", nn.initializers.constant(o.c), (), ())
    multiplier = param("threshold_multiplier", nn.initializers.ones_init(), (), ())
    return kernels.Terms(fire=kernels.Fire(w1, b1, w2, b2, c, multiplier * o.threshold, eps=o.eps))


@flax.struct.dataclass(kw_only=True)
class FireState(base.PositionState):
  """FIRE's state: the shared function's terms when one serves every layer (else None)."""

  shared: kernels.Terms | None = None


class FireEncoder(nn.Module):
  """Encoder-level part: the shared function, when ``share_across_layers``."""

  spec: base.PositionSpec

  @nn.compact
  def __call__(self, positions_BxL):
    base.check_rows("positions", positions_BxL)
    shared = FireFunction(self.spec, name="fire")() if self.spec.options.share_across_layers else None
    return FireState(positions=positions_BxL, shared=shared)


class FireLayer(nn.Module):
  """Per-layer part: this layer's (or the shared) FIRE bias."""

  spec: base.PositionSpec

  @nn.compact
  def __call__(self, q, k, state: FireState, scale):
    terms = state.shared if self.spec.options.share_across_layers else FireFunction(self.spec, name="fire")()
    return base.LayerTerms(q, k, terms=terms)


base.register(base.Method("fire", FireOptions, encoder=FireEncoder, layer=FireLayer,
                          summary="FIRE: an MLP of the log distance normalised by the query's position (Li et al.)"))
