"""Hugging Face ViT (``ViTForImageClassification``, Dosovitskiy et al. 2021) in and out, exactly: an
:class:`posjax.models.vision.ImageClassifier` on the ViT preset with the checkpoint's weights (:func:`from_hf_vit`),
and such a classifier with an input-embedding method as that class (:func:`to_hf_vit`).

ViT's position embeddings are one flattened ``[1 + N, D]`` table, a row for the class token and one per patch in
raster order: posjax's ``absolute_2d`` on the checkpoint's grid of patches with ``class_row=True`` (the first row,
read by the class token) and ``resize="torch"``, so that the model at another resolution
(:func:`posjax.models.vision.regridded`) is Hugging Face's with ``interpolate_pos_encoding=True`` (the grid's table
resized by PyTorch's bicubic kernel, the class row kept) for a square checkpoint's grid (Hugging Face reshapes a
non-square one as a square). The classifier reads the class token's final state
(``pooling="cls"``).

posjax takes ``pixel_values`` channels last (``[B, H, W, C]``): the image processor's ``[B, C, H, W]`` output is
``transpose(0, 2, 3, 1)`` of it. ``id2label`` and the image processor's settings stay in the Hugging Face
directory. Reading a directory with ``model.safetensors`` needs neither PyTorch nor ``transformers``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np

from posjax.convert.hf_bert import ACTIVATIONS, TO_HF_ACTIVATIONS, StateReader, check_shapes, model_params, read_source
from posjax.models import TransformerConfig
from posjax.models.vision import ImageClassifier, class_position, grid_positions
from posjax.positions.grid import checked_grid

MODEL_TYPE = "vit"


def _sides(hf: Mapping[str, Any], field: str, default: int) -> tuple[int, int]:
  """``(height, width)`` of a field that Hugging Face takes as one int or as ``[height, width]``."""
  value = hf.get(field, default)
  value = list(value) if isinstance(value, Iterable) else [value, value]
  if len(value) != 2 or not all(isinstance(v, int) and v > 0 for v in value):
    raise ValueError(f"config.json has {field}={hf.get(field)!r}; posjax reads a positive int or [height, width]")
  return value[0], value[1]


def config_from_hf_vit(hf: Mapping[str, Any]) -> tuple[TransformerConfig, int, tuple[int, int]]:
  """``(config, patch_size, grid)`` of a Hugging Face ``ViTConfig`` (as a dict): ``grid`` the ``(rows, columns)`` of
  patches of its ``image_size``; anything posjax cannot represent is an error."""
  if hf.get("model_type") != MODEL_TYPE:
    raise ValueError(f"config.json has model_type={hf.get('model_type')!r}; this converter reads ViT ('vit')")
  if not hf.get("qkv_bias", True):
    raise ValueError("config.json has qkv_bias=False; posjax's ViT preset has biases on every dense layer "
                     "(use_bias='all')")
  act = hf.get("hidden_act", "gelu")
  if act not in ACTIVATIONS:
    raise ValueError(f"config.json has hidden_act={act!r}; posjax reads {sorted(ACTIVATIONS)}")
  image, (patch, patch_width) = _sides(hf, "image_size", 224), _sides(hf, "patch_size", 16)
  if patch != patch_width:
    raise ValueError(f"config.json has patch_size={hf['patch_size']!r}; posjax reads a square patch_size (one int)")
  if image[0] % patch or image[1] % patch:
    raise ValueError(f"config.json has image_size={hf.get('image_size')!r} and patch_size={patch}: the image does "
                     f"not divide into patches")
  grid = (image[0] // patch, image[1] // patch)
  config = TransformerConfig.vit(
      hidden_size=int(hf["hidden_size"]), num_layers=int(hf["num_hidden_layers"]),
      num_heads=int(hf["num_attention_heads"]), intermediate_size=int(hf["intermediate_size"]),
      layer_norm_eps=float(hf.get("layer_norm_eps", 1e-12)), activation=ACTIVATIONS[act],
      dropout_rate=float(hf.get("hidden_dropout_prob", 0.0)),
      attention_dropout_rate=float(hf.get("attention_probs_dropout_prob", 0.0)),
      position="absolute_2d", position_options={"grid": grid, "class_row": True, "resize": "torch"},
      max_len=grid[0] * grid[1] + 1)
  return config, patch, grid


def from_hf_vit(source) -> tuple[ImageClassifier, dict]:
  """``(module, variables)`` equal to a Hugging Face ``ViTForImageClassification``: an in-memory ``transformers``
  model or a directory. ``module.apply(variables, pixel_values_BxHxWxC)`` returns the logits ``[B, num_labels]``
  for images of the checkpoint's ``image_size`` (another size is an error that names
  :func:`posjax.models.vision.regridded`). Refused in one line: another class (``ViTModel``,
  ``ViTForMaskedImageModeling``, DeiT's distillation token), ``num_labels=0``, ``qkv_bias=False``, a non-square
  patch, an image that does not divide into patches, an activation posjax does not have."""
  hf_config, state, where = read_source(source)
  config, patch, grid = config_from_hf_vit(hf_config)
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
  table_LxD = take("vit.embeddings.position_embeddings")[0]
  out["encoder/position/class_embedding"] = table_LxD[:1]
  out["encoder/position/embedding"] = table_LxD[1:].reshape(*grid, d)
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
  module = ImageClassifier(config, patch, int(out["classifier/bias"].shape[0]), "cls")
  example = jnp.zeros((1, grid[0] * patch, grid[1] * patch, conv_DxCxPxP.shape[1]), jnp.float32)
  return module, {"params": check_shapes(module, out, where, example)}


# The fields a Hugging Face ViT carries; every other TransformerConfig field must be the ViT preset's.
CARRIED = ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size", "max_len", "position",
           "position_options", "attention_kernel", "kernel_platform", "dropout_rate", "attention_dropout_rate",
           "layer_norm_eps", "activation", "dtype", "param_dtype", "remat", "scan_layers", "attention_query_block")


def to_hf_vit(model: ImageClassifier, variables: Mapping, grid: tuple[int, int] | None = None):
  """The Hugging Face ``ViTForImageClassification`` (float32) equal to ``model`` on images of ``grid = (rows,
  columns)`` patches: ``absolute_2d``'s table's, else given here.

  A method that only adds an embedding to the input (``absolute``, ``absolute_2d``, ``sinusoidal``,
  ``sinusoidal_2d``) or ``none`` goes out as ViT's flattened table: the embedding the method gives each token of
  that grid, the class token's included (``absolute_2d`` and the sinusoids give it patch ``(0, 0)``'s), so the
  export reads that grid alone. ``pooling="cls"`` only (ViT classifies the class token); any other field that ViT
  does not have is refused in one line."""
  import torch  # imported here: the convert extra
  import transformers

  c = model.config
  if model.pooling != "cls":
    raise ValueError(f"ViTForImageClassification classifies the class token; this model has pooling="
                     f"{model.pooling!r} (only 'cls' exports)")
  spec = c.position_spec
  if not (spec.method.input_embedding or spec.method.name == "none"):
    raise ValueError(f"position={c.position!r} acts inside attention; ViT's positions are one table added to the "
                     f"input: absolute, absolute_2d, sinusoidal, sinusoidal_2d or none export")
  if c.activation not in TO_HF_ACTIVATIONS:
    raise ValueError(f"activation={c.activation!r} has no Hugging Face hidden_act; {sorted(TO_HF_ACTIVATIONS)} do")
  preset = TransformerConfig.vit(**{f: getattr(c, f) for f in CARRIED})
  differ = [f.name for f in dataclasses.fields(c) if getattr(c, f.name) != getattr(preset, f.name)]
  if differ:
    raise ValueError(f"Hugging Face's ViT has no counterpart for these fields, which differ from the ViT preset's: "
                     f"{differ}")
  table_grid = getattr(spec.options, "grid", None)  # absolute_2d's
  if grid is None and table_grid is None:
    raise ValueError(f"position={c.position!r} reads any grid: give the grid=(rows, columns) of patches to export")
  grid = checked_grid(table_grid if grid is None else grid)
  if table_grid is not None and tuple(table_grid) != grid:
    raise ValueError(f"grid={grid}, but the model reads {tuple(table_grid)} patches: leave grid out, or export the "
                     f"model posjax.models.vision.regridded gives for {grid}")
  params = model_params(variables)
  d, p = c.hidden_size, model.patch_size
  state = spec.method.encoder(spec=spec).apply(
      {"params": params["encoder"].get("position", {})},
      grid_positions(spec.method.axes, *grid, True, class_position(c)))
  table_LxD = (np.zeros((grid[0] * grid[1] + 1, d), np.float32) if state.embedding is None
               else np.asarray(state.embedding[0], np.float32))
  kernel = np.asarray(params["patch_embedding"]["kernel"], np.float32)
  channels = kernel.shape[0] // (p * p)
  out = {"vit.embeddings.cls_token": params["class_token"], "vit.embeddings.position_embeddings": table_LxD[None],
         "vit.embeddings.patch_embeddings.projection.weight": kernel.reshape(p, p, channels, d).transpose(3, 2, 0, 1),
         "vit.embeddings.patch_embeddings.projection.bias": params["patch_embedding"]["bias"],
         "vit.layernorm.weight": params["encoder"]["final_norm"]["scale"],
         "vit.layernorm.bias": params["encoder"]["final_norm"]["bias"],
         "classifier.weight": np.asarray(params["classifier"]["kernel"]).T,
         "classifier.bias": params["classifier"]["bias"]}
  for i in range(c.num_layers):
    layer, hf = params["encoder"][f"layer_{i}"], f"vit.encoder.layer.{i}"
    for part in ("query", "key", "value"):
      out[f"{hf}.attention.attention.{part}.weight"] = np.asarray(layer["attention"][part]["kernel"]).reshape(d, d).T
      out[f"{hf}.attention.attention.{part}.bias"] = np.asarray(layer["attention"][part]["bias"]).reshape(d)
    out[f"{hf}.attention.output.dense.weight"] = np.asarray(layer["attention"]["out"]["kernel"]).reshape(d, d).T
    out[f"{hf}.attention.output.dense.bias"] = layer["attention"]["out"]["bias"]
    for ours, theirs in (("attention_norm", "layernorm_before"), ("mlp_norm", "layernorm_after")):
      out[f"{hf}.{theirs}.weight"], out[f"{hf}.{theirs}.bias"] = layer[ours]["scale"], layer[ours]["bias"]
    for ours, theirs in (("mlp_in", "intermediate.dense"), ("mlp_out", "output.dense")):
      out[f"{hf}.{theirs}.weight"] = np.asarray(layer[ours]["kernel"]).T
      out[f"{hf}.{theirs}.bias"] = layer[ours]["bias"]
  hf_config = transformers.ViTConfig(
      hidden_size=d, num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
      intermediate_size=c.intermediate_size, hidden_act=TO_HF_ACTIVATIONS[c.activation],
      hidden_dropout_prob=c.dropout_rate, attention_probs_dropout_prob=c.attention_dropout_rate,
      layer_norm_eps=c.layer_norm_eps, image_size=[grid[0] * p, grid[1] * p], patch_size=p, num_channels=channels,
      qkv_bias=True, num_labels=model.num_classes)
  hf_model = transformers.ViTForImageClassification(hf_config)
  hf_model.load_state_dict({k: torch.from_numpy(np.array(v, np.float32)) for k, v in out.items()}, strict=True)
  return hf_model.eval()
