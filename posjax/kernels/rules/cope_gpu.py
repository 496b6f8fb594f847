"""CoPE on GPU (Triton): its kernels and ``custom_vjp`` (the rule: :mod:`posjax.kernels.rules.cope`). ``q·e[n]`` of
every row and entry is computed before the kernels (``[B, H, L, P]`` float32); each query tile walks its key tiles
from the diagonal back with an online softmax, carrying each row's count (the gates of the later allowed keys), so a
pair's position is the carry plus the tile's suffix sum and its term interpolates the two entries gathered at its
floor and ceiling. The dq kernel walks twice (each row's ``Σ_j dp_ij``, then the gradients), scatters the entries'
gradient into its ``dqe`` rows and writes each row's two carries at every key tile for the dk/dv kernel.

Shapes: B batch, H heads, N key tiles, L padded length, P table entries, Q/T query/key tile rows, K head dim, V value
head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from posjax.kernels.rules.common import rule_attention, suffix_matrix
from posjax.kernels.rules.walk_gpu import carried_dkv, carried_dq, default_block_sizes, row_totals  # noqa: F401
from posjax.kernels.terms import Terms
from posjax.kernels.tile import Plan, TileBase, dot, dot_t, group_sum, next_power_of_two, row_delta
from posjax.kernels.triton import call, kernel_inputs, range_spec, row_spec
from posjax.kernels.triton_kernels import Tile, scatter_add, tile_range, zero_block


def _rows_of(tile: Tile):
  """``q·e[n]`` of the tile's rows at entries ``n``: a gather from the ``qe`` rows."""
  return lambda index_QxT: tile.gather("qe", tile.index_i_QxT, index_QxT)


def cope_tile(tile: TileBase, counted_Qx1, precision, rows):
  """One tile of CoPE (:class:`posjax.kernels.Cope`) given ``counted_Qx1``, each row's gates summed over the allowed
  keys of the key tiles after this one: ``(g, p, unclamped, f, c, w, slope, logits)``: the gates ``sigmoid(z)`` (0 at
  a masked key), the counted positions ``p`` (clamped at ``P - 1``; ``unclamped``: where they are not), their floor
  ``f``, ceiling ``c`` and fraction ``w``, the slope ``q·e[c] - q·e[f]`` and the logits with the interpolated term
  (masked ones left masked). ``q·e[n]`` of the tile's rows at entries ``n``: ``rows(index_QxT)``."""
  allowed_QxT, s_QxT = tile.allowed_QxT, tile.s_QxT
  g_QxT = jnp.where(allowed_QxT, jax.nn.sigmoid(s_QxT), 0.0)
  top = tile.terms.cope.table.shape[1] - 1
  counted_QxT = counted_Qx1 + dot(g_QxT, suffix_matrix(s_QxT.shape[1], inclusive=True), precision)
  p_QxT = jnp.minimum(counted_QxT, float(top))
  f_QxT = jnp.floor(p_QxT)
  w_QxT = p_QxT - f_QxT
  f_QxT, c_QxT = f_QxT.astype(jnp.int32), jnp.ceil(p_QxT).astype(jnp.int32)
  low_QxT = rows(f_QxT)
  slope_QxT = rows(c_QxT) - low_QxT
  logits_QxT = jnp.where(allowed_QxT, s_QxT + low_QxT + w_QxT * slope_QxT, s_QxT)
  return g_QxT, counted_QxT < top, f_QxT, c_QxT, w_QxT, slope_QxT, logits_QxT


def cope_logit_grads(tile: TileBase, g_QxT, ds_QxT, dp_QxT, before_Qx1, precision):
  """A CoPE tile's ``dz`` from the logits' gradient ``ds`` and the positions' ``dp = ds·slope`` (0 where clamped):
  ``dz_it = ds_it + g_it (1 - g_it) Σ_{j <= t} dp_ij`` (a key's gate counts for every key at or before it), the sum
  ``before_Qx1 - Σ_{j > t in the tile} dp`` (``before``: the row's ``Σ_j dp`` less the later key tiles')."""
  counted_dp_QxT = before_Qx1 - dot(dp_QxT, suffix_matrix(ds_QxT.shape[1], inclusive=False), precision)
  return jnp.where(tile.allowed_QxT, ds_QxT + counted_dp_QxT * g_QxT * (1.0 - g_QxT), 0.0)


def cope_forward_kernel(plan: Plan, terms: Terms, names, *refs):
  """One query tile's output rows and each row's softmax maximum and sum."""
  r = dict(zip(names, refs))
  bq, i0 = plan.block_q, pl.program_id(2) * plan.block_q
  lo, hi = tile_range(r)

  def body(step, carry):
    counted_Q, row_max_Q, row_sum_Q, acc_QxV = carry
    tile = Tile(plan, terms, r, i0, (hi - 1 - step) * plan.block_k)
    g_QxT, *_, logits_QxT = cope_tile(tile, counted_Q[:, None], tile._exact(), _rows_of(tile))
    new_max_Q = jnp.maximum(row_max_Q, jnp.max(logits_QxT, axis=1))
    # walked from the last key tile, a row may first meet only keys past the sequence (-inf): no weight, not NaN
    safe_Q = jnp.where(new_max_Q == -jnp.inf, 0.0, new_max_Q)
    alpha_Q = jnp.exp(row_max_Q - safe_Q)
    p_QxT = jnp.exp(logits_QxT - safe_Q[:, None])
    v_TxV = r["v"][0, 0, tile.cols, :]
    return (counted_Q + jnp.sum(g_QxT, axis=1), new_max_Q, alpha_Q * row_sum_Q + jnp.sum(p_QxT, axis=1),
            alpha_Q[:, None] * acc_QxV + dot(p_QxT.astype(v_TxV.dtype), v_TxV))

  init = (jnp.zeros((bq,), jnp.float32), jnp.full((bq,), -jnp.inf, jnp.float32), jnp.zeros((bq,), jnp.float32),
          jnp.zeros((bq, r["v"].shape[-1]), jnp.float32))
  _, row_max_Q, row_sum_Q, acc_QxV = jax.lax.fori_loop(0, hi - lo, body, init)
  r["out"][0, 0, :, :] = (acc_QxV / row_sum_Q[:, None]).astype(r["out"].dtype)
  r["row_max"][0, 0, :] = row_max_Q
  r["row_sum"][0, 0, :] = row_sum_Q


def _cope_tile_grads(plan: Plan, terms: Terms, r: dict, tile: Tile, counted_Q):
  """A CoPE tile's softmax weights, the logits' gradient ``ds``, the positions' ``dp`` and what CoPE's table
  gradient reads (the gates, floor, ceiling and fraction)."""
  g_QxT, unclamped_QxT, f_QxT, c_QxT, w_QxT, slope_QxT, logits_QxT = cope_tile(tile, counted_Q[:, None],
                                                                            tile._exact(), _rows_of(tile))
  rows = tile.rows
  p_QxT = jnp.exp(logits_QxT - r["row_max"][0, 0, rows][:, None]) / r["row_sum"][0, 0, rows][:, None]
  dp_QxT = dot_t(r["d_out"][0, 0, rows, :], r["v"][0, 0, tile.cols, :])
  ds_QxT = jnp.where(tile.allowed_QxT, p_QxT * (dp_QxT - r["delta"][0, 0, rows][:, None]), 0.0)
  d_position_QxT = jnp.where(unclamped_QxT, ds_QxT * slope_QxT, 0.0)
  return g_QxT, p_QxT, ds_QxT, d_position_QxT, (f_QxT, c_QxT, w_QxT)


def cope_dq_kernel(plan: Plan, terms: Terms, names, *refs):
  """One query tile's ``dq`` and ``dqe`` rows (the gradient of its ``q·e[n]``), in two walks from the last key tile
  back: the first sums each row's ``dp`` (a gate counts for every key at or before it, so its gradient needs the
  whole row's), the second computes the gradients and writes each row's two carries at every key tile (the gates
  and the ``dp`` of the later keys), which the dk/dv kernel reads."""
  r = dict(zip(names, refs))
  zero_block(plan, r["dqe"], rows=True)

  def tile_sums(tile, counted_Q):
    g_QxT, _, _, d_position_QxT, _ = _cope_tile_grads(plan, terms, r, tile, counted_Q)
    return jnp.sum(g_QxT, axis=1), jnp.sum(d_position_QxT, axis=1)

  total_Q = row_totals(plan, terms, r, tile_sums)

  def tile_grads(tile, counted_Q, later_Q):
    g_QxT, _, ds_QxT, d_position_QxT, (f_QxT, c_QxT, w_QxT) = _cope_tile_grads(plan, terms, r, tile, counted_Q)
    scatter_add(plan, r["dqe"], ds_QxT * (1.0 - w_QxT), f_QxT, tile.allowed_QxT, 1)
    scatter_add(plan, r["dqe"], ds_QxT * w_QxT, c_QxT, tile.allowed_QxT, 1)
    dz_QxT = cope_logit_grads(tile, g_QxT, ds_QxT, d_position_QxT, (total_Q - later_Q)[:, None], tile._exact())
    return dz_QxT, (jnp.sum(g_QxT, axis=1), jnp.sum(d_position_QxT, axis=1))

  r["dq"][0, 0, :, :] = carried_dq(plan, terms, r, ("counted", "later_dp"), tile_grads)
  r["total_dp"][0, 0, :] = total_Q


def cope_dkv_kernel(plan: Plan, terms: Terms, names, *refs):
  """One key tile's ``dk`` and ``dv`` from the query tiles that visit it, each row's carries at this key tile and
  its ``Σ dp`` as the dq kernel wrote them."""
  r = dict(zip(names, refs))

  def tile_grads(tile, n):
    counted_Q, later_Q = r["counted"][0, 0, n, tile.rows], r["later_dp"][0, 0, n, tile.rows]
    g_QxT, p_QxT, ds_QxT, d_position_QxT, _ = _cope_tile_grads(plan, terms, r, tile, counted_Q)
    before_Qx1 = (r["total_dp"][0, 0, tile.rows] - later_Q)[:, None]
    return cope_logit_grads(tile, g_QxT, ds_QxT, d_position_QxT, before_Qx1, tile._exact()), p_QxT

  dk_TxK, dv_TxV = carried_dkv(plan, terms, r, tile_grads)
  r["dk"][0, 0, :, :] = dk_TxK
  r["dv"][0, 0, :, :] = dv_TxV


def _cope_bwd(plan: Plan, terms: Terms, inputs: dict, specs: dict, key_tiles_BxNx2, query_tiles_BxMx2):
  """``(d table, dq, dk, dv)`` of CoPE: the dq kernel's ``dqe`` rows (``q·e``'s gradient) give the table's gradient
  and their share of ``dq`` outside the kernels; its carries at every key tile (``[B, H, L / block_k, L]`` float32
  each) and each row's ``Σ dp`` pass to the dk/dv kernel."""
  q_BxHxLxK, qe_BxHxLxP = inputs["q"], inputs["qe"]
  b, h, l, d = q_BxHxLxK.shape
  n_q, n_k = l // plan.block_q, l // plan.block_k
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  carry_tile = pl.BlockSpec((1, 1, n_k, plan.block_q), lambda b, h, i: (b, h, 0, i))
  dq_res = call(cope_dq_kernel, plan, terms, {**inputs, "tiles": key_tiles_BxNx2}, {**specs, "tiles": range_spec()},
                 {"dq": f32(b, h, l, d), "dqe": f32(*qe_BxHxLxP.shape), "counted": f32(b, h, n_k, l),
                  "later_dp": f32(b, h, n_k, l), "total_dp": f32(b, h, l)},
                 {"dq": row_spec(q_BxHxLxK, plan.block_q), "dqe": row_spec(qe_BxHxLxP, plan.block_q),
                  "counted": carry_tile, "later_dp": carry_tile,
                  "total_dp": pl.BlockSpec((1, 1, plan.block_q), lambda b, h, i: (b, h, i))}, n_q)
  carry_rows = pl.BlockSpec((1, 1, n_k, l), lambda b, h, i: (b, h, 0, 0))
  dkv_res = call(cope_dkv_kernel, plan, terms,
                  {**inputs, "counted": dq_res["counted"], "later_dp": dq_res["later_dp"],
                   "total_dp": dq_res["total_dp"], "tiles": query_tiles_BxMx2},
                  {**specs, "counted": carry_rows, "later_dp": carry_rows,
                   "total_dp": pl.BlockSpec((1, 1, l), lambda b, h, i: (b, h, 0)), "tiles": range_spec()},
                  {"dk": f32(b, h, l, d), "dv": f32(b, h, l, inputs["v"].shape[-1])},
                  {"dk": row_spec(q_BxHxLxK, plan.block_k), "dv": row_spec(inputs["d_out"], plan.block_k)}, n_k)
  table_KxP = terms.cope.table.astype(jnp.float32)
  dqe_BxHxLxP = dq_res["dqe"][..., :table_KxP.shape[1]]
  dq_BxHxLxK = dq_res["dq"] + jnp.einsum("bhlp,kp->bhlk", dqe_BxHxLxP, table_KxP, precision=jax.lax.Precision.HIGHEST)
  d_table_KxP = jnp.einsum("bhlk,bhlp->kp", q_BxHxLxK.astype(jnp.float32), dqe_BxHxLxP,
                           precision=jax.lax.Precision.HIGHEST)
  return (d_table_KxP, dq_BxHxLxK, group_sum(dkv_res["dk"], plan.group), group_sum(dkv_res["dv"], plan.group))


def _qe(terms: Terms, q_BxHxLxK):
  """``[B, H, L, P']``: ``q·e[n]`` of every row and table entry (the table scaled as the method adds it), entries padded
  to a power of two."""
  qe_BxHxLxP = jnp.einsum("bhlk,kp->bhlp", q_BxHxLxK.astype(jnp.float32), terms.cope.table.astype(jnp.float32),
                          precision=jax.lax.Precision.HIGHEST)
  entries = qe_BxHxLxP.shape[-1]
  return jnp.pad(qe_BxHxLxP, [(0, 0)] * 3 + [(0, next_power_of_two(entries) - entries)])


def _forward(plan: Plan, terms: Terms, q_BxHxLxK, k_BxHxLxK, v_BxHxLxV, positions_BxL, segment_ids_BxL, valid_BxL,
             salts_BxH, ranges):
  b, h, l, _ = q_BxHxLxK.shape
  inputs, specs = kernel_inputs(plan, terms, q_BxHxLxK, k_BxHxLxK, v_BxHxLxV, positions_BxL, segment_ids_BxL,
                                valid_BxL, salts_BxH, {"qe": _qe(terms, q_BxHxLxK)})
  inputs["tiles"], specs["tiles"] = ranges[0], range_spec()
  row = pl.BlockSpec((1, 1, plan.block_q), lambda b, h, i: (b, h, i))
  out = call(cope_forward_kernel, plan, terms, inputs, specs,
             {"out": jax.ShapeDtypeStruct((b, h, l, v_BxHxLxV.shape[-1]), v_BxHxLxV.dtype),
              "row_max": jax.ShapeDtypeStruct((b, h, l), jnp.float32),
              "row_sum": jax.ShapeDtypeStruct((b, h, l), jnp.float32)},
             {"out": row_spec(v_BxHxLxV, plan.block_q), "row_max": row, "row_sum": row}, l // plan.block_q)
  return out["out"], (out["row_max"], out["row_sum"])


def _backward(plan: Plan, terms: Terms, q_BxHxLxK, k_BxHxLxK, v_BxHxLxV, positions_BxL, segment_ids_BxL, valid_BxL,
              salts_BxH, out_BxHxLxV, stats, ranges, d_out_BxHxLxV):
  l = q_BxHxLxK.shape[2]
  arrays, specs = kernel_inputs(plan, terms, q_BxHxLxK, k_BxHxLxK, v_BxHxLxV, positions_BxL, segment_ids_BxL,
                                valid_BxL, salts_BxH, {"qe": _qe(terms, q_BxHxLxK), "d_out": d_out_BxHxLxV})
  arrays.update(row_max=stats[0], row_sum=stats[1], delta=row_delta(d_out_BxHxLxV, out_BxHxLxV))
  for name in ("row_max", "row_sum", "delta"):
    specs[name] = pl.BlockSpec((1, 1, l), lambda b, h, i: (b, h, 0))
  d_table_KxP, *grads = _cope_bwd(plan, terms, arrays, specs, *ranges)
  return (jax.tree.map(jnp.zeros_like, terms).replace(cope=terms.cope.replace(
      table=d_table_KxP.astype(terms.cope.table.dtype))), *grads)


attention = rule_attention(_forward, _backward, "CoPE attention ``[B, H, L, V]`` of ``[B, H, L, K]`` inputs on GPU "
                           "(as :func:`posjax.kernels.triton.attention`).")
