"""Dropout on the attention weights whose mask is a hash of (seed, batch and head, query, key).

Shapes: B batch, H heads, S any (broadcast) shape.

A kernel cannot keep an ``[L, L]`` mask for its backward pass, and Pallas's GPU backend has no random number
generator: so each tile recomputes its mask from integer arithmetic alone (a 32-bit mixing function, Wellons's
"lowbias32", applied twice), forward and backward alike, and the dense reference builds the very same mask. A
pair is kept when the top 24 bits of its hash are at or above ``round(rate·2^24)`` (so the rate's resolution is
2^-24: a rate above 1 - 2^-25 drops every weight).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_GOLDEN = int(np.uint32(0x9E3779B9).view(np.int32))
_M1 = int(np.uint32(0x7FEB352D).view(np.int32))
_M2 = int(np.uint32(0x846CA68B).view(np.int32))


def mix(x_S):
  """int32 → int32, wrapping (shifts are logical: the bits are read as unsigned): the hash's mixing step,
  integer arithmetic only so that every kernel backend computes it."""
  x_S = x_S ^ jax.lax.shift_right_logical(x_S, jnp.int32(16))
  x_S = x_S * _M1
  x_S = x_S ^ jax.lax.shift_right_logical(x_S, jnp.int32(15))
  x_S = x_S * _M2
  return x_S ^ jax.lax.shift_right_logical(x_S, jnp.int32(16))


def threshold(rate: float) -> int:
  """The 24-bit hash value below which a pair is dropped (``round(rate·2^24)``)."""
  return round(rate * (1 << 24))


def check_rate(rate: float) -> float:
  """``rate`` as a float, or an error unless it is in [0, 1) (a rate of 1 would divide by zero)."""
  rate = float(rate)
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"dropout_rate={rate} must be in [0, 1)")
  return rate


def salts(seed, batch: int, heads: int):
  """``[B, H]`` int32: one salt per (batch row, head) from an integer ``seed``: a Python int or an integer
  array of shape () (traced is fine), taken modulo 2^32."""
  if isinstance(seed, int):
    seed = jnp.asarray(seed % (1 << 32), jnp.uint32)
  seed = jnp.asarray(seed)
  if seed.shape != () or not jnp.issubdtype(seed.dtype, jnp.integer):
    raise ValueError(f"dropout_seed must be one integer (a Python int or an integer array of shape ()); got "
                     f"{seed.dtype} of shape {seed.shape}")
  index_BxH = jnp.arange(batch * heads, dtype=jnp.int32).reshape(batch, heads)
  return mix(seed.astype(jnp.uint32).view(jnp.int32) ^ mix(index_BxH * _GOLDEN))


def keep(salt_S, i_S, j_S, rate: float):
  """bool, broadcasting int32 ``salt`` (per batch row and head), query indices ``i`` and key indices ``j``:
  whether the pair's weight survives dropout."""
  x_S = mix(mix(salt_S ^ i_S) + j_S * _GOLDEN)
  return jax.lax.shift_right_logical(x_S, jnp.int32(8)) >= threshold(rate)


def apply(x_S, salt_S, i_S, j_S, rate: float):
  """``x`` with the dropped pairs zeroed and the kept ones scaled by ``1/(1 - rate)`` (:func:`keep`)."""
  return jnp.where(keep(salt_S, i_S, j_S, rate), x_S * (1.0 / (1.0 - rate)), 0.0)


def seed_from_key(key):
  """An int32 seed from a JAX PRNG key (the model's ``dropout`` stream)."""
  return jax.random.bits(key, dtype=jnp.uint32).view(jnp.int32)
