"""Input embeddings over a grid of ``(row, column)`` positions, for images: MAE's 2-D sinusoids (He et al. 2022,
``get_2d_sincos_pos_embed``) and ViT's learned table (Dosovitskiy et al. 2021), read at a larger grid after
:func:`resized_table` (DeiT's and timm's practice: the table interpolated to the new grid)."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from posjax.positions import base
from posjax.positions.multi_axis import axis_positions


@dataclasses.dataclass(frozen=True)
class Sinusoidal2dOptions:
  """MAE's 2-D sinusoids: half the width encodes the column, half the row, each as ``[sin(p ω_i), cos(p ω_i)]``,
  ``ω_i = max_timescale^(-i / (D/4))`` (MAE's ``get_1d_sincos_pos_embed_from_grid`` on each half; its meshgrid puts
  the column first). scale: the factor on them (MAE's 1).
  """

  max_timescale: float = 10_000.0
  scale: float = 1.0


def sincos(positions, width: int, max_timescale: float):
  """``[..., width]``: ``[sin(p ω), cos(p ω)]`` over ``width / 2`` frequencies ``ω_i = T^(-i / (width/2))``."""
  omega_F = max_timescale ** -(jnp.arange(width // 2, dtype=jnp.float32) / (width // 2))
  angle = positions.astype(jnp.float32)[..., None] * omega_F
  return jnp.concatenate([jnp.sin(angle), jnp.cos(angle)], -1)


class Sinusoidal2d(nn.Module):
  """MAE's fixed 2-D sinusoids, added to the input embedding."""

  spec: base.PositionSpec

  def __call__(self, positions):
    positions_BxLx2 = axis_positions(self.spec, positions)
    width, o = self.spec.input_width, self.spec.options
    if width % 4:
      raise ValueError(f"sinusoidal_2d splits the width in four (sines and cosines of the row and the column); "
                       f"{width} is not a multiple of 4")
    pe = jnp.concatenate([sincos(positions_BxLx2[..., 1], width // 2, o.max_timescale),
                          sincos(positions_BxLx2[..., 0], width // 2, o.max_timescale)], -1)
    return base.PositionState(positions=positions_BxLx2[..., 0], embedding=(o.scale * pe).astype(self.spec.dtype))


base.register(base.Method("sinusoidal_2d", Sinusoidal2dOptions, encoder=Sinusoidal2d, axes=2, input_embedding=True,
                          summary="2-D sinusoids of the row and the column added to the input (MAE)"))


@dataclasses.dataclass(frozen=True)
class Table2dOptions:
  """ViT's learned table of ``grid = (rows, columns)`` positions (N(0, 0.02), as ViT's ``trunc_normal_(std=.02)``),
  read at each token's ``(row, column)``; a position outside it is NaN, never a clamped row. A larger image reads the
  table resized to its grid (:func:`resized_table`).
  """

  grid: tuple | list = (14, 14)

  def __post_init__(self):
    if len(self.grid) != 2 or not all(isinstance(n, int) and n > 0 for n in self.grid):
      raise ValueError(f"grid={self.grid!r} must be two positive counts (rows, columns)")
    object.__setattr__(self, "grid", tuple(self.grid))


class Table2d(nn.Module):
  """A learned 2-D position table (parameter ``embedding`` ``[rows, columns, D]``), added to the input."""

  spec: base.PositionSpec

  @nn.compact
  def __call__(self, positions):
    positions_BxLx2 = axis_positions(self.spec, positions)
    rows, cols = self.spec.options.grid
    table_RxCxD = self.param("embedding", base.normal_init((None, None, base.EMBED)),
                             (rows, cols, self.spec.input_width), self.spec.param_dtype)
    row_BxL, col_BxL = positions_BxLx2[..., 0], positions_BxLx2[..., 1]
    inside_BxL = (col_BxL >= 0) & (col_BxL < cols)
    flat_BxL = jnp.where(inside_BxL, row_BxL * cols + col_BxL, -1)  # outside the grid: NaN (base.lookup)
    embedding = base.lookup(table_RxCxD.reshape(rows * cols, -1), flat_BxL)
    return base.PositionState(positions=row_BxL, embedding=embedding.astype(self.spec.dtype))


def resized_table(table_RxCxD, rows: int, cols: int):
  """The learned table interpolated to a ``rows x cols`` grid (bicubic, corners not aligned; [choice] JAX's cubic
  kernel, Keys' ``a = -0.5``, where PyTorch's ``F.interpolate(mode="bicubic")``, which DeiT and timm use, has
  ``a = -0.75``): the parameter a model at another resolution reads (``grid`` set to ``(rows, cols)``)."""
  return jax.image.resize(table_RxCxD, (rows, cols, table_RxCxD.shape[-1]), "bicubic", antialias=False)


def regrid_table(options: Table2dOptions, params, grid: tuple[int, int]):
  """``absolute_2d``'s options and parameters (None: none to resize) at another grid: the table resized to it
  (:func:`resized_table`)."""
  rows, cols = grid
  options = {**dataclasses.asdict(options), "grid": (rows, cols)}
  return options, None if params is None else {**params, "embedding": resized_table(params["embedding"], rows, cols)}


base.register(base.Method("absolute_2d", Table2dOptions, encoder=Table2d, axes=2, input_embedding=True,
                          regrid=regrid_table,
                          summary="ViT's learned 2-D position table added to the input, resized for larger "
                                  "images"))
