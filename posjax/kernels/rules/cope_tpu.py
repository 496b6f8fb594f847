"""CoPE on TPU (Mosaic): its kernels and ``custom_vjp`` in key-major tiles (:mod:`posjax.kernels.rules.walk_tpu`;
the rule: :mod:`posjax.kernels.rules.cope`), each pair's entries selected one entry at a time over the entries the
tile's counts reach (Mosaic has no gather).

Shapes: B batch, H heads, N key tiles, L padded length, P table entries, Q/T query/key tile rows, K head dim, V value
head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from posjax.kernels.mosaic import default_block_sizes  # noqa: F401  (this rule's tile: the softmax kernels')
from posjax.kernels.mosaic import key_major, lane_row_output, query_major, row_output, visits_tile, write_on_last_step
from posjax.kernels.rules.common import rule_attention, suffix_matrix
from posjax.kernels.rules.walk_tpu import (HIGHEST, call_rule, carried_dkv, key_major_inputs, key_major_tile,
                                           two_walk_carry, two_walk_tiles, two_walks, walked_back)
from posjax.kernels.terms import Terms
from posjax.kernels.tile import MASKED, Plan, dot, dot_t, group_sum, row_delta, t_dot


def _cope_tile(plan: Plan, terms: Terms, r: dict, i, j, counted_1xQ):
  """CoPE's key tile j against query tile i, transposed (:func:`posjax.kernels.rules.cope_gpu.cope_tile`):
  ``(allowed, g, unclamped, f, c, w, slope, logits)`` ``[T, Q]``, the entries ``q·e[n]`` selected one entry at a
  time from the queries' lane-major rows (Mosaic has no gather); the logits masked as
  :meth:`posjax.kernels.tile.TileBase.mask_logits` masks them."""
  bk = plan.block_k
  z_TxQ, allowed_TxQ, key_TxQ, _ = key_major_tile(plan, r, i, j)
  g_TxQ = jnp.where(allowed_TxQ, jax.nn.sigmoid(z_TxQ), 0.0)
  entries = r["qe_t"].shape[2]
  counted_TxQ = counted_1xQ + dot(suffix_matrix(bk, inclusive=True).T, g_TxQ, HIGHEST)
  p_TxQ = jnp.minimum(counted_TxQ, float(entries - 1))
  f_TxQ = jnp.floor(p_TxQ)
  w_TxQ = p_TxQ - f_TxQ
  f_TxQ, c_TxQ = f_TxQ.astype(jnp.int32), jnp.ceil(p_TxQ).astype(jnp.int32)

  def select(n, carry):
    low_TxQ, high_TxQ = carry
    qe_1xQ = r["qe_t"][0, 0, pl.ds(n, 1), :]
    return jnp.where(f_TxQ == n, qe_1xQ, low_TxQ), jnp.where(c_TxQ == n, qe_1xQ, high_TxQ)

  low_TxQ, high_TxQ = jax.lax.fori_loop(*_entries_reached(allowed_TxQ, f_TxQ, c_TxQ, entries), select,
                                        (jnp.zeros_like(z_TxQ), jnp.zeros_like(z_TxQ)))
  logits_TxQ = jnp.where(allowed_TxQ, z_TxQ + low_TxQ + w_TxQ * (high_TxQ - low_TxQ), MASKED)
  logits_TxQ = jnp.where(key_TxQ < plan.length, logits_TxQ, -jnp.inf)
  return allowed_TxQ, g_TxQ, counted_TxQ < entries - 1, f_TxQ, c_TxQ, w_TxQ, high_TxQ - low_TxQ, logits_TxQ


def _entries_reached(allowed_TxQ, f_TxQ, c_TxQ, entries: int):
  """``[lo, hi)``: the table entries a CoPE tile's allowed pairs read (a loop over them selects or accumulates an
  entry at a time: a tile's counts span far fewer entries than the table has, near the diagonal)."""
  lo = jnp.min(jnp.where(allowed_TxQ, f_TxQ, entries - 1))
  return lo, jnp.maximum(jnp.max(jnp.where(allowed_TxQ, c_TxQ, 0)) + 1, lo)


def _cope_forward_kernel(plan: Plan, terms: Terms, names, *refs):
  r, b, i, j, step = walked_back(names, refs)

  @pl.when(step == 0)
  def _():
    r["acc_m"][...] = jnp.full(r["acc_m"].shape, -jnp.inf, jnp.float32)
    for name in ("counted", "l", "out"):
      r["acc_" + name][...] = jnp.zeros(r["acc_" + name].shape, jnp.float32)

  @pl.when(visits_tile(r, b, i, j))
  def _():
    _, g_TxQ, *_, logits_TxQ = _cope_tile(plan, terms, r, i, j, r["acc_counted"][...])
    m_1xQ = r["acc_m"][...]
    new_max_1xQ = jnp.maximum(m_1xQ, jnp.max(logits_TxQ, axis=0, keepdims=True))
    # walked from the last key tile, a query may first meet only keys past the sequence (-inf): no weight, not NaN
    safe_1xQ = jnp.where(new_max_1xQ == -jnp.inf, 0.0, new_max_1xQ)
    alpha_1xQ = jnp.exp(m_1xQ - safe_1xQ)
    p_TxQ = jnp.exp(logits_TxQ - safe_1xQ)
    v_TxV = r["v"][0, 0]
    r["acc_m"][...] = new_max_1xQ
    r["acc_l"][...] = alpha_1xQ * r["acc_l"][...] + jnp.sum(p_TxQ, axis=0, keepdims=True)
    r["acc_out"][...] = alpha_1xQ * r["acc_out"][...] + t_dot(v_TxV, p_TxQ.astype(v_TxV.dtype))  # [V, Q]
    r["acc_counted"][...] += jnp.sum(g_TxQ, axis=0, keepdims=True)

  @pl.when(step == pl.num_programs(3) - 1)
  def _():
    r["out"][0, 0] = (r["acc_out"][...] / r["acc_l"][...]).T.astype(r["out"].dtype)
    r["row_max_t"][0, 0] = r["acc_m"][...]
    r["row_sum_t"][0, 0] = r["acc_l"][...]


def _cope_tile_grads(plan: Plan, terms: Terms, r: dict, i, j, counted_1xQ):
  """A CoPE tile's softmax weights, logits' gradient ``ds``, positions' gradient ``dp`` and the gates, floor,
  ceiling and fraction (transposed, :func:`posjax.kernels.rules.cope_gpu._cope_tile_grads`' counterpart)."""
  allowed_TxQ, g_TxQ, unclamped_TxQ, f_TxQ, c_TxQ, w_TxQ, slope_TxQ, logits_TxQ = _cope_tile(plan, terms, r, i, j,
                                                                                          counted_1xQ)
  p_TxQ = jnp.exp(logits_TxQ - r["row_max_t"][0, 0]) / r["row_sum_t"][0, 0]
  dp_TxQ = dot_t(r["v"][0, 0], r["d_out"][0, 0])
  ds_TxQ = jnp.where(allowed_TxQ, p_TxQ * (dp_TxQ - r["delta_t"][0, 0]), 0.0)
  d_position_TxQ = jnp.where(unclamped_TxQ, ds_TxQ * slope_TxQ, 0.0)
  return allowed_TxQ, g_TxQ, p_TxQ, ds_TxQ, d_position_TxQ, (f_TxQ, c_TxQ, w_TxQ)


def _cope_dz(plan: Plan, allowed_TxQ, g_TxQ, ds_TxQ, d_position_TxQ, before_1xQ):
  """``dz`` of a transposed CoPE tile (:func:`posjax.kernels.rules.cope_gpu.cope_logit_grads`)."""
  counted_dp_TxQ = before_1xQ - dot(suffix_matrix(plan.block_k, inclusive=False).T, d_position_TxQ, HIGHEST)
  return jnp.where(allowed_TxQ, ds_TxQ + counted_dp_TxQ * g_TxQ * (1.0 - g_TxQ), 0.0)


def _cope_dq_kernel(plan: Plan, terms: Terms, names, *refs):
  """Grid (b, h, query tile i, step s) of two walks over the key tiles from the last back (steps ``0 .. N - 1``
  and ``N .. 2N - 1``): the first sums each query's ``dp``, the second computes ``dq`` and ``dqe`` (rows ``[P, Q]``,
  one entry a sublane) and writes each query's carries at every key tile for the dk/dv kernel."""
  r, b, i, j, s, first, second = two_walks(names, refs, "counted", ("counted", "total", "later", "dq", "dqe"))

  @pl.when(first)
  def _():
    _, g_TxQ, _, _, d_position_TxQ, _ = _cope_tile_grads(plan, terms, r, i, j, r["acc_counted"][...])
    r["acc_counted"][...] += jnp.sum(g_TxQ, axis=0, keepdims=True)
    r["acc_total"][...] += jnp.sum(d_position_TxQ, axis=0, keepdims=True)

  @pl.when(second)
  def _():
    counted_1xQ, later_1xQ = r["acc_counted"][...], r["acc_later"][...]
    r["counted_t"][0, 0, 0] = counted_1xQ
    r["later_dp_t"][0, 0, 0] = later_1xQ
    allowed_TxQ, g_TxQ, _, ds_TxQ, d_position_TxQ, (f_TxQ, c_TxQ, w_TxQ) = _cope_tile_grads(
        plan, terms, r, i, j, counted_1xQ)
    dz_TxQ = _cope_dz(plan, allowed_TxQ, g_TxQ, ds_TxQ, d_position_TxQ, r["acc_total"][...] - later_1xQ)
    k_TxK = r["k"][0, 0]
    r["acc_dq"][...] += plan.scale * t_dot(dz_TxQ.astype(k_TxK.dtype), k_TxK)
    low_TxQ, high_TxQ = ds_TxQ * (1.0 - w_TxQ), ds_TxQ * w_TxQ

    def scatter(n, carry):
      part_TxQ = jnp.where(f_TxQ == n, low_TxQ, 0.0) + jnp.where(c_TxQ == n, high_TxQ, 0.0)
      r["acc_dqe"][pl.ds(n, 1), :] += jnp.sum(part_TxQ, axis=0, keepdims=True)
      return carry

    jax.lax.fori_loop(*_entries_reached(allowed_TxQ, f_TxQ, c_TxQ, r["acc_dqe"].shape[0]), scatter, 0)
    r["acc_counted"][...] += jnp.sum(g_TxQ, axis=0, keepdims=True)
    r["acc_later"][...] += jnp.sum(d_position_TxQ, axis=0, keepdims=True)

  @pl.when(s == pl.num_programs(3) - 1)
  def _():
    r["dq"][0, 0] = r["acc_dq"][...]
    r["dqe_t"][0, 0] = r["acc_dqe"][...]
    r["total_dp_t"][0, 0] = r["acc_total"][...]


def _cope_dkv_kernel(plan: Plan, terms: Terms, names, *refs):
  def tile_grads(r, i, j):
    allowed_TxQ, g_TxQ, p_TxQ, ds_TxQ, d_position_TxQ, _ = _cope_tile_grads(plan, terms, r, i, j,
                                                                             r["counted_t"][0, 0, 0])
    before_1xQ = r["total_dp_t"][0, 0] - r["later_dp_t"][0, 0, 0]
    return _cope_dz(plan, allowed_TxQ, g_TxQ, ds_TxQ, d_position_TxQ, before_1xQ), p_TxQ

  r, i = carried_dkv(plan, names, refs, tile_grads)
  write_on_last_step(r, ("dk", "dv"), i)


def _cope_rows_t(terms: Terms, q_BxHxLxK):
  """``[B, H, P, L]``: ``q·e[n]`` of every query and entry (the table scaled as the method adds the term), entries
  on the sublanes."""
  return jnp.einsum("bhlk,kp->bhpl", q_BxHxLxK.astype(jnp.float32), terms.cope.table.astype(jnp.float32),
                    precision=HIGHEST)


def _cope_forward(plan: Plan, terms: Terms, q_BxHxLxK, k_BxHxLxK, v_BxHxLxV, segment_ids_BxL, valid_BxL, ranges):
  b, h, l, _ = q_BxHxLxK.shape
  bq, bk, value_dim = plan.block_q, plan.block_k, v_BxHxLxV.shape[-1]
  arrays = {**key_major_inputs(plan, q_BxHxLxK, k_BxHxLxK, v_BxHxLxV, segment_ids_BxL, valid_BxL),
            "qe_t": _cope_rows_t(terms, q_BxHxLxK)}
  del arrays["v_q"]
  out = call_rule(_cope_forward_kernel, plan, terms, arrays,
              {"out": row_output((b, h, l, value_dim), bq, v_BxHxLxV.dtype),
               "row_max_t": lane_row_output((b, h, 1, l), bq), "row_sum_t": lane_row_output((b, h, 1, l), bq)},
              (b, h, l // bq, l // bk), query_major(l // bq, reverse=l // bk),
              {"acc_counted": (1, bq), "acc_m": (1, bq), "acc_l": (1, bq), "acc_out": (value_dim, bq)}, ranges[0])
  return out["out"], (out["row_max_t"], out["row_sum_t"])


def _cope_backward(plan: Plan, terms: Terms, q_BxHxLxK, k_BxHxLxK, v_BxHxLxV, segment_ids_BxL, valid_BxL, out_BxHxLxV,
                   stats, d_out_BxHxLxV, key_tiles_BxNx2, query_tiles_BxMx2):
  """``(d table, dq, dk, dv)``: the dq kernel's ``dqe`` rows give the table's gradient and their share of ``dq``
  after the kernels; its carries (``[B, H, N, 1, L]`` each) and each query's ``Σ dp`` pass to the dk/dv kernel."""
  b, h, l, d = q_BxHxLxK.shape
  bq, bk, value_dim = plan.block_q, plan.block_k, v_BxHxLxV.shape[-1]
  n_q, n_k = l // bq, l // bk
  qe_BxHxPxL = _cope_rows_t(terms, q_BxHxLxK)
  entries = qe_BxHxPxL.shape[2]
  arrays = {**key_major_inputs(plan, q_BxHxLxK, k_BxHxLxK, v_BxHxLxV, segment_ids_BxL, valid_BxL), "qe_t": qe_BxHxPxL,
            "d_out": d_out_BxHxLxV, "row_max_t": stats[0], "row_sum_t": stats[1],
            "delta_t": row_delta(d_out_BxHxLxV, out_BxHxLxV)[:, :, None]}
  del arrays["v_q"]
  carry = lambda: two_walk_carry((b, h, n_k, 1, l), n_q, bq)
  dq_res = call_rule(_cope_dq_kernel, plan, terms, arrays,
                 {"dq": row_output((b, h, l, d), bq), "dqe_t": (jax.ShapeDtypeStruct((b, h, entries, l), jnp.float32),
                                                          pl.BlockSpec((1, 1, entries, bq),
                                                                       lambda b_, h_, i, s, ranges: (b_, h_, 0, i))),
                  "total_dp_t": lane_row_output((b, h, 1, l), bq), "counted_t": carry(), "later_dp_t": carry()},
                 (b, h, n_q, 2 * n_k), two_walk_tiles(n_q, n_k),
                 {"acc_counted": (1, bq), "acc_total": (1, bq), "acc_later": (1, bq), "acc_dq": (bq, d),
                  "acc_dqe": (entries, bq)}, key_tiles_BxNx2)
  arrays.update(counted_t=dq_res["counted_t"], later_dp_t=dq_res["later_dp_t"], total_dp_t=dq_res["total_dp_t"])
  dkv_res = call_rule(_cope_dkv_kernel, plan, terms, arrays,
                  {"dk": row_output((b, h, l, d), bk), "dv": row_output((b, h, l, value_dim), bk)},
                  (b, h, n_k, n_q), key_major(n_k), {"acc_dk": (bk, d), "acc_dv": (bk, value_dim)},
                  query_tiles_BxMx2)
  table_KxP = terms.cope.table.astype(jnp.float32)
  dqe_BxHxPxL = dq_res["dqe_t"]
  dq_BxHxLxK = dq_res["dq"] + jnp.einsum("bhpl,kp->bhlk", dqe_BxHxPxL, table_KxP, precision=HIGHEST)
  d_table_KxP = jnp.einsum("bhlk,bhpl->kp", q_BxHxLxK.astype(jnp.float32), dqe_BxHxPxL, precision=HIGHEST)
  return d_table_KxP, dq_BxHxLxK, group_sum(dkv_res["dk"], plan.group), group_sum(dkv_res["dv"], plan.group)


def _forward(plan: Plan, terms: Terms, q_BxHxLxK, k_BxHxLxK, v_BxHxLxV, positions_BxL, segment_ids_BxL, valid_BxL,
             salts_BxH, ranges):
  del positions_BxL, salts_BxH
  return _cope_forward(plan, terms, q_BxHxLxK, k_BxHxLxK, v_BxHxLxV, segment_ids_BxL, valid_BxL, ranges)


def _backward(plan: Plan, terms: Terms, q_BxHxLxK, k_BxHxLxK, v_BxHxLxV, positions_BxL, segment_ids_BxL, valid_BxL,
              salts_BxH, out_BxHxLxV, stats, ranges, d_out_BxHxLxV):
  d_table_KxP, *grads = _cope_backward(plan, terms, q_BxHxLxK, k_BxHxLxK, v_BxHxLxV, segment_ids_BxL, valid_BxL,
                                       out_BxHxLxV, stats, d_out_BxHxLxV, *ranges)
  return (jax.tree.map(jnp.zeros_like, terms).replace(cope=terms.cope.replace(
      table=d_table_KxP.astype(terms.cope.table.dtype))), *grads)


attention = rule_attention(_forward, _backward, "CoPE attention ``[B, H, L, V]`` of ``[B, H, L, K]`` inputs on TPU (as "
                           ":func:`posjax.kernels.mosaic.attention`).")
