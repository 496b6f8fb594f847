"""Hugging Face decoders <-> posjax, exactly: Llama (every ``rope_scaling`` type posjax's RoPE has, LongRoPE
included; ``attention_bias``), Mistral (sliding window), Qwen2 (q/k/v biases), Qwen3 (QK-norm), Phi-3 (fused q/k/v and
gate/up weights, LongRoPE, partial rotary, a sliding window), GPT-NeoX (partial rotary, parallel residual) and GPT-2
(learned absolute positions), OLMo 2, Gemma and Gemma 2 and Gemma 3's text model (its local and global layers, each
with its own RoPE base: ``position_schedule``); the text decoders of Qwen2-VL and Qwen2.5-VL (Qwen2's, with M-RoPE's
sections) and Qwen3-VL (Qwen3's, with M-RoPE's interleaved layout) from their ``*ForConditionalGeneration``
checkpoints (:data:`VL_TYPES`; the vision tower's weights are not read: posjax takes the decoder only).

Each is the decoder preset of posjax's one stack (:meth:`posjax.models.TransformerConfig.llama`) with the family's
fields; the state-dict mapping is a table of names per family (:data:`LLAMA_LAYER`, :data:`GPT2_LAYER`), not code
per model (GPT-NeoX's fused ``query_key_value`` is per head ``[q_h, k_h, v_h]``; GPT-2's ``c_attn`` is
``[q, k, v]`` of Conv1D ``[in, out]`` weights). ``*ForCausalLM`` / ``GPT2LMHeadModel`` come across with the ``lm``
head, the base models (``LlamaModel``, ...) with none (their ``last_hidden_state`` is after the final norm, as
posjax's). A field posjax cannot represent (a per-layer sliding window, ``mlp_bias``, ``rope_type="mrope"``, ...) is
a one-line error naming it. A ``model.safetensors`` directory reads without PyTorch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

from posjax.convert.hf_bert import StateReader, check_shapes, model_params, read_source
from posjax.models import TransformerConfig, Transformer
from posjax.positions import rotary

LLAMA_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "olmo2", "gemma", "gemma2", "gemma3_text")
GEMMAS = ("gemma", "gemma2", "gemma3_text")
LOCAL_ROPE = "rope@local"  # Gemma 3's sliding-window layers' RoPE (its own base) in posjax's position_schedule
WINDOWED = ("mistral", "phi3")  # the Llama-family types whose config's sliding_window applies to every layer
# The vision-language models whose text decoder posjax reads: its family, and M-RoPE's layout (posjax's `mrope`)
VL_TYPES = {"qwen2_vl": ("qwen2", "sections"), "qwen2_5_vl": ("qwen2", "sections"),
            "qwen3_vl": ("qwen3", "interleaved")}
MODEL_TYPES = (*LLAMA_TYPES, "gpt_neox", "gpt2", *VL_TYPES)
HF_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
              "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
              "phi3": ("Phi3Config", "Phi3ForCausalLM"), "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
              "gemma": ("GemmaConfig", "GemmaForCausalLM"), "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
              "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
              "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM"), "gpt2": ("GPT2Config", "GPT2LMHeadModel")}
# Phi-3's fused projections: its name -> the Llama names its rows split into, in order
PHI3_FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
              "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
# rope_scaling's keys under posjax's RoPE option names (the rest are the same words)
ROPE_KEYS = {"original_max_position_embeddings": "original_max_len"}
ROPE_FIELDS = {f.name for f in dataclasses.fields(rotary.RopeOptions)} - {"max_timescale", "scaling",
                                                                         "rotary_fraction"}
SCALING_KEYS = {"llama3": ("low_freq_factor", "high_freq_factor")}  # keys Hugging Face requires even at defaults
GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}
GATED_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}  # the Llama family's MLP gate
# Per family: the base model's prefix, the embeddings' and the LM head's names.
FAMILY_KEYS = {**{t: ("model.", "embed_tokens.weight", "lm_head.weight") for t in LLAMA_TYPES},
               "gpt_neox": ("gpt_neox.", "embed_in.weight", "embed_out.weight"),
               "gpt2": ("transformer.", "wte.weight", "lm_head.weight"),
               **{t: ("model.", "embed_tokens.weight", "lm_head.weight") for t in VL_TYPES}}
# A vision-language checkpoint: its text decoder's prefix where transformers 4.52+ keeps it in memory (its files keep
# the older ``model.``), and its vision tower's prefixes
VL_TEXT_PREFIX, VISION_PREFIXES = "model.language_model.", ("visual.", "model.visual.")
# Buffers and copies Hugging Face keeps beside the weights, which posjax does not need.
DROPPED_SUFFIXES = ("rotary_emb.inv_freq", "attn.bias", "attn.masked_bias")

# posjax path under encoder/layer_{i} -> Hugging Face name under model.layers.{i} (Llama family) or h.{i} (GPT-2)
LLAMA_LAYER = {"attention/query": "self_attn.q_proj", "attention/key": "self_attn.k_proj",
               "attention/value": "self_attn.v_proj", "attention/out": "self_attn.o_proj",
               "attention/q_norm": "self_attn.q_norm", "attention/k_norm": "self_attn.k_norm",
               "mlp_gate": "mlp.gate_proj", "mlp_in": "mlp.up_proj", "mlp_out": "mlp.down_proj",
               "attention_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
# OLMo 2's norms sit on each branch's output (norm="reordered"): its post-attention and post-feed-forward norms
OLMO2_LAYER = {**LLAMA_LAYER, "attention_norm": "post_attention_layernorm", "mlp_norm": "post_feedforward_layernorm"}
# Gemma 2's norms before and after each branch (norm="peri")
GEMMA2_LAYER = {**LLAMA_LAYER, "attention_post_norm": "post_attention_layernorm",  # and Gemma 3's
                "mlp_norm": "pre_feedforward_layernorm", "mlp_post_norm": "post_feedforward_layernorm"}
LAYER_NAMES = {"reordered": OLMO2_LAYER, "peri": GEMMA2_LAYER}  # the Llama family's names by norm placement
NEOX_LAYER = {"attention_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
              "mlp_in": "mlp.dense_h_to_4h", "mlp_out": "mlp.dense_4h_to_h", "attention/out": "attention.dense"}
GPT2_LAYER = {"attention_norm": "ln_1", "mlp_norm": "ln_2", "mlp_in": "mlp.c_fc", "mlp_out": "mlp.c_proj",
              "attention/out": "attn.c_proj"}


def _rope_from_hf(hf: Mapping[str, Any]) -> dict:
  options = {"max_timescale": float(hf.get("rope_theta", 10_000.0))}
  scaling = dict(hf.get("rope_scaling") or {})
  kind = scaling.pop("rope_type", scaling.pop("type", "default"))
  if kind == "default":
    return options
  if kind not in rotary.SCALINGS:
    raise ValueError(f"config.json has rope_scaling rope_type={kind!r}; posjax's RoPE has "
                     f"{['default', *rotary.SCALINGS[1:]]}")
  for key, value in scaling.items():
    name = ROPE_KEYS.get(key, key)
    if name not in ROPE_FIELDS:
      raise ValueError(f"config.json has rope_scaling key {key!r}; posjax's {kind} scaling reads "
                       f"{sorted(ROPE_FIELDS)}")
    options[name] = value
  if kind == "dynamic":
    options.pop("original_max_len", None)  # Hugging Face's dynamic scaling grows from max_position_embeddings
  if kind == "longrope":  # Phi-3's: the original length beside max_position_embeddings, the factor their ratio
    original = hf.get("original_max_position_embeddings")
    read = int(original or hf.get("max_position_embeddings", 2048))
    if options.get("original_max_len") not in (None, read):
      raise ValueError(f"config.json has rope_scaling original_max_position_embeddings={options['original_max_len']}"
                       f" for longrope, which Hugging Face's longrope does not read (it switches at the top-level "
                       f"original_max_position_embeddings, else max_position_embeddings: {read}); set the top-level "
                       "key to the length the model was trained at")
    if original:
      options.update(original_max_len=int(original),
                     factor=float(hf.get("max_position_embeddings", 2048)) / int(original))
    options.setdefault("factor", 1.0)
  return {**options, "scaling": kind}


def config_from_hf(hf: Mapping[str, Any]) -> TransformerConfig:
  """A Hugging Face decoder's ``config.json`` (a dict) as posjax's :class:`TransformerConfig`; what posjax cannot
  represent
  is an error naming the field."""
  model_type = hf.get("model_type")
  if model_type not in MODEL_TYPES:
    raise ValueError(f"config.json has model_type={model_type!r}; the decoder converter reads {list(MODEL_TYPES)}")
  if model_type == "gpt2":
    return _gpt2_config(hf)
  if model_type == "gpt_neox":
    return _neox_config(hf)
  if model_type in VL_TYPES:
    return _vl_config(hf)
  heads = int(hf["num_attention_heads"])
  unsupported = {"mlp_bias": False, "pretraining_tp": 1, "use_sliding_window": False, "layer_types": None,
                 "use_bidirectional_attention": False}
  for field, allowed in unsupported.items():
    value = hf.get(field, allowed)
    if field == "layer_types" and value is not None and (set(value) == {"full_attention"} or (
        model_type in ("gemma2", "gemma3_text") and set(value) <= {"full_attention", "sliding_attention"})):
      continue
    if field == "use_sliding_window" and model_type in WINDOWED:
      continue
    if value != allowed:
      raise ValueError(f"config.json has {field}={value!r}; posjax represents only {field}={allowed!r}")
  act = hf.get("hidden_activation") or hf.get("hidden_act", "gelu_pytorch_tanh" if model_type in GEMMAS else "silu")
  if act not in GATED_ACTIVATIONS:
    raise ValueError(f"config.json has hidden_act={act!r}; posjax's {model_type} reads {sorted(GATED_ACTIVATIONS)}")
  if model_type == "qwen2":
    use_bias = "qkv"
  elif hf.get("attention_bias", False):
    if model_type != "llama":
      raise ValueError(f"config.json has attention_bias=True; posjax's {model_type} has no q/k/v/o biases")
    use_bias = "attention"
  else:
    use_bias = "none"
  window = hf.get("sliding_window") if model_type in WINDOWED else None
  gemma2 = _gemma2_fields(hf, model_type) if model_type in ("gemma2", "gemma3_text") else {}
  rope = _rope_from_hf({"rope_theta": 1_000_000.0, **hf} if model_type == "gemma3_text" else hf)
  fraction = float(hf.get("partial_rotary_factor", 1.0)) if model_type == "phi3" else 1.0
  if fraction != 1.0:
    rope["rotary_fraction"] = fraction
  return TransformerConfig.decoder(
      vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]), num_layers=int(hf["num_hidden_layers"]),
      num_heads=heads, num_kv_heads=int(hf.get("num_key_value_heads") or heads),
      head_dim=int(hf.get("head_dim") or 0) if int(hf.get("head_dim") or 0) * heads != int(hf["hidden_size"]) else 0,
      intermediate_size=int(hf["intermediate_size"]), max_len=int(hf.get("max_position_embeddings", 2048)),
      layer_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", model_type in GEMMAS)), activation=GATED_ACTIVATIONS[act],
      norm_type="offset_rmsnorm" if model_type in GEMMAS else "rmsnorm", embedding_scale=model_type in GEMMAS,
      attention_dropout_rate=float(hf.get("attention_dropout", 0.0)), use_bias=use_bias,
      qk_norm=model_type in ("qwen3", "olmo2", "gemma3_text"), qk_norm_axes="all" if model_type == "olmo2" else "head",
      sliding_window=int(window or 0), position="rope", position_options=rope,
      **{"norm": "reordered" if model_type == "olmo2" else "pre", **gemma2})


def _vl_config(hf: Mapping[str, Any]) -> TransformerConfig:
  """A vision-language model's text decoder (its ``text_config``, or the top level of an older ``config.json``): its
  family's config with M-RoPE (``rope_scaling``'s ``mrope_section``; Qwen3-VL's interleaved layout)."""
  family, allocation = VL_TYPES[hf["model_type"]]
  text = dict(hf.get("text_config") or hf)
  scaling = dict(text.get("rope_scaling") or {})
  sections = scaling.pop("mrope_section", None)
  interleaved = scaling.pop("mrope_interleaved", allocation == "interleaved")
  if interleaved != (allocation == "interleaved"):  # Hugging Face's layout follows the model type, not this flag
    raise ValueError(f"config.json's text_config has mrope_interleaved={interleaved!r}; Hugging Face's "
                     f"{hf['model_type']} ignores it and runs M-RoPE's {allocation} layout")
  kind = scaling.pop("rope_type", scaling.pop("type", "default"))
  if kind not in ("default", "mrope") or scaling:
    raise ValueError(f"config.json's text_config has rope_scaling {text.get('rope_scaling')!r}; posjax's mrope reads "
                     "mrope_section (and Qwen3-VL's mrope_interleaved) without a scaling")
  if sections is None:
    raise ValueError("config.json's text_config has no rope_scaling.mrope_section; M-RoPE needs its sections")
  config = config_from_hf({**text, "model_type": family, "rope_scaling": None})
  if sum(sections) != config.position_spec.head_dim // 2:
    raise ValueError(f"config.json's text_config has mrope_section={list(sections)}; it must sum to head_dim / 2 = "
                     f"{config.position_spec.head_dim // 2}")
  options = {"max_timescale": config.position_spec.options.max_timescale, "sections": tuple(sections),
             "allocation": allocation}
  return dataclasses.replace(config, position="mrope", position_options=options)


def _gemma2_fields(hf: Mapping[str, Any], model_type: str) -> dict:
  """Gemma 2's and 3's own fields: norms before and after each branch, the q·k scale, the soft caps and the layers'
  windows (``layer_types``; where the config names none, Gemma 2's sliding and full layers in turn and Gemma 3's
  ``sliding_window_pattern`` (6: five sliding layers, then a full one)). Gemma 3's sliding layers read RoPE at
  ``rope_local_base_freq`` without scaling (:data:`LOCAL_ROPE`), its full layers ``rope_theta`` and
  ``rope_scaling``. Gemma 3's ``attn_logit_softcapping`` is read as none: Hugging Face's Gemma 3 attention does not
  apply it (its config keeps the field from Gemma 2)."""
  layers = int(hf["num_hidden_layers"])
  every = 2 if model_type == "gemma2" else int(hf.get("sliding_window_pattern", 6))
  types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % every else "full_attention"
                                    for i in range(layers)]
  window = int(hf.get("sliding_window") or 0)
  fields = {"norm": "peri", "query_scale": float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
            "attention_softcap": float(hf.get("attn_logit_softcapping") or 0.0) if model_type == "gemma2" else 0.0,
            "final_logit_softcap": float(hf.get("final_logit_softcapping") or 0.0),
            "layer_windows": ",".join(str(window if t == "sliding_attention" else 0) for t in types)}
  if model_type == "gemma3_text" and "sliding_attention" in types:
    fields.update(position_schedule=",".join(LOCAL_ROPE if t == "sliding_attention" else "rope" for t in types),
                  schedule_options={LOCAL_ROPE: {"max_timescale": float(hf.get("rope_local_base_freq", 10_000.0))}})
  return fields


def _gpt2_config(hf: Mapping[str, Any]) -> TransformerConfig:
  act = hf.get("activation_function", "gelu_new")
  if act not in GPT2_ACTIVATIONS:
    raise ValueError(f"config.json has activation_function={act!r}; posjax reads {sorted(GPT2_ACTIVATIONS)}")
  for field in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
    if hf.get(field, False):
      raise ValueError(f"config.json has {field}=True; posjax represents only {field}=False")
  if not hf.get("scale_attn_weights", True):
    raise ValueError("config.json has scale_attn_weights=False; posjax scales q·k by 1/sqrt(head_dim)")
  d = int(hf["n_embd"])
  return TransformerConfig.decoder(
      vocab_size=int(hf["vocab_size"]), hidden_size=d, num_layers=int(hf["n_layer"]), num_heads=int(hf["n_head"]),
      intermediate_size=int(hf.get("n_inner") or 4 * d), max_len=int(hf["n_positions"]), position="absolute",
      norm_type="layernorm", mlp="dense", activation=GPT2_ACTIVATIONS[act], use_bias="all",
      tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
      layer_norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
      dropout_rate=float(hf.get("resid_pdrop", 0.1)), attention_dropout_rate=float(hf.get("attn_pdrop", 0.1)))


def _neox_config(hf: Mapping[str, Any]) -> TransformerConfig:
  act = hf.get("hidden_act", "gelu")
  if act not in GPT2_ACTIVATIONS:
    raise ValueError(f"config.json has hidden_act={act!r}; posjax reads {sorted(GPT2_ACTIVATIONS)}")
  if not hf.get("attention_bias", True):
    raise ValueError("config.json has attention_bias=False; posjax's GPT-NeoX has biases on every projection "
                     "(its MLP's too)")
  rope = _rope_from_hf({**hf, "rope_theta": hf.get("rope_theta", hf.get("rotary_emb_base", 10_000.0))})
  fraction = float(hf.get("partial_rotary_factor", hf.get("rotary_pct", 0.25)))
  return TransformerConfig.decoder(
      vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]), num_layers=int(hf["num_hidden_layers"]),
      num_heads=int(hf["num_attention_heads"]), intermediate_size=int(hf["intermediate_size"]),
      max_len=int(hf.get("max_position_embeddings", 2048)), norm_type="layernorm", mlp="dense",
      activation=GPT2_ACTIVATIONS[act], use_bias="all", layer_norm_eps=float(hf.get("layer_norm_eps", 1e-5)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      parallel_residual=bool(hf.get("use_parallel_residual", True)),
      dropout_rate=float(hf.get("hidden_dropout", 0.0)), attention_dropout_rate=float(hf.get("attention_dropout", 0.0)),
      position="rope", position_options={**rope, **({"rotary_fraction": fraction} if fraction != 1.0 else {})})


def _rope_to_hf(config: TransformerConfig) -> dict:
  options = config.position_spec.options
  defaults = rotary.RopeOptions()
  out = {"rope_theta": options.max_timescale}
  if options.scaling != "none":
    scaling = {"rope_type": options.scaling, "factor": options.factor}
    for field in sorted(ROPE_FIELDS - {"factor"}):
      value = getattr(options, field)
      if value != getattr(defaults, field) or field in SCALING_KEYS.get(options.scaling, ()):
        scaling[{v: k for k, v in ROPE_KEYS.items()}.get(field, field)] = value
    if options.scaling == "longrope":  # Hugging Face reads the original length at the config's top level (Phi-3)
      out["original_max_position_embeddings"] = scaling.pop("original_max_position_embeddings", config.max_len)
    out["rope_scaling"] = scaling
  return out


def model_type_of(config: TransformerConfig) -> str:
  """The Hugging Face family that expresses ``config``: GPT-2 (learned absolute positions), GPT-NeoX (LayerNorm),
  OLMo 2 (reordered norms), Gemma ((1 + w) RMSNorm), Qwen3 (QK-norm), Qwen2 (q/k/v biases), Phi-3 (partial
  rotary), Mistral (a sliding window) or Llama."""
  if config.position == "absolute":
    return "gpt2"
  if config.norm_type == "layernorm":
    return "gpt_neox"
  if config.norm == "reordered":
    return "olmo2"
  if config.norm == "peri":
    return "gemma3_text" if config.qk_norm else "gemma2"
  if config.norm_type == "offset_rmsnorm":
    return "gemma"
  if config.qk_norm:
    return "qwen3"
  if config.use_bias == "qkv":
    return "qwen2"
  if config.position_spec.options.rotary_fraction != 1.0:
    return "phi3"
  return "mistral" if config.sliding_window else "llama"


def config_to_hf(config: TransformerConfig, model_type: str | None = None) -> dict:
  """posjax's decoder config as a Hugging Face ``config.json`` dict of ``model_type`` (default
  :func:`model_type_of`); what that family cannot express is an error naming the field."""
  if model_type in VL_TYPES or config.position == "mrope":
    raise ValueError(f"an M-RoPE decoder goes out as the text decoder of a vision-language checkpoint of "
                     f"{list(VL_TYPES)}, whose vision tower posjax does not have: export it with vision_from= the "
                     "checkpoint it came from (to_hf_decoder)")
  model_type = model_type or model_type_of(config)
  if model_type not in MODEL_TYPES:
    raise ValueError(f"model_type={model_type!r}; the decoder converter writes {list(MODEL_TYPES)}")
  wanted = config_from_hf({"model_type": model_type, **_fields_to_hf(config, model_type)})
  differ = [name for name, value in _compared(config).items() if _compared(wanted)[name] != value]
  if differ:
    raise ValueError(f"Hugging Face {model_type} cannot express this model: " + ", ".join(
        f"{name}={_compared(config)[name]!r} (it would be {_compared(wanted)[name]!r})" for name in differ))
  return {"model_type": model_type, **_fields_to_hf(config, model_type)}


def _compared(config: TransformerConfig) -> dict:
  """What a Hugging Face family must reproduce of a config: its fields (defaults resolved: the heads' width and
  count, the position method's options), less the run's choices (kernel, dtypes, remat, layout, dropout)."""
  skip = ("attention_kernel", "kernel_platform", "dtype", "param_dtype", "remat", "scan_layers", "dropout_rate",
          "attention_dropout_rate", "position_options", "head_dim", "num_kv_heads", "schedule_options",
          "layer_windows", "sliding_window", "layout", "layout_options")  # a layout: compared by what it sets
  values = {f.name: getattr(config, f.name) for f in dataclasses.fields(TransformerConfig) if f.name not in skip}
  spec, specs = config.position_spec, config.method_specs
  schedule = tuple((specs[n].method.name, specs[n].options) for n in config.layer_positions)  # not the entries' tags
  return {**values, "position_options": spec.options, "head_dim": spec.head_dim, "num_kv_heads": spec.kv_heads,
          "position_schedule": schedule if len(set(schedule)) > 1 else (), "windows": config.windows}


def _fields_to_hf(config: TransformerConfig, model_type: str) -> dict:
  if model_type == "gpt2":
    return {"vocab_size": config.vocab_size, "n_embd": config.hidden_size, "n_layer": config.num_layers,
            "n_head": config.num_heads, "n_inner": config.intermediate_size, "n_positions": config.max_len,
            "activation_function": {"gelu_tanh": "gelu_new"}.get(config.activation, config.activation),
            "layer_norm_epsilon": config.layer_norm_eps, "tie_word_embeddings": config.tie_embeddings,
            "resid_pdrop": config.dropout_rate, "embd_pdrop": config.dropout_rate,
            "attn_pdrop": config.attention_dropout_rate}
  if config.position != "rope":
    raise ValueError(f"Hugging Face {model_type} has RoPE positions; this model has position={config.position!r}")
  if model_type == "gpt_neox":
    options = config.position_spec.options
    return {"vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
            "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
            "intermediate_size": config.intermediate_size, "max_position_embeddings": config.max_len,
            "hidden_act": {"gelu_tanh": "gelu_new"}.get(config.activation, config.activation),
            "layer_norm_eps": config.layer_norm_eps, "tie_word_embeddings": config.tie_embeddings,
            "use_parallel_residual": config.parallel_residual, "rotary_pct": options.rotary_fraction,
            "partial_rotary_factor": options.rotary_fraction, "attention_bias": True,
            "hidden_dropout": config.dropout_rate, "attention_dropout": config.attention_dropout_rate,
            **_rope_to_hf(config)}
  fields = {"vocab_size": config.vocab_size, "hidden_size": config.hidden_size, "num_hidden_layers": config.num_layers,
            "num_attention_heads": config.num_heads, "num_key_value_heads": config.position_spec.kv_heads,
            "head_dim": config.position_spec.head_dim, "intermediate_size": config.intermediate_size,
            "max_position_embeddings": config.max_len, "rms_norm_eps": config.layer_norm_eps,
            "hidden_act": {v: k for k, v in GATED_ACTIVATIONS.items()}.get(config.activation, config.activation),
            "tie_word_embeddings": config.tie_embeddings, "attention_dropout": config.attention_dropout_rate,
            **_rope_to_hf(config)}
  if model_type in WINDOWED:
    fields["sliding_window"] = config.sliding_window or None
  if model_type == "phi3":
    fields["partial_rotary_factor"] = config.position_spec.options.rotary_fraction
    fields["attention_bias"] = False
    fields["pad_token_id"] = None  # Phi3Config's default, 32000, is past a smaller vocabulary (the run's own: save_hf)
    if "rope_scaling" in fields:  # Phi-3's reads exactly these three keys (its factor: the lengths' ratio)
      scaling = fields["rope_scaling"]
      fields["rope_scaling"] = {"type": scaling["rope_type"], "short_factor": list(scaling.get("short_factor", ())),
                                "long_factor": list(scaling.get("long_factor", ()))}
  if model_type in ("llama", "qwen3", "olmo2", *GEMMAS):
    fields["attention_bias"] = config.use_bias == "attention"
  if model_type in GEMMAS:
    fields["hidden_activation"] = fields["hidden_act"]
  if model_type in ("gemma2", "gemma3_text"):
    windows = set(config.windows) - {0}
    if len(windows) > 1:
      raise ValueError(f"Hugging Face {model_type} has one sliding window; this model's layers have "
                       f"{sorted(windows)}")
    fields.update(query_pre_attn_scalar=config.position_spec.scale ** -2,
                  attn_logit_softcapping=config.attention_softcap or None,
                  final_logit_softcapping=config.final_logit_softcap or None,
                  sliding_window=windows.pop() if windows else None,
                  layer_types=["sliding_attention" if w else "full_attention" for w in config.windows])
  if model_type == "gemma3_text":
    local = [config.method_specs[n] for n, w in zip(config.layer_positions, config.windows) if w]
    fields["rope_local_base_freq"] = local[0].options.max_timescale if local else 10_000.0
  if model_type == "olmo2":
    fields.pop("head_dim")  # OLMo 2's is hidden_size / num_attention_heads
  return fields


def _gpt2_params(config: TransformerConfig, reader: StateReader, prefix: str) -> None:
  take, out, d = reader.take, reader.out, config.hidden_size
  heads, head_dim = config.num_heads, config.hidden_size // config.num_heads
  out["encoder/word_embeddings/embedding"] = take(f"{prefix}wte.weight")
  out["encoder/position/table/embedding"] = take(f"{prefix}wpe.weight")
  for i in range(config.num_layers):
    hf, px = f"{prefix}h.{i}", f"encoder/layer_{i}"
    for target, name in GPT2_LAYER.items():  # Conv1D: weights stored [in, out], posjax's layout
      if target.endswith("norm"):
        reader.norm(f"{px}/{target}", f"{hf}.{name}")
      elif target == "attention/out":
        out[f"{px}/{target}/kernel"] = take(f"{hf}.{name}.weight").reshape(heads, head_dim, d)
        out[f"{px}/{target}/bias"] = take(f"{hf}.{name}.bias")
      else:
        out[f"{px}/{target}/kernel"] = take(f"{hf}.{name}.weight")
        out[f"{px}/{target}/bias"] = take(f"{hf}.{name}.bias")
    qkv_kernel, qkv_bias = take(f"{hf}.attn.c_attn.weight"), take(f"{hf}.attn.c_attn.bias")
    for part, kernel, bias in zip(("query", "key", "value"), np.split(qkv_kernel, 3, axis=1), np.split(qkv_bias, 3)):
      out[f"{px}/attention/{part}/kernel"] = kernel.reshape(d, heads, head_dim)
      out[f"{px}/attention/{part}/bias"] = bias.reshape(heads, head_dim)
  reader.norm("encoder/final_norm", f"{prefix}ln_f")


def _neox_params(config: TransformerConfig, reader: StateReader, prefix: str) -> None:
  take, out, d = reader.take, reader.out, config.hidden_size
  heads, head_dim = config.num_heads, config.position_spec.head_dim
  out["encoder/word_embeddings/embedding"] = take(f"{prefix}embed_in.weight")
  for i in range(config.num_layers):
    hf, px = f"{prefix}layers.{i}", f"encoder/layer_{i}"
    for target, name in NEOX_LAYER.items():
      if target.endswith("norm"):
        reader.norm(f"{px}/{target}", f"{hf}.{name}")
      else:
        reader.dense(f"{px}/{target}", f"{hf}.{name}")
    out[f"{px}/attention/out/kernel"] = out[f"{px}/attention/out/kernel"].reshape(heads, head_dim, d)
    kernel_Hx3xKxD = take(f"{hf}.attention.query_key_value.weight").reshape(heads, 3, head_dim, d)
    bias_Hx3xK = take(f"{hf}.attention.query_key_value.bias").reshape(heads, 3, head_dim)
    for index, part in enumerate(("query", "key", "value")):
      out[f"{px}/attention/{part}/kernel"] = kernel_Hx3xKxD[:, index].transpose(2, 0, 1)
      out[f"{px}/attention/{part}/bias"] = bias_Hx3xK[:, index]
  reader.norm("encoder/final_norm", f"{prefix}final_layer_norm")


def _llama_params(config: TransformerConfig, reader: StateReader, prefix: str) -> None:
  take, out, d = reader.take, reader.out, config.hidden_size
  spec = config.position_spec
  heads = {"attention/query": spec.num_heads, "attention/key": spec.kv_heads, "attention/value": spec.kv_heads}
  norm_heads = {"attention/q_norm": spec.num_heads, "attention/k_norm": spec.kv_heads}
  out["encoder/word_embeddings/embedding"] = take(f"{prefix}embed_tokens.weight")
  for i in range(config.num_layers):
    hf, px = f"{prefix}layers.{i}", f"encoder/layer_{i}"
    for target, name in LAYER_NAMES.get(config.norm, LLAMA_LAYER).items():
      if target.endswith(("q_norm", "k_norm")) and not config.qk_norm:
        continue
      if target in norm_heads and config.qk_norm_axes == "all":  # over all heads: [H·K] -> [H, K]
        out[f"{px}/{target}/scale"] = take(f"{hf}.{name}.weight").reshape(norm_heads[target], spec.head_dim)
      elif target.endswith("norm"):
        out[f"{px}/{target}/scale"] = take(f"{hf}.{name}.weight")
      elif target in heads:  # [H·K, D] -> [D, H, K]
        out[f"{px}/{target}/kernel"] = take(f"{hf}.{name}.weight").T.reshape(d, heads[target], spec.head_dim)
        if config.use_bias != "none":
          out[f"{px}/{target}/bias"] = take(f"{hf}.{name}.bias").reshape(heads[target], spec.head_dim)
      elif target == "attention/out":  # [D, H·K] -> [H, K, D]
        out[f"{px}/{target}/kernel"] = take(f"{hf}.{name}.weight").T.reshape(spec.num_heads, spec.head_dim, d)
        if config.use_bias == "attention":
          out[f"{px}/{target}/bias"] = take(f"{hf}.{name}.bias")
      else:
        out[f"{px}/{target}/kernel"] = take(f"{hf}.{name}.weight").T
  out["encoder/final_norm/scale"] = take(f"{prefix}norm.weight")


def _fused_rows(config: TransformerConfig, fused: str) -> list[int]:
  """The rows of each part of a Phi-3 fused projection (:data:`PHI3_FUSED`)."""
  spec = config.position_spec
  if fused == "self_attn.qkv_proj":
    return [spec.num_heads * spec.head_dim, spec.kv_heads * spec.head_dim, spec.kv_heads * spec.head_dim]
  return [config.intermediate_size] * 2


def _split_fused(config: TransformerConfig, state: Mapping[str, np.ndarray]) -> dict:
  """Phi-3's state dict with its fused ``qkv_proj`` and ``gate_up_proj`` split into Llama's names."""
  out = dict(state)
  for key in [k for k in state if k.endswith(tuple(f"{f}.weight" for f in PHI3_FUSED))]:
    fused = next(f for f in PHI3_FUSED if key.endswith(f"{f}.weight"))
    rows = _fused_rows(config, fused)
    if state[key].shape[0] != sum(rows):
      raise ValueError(f"Hugging Face phi3 weight {key} has {state[key].shape[0]} rows; its config gives {rows}")
    parts = np.split(out.pop(key), np.cumsum(rows)[:-1], axis=0)
    out.update({key.replace(fused, name): part for name, part in zip(PHI3_FUSED[fused], parts)})
  return out


def _fuse(state: dict) -> dict:
  """Llama's names fused back into Phi-3's (:func:`_split_fused` reversed)."""
  for fused, names in PHI3_FUSED.items():
    for key in [k for k in list(state) if k.endswith(f"{names[0]}.weight")]:
      state[key.replace(names[0], fused)] = np.concatenate([state.pop(key.replace(names[0], n)) for n in names])
  return state


def params_from_hf(config: TransformerConfig, model_type: str, state: Mapping[str, np.ndarray]) -> tuple[dict, str]:
  """``(flat posjax parameters, head)`` from a Hugging Face decoder's state dict (a causal-LM model's or its base
  model's); a weight left over is an error naming it."""
  base, embed, head_key = FAMILY_KEYS[model_type]
  if model_type in VL_TYPES and any(k.startswith(VL_TEXT_PREFIX) for k in state):
    base = VL_TEXT_PREFIX
  prefix = base if any(k.startswith(base) for k in state) else ""
  head = "lm" if prefix else "none"
  if model_type == "phi3":
    state = _split_fused(config, state)
  reader = StateReader(state, f"Hugging Face {model_type}")
  {"gpt2": _gpt2_params, "gpt_neox": _neox_params}.get(model_type, _llama_params)(config, reader, prefix)
  if head == "lm" and head_key in state:
    if config.tie_embeddings:
      if not np.array_equal(reader.take(head_key), state[prefix + embed]):
        raise ValueError(f"config.json has tie_word_embeddings=True but {head_key} differs from the embeddings")
    else:
      reader.out["encoder/lm_head/kernel"] = reader.take(head_key).T
  left = [k for k in reader.dropped() if not k.endswith(DROPPED_SUFFIXES) and not k.startswith(VISION_PREFIXES)]
  if left:
    raise ValueError(f"weights posjax has no place for: {left}")
  return reader.out, head


def from_hf_decoder(source) -> tuple[Transformer, dict]:
  """``(module, variables)`` equal to a Hugging Face decoder (:data:`MODEL_TYPES`): an in-memory ``transformers``
  model or a directory. ``module.apply(variables, input_ids)`` returns a :class:`posjax.models.TransformerOutput` whose
  ``.logits`` are the causal LM's (``last_hidden_state`` for a base model)."""
  hf_config, state, where = read_source(source)
  config = config_from_hf(hf_config)
  flat, head = params_from_hf(config, hf_config["model_type"], state)
  module = Transformer(config, head=head)
  return module, {"params": check_shapes(module, flat, where)}


def state_to_hf(config: TransformerConfig, params: Mapping, model_type: str) -> dict[str, np.ndarray]:
  """A Hugging Face causal-LM state dict of ``model_type`` from posjax parameters (:func:`model_params`' layout)."""
  import flax.traverse_util

  flat = {k: np.asarray(v, np.float32) for k, v in flax.traverse_util.flatten_dict(dict(params), sep="/").items()}
  spec, d, out = config.position_spec, config.hidden_size, {}
  if model_type == "gpt_neox":
    out["gpt_neox.embed_in.weight"] = embed = flat["encoder/word_embeddings/embedding"]
    heads, head_dim = spec.num_heads, spec.head_dim
    for i in range(config.num_layers):
      hf, px = f"gpt_neox.layers.{i}", f"encoder/layer_{i}"
      for target, name in NEOX_LAYER.items():
        if target.endswith("norm"):
          out[f"{hf}.{name}.weight"], out[f"{hf}.{name}.bias"] = (flat[f"{px}/{target}/{p}"] for p in ("scale", "bias"))
        else:
          kernel = flat[f"{px}/{target}/kernel"]
          out[f"{hf}.{name}.weight"] = kernel.reshape(-1, kernel.shape[-1]).T
          out[f"{hf}.{name}.bias"] = flat[f"{px}/{target}/bias"]
      parts = ("query", "key", "value")
      kernel_Hx3xKxD = np.stack([flat[f"{px}/attention/{p}/kernel"].transpose(1, 2, 0) for p in parts], 1)
      out[f"{hf}.attention.query_key_value.weight"] = kernel_Hx3xKxD.reshape(3 * heads * head_dim, d)
      out[f"{hf}.attention.query_key_value.bias"] = np.stack([flat[f"{px}/attention/{p}/bias"] for p in parts],
                                                             1).reshape(-1)
    out["gpt_neox.final_layer_norm.weight"] = flat["encoder/final_norm/scale"]
    out["gpt_neox.final_layer_norm.bias"] = flat["encoder/final_norm/bias"]
    out["embed_out.weight"] = embed if config.tie_embeddings else flat["encoder/lm_head/kernel"].T
    return {k: np.ascontiguousarray(v) for k, v in out.items()}
  if model_type == "gpt2":
    out["transformer.wte.weight"] = flat["encoder/word_embeddings/embedding"]
    out["transformer.wpe.weight"] = flat["encoder/position/table/embedding"]
    for i in range(config.num_layers):
      hf, px = f"transformer.h.{i}", f"encoder/layer_{i}"
      for target, name in GPT2_LAYER.items():
        if target.endswith("norm"):
          out[f"{hf}.{name}.weight"] = flat[f"{px}/{target}/scale"]
          out[f"{hf}.{name}.bias"] = flat[f"{px}/{target}/bias"]
        else:
          out[f"{hf}.{name}.weight"] = flat[f"{px}/{target}/kernel"].reshape(-1, d if target == "attention/out" else
                                                                             flat[f"{px}/{target}/kernel"].shape[-1])
          out[f"{hf}.{name}.bias"] = flat[f"{px}/{target}/bias"]
      parts = ("query", "key", "value")
      out[f"{hf}.attn.c_attn.weight"] = np.concatenate([flat[f"{px}/attention/{p}/kernel"].reshape(d, d)
                                                        for p in parts], 1)
      out[f"{hf}.attn.c_attn.bias"] = np.concatenate([flat[f"{px}/attention/{p}/bias"].reshape(d) for p in parts])
    out["transformer.ln_f.weight"] = flat["encoder/final_norm/scale"]
    out["transformer.ln_f.bias"] = flat["encoder/final_norm/bias"]
    embed = out["transformer.wte.weight"]
  else:
    out["model.embed_tokens.weight"] = embed = flat["encoder/word_embeddings/embedding"]
    for i in range(config.num_layers):
      hf, px = f"model.layers.{i}", f"encoder/layer_{i}"
      for target, name in LAYER_NAMES.get(config.norm, LLAMA_LAYER).items():
        if f"{px}/{target}/scale" in flat:
          out[f"{hf}.{name}.weight"] = flat[f"{px}/{target}/scale"].reshape(-1)
        elif f"{px}/{target}/kernel" in flat:
          kernel = flat[f"{px}/{target}/kernel"]
          if kernel.ndim == 3:  # [D, H, K] -> [H·K, D]; out: [H, K, D] -> [D, H·K]
            kernel = kernel.reshape(-1, d) if target == "attention/out" else kernel.reshape(d, -1)
          out[f"{hf}.{name}.weight"] = kernel.T
          if f"{px}/{target}/bias" in flat:
            out[f"{hf}.{name}.bias"] = flat[f"{px}/{target}/bias"].reshape(-1)
    out["model.norm.weight"] = flat["encoder/final_norm/scale"]
  out["lm_head.weight"] = embed if config.tie_embeddings else flat["encoder/lm_head/kernel"].T
  if model_type == "phi3":
    out = _fuse(out)
  return {k: np.ascontiguousarray(v) for k, v in out.items()}


def to_hf_decoder(config: TransformerConfig, variables: Mapping, model_type: str | None = None, vision_from=None):
  """The Hugging Face causal LM (``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``,
  ``Qwen3ForCausalLM`` or ``GPT2LMHeadModel``; :func:`model_type_of` unless named) equal to a posjax decoder, in
  float32, its weights loaded strictly. An M-RoPE decoder goes out as the text decoder of ``vision_from`` (the
  vision-language model it came from: a directory or an in-memory model), whose vision tower it keeps
  (:func:`to_hf_vision_language`)."""
  import torch  # imported here: the convert extra
  import transformers

  if config.position == "mrope" or model_type in VL_TYPES:
    return to_hf_vision_language(config, variables, vision_from)
  if vision_from is not None:
    raise ValueError(f"vision_from is for an M-RoPE decoder's vision-language checkpoint; this one has "
                     f"position={config.position!r}")
  model_type = model_type or model_type_of(config)
  fields = config_to_hf(config, model_type)
  config_class, model_class = (getattr(transformers, name) for name in HF_CLASSES[model_type])
  # Hugging Face's SDPA attention drops Gemma 2's logit soft cap; its eager attention computes it
  eager = {"attn_implementation": "eager"} if fields.get("attn_logit_softcapping") else {}
  model = model_class(config_class(**{k: v for k, v in fields.items() if k != "model_type"}, **eager))
  state = {k: torch.from_numpy(np.array(v))
           for k, v in state_to_hf(config, model_params(variables), model_type).items()}
  return _loaded(model, state, config)


def _loaded(model, state: Mapping, config: TransformerConfig, kept: tuple[str, ...] = ()):
  """``model`` (in eval mode) with ``state`` loaded: a weight it lacks, or one of its own left unloaded other than
  Hugging Face's buffers (:data:`DROPPED_SUFFIXES`) and those under the prefixes ``kept``, is an error; its LM head
  tied where ``config`` ties it."""
  missing, unexpected = model.load_state_dict(state, strict=False)
  missing = [k for k in missing if not k.endswith(DROPPED_SUFFIXES) and not k.startswith(kept)]
  if missing or unexpected:
    raise ValueError(f"posjax -> {type(model).__name__}: missing {missing}, unexpected {unexpected}")
  if config.tie_embeddings:
    model.tie_weights()
  return model.eval()


def to_hf_vision_language(config: TransformerConfig, variables: Mapping, vision_from):
  """``vision_from`` (a Hugging Face vision-language model of :data:`VL_TYPES`, a directory or in memory) with its
  text decoder's weights replaced by a posjax M-RoPE decoder's, in float32; its vision tower stays as it was. The
  decoder must be ``vision_from``'s (the same config as its text decoder's, which a model converted from it and
  trained keeps); every text weight is replaced, none left over."""
  import copy
  import os

  import torch  # imported here: the convert extra
  import transformers

  if vision_from is None:
    raise ValueError(f"an M-RoPE decoder goes out as the text decoder of a vision-language checkpoint of "
                     f"{list(VL_TYPES)}, whose vision tower posjax does not have: give vision_from= the checkpoint "
                     "it came from")
  if isinstance(vision_from, (str, os.PathLike)):
    model = transformers.AutoModelForImageTextToText.from_pretrained(os.fspath(vision_from), torch_dtype=torch.float32)
  else:
    model = copy.deepcopy(vision_from).float()  # the caller's model stays as it was
  model_type = model.config.model_type
  if model_type not in VL_TYPES:
    raise ValueError(f"vision_from is a {model_type!r} model; an M-RoPE decoder goes into one of {list(VL_TYPES)}")
  theirs = _compared(config_from_hf(model.config.to_dict()))
  mine = _compared(config)
  differ = [f"{name} (here {mine[name]!r}, there {theirs[name]!r})" for name in mine if mine[name] != theirs[name]]
  if differ:
    raise ValueError(f"this decoder is not vision_from's {model_type} text decoder: " + ", ".join(differ))
  family = VL_TYPES[model_type][0]
  text = state_to_hf(config, model_params(variables), family)
  state = {(VL_TEXT_PREFIX + k.removeprefix("model.")) if k.startswith("model.") else k: torch.from_numpy(np.array(v))
           for k, v in text.items()}
  return _loaded(model, state, config, kept=VISION_PREFIXES)
