"""The TPU (Mosaic) walks both rules share, in key-major tiles: keys on the sublanes, queries on the lanes, so every
per-query statistic (the carries, the weights' sums, the backward's row totals) is a lane-major row ``[1, Q]`` that
broadcasts over a tile and is stored as it is: no relayout. Each query tile walks its key tiles from the diagonal
back (the grid's sequential axis reversed); a dq kernel's two walks (a row total, then the gradients) are one
sequential axis of twice the key tiles.

Shapes: B batch, H heads, N key tiles, L padded length, Q/T query/key tile rows, K head dim, V value head dim, X any.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from posjax.kernels.mosaic import call, clamped, visits_tile, zero_on_first_step
from posjax.kernels.tile import Plan, dot, dot_t, kv_head


HIGHEST = jax.lax.Precision.HIGHEST  # the in-tile suffix sums in float32 (a TPU's default float32 dot is bf16)


def key_major_tile(plan: Plan, r: dict, i, j):
  """Key tile j against query tile i, transposed: ``(z, allowed, key, query)`` ``[T, Q]``: the scaled logits, the
  mask (padding, documents, causal, sliding window) and the pairs' sequence indices."""
  bq, bk = plan.block_q, plan.block_k
  z_TxQ = plan.scale * dot_t(r["k"][0, 0], r["q"][0, 0])
  key_TxQ = j * bk + jax.lax.broadcasted_iota(jnp.int32, (bk, bq), 0)
  query_TxQ = i * bq + jax.lax.broadcasted_iota(jnp.int32, (bk, bq), 1)
  allowed_TxQ = (r["kt_valid"][0] > 0) & (r["kt_segments"][0] == r["qt_segments"][0])
  if plan.causal:
    allowed_TxQ = allowed_TxQ & (key_TxQ <= query_TxQ)
  if plan.sliding_window:
    allowed_TxQ = allowed_TxQ & (jnp.abs(query_TxQ - key_TxQ) < plan.sliding_window)
  return z_TxQ, allowed_TxQ, key_TxQ, query_TxQ


def diagonal_rows(x_1xN, rows_NxX):
  """``diag(x) @ rows``: each row scaled by a lane-major row's entry (a product, not a relayout)."""
  n = x_1xN.shape[1]
  eye_NxN = jax.lax.broadcasted_iota(jnp.int32, (n, n), 0) == jax.lax.broadcasted_iota(jnp.int32, (n, n), 1)
  return dot(jnp.where(eye_NxN, x_1xN, 0.0), rows_NxX.astype(jnp.float32), HIGHEST)


def walked_back(names, refs):
  """``(refs by name, b, i, j, step)`` of a query-major grid point whose step ``step`` visits key tile ``j``, the
  key tiles from the last back."""
  step = pl.program_id(3)
  return dict(zip(names, refs)), pl.program_id(0), pl.program_id(2), pl.num_programs(3) - 1 - step, step


def two_walks(names, refs, carry: str, zeroed):
  """A dq kernel's grid point (b, h, query tile i, step s) of two walks over the key tiles from the last back
  (steps ``0 .. N - 1``, then ``N .. 2N - 1``): ``(refs by name, b, i, key tile j, s, the first walk's mask, the
  second's)``. The accumulators ``zeroed`` start at zero, and ``carry`` again at the second walk."""
  r = dict(zip(names, refs))
  b, i, s = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  n_k = pl.num_programs(3) // 2
  j = n_k - 1 - s % n_k
  zero_on_first_step(r, zeroed, s)

  @pl.when(s == n_k)
  def _():
    r["acc_" + carry][...] = jnp.zeros(r["acc_" + carry].shape, jnp.float32)

  visits = visits_tile(r, b, i, j)
  return r, b, i, j, s, visits & (s < n_k), visits & (s >= n_k)


def two_walk_tiles(n_q: int, n_k: int):
  """The (query tile, key tile) of a :func:`two_walks` grid point, the key tile clamped into i's range."""
  return lambda b, h, i, s, ranges: (i, clamped(ranges, n_q, b, i, n_k - 1 - s % n_k))


def two_walk_carry(shape_BxHxNx1xL, n_q: int, block: int):
  """An output of each query's carry at every key tile, written in the second walk (the first walk's steps keep the
  block the second walk writes first: nothing unwritten goes back to memory)."""
  n_k = shape_BxHxNx1xL[2]
  first = lambda ranges, b, i, s: clamped(ranges, n_q, b, i, n_k - 1 - jnp.maximum(s - n_k, 0))
  return (jax.ShapeDtypeStruct(shape_BxHxNx1xL, jnp.float32),
          pl.BlockSpec((1, 1, 1, 1, block), lambda b, h, i, s, ranges: (b, h, first(ranges, b, i, s), 0, i)))


def carried_dkv(plan: Plan, names, refs, tile_grads):
  """The dk/dv kernels of the rules whose queries carry sums across key tiles (grid (b, h, key tile j, query tile
  i), the carries the dq kernel wrote): ``tile_grads(r, i, j) -> (dz, weights)`` ``[T, Q]``, summed into ``acc_dk``
  and ``acc_dv``; returns the refs by name and ``i``, for the kernel's last step."""
  r = dict(zip(names, refs))
  b, j, i = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  zero_on_first_step(r, ("dk", "dv"), i)

  @pl.when(visits_tile(r, b, j, i))
  def _():
    dz_TxQ, weights_TxQ = tile_grads(r, i, j)
    do_QxV, q_QxK = r["d_out"][0, 0], r["q"][0, 0]
    r["acc_dv"][...] += dot(weights_TxQ.astype(do_QxV.dtype), do_QxV)
    r["acc_dk"][...] += plan.scale * dot(dz_TxQ.astype(q_QxK.dtype), q_QxK)

  return r, i


def key_major_inputs(plan: Plan, q_BxHxLxK, k_BxHxLxK, v_BxHxLxV, segment_ids_BxL, valid_BxL) -> dict:
  """The stick-breaking kernels' arrays: the key side's integers replicated across a query tile's lanes
  (``[B, L, Q]``), the query side's as rows (``[B, 1, L]``)."""
  replicate = lambda x_BxL: jnp.broadcast_to(x_BxL[:, :, None], (*x_BxL.shape, plan.block_q))
  return {"q": q_BxHxLxK, "k": k_BxHxLxK, "v": v_BxHxLxV, "v_q": v_BxHxLxV,
          "kt_segments": replicate(segment_ids_BxL), "kt_valid": replicate(valid_BxL),
          "qt_segments": segment_ids_BxL[:, None]}


def key_major_specs(plan: Plan, at, name: str, a):
  """The BlockSpecs of the rules' own arrays (:func:`posjax.kernels.mosaic.call`'s ``more_specs``), None for
  another name."""
  bq, bk = plan.block_q, plan.block_k
  row_block = lambda a_BxHxLxX, size: (1, 1, size, a_BxHxLxX.shape[-1])
  if name == "v_q":  # the values at the query rows (stick-breaking's remainder)
    return at(row_block(a, bq), lambda b, h, i, j: (b, kv_head(h, plan.group), i, 0))
  elif name == "d_out_k":  # d_out at the key rows (stick-breaking's remainder)
    return at(row_block(a, bk), lambda b, h, i, j: (b, h, j, 0))
  elif name in ("kt_segments", "kt_valid"):  # key-major tiles: the key side replicated across the lanes
    return at((1, bk, bq), lambda b, h, i, j: (b, j, 0))
  elif name == "qt_segments":
    return at((1, 1, bq), lambda b, h, i, j: (b, 0, i))
  elif name in ("dov_t", "w_t", "row_max_t", "row_sum_t", "delta_t", "total_dp_t"):  # per query, lane-major
    return at((1, 1, 1, bq), lambda b, h, i, j: (b, h, 0, i))
  elif name == "row_sum_k":  # per key row, lane-major
    return at((1, 1, 1, bk), lambda b, h, i, j: (b, h, 0, j))
  elif name == "qe_t":  # CoPE's q·e[n] of the query tile, one entry a sublane
    return at((1, 1, a.shape[2], bq), lambda b, h, i, j: (b, h, 0, i))
  elif name in ("later_t", "gain_t", "counted_t", "later_dp_t"):  # the carries of query tile i at key tile j
    return at((1, 1, 1, 1, bq), lambda b, h, i, j: (b, h, j, 0, i))
  return None


def call_rule(kernel, plan: Plan, *args, **kwargs):
  """:func:`posjax.kernels.mosaic.call` with the rules' arrays' specs (:func:`key_major_specs`)."""
  return call(kernel, plan, *args, more_specs=functools.partial(key_major_specs, plan), **kwargs)
