"""TUPE (Ke, He, Liu; ICLR 2021): untied positional correlation with [CLS] untying, and BERT-A^d.

TUPE-A logit, per head (Ke, He, Liu 2021, §3)::

    α_ij = (x_i W^Q)(x_j W^K)^T / sqrt(2 d_h) + reset_θ( (p_i U^Q)(p_j U^K)^T / sqrt(2 d_h) [+ b_{j-i}] )

The bracketed T5 relative bias makes TUPE-R. No position embedding is added at the input. ``p`` is one
learned table (LayerNorm-ed), ``U^Q``/``U^K`` one pair for the whole encoder, so the positional term is
an ``[H, L, L]`` bias computed once per forward pass (``share_across_layers=False`` gives every layer
its own ``U``, ``θ`` and ``b``, an ablation the paper never ran; ``p`` and its LayerNorm stay shared).

[CLS] untying treats every token at position 0 as a [CLS] (the first token of each packed segment):
its row of the positional term becomes θ1 ("[CLS] to others", including [CLS]->[CLS]) and the rest of
its column θ2 ("others to [CLS]"), one scalar per head. ``cls_reset``:

- ``official`` (default, the code the paper's numbers come from, needed to convert its checkpoints):
  the table has ``max_len + 1`` rows and the token at position t reads row t+1; θ1 is the self-correlation
  of row 0 and θ2 that of row 1. With a relative term, b is *added* to θ through two extra table entries
  (bucket ``num_buckets // 2``, never produced by the bidirectional buckets, for the row, and a
  ``num_buckets``-th row for the column; with clipping, two rows after the ``2c+1`` distances).
- ``paper`` (Eq. 9 and Appendix B): θ1, θ2 are self-correlations of two extra learned vectors through
  the same LayerNorm and ``U``; they replace the whole positional term, relative bias included.
- ``none``: no untying (the TUPE-A tie-cls ablation).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from posjax import kernels
from posjax.positions import absolute, base, t5


@dataclasses.dataclass(frozen=True)
class TupeAOptions:
  """cls_reset: ``official`` (default) | ``paper`` | ``none`` — see the module docstring.
  share_across_layers: one positional term for all layers (True, the paper) or one per layer.
  projection_bias: ``U^Q``/``U^K`` with a bias (True, the official code; the paper's formula has none).
  layernorm: LayerNorm on the position embeddings before the projections (True, the paper and code).
  """

  cls_reset: str = "official"
  share_across_layers: bool = True
  projection_bias: bool = True
  layernorm: bool = True

  def __post_init__(self):
    base.check_choice("cls_reset", self.cls_reset, ("official", "paper", "none"))


@dataclasses.dataclass(frozen=True)
class TupeROptions(TupeAOptions):
  """relative_distance: ``buckets`` (T5 log buckets, the official code; default) or ``clip`` (plain
  clipping at ±max_distance, the paper's footnote). num_buckets / max_distance: as in T5 (32, 128).
  """

  relative_distance: str = "buckets"
  num_buckets: int = 32
  max_distance: int = 128

  def __post_init__(self):
    super().__post_init__()
    base.check_choice("relative_distance", self.relative_distance, ("buckets", "clip"))
    if self.relative_distance == "buckets":
      t5.T5Options(self.num_buckets, self.max_distance, bidirectional=True)
    elif self.max_distance < 1:
      raise ValueError(f"max_distance={self.max_distance} must be >= 1")


def relative_layout(options: TupeROptions) -> tuple[int, int, int]:
  """``(table rows, [CLS]-row entry, [CLS]-column entry)`` of TUPE-R's relative bias table."""
  if options.relative_distance == "buckets":
    return options.num_buckets + 1, options.num_buckets // 2, options.num_buckets
  c = options.max_distance
  return 2 * c + 3, 2 * c + 1, 2 * c + 2


@flax.struct.dataclass(kw_only=True)
class TupeState(base.PositionState):
  """What TUPE's layers read when each computes its own positional term (``share_across_layers=False``): the
  LayerNorm-ed table rows ``p`` ``[Bp, L, D]`` and the [CLS] reset's vectors ``p_theta`` ``[2, D]`` (or None)."""

  p: jax.Array
  p_theta: jax.Array | None = None


class UntiedCorrelation(nn.Module):
  """The positional term from the LayerNorm-ed positions of ``state``, as :class:`posjax.kernels.Terms`: the untied
  term's rank-``d_h`` factors with its [CLS] reset (and TUPE-R's relative table), never an ``[H, L, L]`` tensor."""

  spec: base.PositionSpec

  @nn.compact
  def __call__(self, state: TupeState) -> kernels.Terms:
    spec, opts = self.spec, self.spec.options
    uq = base.head_projection(spec, "query", opts.projection_bias)
    uk = base.head_projection(spec, "key", opts.projection_bias)
    scale = 1.0 / math.sqrt(2 * spec.head_dim)
    theta_2xH = None
    if opts.cls_reset != "none":
      theta_2xH = jnp.einsum("thd,thd->th", uq(state.p_theta), uk(state.p_theta),
                             preferred_element_type=jnp.float32) * scale
    terms = kernels.Terms(untied=kernels.Untied(uq(state.p) * scale, uk(state.p), theta_2xH, reset=opts.cls_reset))
    if isinstance(opts, TupeROptions):
      rows, row, col = relative_layout(opts)
      official = opts.cls_reset == "official"
      terms = terms.replace(buckets=kernels.Buckets(
          t5.BucketTable(spec.num_heads, rows, spec.param_dtype, name="relative_bias")(),
          kind=opts.relative_distance, num_buckets=opts.num_buckets, max_distance=opts.max_distance,
          bidirectional=True, cls_row=row if official else None, cls_col=col if official else None))
    return terms


class Tupe(nn.Module):
  """Encoder-level part: the position table, its LayerNorm, and (when shared) the positional term.

  ``table_from``: another encoder's :class:`Tupe` whose table and LayerNorm (and paper-reset vectors) this one
  reads instead of its own (ELECTRA's generator and discriminator on one table; the projections stay each
  model's own and take the table's width)."""

  spec: base.PositionSpec
  table_from: Any = None

  def setup(self):
    if self.spec.options.share_across_layers:
      self.correlation = UntiedCorrelation(self.spec)

  @nn.compact
  def embed(self, positions_BxL) -> TupeState:
    """The LayerNorm-ed table rows of the positions (``p``) and the [CLS] reset's vectors (``p_theta``)."""
    spec, opts = self.spec, self.spec.options
    offset = 1 if opts.cls_reset == "official" else 0
    table = absolute.LearnedTable(spec, num_rows=spec.max_len + offset, name="table")
    norm = base.layer_norm(spec, "pos_ln") if opts.layernorm else (lambda x: x)
    p = norm(table(jnp.where(positions_BxL < 0, -1, positions_BxL + offset)))  # < 0: NaN, as without the offset
    p_theta = None
    if opts.cls_reset == "official":
      p_theta = norm(table(jnp.arange(2)))
    elif opts.cls_reset == "paper":
      p_theta = norm(self.param("cls_theta", base.normal_init((None, base.EMBED)), (2, spec.hidden_size),
                                spec.param_dtype).astype(spec.dtype))
    return TupeState(positions=positions_BxL, p=p, p_theta=p_theta)

  def __call__(self, positions_BxL):
    base.check_rows("positions", positions_BxL)
    self.spec.check_length(positions_BxL.shape[-1])
    state = (self if self.table_from is None else self.table_from).embed(positions_BxL)
    if self.spec.options.share_across_layers:
      return base.PositionState.build(positions_BxL, terms=self.correlation(state))
    return state


class TupeLayer(nn.Module):
  """Per-layer part: its own positional term, only when ``share_across_layers=False``."""

  spec: base.PositionSpec

  @nn.compact
  def __call__(self, q, k, state, scale):
    if self.spec.options.share_across_layers:
      return base.LayerTerms(q, k)
    return base.LayerTerms(q, k, terms=UntiedCorrelation(self.spec, name="correlation")(state))


@dataclasses.dataclass(frozen=True)
class BertAdOptions:
  """projection_bias: ``U^Q``/``U^K`` with a bias (True, as BERT's W^Q/W^K).
  layernorm: LayerNorm on the position embeddings (False: the paper mentions none for BERT-A^d).
  The embedding is not added at the input (the paper does not say; posjax leaves it out).
  """

  projection_bias: bool = True
  layernorm: bool = False


@flax.struct.dataclass(kw_only=True)
class BertAdState(base.PositionState):
  """BERT-A^d's state: the position table's rows ``p`` ``[Bp, L, D]``, projected in every layer."""

  p: jax.Array


class BertAdTable(nn.Module):
  """BERT-A^d's encoder-level part: the learned position table (optionally LayerNorm-ed), read by every layer."""

  spec: base.PositionSpec

  @nn.compact
  def __call__(self, positions_BxL):
    base.check_rows("positions", positions_BxL)
    self.spec.check_length(positions_BxL.shape[-1])
    p = absolute.LearnedTable(self.spec, name="table")(positions_BxL)
    if self.spec.options.layernorm:
      p = base.layer_norm(self.spec, "pos_ln")(p)
    return BertAdState(positions=positions_BxL, p=p)


class BertAdLayer(nn.Module):
  """BERT-A^d: ``(q_i + p_i U^Q)·(k_j + p_j U^K) / sqrt(4 d_h)`` expands into all four terms, so the
  layer only shifts q and k (per-layer ``U``) and stays computable by fused kernels."""

  spec: base.PositionSpec

  @nn.compact
  def __call__(self, q, k, state: BertAdState, scale):
    p = state.p
    uq = base.head_projection(self.spec, "pos_query", self.spec.options.projection_bias)
    uk = base.head_projection(self.spec, "pos_key", self.spec.options.projection_bias, self.spec.kv_heads)
    return base.LayerTerms(q + uq(p).astype(q.dtype), k + uk(p).astype(k.dtype))


base.register(base.Method("bert_ad", BertAdOptions, encoder=BertAdTable, layer=BertAdLayer, content_scale=4.0,
                          max_len_bound=True,
                          summary="BERT-A^d: separate word/position projections, four terms, 1/sqrt(4 d_h)"))
base.register(base.Method("tupe_a", TupeAOptions, encoder=Tupe, layer=TupeLayer, content_scale=2.0,
                          max_len_bound=True, table_shareable=True, summary="TUPE-A: untied absolute positional correlation"))
base.register(base.Method("tupe_r", TupeROptions, encoder=Tupe, layer=TupeLayer, content_scale=2.0,
                          max_len_bound=True, table_shareable=True, summary="TUPE-R: TUPE-A plus a T5 relative bias"))
