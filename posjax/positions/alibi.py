"""ALiBi (Press et al. 2022): a fixed bias ``-m_h · |p_j - p_i|`` per head, no parameters.

The encoder (bidirectional) form penalises distance symmetrically. Slopes are the paper's geometric
sequence ``2^(-8h/H)``; for a head count that is not a power of two, the paper's interleaving rule.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from posjax import kernels
from posjax.positions import absolute, base


def slopes(num_heads: int) -> np.ndarray:
  """ALiBi's per-head slopes 2^(-8h/n), h = 1..n (Press et al. 2022); for a head count that is not a power of two,
  those of the power below followed by every other slope of twice that many, as their code computes them."""
  def power_of_two(n):
    return [2 ** (-8 * (h + 1) / n) for h in range(n)]

  n = 2 ** math.floor(math.log2(num_heads))
  extra = power_of_two(2 * n)[0::2][: num_heads - n]
  return np.asarray(power_of_two(n) + extra, np.float32)


class AlibiBias(nn.Module):
  """ALiBi's encoder-level part: the shared ``-slope_h |j - i|`` bias (and its kernel terms)."""

  spec: base.PositionSpec

  @nn.compact
  def __call__(self, positions_BxL):
    base.check_rows("positions", positions_BxL)
    terms = kernels.Terms(alibi=kernels.Alibi(jnp.asarray(slopes(self.spec.num_heads))))
    return base.PositionState.build(positions_BxL, terms=terms)


base.register(base.Method("alibi", absolute.NoOptions, encoder=AlibiBias,
                          summary="ALiBi: fixed linear distance penalty per head (Press et al. 2022)"))
