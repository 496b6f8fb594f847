"""PaTH attention (Yang, Shen, Wen, Tan, Mishra, Ren, Panda, Kim; NeurIPS 2025, "PaTH Attention: Position Encoding
via Accumulating Householder Transformations", arXiv 2505.16381; official code fla-org/flash-linear-attention,
``fla/layers/path_attn.py``): the content logits become ``q_i^T H_i ... H_{j+1} k_j`` with a data-dependent
Householder-like factor per token and key/value head,

    H_t = I - β_t w_t w_t^T,   β_t = β_max sigmoid(x_t · b),   w_t = l2norm(silu(conv(x_t W_w)))

so the order of the tokens, and what they say, moves each key relative to each query (no position index is read;
:class:`posjax.kernels.Path` computes the products). As the official ``PaTHAttention``:

- ``w_rank``: ``x W_w`` is low rank, ``hidden -> w_rank -> kv heads x head_dim`` (two projections without biases),
  rank 32 by default (the official ``use_low_rank_w=True``, whatever the heads; its first release used a full
  projection with grouped k/v heads); 0: a full ``hidden -> kv heads x head_dim`` projection
  (``use_low_rank_w=False``).
- ``conv_width``: a causal depthwise convolution of ``w`` over the tokens, without a bias, then SiLU (the official
  ``ShortConvolution(kv_dim, conv_size=3)``; ``use_w_shortconv``); 0: neither. Packed documents restart it at each
  position 0, as the official restarts it per sequence (``cu_seqlens``).
- ``w`` normalised per head, ``w / sqrt(|w|^2 + 1e-6)`` (fla's ``l2_norm``).
- ``beta_max``: ``β = beta_max sigmoid(.)``, one per token and key/value head, with a bias (``bt_proj``); the official
  2 lets a factor reach ``-1`` eigenvalues (a reflection), 1 keeps them in ``[0, 1]``; past 2 a factor would stretch
  (an eigenvalue below -1, products growing with the distance), so it is refused.
- ``forget``: PaTH-FoX, the Forgetting Transformer's gate added to the logits, one per query head
  (``use_forget_gate``; :class:`posjax.kernels.Forget`, FoX's full gate), scaled with ``q·k`` as the official kernel
  and reference scale it: ``softmax(scale (q_i^T P k_j + c_i - c_j))`` (FoX alone adds it unscaled).
- ``chunk``: the dense form's chunk (:class:`posjax.kernels.Path`): memory and speed, not the result.
- ``band``: the Pallas kernels' blocks (:class:`posjax.kernels.Path`'s ``band``): memory and speed, not the result.

The official ``use_qk_norm`` (off in its model configs) is the attention layer's ``qk_norm``: per head in fla's
current code (``qk_norm_axes="head"``), over all heads in its first release (``"all"``). [choice] Initialisation:
every projection N(0, 0.02) and zero biases (fla's ``_init_weights`` for linear and convolution layers). A decoder's
method only. Kernels: the ``xla`` path and the Pallas kernels on GPU and TPU (each block's own logits dense, the
products across blocks through copies of the keys: :func:`posjax.kernels.terms.path.blocks`); cuDNN refuses it.
Decoding keeps the keys of its cache carried to the newest token, as the official decoding: each step
applies the new token's factor to every cached key (:meth:`posjax.kernels.Path.step`, in float32, stored in the
cache's dtype: a bfloat16 cache rounds the carried keys at every step, as the official one) then attends with plain
``q·k``; the convolution's last inputs are cached beside them. Padding: the official code removes it first; here a
padded token's factor applies like any token's, so each document's real tokens must be consecutive (right or left
padding and packed documents are; a padding token between a key and its query is not supported).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from posjax import kernels
from posjax.positions import base, fox

EPS = 1e-6  # fla's l2_norm


@dataclasses.dataclass(frozen=True)
class PathOptions:
  """w_rank: the w projection's rank (32; 0: full). conv_width: the causal convolution of w (3; 0: none). beta_max:
  ``β``'s range ``(0, beta_max)``, at most 2 (2). forget: PaTH-FoX's gate (False). chunk: the dense form's chunk
  (64). band: the Pallas kernels' blocks (256)."""

  w_rank: int = 32
  conv_width: int = 3
  beta_max: float = 2.0
  forget: bool = False
  chunk: int = kernels.terms.path.CHUNK
  band: int = kernels.terms.path.BAND

  def __post_init__(self):
    if self.w_rank < 0:
      raise ValueError(f"w_rank={self.w_rank} must be >= 0 (0: a full projection; 32: the official low rank)")
    if self.conv_width < 0:
      raise ValueError(f"conv_width={self.conv_width} must be >= 0 (0: no convolution)")
    if not 0 < self.beta_max <= 2:
      raise ValueError(f"beta_max={self.beta_max} must be in (0, 2] (2: the official range, reflections included; past "
                       "2 a factor stretches)")
    for name in ("chunk", "band"):
      if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
        raise ValueError(f"{name}={getattr(self, name)!r} must be an int >= 1")


def short_convolution(x_BxLxGxK, kernel_WxGxK, positions_BxL, context_BxCxGxK=None):
  """``[B, L, G, K]``: ``silu(Σ_s kernel[W-1-s] x_{t-s})`` over the taps ``s < W`` with ``p_t >= s`` (a document
  restarts at position 0), ``x`` before the first token read from ``context`` (the ``W - 1`` previous inputs of a
  decoding cache; default zeros), as PyTorch's ``conv1d`` on ``W - 1`` left pads."""
  width, length = kernel_WxGxK.shape[0], x_BxLxGxK.shape[1]
  if context_BxCxGxK is None:
    context_BxCxGxK = jnp.zeros((x_BxLxGxK.shape[0], width - 1, *x_BxLxGxK.shape[2:]), x_BxLxGxK.dtype)
  extended_BxCLxGxK = jnp.concatenate([context_BxCxGxK, x_BxLxGxK], axis=1)
  positions_BxL = jnp.asarray(positions_BxL)
  out_BxLxGxK = jnp.zeros(x_BxLxGxK.shape, jnp.float32)
  for s in range(width):
    tap_BxLxGxK = jax.lax.slice_in_dim(extended_BxCLxGxK, width - 1 - s, width - 1 - s + length, axis=1)
    tap_BxLxGxK = jnp.where((positions_BxL >= s)[:, :, None, None], tap_BxLxGxK * kernel_WxGxK[width - 1 - s], 0.0)
    out_BxLxGxK = out_BxLxGxK + tap_BxLxGxK
  return jax.nn.silu(out_BxLxGxK)


class PathLayer(nn.Module):
  """One layer's Householder factors from the layer's input ``x``: a :class:`posjax.kernels.Path` term (and
  PaTH-FoX's forget gate). ``decode``: keep the convolution's last inputs in the ``cache`` collection."""

  spec: base.PositionSpec

  @nn.compact
  def __call__(self, q, k, state: base.PositionState, scale, x_BxLxD, decode: bool = False):
    spec, o = self.spec, self.spec.options
    g, d = spec.kv_heads, spec.head_dim
    dense = lambda features, axes, name, **kw: nn.DenseGeneral(
        features, dtype=spec.dtype, param_dtype=spec.param_dtype, kernel_init=base.normal_init(axes), name=name, **kw)
    if o.w_rank:
      x_w = dense(o.w_rank, (base.EMBED, None), "w_down", use_bias=False)(x_BxLxD)
      x_w_BxLxGxK = dense((g, d), (None, base.HEADS, base.KV), "w_up", use_bias=False)(x_w)
    else:
      x_w_BxLxGxK = dense((g, d), (base.EMBED, base.HEADS, base.KV), "w", use_bias=False)(x_BxLxD)
    x_w_BxLxGxK = x_w_BxLxGxK.astype(jnp.float32)
    positions_BxL = jnp.broadcast_to(state.positions, x_BxLxD.shape[:2])
    if o.conv_width:
      kernel_WxGxK = self.param("w_conv", base.normal_init((None, base.HEADS, base.KV)), (o.conv_width, g, d),
                                spec.param_dtype).astype(jnp.float32)
      context_BxCxGxK = None
      if decode:  # the convolution's last inputs, kept across decoding steps
        started = self.has_variable("cache", "w_inputs")
        inputs = self.variable("cache", "w_inputs", jnp.zeros, (x_BxLxD.shape[0], o.conv_width - 1, g, d),
                               jnp.float32)
        if started:
          context_BxCxGxK = inputs.value
          inputs.value = jnp.concatenate([inputs.value, x_w_BxLxGxK], axis=1)[:, x_w_BxLxGxK.shape[1]:]
      x_w_BxLxGxK = short_convolution(x_w_BxLxGxK, kernel_WxGxK, positions_BxL, context_BxCxGxK)
    w_BxLxGxK = x_w_BxLxGxK * jax.lax.rsqrt(jnp.sum(jnp.square(x_w_BxLxGxK), axis=-1, keepdims=True) + EPS)
    beta_BxLxG = o.beta_max * jax.nn.sigmoid(
        dense(g, (base.EMBED, base.HEADS), "beta", bias_init=base.zeros_init((base.HEADS,)))(x_BxLxD)
        .astype(jnp.float32))
    terms = kernels.Terms(path=kernels.Path(w_BxLxGxK, beta_BxLxG, o.chunk, o.band))
    if o.forget:  # scaled with q·k, as the official kernel and reference: softmax(scale (q^T P k + c_i - c_j))
      forget = fox.full_gate(spec, x_BxLxD, positions_BxL)
      terms = terms.replace(forget=forget.replace(c=scale * forget.c))
    return base.LayerTerms(q, k, terms=terms)


base.register(base.Method("path", PathOptions, layer=PathLayer, reads_input=True, decoder_only=True, caches=True,
                          summary="PaTH attention: data-dependent Householder products between each key and query "
                                  "(Yang et al. 2025)"))
