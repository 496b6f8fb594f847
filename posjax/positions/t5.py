"""T5's bucketed relative bias (Raffel et al. 2020), and BERT-R (absolute + T5 bias, TUPE's baseline)."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax.numpy as jnp

from posjax import kernels
from posjax.kernels.terms import bucket, check_buckets  # noqa: F401  the formula (T5's log buckets) lives with the kernels
from posjax.positions import absolute, base


@dataclasses.dataclass(frozen=True)
class T5Options:
  """num_buckets: table rows per head (split between directions when bidirectional).
  max_distance: distances at or beyond it share the last bucket.
  bidirectional: distinguish keys before and after the query; None (default): True in an encoder, False in a
    decoder (T5's decoder: every later key in bucket 0, which the causal mask hides, and all the buckets for the
    earlier ones).
  """

  num_buckets: int = 32
  max_distance: int = 128
  bidirectional: bool | None = None

  def __post_init__(self):
    if self.bidirectional is not None:  # None: checked once the model says which (t5_terms)
      check_buckets(self.num_buckets, self.max_distance, self.bidirectional)


class BucketTable(nn.Module):
  """One learned scalar per (table entry, head): the ``[rows, H]`` parameter ``rel_bias``."""

  num_heads: int
  num_rows: int
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self):
    return self.param("rel_bias", base.normal_init((base.BUCKETS, base.HEADS)), (self.num_rows, self.num_heads),
                      self.param_dtype)


def t5_terms(spec: base.PositionSpec, name: str = "relative_bias") -> kernels.Terms:
  """The bucket table as :class:`posjax.kernels.Buckets` (T5's log buckets of ``p_j - p_i``)."""
  opts = spec.options
  table = BucketTable(spec.num_heads, opts.num_buckets, spec.param_dtype, name=name)()
  bidirectional = not spec.causal if opts.bidirectional is None else opts.bidirectional
  check_buckets(opts.num_buckets, opts.max_distance, bidirectional)
  return kernels.Terms(buckets=kernels.Buckets(table, num_buckets=opts.num_buckets, max_distance=opts.max_distance,
                                               bidirectional=bidirectional))


class T5Bias(nn.Module):
  """T5: one bucketed relative bias table shared by all layers (encoder-level)."""

  spec: base.PositionSpec

  @nn.compact
  def __call__(self, positions_BxL):
    base.check_rows("positions", positions_BxL)
    return base.PositionState.build(positions_BxL, terms=t5_terms(self.spec))


class BertR(nn.Module):
  """BERT-R: the learned absolute input embedding plus one T5 bias table shared by all layers."""

  spec: base.PositionSpec

  @nn.compact
  def __call__(self, positions_BxL):
    state = absolute.Absolute(self.spec, name="absolute")(positions_BxL)
    return base.PositionState.build(positions_BxL, terms=t5_terms(self.spec), embedding=state.embedding)


base.register(base.Method("t5", T5Options, encoder=T5Bias,
                          summary="T5 bucketed relative bias, one table shared by all layers"))
base.register(base.Method("bert_r", T5Options, encoder=BertR, max_len_bound=True,
                          summary="BERT-R: learned absolute embedding + T5 relative bias (TUPE's baseline)"))
