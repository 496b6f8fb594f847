"""Hugging Face ModernBERT (Warner et al. 2024) <-> posjax, exactly: an encoder of posjax's one stack with Pre-LN
LayerNorms without biases, the first layer's attention reading the normed embeddings directly
(``first_attention_norm=False``), GeGLU MLPs, no biases, and global and local layers in turn: every
``global_attn_every_n_layers``-th layer (the first included) attends to the whole sequence with RoPE at
``global_rope_theta``, the others to the keys at most ``local_attention / 2`` tokens away on either side (posjax's
two-sided ``sliding_window = local_attention / 2 + 1``) with RoPE at ``local_rope_theta`` (``position_schedule``
entry :data:`LOCAL_ROPE`).

``ModernBertForMaskedLM`` comes across with the ``mlm`` head (its ``head``: a dense layer, the activation and a norm,
then the decoder tied to the embeddings with its bias), ``ModernBertModel`` with none. The classification and
token-classification heads (pooling, their own head) are not converted: a one-line error names them. The fused
``Wqkv`` is ``[q, k, v]`` of ``[H, K]`` rows each; the fused ``Wi`` is ``[input, gate]`` (``act(input) * gate``:
posjax's ``mlp_gate`` and ``mlp_in``).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from posjax.convert.hf_bert import StateReader, check_shapes, model_params, read_source
from posjax.models import TransformerConfig, Transformer

LOCAL_ROPE = "rope@local"
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "silu": "silu",
               "relu": "relu"}
# posjax path under encoder/layer_{i} -> ModernBERT's name under model.layers.{i}
LAYER = {"attention_norm": "attn_norm", "attention/out": "attn.Wo", "mlp_norm": "mlp_norm", "mlp_out": "mlp.Wo"}
DROPPED_SUFFIXES = ("rotary_emb.inv_freq",)
SPECIAL_TOKENS = ("pad", "bos", "eos", "cls", "sep")  # ModernBertConfig's ``*_token_id`` fields


def config_from_hf(hf: Mapping[str, Any]) -> TransformerConfig:
  """ModernBERT's ``config.json`` (a dict) as posjax's :class:`TransformerConfig`; what posjax cannot represent is an
  error
  naming the field."""
  if hf.get("model_type") != "modernbert":
    raise ValueError(f"config.json has model_type={hf.get('model_type')!r}; this converter reads 'modernbert'")
  act = hf.get("hidden_activation", "gelu")
  if act not in ACTIVATIONS:
    raise ValueError(f"config.json has hidden_activation={act!r}; posjax reads {sorted(ACTIVATIONS)}")
  if hf.get("classifier_activation", act) != act:
    raise ValueError(f"config.json has classifier_activation={hf['classifier_activation']!r} and hidden_activation="
                     f"{act!r}; posjax's MLM head takes the layers' activation")
  biases = {field: bool(hf.get(field, False)) for field in ("attention_bias", "mlp_bias")}
  if len(set(biases.values())) > 1:
    raise ValueError(f"config.json has {biases}; posjax represents both False (ModernBERT's) or both True")
  if hf.get("norm_bias", False) or not hf.get("decoder_bias", True):
    raise ValueError(f"config.json has norm_bias={hf.get('norm_bias')!r}, decoder_bias={hf.get('decoder_bias')!r}; "
                     "posjax represents ModernBERT's norm_bias=False, decoder_bias=True")
  layers, every = int(hf["num_hidden_layers"]), int(hf.get("global_attn_every_n_layers", 3))
  local = [i % every != 0 for i in range(layers)]
  window = int(hf.get("local_attention", 128)) // 2 + 1
  global_theta = float(hf.get("global_rope_theta", 160_000.0))
  # absent: ModernBertConfig's 10,000; null: the global base (as its attention reads it)
  local_theta = float(hf.get("local_rope_theta", 10_000.0) or global_theta)
  dropout = {float(hf.get(f, 0.0)) for f in ("embedding_dropout", "mlp_dropout")}
  if len(dropout) > 1:
    raise ValueError(f"config.json has embedding_dropout={hf.get('embedding_dropout')} and mlp_dropout="
                     f"{hf.get('mlp_dropout')}; posjax has one dropout_rate")
  schedule = {}
  if any(local):
    schedule = dict(position_schedule=",".join(LOCAL_ROPE if x else "rope" for x in local),
                    schedule_options={LOCAL_ROPE: {"max_timescale": local_theta}},
                    layer_windows=",".join(str(window if x else 0) for x in local))
  return TransformerConfig(
      vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]), num_layers=layers,
      num_heads=int(hf["num_attention_heads"]), intermediate_size=int(hf["intermediate_size"]),
      max_len=int(hf.get("max_position_embeddings", 8192)), type_vocab_size=0, position="rope",
      position_options={"max_timescale": global_theta}, norm="pre", norm_type="layernorm_nobias",
      first_attention_norm=False, mlp="gated", activation=ACTIVATIONS[act],
      use_bias="all" if biases["attention_bias"] else "none", head_bias=bool(hf.get("classifier_bias", False)),
      layer_norm_eps=float(hf.get("norm_eps", 1e-5)),
      dropout_rate=dropout.pop(), attention_dropout_rate=float(hf.get("attention_dropout", 0.0)), **schedule)


def is_modernbert(config: TransformerConfig) -> bool:
  """Whether ``config`` is ModernBERT's layout (an encoder whose first layer's attention has no norm)."""
  return not config.causal and not config.first_attention_norm


def config_to_hf(config: TransformerConfig) -> dict:
  """posjax's config as ModernBERT's ``config.json`` fields; what ModernBERT cannot express is an error naming the
  field (checked by reading the fields back: :func:`config_from_hf` must give ``config`` again)."""
  local = [w != 0 for w in config.windows]
  windows = {w for w in config.windows if w}
  specs = [config.method_specs[n] for n in config.layer_positions]
  every = next((i for i in range(1, config.num_layers) if not local[i]), config.num_layers)
  fields = {"model_type": "modernbert", "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
            "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
            "intermediate_size": config.intermediate_size, "max_position_embeddings": config.max_len,
            "hidden_activation": {"gelu_tanh": "gelu_pytorch_tanh"}.get(config.activation, config.activation),
            "norm_eps": config.layer_norm_eps, "norm_bias": False, "decoder_bias": True,
            "attention_bias": config.use_bias == "all", "mlp_bias": config.use_bias == "all",
            "classifier_bias": config.head_bias, "global_attn_every_n_layers": every,
            "local_attention": 2 * (windows.pop() - 1) if len(windows) == 1 else 128,
            "global_rope_theta": config.position_spec.options.max_timescale,
            "local_rope_theta": next((s.options.max_timescale for s, x in zip(specs, local) if x), 10_000.0),
            "embedding_dropout": config.dropout_rate, "mlp_dropout": config.dropout_rate,
            "attention_dropout": config.attention_dropout_rate}
  fields["classifier_activation"] = fields["hidden_activation"]
  # the tokens' ids are the tokenizer's (ModernBertConfig's defaults are its own vocabulary's): the export names them
  fields.update({f"{name}_token_id": None for name in SPECIAL_TOKENS})
  back = config_from_hf(fields)  # ids aside
  mine = lambda c: (c.to_dict() | {"position_schedule": tuple(
      (c.method_specs[n].method.name, c.method_specs[n].options) for n in c.layer_positions), "schedule_options": None,
      "windows": c.windows, "layer_windows": None, "attention_kernel": None, "kernel_platform": None, "dtype": None,
      "param_dtype": None, "remat": None})
  differ = sorted(k for k, v in mine(config).items() if mine(back)[k] != v)
  if differ:
    raise ValueError("Hugging Face ModernBERT cannot express this model: " + ", ".join(
        f"{k}={mine(config)[k]!r} (it would be {mine(back)[k]!r})" for k in differ))
  return fields


def params_from_hf(config: TransformerConfig, state: Mapping[str, np.ndarray]) -> tuple[dict, str]:
  """``(flat posjax parameters, head)`` from ModernBERT's state dict (``ModernBertForMaskedLM``'s or
  ``ModernBertModel``'s); a weight left over is an error naming it."""
  prefix = "model." if any(k.startswith("model.") for k in state) else ""
  head = "mlm" if "head.dense.weight" in state else "none"
  if any(k.startswith(("classifier.", "head.")) for k in state) and "decoder.bias" not in state:
    raise ValueError("a ModernBERT classification head is not converted (posjax reads ModernBertForMaskedLM and "
                     "ModernBertModel)")
  reader = StateReader(state, "Hugging Face ModernBERT")
  take, out, d, bias = reader.take, reader.out, config.hidden_size, config.use_bias == "all"
  heads, head_dim = config.num_heads, config.position_spec.head_dim
  out["encoder/word_embeddings/embedding"] = take(f"{prefix}embeddings.tok_embeddings.weight")
  out["encoder/embedding_norm/scale"] = take(f"{prefix}embeddings.norm.weight")
  for i in range(config.num_layers):
    hf, px = f"{prefix}layers.{i}", f"encoder/layer_{i}"
    for target, name in LAYER.items():
      if target.endswith("norm"):
        if i or target != "attention_norm":
          out[f"{px}/{target}/scale"] = take(f"{hf}.{name}.weight")
        continue
      kernel = take(f"{hf}.{name}.weight").T
      out[f"{px}/{target}/kernel"] = kernel.reshape(heads, head_dim, d) if target == "attention/out" else kernel
      if bias:
        out[f"{px}/{target}/bias"] = take(f"{hf}.{name}.bias")
    qkv = np.split(take(f"{hf}.attn.Wqkv.weight"), 3)  # [3·H·K, D] -> 3 x [D, H, K]
    for part, kernel in zip(("query", "key", "value"), qkv):
      out[f"{px}/attention/{part}/kernel"] = kernel.T.reshape(d, heads, head_dim)
    gate, value = np.split(take(f"{hf}.mlp.Wi.weight"), 2)  # [2I, D]: act(first half) * second half
    out[f"{px}/mlp_gate/kernel"], out[f"{px}/mlp_in/kernel"] = gate.T, value.T
    if bias:
      for part, b in zip(("query", "key", "value"), np.split(take(f"{hf}.attn.Wqkv.bias"), 3)):
        out[f"{px}/attention/{part}/bias"] = b.reshape(heads, head_dim)
      gate_b, value_b = np.split(take(f"{hf}.mlp.Wi.bias"), 2)
      out[f"{px}/mlp_gate/bias"], out[f"{px}/mlp_in/bias"] = gate_b, value_b
  out["encoder/final_norm/scale"] = take(f"{prefix}final_norm.weight")
  if head == "mlm":
    out["transform/kernel"] = take("head.dense.weight").T
    if config.head_bias:
      out["transform/bias"] = take("head.dense.bias")
    out["transform_norm/scale"] = take("head.norm.weight")
    out["output_bias"] = take("decoder.bias")
    decoder = state.get("decoder.weight")
    if decoder is not None:
      reader.used.add("decoder.weight")
      if not np.array_equal(decoder, state[f"{prefix}embeddings.tok_embeddings.weight"]):
        raise ValueError("ModernBERT's decoder is not tied to the embeddings; posjax's MLM head is")
  left = [k for k in reader.dropped() if not k.endswith(DROPPED_SUFFIXES)]
  if left:
    raise ValueError(f"weights posjax has no place for: {left}")
  return out, head


def from_hf_modernbert(source) -> tuple[Transformer, dict]:
  """``(module, variables)`` equal to a Hugging Face ModernBERT: an in-memory model or a directory."""
  hf_config, state, where = read_source(source)
  config = config_from_hf(hf_config)
  flat, head = params_from_hf(config, state)
  module = Transformer(config, head=head)
  return module, {"params": check_shapes(module, flat, where)}


def state_to_hf(config: TransformerConfig, params: Mapping) -> dict[str, np.ndarray]:
  """``ModernBertForMaskedLM``'s state dict (``ModernBertModel``'s, under ``model.``, without an MLM head) from
  posjax parameters (:func:`model_params`' layout)."""
  import flax.traverse_util

  flat = {k: np.asarray(v, np.float32) for k, v in flax.traverse_util.flatten_dict(dict(params), sep="/").items()}
  d, out = config.hidden_size, {}
  out["model.embeddings.tok_embeddings.weight"] = flat["encoder/word_embeddings/embedding"]
  out["model.embeddings.norm.weight"] = flat["encoder/embedding_norm/scale"]
  for i in range(config.num_layers):
    hf, px = f"model.layers.{i}", f"encoder/layer_{i}"
    for target, name in LAYER.items():
      if f"{px}/{target}/scale" in flat:
        out[f"{hf}.{name}.weight"] = flat[f"{px}/{target}/scale"]
      elif f"{px}/{target}/kernel" in flat:
        out[f"{hf}.{name}.weight"] = flat[f"{px}/{target}/kernel"].reshape(-1, d).T if target == "attention/out" \
            else flat[f"{px}/{target}/kernel"].T
        if f"{px}/{target}/bias" in flat:
          out[f"{hf}.{name}.bias"] = flat[f"{px}/{target}/bias"]
    parts = ("query", "key", "value")
    out[f"{hf}.attn.Wqkv.weight"] = np.concatenate([flat[f"{px}/attention/{p}/kernel"].reshape(d, -1).T
                                                    for p in parts])
    out[f"{hf}.mlp.Wi.weight"] = np.concatenate([flat[f"{px}/mlp_gate/kernel"].T, flat[f"{px}/mlp_in/kernel"].T])
    if f"{px}/mlp_in/bias" in flat:
      out[f"{hf}.attn.Wqkv.bias"] = np.concatenate([flat[f"{px}/attention/{p}/bias"].reshape(-1) for p in parts])
      out[f"{hf}.mlp.Wi.bias"] = np.concatenate([flat[f"{px}/mlp_gate/bias"], flat[f"{px}/mlp_in/bias"]])
  out["model.final_norm.weight"] = flat["encoder/final_norm/scale"]
  if "output_bias" in flat:
    out["head.dense.weight"] = flat["transform/kernel"].T
    if "transform/bias" in flat:
      out["head.dense.bias"] = flat["transform/bias"]
    out["head.norm.weight"] = flat["transform_norm/scale"]
    out["decoder.weight"] = out["model.embeddings.tok_embeddings.weight"]
    out["decoder.bias"] = flat["output_bias"]
  return {k: np.ascontiguousarray(v) for k, v in out.items()}


def to_hf_modernbert(config: TransformerConfig, variables: Mapping):
  """``ModernBertForMaskedLM`` (or ``ModernBertModel`` for parameters without an MLM head) equal to a posjax model,
  in float32, with eager attention, its weights loaded strictly."""
  import torch  # imported here: the convert extra
  import transformers

  params = model_params(variables)
  heads = sorted(set(params) & {"pooler", "classifier", "span", "rtd"})
  if heads:
    raise ValueError(f"the ModernBERT export writes ModernBertForMaskedLM or ModernBertModel; these parameters have a "
                     f"task head ({', '.join(heads)}): export the pre-training run they started from")
  fields = config_to_hf(config)
  hf_config = transformers.ModernBertConfig(**{k: v for k, v in fields.items() if k != "model_type"},
                                            attn_implementation="eager", reference_compile=False)
  state = state_to_hf(config, params)
  if "output_bias" in params:
    model = transformers.ModernBertForMaskedLM(hf_config)
  else:
    model = transformers.ModernBertModel(hf_config)
    state = {k.removeprefix("model."): v for k, v in state.items()}
  missing, unexpected = model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in state.items()},
                                              strict=False)
  missing = [k for k in missing if not k.endswith(DROPPED_SUFFIXES)]
  if missing or unexpected:
    raise ValueError(f"posjax -> {type(model).__name__}: missing {missing}, unexpected {unexpected}")
  return model.eval()
