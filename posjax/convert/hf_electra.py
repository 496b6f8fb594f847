"""Hugging Face ELECTRA (``transformers`` < 5) <-> posjax, exactly: ``ElectraModel``, ``ElectraForPreTraining``
(the discriminator) and ``ElectraForMaskedLM`` (the generator), with ``position_embedding_type`` absolute,
``relative_key`` or ``relative_key_query`` (mapped as :mod:`posjax.convert.hf_bert` maps BERT's).

An ELECTRA encoder is a BERT encoder whose embeddings may be narrower than its layers (``embedding_size <
hidden_size``: the generator of ELECTRA-Base reads 768-wide embeddings through ``embeddings_project`` into its
256), so the encoder's weights convert as BERT's (:func:`posjax.convert.hf_bert.params_from_hf`,
:func:`~posjax.convert.hf_bert.state_to_hf`), plus ``embeddings_project``; the generator's MLM head is BERT's at
the embeddings' width (``generator_predictions`` -> ``transform``, ``transform_norm``; ``generator_lm_head.bias``
-> ``output_bias``, its weight tied to the word embeddings), the discriminator's head is posjax's ``rtd`` head
(``discriminator_predictions.dense`` -> ``rtd``, ``.dense_prediction`` -> ``rtd_output``). Hugging Face's
generator head is always exact GELU, posjax's that of the config: only ``gelu`` generators convert.

A posjax :class:`posjax.models.electra.Electra` (generator and discriminator on one set of embeddings) becomes
two Hugging Face models (:func:`electra_to_hf`), each with its own copy of the shared embeddings, as Hugging
Face's ELECTRA checkpoints store them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import flax.traverse_util
import jax
import numpy as np

from posjax.convert import hf_bert
from posjax.models import TransformerConfig, Transformer

# Hugging Face class -> posjax head, read from the weights present.
HEADS = {"generator_predictions.dense.weight": "mlm", "discriminator_predictions.dense.weight": "rtd"}
TO_HF_CLASSES = {"none": "ElectraModel", "rtd": "ElectraForPreTraining", "mlm": "ElectraForMaskedLM"}
# Each head's Hugging Face module -> posjax Dense or LayerNorm.
HEAD_LAYERS = {"rtd": {"discriminator_predictions.dense": "rtd", "discriminator_predictions.dense_prediction":
                       "rtd_output"},
               "mlm": {"generator_predictions.dense": "transform", "generator_predictions.LayerNorm": "transform_norm"},
               "none": {}}
DROPPED = ("embeddings.position_ids", "embeddings.token_type_ids", "generator_lm_head.weight")
# What the generator of a posjax Electra reads from the discriminator's encoder (see posjax.models.electra).
SHARED = ("word_embeddings", "token_type_embeddings", "position", "embedding_norm")
JOINT = ("encoder", "generator", "generator_head", "rtd", "rtd_output")


def check_generator_activation(config: TransformerConfig) -> None:
  """Hugging Face's generator head (``ElectraGeneratorPredictions``) is exact GELU whatever ``hidden_act`` says;
  posjax's MLM head uses the config's activation, so only ``gelu`` is the same model on both sides."""
  if config.activation != "gelu":
    raise ValueError(f"Hugging Face ELECTRA's generator head is always exact GELU; this model's activation is "
                     f"{config.activation!r} (posjax's MLM head uses it): only 'gelu' generators convert")


def config_from_hf(hf: Mapping[str, Any]) -> TransformerConfig:
  """A Hugging Face ``ElectraConfig`` (as a dict) as a posjax TransformerConfig (``embedding_size`` 0 where it is
  ``hidden_size``, as posjax writes that); what posjax cannot represent is an error (the same checks as BERT's)."""
  if hf.get("model_type", "electra") != "electra":
    raise ValueError(f"config.json has model_type={hf.get('model_type')!r}; this converter reads ELECTRA "
                     "('electra'); BERT: posjax.convert.from_hf_bert")
  config = hf_bert.config_from_hf({**hf, "model_type": "bert"})
  embedding_size = int(hf.get("embedding_size", config.hidden_size))
  return dataclasses.replace(config, embedding_size=0 if embedding_size == config.hidden_size else embedding_size)


def config_to_hf(config: TransformerConfig, head: str = "none") -> dict:
  """posjax's TransformerConfig as Hugging Face ``ElectraConfig`` fields (``head``: ``mlm`` also checks the generator
  head's activation); what ELECTRA cannot express is an error (BERT's checks: its encoder is BERT's)."""
  if head == "mlm":
    check_generator_activation(config)
  try:
    fields = hf_bert.config_to_hf(config)
  except ValueError as error:
    raise ValueError(f"ELECTRA's encoder is BERT's: {error}") from None
  return {**fields, "model_type": "electra", "embedding_size": config.embed_width}


def params_from_hf(config: TransformerConfig, state: Mapping[str, np.ndarray], head: str) -> tuple[dict, list[str]]:
  """posjax parameters (flat, ``/``-joined paths) from an ELECTRA state dict without its ``electra.`` prefix,
  and the keys dropped."""
  reader = hf_bert.StateReader(state, f"ELECTRA {head} model")
  out, _ = hf_bert.params_from_hf(config, state, "none", reader)
  if config.embed_width != config.hidden_size:
    reader.dense("encoder/embeddings_project", "embeddings_project")
  for name, target in HEAD_LAYERS[head].items():
    (reader.norm if name.endswith("LayerNorm") else reader.dense)(target, name)
  if head == "mlm":
    check_generator_activation(config)
    out["output_bias"] = reader.take("generator_lm_head.bias")
    decoder = state.get("generator_lm_head.weight")
    if decoder is not None and not np.array_equal(decoder, state["embeddings.word_embeddings.weight"]):
      raise ValueError("the generator's LM head is not tied to the word embeddings; posjax's MLM head is (as "
                       "ELECTRA's)")
  return out, reader.dropped()


def from_hf_electra(source) -> tuple[Transformer, dict]:
  """``(module, variables)`` equal to a Hugging Face ELECTRA model (in memory, or a directory with
  ``config.json`` and ``model.safetensors`` / ``pytorch_model.bin``): ``ElectraModel`` -> head ``none``,
  ``ElectraForPreTraining`` -> ``rtd`` (``logits [B, L]``, that each token was replaced),
  ``ElectraForMaskedLM`` -> ``mlm``."""
  hf_config, state, where = hf_bert.read_source(source)
  state = {k.removeprefix("electra."): np.asarray(v) for k, v in state.items()}
  config = config_from_hf(hf_config)
  head = next((h for key, h in HEADS.items() if key in state), "none")
  flat, dropped = params_from_hf(config, state, head)
  unexpected = [k for k in dropped if k not in DROPPED and k != "embeddings.position_embeddings.weight"]
  if unexpected:
    raise ValueError(f"{where}: weights posjax has no place for: {unexpected}")
  module = Transformer(config, head=head)
  return module, {"params": hf_bert.check_shapes(module, flat, where)}


def head_of(params: Mapping) -> str:
  """The head a posjax parameter tree carries (:func:`posjax.convert.hf_bert.head_of`, and ``rtd``); one
  Hugging Face ELECTRA has no class for is an error."""
  if "rtd" in params or "rtd_output" in params:
    return "rtd"
  head, _ = hf_bert.head_of(params)
  if head not in TO_HF_CLASSES:
    raise ValueError(f"Hugging Face ELECTRA has no model for posjax's {head!r} head; it converts heads "
                     + ", ".join(f"{h} -> {name}" for h, name in TO_HF_CLASSES.items()))
  return head


def _torch_layer(layer: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
  """A posjax Dense's or LayerNorm's parameters as the torch module's ``weight`` and ``bias``."""
  return {"weight": layer["kernel"].T if "kernel" in layer else layer["scale"], "bias": layer["bias"]}


def state_to_hf(config: TransformerConfig, params: Mapping, head: str) -> dict[str, np.ndarray]:
  """A Hugging Face ELECTRA state dict (``electra.``-prefixed encoder unless ``head`` is ``none``) from posjax
  parameters (plain arrays, as :func:`posjax.convert.hf_bert.model_params` gives them)."""
  params = jax.tree.map(lambda x: np.asarray(x, np.float32), dict(params))
  e = config.embed_width
  # Hugging Face always has token-type and position tables, at the embeddings' width: absent ones are zeros.
  encoder = {"token_type_embeddings": {"embedding": np.zeros((1, e), np.float32)},
             "position": {"table": {"embedding": np.zeros((config.max_len, e), np.float32)}}, **params["encoder"]}
  state = hf_bert.state_to_hf(config, {"encoder": encoder}, "none")
  modules = {name: params[source] for name, source in HEAD_LAYERS[head].items()}
  if e != config.hidden_size:
    modules["embeddings_project"] = encoder["embeddings_project"]
  state.update({f"{name}.{part}": value for name, layer in modules.items()
                for part, value in _torch_layer(layer).items()})
  if head == "mlm":
    state["generator_lm_head.weight"] = encoder["word_embeddings"]["embedding"]
    state["generator_lm_head.bias"] = params["output_bias"]
  heads = tuple(f"{name}." for name in (*HEAD_LAYERS[head], "generator_lm_head"))
  return {k if head == "none" or k.startswith(heads) else f"electra.{k}": v for k, v in state.items()}


def to_hf_electra(config: TransformerConfig, variables: Mapping):
  """The Hugging Face model (``ElectraModel``, ``ElectraForPreTraining`` or ``ElectraForMaskedLM``, by the
  parameters' head: none, ``rtd``, ``mlm``) equal to a posjax model, in float32. ``variables`` as
  :func:`posjax.convert.hf_bert.model_params` takes them (a ``Transformer``'s or a ``TransformerStack``'s, boxed or
  not); parameters that do not match ``config`` are an error naming them, and every Hugging Face weight is
  written (a strict load)."""
  import torch  # imported here: the convert extra
  import transformers

  params = hf_bert.model_params(variables)
  head = head_of(params)
  name = TO_HF_CLASSES[head]
  hf_config = transformers.ElectraConfig(**config_to_hf(config, head))
  flat = flax.traverse_util.flatten_dict(params, sep="/")
  hf_bert.check_shapes(Transformer(config, head=head), flat, f"posjax -> {name}")
  model = getattr(transformers, name)(hf_config)
  model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in state_to_hf(config, params, head).items()})
  return model.eval()


def split_electra(variables: Mapping) -> tuple[dict, dict]:
  """``(generator, discriminator)`` parameters of a posjax ``Electra`` as two ``Transformer``'s (heads ``mlm``,
  ``rtd``), the generator's encoder given the shared embeddings it reads (its own, if it has them: an untied
  ``Electra``)."""
  params = variables.get("params", variables)
  missing = [k for k in JOINT if k not in params]
  if missing:
    raise ValueError(f"expected the variables of a posjax Electra ({{'params': ...}} or the params) with "
                     f"{list(JOINT)} at the top; {missing} missing, got keys {sorted(params)}")
  params = hf_bert.model_params(params)
  shared = {k: v for k, v in params["encoder"].items() if k in SHARED}
  generator = {"encoder": {**shared, **params["generator"]}, **params["generator_head"]}
  return generator, {k: params[k] for k in ("encoder", "rtd", "rtd_output")}


def electra_to_hf(generator_config: TransformerConfig, discriminator_config: TransformerConfig, variables: Mapping):
  """``(ElectraForMaskedLM, ElectraForPreTraining)`` equal to a posjax ``Electra``'s generator (``generate``:
  its logits at the masked positions are Hugging Face's there) and discriminator (``discriminate``), in
  float32; ``variables`` boxed or not."""
  generator, discriminator = split_electra(variables)
  return to_hf_electra(generator_config, generator), to_hf_electra(discriminator_config, discriminator)
