"""One Transformer stack with a pluggable position method: the BERT encoder (Devlin et al. 2019), the Llama-family
decoder, Gemma, ModernBERT and the vision transformer are presets of its config (:meth:`TransformerConfig.bert`,
:meth:`TransformerConfig.llama`, :meth:`TransformerConfig.gemma`, :meth:`TransformerConfig.vit`); its task heads are
:mod:`posjax.models.heads`, its image classifier :mod:`posjax.models.vision`.

Embeddings (word, token type, the method's input embedding) -> LayerNorm (or none) -> dropout -> N layers
(Post-LN by default, as BERT and TUPE; Pre-LN; LayerNorm or RMSNorm; a GELU or gated (SwiGLU) MLP; grouped-query
attention; GPT-NeoX's parallel residual) -> a final norm. The position method's shared terms are computed once per
forward pass from the batch's ``positions`` and handed to every layer.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
from flax.core import FrozenDict

from posjax import attention, kernels, partitioning, positions as positions_lib
from posjax.models import hybrid, layout
from posjax.positions import base
from posjax.positions import temperature as temperature_lib

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
ACTIVATIONS = {"gelu": functools.partial(nn.gelu, approximate=False),
               "gelu_tanh": functools.partial(nn.gelu, approximate=True), "relu": nn.relu, "silu": nn.silu}
NORMS = ("layernorm", "layernorm_nobias", "rmsnorm", "offset_rmsnorm")
# Where a layer's norms sit: after each residual sum (BERT's), before each branch (GPT-2's, Llama's) or on each
# branch's output before its residual sum (OLMo 2's "reordered" norms), or before each branch and on its output
# (Gemma 2's and 3's "peri" norms)
NORM_PLACEMENTS = ("post", "pre", "reordered", "peri")
MLPS = ("dense", "gated")
# which projections have biases: every one, none (Llama), q/k/v only (Qwen2), q/k/v and out but not the MLP's
# (Llama's attention_bias=True)
BIASES = ("all", "none", "qkv", "attention")
LM_HEADS = ("mlm", "linear")
# Architectures by name (configs' ``size=`` option): a CPU-sized one, BERT-Base and BERT-Large.
SIZES = {
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128),
    "base": dict(hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072),
    "large": dict(hidden_size=1024, num_layers=24, num_heads=16, intermediate_size=4096),
}
# Decoder shapes by name (``configs/lm.py``'s ``size=``): a CPU-sized one and the usual 125M / 350M / 1B classes with
# grouped-query attention (SwiGLU widths near 8/3 of the model's; ``1b``: Llama 3.2 1B's shape, tied embeddings).
DECODER_SIZES = {
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=176),
    "125m": dict(hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4, intermediate_size=2048),
    "350m": dict(hidden_size=1024, num_layers=24, num_heads=16, num_kv_heads=4, intermediate_size=2816),
    "1b": dict(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, intermediate_size=8192,
               tie_embeddings=True),
}
VOCAB, MLP = "vocab", "mlp"
# Rematerialisation: what a layer's backward pass keeps from its forward (``jax.checkpoint_policies``); the rest it
# recomputes. ``none``: keep everything (no remat); ``full``: keep only the layer's input.
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_with_no_batch_dims": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


def _plain(value):
  """``value`` with every mapping in it a plain dict (a FrozenDict's nested ones too): JSON's."""
  return {k: _plain(v) for k, v in value.items()} if isinstance(value, Mapping) else value


@dataclasses.dataclass(frozen=True)
class LayerKind:
  """One layer's attention as data: its position method (a schedule entry: ``rope``, ``none``, ``rope@local``), its
  sliding window and chunk (0: none) and its query temperature (None: none). :attr:`TransformerConfig.layer_kinds`
  gives every layer's; layers of one kind share a compiled program under ``scan_layers``."""
  position: str
  window: int = 0
  chunk: int = 0
  temperature: Any = None

  def describe(self) -> str:
    parts = [self.position] + [f"{name} {value}" for name, value in (("window", self.window), ("chunk", self.chunk))
                               if value] + ([f"temperature {self.temperature.kind}"] if self.temperature else [])
    return ", ".join(parts)


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Architecture of a BERT encoder.

  Attributes:
    position: a position-method registry name (``posjax.positions.names()``).
    position_options: that method's options (an unknown key is an error).
    attention_kernel: ``xla`` | ``cudnn`` | ``pallas`` | ``auto`` (see ``posjax.attention``).
    kernel_platform: the device the fused kernels are compiled for, ``gpu`` | ``tpu``; empty: the backend the
      model runs on. Set by ahead-of-time compilation on a CPU (:mod:`posjax.aot`); not a training choice.
    norm: where the norms sit (:data:`NORM_PLACEMENTS`): ``post`` (after each residual sum: BERT, TUPE), ``pre``
      (before each branch: GPT-2, Llama) or ``reordered`` (on each branch's output, before its residual sum: OLMo 2);
      ``peri`` (before each branch and on its output: Gemma 2, 3); all but ``post`` end with a final norm.
    activation: of the MLP and the MLM head: ``gelu`` (exact, BERT's), ``gelu_tanh`` (the tanh
      approximation: Hugging Face's ``gelu_new``), ``relu``.
    dtype: compute dtype name (``float32`` | ``bfloat16`` | ``float16``); parameters stay ``param_dtype``.
    type_vocab_size: token-type (segment A/B) embeddings; 0 for none.
    embedding_size: the width of the input embeddings (word, token type, an input position method's) and of the
      MLM head's output, when it is not ``hidden_size``: ELECTRA's generator reads the discriminator's 768-wide
      embeddings through a dense ``embeddings_project`` to its 256 (Clark et al. 2020). 0: ``hidden_size``.
    remat: what each layer keeps for its backward pass (:data:`REMAT_POLICIES`): ``none`` (default: everything),
      ``full`` (its input only; the rest is recomputed), ``dots`` / ``dots_with_no_batch_dims`` (the matrix
      products, as ``jax.checkpoint_policies`` names them). The same numbers; less memory, more compute.
    causal: attention to earlier tokens only (a decoder); the position methods take their decoder form (T5's
      unidirectional buckets). Default False (an encoder).
    scan_layers: the layers as one ``nn.scan`` over stacked parameters (``encoder/layers/...``, leading axis
      ``layers``) instead of ``encoder/layer_{i}``: one layer's program, compiled once whatever the depth. The same
      numbers; checkpoints convert between the two layouts (:mod:`posjax.models.layout`). Layers of different kinds
      (:attr:`layer_kinds`: windows, chunks, methods, temperatures) scan their repeating :attr:`pattern` as one
      group of layers (``encoder/layers/kind_{j}/...``, leading axis ``layers / P``).

  Decoder fields (their defaults are BERT's; :meth:`decoder` is the Llama preset):
    num_kv_heads: k/v heads (grouped-query attention, Ainslie et al. 2023; 1: multi-query); 0: ``num_heads``.
    head_dim: each head's width where it is not ``hidden_size / num_heads``; 0: that.
    norm_type: ``layernorm`` (BERT's, with a bias), ``layernorm_nobias`` (ModernBERT's: a scale only),
      ``rmsnorm`` (Llama's: scale only) or ``offset_rmsnorm`` (Gemma's: ``x / rms(x) · (1 + w)``, ``w`` from zero, in
      float32), epsilon ``layer_norm_eps``, for every norm of the stack.
    first_attention_norm: False: the first layer's attention reads the (normed) embeddings without a norm of its
      own (ModernBERT's, with ``norm="pre"``); default True.
    head_bias: the MLM head's transform has a bias (BERT's); False: none (ModernBERT's ``classifier_bias=False``).
    attention_sinks: each layer's learned logit per head in its softmax's denominator (GPT-OSS's sinks,
      :class:`posjax.kernels.Sink`; every kernel but cuDNN); default False.
    attention_query_block: the ``xla`` kernel's queries at a time (``[B, H, block, L]`` logits alive, each block
      recomputed in the backward pass; under a ``context`` mesh axis, of each device's share); 0: all at once.
    embedding_scale: the word embeddings times ``sqrt(hidden_size)`` (in the compute dtype), Gemma's.
    query_scale: the factor on q·k (Gemma 2's ``query_pre_attn_scalar ** -0.5``); 0: the method's.
    attention_softcap: each layer's logits capped at ``c · tanh(s / c)`` after its position terms (Gemma 2's
      ``attn_logit_softcapping``; :class:`posjax.kernels.SoftCap`, fused on the Pallas kernels); 0: none.
    final_logit_softcap: the LM head's logits capped likewise (Gemma 2's ``final_logit_softcapping``); 0: none.
    layer_windows: each layer's sliding window, ``,``-separated and repeated over the depth (``"4096,0"``: Gemma 2's
      local and global layers in turn; 0: the whole context); empty: ``sliding_window`` in every layer.
    layer_chunks: each layer's chunk, ``,``-separated and repeated over the depth (``"8192,8192,8192,0"``: Llama 4's
      chunked RoPE layers and its global ones): a query attends to its aligned block of that many tokens only
      (:class:`posjax.attention.Mask`'s ``chunk``); 0 or empty: none.
    mlp: ``dense`` (``act(x W_in) W_out``) or ``gated`` (``(act(x W_gate) * x W_in) W_out``: SwiGLU with
      ``activation="silu"``, Shazeer 2020).
    use_bias: which projections have biases: ``all`` (BERT), ``none`` (Llama, ModernBERT), ``qkv`` (q/k/v only:
      Qwen2), ``attention`` (q/k/v and the output projection, not the MLP's: Llama's ``attention_bias=True``).
    qk_norm: an RMSNorm of q and k before the position method (Qwen3, OLMo 2, Gemma 3); ``qk_norm_axes``: over
      each head (``head``: Qwen3's, Gemma 3's) or over all the heads' width at once (``all``: OLMo 2's);
      ``qk_norm_scale=False``: without a learned scale (Llama 4's L2 norm; not with ``offset_rmsnorm``).
    embedding_norm: the norm after the embeddings (BERT's); False: none (GPT-2, Llama).
    tie_embeddings: the LM head reads the word embeddings (BERT, GPT-2, Qwen2 small); False: its own ``lm_head``.
    lm_head: what :class:`Transformer`'s ``lm`` head is: ``mlm`` (BERT's transform, LayerNorm and output bias,
      tied) or ``linear`` (the decoders': the final state straight to the vocabulary).
    parallel_residual: ``x + attn(norm1(x)) + mlp(norm2(x))`` (GPT-NeoX, GPT-J) instead of one branch after the
      other; with ``norm="pre"``.
    sliding_window: each query attends to the keys fewer than ``sliding_window`` tokens away
      (:class:`posjax.attention.Mask`): with ``causal`` its last ``sliding_window`` tokens (Mistral), without it as
      many on each side (ModernBERT's local layers: ``local_attention / 2 + 1``); 0: all.
    position_schedule: the layers' position methods, ``,``-separated registry names repeated over the depth
      (``"rope,rope,rope,none"``: NoPE every fourth layer, as Llama 4's iRoPE; ``"none,rope"``: SWAN-GPT's
      interleave); empty: ``position`` in every layer. ``position_options`` are ``position``'s; the other methods
      in the schedule take their defaults or ``schedule_options``. An entry ``method@tag`` is ``method`` with its
      own options (``"rope@local,rope"`` with ``schedule_options={"rope@local": {"max_timescale": 10000}}``: Gemma
      3's local and global RoPE bases). Each entry's shared terms are computed once per forward pass. Not with
      methods that add an input embedding.
    schedule_options: ``{schedule entry: its method's options}`` for the entries of ``position_schedule`` other
      than ``position`` (whose options are ``position_options``); an entry it does not name takes its defaults.
    query_temperature: each query scaled by a factor of its position (:mod:`posjax.positions.temperature`):
      ``{"kind": "llama4", "floor_scale": 8192, "attn_scale": 0.1}`` (Llama 4's NoPE layers), ``{"kind":
      "ministral", "beta": 0.1, "original_max_len": 16384}`` or ``{"kind": "ssmax"}`` (a learned ``s log n`` per
      head; causal); empty: none. ``temperature_layers``: the layers it applies to, ``,``-separated 0 / 1 repeated
      over the depth (``"0,0,0,1"``: every fourth, Llama 4's NoPE layers); empty: every layer.
    layout: a named hybrid layout (:mod:`posjax.models.hybrid`: ``full``, ``irope``, ``rnope_swa``, ``swan``,
      ``gpt_oss``, ``gemma3``) that sets the per-layer fields above from ``layout_options`` over ``position``; a
      field it sets and the config gives otherwise is an error. :attr:`layer_kinds` is every layer's attention,
      however set.
  """

  vocab_size: int = 30522
  hidden_size: int = 768
  num_layers: int = 12
  num_heads: int = 12
  intermediate_size: int = 3072
  max_len: int = 512
  type_vocab_size: int = 2
  embedding_size: int = 0
  position: str = "absolute"
  position_options: Mapping[str, Any] = FrozenDict()
  attention_kernel: str = "xla"
  kernel_platform: str = ""
  dropout_rate: float = 0.1
  attention_dropout_rate: float = 0.1
  layer_norm_eps: float = 1e-12
  norm: str = "post"
  activation: str = "gelu"
  dtype: str = "float32"
  param_dtype: str = "float32"
  remat: str = "none"
  scan_layers: bool = False
  causal: bool = False
  num_kv_heads: int = 0
  head_dim: int = 0
  norm_type: str = "layernorm"
  mlp: str = "dense"
  use_bias: str = "all"
  qk_norm: bool = False
  qk_norm_axes: str = "head"
  qk_norm_scale: bool = True
  embedding_scale: bool = False
  first_attention_norm: bool = True
  head_bias: bool = True
  attention_sinks: bool = False
  attention_query_block: int = 0
  query_scale: float = 0.0
  attention_softcap: float = 0.0
  final_logit_softcap: float = 0.0
  layer_windows: str = ""
  layer_chunks: str = ""
  embedding_norm: bool = True
  tie_embeddings: bool = True
  lm_head: str = "mlm"
  parallel_residual: bool = False
  sliding_window: int = 0
  position_schedule: str = ""
  schedule_options: Mapping[str, Mapping[str, Any]] = FrozenDict()
  query_temperature: Mapping[str, Any] = FrozenDict()
  temperature_layers: str = ""
  layout: str = ""
  layout_options: Mapping[str, Any] = FrozenDict()

  def __post_init__(self):
    self._apply_layout()
    # lists as tuples (LongRoPE's factors from a config or JSON): the config is hashed as a static argument
    frozen = lambda options: FrozenDict({k: tuple(v) if isinstance(v, list) else v for k, v in (options or {}).items()})
    object.__setattr__(self, "position_options", frozen(self.position_options))
    if not isinstance(self.schedule_options or {}, Mapping) or not all(
        isinstance(v, Mapping) for v in (self.schedule_options or {}).values()):
      raise ValueError(f"schedule_options must map schedule entries to option dicts, got {self.schedule_options!r}")
    object.__setattr__(self, "schedule_options", FrozenDict({k: frozen(v) for k, v in
                                                             (self.schedule_options or {}).items()}))
    object.__setattr__(self, "query_temperature", frozen(self.query_temperature))
    object.__setattr__(self, "layout_options", FrozenDict(self.layout_options or {}))
    if self.temperature_layers and not self.query_temperature:
      raise ValueError(f"temperature_layers={self.temperature_layers!r} without a query_temperature")
    temperatures = self.layer_temperatures  # checks the options, here rather than when the model is built
    if any(t is not None and t.kind == "ssmax" for t in temperatures) and not self.causal:
      raise ValueError("query_temperature kind 'ssmax' counts each query's keys from its position: a causal model "
                       "only (causal=True)")
    for field in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size", "max_len"):
      if getattr(self, field) <= 0:
        raise ValueError(f"{field} must be positive, got {getattr(self, field)}")
    base.check_choice("norm", self.norm, NORM_PLACEMENTS)
    if not isinstance(self.attention_query_block, int) or self.attention_query_block < 0:
      raise ValueError(f"attention_query_block must be an int >= 0 (0: all queries at once), got "
                       f"{self.attention_query_block!r}")
    for field in ("query_scale", "attention_softcap", "final_logit_softcap"):
      if not getattr(self, field) >= 0:
        raise ValueError(f"{field} must be >= 0 (0: none), got {getattr(self, field)}")
    self.chunks, self.windows  # check each entry, here rather than when the model is built
    why = kernels.capability.refusal("cudnn", kernels.as_terms(kernels.SoftCap(self.attention_softcap))
                                     ) if self.attention_softcap and self.attention_kernel == "cudnn" else None
    if why:
      raise ValueError(f"attention_softcap={self.attention_softcap}: attention kernel 'cudnn' cannot run it ({why}); "
                       "use attention_kernel 'pallas', 'xla' or 'auto'")
    if self.attention_sinks and "stick_breaking" in {spec.method.name for spec in self.method_specs.values()}:
      raise ValueError("attention_sinks=True with position 'stick_breaking': a sink joins a softmax's denominator "
                       "and stick-breaking's weights are not a softmax")
    if self.attention_sinks and self.attention_kernel == "cudnn":
      raise ValueError(f"attention_sinks=True: attention kernel 'cudnn' cannot run them ("
                       f"{kernels.capability.refusal('cudnn', kernels.Terms(sink=kernels.Sink(None)))}); use "
                       "attention_kernel 'pallas', 'xla' or 'auto'")
    base.check_choice("qk_norm_axes", self.qk_norm_axes, ("head", "all"))
    base.check_choice("kernel_platform", self.kernel_platform, ("", "gpu", "tpu"))
    base.check_choice("activation", self.activation, tuple(ACTIVATIONS))
    base.check_choice("dtype", self.dtype, tuple(DTYPES))
    base.check_choice("param_dtype", self.param_dtype, tuple(DTYPES))
    base.check_choice("remat", self.remat, tuple(REMAT_POLICIES))
    base.check_choice("norm_type", self.norm_type, NORMS)
    base.check_choice("mlp", self.mlp, MLPS)
    base.check_choice("use_bias", self.use_bias, BIASES)
    base.check_choice("lm_head", self.lm_head, LM_HEADS)
    for field in ("num_kv_heads", "head_dim", "sliding_window"):
      if not isinstance(getattr(self, field), int) or getattr(self, field) < 0:
        raise ValueError(f"{field} must be an int >= 0 (0: the default), got {getattr(self, field)!r}")
    if not self.first_attention_norm and (self.norm != "pre" or self.scan_layers or self.parallel_residual):
      raise ValueError("first_attention_norm=False needs norm='pre', sequential residuals and unscanned layers "
                       "(ModernBERT's first layer: its attention reads the normed embeddings)")
    if not self.qk_norm_scale and self.norm_type == "offset_rmsnorm":
      raise ValueError("qk_norm_scale=False with norm_type='offset_rmsnorm': Gemma's (1 + w) norm is its scale; "
                       "use norm_type 'rmsnorm' for a q/k norm without one")
    if self.parallel_residual and self.norm != "pre":
      raise ValueError("parallel_residual=True needs norm='pre' (GPT-NeoX's layer)")
    if not self.tie_embeddings and self.lm_head != "linear":
      raise ValueError("tie_embeddings=False needs lm_head='linear' (BERT's MLM head is tied)")
    for field in ("scan_layers", "causal", "qk_norm", "embedding_norm", "tie_embeddings", "parallel_residual",
                  "embedding_scale", "first_attention_norm", "head_bias", "attention_sinks", "qk_norm_scale"):
      if not isinstance(getattr(self, field), bool):
        raise ValueError(f"{field} must be True or False, got {getattr(self, field)!r}")
    if self.embedding_size < 0:
      raise ValueError(f"embedding_size must be >= 0 (0: hidden_size), got {self.embedding_size}")
    for field in ("dropout_rate", "attention_dropout_rate"):
      if not 0.0 <= getattr(self, field) < 1.0:
        raise ValueError(f"{field} must be in [0, 1), got {getattr(self, field)}")
    attention.check_kernel(self.attention_kernel, self.position_spec, dropout=self._kernel_dropout)
    if self.position_schedule:
      if not isinstance(self.position_schedule, str):
        raise ValueError(f"position_schedule must be a ','-separated string of method names, got "
                         f"{self.position_schedule!r}")
      for spec in self.method_specs.values():
        if spec.method.input_embedding:
          raise ValueError(f"position_schedule: {spec.name!r} adds an input embedding, not a per-layer term; a "
                           "schedule takes methods that act inside attention")
        attention.check_kernel(self.attention_kernel, spec, dropout=self._kernel_dropout)
    if self.layer_windows and self.sliding_window:
      raise ValueError(f"layer_windows={self.layer_windows!r} and sliding_window={self.sliding_window}: give each "
                       "layer's window in layer_windows, or one window for every layer in sliding_window")
    named = set(self.schedule_options)
    stray = sorted((named - set(self.layer_positions)) | (named & {self.position}))
    if stray:
      raise ValueError(f"schedule_options names {stray}, which are not entries of position_schedule other than "
                       f"position ({self.position_schedule or self.position!r}): position's options are "
                       "position_options")

  def _apply_layout(self) -> None:
    """Sets the fields ``layout`` names (:func:`posjax.models.hybrid.fields`) where they hold their defaults; one
    given another value is a one-line error (the layout's options change it)."""
    if not self.layout:
      if self.layout_options:
        raise ValueError(f"layout_options={dict(self.layout_options)!r} without a layout")
      return
    if not isinstance(self.layout, str):
      raise ValueError(f"layout must be a layout's name ({hybrid.names()}), got {self.layout!r}")
    defaults = {f.name: f.default for f in dataclasses.fields(self)}
    every = hybrid.options(self.layout, self.layout_options).get("every", 1)
    if every > self.num_layers:
      raise ValueError(f"layout={self.layout!r} groups every={every} layers (one global), more than num_layers="
                       f"{self.num_layers}: set layout_options every <= {self.num_layers}")
    for field, value in hybrid.fields(self.layout, self.layout_options, self.position, self.position_options).items():
      have = getattr(self, field)
      if _plain(have) == _plain(value):
        continue
      if _plain(have) != _plain(defaults[field]):
        raise ValueError(f"layout={self.layout!r} sets {field}={value!r}, and {field}={_plain(have)!r} was given: "
                         f"change it through layout_options ({sorted(hybrid.options(self.layout))}) or set the "
                         "per-layer fields without a layout")
      object.__setattr__(self, field, value)

  @property
  def _kernel_dropout(self) -> bool:
    """Whether the configured kernel must drop attention weights in training (the Pallas kernels; cuDNN's layers
    fall back at run time, where training with dropout is known)."""
    return self.attention_kernel == "pallas" and bool(self.attention_dropout_rate)

  def to_dict(self) -> dict:
    """The fields as plain JSON values (what ``model_config.json`` holds)."""
    return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

  @functools.cached_property
  def position_spec(self) -> base.PositionSpec:
    return self._spec(self.position, self.position_options)

  def _spec(self, name: str, options: Mapping[str, Any]) -> base.PositionSpec:
    return positions_lib.make(name, options, num_heads=self.num_heads, hidden_size=self.hidden_size,
                              max_len=self.max_len, embedding_size=self.embed_width, dtype=DTYPES[self.dtype],
                              param_dtype=DTYPES[self.param_dtype], causal=self.causal,
                              num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, query_scale=self.query_scale)

  @functools.cached_property
  def windows(self) -> tuple[int, ...]:
    """Each layer's sliding window (0: none): ``layer_windows`` repeated over the depth, or ``sliding_window``."""
    if not self.layer_windows:
      return (self.sliding_window,) * self.num_layers
    return self._per_layer("layer_windows", "window", "4096,0", "the whole context")

  @functools.cached_property
  def chunks(self) -> tuple[int, ...]:
    """Each layer's chunk (0: none): ``layer_chunks`` repeated over the depth."""
    if not self.layer_chunks:
      return (0,) * self.num_layers
    return self._per_layer("layer_chunks", "chunk", "8192,0", "none")

  def _per_layer(self, field: str, what: str, example: str, zero: str) -> tuple[int, ...]:
    """``field``'s ``,``-separated ints >= 0, repeated over the depth; a bad entry is a one-line error."""
    value = getattr(self, field)
    try:
      sizes = tuple(int(x) for x in str(value).split(","))
    except ValueError:
      raise ValueError(f"{field}={value!r}: expected ','-separated ints >= 0, e.g. '{example}'") from None
    if any(x < 0 for x in sizes):
      raise ValueError(f"{field}={value!r}: each {what} must be >= 0 (0: {zero})")
    return tuple(sizes[i % len(sizes)] for i in range(self.num_layers))

  @functools.cached_property
  def layer_temperatures(self) -> tuple[temperature_lib.Temperature | None, ...]:
    """Each layer's query temperature (None: none): ``query_temperature`` on the layers ``temperature_layers``
    flags (every layer where it is empty)."""
    temperature = temperature_lib.Temperature.parse(self.query_temperature)
    if not self.temperature_layers:
      return (temperature,) * self.num_layers
    flags = tuple(f.strip() for f in str(self.temperature_layers).split(","))
    if not set(flags) <= {"0", "1"}:
      raise ValueError(f"temperature_layers={self.temperature_layers!r}: expected ','-separated 0 / 1, e.g. "
                       "'0,0,0,1'")
    return tuple(temperature if flags[i % len(flags)] == "1" else None for i in range(self.num_layers))

  @functools.cached_property
  def layer_positions(self) -> tuple[str, ...]:
    """Each layer's position method: ``position_schedule`` repeated over the depth, or ``position`` everywhere."""
    if not self.position_schedule:
      return (self.position,) * self.num_layers
    names = tuple(name.strip() for name in self.position_schedule.split(","))
    if not all(names):
      raise ValueError(f"position_schedule={self.position_schedule!r} has an empty entry")
    return tuple(names[i % len(names)] for i in range(self.num_layers))

  @functools.cached_property
  def method_specs(self) -> dict[str, base.PositionSpec]:
    """The spec of each schedule entry (``position``'s with ``position_options``; ``method@tag`` is ``method``; the
    others with ``schedule_options`` or their defaults)."""
    return {name: self.position_spec if name == self.position else self._spec(
        name.split("@")[0], self.schedule_options.get(name, {})) for name in dict.fromkeys(self.layer_positions)}

  @functools.cached_property
  def layer_kinds(self) -> tuple[LayerKind, ...]:
    """Every layer's attention (:class:`LayerKind`), from ``position_schedule``, ``layer_windows`` /
    ``sliding_window``, ``layer_chunks`` and ``query_temperature`` / ``temperature_layers`` (or a ``layout``)."""
    return tuple(LayerKind(*kind) for kind in zip(self.layer_positions, self.windows, self.chunks,
                                                   self.layer_temperatures))

  @functools.cached_property
  def pattern(self) -> tuple[LayerKind, ...]:
    """The shortest run of layer kinds that repeats over the depth a whole number of times (the whole depth where
    none does): ``scan_layers`` scans it, one program per kind."""
    kinds = self.layer_kinds
    period = next(p for p in range(1, len(kinds) + 1)
                  if len(kinds) % p == 0 and all(kinds[i] == kinds[i % p] for i in range(len(kinds))))
    return kinds[:period]

  @property
  def embed_width(self) -> int:
    """The input embeddings' width: ``embedding_size``, or ``hidden_size`` where that is 0."""
    return self.embedding_size or self.hidden_size

  @classmethod
  def tiny(cls, **overrides) -> "TransformerConfig":
    """For tests: 2 layers, width 32, 4 heads, 64 positions, 128-token vocabulary."""
    return cls(**{**dict(vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
                         max_len=64), **overrides})

  @classmethod
  def bert(cls, **overrides) -> "TransformerConfig":
    """BERT-Base: 12 layers, 768 wide, 12 heads, FFN 3072 (110M parameters with absolute positions); the fields'
    defaults."""
    return cls(**overrides)

  @classmethod
  def bert_large(cls, **overrides) -> "TransformerConfig":
    """BERT-Large: 24 layers, 1024 wide, 16 heads, FFN 4096."""
    return cls(**{**dict(hidden_size=1024, num_layers=24, num_heads=16, intermediate_size=4096), **overrides})

  @classmethod
  def llama(cls, **overrides) -> "TransformerConfig":
    """A Llama-family decoder (Touvron et al. 2023): causal, RoPE, Pre-RMSNorm (epsilon 1e-5), SwiGLU, no biases,
    no embedding norm or token types, untied LM head, no dropout; the sizes are the caller's (``configs/lm.py``
    names them). Qwen2 is this with ``use_bias="qkv"``, Qwen3 with ``qk_norm=True``, Mistral with
    ``sliding_window``."""
    return cls(**{**dict(causal=True, position="rope", norm="pre", norm_type="rmsnorm", mlp="gated",
                         activation="silu", use_bias="none", embedding_norm=False, type_vocab_size=0,
                         tie_embeddings=False, lm_head="linear", dropout_rate=0.0, attention_dropout_rate=0.0,
                         layer_norm_eps=1e-5), **overrides})

  @classmethod
  def gemma(cls, **overrides) -> "TransformerConfig":
    """Gemma's decoder (Gemma Team 2024): :meth:`llama` with ``(1 + w)`` RMSNorms (epsilon 1e-6), embeddings
    times ``sqrt(d)``, GeGLU (tanh GELU) and tied embeddings. Gemma 2 adds ``norm="peri"``, ``query_scale``, the
    soft caps and ``layer_windows``; Gemma 3 ``qk_norm`` and its local layers' RoPE (``position_schedule``), as
    :func:`posjax.convert.hf_decoder.config_from_hf` reads them."""
    return cls.llama(**{**dict(norm_type="offset_rmsnorm", layer_norm_eps=1e-6, embedding_scale=True,
                               activation="gelu_tanh", tie_embeddings=True), **overrides})

  @classmethod
  def modernbert(cls, **overrides) -> "TransformerConfig":
    """ModernBERT-base's layout (Warner et al. 2024): 22 layers, 768 wide, 12 heads, GeGLU 1152, Pre-LN without
    biases (the first layer's attention reads the normed embeddings), no token types; every third layer global
    with RoPE at 160,000, the others seeing 64 tokens on each side with RoPE at 10,000."""
    return cls(**{**dict(hidden_size=768, num_layers=22, num_heads=12, intermediate_size=1152, max_len=8192,
                         type_vocab_size=0, position="rope", position_options={"max_timescale": 160_000.0},
                         position_schedule="rope,rope@local,rope@local", layer_windows="0,65,65",
                         schedule_options={"rope@local": {"max_timescale": 10_000.0}}, norm="pre",
                         norm_type="layernorm_nobias", first_attention_norm=False, mlp="gated", use_bias="none",
                         head_bias=False,
                         layer_norm_eps=1e-5, dropout_rate=0.0, attention_dropout_rate=0.0), **overrides})

  @classmethod
  def vit(cls, **overrides) -> "TransformerConfig":
    """A vision transformer's encoder (Dosovitskiy et al. 2021, ViT-B/16's shape: 12 layers, 768 wide, 12 heads, MLP
    3072): Pre-LN LayerNorms (epsilon 1e-6) with a final one, exact GELU, biases everywhere, no embedding norm or token
    types, no dropout, a learned 2-D table (``absolute_2d`` on a 14 x 14 grid; ViT's own is a flattened ``[197, D]``
    table with a row for the class token: ``absolute_2d`` with ``class_row=True``, which loads its checkpoints) and
    ``max_len`` 197 (the grid and a class token). Its tokens are patches, given as ``inputs_embeds``
    (:class:`posjax.models.vision.ImageClassifier` embeds them): ``vocab_size`` 1, no word embedding is ever read or
    made."""
    return cls(**{**dict(vocab_size=1, max_len=197, type_vocab_size=0, position="absolute_2d", norm="pre",
                         layer_norm_eps=1e-6, embedding_norm=False, dropout_rate=0.0, attention_dropout_rate=0.0),
                  **overrides})

  # the presets' names before 0.2.0
  base, large, decoder = bert, bert_large, llama

  @classmethod
  def from_config(cls, model: Mapping[str, Any], vocab_size: int, max_len: int) -> "TransformerConfig":
    """A run's ``config.model`` (a ConfigDict or dict) as a TransformerConfig; ``vocab_size=0`` / ``max_len=0`` take the
    tokenizer's / the data's. An unknown field, or a vocabulary size other than the tokenizer's, is an error."""
    values = dict(model.to_dict() if hasattr(model, "to_dict") else model)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - fields)
    if unknown:
      raise ValueError(f"config.model has unknown field(s) {unknown}; TransformerConfig fields: {sorted(fields)}")
    values["vocab_size"] = values.get("vocab_size") or vocab_size
    values["max_len"] = values.get("max_len") or max_len
    if values["vocab_size"] != vocab_size:
      raise ValueError(f"model.vocab_size={values['vocab_size']} but the tokenizer has {vocab_size} pieces")
    return cls(**values)


class Unembed(nn.Module):
  """An untied LM head: ``[.., D] -> [.., V]`` float32 logits through its own ``kernel [D, V]`` (no bias), the
  products in the compute dtype, the sum in float32."""
  config: Any

  def setup(self):
    c = self.config
    self.kernel = self.param("kernel", base.normal_init((base.EMBED, VOCAB)), (c.hidden_size, c.vocab_size),
                             DTYPES[c.param_dtype])

  def matrix(self):
    """``[D, V]`` in the compute dtype."""
    return self.kernel.astype(DTYPES[self.config.dtype])

  def __call__(self, x_BxLxD):
    kernel_DxV = self.matrix()
    return jnp.einsum("...d,dv->...v", x_BxLxD.astype(kernel_DxV.dtype), kernel_DxV,
                      preferred_element_type=jnp.float32)


@flax.struct.dataclass
class EncoderOutput:
  last_hidden_state: jax.Array


def _dense(config: TransformerConfig, features: int, axes: tuple[str, str], name: str,
           use_bias: bool = True) -> nn.Dense:
  return nn.Dense(features, dtype=DTYPES[config.dtype], param_dtype=DTYPES[config.param_dtype], use_bias=use_bias,
                  kernel_init=base.normal_init(axes), bias_init=base.zeros_init(axes[1:]), name=name)


def _layer_norm(config: TransformerConfig, name: str) -> nn.Module:
  """The stack's norm (``config.norm_type``): LayerNorm (scale and bias), RMSNorm (scale) or Gemma's RMSNorm
  (``1 + scale``), over the width."""
  if config.norm_type == "offset_rmsnorm":
    return attention.OffsetRMSNorm(config.layer_norm_eps, DTYPES[config.dtype], DTYPES[config.param_dtype], name=name)
  if config.norm_type == "rmsnorm":
    return nn.RMSNorm(epsilon=config.layer_norm_eps, dtype=DTYPES[config.dtype],
                      param_dtype=DTYPES[config.param_dtype], scale_init=base.ones_init((base.EMBED,)), name=name)
  return nn.LayerNorm(epsilon=config.layer_norm_eps, dtype=DTYPES[config.dtype],
                      use_bias=config.norm_type == "layernorm", param_dtype=DTYPES[config.param_dtype],
                      scale_init=base.ones_init((base.EMBED,)), bias_init=base.zeros_init((base.EMBED,)), name=name)


class TransformerLayer(nn.Module):
  """One Transformer layer: self-attention with the position method's terms, then the MLP, each a residual
  branch with dropout and a LayerNorm after it (``norm="post"``) or before it (``"pre"``). Its output is
  constrained to the batch's sharding (:mod:`posjax.partitioning`); ``scanned``: it returns ``(x, None)``, the
  body of ``nn.scan``. ``position``: its method where the config's schedule gives one (default ``position``)."""
  config: TransformerConfig
  scanned: bool = False
  position: str = ""
  attention_norm: bool = True  # False: ModernBERT's first layer (``first_attention_norm``)
  temperature: Any = None  # its query temperature (config.layer_temperatures)

  @nn.compact
  def __call__(self, x_BxLxD, state: base.PositionState, mask: attention.Mask, deterministic: bool,
               decode: bool = False):
    y_BxLxD = partitioning.constrain(self._layer(x_BxLxD, state, mask, deterministic, decode), partitioning.BLD)
    return (y_BxLxD, None) if self.scanned else y_BxLxD

  def _layer(self, x_BxLxD, state: base.PositionState, mask: attention.Mask, deterministic: bool, decode: bool):
    c = self.config
    drop = lambda y: nn.Dropout(c.dropout_rate)(y, deterministic=deterministic)
    spec = c.method_specs[self.position] if self.position else c.position_spec
    attend = attention.SelfAttention(spec, c.attention_kernel, c.attention_dropout_rate,
                                     use_bias=c.use_bias != "none", out_bias=c.use_bias in ("all", "attention"),
                                     platform=c.kernel_platform or None, qk_norm=c.qk_norm,
                                     qk_norm_axes=c.qk_norm_axes, softcap=c.attention_softcap,
                                     qk_norm_offset=c.norm_type == "offset_rmsnorm", qk_norm_scale=c.qk_norm_scale,
                                     temperature=self.temperature, sinks=c.attention_sinks,
                                     query_block=c.attention_query_block,
                                     norm_eps=c.layer_norm_eps, name="attention")
    bias = c.use_bias == "all"

    def mlp(y):
      h = ACTIVATIONS[c.activation](_dense(c, c.intermediate_size, (base.EMBED, MLP), "mlp_gate" if c.mlp == "gated"
                                           else "mlp_in", bias)(y))
      if c.mlp == "gated":
        h = h * _dense(c, c.intermediate_size, (base.EMBED, MLP), "mlp_in", bias)(y)
      return _dense(c, c.hidden_size, (MLP, base.EMBED), "mlp_out", bias)(partitioning.constrain(h, partitioning.BLF))

    attention_norm, mlp_norm = _layer_norm(c, "attention_norm") if self.attention_norm else lambda y: y, _layer_norm(
        c, "mlp_norm")
    attend = functools.partial(attend, decode=decode)
    if c.parallel_residual:
      return (x_BxLxD + drop(attend(attention_norm(x_BxLxD), state, mask, deterministic))
              + drop(mlp(mlp_norm(x_BxLxD))))
    if c.norm == "post":
      x_BxLxD = attention_norm(x_BxLxD + drop(attend(x_BxLxD, state, mask, deterministic)))
      return mlp_norm(x_BxLxD + drop(mlp(x_BxLxD)))
    if c.norm == "reordered":
      x_BxLxD = x_BxLxD + drop(attention_norm(attend(x_BxLxD, state, mask, deterministic)))
      return x_BxLxD + drop(mlp_norm(mlp(x_BxLxD)))
    if c.norm == "peri":
      after_attention, after_mlp = _layer_norm(c, "attention_post_norm"), _layer_norm(c, "mlp_post_norm")
      x_BxLxD = x_BxLxD + drop(after_attention(attend(attention_norm(x_BxLxD), state, mask, deterministic)))
      return x_BxLxD + drop(after_mlp(mlp(mlp_norm(x_BxLxD))))
    x_BxLxD = x_BxLxD + drop(attend(attention_norm(x_BxLxD), state, mask, deterministic))
    return x_BxLxD + drop(mlp(mlp_norm(x_BxLxD)))


def _layer_class(config: TransformerConfig):
  """:class:`TransformerLayer`, rematerialised per ``config.remat``."""
  if config.remat == "none":
    return TransformerLayer
  # deterministic and decode (arguments 4, 5, counting the module) are static; CSE stays possible inside a scan
  # (MaxText's choice).
  return nn.remat(TransformerLayer, policy=REMAT_POLICIES[config.remat], prevent_cse=not config.scan_layers,
                  static_argnums=(4, 5))


class TransformerGroup(nn.Module):
  """One repeat of ``config.pattern`` (:class:`LayerKind` j as ``kind_{j}``), the body ``scan_layers`` scans when
  the layers are of several kinds: each kind its own program, compiled once whatever the depth."""
  config: TransformerConfig

  @nn.compact
  def __call__(self, x_BxLxD, states: dict, mask: attention.Mask, deterministic: bool, decode: bool = False):
    layer = _layer_class(self.config)
    for j, kind in enumerate(self.config.pattern):
      x_BxLxD = layer(self.config, position=kind.position, temperature=kind.temperature, name=f"kind_{j}")(
          x_BxLxD, states[kind.position], dataclasses.replace(mask, sliding_window=kind.window, chunk=kind.chunk),
          deterministic, decode)
    return x_BxLxD, None


def encoder_layers(config: TransformerConfig):
  """The encoder's layers: ``layer_{i}`` modules, or with ``scan_layers`` one ``layers`` module scanning a layer
  (a :class:`TransformerGroup` of the repeating :attr:`TransformerConfig.pattern` where the layers differ) over
  stacked parameters (logical axis ``layers``; each layer its own dropout and sown intermediates), each
  rematerialised per ``config.remat``."""
  layer = _layer_class(config)
  kinds = config.layer_kinds
  if not config.scan_layers:
    return [layer(config, position=kind.position, attention_norm=i > 0 or config.first_attention_norm,
                  temperature=kind.temperature, name=f"layer_{i}") for i, kind in enumerate(kinds)]
  grouped = len(config.pattern) > 1
  scan = nn.scan(TransformerGroup if grouped else layer, variable_axes={"params": 0, "intermediates": 0, "cache": 0},
                 split_rngs={"params": True, "dropout": True},
                 in_axes=(nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast),
                 length=config.num_layers // len(config.pattern), metadata_params={nn.PARTITION_NAME: layout.STACKED})
  if grouped:
    return scan(config, name=layout.STACKED)
  return scan(config, scanned=True, position=kinds[0].position, temperature=kinds[0].temperature,
              name=layout.STACKED)


class TransformerStack(nn.Module):
  """``input_ids [B, L] -> EncoderOutput(last_hidden_state [B, L, D])``.

  ``positions`` (``[B, L]`` or ``[1, L]``; default ``0..L-1``; ``[B, L, A]`` over A axes for a multi-axis method,
  :func:`posjax.positions.base.method_positions`) and ``segment_ids`` come from the batch, so packed sequences
  work: position terms use the batch's positions, tokens of different segments never attend to each other, and
  [CLS] untying applies to every token at position 0. With ``mutable=["intermediates"]`` it sows
  ``position_bias`` and every layer's ``attention_logits``.

  ``shared``: another encoder whose embeddings this one reads (ELECTRA's generator reads the discriminator's:
  word, token type, an input position table, their LayerNorm) instead of its own; its layers, its
  ``embeddings_project`` and any position terms inside the layers stay its own. ``shared_position_table``: it
  reads ``shared``'s position table too, for a method whose table feeds the layers (TUPE's; its projections
  stay this encoder's own).
  """

  config: TransformerConfig
  shared: Any = None
  shared_position_table: bool = False

  def setup(self):
    c, spec = self.config, self.config.position_spec
    dtype, param_dtype = DTYPES[c.dtype], DTYPES[c.param_dtype]
    self.word_embeddings = nn.Embed(c.vocab_size, c.embed_width, dtype=dtype, param_dtype=param_dtype,
                                    embedding_init=base.normal_init((VOCAB, base.EMBED)))
    if c.type_vocab_size:
      self.token_type_embeddings = nn.Embed(c.type_vocab_size, c.embed_width, dtype=dtype,
                                            param_dtype=param_dtype,
                                            embedding_init=base.normal_init((None, base.EMBED)))
    if self.shared_position_table:
      self.position = spec.method.encoder(spec=spec, table_from=self._table_source().position)
    else:
      self.position = spec.method.encoder(spec=spec)
    if c.embedding_norm:
      self.embedding_norm = _layer_norm(c, "embedding_norm")
    if not c.tie_embeddings:
      self.lm_head = Unembed(c, name="lm_head")
    self.embedding_dropout = nn.Dropout(c.dropout_rate)
    if c.embed_width != c.hidden_size:
      self.embeddings_project = _dense(c, c.hidden_size, (base.EMBED, MLP), "embeddings_project")
    self.layers = encoder_layers(c)
    # the schedule's other methods (position_schedule), each its own shared terms: ``position_<name>``
    self.scheduled = {name: other.method.encoder(spec=other, name=f"position_{name}")
                      for name, other in c.method_specs.items() if name != c.position}
    if c.norm != "post":  # a norm after the last layer (the decoders')
      self.final_norm = _layer_norm(c, "final_norm")

  def __call__(self, input_ids=None, *, inputs_embeds=None, token_type_ids=None, attention_mask=None,
               positions=None, segment_ids=None, deterministic: bool = True, decode: bool = False) -> EncoderOutput:
    """``decode``: incremental decoding with each layer's cache (:func:`posjax.attention.decode_step`; a causal
    model; :mod:`posjax.generate` drives it): ``input_ids`` are the new tokens, ``positions`` theirs.
    ``inputs_embeds`` ``[B, L, E]``: the tokens' embeddings given instead of ``input_ids`` (a vision transformer's
    patches, :mod:`posjax.models.vision`), as Hugging Face's argument of that name; the rest of the embedding
    (scale, token types, the method's input embedding, the norm) applies to them as to the word embeddings."""
    c, spec = self.config, self.config.position_spec
    if (input_ids is None) == (inputs_embeds is None):
      raise ValueError("give the stack input_ids [batch, length] or inputs_embeds [batch, length, width], one of them")
    if input_ids is not None and input_ids.ndim != 2:
      raise ValueError(f"input_ids must be [batch, length], got shape {input_ids.shape}")
    if inputs_embeds is not None and (inputs_embeds.ndim != 3 or inputs_embeds.shape[-1] != c.embed_width):
      raise ValueError(f"inputs_embeds must be [batch, length, {c.embed_width}] (the embedding width), got shape "
                       f"{inputs_embeds.shape}")
    batch, length = (input_ids if inputs_embeds is None else inputs_embeds).shape[:2]
    spec.check_length(length)
    if positions is None:
      positions = jnp.arange(length, dtype=jnp.int32)[None]
    base.check_rows("positions", positions[..., 0] if jnp.ndim(positions) == 3 else positions, batch, length)
    embeddings = self._embeddings_source()
    position = embeddings.position if spec.method.input_embedding and embeddings is not self else self.position
    state = position(base.method_positions(spec.method, positions))
    if state.bias is not None:
      self.sow("intermediates", "position_bias", state.bias)

    x = embeddings.word_embeddings(input_ids) if inputs_embeds is None else inputs_embeds.astype(DTYPES[c.dtype])
    if c.embedding_scale:
      x = x * jnp.asarray(c.hidden_size ** 0.5, x.dtype)
    if c.type_vocab_size:
      x = x + embeddings.token_type_embeddings(
          jnp.zeros((batch, length), jnp.int32) if token_type_ids is None else token_type_ids)
    elif token_type_ids is not None:
      raise ValueError("token_type_ids given but the config has type_vocab_size=0")
    if state.embedding is not None:
      x = x + state.embedding.astype(x.dtype)
    if c.embedding_norm:
      x = embeddings.embedding_norm(x)
    x = self.embedding_dropout(x, deterministic=deterministic)
    if c.embed_width != c.hidden_size:
      x = self.embeddings_project(x)

    if attention_mask is not None:
      base.check_rows("attention_mask", attention_mask, batch, length, "mask")
    mask = attention.Mask(None if attention_mask is None else attention_mask.astype(bool), segment_ids, c.causal)
    x = partitioning.constrain(x, partitioning.BLD)
    states = {c.position: state, **{name: encoder(base.method_positions(c.method_specs[name].method, positions))
                                    for name, encoder in self.scheduled.items()}}
    kinds = c.layer_kinds
    if c.scan_layers and len(c.pattern) > 1:
      x, _ = self.layers(x, states, mask, deterministic, decode)
    elif c.scan_layers:
      x, _ = self.layers(x, states[kinds[0].position], dataclasses.replace(
          mask, sliding_window=kinds[0].window, chunk=kinds[0].chunk), deterministic, decode)
    else:
      for layer, kind in zip(self.layers, kinds):
        x = layer(x, states[kind.position], dataclasses.replace(mask, sliding_window=kind.window, chunk=kind.chunk),
                  deterministic, decode)
    if c.norm != "post":
      x = self.final_norm(x)
    return EncoderOutput(last_hidden_state=x)

  def attend_words(self, x_BxLxE):
    """Float32 logits over the vocabulary through the (tied, perhaps shared) word embeddings, or the untied
    ``lm_head`` (``tie_embeddings=False``): the products take the compute dtype, the sum over the width accumulates
    in float32 (MaxText's ``logits_dot_in_fp32``)."""
    if not self.config.tie_embeddings:
      return self.lm_head(x_BxLxE)
    embed = self._embeddings_source().word_embeddings
    return jnp.einsum("...e,ve->...v", x_BxLxE.astype(embed.dtype), embed.embedding.astype(embed.dtype),
                      preferred_element_type=jnp.float32)

  def word_matrix(self):
    """``(matrix, layout)`` of :meth:`attend_words` in the compute dtype: the word embeddings ``[V, E]`` (``"ve"``)
    or the untied head's kernel ``[D, V]`` (``"dv"``), for :func:`posjax.models.lm_loss.token_losses`."""
    if not self.config.tie_embeddings:
      return self.lm_head.matrix(), "dv"
    embed = self._embeddings_source().word_embeddings
    return embed.embedding.astype(embed.dtype), "ve"

  def _table_source(self) -> "TransformerStack":
    """The encoder whose position table this one reads: ``shared``, with the same table-shareable method, options
    and ``max_len``."""
    spec = self.config.position_spec
    if self.shared is None or not spec.method.table_shareable:
      shareable = [n for n in positions_lib.names() if positions_lib.get(n).table_shareable]
      raise ValueError(f"sharing a position table needs an encoder to share with and a method whose table feeds "
                       f"the layers ({', '.join(shareable)}); here {self.config.position!r}"
                       + ("" if self.shared is not None else " and no shared encoder"))
    mine, theirs = spec, self.shared.config.position_spec
    fields = {"position": lambda s: s.method.name, "position options": lambda s: s.options,
              "max_len": lambda s: s.max_len}
    differ = [f"{name} (here {get(mine)!r}, there {get(theirs)!r})" for name, get in fields.items()
              if get(mine) != get(theirs)]
    if differ:
      raise ValueError("an encoder that shares another's position table needs the same " + ", ".join(differ))
    return self.shared

  def _embeddings_source(self) -> "TransformerStack":
    """This encoder, or the one whose embeddings it shares (which must have the same vocabulary, width, token
    types, input position method and its options)."""
    other = self.shared
    if other is None:
      return self
    mine, theirs = self.config, other.config
    fields = ["vocab_size", "embed_width", "type_vocab_size", "max_len", "param_dtype"]
    if mine.position_spec.method.input_embedding or theirs.position_spec.method.input_embedding:
      fields += ["position", "position_options"]
    differ = [f for f in fields if getattr(mine, f) != getattr(theirs, f)]
    if differ:
      raise ValueError("an encoder that shares another's embeddings needs the same " + ", ".join(
          f"{f} (here {getattr(mine, f)!r}, there {getattr(theirs, f)!r})" for f in differ))
    return other
