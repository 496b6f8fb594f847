"""Hugging Face ViT (``ViTForImageClassification``, Dosovitskiy et al. 2021) in, exactly: an
:class:`posjax.models.vision.ImageClassifier` on the ViT preset with the checkpoint's weights.

ViT's position embeddings are one flattened ``[1 + N, D]`` table, a row for the class token and one per patch in
raster order: posjax's ``absolute`` method on the raster index, the class token at 0 (the preset's ``absolute_2d``
gives the class token patch ``(0, 0)``'s entry, so it would not be the same model). ``max_len`` is ``1 + N`` for the
checkpoint's ``image_size``, the only size the converted model reads (as Hugging Face's without
``interpolate_pos_encoding``, which posjax does not have for a 1-D table). The classifier reads the class token's
final state (``pooling="cls"``).

posjax takes ``pixel_values`` channels last (``[B, H, W, C]``): the image processor's ``[B, C, H, W]`` output is
``transpose(0, 2, 3, 1)`` of it. ``id2label`` and the image processor's settings stay in the Hugging Face
directory. Reading a directory with ``model.safetensors`` needs neither PyTorch nor ``transformers``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any, Mapping

import jax.numpy as jnp

from posjax.convert.hf_bert import ACTIVATIONS, StateReader, check_shapes, read_source
from posjax.models import TransformerConfig
from posjax.models.vision import ImageClassifier

MODEL_TYPE = "vit"


def _square(hf: Mapping[str, Any], field: str, default: int) -> int:
  """An int field that Hugging Face also takes as ``[height, width]``; posjax's patches and images are square."""
  value = hf.get(field, default)
  if isinstance(value, Iterable):
    value = list(value)
    if len(value) != 2 or value[0] != value[1]:
      raise ValueError(f"config.json has {field}={value!r}; posjax reads a square {field} (one int)")
    value = value[0]
  return int(value)


def config_from_hf_vit(hf: Mapping[str, Any]) -> tuple[TransformerConfig, int]:
  """``(config, patch_size)`` of a Hugging Face ``ViTConfig`` (as a dict); anything posjax cannot represent is an
  error."""
  if hf.get("model_type") != MODEL_TYPE:
    raise ValueError(f"config.json has model_type={hf.get('model_type')!r}; this converter reads ViT ('vit')")
  if not hf.get("qkv_bias", True):
    raise ValueError("config.json has qkv_bias=False; posjax's ViT preset has biases on every dense layer "
                     "(use_bias='all')")
  act = hf.get("hidden_act", "gelu")
  if act not in ACTIVATIONS:
    raise ValueError(f"config.json has hidden_act={act!r}; posjax reads {sorted(ACTIVATIONS)}")
  image, patch = _square(hf, "image_size", 224), _square(hf, "patch_size", 16)
  if image % patch:
    raise ValueError(f"config.json has image_size={image} and patch_size={patch}: the image does not divide into "
                     f"patches")
  config = TransformerConfig.vit(
      hidden_size=int(hf["hidden_size"]), num_layers=int(hf["num_hidden_layers"]),
      num_heads=int(hf["num_attention_heads"]), intermediate_size=int(hf["intermediate_size"]),
      layer_norm_eps=float(hf.get("layer_norm_eps", 1e-12)), activation=ACTIVATIONS[act],
      dropout_rate=float(hf.get("hidden_dropout_prob", 0.0)),
      attention_dropout_rate=float(hf.get("attention_probs_dropout_prob", 0.0)),
      position="absolute", max_len=(image // patch) ** 2 + 1)
  return config, patch


def from_hf_vit(source) -> tuple[ImageClassifier, dict]:
  """``(module, variables)`` equal to a Hugging Face ``ViTForImageClassification``: an in-memory ``transformers``
  model or a directory. ``module.apply(variables, pixel_values_BxHxWxC)`` returns the logits ``[B, num_labels]`` for
  images of the checkpoint's ``image_size`` (the module's ``grid``; another size is an error). Refused in one line:
  another class (``ViTModel``, ``ViTForMaskedImageModeling``, DeiT's distillation token), ``num_labels=0``,
  ``qkv_bias=False``, a non-square image or patch, an image that does not divide into patches, an activation posjax
  does not have."""
  hf_config, state, where = read_source(source)
  config, patch = config_from_hf_vit(hf_config)
  if "classifier.weight" not in state or not any(k.startswith("vit.") for k in state):
    in_memory = not isinstance(source, (str, os.PathLike))
    kind = where if in_memory else f"{where}: {(hf_config.get('architectures') or ['the model'])[0]}"
    raise ValueError(f"{kind} holds no ViTForImageClassification weights ('vit.' and a 'classifier'); posjax reads "
                     f"that class alone (not ViTModel, ViTForMaskedImageModeling or num_labels=0)")
  reader = StateReader(state, "ViT image classifier")
  take, norm, dense, out = reader.take, reader.norm, reader.dense, reader.out
  d, heads = config.hidden_size, config.num_heads
  conv_DxCxPxP = take("vit.embeddings.patch_embeddings.projection.weight")
  out["patch_embedding/kernel"] = conv_DxCxPxP.transpose(2, 3, 1, 0).reshape(-1, d)  # (row, column, channel)
  out["patch_embedding/bias"] = take("vit.embeddings.patch_embeddings.projection.bias")
  out["class_token"] = take("vit.embeddings.cls_token")
  out["encoder/position/table/embedding"] = take("vit.embeddings.position_embeddings")[0]
  for i in range(config.num_layers):
    hf, px = f"vit.encoder.layer.{i}", f"encoder/layer_{i}"
    for part in ("query", "key", "value"):
      dense(f"{px}/attention/{part}", f"{hf}.attention.attention.{part}", (d, heads, d // heads))
    out[f"{px}/attention/out/kernel"] = take(f"{hf}.attention.output.dense.weight").T.reshape(heads, d // heads, d)
    out[f"{px}/attention/out/bias"] = take(f"{hf}.attention.output.dense.bias")
    norm(f"{px}/attention_norm", f"{hf}.layernorm_before")
    norm(f"{px}/mlp_norm", f"{hf}.layernorm_after")
    dense(f"{px}/mlp_in", f"{hf}.intermediate.dense")
    dense(f"{px}/mlp_out", f"{hf}.output.dense")
  norm("encoder/final_norm", "vit.layernorm")
  dense("classifier", "classifier")
  if reader.dropped():
    raise ValueError(f"{where}: weights posjax has no place for: {reader.dropped()}")
  side = round((config.max_len - 1) ** 0.5)
  module = ImageClassifier(config, patch, int(out["classifier/bias"].shape[0]), "cls", grid=(side, side))
  example = jnp.zeros((1, side * patch, side * patch, conv_DxCxPxP.shape[1]), jnp.float32)
  return module, {"params": check_shapes(module, out, where, example)}
