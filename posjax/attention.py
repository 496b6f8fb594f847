"""Multi-head self-attention with a pluggable position method and a choice of kernel.

One layer: project ``x`` to q, k, v; let the position method's per-layer module transform q/k and add its
terms; add the shared bias the encoder computed once; mask padding and cross-segment pairs; softmax in
float32; dropout on the weights. Kernels (``kernel=``):

- ``xla``: the dense path; computes every method; the default and the CPU path. Its position bias and softmax are
  :mod:`posjax.kernels.xla`'s (``position_bias``, ``attention_weights``: the softmax, or the terms that read the
  masked logits: CoPE's term, stick-breaking's weights), the reference every kernel is tested against; only the
  multiplicative Methods 1-3 and Shaw's value term add their own dense forms
  (:class:`posjax.positions.base.DenseLayerTerms`).
- ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")`` on GPU in bf16/fp16. It takes q/k transforms and
  an additive bias (segments are folded into it) and padding as sequence lengths where every row is right-padded, else
  as a bias (chosen at run time: any layout is exact). It cannot compute the multiplicative Methods 1-3 or Shaw's
  value term, nor dropout on the attention weights: asking for it there is an error. TUPE's untied term and its [CLS]
  reset are folded into q and k (exact, :mod:`posjax.kernels.fold`; :func:`cudnn_inputs`): TUPE-A runs with no bias,
  TUPE-R with only its bucket bias, instead of a dense ``[B, H, L, L]`` bias and its gradient; where the folded head
  dim would pass cuDNN's limit (:func:`cudnn_max_head_dim`) or the batch's positions are unknown, the dense bias.
- ``pallas``: :func:`posjax.kernels.relative_attention`, flash attention with the method's terms built inside each
  tile from the batch's positions (ALiBi, T5 / TUPE-R buckets, TUPE's untied term and [CLS] reset, Shaw / Method 4
  vectors; q/k transforms such as RoPE before it). No ``[B, H, L, L]`` array is kept for the backward pass. Shaw /
  Method 4 with a table wider than two tiles read it windowed, which takes positions rising by one inside each
  segment; a batch where they do not (Hugging Face's left-padded ids) runs on the dense path instead, chosen at run
  time (:mod:`posjax.kernels.exact`). Attention dropout uses a hashed mask that the kernel recomputes per tile
  (:mod:`posjax.kernels.dropout`; other draws than the ``xla`` path's). Not Methods 1-3 or Shaw's value term (an
  error). On a CPU it runs in Pallas interpret mode: slow, but the same outputs and gradients as ``xla``, for tests
  and for checking a model.
- ``auto``: ``cudnn`` where it can compute the layer, otherwise ``xla`` with a log line (it does not pick
  ``pallas``: its GPU speed has not been measured yet).

When the ``intermediates`` collection is mutable, every layer sows ``attention_logits``
``[B, H, L, L]``: scaled, with every position term, before masking (CoPE's term, which reads the masked logits, is
not in them).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import flax.linen as nn
import flax.struct
from absl import logging

from posjax import kernels, partitioning
from posjax.positions import base
from posjax.positions import temperature as temperature_lib

KERNELS = ("xla", "cudnn", "pallas", "auto")
FUSED_DTYPES = (jnp.bfloat16, jnp.float16)
_LOGGED: set[str] = set()  # fallback messages already logged (each layer of each trace would repeat them)


@flax.struct.dataclass
class Mask:
  """Which keys each query may attend to.

  Attributes:
    padding: ``[B, L]`` bool, True at real tokens; None when nothing is padded.
    segment_ids: ``[B, L]`` int; tokens attend only within their own segment (packed sequences).
    causal: query i attends to keys j <= i only (token order; a decoder). Every kernel takes it.
    sliding_window: query i attends to keys ``|i - j| < W`` only (token order, the query's own included): with
      ``causal`` the ``W`` keys ``i - W < j <= i`` (Mistral's, Hugging Face's ``sliding_window``), without it ``W - 1``
      on each side too (ModernBERT's ``local_attention = 2 (W - 1)``); 0: no window. Every kernel takes it; the
      Pallas kernels skip the tiles it rules out.
    chunk: query i attends to keys in its own aligned block of ``C`` tokens only, ``i // C == j // C`` (token order:
      Llama 4's chunked attention, Hugging Face's ``attention_chunk_size``); 0: none. The kernels take it as segments
      (:meth:`chunked`: each chunk a segment of its own within the row's), so they skip the other chunks' tiles as
      they skip other documents'.
  """

  padding: jax.Array | None = None
  segment_ids: jax.Array | None = None
  causal: bool = flax.struct.field(pytree_node=False, default=False)
  sliding_window: int = flax.struct.field(pytree_node=False, default=0)
  chunk: int = flax.struct.field(pytree_node=False, default=0)

  def __post_init__(self):
    for field in ("sliding_window", "chunk"):
      if not isinstance(getattr(self, field), int) or getattr(self, field) < 0:
        raise ValueError(f"Mask({field}={getattr(self, field)!r}) must be an int >= 1 (0: none)")

  def chunked(self, batch: int, length: int) -> "Mask":
    """This mask with its chunks as segments (``chunk`` 0 after): ``segment · ⌈L / C⌉ + i // C``, so that every
    kernel's segment mask and tile skipping compute them; itself without a chunk."""
    if not self.chunk:
      return self
    chunks_L = jnp.arange(length, dtype=jnp.int32) // self.chunk
    segments_BxL = jnp.zeros((batch, length), jnp.int32) if self.segment_ids is None else jnp.asarray(
        self.segment_ids, jnp.int32)
    return self.replace(segment_ids=segments_BxL * (-(-length // self.chunk)) + chunks_L[None], chunk=0)

  def pairs(self, length: int):
    """``[B or 1, 1, L or 1, L]`` bool, True where query i may attend to key j; None when all may."""
    if self.chunk:
      chunks_L = jnp.arange(length) // self.chunk
      same_LxL = chunks_L[:, None] == chunks_L[None, :]
      rest = self.replace(chunk=0).pairs(length)
      return same_LxL[None, None] if rest is None else rest & same_LxL[None, None]
    allowed = None
    if self.padding is not None:
      allowed = self.padding[:, None, None, :].astype(bool)
    if self.segment_ids is not None:
      same = self.segment_ids[:, None, :, None] == self.segment_ids[:, None, None, :]
      allowed = same if allowed is None else allowed & same
    if self.causal or self.sliding_window:
      distance_LxL = jnp.arange(length)[:, None] - jnp.arange(length)[None, :]
      near_LxL = (distance_LxL >= 0) if self.causal else jnp.ones((length, length), bool)
      if self.sliding_window:
        near_LxL = near_LxL & (jnp.abs(distance_LxL) < self.sliding_window)
      allowed = near_LxL[None, None] if allowed is None else allowed & near_LxL[None, None]
    return allowed


def check_kernel(kernel: str, spec: base.PositionSpec, *, dropout: bool = False) -> None:
  """Static check: the kernel exists and can compute the method with its options (and attention dropout where
  ``dropout``), as :meth:`posjax.positions.PositionSpec.refusal` says: one table,
  :func:`posjax.kernels.capability.refusal`, read from the method's own terms."""
  if kernel not in KERNELS:
    raise ValueError(f"unknown attention kernel {kernel!r}; allowed: {list(KERNELS)}")
  why = spec.refusal(kernel, dropout=dropout) if kernel in ("cudnn", "pallas") else None
  if why:
    raise ValueError(f"attention kernel {kernel!r} cannot compute position method {spec.name!r} with options "
                     f"{spec.options}: {why}; use kernel 'xla' (or 'auto', which falls back to it)")


def resolve_kernel(kernel: str, spec: base.PositionSpec, *, dtype, dropout: bool, platform: str | None = None) -> str:
  """The kernel one call runs on: ``xla``, ``cudnn`` or ``pallas`` (``platform``: the device compiled for,
  default the default backend's); ``auto`` takes cuDNN where it can compute the layer, else ``xla``."""
  check_kernel(kernel, spec, dropout=dropout and kernel == "pallas")
  if kernel == "xla":
    return "xla"
  split = kernels.shard.context_shards()
  if split > 1 and kernel == "cudnn":
    raise ValueError(f"attention kernel 'cudnn' takes whole sequences, but the mesh splits the sequence over "
                     f"{split} context devices; use kernel 'xla' (or 'auto') or 'pallas', which score each "
                     "device's queries against the gathered keys, or mesh context=1")
  if kernel == "pallas":
    return "pallas"
  reasons = []
  if split > 1:
    reasons.append(f"the mesh splits the sequence over {split} context devices")
  why = spec.refusal("cudnn", dropout=dropout)
  if why:
    reasons.append(f"position method {spec.name!r}: {why}")
  if jnp.dtype(dtype) not in FUSED_DTYPES:
    reasons.append(f"compute dtype {jnp.dtype(dtype).name} is not bfloat16/float16")
  if kernel == "cudnn":
    if reasons:
      raise ValueError(f"attention kernel 'cudnn' cannot run this layer: {'; '.join(reasons)}")
    return "cudnn"
  platform = platform or jax.default_backend()
  if platform != "gpu":
    reasons.append(f"backend is {platform}")
  if reasons:
    message = f"attention kernel 'auto' uses 'xla' for {spec.name!r}: {'; '.join(reasons)}"
    if message not in _LOGGED:
      _LOGGED.add(message)
      logging.info(message)
    return "xla"
  return "cudnn"


def add_biases(*biases):
  """The sum of the biases that are not None (None when all are)."""
  present = [b for b in biases if b is not None]
  return sum(present[1:], present[0]) if present else None


def layer_bias(terms: base.LayerTerms, state: base.PositionState, scale: float):
  """``[B or Bp, H, L, L]`` float32 or None: the shared bias plus the layer's own terms' dense form, both from
  :func:`posjax.kernels.xla.position_bias` (the reference every kernel is tested against)."""
  own = None if terms.terms is None else kernels.xla.position_bias(terms.terms, state.positions, scale, terms.q,
                                                                   terms.k)
  return add_biases(state.bias, own)


def open_logits(terms: base.LayerTerms, state: base.PositionState, scale: float):
  """``[B, H, L, L]`` float32: the layer's content logits after its open terms (:class:`posjax.kernels.Term`, the
  encoder's and the layer's, in order; their dense form), before the built-in ones (:func:`layer_bias`)."""
  logits = terms.content_logits(scale)
  merged = kernels.merge(state.terms, terms.terms)
  if not merged.open:
    return logits
  b, length, heads = terms.q.shape[0], terms.q.shape[1], terms.q.shape[2]
  bound = kernels.bind_open(merged, state.positions, b, heads, length)
  return kernels.term.dense_logits(bound.open, state.positions, logits)


def cudnn_max_head_dim() -> int:
  """The widest q/k/v head cuDNN's flash attention takes (a multiple of 8): 256 from Hopper (sm_90) on, 128
  before (jax's own check); off a GPU (compiling ahead of time for posjax's targets, H100/H200) 256."""
  if jax.default_backend() == "gpu":
    capability = tuple(int(x) for x in str(getattr(jax.devices()[0], "compute_capability", "9.0")).split("."))
    return 256 if capability >= (9, 0) else 128
  return 256


def cudnn_inputs(terms: base.LayerTerms, state: base.PositionState, v_BxLxHxV, scale: float):
  """``(q, k, v, bias)`` for cuDNN at content scale ``scale``: TUPE's untied term folded into q and k
  (:func:`posjax.kernels.fold.fold_for_bias`, widths padded to a multiple of 8, v to the same width since cuDNN
  takes one head dim), so the bias holds only what is left (TUPE-R's buckets; None for TUPE-A); without an
  untied term, past :func:`cudnn_max_head_dim` or beside relative vectors (their dense form needs q and k), the
  layer's dense bias (:func:`layer_bias`)."""
  sources = [terms_ for terms_ in (state.terms, terms.terms) if terms_ is not None]
  folded = kernels.fold.fold_for_bias(terms.q, terms.k, v_BxLxHxV, sources, state.positions, scale,
                                      cudnn_max_head_dim())
  if folded is None:
    return (*one_head_dim(terms.q, terms.k, v_BxLxHxV), layer_bias(terms, state, scale))
  q, k, v, rest = folded
  bias = lambda terms_: kernels.xla.position_bias(terms_, state.positions, scale, terms.q, terms.k)
  return q, k, v, add_biases(*(bias(t) for t in rest))


def one_head_dim(q_BxLxHxK, k_BxLxGxK, v_BxLxGxV):
  """q, k and v padded with zeros to one head dim (cuDNN takes one; a method may widen q and k, as PoPE doubles
  them): the logits and the output's first ``V`` features unchanged."""
  width = max(q_BxLxHxK.shape[-1], v_BxLxGxV.shape[-1])
  pad = lambda x: jnp.pad(x, [(0, 0)] * 3 + [(0, width - x.shape[-1])])
  return pad(q_BxLxHxK), pad(k_BxLxGxK), pad(v_BxLxGxV)


def right_padded(padding_BxL):
  """Whether every row's real tokens come first and there is one at least (the layout cuDNN's sequence lengths
  describe; a row of length 0 goes in as a bias, averaging every key as the ``xla`` path does), a traced bool."""
  lengths_B = jnp.sum(padding_BxL, axis=-1, dtype=jnp.int32)
  first_BxL = jnp.arange(padding_BxL.shape[-1])[None, :] < lengths_B[:, None]
  return jnp.all(padding_BxL.astype(bool) == first_BxL) & jnp.all(lengths_B > 0)


def fused_attention(q, k, v, bias, mask: Mask, scale: float, implementation: str | None = "cudnn"):
  """``jax.nn.dot_product_attention`` with segments folded into the bias and padding as cuDNN takes it: sequence
  lengths where every row of the batch is right-padded, else (left padding, holes) a bias, chosen at run time
  (:func:`posjax.kernels.fall_back_where`), so every layout gives the real tokens the ``xla`` path's outputs.
  Padded queries of right-padded rows come out zero."""
  neg = 0.5 * jnp.finfo(q.dtype).min
  if mask.segment_ids is not None:
    same = mask.segment_ids[:, None, :, None] == mask.segment_ids[:, None, None, :]
    bias = add_biases(bias, jnp.where(same, 0.0, neg))
  window = (mask.sliding_window - 1, 0) if mask.sliding_window and mask.causal else None
  if mask.sliding_window and not mask.causal:  # cuDNN's windows look back only: a two-sided one is a bias
    length = q.shape[1]
    distance_LxL = jnp.abs(jnp.arange(length)[:, None] - jnp.arange(length)[None, :])
    bias = add_biases(bias, jnp.where(distance_LxL < mask.sliding_window, 0.0, neg)[None, None])
  attend = lambda q, k, v, bias, lengths=None: jax.nn.dot_product_attention(
      q, k, v, None if bias is None else bias.astype(q.dtype), scale=scale, is_causal=mask.causal,
      query_seq_lengths=lengths, key_value_seq_lengths=lengths, local_window_size=window,
      implementation=implementation)
  if mask.padding is None:
    return attend(q, k, v, bias)
  padding_BxL = mask.padding.astype(bool)
  with_lengths = lambda q, k, v, bias, padding_BxL: attend(q, k, v, bias, jnp.sum(padding_BxL, -1, dtype=jnp.int32))

  def with_bias(q, k, v, bias, padding_BxL):
    length = padding_BxL.shape[-1]
    keys_Bx1xLxL = jnp.broadcast_to(jnp.where(padding_BxL, 0.0, neg)[:, None, None, :], (len(padding_BxL), 1, length,
                                                                                         length))
    return attend(q, k, v, add_biases(bias, keys_Bx1xLxL))

  not_right = lambda out, q, k, v, bias, padding_BxL: ~right_padded(padding_BxL)
  return kernels.fall_back_where(not_right, with_lengths, with_bias)((q, k, v, bias), (padding_BxL,))


def check_state(spec: base.PositionSpec, state: base.PositionState | None, batch_length) -> base.PositionState:
  """The state a layer computes with: the one given, which must come from the method's encoder where the layer
  reads it (it then carries the batch's positions), or an empty one for a method whose layers read none."""
  if state is None:
    if spec.method.reads_state:
      raise ValueError(
          f"SelfAttention with position method {spec.name!r} needs the PositionState its encoder returns for this "
          f"batch: state = spec.method.encoder(spec=spec)(positions_BxL), then attention(x, state, mask)")
    return base.PositionState(positions=jnp.arange(batch_length[1], dtype=jnp.int32)[None])
  kernels.check_rows("state.positions", state.positions, *batch_length)
  return state


def check_mask(mask: Mask, batch: int, length: int) -> None:
  """Raises unless the mask's arrays are ``[batch, length]``: padding bool (or 0/1), segment ids integers."""
  if mask.padding is not None:
    kernels.check_rows("Mask.padding", mask.padding, batch, length, "mask")
  if mask.segment_ids is not None:
    kernels.check_rows("Mask.segment_ids", mask.segment_ids, batch, length)


class OffsetRMSNorm(nn.Module):
  """Gemma's RMSNorm: ``x / rms(x) · (1 + scale)`` over ``axes`` (default the last; ``names``: the scale's
  logical axes), ``scale`` from zero, computed in float32 and cast back."""
  epsilon: float
  dtype: Any
  param_dtype: Any
  axes: tuple[int, ...] = (-1,)
  names: tuple[str, ...] = (base.EMBED,)

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", base.zeros_init(self.names), tuple(x.shape[a] for a in self.axes), self.param_dtype)
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=self.axes, keepdims=True) + self.epsilon)
    return (y * (1.0 + scale.astype(jnp.float32))).astype(self.dtype)


class SelfAttention(nn.Module):
  """Self-attention with the position method of ``spec``; drop it into any linen model.

  Call with the ``PositionState`` the method's encoder-level module returned for this batch
  (``spec.method.encoder(spec=spec)(positions_BxL)``, every method, ``none`` included; built once and shared by
  all layers). It carries the batch's positions, from which the fused kernels build their terms. Without a state
  (``state=None``), only a method whose layers read none (``none``, ``absolute``, ``sinusoidal``) runs, at
  positions ``0..L-1``; any other is an error. ``platform`` names the device the program
  is compiled for (``gpu`` / ``tpu``; None: the default backend's), for ahead-of-time compilation on a CPU. Under a
  mesh, q, k, v and the heads' outputs are constrained by their logical axes (:mod:`posjax.partitioning`).

  Decoder options: ``spec.num_kv_heads`` below ``num_heads`` gives k and v that many heads (grouped-query
  attention; every kernel reads them per group, never repeated); ``use_bias`` is the q/k/v projections' bias and
  ``out_bias`` the output projection's (None: ``use_bias``; Qwen2 has q/k/v biases only); ``qk_norm``: an RMSNorm
  of q and of k (``q_norm``, ``k_norm``, epsilon ``norm_eps``) before the position method, over each head
  (``qk_norm_axes="head"``: one scale of ``head_dim`` shared by the heads, Qwen3's and Gemma 3's) or over all the
  heads' width at once (``"all"``: a scale per head and feature, OLMo 2's); ``qk_norm_offset``: Gemma's ``(1 + w)``
  form (:class:`OffsetRMSNorm`, Gemma 3's); ``qk_norm_scale=False``: no learned scale (Llama 4's L2 norm,
  ``x / sqrt(mean(x²) + eps)``). ``temperature``: a
  :class:`posjax.positions.temperature.Temperature` that scales each query by a factor of its position (Llama 4,
  Ministral, SSMax), after the q/k norms and before the position method; None: none. ``sinks``: a learned logit per
  head (``sinks [H]``, from zero: one more key of logit 0) in every row's softmax denominator
  (:class:`posjax.kernels.Sink`, GPT-OSS's), on every kernel but cuDNN. ``softcap``: the logits capped at
  ``softcap · tanh(s / softcap)`` after every position term (Gemma 2's ``attn_logit_softcapping``;
  :class:`posjax.kernels.SoftCap`); 0: none. A layer's open terms (:class:`posjax.kernels.Term`) apply on every
  kernel in the op's order: the open terms, then the built-in ones. ``query_block``: the ``xla`` kernel scores
  this many queries at a time (a loop whose blocks the backward pass recomputes: ``[B, H, query_block, L]`` logits
  alive, not ``[B, H, L, L]``); 0: all at once. Where the mesh splits the sequence (``context``), the ``xla``
  kernel scores each device's queries against the gathered keys
  (:func:`posjax.kernels.shard.per_context_shard`).
  """

  spec: base.PositionSpec
  kernel: str = "xla"
  dropout_rate: float = 0.0
  use_bias: bool = True
  platform: str | None = None
  out_bias: bool | None = None
  qk_norm: bool = False
  norm_eps: float = 1e-6
  qk_norm_axes: str = "head"
  softcap: float = 0.0
  qk_norm_offset: bool = False
  qk_norm_scale: bool = True
  temperature: Any = None
  sinks: bool = False
  query_block: int = 0

  @nn.compact
  def __call__(self, x_BxLxD, state: base.PositionState | None = None, mask: Mask | None = None,
               deterministic: bool = True, decode: bool = False):
    """``decode``: incremental decoding through the ``cache`` collection (:func:`decode_step`): initialised with
    ``init(..., decode=True)`` on a ``[B, T]`` input (``T``: the cache's length), then called with the new tokens,
    their positions in ``state`` and their validity in ``mask.padding``, the cache mutable."""
    spec = self.spec
    if x_BxLxD.ndim != 3:
      raise ValueError(f"SelfAttention's input has shape {x_BxLxD.shape}; expected [B, L, D]")
    state = check_state(spec, state, x_BxLxD.shape[:2])
    mask = mask or Mask()
    check_mask(mask, *x_BxLxD.shape[:2])
    chunk = mask.chunk
    if not decode:  # a decoding step's chunks are its cache slots' (decode_step)
      mask = mask.chunked(*x_BxLxD.shape[:2])
    q, k, v = (partitioning.constrain(base.head_projection(spec, name, self.use_bias, heads)(x_BxLxD),
                                      partitioning.BLHK)
               for name, heads in (("query", spec.num_heads), ("key", spec.kv_heads), ("value", spec.kv_heads)))
    if self.qk_norm:
      axes = (-1,) if self.qk_norm_axes == "head" else (-2, -1)
      names = (base.KV,) if len(axes) == 1 else (base.HEADS, base.KV)
      norm = (functools.partial(OffsetRMSNorm, self.norm_eps, spec.dtype, spec.param_dtype, axes, names)
              if self.qk_norm_offset else functools.partial(
                  nn.RMSNorm, epsilon=self.norm_eps, dtype=spec.dtype, param_dtype=spec.param_dtype,
                  reduction_axes=axes, feature_axes=axes, scale_init=base.ones_init(names),
                  use_scale=self.qk_norm_scale))
      q, k = (norm(name=name)(x_BxLxHxK) for name, x_BxLxHxK in (("q_norm", q), ("k_norm", k)))
    if self.temperature is not None:
      q = temperature_lib.QueryTemperature(self.temperature, spec.causal, mask.sliding_window, spec.max_len,
                                           chunk=chunk, name="temperature")(q, state.positions)
    if spec.method.layer is not None:
      inputs = (x_BxLxD,) if spec.method.reads_input else ()
      own_cache = {"decode": decode} if spec.method.caches else {}
      terms = spec.method.layer(spec=spec, name="position")(q, k, state, spec.scale, *inputs, **own_cache)
    else:
      terms = base.LayerTerms(q, k)
    if self.sinks:
      sinks_H = self.param("sinks", base.zeros_init((base.HEADS,)), (spec.num_heads,), spec.param_dtype)
      terms = dataclasses.replace(terms, terms=kernels.merge(terms.terms, kernels.Terms(sink=kernels.Sink(sinks_H))))
    dropout = not deterministic and self.dropout_rate > 0
    kernel = resolve_kernel(self.kernel, spec, dtype=spec.dtype, dropout=dropout, platform=self.platform)
    why = kernels.capability.refusal("cudnn", terms.terms, dropout=dropout) if self.sinks else None
    if kernel == "cudnn" and why:
      if self.kernel == "cudnn":
        raise ValueError(f"attention kernel 'cudnn' cannot run this layer: {why}")
      kernel = "xla"
    if self.softcap:  # after every position term: the built-in ones become open terms, in the op's order
      terms = dataclasses.replace(terms, terms=kernels.as_terms(
          [kernels.merge(state.terms, terms.terms), kernels.SoftCap(self.softcap)]))
      state = state.replace(terms=None, bias=None)
      why = kernels.capability.refusal("cudnn", terms.terms, dropout=dropout)
      if kernel == "cudnn" and why:
        if self.kernel == "cudnn":
          raise ValueError(f"attention kernel 'cudnn' cannot run this layer: {why} (softcap={self.softcap})")
        kernel = "xla"
    if decode and self.has_variable("cache", "cached_key"):
      return self._out(decode_step(self, spec, terms, state, v, mask, kernel))
    if decode:  # initialising: an empty cache of the input's length, or a ring of what the layer can still see
      states = decoding_states(terms.terms)
      merged = kernels.merge(state.terms, terms.terms)
      cache_variables(self, terms.k, v, ring_slots(mask, terms.k.shape[1], bool(
          states or decoding_states(merged) or merged.path is not None)))
      for name, term in states.items():
        state_variable(self, name, term, terms.k.shape[1])
    if self.is_initializing():
      kernel = "xla"  # the same parameters, and no kernel this host cannot run (compiling for another device)
    blocked = kernel == "xla" and not isinstance(terms, base.DenseLayerTerms) and (
        self.query_block or kernels.shard.context_shards() > 1)  # by query blocks, or split over devices
    dense = kernel == "xla" and not blocked
    if dense:  # terms only the dense path computes; under a context split, GSPMD's partition of it: each
      terms = dataclasses.replace(terms, k=partitioning.constrain(terms.k, partitioning.BLHK_WHOLE))
      v = partitioning.constrain(v, partitioning.BLHK_WHOLE)  # device's queries against every key
    if dense or self.is_mutable_collection("intermediates"):
      logits = partitioning.constrain(
          add_biases(open_logits(terms, state, spec.scale), layer_bias(terms, state, spec.scale)), partitioning.BHQL)
      self.sow("intermediates", "attention_logits", logits)
    if dense:
      weights = kernels.xla.attention_weights(logits, mask.pairs(x_BxLxD.shape[1]),
                                              kernels.merge(state.terms, terms.terms), terms.q)
      weights = nn.Dropout(self.dropout_rate)(weights, deterministic=not dropout)
      out = kernels.xla.weighted_values(weights, v)
      value = terms.value_term(weights)
      out = out if value is None else out + value.astype(out.dtype)
    elif kernel == "pallas" or blocked:
      seed = kernels.dropout.seed_from_key(self.make_rng("dropout")) if dropout else None
      out = kernels.relative_attention(
          terms.q, terms.k, v, terms=kernels.merge(state.terms, terms.terms), positions=state.positions,
          segment_ids=mask.segment_ids, padding=mask.padding, scale=spec.scale, causal=mask.causal,
          sliding_window=mask.sliding_window, implementation="xla" if blocked else "pallas",
          query_block=(self.query_block or None) if blocked else None,
          platform=self.platform, dropout_rate=self.dropout_rate if dropout else 0.0, dropout_seed=seed)
    else:
      q, k, v_wide, bias = cudnn_inputs(terms, state, v, spec.scale)
      out = fused_attention(q, k, v_wide, bias, mask, spec.scale)[..., :v.shape[-1]]
    return self._out(out)

  def _out(self, out):
    spec = self.spec
    out = partitioning.constrain(out, partitioning.BLHK)
    return nn.DenseGeneral(
        spec.hidden_size, axis=(-2, -1), use_bias=self.use_bias if self.out_bias is None else self.out_bias,
        dtype=spec.dtype,
        param_dtype=spec.param_dtype, kernel_init=base.normal_init((base.HEADS, base.KV, base.EMBED)),
        bias_init=base.zeros_init((base.EMBED,)), name="out")(out)


def ring_slots(mask: Mask, length: int, has_states: bool = False) -> int:
  """The slots of a layer's decoding cache for a context of ``length`` tokens: a windowed or chunked layer's
  ``min(W, C)`` where that is fewer (a ring buffer: a query sees at most ``W - 1`` earlier keys, or its chunk's
  ``C - 1``), so its cache and each decode step's work follow the window, not the context; ``length`` otherwise, and
  for a layer whose terms keep a decoding state per slot (the Forgetting Transformer's gates)."""
  sizes = [size for size in (mask.sliding_window, mask.chunk) if size]
  return min(sizes) if sizes and min(sizes) < length and not has_states else length


def cache_variables(module: nn.Module, k_BxQxGxK, v_BxQxGxV, slots: int | None = None):
  """The layer's decoding cache (collection ``cache``): keys (after the position method's transform: RoPE-rotated)
  and values of its key/value heads only, heads first (``[B, G, T, K]``, G < H under grouped-query attention: the
  decode kernels' layout, read in place), the keys' positions and validity ``[B, T]`` and the number of tokens
  written (the next one's slot; in a ring of ``T`` slots, :func:`ring_slots`, token ``n`` sits at slot ``n mod T``);
  ``T`` is ``slots``, or the input's length at ``init``. Under a mesh the cache is split like the activations (rows
  over the batch's axes, heads over the heads': :data:`posjax.partitioning.BHLK`)."""
  (b, t, g), zeros = k_BxQxGxK.shape[:3], jnp.zeros
  t = slots or t
  return (module.variable("cache", "cached_key", zeros, (b, g, t, k_BxQxGxK.shape[3]), k_BxQxGxK.dtype),
          module.variable("cache", "cached_value", zeros, (b, g, t, v_BxQxGxV.shape[3]), v_BxQxGxV.dtype),
          module.variable("cache", "cached_positions", zeros, (b, t), jnp.int32),
          module.variable("cache", "cached_valid", zeros, (b, t), bool),
          module.variable("cache", "cache_index", zeros, (), jnp.int32))


def decoding_states(terms: kernels.Terms | None) -> dict:
  """``{name: term}`` of the terms that keep a decoding state beside k and v (:meth:`posjax.kernels.Term.decode_state`:
  the Forgetting Transformer's gates), named by their ``Terms`` field or ``open<i>``."""
  if terms is None:
    return {}
  fields = {name: getattr(terms, name) for name in kernels.terms.NAMES}
  fields.update({f"open{i}": term for i, term in enumerate(terms.open)})
  return {name: term for name, term in fields.items()
          if isinstance(term, kernels.Term) and term.decode_state(1) is not None}


def state_variable(module: nn.Module, name: str, term, slots: int):
  """The cache's variable ``cached_<name>`` of a term's decoding state (:func:`decoding_states`)."""
  shape, dtype = term.decode_state(slots)
  return module.variable("cache", f"cached_{name}", jnp.zeros, tuple(shape), dtype)


def continue_states(module: nn.Module, terms: kernels.Terms, positions_BxQ, index, slots: int) -> kernels.Terms:
  """``terms`` with each one that keeps a decoding state continued from the cache (:meth:`posjax.kernels.Term.
  continued`), the cache written: every term over every slot."""
  opened = list(terms.open)
  for name, term in decoding_states(terms).items():
    var = state_variable(module, name, term, slots)
    term, var.value = term.continued(var.value, positions_BxQ, index)
    if name.startswith("open"):
      opened[int(name[4:])] = term
    else:
      terms = terms.replace(**{name: term})
  return terms.replace(open=tuple(opened))


def decode_step(module: nn.Module, spec: base.PositionSpec, terms: base.LayerTerms, state: base.PositionState,
                v_BxQxGxV, mask: Mask, kernel: str):
  """``[B, Q, H, V]``: the Q new tokens' attention over the cache after writing their keys and values into it at
  the next free slots (prefill: the prompt; a decode step: one token), through
  :func:`posjax.kernels.decode.decode_attention`. The position terms come from the positions: the queries'
  (``state``, continuing past the prompt) and the cached keys', so every method whose terms are a function of (query
  position, key position, q, k) decodes exactly (RoPE and its scalings, xPos, ALiBi, T5, KERPLE, FIRE, Sandwich,
  Shaw's key term, NoPE; a learned table up to its length). Causal in slot order; the sliding window counts slots.
  A windowed or chunked layer's cache is a ring (:func:`ring_slots`, :func:`_ring_step`).
  ``kernel``: the layer's resolved kernel; ``pallas`` decodes on the decode kernels where they build the method's
  terms (:data:`posjax.kernels.decode.KERNEL_TERMS`), otherwise, and on ``xla`` and ``cudnn``, on the dense
  formulas (``[B, H, Q, T]`` logits; a logged line says why where ``pallas`` was asked for)."""
  if not mask.causal:
    raise ValueError("decoding with a cache needs a causal model (Mask.causal=True)")
  if isinstance(terms, base.DenseLayerTerms):
    raise ValueError(f"position method {spec.name!r} computes dense logits from q and k of equal length (or a value "
                     "term), which a decode step's few queries against the cache cannot; decode on the full forward")
  merged = kernels.merge(state.terms, terms.terms)
  if merged.untied is not None:
    raise ValueError(f"position method {spec.name!r} has TUPE's untied term, an encoder's, which decoding with a "
                     "cache does not compute")
  k_var, v_var, positions_var, valid_var, index_var = cache_variables(module, terms.k, v_BxQxGxV)
  b, q = terms.q.shape[:2]
  index = index_var.value
  positions_BxQ = jnp.broadcast_to(state.positions, (b, q)).astype(jnp.int32)
  valid_BxQ = jnp.ones((b, q), bool) if mask.padding is None else jnp.asarray(mask.padding, bool)
  path = merged.path  # PaTH: the cached keys carried to the newest token
  if path is not None and q == 1:  # a step: its factor on the cached keys (below), then plain q·k
    merged = merged.replace(path=None)
  elif path is not None:  # a prefill: the products among the new tokens on the dense formulas
    kernel = "xla"
  implementation = "xla"
  if kernel == "pallas":
    refusal = kernels.decode.kernel_refusal(merged)
    implementation = "xla" if refusal else "pallas"
    if refusal and refusal not in _LOGGED:
      _LOGGED.add(refusal)
      logging.info("decoding %r on the xla formulas: %s", spec.name, refusal)
  slots = k_var.value.shape[2]
  if not decoding_states(merged) and path is None and slots == ring_slots(mask, slots + 1):
    return _ring_step(module, terms.q, (k_var, v_var, positions_var, valid_var, index_var), terms.k, v_BxQxGxV,
                      positions_BxQ, valid_BxQ, merged, spec.scale, mask, implementation)
  merged = continue_states(module, merged, state.positions, index, slots)
  write = lambda var, x, axis: jax.lax.dynamic_update_slice_in_dim(var.value, x.astype(var.value.dtype), index, axis)
  k_var.value = partitioning.constrain(write(k_var, jnp.swapaxes(terms.k, 1, 2), 2), partitioning.BHLK)
  if path is not None and q == 1:  # the new token's factor on every earlier key (the official decoding's step)
    k_var.value = partitioning.constrain(path.step(k_var.value, index).astype(k_var.value.dtype), partitioning.BHLK)
  v_var.value = partitioning.constrain(write(v_var, jnp.swapaxes(v_BxQxGxV, 1, 2), 2), partitioning.BHLK)
  positions_var.value, valid_var.value = write(positions_var, positions_BxQ, 1), write(valid_var, valid_BxQ, 1)
  index_var.value = index + q
  out = kernels.decode.decode_attention(
      terms.q, k_var.value, v_var.value, start=index, key_positions=positions_var.value, key_valid=valid_var.value,
      terms=merged, scale=spec.scale, sliding_window=mask.sliding_window, chunk=mask.chunk,
      implementation=implementation,
      platform=module.platform)
  if merged.path is not None:  # after a prefill: every key carried through the new tokens' factors after it
    k_BxTxGxK = merged.path.keys_at_end(jnp.swapaxes(k_var.value, 1, 2), index)
    k_var.value = partitioning.constrain(jnp.swapaxes(k_BxTxGxK, 1, 2).astype(k_var.value.dtype), partitioning.BHLK)
  return out


def _ring_step(module: nn.Module, q_BxQxHxK, variables, k_BxQxGxK, v_BxQxGxV, positions_BxQ, valid_BxQ, terms,
               scale: float, mask: Mask, implementation: str):
  """A decode step of a windowed or chunked layer over its ring of ``S`` slots (:func:`ring_slots`): the ring in
  token order (its oldest slot first), then the new tokens, is the view the step attends over, so the causal mask,
  the window and the tile skipping count views' slots as they count a full cache's; a chunked layer's view starts
  at a chunk's first token (up to ``C`` empty slots before it and after). Then the newest ``min(Q, S)`` tokens
  overwrite the oldest slots. Exact for any number of new tokens: a prefill longer than the ring attends over its
  own keys before the ring keeps the last ``S``."""
  k_var, v_var, positions_var, valid_var, index_var = variables
  s, q, index, chunk = k_var.value.shape[2], q_BxQxHxK.shape[1], index_var.value, mask.chunk
  ordered = lambda x, axis: jnp.roll(x, -(index % s), axis=axis)  # view slot v: token index - S + v
  k_new_BxGxQxK, v_new_BxGxQxV = jnp.swapaxes(k_BxQxGxK, 1, 2), jnp.swapaxes(v_BxQxGxV, 1, 2)
  view = [jnp.concatenate([ordered(var.value, axis), new.astype(var.value.dtype)], axis=axis) for var, new, axis in
          ((k_var, k_new_BxGxQxK, 2), (v_var, v_new_BxGxQxV, 2), (positions_var, positions_BxQ, 1),
           (valid_var, valid_BxQ, 1))]
  start = jnp.asarray(s, jnp.int32)
  if chunk:  # C empty slots each side, then the C + S + Q slots from a chunk's first token on
    first = (-(index - s)) % chunk  # the padded view's first slot whose token starts a chunk
    wide = lambda x, axis: jax.lax.dynamic_slice_in_dim(
        jnp.pad(x, [(chunk, chunk) if a == axis else (0, 0) for a in range(x.ndim)]), first, chunk + s + q, axis)
    view = [wide(x, axis) for x, axis in zip(view, (2, 2, 1, 1))]
    start = start + chunk - first
  k_BxGxVxK, v_BxGxVxV, positions_BxV, valid_BxV = view
  out = kernels.decode.decode_attention(
      q_BxQxHxK, k_BxGxVxK, v_BxGxVxV, start=start, key_positions=positions_BxV, key_valid=valid_BxV, terms=terms,
      scale=scale, sliding_window=mask.sliding_window, chunk=chunk, implementation=implementation,
      platform=module.platform)
  kept = min(q, s)  # the newest tokens, each to slot (token index mod S)
  slots_N = (index + q - kept + jnp.arange(kept, dtype=jnp.int32)) % s
  for var, new, axis in ((k_var, k_new_BxGxQxK, 2), (v_var, v_new_BxGxQxV, 2), (positions_var, positions_BxQ, 1),
                         (valid_var, valid_BxQ, 1)):
    new = jax.lax.slice_in_dim(new, q - kept, q, axis=axis).astype(var.value.dtype)
    var.value = var.value.at[(slice(None),) * axis + (slots_N,)].set(new)
  k_var.value = partitioning.constrain(k_var.value, partitioning.BHLK)
  v_var.value = partitioning.constrain(v_var.value, partitioning.BHLK)
  index_var.value = index + q
  return out
