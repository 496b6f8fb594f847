"""Input-embedding methods: none, learned absolute (BERT-A), sinusoidal (Vaswani et al. 2017)."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax.numpy as jnp

from posjax.positions import base


@dataclasses.dataclass(frozen=True)
class NoOptions:
  """A method without options."""


@dataclasses.dataclass(frozen=True)
class SinusoidalOptions:
  """max_timescale: the longest wavelength is ``2π · max_timescale`` (10,000 in the original).
  scale: the sinusoids are multiplied by it before they are added. The default, 0.02·√2, gives them the
  RMS of BERT's N(0, 0.02) word embeddings; at 1.0 (the original, which instead scales word embeddings by
  √D) they drown the words of a BERT-initialised model.
  """

  max_timescale: float = 10_000.0
  scale: float = 0.02 * 2 ** 0.5


class LearnedTable(nn.Module):
  """A learned ``[max_len, width]`` table read at the batch's positions (BERT's position embedding; ``width``
  default: the model's)."""

  spec: base.PositionSpec
  num_rows: int | None = None
  width: int | None = None

  @nn.compact
  def __call__(self, positions_BxL):
    rows = self.num_rows or self.spec.max_len
    table = self.param("embedding", base.normal_init((base.POSITION, base.EMBED)),
                       (rows, self.width or self.spec.hidden_size), self.spec.param_dtype)
    return base.lookup(table, positions_BxL).astype(self.spec.dtype)


class Absolute(nn.Module):
  """BERT's learned absolute positions: a table row added to every token's input embedding."""

  spec: base.PositionSpec

  @nn.compact
  def __call__(self, positions_BxL):
    base.check_rows("positions", positions_BxL)
    self.spec.check_length(positions_BxL.shape[-1])
    return base.PositionState(embedding=LearnedTable(self.spec, width=self.spec.input_width,
                                                     name="table")(positions_BxL), positions=positions_BxL)


def sinusoid(positions_BxL, dim: int, max_timescale: float = 10_000.0):
  """``PE[p, 2i] = sin(p / T^(2i/D))``, ``PE[p, 2i+1] = cos(p / T^(2i/D))`` (interleaved), ``[B, L, D]``."""
  base.check_rows("positions", positions_BxL)
  inv_freq = max_timescale ** (-jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
  angle_BxLxF = positions_BxL.astype(jnp.float32)[..., None] * inv_freq
  pe = jnp.stack([jnp.sin(angle_BxLxF), jnp.cos(angle_BxLxF)], axis=-1)
  return pe.reshape(*positions_BxL.shape, -1)[..., :dim]


class Sinusoidal(nn.Module):
  """Vaswani et al.'s fixed sinusoidal positions, scaled, added to the input embedding."""

  spec: base.PositionSpec

  @nn.compact
  def __call__(self, positions_BxL):
    options = self.spec.options
    pe = options.scale * sinusoid(positions_BxL, self.spec.input_width, options.max_timescale)
    return base.PositionState(embedding=pe.astype(self.spec.dtype), positions=positions_BxL)


base.register(base.Method("none", NoOptions, summary="no position information"))
base.register(base.Method("absolute", NoOptions, encoder=Absolute, max_len_bound=True, input_embedding=True,
                          summary="learned absolute embedding added at the input (BERT-A)"))
base.register(base.Method("sinusoidal", SinusoidalOptions, encoder=Sinusoidal, input_embedding=True,
                          summary="fixed sinusoids added at the input (Vaswani et al. 2017)"))
