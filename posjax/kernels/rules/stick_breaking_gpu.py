"""Stick-breaking attention on GPU (Triton): its kernels and ``custom_vjp`` (the rule: :mod:`posjax.kernels.rules.
stick_breaking`). Each query tile walks its key tiles from the diagonal back, carrying each row's ``Σ log(1 - β)``
over the later keys; nothing to normalise. The backward's dq kernel walks twice (each row's ``Σ_j da_ij a_ij``, then
the gradients) and writes each row's two carries at every key tile (``[B, H, N, L]`` float32 each:
``O(L² / block_k)``), which the dk/dv kernel reads for its pairs; no atomics.

Shapes: B batch, H heads, G key/value heads, N key tiles, L padded length, Q/T query/key tile rows, K head dim, V
value head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from posjax.kernels.rules.common import rule_attention, stick_breaking_rows, suffix_matrix
from posjax.kernels.rules.walk_gpu import carried_dkv, carried_dq, default_block_sizes, row_totals  # noqa: F401
from posjax.kernels.terms import Terms
from posjax.kernels.tile import Plan, TileBase, dot, dot_t, group_sum
from posjax.kernels.triton import call, kernel_inputs, range_spec, row_spec
from posjax.kernels.triton_kernels import Tile, tile_range


def stick_breaking_tile(tile: TileBase, later_Q, precision):
  """One tile of stick-breaking attention (:class:`posjax.kernels.StickBreaking`) given ``later_Q``, each row's
  ``Σ log(1 - β)`` over the allowed keys of the key tiles after this one: ``(allowed_QxT, rest_QxT, a_QxT)``, the
  keys that take a share (the query's own left out unless ``attend_current``), their ``log(1 - β)`` (0 elsewhere)
  and their weights ``β_ij Π_{k > j} (1 - β_ik)``, summed in log space (the tile's part a product with
  :func:`suffix_matrix` at ``precision``)."""
  allowed_QxT = tile.allowed_QxT
  if not tile.terms.stick_breaking.attend_current:
    allowed_QxT = allowed_QxT & (tile.index_i_QxT != tile.index_j_QxT)
  z_QxT = tile.s_QxT
  rest_QxT = jnp.where(allowed_QxT, jax.nn.log_sigmoid(-z_QxT), 0.0)
  later_QxT = dot(rest_QxT, suffix_matrix(z_QxT.shape[1], inclusive=False), precision) + later_Q[:, None]
  a_QxT = jnp.where(allowed_QxT, jnp.exp(jax.nn.log_sigmoid(z_QxT) + later_QxT), 0.0)
  return allowed_QxT, rest_QxT, a_QxT


def stick_breaking_grads(tile: TileBase, allowed_QxT, a_QxT, da_QxT, before_Q, precision):
  """The logits' gradient of a stick-breaking tile from its weights' ``da``: ``dz_ij = da_ij a_ij (1 - β_ij) - β_ij
  Σ_{k < j} da_ik a_ik``, the sum over the row's earlier keys ``before_Q - Σ_{k >= j in the tile}`` (``before_Q``:
  the row's ``Σ_k da a`` less the key tiles after this one); and ``da a`` (its row sums carry to the earlier
  tiles)."""
  z_QxT = tile.s_QxT
  gain_QxT = da_QxT * a_QxT
  earlier_QxT = before_Q[:, None] - dot(gain_QxT, suffix_matrix(z_QxT.shape[1], inclusive=True), precision)
  dz_QxT = gain_QxT * jax.nn.sigmoid(-z_QxT) - jax.nn.sigmoid(z_QxT) * earlier_QxT
  return jnp.where(allowed_QxT, dz_QxT, 0.0), gain_QxT


def stick_forward_kernel(plan: Plan, terms: Terms, names, *refs):
  """One query tile's output rows, its key tiles from the last back, and each row's weight sum ``Σ_j a_ij`` (the
  remainder's share, ``1 -`` it, goes to the query's own value)."""
  r = dict(zip(names, refs))
  bq, i0 = plan.block_q, pl.program_id(2) * plan.block_q
  lo, hi = tile_range(r)

  def body(step, carry):
    later_Q, mass_Q, acc_QxV = carry
    tile = Tile(plan, terms, r, i0, (hi - 1 - step) * plan.block_k)
    _, rest_QxT, a_QxT = stick_breaking_tile(tile, later_Q, tile._exact())
    v_TxV = r["v"][0, 0, tile.cols, :]
    return (later_Q + jnp.sum(rest_QxT, axis=1), mass_Q + jnp.sum(a_QxT, axis=1),
            acc_QxV + dot(a_QxT.astype(v_TxV.dtype), v_TxV))

  init = (jnp.zeros((bq,), jnp.float32), jnp.zeros((bq,), jnp.float32),
          jnp.zeros((bq, r["v"].shape[-1]), jnp.float32))
  _, mass_Q, acc_QxV = jax.lax.fori_loop(0, hi - lo, body, init)
  if terms.stick_breaking.remainder:
    acc_QxV = acc_QxV + (1.0 - mass_Q)[:, None] * r["v"][0, 0, pl.ds(i0, bq), :].astype(jnp.float32)
  r["out"][0, 0, :, :] = acc_QxV.astype(r["out"].dtype)
  r["row_sum"][0, 0, :] = mass_Q


def _stick_tile(plan: Plan, terms: Terms, r: dict, tile: Tile, later_Q, before_Q):
  """A stick-breaking tile's weights, logits' gradient and ``da a`` (:func:`stick_breaking_grads`) from its rows'
  carries."""
  allowed_QxT, rest_QxT, a_QxT = stick_breaking_tile(tile, later_Q, tile._exact())
  da_QxT = dot_t(r["d_out"][0, 0, tile.rows, :], r["v"][0, 0, tile.cols, :]) - r["dov"][0, 0, tile.rows][:, None]
  dz_QxT, gain_QxT = stick_breaking_grads(tile, allowed_QxT, a_QxT, da_QxT, before_Q, tile._exact())
  return rest_QxT, a_QxT, dz_QxT, gain_QxT


def stick_dq_kernel(plan: Plan, terms: Terms, names, *refs):
  """One query tile's ``dq`` and each row's ``w = Σ_j da_ij a_ij`` (a first walk), its key tiles from the last back,
  and the two carries each of them starts from (``later``: Σ log(1 - β) over the later keys; ``gain``: Σ da·a over
  them), which the dk/dv kernel reads with ``w``."""
  r = dict(zip(names, refs))

  def tile_sums(tile, later_Q):
    rest_QxT, _, _, gain_QxT = _stick_tile(plan, terms, r, tile, later_Q, jnp.zeros_like(later_Q))
    return jnp.sum(rest_QxT, axis=1), jnp.sum(gain_QxT, axis=1)

  w_Q = row_totals(plan, terms, r, tile_sums)

  def tile_grads(tile, later_Q, gain_Q):
    rest_QxT, _, dz_QxT, gain_QxT = _stick_tile(plan, terms, r, tile, later_Q, w_Q - gain_Q)
    return dz_QxT, (jnp.sum(rest_QxT, axis=1), jnp.sum(gain_QxT, axis=1))

  r["dq"][0, 0, :, :] = carried_dq(plan, terms, r, ("later", "gain"), tile_grads)
  r["w"][0, 0, :] = w_Q


def stick_dkv_kernel(plan: Plan, terms: Terms, names, *refs):
  """One key tile's ``dk`` and ``dv`` from the query tiles that visit it, each row's carries at this key tile as the
  dq kernel wrote them; with the remainder, ``dv_j`` also takes ``(1 - Σ_k a_jk) d_out_j`` (query j's own value)."""
  r = dict(zip(names, refs))

  def tile_grads(tile, n):
    later_Q, gain_Q = r["later"][0, 0, n, tile.rows], r["gain"][0, 0, n, tile.rows]
    _, a_QxT, dz_QxT, _ = _stick_tile(plan, terms, r, tile, later_Q, r["w"][0, 0, tile.rows] - gain_Q)
    return dz_QxT, a_QxT

  dk_TxK, dv_TxV = carried_dkv(plan, terms, r, tile_grads)
  if terms.stick_breaking.remainder:
    cols = pl.ds(pl.program_id(2) * plan.block_k, plan.block_k)
    dv_TxV = dv_TxV + (1.0 - r["row_sum"][0, 0, cols])[:, None] * r["d_out"][0, 0, cols, :].astype(jnp.float32)
  r["dk"][0, 0, :, :] = dk_TxK
  r["dv"][0, 0, :, :] = dv_TxV


def _stick_breaking_bwd(plan: Plan, terms: Terms, inputs: dict, specs: dict, row_sum_BxHxL, v_BxGxLxV, d_out_BxHxLxV,
                        key_tiles_BxNx2, query_tiles_BxMx2):
  """``(dq, dk, dv)`` of stick-breaking attention: the dq kernel walks each query tile's key tiles from the last back
  and writes the rows' two carries at every key tile (``[B, H, N, L]`` float32 each: ``O(L² / block_k)``), which the
  dk/dv kernel reads for its pairs; no atomics."""
  b, h, l, d = inputs["q"].shape
  n_q, n_k = l // plan.block_q, l // plan.block_k
  inputs = {**inputs, "row_sum": row_sum_BxHxL,
            "dov": stick_breaking_rows(d_out_BxHxLxV, v_BxGxLxV, terms.stick_breaking.remainder)}
  row = pl.BlockSpec((1, 1, l), lambda b, h, i: (b, h, 0))
  specs = {**specs, "row_sum": row, "dov": row}
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  carry_tile = pl.BlockSpec((1, 1, n_k, plan.block_q), lambda b, h, i: (b, h, 0, i))
  dq_res = call(stick_dq_kernel, plan, terms, {**inputs, "tiles": key_tiles_BxNx2}, {**specs, "tiles": range_spec()},
                 {"dq": f32(b, h, l, d), "later": f32(b, h, n_k, l), "gain": f32(b, h, n_k, l), "w": f32(b, h, l)},
                 {"dq": row_spec(inputs["q"], plan.block_q), "later": carry_tile, "gain": carry_tile,
                  "w": pl.BlockSpec((1, 1, plan.block_q), lambda b, h, i: (b, h, i))}, n_q)
  carry_rows = pl.BlockSpec((1, 1, n_k, l), lambda b, h, i: (b, h, 0, 0))
  dkv_res = call(stick_dkv_kernel, plan, terms,
                  {**inputs, "later": dq_res["later"], "gain": dq_res["gain"], "w": dq_res["w"],
                   "tiles": query_tiles_BxMx2},
                  {**specs, "later": carry_rows, "gain": carry_rows, "w": row, "tiles": range_spec()},
                  {"dk": f32(b, h, l, d), "dv": f32(b, h, l, v_BxGxLxV.shape[-1])},
                  {"dk": row_spec(inputs["q"], plan.block_k), "dv": row_spec(inputs["d_out"], plan.block_k)}, n_k)
  return dq_res["dq"], group_sum(dkv_res["dk"], plan.group), group_sum(dkv_res["dv"], plan.group)


def _forward(plan: Plan, terms: Terms, q_BxHxLxK, k_BxHxLxK, v_BxHxLxV, positions_BxL, segment_ids_BxL, valid_BxL,
             salts_BxH, ranges):
  b, h, l, _ = q_BxHxLxK.shape
  inputs, specs = kernel_inputs(plan, terms, q_BxHxLxK, k_BxHxLxK, v_BxHxLxV, positions_BxL, segment_ids_BxL,
                                valid_BxL, salts_BxH, {})
  inputs["tiles"], specs["tiles"] = ranges[0], range_spec()
  out = call(stick_forward_kernel, plan, terms, inputs, specs,  # each row's weight sum, no maximum
             {"out": jax.ShapeDtypeStruct((b, h, l, v_BxHxLxV.shape[-1]), v_BxHxLxV.dtype),
              "row_sum": jax.ShapeDtypeStruct((b, h, l), jnp.float32)},
             {"out": row_spec(v_BxHxLxV, plan.block_q),
              "row_sum": pl.BlockSpec((1, 1, plan.block_q), lambda b, h, i: (b, h, i))}, l // plan.block_q)
  return out["out"], out["row_sum"]


def _backward(plan: Plan, terms: Terms, q_BxHxLxK, k_BxHxLxK, v_BxHxLxV, positions_BxL, segment_ids_BxL, valid_BxL,
              salts_BxH, out_BxHxLxV, row_sum_BxHxL, ranges, d_out_BxHxLxV):
  del out_BxHxLxV
  arrays, specs = kernel_inputs(plan, terms, q_BxHxLxK, k_BxHxLxK, v_BxHxLxV, positions_BxL, segment_ids_BxL,
                                valid_BxL, salts_BxH, {"d_out": d_out_BxHxLxV})
  grads = _stick_breaking_bwd(plan, terms, arrays, specs, row_sum_BxHxL, v_BxHxLxV, d_out_BxHxLxV, *ranges)
  return (jax.tree.map(jnp.zeros_like, terms), *grads)


attention = rule_attention(_forward, _backward, "Stick-breaking attention ``[B, H, L, V]`` of ``[B, H, L, K]`` "
                           "inputs on GPU (as :func:`posjax.kernels.triton.attention`).")
