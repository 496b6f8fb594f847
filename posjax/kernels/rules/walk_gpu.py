"""The GPU (Triton) walks both rules share: each query tile's key tiles from the diagonal back with per-row carries
(the dq kernel writes them at every key tile for the dk/dv kernel), and a first walk for a row total.

Shapes: B batch, H heads, N key tiles, L length, Q/T query/key tile rows, K head dim, V value head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from posjax.kernels.terms import Terms
from posjax.kernels.tile import Plan, dot, t_dot
from posjax.kernels.triton_kernels import Tile, dot_in, tile_range


def carried_dq(plan: Plan, terms: Terms, r: dict, carries: tuple[str, ...], tile_grads):
  """``dq`` of one query tile for the rules whose rows carry sums across key tiles: the key tiles walked from the last
  back, each row's carries (outputs ``carries``, ``[B, H, N, L]``) written at every key tile before it is added to,
  for the dk/dv kernel; ``tile_grads(tile, *sums_Q) -> (dz, (row sums to add to the carries))``."""
  bq, i0 = plan.block_q, pl.program_id(2) * plan.block_q
  lo, hi = tile_range(r)

  def body(step, carry):
    *sums_Q, dq_QxK = carry
    t = hi - 1 - step
    for name, sum_Q in zip(carries, sums_Q):
      r[name][0, 0, t, :] = sum_Q
    tile = Tile(plan, terms, r, i0, t * plan.block_k)
    dz_QxT, added_Q = tile_grads(tile, *sums_Q)
    return (*(x + y for x, y in zip(sums_Q, added_Q)), dq_QxK + plan.scale * dot_in(dot, dz_QxT, tile.k_TxK))

  init = (*(jnp.zeros((bq,), jnp.float32) for _ in carries), jnp.zeros((bq, r["q"].shape[-1]), jnp.float32))
  return jax.lax.fori_loop(0, hi - lo, body, init)[-1]


def row_totals(plan: Plan, terms: Terms, r: dict, tile_sums):
  """A first walk over one query tile's key tiles from the last back: each row's total of a per-pair quantity the
  backward needs whole (``tile_sums(tile, carry_Q) -> (the carry's row sums, the total's)``), the row's carry
  recomputed on the way."""
  bq, i0 = plan.block_q, pl.program_id(2) * plan.block_q
  lo, hi = tile_range(r)

  def body(step, carry):
    carry_Q, total_Q = carry
    added_Q, part_Q = tile_sums(Tile(plan, terms, r, i0, (hi - 1 - step) * plan.block_k), carry_Q)
    return carry_Q + added_Q, total_Q + part_Q

  return jax.lax.fori_loop(0, hi - lo, body, (jnp.zeros((bq,), jnp.float32), jnp.zeros((bq,), jnp.float32)))[1]


def carried_dkv(plan: Plan, terms: Terms, r: dict, tile_grads):
  """``(dk, dv)`` of one key tile for the rules whose rows carry sums across key tiles (the dq kernel wrote each
  row's carries at every key tile): ``tile_grads(tile, n) -> (dz, weights)`` of a tile at key tile ``n``."""
  n = pl.program_id(2)
  bk, j0 = plan.block_k, n * plan.block_k

  def body(t, acc):
    dk_TxK, dv_TxV = acc
    tile = Tile(plan, terms, r, t * plan.block_q, j0)
    dz_QxT, weights_QxT = tile_grads(tile, n)
    do_QxV = r["d_out"][0, 0, tile.rows, :]
    return (dk_TxK + plan.scale * dot_in(t_dot, dz_QxT, tile.q_QxK), dv_TxV + dot_in(t_dot, weights_QxT, do_QxV))

  init = (jnp.zeros((bk, r["k"].shape[-1]), jnp.float32), jnp.zeros((bk, r["v"].shape[-1]), jnp.float32))
  return jax.lax.fori_loop(*tile_range(r), body, init)


def default_block_sizes(terms: Terms, length: int, head_dim: int) -> tuple[int, int]:
  """Both rules' GPU tile, 32x32: at 64x64 their float32 ``[bq, bk]`` tiles (weights or gates, their logs, the in-tile
  suffix sums) spill 0.8-2.3 KB per thread on H100 (ptxas), at 32x32 none."""
  del terms, length, head_dim
  return (32, 32)
