"""The position-method interface and its registry.

A position method may contribute to three places, and each is a separate, explicit part of the interface:

| contribution                              | computed                      | methods                          |
|-------------------------------------------|-------------------------------|----------------------------------|
| input embedding ``[Bp, L, D]``            | once, before the first layer  | absolute, sinusoidal, bert_r     |
| shared terms (:class:`~posjax.kernels.Terms`) | once per forward pass     | t5, bert_r, tupe_a/r, alibi      |
| per-layer q/k transforms and terms        | in every attention layer      | shaw, huang_m1..m4, bert_ad, rope|

Every bias is a :class:`posjax.kernels.Terms` (ALiBi, buckets, relative vectors, TUPE's untied term, KERPLE, FIRE,
Sandwich, the forget gate, the weight rules) or an open :class:`posjax.kernels.Term`: a fused kernel builds it per
tile, the ``xla`` path adds its dense form from :mod:`posjax.kernels.xla`, the one reference. Only the
multiplicative Methods 1-3 and Shaw's value term are not terms; they come as :class:`DenseLayerTerms`: the ``xla``
path alone. A method declares nothing about kernels: which kernel computes it is read from the terms its modules
return (:meth:`PositionSpec.refusal`).

``Bp`` is the batch size of the ``positions`` array: 1 when every row shares the default ``0..L-1``
positions (the shared terms are then computed once for the whole batch), ``B`` for packed batches.

A method is a :class:`Method` record in the registry: an options dataclass, an optional encoder-level
module (returns a :class:`PositionState`, or a subclass naming what its layers read) and an optional per-layer
module (returns :class:`LayerTerms`).
:func:`make` validates a name and its options and returns a hashable :class:`PositionSpec` that the
attention layer and the encoder are built from.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from typing import Any, Callable, Mapping

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

# The relative formulas several methods share live with the kernels' terms (which compute them too); re-exported.
from posjax import kernels
from posjax.kernels.terms import check_rows, dot_heads, relative_positions  # noqa: F401

Array = jax.Array
Initializer = Callable[..., Array]

# Logical axis names of every parameter; sharding rules map them to mesh axes.
EMBED, HEADS, KV, POSITION, BUCKETS, RELATIVE = "embed", "heads", "kv", "position", "relpos_buckets", "relpos"


@flax.struct.dataclass(kw_only=True)
class PositionState:
  """What a method computes once per forward pass, before the first layer; a method whose layers read more
  subclasses it (:class:`posjax.positions.rotary.RotaryState`, ...), so each state says what it carries.

  Attributes:
    positions: ``[Bp, L]`` the batch's positions (every kernel builds its terms from them, so packed rows are exact).
    embedding: ``[Bp, L, D]`` added to the word embeddings, or None.
    terms: what every layer adds to its logits (:class:`posjax.kernels.Terms`: ALiBi, buckets, TUPE's untied term),
      or None. A fused kernel builds them per tile.
    bias: ``[Bp, H, L, L]`` the same terms as a dense bias, built once by :func:`posjax.kernels.xla.position_bias`
      (:meth:`build`) for the paths that add a bias; under ``jit``, never computed where no layer reads it.
  """

  positions: Array
  embedding: Array | None = None
  terms: Any = None
  bias: Array | None = None

  @classmethod
  def build(cls, positions_BxL, *, terms=None, **fields):
    """A state whose ``bias`` is its ``terms``' dense form (the one reference, :mod:`posjax.kernels.xla`)."""
    bias = None if terms is None else kernels.xla.position_bias(terms, positions_BxL, 1.0)
    return cls(positions=positions_BxL, terms=terms, bias=bias, **fields)


@dataclasses.dataclass
class LayerTerms:
  """What a method contributes inside one attention layer, in the form every kernel computes: q and k (possibly
  transformed: RoPE rotates them, BERT-A^d adds projected positions) and position terms added to ``scale q·k``.

  Attributes:
    q, k: ``[B, L, H, K]`` queries and keys.
    terms: :class:`posjax.kernels.Terms` of this layer (Shaw's / Method 4's relative vectors, a TUPE layer's own
      untied term), or None; the ``xla`` path adds their dense form, a fused kernel builds them per tile.
  """

  q: Array
  k: Array
  terms: Any = None

  def content_logits(self, scale: float):
    """``[B, H, L, L]`` float32: ``scale q·k`` (PaTH's products where its terms hold a
    :class:`posjax.kernels.Path`: :func:`posjax.kernels.xla.content_logits`), the logits before the position terms."""
    return kernels.xla.content_logits(self.q, self.k, self.terms, scale)

  def value_term(self, weights_BxHxLxL):
    """What the method adds to the attention output from the weights (None: nothing)."""
    del weights_BxHxLxL


@dataclasses.dataclass
class DenseLayerTerms(LayerTerms):
  """Terms only the dense ``xla`` path computes: logits that *replace* ``scale q·k`` (the multiplicative
  Methods 1-3) or a value term that reads the attention weights (Shaw's).

  Attributes:
    logits: ``[B, H, L, L]`` scaled logits in place of ``scale q·k``, or None (then ``scale q·k``).
    value_fn: ``weights_BxHxLxL -> [B, L, H, K]`` added to the attention output, or None.
  """

  logits: Array | None = None
  value_fn: Callable[[Array], Array] | None = None

  def content_logits(self, scale: float):
    return super().content_logits(scale) if self.logits is None else self.logits.astype(jnp.float32)

  def value_term(self, weights_BxHxLxL):
    return None if self.value_fn is None else self.value_fn(weights_BxHxLxL)


class Positions(nn.Module):
  """The encoder of a method that computes nothing before the first layer (``none``): a state holding only the
  batch's positions, so that one pattern, ``spec.method.encoder(spec=spec)(positions_BxL)``, serves every
  method."""

  spec: Any

  def __call__(self, positions_BxL):
    check_rows("positions", positions_BxL)
    return PositionState(positions=positions_BxL)


@flax.struct.dataclass(kw_only=True)
class SharedTermsState(PositionState):
  """The state of a method whose layers' terms one module may serve (``options.share_across_layers``): those terms
  (None: each layer builds its own)."""

  shared: Any = None


class SharedTermsEncoder(nn.Module):
  """Encoder-level part of such a method (FIRE, KERPLE): the shared terms, built once by :meth:`layer_terms`, when
  ``options.share_across_layers``. A subclass defines ``layer_terms()`` (its parameters are declared where it runs:
  here when shared, in the layer otherwise); its layer is :class:`SharedTermsLayer` with the same ``layer_terms``."""

  spec: Any

  def layer_terms(self):
    raise NotImplementedError

  @nn.compact
  def __call__(self, positions_BxL):
    check_rows("positions", positions_BxL)
    shared = self.layer_terms() if self.spec.options.share_across_layers else None
    return SharedTermsState(positions=positions_BxL, shared=shared)


class SharedTermsLayer(nn.Module):
  """Per-layer part: the shared terms, or this layer's own (:meth:`layer_terms`)."""

  spec: Any

  def layer_terms(self):
    raise NotImplementedError

  @nn.compact
  def __call__(self, q, k, state: SharedTermsState, scale):
    terms = state.shared if self.spec.options.share_across_layers else self.layer_terms()
    return LayerTerms(q, k, terms=terms)


@dataclasses.dataclass(frozen=True)
class Method:
  """A registered position method.

  Attributes:
    name: registry name.
    options: a frozen dataclass type; its fields are the method's options, with their defaults.
    encoder: module type built as ``encoder(spec=...)``, called as ``(positions_BpxL) -> PositionState`` (a state
      that carries the positions it was given); :class:`Positions` for a method that computes nothing there.
    layer: module type built as ``layer(spec=...)`` in every attention layer, called as
      ``(q, k, state, scale) -> LayerTerms`` (``state``: what ``encoder`` returned).
    content_scale: the word (q·k) term is scaled by ``1/sqrt(content_scale * d_h)``.
    max_len_bound: whether the method holds a learned table indexed by absolute position, so sequences
      longer than ``max_len`` are an error.
    input_embedding: whether all the method does is add an embedding to the tokens' (absolute, sinusoidal):
      an encoder that shares another's embeddings (ELECTRA's generator) shares it too.
    table_shareable: whether the encoder module can read another encoder's position table (``table_from=``,
      TUPE's): ELECTRA's two models on one table, each with its own projections.
    reads_input: whether its layer also reads the attention layer's input ``x`` ``[B, L, D]``, called as ``(q, k,
      state, scale, x)`` (the Forgetting Transformer's gate, computed from the tokens).
    decoder_only: whether the method exists in a decoder's (causal) form only: its state runs from a key to the
      query (CoPE's counted positions, stick-breaking's product), so :func:`make` refuses it without ``causal``.
    caches: whether its layer keeps a decoding state of its own in the ``cache`` collection (PaTH's convolution
      inputs): it is called with ``decode=`` as the attention layer is.
    axes: the position axes its modules read: 1 (the batch's ``[Bp, L]`` positions), more for a multi-axis method
      (``[Bp, L, A]``: M-RoPE's time, height and width), 0 for one that reads none (any positions). A method of one
      axis refuses positions of several (:func:`method_positions`).
    sequence_positions: whether a multi-axis method reads plain ``[Bp, L]`` positions as that position on every
      axis (M-RoPE's text tokens: Qwen2-VL's three equal ids); otherwise it refuses them.
    continuation_axis: ``options -> axis or None``: the axis whose largest prompt id the generated tokens follow
      (VideoRoPE's time); None, or a method without it: the largest id of every axis (Qwen2-VL's ``rope_deltas``).
    regrid: ``(options, params, (rows, columns)) -> (options, params)``: the method's options and encoder
      parameters for images of another grid of patches (ViT's table resized to it); None: it reads any grid's
      positions as they are.
    summary: one line for listings and error messages.
  """

  name: str
  options: type
  encoder: type[nn.Module] = Positions
  layer: type[nn.Module] | None = None
  content_scale: float = 1.0
  max_len_bound: bool = False
  input_embedding: bool = False
  table_shareable: bool = False
  reads_input: bool = False
  decoder_only: bool = False
  caches: bool = False
  axes: int = 1
  sequence_positions: bool = False
  continuation_axis: Callable[[Any], int | None] | None = None
  regrid: Callable[[Any, Any, tuple[int, int]], tuple[dict, Any]] | None = None
  summary: str = ""

  @property
  def reads_state(self) -> bool:
    """Whether its attention layers read the state its encoder returns (all but ``none`` and the methods that
    only add an input embedding)."""
    return self.layer is not None or not (self.input_embedding or self.encoder is Positions)


_REGISTRY: dict[str, Method] = {}
_ALIASES: dict[str, str] = {}


def register(method: Method, *aliases: str) -> Method:
  """Adds ``method`` (and its aliases) to the registry; a name registered twice is an error."""
  for name in (method.name, *aliases):
    if name in _REGISTRY or name in _ALIASES:
      raise ValueError(f"position method {name!r} is registered twice")
  _REGISTRY[method.name] = method
  _ALIASES.update({alias: method.name for alias in aliases})
  return method


def names() -> list[str]:
  """Registered method names (aliases excluded), in registration order."""
  return list(_REGISTRY)


def encoder_names() -> list[str]:
  """The registered methods that have an encoder's form (all but the decoder-only ones), in registration order."""
  return [name for name in _REGISTRY if not _REGISTRY[name].decoder_only]


def multi_axis_names() -> list[str]:
  """The registered methods that read several position axes (:attr:`Method.axes` > 1), in registration order."""
  return [name for name in _REGISTRY if _REGISTRY[name].axes > 1]


def method_positions(method: Method, positions):
  """The batch's positions, ``[Bp, L]`` or ``[Bp, L, A]`` (A axes), as ``method`` reads them: ``[Bp, L]`` for a
  method of one axis (``[Bp, L, 1]``: that axis) or of none (the first axis: the sequence's), ``[Bp, L, A]`` for a
  method of A axes (``[Bp, L]`` as that position on every axis where the method reads it so:
  :attr:`Method.sequence_positions`). Anything else is a one-line error naming what the method reads."""
  shape = tuple(jnp.shape(positions))
  if len(shape) not in (2, 3):
    raise ValueError(f"positions has shape {shape}; expected [B, L] or [B, L, A] (A position axes)")
  given = 1 if len(shape) == 2 else shape[2]
  if method.axes <= 1:
    if given == 1 or method.axes == 0:
      return positions if len(shape) == 2 else positions[..., 0]
    raise ValueError(f"position method {method.name!r} reads one position axis; these positions have {given} "
                     f"(shape {shape}); the methods of several axes: {', '.join(multi_axis_names())}")
  if len(shape) == 2 and method.sequence_positions:
    return jnp.broadcast_to(jnp.asarray(positions)[..., None], (*shape, method.axes))
  if given != method.axes or len(shape) == 2:
    raise ValueError(f"position method {method.name!r} reads {method.axes} position axes; positions must be "
                     f"[B, L, {method.axes}], got shape {shape}")
  return positions


def get(name: str) -> Method:
  """Returns the method registered under ``name`` or one of its aliases."""
  name = _ALIASES.get(name, name)
  if name not in _REGISTRY:
    allowed = ", ".join(names() + [f"{a} (= {t})" for a, t in _ALIASES.items()])
    raise ValueError(f"unknown position method {name!r}; allowed: {allowed}")
  return _REGISTRY[name]


def _accepts(value: Any, hint: Any) -> bool:
  """Whether ``value`` has the type an options field is annotated with (an int where a float is asked is one)."""
  if typing.get_origin(hint) in (typing.Union, types.UnionType):
    return any(_accepts(value, arg) for arg in typing.get_args(hint))
  if hint is type(None):
    return value is None
  if hint in (int, float):
    numbers = (int, np.integer) if hint is int else (int, float, np.integer, np.floating)
    return isinstance(value, numbers) and not isinstance(value, (bool, np.bool_))
  if hint is bool:
    return isinstance(value, (bool, np.bool_))
  return not isinstance(hint, type) or isinstance(value, hint)


def parse_options(method: Method, options: Mapping[str, Any] | None) -> Any:
  """Builds ``method.options`` from a mapping; an unknown key, or a value of another type than the field's, is an
  error that says what is allowed."""
  options = dict(options or {})
  hints = typing.get_type_hints(method.options)
  allowed = {f.name for f in dataclasses.fields(method.options)}
  unknown = sorted(set(options) - allowed)
  if unknown:
    raise ValueError(
        f"position method {method.name!r} has no option(s) {unknown}; allowed: {sorted(allowed) or 'none'}")
  for name, value in options.items():
    if not _accepts(value, hints[name]):
      hint = getattr(hints[name], "__name__", str(hints[name]))
      raise ValueError(f"position method {method.name!r}: option {name}={value!r} is a {type(value).__name__}; "
                       f"it must be {hint}")
  return method.options(**options)


@dataclasses.dataclass(frozen=True)
class PositionSpec:
  """A fully configured position method: everything its modules need, hashable."""

  method: Method
  options: Any
  num_heads: int
  head_dim: int
  max_len: int
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  embedding_size: int = 0  # the input embeddings' width where it is not the model's (ELECTRA's); 0: hidden_size
  causal: bool = False  # in a decoder (attention to earlier tokens only): a method takes its decoder form
  num_kv_heads: int = 0  # key/value heads (grouped-query attention; 0: num_heads)
  model_width: int = 0  # the residual stream's width where it is not H·K (a decoder's head_dim); 0: H·K
  query_scale: float = 0.0  # the factor on q·k where a model sets its own (Gemma 2's query_pre_attn_scalar^-1/2)

  @property
  def name(self) -> str:
    """The method's registry name."""
    return self.method.name

  @property
  def hidden_size(self) -> int:
    """The model width: ``H·K`` unless ``model_width`` says otherwise."""
    return self.model_width or self.num_heads * self.head_dim

  @property
  def kv_heads(self) -> int:
    """The heads of k and v: ``num_kv_heads``, or ``num_heads`` where that is 0 (multi-head attention)."""
    return self.num_kv_heads or self.num_heads

  @property
  def input_width(self) -> int:
    """The width of what an input-embedding method adds: the token embeddings', ``embedding_size`` or ``H·K``."""
    return self.embedding_size or self.hidden_size

  def refusal(self, kernel: str, *, dropout: bool = False) -> str | None:
    """Why ``kernel`` (``xla``, ``cudnn``, ``pallas`` or ``decode``) cannot compute the method with these options
    (``dropout``: with attention dropout), None where it can: :func:`posjax.kernels.capability.refusal` of the terms
    its modules return (:func:`kernel_refusals`); a method declares nothing about kernels."""
    if kernel not in kernels.capability.KERNELS:
      raise ValueError(f"unknown kernel {kernel!r}; allowed: {list(kernels.capability.KERNELS)}")
    return kernel_refusals(self)[kernel, bool(dropout)]

  @property
  def scale(self) -> float:
    """The factor applied to q·k (1/sqrt(d_h), or 1/sqrt(2 d_h) with TUPE, 1/sqrt(4 d_h) with BERT-A^d;
    ``query_scale`` where given)."""
    return self.query_scale or 1.0 / math.sqrt(self.method.content_scale * self.head_dim)

  def check_length(self, length: int) -> None:
    """Raises if a sequence of ``length`` tokens is longer than a learned table of the method supports."""
    if self.method.max_len_bound and length > self.max_len:
      raise ValueError(
          f"position method {self.name!r} has a learned table of max_len={self.max_len} positions and cannot "
          f"encode a sequence of length {length}; use a shorter sequence, a larger max_len, or a relative "
          f"method ({', '.join(n for n in names() if not get(n).max_len_bound)})")


@functools.lru_cache(maxsize=None)
def kernel_refusals(spec: PositionSpec) -> dict[tuple[str, bool], str | None]:
  """``{(kernel, dropout): why or None}`` of :func:`posjax.kernels.capability.refusal` for one attention layer of
  ``spec``: its terms (the encoder's and the layer's, merged) and whether its layer returns :class:`DenseLayerTerms`
  (logits that replace ``scale q·k``, or a value term). Found by evaluating the method's modules abstractly on a
  short row (:func:`jax.eval_shape`: nothing is computed, and the table is read inside the trace, so no abstract
  value outlives it), once per spec, so what a kernel can compute is read from the terms themselves."""
  found = {}

  def form():
    length, (h, g, k) = min(8, spec.max_len), (spec.num_heads, spec.kv_heads, spec.head_dim)
    positions = jnp.arange(length, dtype=jnp.int32)[None]  # [1, L], or [1, L, A] for a method of A axes
    if spec.method.axes > 1:
      positions = jnp.broadcast_to(positions[..., None], (1, length, spec.method.axes))
    q_1xLxHxK, k_1xLxGxK = jnp.zeros((1, length, h, k), spec.dtype), jnp.zeros((1, length, g, k), spec.dtype)
    encoder = spec.method.encoder(spec=spec)
    state = encoder.apply(encoder.init(jax.random.PRNGKey(0), positions), positions)
    terms, dense = state.terms, False
    if spec.method.layer is not None:
      layer = spec.method.layer(spec=spec)
      inputs = (q_1xLxHxK, k_1xLxGxK, state, spec.scale)
      inputs += (jnp.zeros((1, length, spec.hidden_size), spec.dtype),) if spec.method.reads_input else ()
      layer_terms = layer.apply(layer.init(jax.random.PRNGKey(0), *inputs), *inputs)
      terms, dense = kernels.merge(state.terms, layer_terms.terms), isinstance(layer_terms, DenseLayerTerms)
    found.update({(kernel, dropout): kernels.capability.refusal(kernel, terms, dropout=dropout, dense=dense)
                  for kernel in kernels.capability.KERNELS for dropout in (False, True)})
    return 0

  jax.eval_shape(form)
  return found


def make(name: str, options: Mapping[str, Any] | None = None, *, num_heads: int, hidden_size: int,
         max_len: int, dtype: Any = jnp.float32, param_dtype: Any = jnp.float32,
         embedding_size: int = 0, causal: bool = False, num_kv_heads: int = 0, head_dim: int = 0,
         query_scale: float = 0.0) -> PositionSpec:
  """Validates a method name and its options and returns the spec the modules are built from (``causal``: for a
  decoder, whose methods take their decoder form, e.g. T5's unidirectional buckets; ``num_kv_heads``: grouped k/v
  heads, 0 for ``num_heads``; ``head_dim``: the heads' width where it is not ``hidden_size / num_heads``)."""
  method = get(name)
  if head_dim < 0:
    raise ValueError(f"head_dim must be >= 0 (0: hidden_size / num_heads), got {head_dim}")
  if num_heads <= 0 or (not head_dim and hidden_size % num_heads):
    raise ValueError(f"num_heads={num_heads} must be positive and divide hidden_size={hidden_size} (or give "
                     "head_dim)")
  if num_kv_heads < 0 or (num_kv_heads and num_heads % num_kv_heads):
    raise ValueError(f"num_kv_heads={num_kv_heads} must divide num_heads={num_heads} (0: num_heads)")
  if max_len <= 0:
    raise ValueError(f"max_len must be positive, got {max_len}")
  if query_scale < 0:
    raise ValueError(f"query_scale must be >= 0 (0: the method's 1/sqrt(head_dim)), got {query_scale}")
  if method.decoder_only and not causal:
    raise ValueError(f"position method {method.name!r} exists in a decoder's form only (causal attention: "
                     "model.causal=True, or a decoder preset such as configs/lm.py's)")
  head_dim = head_dim or hidden_size // num_heads
  return PositionSpec(method, parse_options(method, options), num_heads, head_dim, max_len,
                      dtype, param_dtype, 0 if embedding_size == hidden_size else embedding_size, bool(causal),
                      0 if num_kv_heads == num_heads else num_kv_heads,
                      0 if hidden_size == num_heads * head_dim else hidden_size, float(query_scale))


def check_choice(field: str, value: Any, allowed: tuple[Any, ...]) -> None:
  """Raises, naming the allowed values, unless ``value`` is one of them (an option's validation)."""
  if value not in allowed:
    raise ValueError(f"option {field}={value!r} is not allowed; choose one of {list(allowed)}")


# ----------------------------------------------------------------------------------------------------------
# Helpers shared by several methods.


def normal_init(axes: tuple[str, ...], stddev: float = 0.02) -> Initializer:
  """N(0, stddev) with logical axis names (BERT's initialisation; the names let sharding rules place it)."""
  return nn.with_logical_partitioning(nn.initializers.normal(stddev), axes)


def ones_init(axes: tuple[str, ...]) -> Initializer:
  """Ones with logical axis names."""
  return nn.with_logical_partitioning(nn.initializers.ones_init(), axes)


def zeros_init(axes: tuple[str, ...]) -> Initializer:
  """Zeros with logical axis names."""
  return nn.with_logical_partitioning(nn.initializers.zeros_init(), axes)


def head_projection(spec: PositionSpec, name: str, use_bias: bool, heads: int = 0) -> nn.DenseGeneral:
  """``[.., D] -> [.., H, K]`` with logical axes, as W^Q / W^K / U^Q / U^K (``heads``: other than ``num_heads``,
  the key/value heads of grouped-query attention)."""
  return nn.DenseGeneral(
      (heads or spec.num_heads, spec.head_dim), use_bias=use_bias, dtype=spec.dtype, param_dtype=spec.param_dtype,
      kernel_init=normal_init((EMBED, HEADS, KV)), bias_init=zeros_init((HEADS, KV)), name=name)


def layer_norm(spec: PositionSpec, name: str, eps: float = 1e-5) -> nn.LayerNorm:
  """A LayerNorm over the model width with logical axes (TUPE's and BERT-A^d's on the position embeddings)."""
  return nn.LayerNorm(epsilon=eps, dtype=spec.dtype, param_dtype=spec.param_dtype,
                      scale_init=ones_init((EMBED,)), bias_init=zeros_init((EMBED,)), name=name)


def lookup(table_NxD: Array, index: Array) -> Array:
  """Rows of a learned table; an index outside it (negative included) yields NaN, never a clamped row."""
  index = jnp.where(index < 0, table_NxD.shape[0], index)
  return jnp.take(table_NxD, index, axis=0, mode="fill", fill_value=jnp.nan)
