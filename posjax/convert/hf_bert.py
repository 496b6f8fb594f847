"""Hugging Face BERT (``transformers`` < 5) <-> posjax, exactly: absolute, ``relative_key`` and
``relative_key_query`` position embeddings.

``position_embedding_type`` maps to a posjax method: ``absolute`` -> ``absolute``, ``relative_key`` ->
``shaw`` (Shaw et al. 2018, key term), ``relative_key_query`` -> ``huang_m4`` (Huang et al. 2020, Method 4).
Hugging Face's relative table has ``2 M - 1`` rows for ``M = max_position_embeddings`` and is indexed by
query minus key (``i - j + M - 1``); posjax's by key minus query (``j - i + k`` with ``k = M - 1``): the same
table, rows reversed. Hugging Face does not clip distances (inputs longer than ``M`` fail there); posjax clips
at ``k``, so the two agree on every input Hugging Face accepts.

Heads come across when the source has them: ``BertForMaskedLM`` / ``BertForPreTraining`` -> ``mlm`` (the NSP
classifier is dropped), ``BertForSequenceClassification`` -> ``classification``, ``BertForQuestionAnswering``
-> ``span``, ``BertModel`` -> ``pooler``. Reading a directory with ``model.safetensors`` needs neither
PyTorch nor ``transformers``; ``pytorch_model.bin`` needs PyTorch.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

import flax.core
import flax.linen as nn
import flax.traverse_util
import jax
import jax.numpy as jnp
import numpy as np

from posjax.models import TransformerConfig, Transformer, layout

POSITIONS = {"absolute": "absolute", "relative_key": "shaw", "relative_key_query": "huang_m4"}
TO_HF_POSITIONS = {"absolute": "absolute", "shaw": "relative_key", "huang_m4": "relative_key_query"}
ACTIVATIONS = {"gelu": "gelu", "gelu_python": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
               "gelu_fast": "gelu_tanh", "relu": "relu"}
TO_HF_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}
# posjax fields that Hugging Face BERT (and ELECTRA) have at posjax's defaults only: the export refuses others (no
# weight would show that a window, a schedule or a temperature was lost)
BERT_FIXED = ("norm_type", "mlp", "use_bias", "qk_norm", "embedding_norm", "tie_embeddings", "parallel_residual",
              "sliding_window", "layer_windows", "layer_chunks", "position_schedule", "schedule_options", "query_temperature",
              "temperature_layers", "first_attention_norm", "embedding_scale", "query_scale", "attention_softcap",
              "final_logit_softcap", "head_bias", "attention_sinks")
# Hugging Face config fields posjax has no counterpart for, with the values it can represent.
UNSUPPORTED = {"add_cross_attention": False}
# Weights posjax has no place for and drops (with a log line): buffers, the NSP head, and the absolute table of
# a relative model (Hugging Face keeps one it never reads).
DROPPED = ("embeddings.position_ids", "embeddings.token_type_ids", "cls.seq_relationship.weight",
           "cls.seq_relationship.bias", "cls.predictions.decoder.weight", "cls.predictions.decoder.bias")


def config_from_hf(hf: Mapping[str, Any]) -> TransformerConfig:
  """A Hugging Face ``BertConfig`` (as a dict) as posjax's; anything posjax cannot represent is an error."""
  if hf.get("model_type", "bert") != "bert":
    raise ValueError(f"config.json has model_type={hf.get('model_type')!r}; the converter reads BERT ('bert') only")
  for field, supported in UNSUPPORTED.items():
    if hf.get(field, supported) != supported:
      raise ValueError(f"config.json has {field}={hf[field]!r}; posjax represents only {field}={supported!r}")
  kind = hf.get("position_embedding_type", "absolute")
  if kind not in POSITIONS:
    raise ValueError(f"config.json has position_embedding_type={kind!r}; posjax reads {sorted(POSITIONS)}")
  act = hf.get("hidden_act", "gelu")
  if act not in ACTIVATIONS:
    raise ValueError(f"config.json has hidden_act={act!r}; posjax reads {sorted(ACTIVATIONS)}")
  max_len = int(hf.get("max_position_embeddings", 512))
  position = POSITIONS[kind]
  return TransformerConfig(
      vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]), num_layers=int(hf["num_hidden_layers"]),
      num_heads=int(hf["num_attention_heads"]), intermediate_size=int(hf["intermediate_size"]), max_len=max_len,
      type_vocab_size=int(hf.get("type_vocab_size", 2)), position=position,
      position_options={},  # relative: posjax's default clip distance, max_len - 1, is Hugging Face's
      dropout_rate=float(hf.get("hidden_dropout_prob", 0.1)),
      attention_dropout_rate=float(hf.get("attention_probs_dropout_prob", 0.1)),
      layer_norm_eps=float(hf.get("layer_norm_eps", 1e-12)), activation=ACTIVATIONS[act],
      causal=bool(hf.get("is_decoder", False)))


def config_to_hf(config: TransformerConfig) -> dict:
  """posjax's TransformerConfig as Hugging Face ``BertConfig`` fields; methods or options it cannot express are
  errors."""
  if config.position not in TO_HF_POSITIONS:
    raise ValueError(f"Hugging Face BERT cannot express position {config.position!r}; it has "
                     f"{sorted(TO_HF_POSITIONS)} ({', '.join(f'{k} = {v}' for k, v in TO_HF_POSITIONS.items())})")
  options = config.position_spec.options
  if config.position != "absolute":
    k = config.max_len - 1 if options.max_distance is None else options.max_distance
    if k != config.max_len - 1:
      raise ValueError(f"Hugging Face's relative table clips at max_position_embeddings - 1 = {config.max_len - 1}; "
                       f"this model's max_distance is {k}")
    if options.share_across_layers:
      raise ValueError("Hugging Face has one relative table per layer; this model shares one (share_across_layers)")
    if getattr(options, "value_term", False):
      raise ValueError("Hugging Face's relative_key has no value term; this shaw model has value_term=True")
  if config.norm != "post":
    raise ValueError(f"Hugging Face BERT is Post-LN; this model has norm={config.norm!r}")
  bert = TransformerConfig(num_heads=config.num_heads, hidden_size=config.hidden_size)
  differ = [f"{f}={getattr(config, f)!r}" for f in BERT_FIXED if getattr(config, f) != getattr(bert, f)]
  if config.position_spec.kv_heads != config.num_heads or config.position_spec.head_dim * config.num_heads != (
      config.hidden_size):
    differ.append(f"num_kv_heads={config.num_kv_heads}, head_dim={config.head_dim}")
  if differ:
    raise ValueError(f"Hugging Face BERT cannot express {', '.join(differ)} (it has BERT's: "
                     + ", ".join(f"{f}={getattr(bert, f)!r}" for f in BERT_FIXED if f"{f}=" in " ".join(differ))
                     + ")")
  return {
      "model_type": "bert", "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
      "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
      "intermediate_size": config.intermediate_size, "max_position_embeddings": config.max_len,
      # Hugging Face always has token-type embeddings: a model without gets one row of zeros (adds nothing).
      "type_vocab_size": max(config.type_vocab_size, 1), "position_embedding_type": TO_HF_POSITIONS[config.position],
      "hidden_act": TO_HF_ACTIVATIONS[config.activation], "hidden_dropout_prob": config.dropout_rate,
      "attention_probs_dropout_prob": config.attention_dropout_rate, "layer_norm_eps": config.layer_norm_eps,
      "is_decoder": config.causal}


def _strip(state: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Keys without the task models' ``bert.`` prefix."""
  return {k.removeprefix("bert."): np.asarray(v) for k, v in state.items()}


def detect_head(state: Mapping[str, np.ndarray]) -> tuple[str, int]:
  """``(head, num_labels)`` from the weights present."""
  if "cls.predictions.transform.dense.weight" in state:
    return "mlm", 2
  if "qa_outputs.weight" in state:
    return "span", 2
  if "classifier.weight" in state:
    return "classification", int(state["classifier.weight"].shape[0])
  if "pooler.dense.weight" in state:
    return "pooler", 2
  return "none", 2


class StateReader:
  """Weights taken out of a Hugging Face state dict by name into flat posjax paths (``out``), with the names
  used remembered; a missing weight is an error naming it and what was expected."""

  def __init__(self, state: Mapping[str, np.ndarray], what: str):
    self.state, self.what, self.used, self.out = state, what, set(), {}

  def take(self, key: str) -> np.ndarray:
    if key not in self.state:
      raise ValueError(f"the checkpoint has no weight {key!r} (expected for this {self.what})")
    self.used.add(key)
    return self.state[key]

  def norm(self, target: str, name: str) -> None:
    self.out[f"{target}/scale"], self.out[f"{target}/bias"] = self.take(f"{name}.weight"), self.take(f"{name}.bias")

  def dense(self, target: str, name: str, shape=None) -> None:
    kernel, bias = self.take(f"{name}.weight").T, self.take(f"{name}.bias")
    self.out[f"{target}/kernel"] = kernel if shape is None else kernel.reshape(shape)
    self.out[f"{target}/bias"] = bias if shape is None else bias.reshape(shape[1:])

  def dropped(self) -> list[str]:
    return sorted(set(self.state) - self.used)


def params_from_hf(config: TransformerConfig, state: Mapping[str, np.ndarray], head: str,
                   reader: StateReader | None = None) -> tuple[dict, list[str]]:
  """posjax parameters (flat, ``/``-joined paths) from a Hugging Face state dict, and the keys dropped
  (``reader``: one to add to, e.g. ELECTRA's, which reads more)."""
  heads, head_dim = config.num_heads, config.hidden_size // config.num_heads
  reader = reader or StateReader(state, f"{config.position} BERT")
  take, norm, dense, out = reader.take, reader.norm, reader.dense, reader.out

  out["encoder/word_embeddings/embedding"] = take("embeddings.word_embeddings.weight")
  if config.type_vocab_size:
    out["encoder/token_type_embeddings/embedding"] = take("embeddings.token_type_embeddings.weight")
  if config.position == "absolute":
    out["encoder/position/table/embedding"] = take("embeddings.position_embeddings.weight")
  norm("encoder/embedding_norm", "embeddings.LayerNorm")
  d = config.hidden_size
  for i in range(config.num_layers):
    hf, px = f"encoder.layer.{i}", f"encoder/layer_{i}"
    for part in ("query", "key", "value"):
      dense(f"{px}/attention/{part}", f"{hf}.attention.self.{part}", (d, heads, head_dim))
    kernel, bias = take(f"{hf}.attention.output.dense.weight").T, take(f"{hf}.attention.output.dense.bias")
    out[f"{px}/attention/out/kernel"], out[f"{px}/attention/out/bias"] = kernel.reshape(heads, head_dim, d), bias
    norm(f"{px}/attention_norm", f"{hf}.attention.output.LayerNorm")
    dense(f"{px}/mlp_in", f"{hf}.intermediate.dense")
    dense(f"{px}/mlp_out", f"{hf}.output.dense")
    norm(f"{px}/mlp_norm", f"{hf}.output.LayerNorm")
    if config.position != "absolute":
      out[f"{px}/attention/position/key"] = take(f"{hf}.attention.self.distance_embedding.weight")[::-1]
  if head == "mlm":
    dense("transform", "cls.predictions.transform.dense")
    norm("transform_norm", "cls.predictions.transform.LayerNorm")
    out["output_bias"] = take("cls.predictions.bias")
    decoder = state.get("cls.predictions.decoder.weight")
    if decoder is not None and not np.array_equal(decoder, state["embeddings.word_embeddings.weight"]):
      raise ValueError("the MLM decoder is not tied to the word embeddings; posjax's MLM head is (as BERT's)")
  if head in ("pooler", "classification"):
    dense("pooler", "pooler.dense")
  if head == "classification":
    dense("classifier", "classifier")
  if head == "span":
    dense("span", "qa_outputs")
  return out, reader.dropped()


def check_shapes(module: nn.Module, flat: dict[str, np.ndarray], source: str, example=None) -> dict:
  """``flat`` (``/``-joined parameter paths) as ``module``'s parameter tree (``example``: an input it is initialised
  on, token ids ``[1, 2]`` unless given); a missing, extra or misshaped parameter is an error naming it and
  ``source`` (every converter's last check)."""
  example = jnp.ones((1, 2), jnp.int32) if example is None else example
  expected = flax.traverse_util.flatten_dict(jax.eval_shape(module.init, jax.random.PRNGKey(0), example)["params"],
                                             sep="/")
  expected = {k: getattr(v, "value", v) for k, v in expected.items()}
  missing, extra = sorted(set(expected) - set(flat)), sorted(set(flat) - set(expected))
  if missing or extra:
    raise ValueError(f"{source}: the converted parameters do not match the posjax model (missing {missing}, "
                     f"unexpected {extra})")
  for path, value in flat.items():
    if tuple(value.shape) != tuple(expected[path].shape):
      raise ValueError(f"{source}: {path} has shape {tuple(value.shape)} but its config implies "
                       f"{tuple(expected[path].shape)}")
  return flax.traverse_util.unflatten_dict(
      {k: jnp.asarray(v, expected[k].dtype) for k, v in flat.items()}, sep="/")


def read_config(path: str) -> dict:
  """A Hugging Face ``config.json`` as a dict; a file that is not a JSON object is a ``ValueError`` naming it."""
  try:
    with open(path, encoding="utf-8") as f:
      hf_config = json.load(f)
  except ValueError as error:  # json.JSONDecodeError, UnicodeDecodeError
    raise ValueError(f"{path} is not valid JSON ({error}); a Hugging Face config.json is the JSON object of the "
                     "model's fields that save_pretrained writes") from None
  if not isinstance(hf_config, dict):
    raise ValueError(f"{path} holds a JSON {type(hf_config).__name__}; a Hugging Face config.json is the JSON object "
                     "of the model's fields that save_pretrained writes")
  return hf_config


def read_directory(directory: str) -> tuple[dict, dict[str, np.ndarray]]:
  """``(config.json as a dict, state dict as numpy)`` of a Hugging Face model directory; a weights file that
  cannot be read (a truncated download) is a ``ValueError`` naming it."""
  path = os.path.join(directory, "config.json")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{directory} has no config.json (a Hugging Face model directory has config.json "
                            "and model.safetensors or pytorch_model.bin)")
  hf_config = read_config(path)
  safetensors_path = os.path.join(directory, "model.safetensors")
  torch_path = os.path.join(directory, "pytorch_model.bin")
  unreadable = ("{} cannot be read as weights ({}); the converters read the whole file save_pretrained writes (a "
                "truncated copy or an interrupted download: copy or download it again)")
  if os.path.isfile(safetensors_path):
    from safetensors import SafetensorError  # imported here: an optional dependency (the convert extra)
    from safetensors.numpy import load_file

    try:
      return hf_config, load_file(safetensors_path)
    except SafetensorError as error:
      raise ValueError(unreadable.format(safetensors_path, error)) from None
  if os.path.isfile(torch_path):
    import pickle

    import torch  # imported here: only .bin files need it

    try:
      state = torch.load(torch_path, map_location="cpu", weights_only=True)
    except (RuntimeError, OSError, EOFError, pickle.UnpicklingError) as error:
      raise ValueError(unreadable.format(torch_path, " ".join(str(error).split()))) from None
    return hf_config, {k: v.float().numpy() if v.is_floating_point() else v.numpy() for k, v in state.items()}
  raise FileNotFoundError(f"{directory} has no weights: expected model.safetensors or pytorch_model.bin; it has "
                          f"{sorted(os.listdir(directory))}")


def read_source(source) -> tuple[dict, dict[str, np.ndarray], str]:
  """``(config.json as a dict, state dict as numpy, what to call it in errors)`` of an in-memory
  ``transformers`` model or a model directory."""
  if isinstance(source, (str, os.PathLike)):
    return (*read_directory(os.fspath(source)), os.fspath(source))
  state = {k: v.detach().cpu().float().numpy() if v.is_floating_point() else v.detach().cpu().numpy()
           for k, v in source.state_dict().items()}
  return source.config.to_dict(), state, type(source).__name__


def from_hf_bert(source) -> tuple[Transformer, dict]:
  """``(module, variables)`` equal to a Hugging Face BERT: an in-memory ``transformers`` model or a directory.

  ``module.apply(variables, input_ids, token_type_ids=..., attention_mask=...)`` returns a
  :class:`posjax.models.TransformerOutput` (``last_hidden_state``, and the head's logits)."""
  hf_config, state, where = read_source(source)
  state = _strip(state)
  config = config_from_hf(hf_config)
  types = state.get("embeddings.token_type_embeddings.weight")
  if config.type_vocab_size == 1 and types is not None and not types.any():  # posjax's "no token types", written out
    config = dataclasses.replace(config, type_vocab_size=0)
    state.pop("embeddings.token_type_embeddings.weight")
  head, num_labels = detect_head(state)
  flat, dropped = params_from_hf(config, state, head)
  unexpected = [k for k in dropped if k not in DROPPED and not k.startswith("pooler.")
                and k != "embeddings.position_embeddings.weight"]
  if unexpected:
    raise ValueError(f"{where}: weights posjax has no place for: {unexpected}")
  module = Transformer(config, head=head, num_labels=num_labels)
  return module, {"params": check_shapes(module, flat, where)}


def state_to_hf(config: TransformerConfig, params: Mapping, head: str) -> dict[str, np.ndarray]:
  """A Hugging Face state dict (task-model key names: ``bert.`` prefixed unless ``head`` is ``none`` or
  ``pooler``) from posjax parameters."""
  flat = {k: np.asarray(v, np.float32) for k, v in flax.traverse_util.flatten_dict(dict(params), sep="/").items()}
  prefix = "" if head in ("none", "pooler") else "bert."
  d, out = config.hidden_size, {}

  def put(name, value):
    out[prefix + name if not name.startswith(("cls.", "classifier", "qa_outputs")) else name] = value

  def norm(name, source):
    put(f"{name}.weight", flat[f"{source}/scale"])
    put(f"{name}.bias", flat[f"{source}/bias"])

  def dense(name, source):
    put(f"{name}.weight", flat[f"{source}/kernel"].T)
    put(f"{name}.bias", flat[f"{source}/bias"])

  put("embeddings.word_embeddings.weight", flat["encoder/word_embeddings/embedding"])
  put("embeddings.token_type_embeddings.weight", flat.get("encoder/token_type_embeddings/embedding",
                                                         np.zeros((1, d), np.float32)))
  put("embeddings.position_embeddings.weight", flat.get("encoder/position/table/embedding",
                                                       np.zeros((config.max_len, d), np.float32)))
  norm("embeddings.LayerNorm", "encoder/embedding_norm")
  for i in range(config.num_layers):
    hf, px = f"encoder.layer.{i}", f"encoder/layer_{i}"
    for part in ("query", "key", "value"):
      put(f"{hf}.attention.self.{part}.weight", flat[f"{px}/attention/{part}/kernel"].reshape(d, d).T)
      put(f"{hf}.attention.self.{part}.bias", flat[f"{px}/attention/{part}/bias"].reshape(d))
    put(f"{hf}.attention.output.dense.weight", flat[f"{px}/attention/out/kernel"].reshape(d, d).T)
    put(f"{hf}.attention.output.dense.bias", flat[f"{px}/attention/out/bias"])
    norm(f"{hf}.attention.output.LayerNorm", f"{px}/attention_norm")
    dense(f"{hf}.intermediate.dense", f"{px}/mlp_in")
    dense(f"{hf}.output.dense", f"{px}/mlp_out")
    norm(f"{hf}.output.LayerNorm", f"{px}/mlp_norm")
    if config.position != "absolute":
      put(f"{hf}.attention.self.distance_embedding.weight", flat[f"{px}/attention/position/key"][::-1].copy())
  if head == "mlm":
    dense("cls.predictions.transform.dense", "transform")
    norm("cls.predictions.transform.LayerNorm", "transform_norm")
    put("cls.predictions.bias", flat["output_bias"])
    put("cls.predictions.decoder.weight", flat["encoder/word_embeddings/embedding"])
    put("cls.predictions.decoder.bias", flat["output_bias"])
  if head in ("pooler", "classification"):
    dense("pooler.dense", "pooler")
  if head == "classification":
    dense("classifier", "classifier")
  if head == "span":
    dense("qa_outputs", "span")
  return out


HF_CLASSES = {"none": "BertModel", "pooler": "BertModel", "mlm": "BertForMaskedLM",
              "classification": "BertForSequenceClassification", "span": "BertForQuestionAnswering"}


def head_of(params: Mapping) -> tuple[str, int]:
  """The head a posjax parameter tree carries, from its top-level names."""
  if "output_bias" in params:
    return "mlm", 2
  if "span" in params:
    return "span", 2
  if "classifier" in params:
    return "classification", int(np.shape(params["classifier"]["kernel"])[-1])
  if "pooler" in params:
    return "pooler", 2
  return "none", 2


def model_params(variables: Mapping) -> dict:
  """The parameters of a posjax model's variables (or of the parameters themselves) as plain arrays under the
  task models' names: boxed ones (as ``init`` returns them, with logical axes) unboxed, scanned layers
  (``model.scan_layers``) as ``layer_{i}``, a ``TransformerStack``'s put under ``encoder``; anything else is an error
  that says what is expected."""
  params = layout.unstack(flax.core.unfreeze(nn.unbox(variables.get("params", variables))))
  if "encoder" in params:
    return params
  if "word_embeddings" in params and "embedding_norm" in params:
    return {"encoder": params}
  raise ValueError(f"expected the variables of a posjax Transformer or TransformerStack ({{'params': ...}} or the "
                   f"params), with 'encoder' or 'word_embeddings' at the top; got keys {sorted(params)}")


def to_hf_bert(config: TransformerConfig, variables: Mapping):
  """The Hugging Face model (``BertModel``, ``BertForMaskedLM``, ``BertForSequenceClassification`` or
  ``BertForQuestionAnswering``, by the parameters' head; a causal model's LM head: ``BertLMHeadModel`` with
  ``is_decoder``) equal to a posjax model, in float32. ``variables`` as
  :func:`model_params` takes them (a task model's or a ``TransformerStack``'s, boxed or not)."""
  import torch  # imported here: the convert extra
  import transformers

  params = model_params(variables)
  head, num_labels = head_of(params)
  hf_config = transformers.BertConfig(**config_to_hf(config), num_labels=num_labels)
  model_class = getattr(transformers, HF_CLASSES[head])
  if config.causal:  # a causal BERT (configs/clm.py): BertLMHeadModel, the one that masks as it does
    if head != "mlm":
      raise ValueError(f"a causal BERT exports as Hugging Face's BertLMHeadModel, an LM head's model; this one has "
                       f"head {head!r}")
    model_class = transformers.BertLMHeadModel
  model = model_class(hf_config, add_pooling_layer=head == "pooler") if head in ("none", "pooler") else model_class(hf_config)
  state = {k: torch.from_numpy(np.array(v)) for k, v in state_to_hf(config, params, head).items()}
  missing, unexpected = model.load_state_dict(state, strict=False)
  missing = [k for k in missing if not k.endswith(("position_ids", "token_type_ids"))]
  if missing or unexpected:
    raise ValueError(f"posjax -> {model_class.__name__}: missing {missing}, unexpected {unexpected}")
  return model.eval()
