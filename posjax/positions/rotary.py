"""RoPE (Su et al. 2021): rotate q and k by angles proportional to their positions, in every layer.

``q_i·k_j`` after rotation depends on positions only through ``p_j - p_i``. Rotation pairs feature ``d``
with feature ``d + d_h/2`` (the GPT-NeoX / Llama layout, ``layout="half"``) or neighbouring features ``2f, 2f+1``
(GPT-J's, ``layout="interleaved"``); a fraction of each head's features may rotate (GPT-NeoX's ``rotary_pct``), and
the lowest frequencies may be dropped (p-RoPE).
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from posjax.positions import base

SCALINGS = ("none", "linear", "dynamic", "yarn", "llama3", "longrope")
LAYOUTS = ("half", "interleaved")
LENGTH_DEPENDENT = ("dynamic", "longrope")  # scalings that read the length (token_frequencies)


@dataclasses.dataclass(frozen=True)
class RopeOptions:
  """RoPE's base and the context-extension scalings, with Hugging Face's ``rope_scaling`` names and defaults
  (``transformers.modeling_rope_utils``; its ``rope_type`` is ``scaling`` here):

  max_timescale: the rotation base, ``rope_theta`` (10,000 in the paper).
  scaling: ``none`` (default) | ``linear`` (position interpolation, Chen et al. 2023: frequencies / factor) |
    ``dynamic`` (NTK-aware: the base grows with the length, a row's largest position + 1, past ``max_len``) | ``yarn`` (Peng et al.
    2023: per-frequency ramp between interpolation and extrapolation, cos/sin times an attention factor) | ``llama3``
    (Llama 3.1: long wavelengths / factor, short ones kept, a smooth ramp between).
  factor: the extension factor (1 with ``none``).
  original_max_len: the length the model was trained at (``original_max_position_embeddings``); None: the model's
    ``max_len`` (Hugging Face's ``max_position_embeddings``). ``llama3`` needs it; ``dynamic`` takes none (Hugging
    Face's grows the base from ``max_position_embeddings``, the model's ``max_len``, whatever this key says).
  beta_fast, beta_slow, mscale, mscale_all_dim, attention_factor, truncate: YaRN's keys (defaults 32, 1, None, None,
    None: from the factor, True).
  low_freq_factor, high_freq_factor: Llama 3.1's keys (its defaults 1 and 4).
  short_factor, long_factor: LongRoPE's per-frequency divisors (Ding et al. 2024; Hugging Face's ``longrope``, Phi-3):
    ``d_r/2`` each, the long ones where the length (below) passes ``original_max_len`` (default the model's
    ``max_len``); the attention factor is ``attention_factor`` or ``sqrt(1 + log(factor) / log(original_max_len))``
    (1 at ``factor`` 1), as Hugging Face's.
  rotary_fraction: the fraction of each head's features that rotate, the first ``d_r = int(d_h * fraction)`` (even;
    the rest pass unchanged): Hugging Face's ``partial_rotary_factor``, GPT-NeoX's ``rotary_pct``; 1: all.
  layout: ``half`` (rotate-half: feature f pairs with f + d_r/2; Llama, GPT-NeoX) or ``interleaved`` (f pairs
    2f with 2f+1: GPT-J, the paper's, Meta's original Llama code).
  frequency_fraction: p-RoPE (Barbero et al. 2024, "Round and Round We Go"): only the highest ``int(p · d_r/2)``
    frequencies rotate, the lowest are set to 0 (those features carry no position); 1: every frequency.

  ``dynamic`` and ``longrope`` depend on the length: as Hugging Face's (``dynamic_rope_update``), the length of a
  forward pass is its largest position + 1: a left-padded prompt's last position + 1 and, in a decode step, the new
  token's position + 1. [choice] posjax takes it per run of positions (a row, or each packed document: a run starts
  at each position 0), where Hugging Face takes it over the whole batch: the same for one row or rows of equal
  length, and a packed document or a batched prompt then gets what it would alone, whatever is beside it. Decoding
  caches keys already rotated, so each key keeps the frequencies of the step that wrote it: with ``dynamic`` past
  ``max_len`` (and ``longrope`` when a prompt shorter than ``original_max_len`` grows past it) generation is not
  the full forward over the same tokens, as in Hugging Face's Llama-family ``generate`` (Phi-3's recomputes the
  cache when it crosses ``original_max_len``; posjax does not).
  """

  max_timescale: float = 10_000.0
  scaling: str = "none"
  factor: float = 1.0
  original_max_len: int | None = None
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  mscale: float | None = None
  mscale_all_dim: float | None = None
  attention_factor: float | None = None
  truncate: bool = True
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  short_factor: tuple | list | None = None
  long_factor: tuple | list | None = None
  rotary_fraction: float = 1.0
  layout: str = "half"
  frequency_fraction: float = 1.0

  def __post_init__(self):
    base.check_choice("scaling", self.scaling, SCALINGS)
    base.check_choice("layout", self.layout, LAYOUTS)
    for name in ("short_factor", "long_factor"):  # hashable, whatever the config gave
      value = getattr(self, name)
      if value is not None:
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in value):
          raise ValueError(f"{name} must be positive numbers, one per rotated frequency; got {value!r}")
        object.__setattr__(self, name, tuple(float(x) for x in value))
    if (self.scaling == "longrope") != (self.short_factor is not None and self.long_factor is not None):
      raise ValueError("short_factor and long_factor go with scaling='longrope', and it needs both"
                       f" (scaling={self.scaling!r})")
    if not 0.0 < self.rotary_fraction <= 1.0:
      raise ValueError(f"rotary_fraction={self.rotary_fraction} must be in (0, 1]")
    if not 0.0 <= self.frequency_fraction <= 1.0:
      raise ValueError(f"frequency_fraction={self.frequency_fraction} must be in [0, 1]")
    if self.scaling == "none" and self.factor != 1.0:
      raise ValueError(f"factor={self.factor} needs a scaling ({', '.join(SCALINGS[1:])}); with scaling='none' it "
                       "must be 1")
    if self.scaling != "none" and not self.factor >= 1.0:
      raise ValueError(f"factor={self.factor} must be >= 1 with scaling={self.scaling!r}")
    if self.original_max_len is not None and self.original_max_len < 1:
      raise ValueError(f"original_max_len={self.original_max_len} must be >= 1 (or None for the model's max_len)")
    if self.scaling == "dynamic" and self.original_max_len is not None:
      raise ValueError("scaling='dynamic' grows the base from the model's max_len (Hugging Face's "
                       "max_position_embeddings); original_max_len must be None")
    if self.scaling == "llama3":
      if self.original_max_len is None:
        raise ValueError("scaling='llama3' needs original_max_len (Llama 3.1: 8192)")
      if not 0 < self.low_freq_factor < self.high_freq_factor:
        raise ValueError(f"llama3 needs 0 < low_freq_factor < high_freq_factor, got {self.low_freq_factor} and "
                         f"{self.high_freq_factor}")


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
  return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rotary_dim(options: RopeOptions, head_dim: int) -> int:
  """``d_r``: the features of a head that rotate (``rotary_fraction``; Hugging Face's ``int(d_h * factor)``)."""
  dim = int(head_dim * options.rotary_fraction)
  if dim % 2 or dim < 2:
    raise ValueError(f"rope rotates {dim} of head_dim={head_dim} features (rotary_fraction={options.rotary_fraction})"
                     "; that must be even and at least 2")
  return dim


def frequencies(options: RopeOptions, head_dim: int, max_len: int, length: int) -> tuple[np.ndarray, float]:
  """``(inverse frequencies [d/2] float32, attention factor)`` of the options at a batch of ``length`` tokens for
  ``d = head_dim`` rotated features (``max_len``: the model's, the default ``original_max_len``); the factor
  multiplies cos and sin. p-RoPE's zeroed frequencies are :func:`rotation`'s."""
  if head_dim % 2:
    raise ValueError(f"rope needs an even head dimension, got head_dim={head_dim}")
  o, theta = options, float(options.max_timescale)
  original = o.original_max_len or max_len
  exponent = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
  inv_freq = theta ** -exponent
  factor = 1.0
  if o.scaling == "linear":
    inv_freq = inv_freq / o.factor
  elif o.scaling == "dynamic":
    grown = theta * (o.factor * max(length, original) / original - (o.factor - 1)) ** (head_dim / (head_dim - 2))
    inv_freq = grown ** -exponent
  elif o.scaling == "yarn":
    factor = o.attention_factor
    if factor is None:
      factor = (_yarn_mscale(o.factor, o.mscale) / _yarn_mscale(o.factor, o.mscale_all_dim)
                if o.mscale and o.mscale_all_dim else _yarn_mscale(o.factor))
    dim_at = lambda rotations: head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = dim_at(o.beta_fast), dim_at(o.beta_slow)
    if o.truncate:
      low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = np.clip((np.arange(head_dim // 2) - low) / ((high + 0.001 if low == high else high) - low), 0, 1)
    inv_freq = inv_freq / o.factor * ramp + inv_freq * (1 - ramp)
  elif o.scaling == "llama3":
    wavelength = 2 * math.pi / inv_freq
    smooth = (original / wavelength - o.low_freq_factor) / (o.high_freq_factor - o.low_freq_factor)
    scaled = np.where(wavelength > original / o.low_freq_factor, inv_freq / o.factor, inv_freq)
    medium = (wavelength >= original / o.high_freq_factor) & (wavelength <= original / o.low_freq_factor)
    inv_freq = np.where(medium, (1 - smooth) * scaled / o.factor + smooth * scaled, scaled)
  elif o.scaling == "longrope":
    ext = np.asarray(o.long_factor if length > original else o.short_factor, np.float64)
    if ext.shape != inv_freq.shape:
      raise ValueError(f"longrope's short_factor and long_factor need {len(inv_freq)} entries (one per rotated "
                       f"frequency), got {len(o.short_factor)} and {len(o.long_factor)}")
    inv_freq = 1.0 / (ext * theta ** exponent)
    factor = o.attention_factor
    if factor is None:
      factor = 1.0 if o.factor <= 1.0 else math.sqrt(1 + math.log(o.factor) / math.log(original))
  return inv_freq.astype(np.float32), float(factor)


def run_lengths(positions_BxL):
  """``[B, L]`` int32: each token's length as Hugging Face reads it, its run's largest position + 1, a run starting
  at each position 0 (a packed document; a left-padded prompt, each pad at position 0 a run of its own): two
  segmented max-scans, to the run's end and back to its start."""
  p_BxL = jnp.asarray(positions_BxL).astype(jnp.int32)
  start_BxL = p_BxL == 0
  last_BxL = jnp.concatenate([start_BxL[:, 1:], jnp.ones_like(start_BxL[:, :1])], axis=1)

  def segmented_max(a, b):  # b follows a in the scan's order; a segment starts where b's flag is set
    return jnp.where(b[1], b[0], jnp.maximum(a[0], b[0])), a[1] | b[1]

  to_end_BxL, _ = jax.lax.associative_scan(segmented_max, (p_BxL, last_BxL), reverse=True, axis=1)
  run_BxL, _ = jax.lax.associative_scan(segmented_max, (to_end_BxL, start_BxL), axis=1)
  return run_BxL + 1


def token_frequencies(options: RopeOptions, dim: int, max_len: int, positions_BxL):
  """``[B, L, 1, d/2]`` float32: each token's inverse frequencies under a length-dependent scaling (``dynamic``,
  ``longrope``) at its :func:`run_lengths` (traced: one program for every length), so a packed document gets what it
  would alone. ``dynamic`` in float32 in Hugging Face's order of operations; ``longrope``: :func:`frequencies`'
  short or long factors."""
  length_BxLx1 = run_lengths(positions_BxL)[..., None]
  o, original = options, options.original_max_len or max_len
  if o.scaling == "longrope":
    short_F, long_F = (frequencies(o, dim, max_len, n)[0] for n in (original, original + 1))
    inv_freq_BxLxF = jnp.where(length_BxLx1 > original, long_F, short_F)
  else:
    length_BxLx1 = jnp.maximum(length_BxLx1, original).astype(jnp.float32)
    grown_BxLx1 = o.max_timescale * (o.factor * length_BxLx1 / original - (o.factor - 1)) ** (dim / (dim - 2))
    inv_freq_BxLxF = 1.0 / grown_BxLx1 ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
  return inv_freq_BxLxF[:, :, None, :]


def rotation(positions_BxL, head_dim: int, options: RopeOptions = RopeOptions(), max_len: int | None = None):
  """``(sin, cos)``, each ``[B, L, 1, d_r/2]``: the angles ``p · inv_freq`` (:func:`frequencies` of the ``d_r``
  rotated features; :func:`token_frequencies` per token for ``dynamic`` and ``longrope``), times the attention factor of
  YaRN and LongRoPE; p-RoPE's lowest frequencies 0."""
  base.check_rows("positions", positions_BxL)
  length = positions_BxL.shape[-1]
  dim = rotary_dim(options, head_dim) if options.rotary_fraction != 1.0 else head_dim
  if options.scaling == "none":  # the paper's frequencies, computed as they always were
    if dim % 2:
      raise ValueError(f"rope needs an even head dimension, got head_dim={head_dim}")
    inv_freq, factor = options.max_timescale ** (-jnp.arange(0, dim, 2, dtype=jnp.float32) / dim), 1.0
  elif options.scaling in LENGTH_DEPENDENT:
    inv_freq, factor = token_frequencies(options, dim, max_len or length, positions_BxL), frequencies(
        options, dim, max_len or length, 1)[1]
  else:
    inv_freq, factor = frequencies(options, dim, max_len or length, length)
  if options.frequency_fraction != 1.0:  # p-RoPE: the highest frequencies come first
    kept = int(options.frequency_fraction * (dim // 2))
    inv_freq = jnp.where(jnp.arange(dim // 2) < kept, jnp.asarray(inv_freq, jnp.float32), 0.0)
  angle = positions_BxL.astype(jnp.float32)[..., None, None] * inv_freq
  if factor == 1.0:
    return jnp.sin(angle), jnp.cos(angle)
  return jnp.sin(angle) * factor, jnp.cos(angle) * factor


def rotate(x_BxLxHxK, sin, cos, layout: str = "half"):
  """RoPE's rotation of each pair of features by the position's angles (float32 inside): the first ``2 F`` features
  for angles of ``F`` frequencies, the rest unchanged (partial rotary); pairs ``(f, f + F)`` (``half``) or
  ``(2f, 2f + 1)`` (``interleaved``)."""
  rotated = 2 * sin.shape[-1]
  x_BxLxHxR, rest = x_BxLxHxK[..., :rotated].astype(jnp.float32), x_BxLxHxK[..., rotated:]
  if layout == "interleaved":
    x1, x2 = x_BxLxHxR[..., 0::2], x_BxLxHxR[..., 1::2]
    out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(x_BxLxHxR.shape)
  else:
    x1, x2 = jnp.split(x_BxLxHxR, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  out = out.astype(x_BxLxHxK.dtype)
  return out if rest.shape[-1] == 0 else jnp.concatenate([out, rest], axis=-1)


@flax.struct.dataclass(kw_only=True)
class RotaryState(base.PositionState):
  """RoPE's state: the angles' sines and cosines, each ``[Bp, L, 1, d_r/2]``."""

  sin: jax.Array
  cos: jax.Array


class Rotation(nn.Module):
  """RoPE's encoder-level part: the sines and cosines of every position, computed once per forward pass."""

  spec: base.PositionSpec

  @nn.compact
  def __call__(self, positions_BxL):
    sin, cos = rotation(positions_BxL, self.spec.head_dim, self.spec.options, self.spec.max_len)
    return RotaryState(positions=positions_BxL, sin=sin, cos=cos)


class RotateQK(nn.Module):
  """RoPE inside each attention layer: q and k rotated by their positions' angles."""

  spec: base.PositionSpec

  @nn.compact
  def __call__(self, q, k, state: RotaryState, scale):
    layout = self.spec.options.layout
    return base.LayerTerms(rotate(q, state.sin, state.cos, layout), rotate(k, state.sin, state.cos, layout))


base.register(base.Method("rope", RopeOptions, encoder=Rotation, layer=RotateQK,
                          summary="rotary embedding of q and k (Su et al. 2021); linear / dynamic / YaRN / Llama 3 / "
                                  "LongRoPE scaling, partial, interleaved, p-RoPE"))


@dataclasses.dataclass(frozen=True)
class XposOptions:
  """xPos (Sun et al. 2023, "A Length-Extrapolatable Transformer"): RoPE whose pair ``f`` is also scaled by
  ``ζ_f^(n/γ)`` on the query at position n and ``ζ_f^(-m/γ)`` on the key at m, so their product decays as
  ``ζ_f^((n - m)/γ)``, ``ζ_f = (2f/d_h + gamma) / (1 + gamma)``.

  max_timescale: the rotation base (10,000). scale_base: γ (512). gamma: 0.4. The official code (torchscale's
  ``XPOS``) centres the positions at the length's middle before the powers (the product is the same, the factors
  stay near 1). centre: where posjax centres them: ``max_len`` (default: the model's ``max_len // 2`` for every
  call, so a decoding cache's keys, scaled once, meet each new query at the same centre) or ``length`` (the
  batch's ``L // 2``, torchscale's; not for decoding with a cache). Meant for decoders: in an encoder the keys
  after a query grow instead of decaying. The rotation pairs feature ``f`` with ``f + d_h/2``, as posjax's RoPE (torchscale interleaves
  neighbouring features: a permutation of the head's features, the same model up to it).
  """

  max_timescale: float = 10_000.0
  scale_base: float = 512.0
  gamma: float = 0.4
  centre: str = "max_len"

  def __post_init__(self):
    if not self.scale_base > 0 or not self.gamma > 0:
      raise ValueError(f"scale_base={self.scale_base} and gamma={self.gamma} must be positive")
    base.check_choice("centre", self.centre, ("max_len", "length"))


@flax.struct.dataclass(kw_only=True)
class XposState(RotaryState):
  """xPos's state: RoPE's angles and the queries' decay ``ζ^((p - c)/γ)`` (c: ``XposOptions.centre``),
  ``[Bp, L, 1, d_h/2]`` (the keys' is its inverse)."""

  decay: jax.Array


class XposRotation(nn.Module):
  """xPos's encoder-level part: the angles and the decay of every position."""

  spec: base.PositionSpec

  @nn.compact
  def __call__(self, positions_BxL):
    spec, o = self.spec, self.spec.options
    sin, cos = rotation(positions_BxL, spec.head_dim, RopeOptions(max_timescale=o.max_timescale))
    zeta_F = (jnp.arange(0, spec.head_dim, 2, dtype=jnp.float32) / spec.head_dim + o.gamma) / (1.0 + o.gamma)
    centre = spec.max_len // 2 if o.centre == "max_len" else positions_BxL.shape[-1] // 2
    centred_BxL = (positions_BxL - centre).astype(jnp.float32)
    decay = zeta_F ** (centred_BxL[..., None, None] / o.scale_base)
    return XposState(positions=positions_BxL, sin=sin, cos=cos, decay=decay)


class XposQK(nn.Module):
  """xPos inside each attention layer: q and k rotated, q scaled by the decay, k by its inverse."""

  spec: base.PositionSpec

  @nn.compact
  def __call__(self, q, k, state: XposState, scale):
    scaled = lambda x_BxLxHxK, factor: (x_BxLxHxK.astype(jnp.float32) * jnp.concatenate([factor, factor], -1)
                                        ).astype(x_BxLxHxK.dtype)
    return base.LayerTerms(scaled(rotate(q, state.sin, state.cos), state.decay),
                           scaled(rotate(k, state.sin, state.cos), 1.0 / state.decay))


base.register(base.Method("xpos", XposOptions, encoder=XposRotation, layer=XposQK,
                          summary="xPos: RoPE with a per-frequency decay of the distance (Sun et al. 2023; decoders)"))
