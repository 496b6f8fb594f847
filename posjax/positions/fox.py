"""Forgetting Attention (Lin, Nikishin, He, Courville; ICLR 2025, "Forgetting Transformer: Softmax Attention with a
Forget Gate"; official code zhixuan-lin/forgetting-transformer): a forget gate per head and token computed from the
layer's input, ``f_t = sigmoid(w_h · x_t + b_h)``, and the logits

    z_ij = scale q_i · k_j + c_i - c_j,   c_i = Σ_{t <= i} log f_t

so a key's weight decays by the gates between it and the query (``Π_{j<t<=i} f_t``): a data-dependent, learned
recency bias, and FoX's only position signal by default (the official ``use_rope=False``). The paper's form is
causal; [unconfirmed] an encoder's adds ``c_j - c_i`` for a later key, the gates between the two tokens either way.

Options, as the official ``ForgettingAttentionLayer``'s:

- ``gate``: ``full`` (the default: a ``hidden -> heads`` linear layer with a bias, weights from N(0, 0.02) and zero
  biases, the official ``fgate_proj`` under its ``_initialize_weights``), ``bias_only`` (a learned bias per head, no
  data dependence) or ``fixed`` (that bias, not trained).
- ``decay_time``: ``(T_min, T_max)``: the bias per head ``-log(expm1(1 / T))``, ``T`` log-spaced from ``T_min`` to
  ``T_max`` over the heads (gates whose product over ``T`` tokens is about ``1/e``), the official
  ``fgate_bias_init`` with ``decay_time_min`` / ``decay_time_max``; required by ``fixed``, optional for
  ``bias_only``, and, as in the official code, not taken by ``full``.
- ``rope``: also rotate q and k as RoPE (the official ``use_rope``), base ``rope_base`` (the official 500,000).

Packed documents: ``c`` restarts at each position 0 (:func:`posjax.kernels.terms.forget_sums`). Grouped-query
attention: one gate per query head, as the official code (its k/v heads are never grouped). It is a
:class:`posjax.kernels.Forget` term: every kernel computes it (the Pallas kernels per tile from ``c``'s rows, its
gradient as the dq kernel's row sums and the dk/dv kernel's column sums, no atomics); decoding keeps each key's
``c`` in the cache, which the decode kernels read per tile like its k and v. Left out: the "Pro" block's output
gate, output norm, QK-norm and k/v token shift, which are parts of the attention block rather than of the position
signal.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from posjax import kernels
from posjax.positions import base, rotary

GATES = ("full", "bias_only", "fixed")


@dataclasses.dataclass(frozen=True)
class FoxOptions:
  """gate: ``full`` | ``bias_only`` | ``fixed``. decay_time: ``(T_min, T_max)`` of the gate biases' initialisation
  (None: zero biases). rope: rotate q and k as RoPE too (False). rope_base: its base (500,000)."""

  gate: str = "full"
  decay_time: tuple[float, float] | None = None
  rope: bool = False
  rope_base: float = 500_000.0

  def __post_init__(self):
    base.check_choice("gate", self.gate, GATES)
    if self.decay_time is not None and (len(self.decay_time) != 2 or not min(self.decay_time) > 0):
      raise ValueError(f"decay_time={self.decay_time!r} must be two positive times (T_min, T_max) in tokens")
    if self.gate == "fixed" and self.decay_time is None:
      raise ValueError("gate='fixed' is its initial bias, never trained: give decay_time=(T_min, T_max)")
    if self.gate == "full" and self.decay_time is not None:
      raise ValueError("decay_time initialises the bias of gate='bias_only' or 'fixed' (as the official code); "
                       "gate='full' starts its bias at 0")


def decay_bias(num_heads: int, decay_time: tuple[float, float]) -> np.ndarray:
  """``[H]`` the official ``fgate_bias_init``: ``-log(expm1(1 / T))``, ``T`` log-spaced over the heads, so that
  ``-1 / log(sigmoid(b)) = T``."""
  t_H = np.exp(np.linspace(math.log(decay_time[0]), math.log(decay_time[1]), num_heads))
  return (-np.log(np.expm1(1.0 / t_H))).astype(np.float32)


class FoxPositions(nn.Module):
  """The encoder-level part: RoPE's angles where ``rope``, else only the positions."""

  spec: base.PositionSpec

  @nn.compact
  def __call__(self, positions_BxL):
    base.check_rows("positions", positions_BxL)
    if not self.spec.options.rope:
      return base.PositionState(positions=positions_BxL)
    sin, cos = rotary.rotation(positions_BxL, self.spec.head_dim,
                               rotary.RopeOptions(max_timescale=self.spec.options.rope_base))
    return rotary.RotaryState(positions=positions_BxL, sin=sin, cos=cos)


def gate_term(logit_BxLxH, positions_BxL) -> kernels.Forget:
  """The forget term of the gates' logits: ``c`` the cumulative ``log sigmoid`` per query head."""
  log_f_BxHxL = jax.nn.log_sigmoid(logit_BxLxH.astype(jnp.float32)).transpose(0, 2, 1)
  return kernels.Forget(kernels.terms.forget_sums(log_f_BxHxL, positions_BxL))


def full_gate(spec: base.PositionSpec, x_BxLxD, positions_BxL) -> kernels.Forget:
  """The official full gate, a ``hidden -> heads`` linear layer ``gate`` with a bias (weights N(0, 0.02), zero
  biases), as the forget term; called inside a module's compact method (its parameters are that module's)."""
  logit_BxLxH = nn.DenseGeneral(spec.num_heads, dtype=spec.dtype, param_dtype=spec.param_dtype,
                                kernel_init=base.normal_init((base.EMBED, base.HEADS)),
                                bias_init=base.zeros_init((base.HEADS,)), name="gate")(x_BxLxD)
  return gate_term(logit_BxLxH, positions_BxL)


class ForgetGate(nn.Module):
  """One layer's forget gate, from the layer's input ``x``: its cumulative log gates as a
  :class:`posjax.kernels.Forget` term."""

  spec: base.PositionSpec

  @nn.compact
  def __call__(self, q, k, state: base.PositionState, scale, x_BxLxD):
    spec, o = self.spec, self.spec.options
    heads = spec.num_heads
    positions_BxL = jnp.broadcast_to(state.positions, x_BxLxD.shape[:2])
    if o.gate == "full":
      forget = full_gate(spec, x_BxLxD, positions_BxL)
    else:
      start = (np.zeros(heads, np.float32) if o.decay_time is None else decay_bias(heads, o.decay_time))
      if o.gate == "fixed":
        bias_H = jnp.asarray(start)
      else:
        bias_H = self.param("gate_bias", nn.with_logical_partitioning(lambda *_: jnp.asarray(start, spec.param_dtype),
                                                                       (base.HEADS,)))
      logit_BxLxH = jnp.broadcast_to(bias_H, (*x_BxLxD.shape[:2], heads))
      forget = gate_term(logit_BxLxH, positions_BxL)
    terms = kernels.Terms(forget=forget)
    if o.rope:
      q, k = (rotary.rotate(x, state.sin, state.cos) for x in (q, k))
    return base.LayerTerms(q, k, terms=terms)


base.register(base.Method("fox", FoxOptions, encoder=FoxPositions, layer=ForgetGate, reads_input=True,
                          summary="Forgetting Attention: a data-dependent forget gate's cumulative log as a bias "
                                  "(Lin et al. 2025)"))
