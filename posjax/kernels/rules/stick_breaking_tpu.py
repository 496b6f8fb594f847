"""Stick-breaking attention on TPU (Mosaic): its kernels and ``custom_vjp`` in key-major tiles
(:mod:`posjax.kernels.rules.walk_tpu`; the rule: :mod:`posjax.kernels.rules.stick_breaking`).

Shapes: B batch, H heads, N key tiles, L padded length, Q/T query/key tile rows, K head dim, V value head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from posjax.kernels.mosaic import default_block_sizes  # noqa: F401  (this rule's tile: the softmax kernels')
from posjax.kernels.mosaic import (key_major, lane_row_output, query_major, row_output, visits_tile,
                                   zero_on_first_step)
from posjax.kernels.rules.common import rule_attention, stick_breaking_rows, suffix_matrix
from posjax.kernels.rules.walk_tpu import (HIGHEST, call_rule, carried_dkv, diagonal_rows, key_major_inputs,
                                           key_major_tile, two_walk_carry, two_walk_tiles, two_walks, walked_back)
from posjax.kernels.terms import Terms
from posjax.kernels.tile import Plan, dot, dot_t, group_sum, t_dot


def _stick_tile(plan: Plan, terms: Terms, r: dict, i, j, later_1xQ):
  """Key tile j against query tile i, transposed: ``(z, allowed, rest, a)`` ``[T, Q]``: the logits, the keys that
  take a share, their ``log(1 - β)`` and their weights given each query's ``Σ log(1 - β)`` over the later key
  tiles."""
  bk = plan.block_k
  z_TxQ, allowed_TxQ, key_TxQ, query_TxQ = key_major_tile(plan, r, i, j)
  if not terms.stick_breaking.attend_current:
    allowed_TxQ = allowed_TxQ & (key_TxQ != query_TxQ)
  rest_TxQ = jnp.where(allowed_TxQ, jax.nn.log_sigmoid(-z_TxQ), 0.0)
  later_TxQ = dot(suffix_matrix(bk, inclusive=False).T, rest_TxQ, HIGHEST) + later_1xQ
  a_TxQ = jnp.where(allowed_TxQ, jnp.exp(jax.nn.log_sigmoid(z_TxQ) + later_TxQ), 0.0)
  return z_TxQ, allowed_TxQ, rest_TxQ, a_TxQ


def _stick_grads(plan: Plan, r: dict, z_TxQ, allowed_TxQ, a_TxQ, before_1xQ):
  """The tile's logits' gradient ``dz`` and ``da a`` (transposed
  :func:`posjax.kernels.rules.stick_breaking_gpu.stick_breaking_grads`), ``before``: each query's ``Σ da a`` less
  the later key tiles'."""
  da_TxQ = dot_t(r["v"][0, 0], r["d_out"][0, 0]) - r["dov_t"][0, 0]
  gain_TxQ = da_TxQ * a_TxQ
  earlier_TxQ = before_1xQ - dot(suffix_matrix(a_TxQ.shape[0], inclusive=True).T, gain_TxQ, HIGHEST)
  dz_TxQ = gain_TxQ * jax.nn.sigmoid(-z_TxQ) - jax.nn.sigmoid(z_TxQ) * earlier_TxQ
  return jnp.where(allowed_TxQ, dz_TxQ, 0.0), gain_TxQ


def _stick_forward_kernel(plan: Plan, terms: Terms, names, *refs):
  r, b, i, j, step = walked_back(names, refs)
  zero_on_first_step(r, ("later", "mass", "out"), step)

  @pl.when(visits_tile(r, b, i, j))
  def _():
    _, _, rest_TxQ, a_TxQ = _stick_tile(plan, terms, r, i, j, r["acc_later"][...])
    v_TxV = r["v"][0, 0]
    r["acc_later"][...] += jnp.sum(rest_TxQ, axis=0, keepdims=True)
    r["acc_mass"][...] += jnp.sum(a_TxQ, axis=0, keepdims=True)
    r["acc_out"][...] += t_dot(a_TxQ.astype(v_TxV.dtype), v_TxV)

  @pl.when(step == pl.num_programs(3) - 1)
  def _():
    out_QxV = r["acc_out"][...]
    if terms.stick_breaking.remainder:  # what is left of the stick, on the query's own value
      out_QxV = out_QxV + diagonal_rows(1.0 - r["acc_mass"][...], r["v_q"][0, 0])
    r["out"][0, 0] = out_QxV.astype(r["out"].dtype)
    r["row_sum_t"][0, 0] = r["acc_mass"][...]


def _stick_dq_kernel(plan: Plan, terms: Terms, names, *refs):
  """dq and each query's ``w = Σ_j da_ij a_ij`` (the first walk), and each query's two carries at every key tile
  it visits (the second), for the dk/dv kernel."""
  r, b, i, j, s, first, second = two_walks(names, refs, "later", ("later", "w", "gain", "dq"))

  @pl.when(first)
  def _():
    z_TxQ, allowed_TxQ, rest_TxQ, a_TxQ = _stick_tile(plan, terms, r, i, j, r["acc_later"][...])
    _, gain_TxQ = _stick_grads(plan, r, z_TxQ, allowed_TxQ, a_TxQ, jnp.zeros_like(r["acc_w"][...]))
    r["acc_later"][...] += jnp.sum(rest_TxQ, axis=0, keepdims=True)
    r["acc_w"][...] += jnp.sum(gain_TxQ, axis=0, keepdims=True)

  @pl.when(second)
  def _():
    later_1xQ, gain_1xQ = r["acc_later"][...], r["acc_gain"][...]
    r["later_t"][0, 0, 0] = later_1xQ
    r["gain_t"][0, 0, 0] = gain_1xQ
    z_TxQ, allowed_TxQ, rest_TxQ, a_TxQ = _stick_tile(plan, terms, r, i, j, later_1xQ)
    dz_TxQ, gain_TxQ = _stick_grads(plan, r, z_TxQ, allowed_TxQ, a_TxQ, r["acc_w"][...] - gain_1xQ)
    k_TxK = r["k"][0, 0]
    r["acc_later"][...] += jnp.sum(rest_TxQ, axis=0, keepdims=True)
    r["acc_gain"][...] += jnp.sum(gain_TxQ, axis=0, keepdims=True)
    r["acc_dq"][...] += plan.scale * t_dot(dz_TxQ.astype(k_TxK.dtype), k_TxK)

  @pl.when(s == pl.num_programs(3) - 1)
  def _():
    r["dq"][0, 0] = r["acc_dq"][...]
    r["w_t"][0, 0] = r["acc_w"][...]


def _stick_dkv_kernel(plan: Plan, terms: Terms, names, *refs):
  def tile_grads(r, i, j):
    later_1xQ, gain_1xQ = r["later_t"][0, 0, 0], r["gain_t"][0, 0, 0]
    z_TxQ, allowed_TxQ, _, a_TxQ = _stick_tile(plan, terms, r, i, j, later_1xQ)
    dz_TxQ, _ = _stick_grads(plan, r, z_TxQ, allowed_TxQ, a_TxQ, r["w_t"][0, 0] - gain_1xQ)
    return dz_TxQ, a_TxQ

  r, i = carried_dkv(plan, names, refs, tile_grads)

  @pl.when(i == pl.num_programs(3) - 1)
  def _():
    dv_TxV = r["acc_dv"][...]
    if terms.stick_breaking.remainder:  # the key's own query's remainder, on its value
      dv_TxV = dv_TxV + diagonal_rows(1.0 - r["row_sum_k"][0, 0], r["d_out_k"][0, 0])
    r["dv"][0, 0] = dv_TxV
    r["dk"][0, 0] = r["acc_dk"][...]


def _stick_forward(plan: Plan, terms: Terms, q_BxHxLxK, k_BxHxLxK, v_BxHxLxV, segment_ids_BxL, valid_BxL, ranges):
  b, h, l, _ = q_BxHxLxK.shape
  bq, bk, value_dim = plan.block_q, plan.block_k, v_BxHxLxV.shape[-1]
  arrays = key_major_inputs(plan, q_BxHxLxK, k_BxHxLxK, v_BxHxLxV, segment_ids_BxL, valid_BxL)
  out = call_rule(_stick_forward_kernel, plan, terms, arrays,
              {"out": row_output((b, h, l, value_dim), bq, v_BxHxLxV.dtype),
               "row_sum_t": lane_row_output((b, h, 1, l), bq)},
              (b, h, l // bq, l // bk), query_major(l // bq, reverse=l // bk),
              {"acc_later": (1, bq), "acc_mass": (1, bq), "acc_out": (bq, value_dim)}, ranges[0])
  return out["out"], out["row_sum_t"]


def _stick_backward(plan: Plan, terms: Terms, q_BxHxLxK, k_BxHxLxK, v_BxHxLxV, segment_ids_BxL, valid_BxL,
                    row_sum_BxHx1xL, d_out_BxHxLxV, key_tiles_BxNx2, query_tiles_BxMx2):
  """``(dq, dk, dv)``; the dq kernel's two walks (each query's ``Σ_j da a``, then the gradients) and its carries
  (``[B, H, N, 1, L]`` float32 each, ``O(L² / block_k)``), which pass to the dk/dv kernel."""
  b, h, l, d = q_BxHxLxK.shape
  bq, bk, value_dim = plan.block_q, plan.block_k, v_BxHxLxV.shape[-1]
  n_q, n_k = l // bq, l // bk
  dov_BxHxL = stick_breaking_rows(d_out_BxHxLxV, v_BxHxLxV, terms.stick_breaking.remainder)
  arrays = {**key_major_inputs(plan, q_BxHxLxK, k_BxHxLxK, v_BxHxLxV, segment_ids_BxL, valid_BxL),
            "d_out": d_out_BxHxLxV, "dov_t": dov_BxHxL[:, :, None]}
  carry = lambda: two_walk_carry((b, h, n_k, 1, l), n_q, bq)
  dq_res = call_rule(_stick_dq_kernel, plan, terms, arrays,
                 {"dq": row_output((b, h, l, d), bq), "w_t": lane_row_output((b, h, 1, l), bq), "later_t": carry(),
                  "gain_t": carry()},
                 (b, h, n_q, 2 * n_k), two_walk_tiles(n_q, n_k),
                 {"acc_later": (1, bq), "acc_w": (1, bq), "acc_gain": (1, bq), "acc_dq": (bq, d)}, key_tiles_BxNx2)
  arrays.update(later_t=dq_res["later_t"], gain_t=dq_res["gain_t"], w_t=dq_res["w_t"], row_sum_k=row_sum_BxHx1xL,
                d_out_k=d_out_BxHxLxV)
  dkv_res = call_rule(_stick_dkv_kernel, plan, terms, arrays,
                  {"dk": row_output((b, h, l, d), bk), "dv": row_output((b, h, l, value_dim), bk)},
                  (b, h, n_k, n_q), key_major(n_k), {"acc_dk": (bk, d), "acc_dv": (bk, value_dim)},
                  query_tiles_BxMx2)
  return dq_res["dq"], group_sum(dkv_res["dk"], plan.group), group_sum(dkv_res["dv"], plan.group)


def _forward(plan: Plan, terms: Terms, q_BxHxLxK, k_BxHxLxK, v_BxHxLxV, positions_BxL, segment_ids_BxL, valid_BxL,
             salts_BxH, ranges):
  del positions_BxL, salts_BxH
  return _stick_forward(plan, terms, q_BxHxLxK, k_BxHxLxK, v_BxHxLxV, segment_ids_BxL, valid_BxL, ranges)


def _backward(plan: Plan, terms: Terms, q_BxHxLxK, k_BxHxLxK, v_BxHxLxV, positions_BxL, segment_ids_BxL, valid_BxL,
              salts_BxH, out_BxHxLxV, row_sum_BxHx1xL, ranges, d_out_BxHxLxV):
  grads = _stick_backward(plan, terms, q_BxHxLxK, k_BxHxLxK, v_BxHxLxV, segment_ids_BxL, valid_BxL, row_sum_BxHx1xL,
                          d_out_BxHxLxV, *ranges)
  return (jax.tree.map(jnp.zeros_like, terms), *grads)


attention = rule_attention(_forward, _backward, "Stick-breaking attention ``[B, H, L, V]`` of ``[B, H, L, K]`` "
                           "inputs on TPU (as :func:`posjax.kernels.mosaic.attention`).")
