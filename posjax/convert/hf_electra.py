"""Hugging Face ELECTRA (``transformers`` < 5) -> posjax, exactly: ``ElectraModel``, ``ElectraForPreTraining``
(the discriminator) and ``ElectraForMaskedLM`` (the generator), with ``position_embedding_type`` absolute,
``relative_key`` or ``relative_key_query`` (mapped as :mod:`posjax.convert.hf_bert` maps BERT's).

An ELECTRA encoder is a BERT encoder whose embeddings may be narrower than its layers (``embedding_size <
hidden_size``: the generator of ELECTRA-Base reads 768-wide embeddings through ``embeddings_project`` into its
256), so the encoder's weights convert as BERT's (:func:`posjax.convert.hf_bert.params_from_hf`), plus
``embeddings_project``; the generator's MLM head is BERT's at the embeddings' width (``generator_predictions``
-> ``transform``, ``transform_norm``; ``generator_lm_head.bias`` -> ``output_bias``, its weight tied to the word
embeddings), the discriminator's head is posjax's ``rtd`` head (``discriminator_predictions.dense`` -> ``rtd``,
``.dense_prediction`` -> ``rtd_output``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

from posjax.convert import hf_bert
from posjax.models import BertConfig, BertModel

# Hugging Face class -> posjax head, read from the weights present.
HEADS = {"generator_predictions.dense.weight": "mlm", "discriminator_predictions.dense.weight": "rtd"}
DROPPED = ("embeddings.position_ids", "embeddings.token_type_ids", "generator_lm_head.weight")


def config_from_hf(hf: Mapping[str, Any]) -> BertConfig:
  """A Hugging Face ``ElectraConfig`` (as a dict) as a posjax BertConfig; what posjax cannot represent is an error
  (the same checks as BERT's)."""
  if hf.get("model_type", "electra") != "electra":
    raise ValueError(f"config.json has model_type={hf.get('model_type')!r}; this converter reads ELECTRA "
                     "('electra'); BERT: posjax.convert.from_hf_bert")
  config = hf_bert.config_from_hf({**hf, "model_type": "bert"})
  return dataclasses.replace(config, embedding_size=int(hf.get("embedding_size", config.hidden_size)))


def params_from_hf(config: BertConfig, state: Mapping[str, np.ndarray], head: str) -> tuple[dict, list[str]]:
  """posjax parameters (flat, ``/``-joined paths) from an ELECTRA state dict without its ``electra.`` prefix,
  and the keys dropped."""
  reader = hf_bert.StateReader(state, f"ELECTRA {head} model")
  out, _ = hf_bert.params_from_hf(config, state, "none", reader)
  take, dense = reader.take, reader.dense

  if config.embed_width != config.hidden_size:
    dense("encoder/embeddings_project", "embeddings_project")
  if head == "mlm":
    dense("transform", "generator_predictions.dense")
    reader.norm("transform_norm", "generator_predictions.LayerNorm")
    out["output_bias"] = take("generator_lm_head.bias")
    decoder = state.get("generator_lm_head.weight")
    if decoder is not None and not np.array_equal(decoder, state["embeddings.word_embeddings.weight"]):
      raise ValueError("the generator's LM head is not tied to the word embeddings; posjax's MLM head is (as "
                       "ELECTRA's)")
  if head == "rtd":
    dense("rtd", "discriminator_predictions.dense")
    dense("rtd_output", "discriminator_predictions.dense_prediction")
  return out, reader.dropped()


def from_hf_electra(source) -> tuple[BertModel, dict]:
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
  module = BertModel(config, head=head)
  return module, {"params": hf_bert._check_shapes(module, flat, where)}  # pylint: disable=protected-access
