"""Checkpoints of the official TUPE code (github.com/guolinke/TUPE, a fairseq fork; Ke, He, Liu 2021) as posjax
models: TUPE-A, and TUPE-R (``--rel-pos``).

What the official encoder (``fairseq/modules/transformer_sentence_encoder.py``) holds, and where it goes:

- ``embed_tokens`` -> word embeddings (no token types, no position embedding at the input);
  ``emb_layer_norm`` (``--embedding-normalize``) -> the embedding LayerNorm; ``emb_out_layer_norm``
  (``--encoder-normalize-before``, Pre-LN) -> the final LayerNorm.
- ``pos`` (``max_positions + 1`` rows: the token at position t reads row t+1, rows 0 and 1 give θ1 and θ2),
  ``pos_ln``, ``pos_q_linear``, ``pos_k_linear`` (with bias) -> ``tupe_a`` / ``tupe_r`` with
  ``cls_reset="official"``; ``relative_attention_bias`` (33 rows: 32 T5 buckets, max distance 128, row 16 for
  the [CLS] row and row 32 for its column) -> TUPE-R's relative table, as is.
- Each layer's ``self_attn`` (``in_proj_weight`` = q, k, v stacked, or ``q_proj``/``k_proj``/``v_proj``),
  ``out_proj``, ``self_attn_layer_norm``, ``fc1``, ``fc2``, ``final_layer_norm``; fairseq's LayerNorm eps 1e-5.
- ``lm_head`` (tied to ``embed_tokens``) -> the MLM head; ``classification_heads.<name>`` (dense, tanh,
  out_proj) -> the classification head.

The checkpoint is unpickled without fairseq: objects of fairseq classes (meters, ...) become empty stand-ins.
Load only checkpoints you trust (they are pickles).
"""

from __future__ import annotations

import argparse
import os
import pickle
import types
from typing import Any, Mapping

import numpy as np

from posjax.convert.hf_bert import check_shapes
from posjax.models import TransformerConfig, Transformer

ACTIVATIONS = {"gelu": "gelu", "gelu_accurate": "gelu_tanh", "gelu_fast": "gelu_tanh", "relu": "relu"}
PREFIXES = ("decoder.sentence_encoder.", "encoder.sentence_encoder.")
NUM_BUCKETS, MAX_DISTANCE = 32, 128  # fixed in the official encoder (not command-line arguments)


class _Stub:
  """Stands in for an object of a fairseq class in a checkpoint (training meters and the like)."""

  def __init__(self, *args, **kwargs):
    del args, kwargs

  def __setstate__(self, state):
    if isinstance(state, dict):
      self.__dict__.update(state)


class _Unpickler(pickle.Unpickler):
  def find_class(self, module, name):
    if module.split(".")[0] == "fairseq":
      return _Stub
    return super().find_class(module, name)


_PICKLE = types.SimpleNamespace(Unpickler=_Unpickler, load=lambda f, **kw: _Unpickler(f, **kw).load(),
                                __name__="posjax_fairseq_pickle")


def load_checkpoint(path: str) -> dict:
  """A fairseq ``checkpoint*.pt`` as a dict (``args``, ``model``), read without fairseq."""
  import torch  # imported here: the convert extra

  if not os.path.isfile(path):
    raise FileNotFoundError(f"TUPE checkpoint {path} does not exist")
  try:
    return torch.load(path, map_location="cpu", pickle_module=_PICKLE, weights_only=False)
  except (RuntimeError, EOFError, pickle.UnpicklingError) as error:
    raise ValueError(f"TUPE checkpoint {path} cannot be read ({' '.join(str(error).split()) or type(error).__name__}"
                     "); the converter reads a whole checkpoint*.pt that fairseq saved (a truncated copy: copy it "
                     "again)") from None


def _args(checkpoint: Mapping) -> dict:
  args = checkpoint.get("args")
  if args is None and checkpoint.get("cfg") is not None:
    args = checkpoint["cfg"].get("model")
  if args is None:
    raise ValueError("the checkpoint has no 'args' (the fairseq model arguments); it has "
                     f"{sorted(checkpoint)}")
  return dict(vars(args)) if isinstance(args, (argparse.Namespace, _Stub)) else dict(args)


def _numpy(state: Mapping) -> dict[str, np.ndarray]:
  out = {}
  for key, value in state.items():
    if hasattr(value, "detach"):
      value = value.detach().cpu().float().numpy() if value.is_floating_point() else value.detach().cpu().numpy()
    out[key] = np.asarray(value)
  return out


def config_from_args(args: Mapping[str, Any], state: Mapping[str, np.ndarray]) -> TransformerConfig:
  """posjax's TransformerConfig for an official TUPE model; what posjax cannot represent is an error."""
  act = args.get("activation_fn", "gelu")
  if act not in ACTIVATIONS:
    raise ValueError(f"the checkpoint's activation_fn={act!r}; posjax reads {sorted(ACTIVATIONS)}")
  if "embed_tokens.weight" not in state:
    raise ValueError("the checkpoint has no sentence_encoder.embed_tokens.weight: not a TUPE (fairseq BERT) model")
  if "emb_layer_norm.weight" not in state:
    raise ValueError("the checkpoint was trained without --embedding-normalize (no emb_layer_norm); posjax's "
                     "encoder always normalizes its embeddings")
  rel_pos = bool(args.get("rel_pos", False))
  if rel_pos and state["relative_attention_bias.weight"].shape[0] != NUM_BUCKETS + 1:
    raise ValueError(f"relative_attention_bias has {state['relative_attention_bias.weight'].shape[0]} rows; the "
                     f"official TUPE-R has {NUM_BUCKETS + 1}")
  vocab_size, hidden = state["embed_tokens.weight"].shape
  max_len = int(args.get("max_positions") or args.get("tokens_per_sample") or state["pos.weight"].shape[0] - 1)
  options = {"cls_reset": "official", "share_across_layers": True, "projection_bias": True, "layernorm": True}
  if rel_pos:
    options.update(relative_distance="buckets", num_buckets=NUM_BUCKETS, max_distance=MAX_DISTANCE)
  return TransformerConfig(
      vocab_size=int(vocab_size), hidden_size=int(args.get("encoder_embed_dim", hidden)),
      num_layers=int(args.get("encoder_layers", 12)), num_heads=int(args.get("encoder_attention_heads", 12)),
      intermediate_size=int(args.get("encoder_ffn_embed_dim", 3072)), max_len=max_len, type_vocab_size=0,
      position="tupe_r" if rel_pos else "tupe_a", position_options=options,
      dropout_rate=float(args.get("dropout", 0.1)), attention_dropout_rate=float(args.get("attention_dropout", 0.1)),
      layer_norm_eps=1e-5, norm="pre" if args.get("encoder_normalize_before", False) else "post",
      activation=ACTIVATIONS[act])


def params_from_fairseq(config: TransformerConfig, encoder: Mapping[str, np.ndarray], heads: Mapping[str, np.ndarray],
                        head: str, head_name: str | None) -> dict[str, np.ndarray]:
  """Flat posjax parameters from the official encoder's weights (``encoder``: keys without the
  ``sentence_encoder.`` prefix) and its heads (``heads``: keys as in the checkpoint)."""
  d, h = config.hidden_size, config.num_heads
  k = d // h
  out = {}

  def take(source, key):
    if key not in source:
      raise ValueError(f"the checkpoint has no weight {key!r} (expected for a {config.position} model)")
    return source[key]

  def norm(target, source, name):
    out[f"{target}/scale"], out[f"{target}/bias"] = take(source, f"{name}.weight"), take(source, f"{name}.bias")

  def dense(target, source, name, heads_split=False):
    weight, bias = take(source, f"{name}.weight"), take(source, f"{name}.bias")
    out[f"{target}/kernel"] = weight.T.reshape(d, h, k) if heads_split else weight.T
    out[f"{target}/bias"] = bias.reshape(h, k) if heads_split else bias

  out["encoder/word_embeddings/embedding"] = take(encoder, "embed_tokens.weight")
  norm("encoder/embedding_norm", encoder, "emb_layer_norm")
  out["encoder/position/table/embedding"] = take(encoder, "pos.weight")
  norm("encoder/position/pos_ln", encoder, "pos_ln")
  dense("encoder/position/correlation/query", encoder, "pos_q_linear", heads_split=True)
  dense("encoder/position/correlation/key", encoder, "pos_k_linear", heads_split=True)
  if config.position == "tupe_r":
    out["encoder/position/correlation/relative_bias/rel_bias"] = take(encoder, "relative_attention_bias.weight")
  if config.norm == "pre":
    norm("encoder/final_norm", encoder, "emb_out_layer_norm")
  for i in range(config.num_layers):
    src, px = f"layers.{i}", f"encoder/layer_{i}"
    attn = f"{src}.self_attn"
    if f"{attn}.in_proj_weight" in encoder:
      weights = np.split(encoder[f"{attn}.in_proj_weight"], 3)
      biases = np.split(take(encoder, f"{attn}.in_proj_bias"), 3)
    else:
      weights = [take(encoder, f"{attn}.{p}_proj.weight") for p in "qkv"]
      biases = [take(encoder, f"{attn}.{p}_proj.bias") for p in "qkv"]
    for part, weight, bias in zip(("query", "key", "value"), weights, biases):
      out[f"{px}/attention/{part}/kernel"] = weight.T.reshape(d, h, k)
      out[f"{px}/attention/{part}/bias"] = bias.reshape(h, k)
    out[f"{px}/attention/out/kernel"] = take(encoder, f"{attn}.out_proj.weight").T.reshape(h, k, d)
    out[f"{px}/attention/out/bias"] = take(encoder, f"{attn}.out_proj.bias")
    norm(f"{px}/attention_norm", encoder, f"{src}.self_attn_layer_norm")
    dense(f"{px}/mlp_in", encoder, f"{src}.fc1")
    dense(f"{px}/mlp_out", encoder, f"{src}.fc2")
    norm(f"{px}/mlp_norm", encoder, f"{src}.final_layer_norm")
  if head == "mlm":
    lm = {key.split("lm_head.", 1)[1]: value for key, value in heads.items() if "lm_head." in key}
    if "weight" in lm and not np.array_equal(lm["weight"], encoder["embed_tokens.weight"]):
      raise ValueError("the checkpoint's lm_head.weight is not tied to embed_tokens; posjax's MLM head is")
    dense("transform", lm, "dense")
    norm("transform_norm", lm, "layer_norm")
    out["output_bias"] = take(lm, "bias")
  if head == "classification":
    prefix = f"classification_heads.{head_name}."
    cls = {key[len(prefix):]: value for key, value in heads.items() if key.startswith(prefix)}
    dense("pooler", cls, "dense")
    dense("classifier", cls, "out_proj")
  return out


def from_tupe_fairseq(checkpoint, classification_head: str | None = None) -> tuple[Transformer, dict]:
  """``(module, variables)`` equal to an official TUPE model: ``checkpoint`` is a ``checkpoint*.pt`` path or
  the loaded dict (``args``, ``model``). The head: a classification head (``classification_head``, or the only
  one), else the MLM head, else none."""
  where = checkpoint if isinstance(checkpoint, str) else "the checkpoint"
  loaded = load_checkpoint(checkpoint) if isinstance(checkpoint, str) else checkpoint
  if "model" not in loaded:
    raise ValueError(f"{where} has no 'model' state dict; it has {sorted(loaded)}")
  state = _numpy(loaded["model"])
  args = _args(loaded)
  prefix = next((p for p in PREFIXES if any(key.startswith(p) for key in state)), None)
  if prefix is None:
    raise ValueError(f"{where}: no weights under {' or '.join(PREFIXES)}: not a TUPE (fairseq BERT) model")
  encoder = {key[len(prefix):]: value for key, value in state.items() if key.startswith(prefix)}
  heads = {key: value for key, value in state.items() if not key.startswith(prefix)}
  names = sorted({key.split(".")[1] for key in heads if key.startswith("classification_heads.")})
  if classification_head is not None and classification_head not in names:
    raise ValueError(f"{where} has no classification head {classification_head!r}; it has {names}")
  if classification_head is None and len(names) > 1:
    raise ValueError(f"{where} has several classification heads {names}: name one (classification_head=...)")
  head_name = classification_head or (names[0] if names else None)
  head = "classification" if head_name else ("mlm" if any("lm_head." in key for key in heads) else "none")
  if head == "classification" and args.get("pooler_activation_fn", "tanh") != "tanh":
    raise ValueError(f"the classification head uses pooler_activation_fn={args['pooler_activation_fn']!r}; "
                     "posjax's head uses tanh")
  config = config_from_args(args, encoder)
  num_labels = int(heads[f"classification_heads.{head_name}.out_proj.weight"].shape[0]) if head_name else 2
  module = Transformer(config, head=head, num_labels=num_labels)
  flat = params_from_fairseq(config, encoder, heads, head, head_name)
  return module, {"params": check_shapes(module, flat, str(where))}
