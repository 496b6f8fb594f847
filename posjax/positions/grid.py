"""Input embeddings over a grid of ``(row, column)`` positions, for images: MAE's 2-D sinusoids (He et al. 2022,
``get_2d_sincos_pos_embed``) and ViT's learned table (Dosovitskiy et al. 2021), read at a larger grid after
:func:`resized_table` (DeiT's and timm's practice: the table interpolated to the new grid)."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

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


RESIZES = ("keys", "torch")
CLASS_POSITION = -1  # where a class token reads the table's class row (``class_row=True``), on both axes


@dataclasses.dataclass(frozen=True)
class Table2dOptions:
  """ViT's learned table of ``grid = (rows, columns)`` positions (N(0, 0.02), as ViT's ``trunc_normal_(std=.02)``),
  read at each token's ``(row, column)``; a position outside it is NaN, never a clamped row. A larger image reads the
  table resized to its grid (:func:`resized_table`).

  class_row: a learned row of its own for the class token, read at position ``(-1, -1)`` (ViT's flattened
  ``[1 + N, D]`` table's first row; :class:`posjax.models.vision.ImageClassifier` puts its class token there);
  [choice] False: the class token reads patch ``(0, 0)``'s entry. resize: the bicubic kernel of a resize, ``keys``
  ([choice] JAX's, Keys' ``a = -0.5``) or ``torch`` (PyTorch's ``F.interpolate(mode="bicubic", align_corners=False)``,
  ``a = -0.75``, the border rows repeated: timm's, DeiT's, DINO's and Hugging Face ViT's ``interpolate_pos_encoding``).
  """

  grid: tuple | list = (14, 14)
  class_row: bool = False
  resize: str = "keys"

  def __post_init__(self):
    object.__setattr__(self, "grid", checked_grid(self.grid))
    base.check_choice("resize", self.resize, RESIZES)


def checked_grid(grid) -> tuple[int, int]:
  """``grid`` as ``(rows, columns)``; anything but two positive ints is an error that says so."""
  if not isinstance(grid, (tuple, list)) or len(grid) != 2 or not all(
      isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in grid):
    raise ValueError(f"grid={grid!r} must be two positive counts (rows, columns)")
  return tuple(grid)


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
    table_NxD = table_RxCxD.reshape(rows * cols, -1)
    inside_BxL = (row_BxL >= 0) & (row_BxL < rows) & (col_BxL >= 0) & (col_BxL < cols)
    flat_BxL = jnp.where(inside_BxL, row_BxL * cols + col_BxL, -1)  # outside the grid: NaN (base.lookup)
    if self.spec.options.class_row:
      class_1xD = self.param("class_embedding", base.normal_init((None, base.EMBED)), (1, self.spec.input_width),
                             self.spec.param_dtype)
      table_NxD = jnp.concatenate([table_NxD, class_1xD])
      flat_BxL = jnp.where((row_BxL == CLASS_POSITION) & (col_BxL == CLASS_POSITION), rows * cols, flat_BxL)
    embedding = base.lookup(table_NxD, flat_BxL)
    # the class row's token is at 0 for what reads the state's positions (a query temperature)
    return base.PositionState(positions=jnp.maximum(row_BxL, 0) if self.spec.options.class_row else row_BxL,
                              embedding=embedding.astype(self.spec.dtype))


def resized_table(table_RxCxD, rows: int, cols: int, resize: str = "keys"):
  """The learned table interpolated to a ``rows x cols`` grid (bicubic, corners not aligned; ``resize``: the kernel,
  :class:`Table2dOptions`'): the parameter a model at another resolution reads (``grid`` set to ``(rows, cols)``)."""
  base.check_choice("resize", resize, RESIZES)
  if resize == "keys":
    return jax.image.resize(table_RxCxD, (rows, cols, table_RxCxD.shape[-1]), "bicubic", antialias=False)
  weights_RxS, weights_CxT = torch_bicubic(table_RxCxD.shape[0], rows), torch_bicubic(table_RxCxD.shape[1], cols)
  return jnp.einsum("rs,std,ct->rcd", weights_RxS, table_RxCxD.astype(jnp.float32), weights_CxT,
                    precision="highest").astype(table_RxCxD.dtype)


def torch_bicubic(size: int, new_size: int) -> np.ndarray:
  """``[new_size, size]``: PyTorch's bicubic resize along one axis as a matrix (``align_corners=False``: source
  ``(i + 0.5) size / new_size - 0.5``; the cubic convolution kernel with ``a = -0.75``; indices past a border read the
  border)."""
  a = -0.75
  near = lambda x: ((a + 2) * x - (a + 3)) * x * x + 1  # |x| <= 1
  far = lambda x: ((a * x - 5 * a) * x + 8 * a) * x - 4 * a  # 1 < |x| < 2
  source = (np.arange(new_size) + 0.5) * size / new_size - 0.5
  first, t = np.floor(source).astype(int), source - np.floor(source)
  weights = np.zeros((new_size, size))
  for offset, w in zip((-1, 0, 1, 2), (far(t + 1), near(t), near(1 - t), far(2 - t))):
    np.add.at(weights, (np.arange(new_size), np.clip(first + offset, 0, size - 1)), w)
  return weights.astype(np.float32)


def regrid_table(options: Table2dOptions, params, grid: tuple[int, int]):
  """``absolute_2d``'s options and parameters (None: none to resize) at another grid: the table resized to it
  (:func:`resized_table`)."""
  rows, cols = checked_grid(grid)
  resized = None if params is None else resized_table(params["embedding"], rows, cols, options.resize)
  options = {**dataclasses.asdict(options), "grid": (rows, cols)}
  return options, None if params is None else {**params, "embedding": resized}  # a class row stays as it is


base.register(base.Method("absolute_2d", Table2dOptions, encoder=Table2d, axes=2, input_embedding=True,
                          regrid=regrid_table,
                          summary="ViT's learned 2-D position table added to the input, resized for larger "
                                  "images"))
