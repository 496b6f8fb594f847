"""Rotary positions over several axes: M-RoPE (Qwen2-VL, Wang et al. 2024; Qwen2.5-VL; Qwen3-VL's interleaved
layout; VideoRoPE's allocation, Wei et al. 2025), 2-D axial RoPE and RoPE-Mixed (Heo et al., ECCV 2024,
naver-ai/rope-vit) for images.

Each token has a position on every axis (``[Bp, L, A]``: time, height, width; or row, column) and each rotated pair
of features ``f`` turns by an angle read from them: ``p[axis(f)] · θ_f`` where each frequency belongs to one axis
(M-RoPE, axial), ``Σ_a p[a] · θ_{a,h,f}`` with learned per-head frequencies (RoPE-Mixed). The angles are computed in
float32 as the reference code computes them (one product, or a sum of one product per axis); the inverse frequencies
are RoPE's (``base ** -(2i / d)`` in float32, which may differ from Hugging Face's ``1 / base ** (2i / d)`` in the
last bit); the rotation is RoPE's (:func:`posjax.positions.rotary.rotate`), before any kernel: every kernel
and the decoding cache (keys cached rotated) compute these methods as they compute RoPE.

The state's ``positions`` (what the kernels' terms, the cache and a query temperature read) are the first axis: the
time axis of M-RoPE (a text token's one position), the row of an image.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from posjax.positions import base, rotary

ALLOCATIONS = ("sections", "interleaved", "videorope")


def check_axis_rows(positions_BxLxA, axes: int) -> None:
  """Raises unless ``positions`` is ``[B, L, axes]`` integers."""
  shape, dtype = jnp.shape(positions_BxLxA), jnp.result_type(positions_BxLxA)
  if len(shape) != 3 or shape[2] != axes:
    raise ValueError(f"positions has shape {tuple(shape)}; expected [B, L, {axes}] (a position per axis)")
  if not jnp.issubdtype(dtype, jnp.integer):
    raise ValueError(f"positions has dtype {dtype}; it must hold integers")


def axis_positions(spec: base.PositionSpec, positions):
  """``[Bp, L, A]`` integer ids of the batch's positions as ``spec``'s method of A axes reads them, checked."""
  positions_BxLxA = base.method_positions(spec.method, positions)
  check_axis_rows(positions_BxLxA, spec.method.axes)
  return positions_BxLxA


def default_sections(frequencies: int) -> tuple[int, int, int]:
  """Qwen2-VL's proportions for ``frequencies`` rotated pairs: ``3F/8`` (rounded down) each to height and width, the
  rest to time (``(16, 24, 24)`` at a head of 128)."""
  spatial = 3 * frequencies // 8
  return frequencies - 2 * spatial, spatial, spatial


def frequency_axes(allocation: str, sections, frequencies: int) -> np.ndarray:
  """``[F]`` int: the axis (0 time, 1 height, 2 width) of each of the ``F`` frequencies, highest first.

  ``sections`` (Qwen2-VL's ``mrope_section``, ``(t, h, w)`` summing to F): the first t frequencies are time's, the
  next h height's, the last w width's. ``interleaved`` (Qwen3-VL's ``apply_interleaved_mrope``): frequency f is
  height's where ``f % 3 == 1`` and ``f < 3h``, width's where ``f % 3 == 2`` and ``f < 3w``, time's otherwise (so h
  and w must fit, ``3h <= F + 1`` and ``3w <= F``, which :func:`mrope_frequencies` checks).
  ``videorope`` (VideoRoPE's low-frequency temporal allocation, its ``apply_m_modify_multimodal_rotary_pos_emb``):
  the lowest t frequencies are time's, the others alternate height (even f) and width (odd f), so h and w only
  count together."""
  t, h, w = sections
  f = np.arange(frequencies)
  if allocation == "sections":
    return np.repeat(np.arange(3), (t, h, w))
  if allocation == "interleaved":
    return np.where((f % 3 == 1) & (f < 3 * h), 1, np.where((f % 3 == 2) & (f < 3 * w), 2, 0))
  return np.where(f < frequencies - t, 1 + f % 2, 0)


@flax.struct.dataclass(kw_only=True)
class AxesState(base.PositionState):
  """A multi-axis method's state: ``positions`` (the first axis, ``[Bp, L]``) and every axis, ``[Bp, L, A]``."""

  axis_positions: jax.Array


@dataclasses.dataclass(frozen=True)
class MropeOptions:
  """M-RoPE (Qwen2-VL): RoPE whose frequencies are shared out among time, height and width.

  max_timescale: the rotation base (``rope_theta``; Qwen2-VL's 1,000,000, RoPE's default 10,000 here).
  sections: ``(t, h, w)`` frequencies per axis (``mrope_section``), summing to ``head_dim / 2``; None: Qwen2-VL's
    proportions (:func:`default_sections`; ``(16, 24, 24)`` at a head of 128).
  allocation: ``sections`` (Qwen2-VL, Qwen2.5-VL), ``interleaved`` (Qwen3-VL) or ``videorope`` (VideoRoPE's
    low-frequency temporal allocation): :func:`frequency_axes`.
  layout: RoPE's pairing, ``half`` (the Qwen models') or ``interleaved``.

  Text positions ``[Bp, L]`` are read as that position on the three axes (Qwen2-VL's text ids), where M-RoPE is
  RoPE. Generation after a prompt continues from its largest id + 1 on every axis (Qwen2-VL's and Qwen3-VL's
  ``get_rope_index``), with ``videorope`` from the largest time id + 1 (VideoRoPE's ``get_t_scale_rope_index``: its
  height and width ids run ahead of time). Ids are integers (VideoRoPE's temporal spacing of 2 is; a fractional
  spacing is not representable). [choice] No context-extension scaling (the Qwen-VL models have none).
  """

  max_timescale: float = 10_000.0
  sections: tuple | list | None = None
  allocation: str = "sections"
  layout: str = "half"

  def __post_init__(self):
    base.check_choice("allocation", self.allocation, ALLOCATIONS)
    base.check_choice("layout", self.layout, rotary.LAYOUTS)
    if self.sections is not None:
      if len(self.sections) != 3 or not all(isinstance(s, (int, np.integer)) and s >= 0 for s in self.sections):
        raise ValueError(f"sections={self.sections!r} must be three counts of frequencies >= 0 (time, height, width)")
      object.__setattr__(self, "sections", tuple(int(s) for s in self.sections))


def continuation_axis(options: MropeOptions) -> int | None:
  """The axis whose largest id a continuation after a prompt follows: VideoRoPE's time axis, or None (the largest
  id of every axis)."""
  return 0 if options.allocation == "videorope" else None


def mrope_frequencies(options: MropeOptions, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
  """``(inverse frequencies [F] float32, their axes [F])`` of M-RoPE at ``head_dim`` (``F = head_dim / 2``)."""
  if head_dim % 2:
    raise ValueError(f"mrope needs an even head dimension, got head_dim={head_dim}")
  count = head_dim // 2
  sections = options.sections or default_sections(count)
  if sum(sections) != count:
    raise ValueError(f"mrope's sections {list(sections)} must sum to head_dim / 2 = {count} (one count per axis of "
                     "the rotated frequencies)")
  if options.allocation == "interleaved" and (3 * sections[1] > count + 1 or 3 * sections[2] > count):
    raise ValueError(f"mrope's interleaved layout places height and width at every third of the {count} frequencies: "
                     f"sections {list(sections)} need 3h <= {count + 1} and 3w <= {count}")
  inv_freq = options.max_timescale ** -(np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
  return inv_freq.astype(np.float32), frequency_axes(options.allocation, sections, count)


def axis_angles(positions_BxLxA, inv_freq_F, axes_F):
  """``[B, L, 1, F]`` float32: each frequency's angle at its own axis' position, ``p[axis(f)] · θ_f``."""
  return (jnp.take(positions_BxLxA.astype(jnp.float32), jnp.asarray(axes_F), axis=-1) * inv_freq_F)[:, :, None, :]


class AxesRotation(nn.Module):
  """The encoder-level part of a multi-axis rotation of fixed frequencies (M-RoPE, axial): the sines and cosines of
  every token's angles, once per forward pass."""

  spec: base.PositionSpec

  def frequencies(self) -> tuple[np.ndarray, np.ndarray]:
    raise NotImplementedError

  @nn.compact
  def __call__(self, positions):
    positions_BxLxA = axis_positions(self.spec, positions)
    angle = axis_angles(positions_BxLxA, *self.frequencies())
    return rotary.RotaryState(positions=positions_BxLxA[..., 0], sin=jnp.sin(angle), cos=jnp.cos(angle))


class MropeRotation(AxesRotation):
  """M-RoPE's encoder-level part."""

  def frequencies(self):
    return mrope_frequencies(self.spec.options, self.spec.head_dim)


base.register(base.Method("mrope", MropeOptions, encoder=MropeRotation, layer=rotary.RotateQK, axes=3,
                          sequence_positions=True, continuation_axis=continuation_axis,
                          summary="M-RoPE: RoPE's frequencies shared among time, height and width (Qwen2-VL, "
                                  "Qwen3-VL's interleaved layout, VideoRoPE's allocation)"))


@dataclasses.dataclass(frozen=True)
class Rope2dOptions:
  """2-D axial RoPE (rope-vit's ``compute_axial_cis``): a quarter of a head's features turn with the column, a
  quarter with the row, each at ``θ_i = base^(-4i / d_h)``, ``i < d_h / 4``.

  max_timescale: the base (rope-vit's axial models: 100). layout: ``interleaved`` (rope-vit's complex pairs
  ``2f, 2f+1``; default) or ``half``. Positions are ``(row, column)``; rope-vit's pairs turn with the column first,
  then the row, and its class token is not rotated: position ``(0, 0)`` here, which is the identity.
  """

  max_timescale: float = 100.0
  layout: str = "interleaved"

  def __post_init__(self):
    base.check_choice("layout", self.layout, rotary.LAYOUTS)


def check_quarters(name: str, head_dim: int) -> int:
  """``d_h / 4``: the frequencies of each of two axes, where ``d_h`` is a multiple of 4."""
  if head_dim % 4:
    raise ValueError(f"{name} turns a quarter of each head's features per axis; head_dim={head_dim} must be a "
                     "multiple of 4")
  return head_dim // 4


class Rope2dRotation(AxesRotation):
  """2-D axial RoPE's encoder-level part."""

  def frequencies(self):
    quarter, head_dim = check_quarters("rope_2d", self.spec.head_dim), self.spec.head_dim
    theta = (self.spec.options.max_timescale ** -(np.arange(0, head_dim, 4)[:quarter] / head_dim)).astype(np.float32)
    return np.concatenate([theta, theta]), np.repeat([1, 0], quarter)  # the column's, then the row's


base.register(base.Method("rope_2d", Rope2dOptions, encoder=Rope2dRotation, layer=rotary.RotateQK, axes=2,
                          summary="2-D axial RoPE: features turning with the row and with the column (rope-vit)"))


@dataclasses.dataclass(frozen=True)
class RopeMixedOptions:
  """RoPE-Mixed (Heo et al., ECCV 2024; rope-vit's ``init_random_2d_freqs`` and ``compute_mixed_cis``): every
  layer learns, per head and rotated pair, a frequency for the row and one for the column; the angle is
  ``row · θ_row + column · θ_column``.

  max_timescale: the base of the initial magnitudes ``base^(-4i / d_h)`` (rope-vit's mixed models: 10). Each head
  starts at a random direction ``α``: the column's frequencies ``[m cos α, m cos(α + π/2)]``, the row's
  ``[m sin α, m sin(α + π/2)]`` (rope-vit's ``rotate=True``; ``random_direction=False``: α = 0). layout: as
  :class:`Rope2dOptions`. Positions ``(row, column)``; the class token at ``(0, 0)`` turns by nothing. With grouped
  k/v heads the frequencies are the k/v heads' (a key turns once for the query heads that read it). A layer's
  parameter ``frequencies`` is ``[2 (row, column), G, d_h / 2]``: rope-vit's ``freqs[:, layer]`` (``x``, the column,
  first) reversed along its first axis and reshaped from ``H·d_h/2``. Weight decay skips it, as rope-vit's
  ``no_weight_decay`` does (:func:`posjax.train.step.decays`).
  """

  max_timescale: float = 10.0
  random_direction: bool = True
  layout: str = "interleaved"

  def __post_init__(self):
    base.check_choice("layout", self.layout, rotary.LAYOUTS)


class Axes(nn.Module):
  """The encoder-level part of a method whose layers read every axis (RoPE-Mixed): the positions."""

  spec: base.PositionSpec

  def __call__(self, positions):
    positions_BxLxA = axis_positions(self.spec, positions)
    return AxesState(positions=positions_BxLxA[..., 0], axis_positions=positions_BxLxA)


def mixed_init(head_dim: int, max_timescale: float, random_direction: bool):
  """rope-vit's initial frequencies, ``[2 (row, column), G, d_h / 2]``."""

  def init(key, shape, dtype=jnp.float32):
    _, heads, _ = shape
    quarter = check_quarters("rope_mixed", head_dim)
    magnitude_Q = max_timescale ** -(jnp.arange(0, head_dim, 4)[:quarter] / head_dim)
    alpha_Gx1 = (jax.random.uniform(key, (heads, 1)) * 2 * math.pi if random_direction
                 else jnp.zeros((heads, 1)))
    turn = lambda f: jnp.concatenate([magnitude_Q * f(alpha_Gx1), magnitude_Q * f(alpha_Gx1 + math.pi / 2)], -1)
    return jnp.stack([turn(jnp.sin), turn(jnp.cos)]).astype(dtype)

  return init


class MixedQK(nn.Module):
  """RoPE-Mixed inside each layer: this layer's learned frequencies ``[2, G, d_h / 2]`` (parameter ``frequencies``),
  q and k turned by their tokens' angles."""

  spec: base.PositionSpec

  @nn.compact
  def __call__(self, q, k, state: AxesState, scale):
    spec, o = self.spec, self.spec.options
    frequencies_AxGxF = self.param("frequencies", nn.with_logical_partitioning(
        mixed_init(spec.head_dim, o.max_timescale, o.random_direction), (None, base.KV, None)),
        (2, spec.kv_heads, spec.head_dim // 2), spec.param_dtype)
    p_BxLxA = state.axis_positions.astype(jnp.float32)
    f_AxGxF = frequencies_AxGxF.astype(jnp.float32)
    angle_BxLxGxF = p_BxLxA[..., 0, None, None] * f_AxGxF[0] + p_BxLxA[..., 1, None, None] * f_AxGxF[1]
    sin_k, cos_k = jnp.sin(angle_BxLxGxF), jnp.cos(angle_BxLxGxF)
    group = spec.num_heads // spec.kv_heads
    sin_q, cos_q = (jnp.repeat(x, group, axis=2) for x in (sin_k, cos_k))
    return base.LayerTerms(rotary.rotate(q, sin_q, cos_q, o.layout), rotary.rotate(k, sin_k, cos_k, o.layout))


base.register(base.Method("rope_mixed", RopeMixedOptions, encoder=Axes, layer=MixedQK, axes=2,
                          summary="RoPE-Mixed: learned per-head row and column frequencies in every layer "
                                  "(Heo et al. 2024)"))
