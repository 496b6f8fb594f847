"""T5's bucketed relative bias (Raffel et al. 2020), and BERT-R (absolute + T5 bias, TUPE's baseline)."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax.numpy as jnp

from posjax import kernels
from posjax.kernels.terms import bucket, check_buckets  # the formula (T5's log buckets) lives with the kernels
from posjax.positions import absolute, base


@dataclasses.dataclass(frozen=True)
class T5Options:
  """num_buckets: table rows per head (split between directions when bidirectional).
  max_distance: distances at or beyond it share the last bucket.
  bidirectional: distinguish keys before and after the query (True for an encoder).
  """

  num_buckets: int = 32
  max_distance: int = 128
  bidirectional: bool = True

  def __post_init__(self):
    check_buckets(self.num_buckets, self.max_distance, self.bidirectional)


class BucketBias(nn.Module):
  """One learned scalar per (bucket, head): ``index [Bp, L, L] -> bias [Bp, H, L, L]``; ``table`` is the
  ``[rows, H]`` parameter (what a fused kernel reads instead of the bias)."""

  num_heads: int
  num_rows: int
  param_dtype: jnp.dtype = jnp.float32

  def setup(self):
    """The ``[rows, H]`` table parameter (``rel_bias``)."""
    self.table = self.param("rel_bias", base.normal_init((base.BUCKETS, base.HEADS)),
                            (self.num_rows, self.num_heads), self.param_dtype)

  def __call__(self, index_BxLxL):
    return jnp.take(self.table, index_BxLxL, axis=0).transpose(0, 3, 1, 2)


def t5_bias(spec: base.PositionSpec, positions_BxL, name: str = "relative_bias") -> base.PositionState:
  """The bucket bias and, for fused kernels, the same as :class:`posjax.kernels.Buckets`."""
  opts = spec.options
  index = bucket(base.relative_positions(positions_BxL), opts.num_buckets, opts.max_distance,
                 opts.bidirectional)
  module = BucketBias(spec.num_heads, opts.num_buckets, spec.param_dtype, name=name)
  bias = module(index)
  terms = kernels.Terms(buckets=kernels.Buckets(module.table, num_buckets=opts.num_buckets,
                                                max_distance=opts.max_distance, bidirectional=opts.bidirectional))
  return base.PositionState(bias=bias, kernel_terms=terms, positions=positions_BxL)


class T5Bias(nn.Module):
  """T5: one bucketed relative bias table shared by all layers (encoder-level)."""

  spec: base.PositionSpec

  @nn.compact
  def __call__(self, positions_BxL):
    return t5_bias(self.spec, positions_BxL)


class BertR(nn.Module):
  """BERT-R: the learned absolute input embedding plus one T5 bias table shared by all layers."""

  spec: base.PositionSpec

  @nn.compact
  def __call__(self, positions_BxL):
    state = absolute.Absolute(self.spec, name="absolute")(positions_BxL)
    return t5_bias(self.spec, positions_BxL).replace(embedding=state.embedding)


base.register(base.Method("t5", T5Options, encoder=T5Bias,
                          summary="T5 bucketed relative bias, one table shared by all layers"))
base.register(base.Method("bert_r", T5Options, encoder=BertR, max_len_bound=True,
                          summary="BERT-R: learned absolute embedding + T5 relative bias (TUPE's baseline)"))
