"""Vision transformers on the one stack (:meth:`posjax.models.TransformerConfig.vit`): an image cut into patches,
each patch one token (Dosovitskiy et al. 2021), and the position method reading each patch's place in the grid.

A method of two axes (``absolute_2d``, ``sinusoidal_2d``, ``rope_2d``, ``rope_mixed``) reads ``(row, column)``; one of
three (``mrope``) reads ``(0, row, column)``, Qwen2-VL's positions of one image frame; one of one axis reads the
raster index (row-major, as ViT's flattened table: Hugging Face's ``ViTModel`` is ``absolute`` on it with a class
token). The class token ([choice], with ``pooling="cls"``; initialised at zero, big_vision's, where Hugging Face
draws it from N(0, 0.02) and timm from N(0, 1e-6)) is at ``(0, 0)`` on every axis, rope-vit's unrotated class token;
a 2-D table or sinusoid gives it patch ``(0, 0)``'s entry there, where ViT learns it a row of its own, MAE's
sinusoids give it zeros and DeiT III, rope-vit and big_vision add it no position at all (a 1-D method's index 0 is
its own, the patches taking 1..N: ViT's flattened ``[1 + N, D]`` table is ``absolute`` on it). ``absolute_2d`` with
``class_row=True`` learns it ViT's row of its own, read at ``(-1, -1)``, where such a class token sits.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from posjax.models.transformer import DTYPES, TransformerConfig, TransformerStack
from posjax.positions import base
from posjax.positions.grid import CLASS_POSITION, checked_grid

# ``cls``: a learned class token first, its final state classified (ViT's, rope-vit's); ``mean``: no class token,
# the mean of the patches' final (normed) states (big_vision's ``gap``, Beyer et al. 2022, "Better plain ViT
# baselines"; MAE's fine-tuning pool averages before its norm).
POOLINGS = ("cls", "mean")


def class_position(config: TransformerConfig) -> int:
  """Where the class token sits on every axis: 0 (the module docstring), or ``absolute_2d``'s class row's position
  where its table has one (``class_row=True``: ViT's own row for it)."""
  return CLASS_POSITION if getattr(config.position_spec.options, "class_row", False) else 0


def grid_positions(axes: int, rows: int, cols: int, class_token: bool, class_at: int = 0):
  """``[1, L]`` (``axes`` <= 1: the raster index) or ``[1, L, axes]`` int32: the tokens' positions, the class token
  first where there is one, at ``class_at`` on every axis of two or three (the module docstring)."""
  if axes <= 1:
    return jnp.arange(rows * cols + class_token, dtype=jnp.int32)[None]
  if axes not in (2, 3):
    raise ValueError(f"a grid of patches has positions of 1 axis (raster), 2 (row, column) or 3 (frame, row, "
                     f"column); the method reads {axes}")
  row_N, col_N = np.divmod(np.arange(rows * cols), cols)
  grid_NxA = np.stack([row_N, col_N] if axes == 2 else [np.zeros_like(row_N), row_N, col_N], -1)
  if class_token:
    grid_NxA = np.concatenate([np.full((1, axes), class_at, grid_NxA.dtype), grid_NxA])
  return jnp.asarray(grid_NxA[None], jnp.int32)


def patches(pixel_values_BxHxWxC, patch_size: int):
  """``[B, N, p * p * C]``: the image's ``p x p`` patches in raster order, each flattened (row, column, channel), as a
  ``p``-strided ``p x p`` convolution reads them (flax's HWIO kernel reshaped; a PyTorch ``Conv2d`` weight
  ``[D, C, p, p]`` is ``permute(2, 3, 1, 0)`` of it)."""
  if pixel_values_BxHxWxC.ndim != 4:
    raise ValueError(f"pixel_values must be [batch, height, width, channels] (channels last, not PyTorch's NCHW), got "
                     f"shape {pixel_values_BxHxWxC.shape}")
  b, h, w, c = pixel_values_BxHxWxC.shape
  if h % patch_size or w % patch_size:
    raise ValueError(f"an image of {h} x {w} pixels does not divide into {patch_size} x {patch_size} patches: give "
                     f"a height and a width that are multiples of {patch_size} (pixel_values are [batch, height, "
                     f"width, channels])")
  x = pixel_values_BxHxWxC.reshape(b, h // patch_size, patch_size, w // patch_size, patch_size, c)
  return x.transpose(0, 1, 3, 2, 4, 5).reshape(b, (h // patch_size) * (w // patch_size), patch_size ** 2 * c)


class ImageClassifier(nn.Module):
  """``pixel_values [B, H, W, C] -> logits [B, num_classes]`` (float32): the patches' linear embedding
  (``patch_embedding``, ViT's strided convolution as one dense layer, N(0, 0.02) as Hugging Face's ``ViTModel``), a
  class token (``pooling="cls"``), the stack over them with their grid positions, the pooled final state and a
  linear ``classifier``. Any image whose sides are
  multiples of ``patch_size`` runs: a larger one is a larger grid (a 1-D learned table past its ``max_len`` is an
  error; ``absolute_2d`` reads another grid after :attr:`posjax.positions.base.Method.regrid`)."""

  config: TransformerConfig
  patch_size: int
  num_classes: int
  pooling: str = "cls"

  @nn.compact
  def __call__(self, pixel_values, deterministic: bool = True):
    c = self.config
    base.check_choice("pooling", self.pooling, POOLINGS)
    if not isinstance(self.patch_size, int) or self.patch_size <= 0:
      raise ValueError(f"patch_size must be a positive int, got {self.patch_size!r}")
    patches_BxNxP = patches(pixel_values, self.patch_size)
    rows, cols = pixel_values.shape[1] // self.patch_size, pixel_values.shape[2] // self.patch_size
    method, grid = c.position_spec.method, getattr(c.position_spec.options, "grid", None)
    if method.regrid is not None and grid != (rows, cols):
      raise ValueError(f"position method {method.name!r} holds a table of grid={grid} patches and this image has "
                       f"{rows} x {cols}: read it through posjax.models.vision.regridded(config, params, ({rows}, "
                       f"{cols}))")
    dtype, param_dtype = DTYPES[c.dtype], DTYPES[c.param_dtype]
    x_BxNxE = nn.Dense(c.embed_width, dtype=dtype, param_dtype=param_dtype, name="patch_embedding",
                       kernel_init=base.normal_init((None, base.EMBED)),
                       bias_init=base.zeros_init((base.EMBED,)))(patches_BxNxP)
    class_token = self.pooling == "cls"
    if class_position(c) != 0 and (not class_token or c.position_schedule):
      raise ValueError(f"absolute_2d's class_row is read by a class token at (-1, -1): it needs pooling='cls' (not "
                       f"{self.pooling!r}) and no position_schedule (its methods would read that position; "
                       f"{c.position_schedule!r})")
    if class_token:
      token_1x1xE = self.param("class_token", base.zeros_init((None, None, base.EMBED)), (1, 1, c.embed_width),
                               param_dtype)
      x_BxNxE = jnp.concatenate([jnp.broadcast_to(token_1x1xE.astype(x_BxNxE.dtype),
                                                  (x_BxNxE.shape[0], 1, c.embed_width)), x_BxNxE], 1)
    positions = grid_positions(method.axes, rows, cols, class_token, class_position(c))
    h_BxLxD = TransformerStack(c, name="encoder")(inputs_embeds=x_BxNxE, positions=positions,
                                                  deterministic=deterministic).last_hidden_state
    pooled_BxD = h_BxLxD[:, 0] if class_token else h_BxLxD.mean(1)
    return nn.Dense(self.num_classes, dtype=dtype, param_dtype=param_dtype, name="classifier",
                    kernel_init=base.normal_init((base.EMBED, None)),
                    bias_init=base.zeros_init((None,)))(pooled_BxD).astype(jnp.float32)


def regridded(config: TransformerConfig, params, grid: tuple[int, int]):
  """``(config, params)`` of an :class:`ImageClassifier` for images of another ``grid = (rows, columns)`` of patches:
  the method's :attr:`~posjax.positions.base.Method.regrid` applied to its options and its encoder's parameters
  (``encoder/position``; ``params=None``: the config alone) where it has one; unchanged otherwise (``max_len`` too:
  a learned 1-D table stays the size it was trained at, and a longer raster is its error)."""
  spec, grid = config.position_spec, checked_grid(grid)
  if spec.method.regrid is None:
    return config, params
  options, position = spec.method.regrid(spec.options, None if params is None else params["encoder"]["position"],
                                         grid)
  return (dataclasses.replace(config, position_options=options),
          None if params is None else {**params, "encoder": {**params["encoder"], "position": position}})
