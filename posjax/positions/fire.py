"""FIRE (Li et al., ICLR 2024, "Functional Interpolation for Relative Positions Improves Long Context Transformers"):
each layer's bias is a small MLP of the log-scaled distance, normalised by the query's position::

    b(i, j) = f_θ( ψ(|r|) / (ψ(max(L, p_i)) + eps) ),   ψ(x) = log(c x + 1),   r = p_j - p_i

``f_θ`` is ``1 -> mlp_width -> H`` with a ReLU (a bias per head), ``c`` learned (initialised at 0.1) and ``L`` a
threshold learned as a multiplier of its initial value: below ``L`` the normaliser is fixed, so the bias is a function
of the distance alone; past it, distances are interpolated into ``[0, 1]`` by the query's position. ``mlp_width=32``,
``c=0.1`` and ``eps=1e-6`` are the official module's defaults. Its ``init_L=512`` is an absolute number, set for the
paper's language models trained on 2,048-token rows, where a quarter of each row's queries sit below ``L`` and the
rest are interpolated. [unconfirmed: the paper's setting of ``L`` for other training lengths] ``L`` starts at
``threshold_ratio`` (1/4) of the training length (``original_max_len``, else the model's ``max_len``), so
interpolation acts in training at every length: at 32 tokens, L = 8. ``threshold=512`` gives the official module's
absolute value, which a model trained at 512 tokens or fewer never passes. A warm start at a longer ``max_len`` keeps
its base run's L (its ``max_len`` becomes ``original_max_len``).
[unconfirmed] The paper's form is causal; the encoders' form here reads ``|r|`` (symmetric), the decoders' the same
under the causal mask. The MLP starts as the official module's ``nn.Linear`` layers do (``init="torch"``: weights
and biases from ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``, so the first layer's from ``U(-1, 1)``: its units switch
on at different distances instead of all at 0); ``init="flax"``: flax's LeCun normal with zero biases. One MLP
per layer (``share_across_layers=True``: one for the encoder). It is a :class:`posjax.kernels.Fire` term: every kernel computes it (the Pallas kernels per tile, a hidden unit at a time,
with the MLP's, ``c``'s and ``L``'s gradients as per-tile sums).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax

from posjax import kernels
from posjax.positions import base


@dataclasses.dataclass(frozen=True)
class FireOptions:
  """mlp_width: the MLP's hidden width (32). c: ψ's initial scale (0.1). threshold: L's initial value (None:
  ``threshold_ratio`` of the training length). threshold_ratio: that fraction (0.25). original_max_len: the training
  length it is a fraction of (None: the model's ``max_len``). eps: added to the normaliser (1e-6).
  share_across_layers: one MLP for every layer (False: one per layer). init: the MLP's initialisation, ``torch`` (the official module's PyTorch ``nn.Linear`` default) or ``flax``."""

  mlp_width: int = 32
  c: float = 0.1
  threshold: float | None = None
  threshold_ratio: float = 0.25
  original_max_len: int | None = None
  eps: float = 1e-6
  share_across_layers: bool = False
  init: str = "torch"

  def __post_init__(self):
    if self.mlp_width < 1:
      raise ValueError(f"mlp_width={self.mlp_width} must be >= 1")
    base.check_choice("init", self.init, ("torch", "flax"))
    if not self.c > 0 or not self.threshold_ratio > 0 or not (self.threshold is None or self.threshold > 0):
      raise ValueError(f"c={self.c}, threshold={self.threshold} and threshold_ratio={self.threshold_ratio} must be "
                       "positive (threshold None: threshold_ratio of the training length)")
    if self.original_max_len is not None and self.original_max_len < 1:
      raise ValueError(f"original_max_len={self.original_max_len} must be >= 1 (or None for the model's max_len)")


def initial_threshold(spec: base.PositionSpec) -> float:
  """L's initial value: ``threshold``, else ``threshold_ratio`` of the training length."""
  o = spec.options
  if o.threshold is not None:
    return float(o.threshold)
  return o.threshold_ratio * (o.original_max_len or spec.max_len)


class FireFunction(nn.Module):
  """The MLP, ``c`` and ``L`` of one FIRE bias, as :class:`posjax.kernels.Fire`."""

  spec: base.PositionSpec

  @nn.compact
  def __call__(self) -> kernels.Terms:
    spec, o = self.spec, self.spec.options
    param = lambda name, init, shape, axes: self.param(name, nn.with_logical_partitioning(init, axes), shape,
                                                       spec.param_dtype)
    if o.init == "torch":  # nn.Linear's: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for the weights and the biases
      uniform = lambda fan_in: lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -fan_in ** -0.5,
                                                                            fan_in ** -0.5)
      (w1_init, b1_init), (w2_init, b2_init) = (uniform(1), uniform(1)), (uniform(o.mlp_width), uniform(o.mlp_width))
    else:
      lecun = nn.initializers.lecun_normal()
      w1_init, w2_init = lambda key, shape, dtype: lecun(key, (1, shape[0]), dtype)[0], lecun
      b1_init = b2_init = nn.initializers.zeros_init()
    w1 = param("w1", w1_init, (o.mlp_width,), (None,))
    b1 = param("b1", b1_init, (o.mlp_width,), (None,))
    w2 = param("w2", w2_init, (o.mlp_width, spec.num_heads), (None, base.HEADS))
    b2 = param("b2", b2_init, (spec.num_heads,), (base.HEADS,))
    c = param("c", nn.initializers.constant(o.c), (), ())
    multiplier = param("threshold_multiplier", nn.initializers.ones_init(), (), ())
    return kernels.Terms(fire=kernels.Fire(w1, b1, w2, b2, c, multiplier * initial_threshold(spec), eps=o.eps))


class FireEncoder(base.SharedTermsEncoder):
  """Encoder-level part: the shared function, when ``share_across_layers``."""

  def layer_terms(self):
    return FireFunction(self.spec, name="fire")()


class FireLayer(base.SharedTermsLayer):
  """Per-layer part: this layer's (or the shared) FIRE bias."""

  def layer_terms(self):
    return FireFunction(self.spec, name="fire")()


base.register(base.Method("fire", FireOptions, encoder=FireEncoder, layer=FireLayer,
                          summary="FIRE: an MLP of the log distance normalised by the query's position (Li et al.)"))
