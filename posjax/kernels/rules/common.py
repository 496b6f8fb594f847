"""What the two rules' kernels share on both backends: the in-tile suffix sums and stick-breaking's own-value rows.

Shapes: B batch, H heads, G key/value heads, L length, V value head dim, T tile keys.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from posjax.kernels.tile import row_delta, tile_ranges


def suffix_matrix(size: int, inclusive: bool):
  """``[T, T]`` float32 ``M[t, j] = 1`` where ``t > j`` (``inclusive``: ``t >= j``): ``x @ M`` sums each row of ``x``
  over the keys after ``j`` (from ``j`` on) within a tile."""
  t_TxT = jax.lax.broadcasted_iota(jnp.int32, (size, size), 0)
  j_TxT = jax.lax.broadcasted_iota(jnp.int32, (size, size), 1)
  return jnp.where((t_TxT >= j_TxT) if inclusive else (t_TxT > j_TxT), 1.0, 0.0).astype(jnp.float32)


def stick_breaking_rows(d_out_BxHxLxV, v_BxGxLxV, remainder: bool):
  """``[B, H, L]``: ``d_out·v_i`` with the remainder (the query's own value, its group's under grouped k/v; 0
  without), the part of the weights' gradient ``da_ij = d_out_i·v_j - d_out_i·v_i`` that is the row's own. The
  backward's row totals ``Σ_j da_ij a_ij`` are summed by its dq kernel from the weights it recomputes (a total from
  the rounded output would differ from them, and the difference reaches every key's gradient unnormalised)."""
  if not remainder:
    return jnp.zeros(d_out_BxHxLxV.shape[:3], jnp.float32)
  group = d_out_BxHxLxV.shape[1] // v_BxGxLxV.shape[1]
  return row_delta(d_out_BxHxLxV, jnp.repeat(v_BxGxLxV, group, axis=1))


def rule_attention(forward, backward, doc: str):
  """A rule's ``custom_vjp`` ``attention(plan, leaves, q, k, v, positions, segment_ids, valid, salts)`` (the
  backends' signature) from ``forward(plan, terms, *inputs, ranges) -> (out, stats)`` and ``backward(plan, terms,
  *inputs, out, stats, ranges, d_out) -> (d_terms, dq, dk, dv)``; the tile ranges
  (:func:`posjax.kernels.tile.tile_ranges`) computed once, in the forward."""

  @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
  def attention(plan, leaves, *inputs):
    return attention_fwd(plan, leaves, *inputs)[0]

  def attention_fwd(plan, leaves, *inputs):
    _, _, _, _, segment_ids_BxL, valid_BxL, _ = inputs
    ranges = tile_ranges(plan, segment_ids_BxL, valid_BxL)
    out_BxHxLxV, stats = forward(plan, plan.terms(leaves), *inputs, ranges)
    return out_BxHxLxV, (leaves, inputs, out_BxHxLxV, stats, ranges)

  def attention_bwd(plan, residuals, d_out_BxHxLxV):
    leaves, inputs, out_BxHxLxV, stats, ranges = residuals
    d_terms, *grads = backward(plan, plan.terms(leaves), *inputs, out_BxHxLxV, stats, ranges, d_out_BxHxLxV)
    return (jax.tree_util.tree_leaves(d_terms), *(g.astype(x.dtype) for g, x in zip(grads, inputs[:3])),
            None, None, None, None)

  attention.defvjp(attention_fwd, attention_bwd)
  attention.__doc__ = doc
  return attention
