"""The op's ``xla`` implementation: every term materialised as ``[B, H, L, L]`` (or, by query blocks, ``[B, H, Q,
L]`` at a time) and a plain float32 softmax.

Shapes: B batch, L length, Q query rows, H heads, G key/value heads (dividing H: grouped-query attention), K head
dim, V value head dim, N query blocks.

It is the oracle the kernels are tested against. It builds each term with the formulas of
:mod:`posjax.kernels.terms` (:func:`~posjax.kernels.terms.bucket`, :func:`~posjax.kernels.terms.query_term`,
:func:`~posjax.kernels.terms.untie_cls`, ...), the ones the position methods compute too, checked against loop
references in ``tests/test_positions.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from posjax.kernels import dropout
from posjax.kernels import term as term_lib
from posjax.kernels.terms import Terms, dot_heads, expand_heads, key_term, kv_group, query_term, untie_cls


def position_bias(terms: Terms, positions_BxL, scale: float, q_BxQxHxK=None, k_BxLxHxK=None, rows_Q=None):
  """``[Bp, H, Q, L]`` float32: what every position term adds to the logits at query rows ``rows_Q`` (default all:
  ``Q = L``), None without terms. ``Bp`` is the batch of the positions (or of the terms' rows, where larger).
  Relative vectors read q and k (``q_BxQxHxK``: the rows' queries); the other terms need positions only, so an
  encoder computes them once for every layer."""
  if terms.builtin_empty():
    return None
  take = lambda x_BxLxS: x_BxLxS if rows_Q is None else jnp.take(x_BxLxS, rows_Q, axis=1)
  positions_BxL = jnp.asarray(positions_BxL, jnp.int32)
  positions_BxQ = take(positions_BxL)
  rel_BxQxL = positions_BxL[:, None, :] - positions_BxQ[:, :, None]
  is_cls_BxL, is_cls_BxQ = positions_BxL == 0, positions_BxQ == 0
  add = lambda a, b: b if a is None else a + b
  bias_BxHxQxL = None
  if terms.alibi is not None:
    bias_BxHxQxL = -terms.alibi.slopes[None, :, None, None] * jnp.abs(rel_BxQxL)[:, None].astype(jnp.float32)
  if terms.kerple is not None:
    bias_BxHxQxL = add(bias_BxHxQxL, jnp.moveaxis(terms.kerple.bias(rel_BxQxL), -1, 1))
  if terms.fire is not None:
    bias_BxHxQxL = add(bias_BxHxQxL, jnp.moveaxis(terms.fire.bias(rel_BxQxL, positions_BxQ[:, :, None]), -1, 1))
  if terms.sandwich is not None:
    bias_BxHxQxL = add(bias_BxHxQxL, terms.sandwich.bias(positions_BxQ, positions_BxL))
  if terms.forget is not None:
    bias_BxHxQxL = add(bias_BxHxQxL, terms.forget.bias(rows_Q))
  if terms.relative is not None:
    r = terms.relative
    if q_BxQxHxK is None or k_BxLxHxK is None:
      raise ValueError("relative vectors add q_i·a_r and a_r·k_j: give q and k to build their bias")
    index_BxQxL, impl = r.entries(rel_BxQxL), r.impl if rows_Q is None else "auto"
    if r.query:
      bias_BxHxQxL = add(bias_BxHxQxL, scale * query_term(q_BxQxHxK, r.table, index_BxQxL, impl).astype(jnp.float32))
    if r.key:
      key_BxGxQxL = scale * key_term(k_BxLxHxK, r.table, index_BxQxL, impl).astype(jnp.float32)
      bias_BxHxQxL = add(bias_BxHxQxL, expand_heads(key_BxGxQxL, q_BxQxHxK.shape[2]))
  positional_BxHxQxL = None
  if terms.untied is not None:
    positional_BxHxQxL = jnp.einsum("bqhd,bkhd->bhqk", take(terms.untied.u_q), terms.untied.u_k,
                                    preferred_element_type=jnp.float32)
  reset = terms.untied.reset if terms.untied is not None else "none"

  def untie(x_BxHxQxL):
    shape = (max(x_BxHxQxL.shape[0], positions_BxL.shape[0]), *x_BxHxQxL.shape[1:])
    return untie_cls(jnp.broadcast_to(x_BxHxQxL, shape), is_cls_BxL, *terms.untied.theta, is_cls_i_BxQ=is_cls_BxQ)

  if reset == "official":
    positional_BxHxQxL = untie(positional_BxHxQxL)
  if terms.buckets is not None:
    index_BxQxL = terms.buckets.entries(rel_BxQxL, is_cls_BxQ[:, :, None], is_cls_BxL[:, None, :])
    positional_BxHxQxL = add(positional_BxHxQxL,
                             jnp.take(terms.buckets.table, index_BxQxL, axis=0).transpose(0, 3, 1, 2))
  if reset == "paper":
    positional_BxHxQxL = untie(positional_BxHxQxL)
  if positional_BxHxQxL is not None:
    bias_BxHxQxL = add(bias_BxHxQxL, positional_BxHxQxL.astype(jnp.float32))
  return bias_BxHxQxL


def content_logits(q_BxQxHxK, k_BxLxHxK, terms: Terms | None, scale: float, rows_Q=None):
  """``[B, H, Q, L]`` float32: ``scale q·k``, or PaTH's ``scale q_i^T H_i ... H_{j+1} k_j`` where ``terms.path``
  (``rows_Q``: the queries' sequence rows, default all)."""
  if terms is not None and terms.path is not None:
    return scale * terms.path.content(q_BxQxHxK, k_BxLxHxK, rows_Q)
  return scale * dot_heads(q_BxQxHxK, k_BxLxHxK)


def logits(q_BxQxHxK, k_BxLxHxK, terms: Terms, positions_BxL, scale: float, rows_Q=None):
  """``[B, H, Q, L]`` float32: the content logits (:func:`content_logits`) after the open terms
  (:func:`posjax.kernels.term.dense_logits`, bound: :class:`posjax.kernels.term.Bound`), plus every built-in term
  (:func:`position_bias`); ``rows_Q``: the queries' sequence rows (default all: ``Q = L``)."""
  s_BxHxQxL = content_logits(q_BxQxHxK, k_BxLxHxK, terms, scale, rows_Q)
  if terms.open:
    s_BxHxQxL = term_lib.dense_logits(terms.open, positions_BxL, s_BxHxQxL, rows_Q)
  bias_BxHxQxL = position_bias(terms, positions_BxL, scale, q_BxQxHxK, k_BxLxHxK, rows_Q)
  return s_BxHxQxL if bias_BxHxQxL is None else s_BxHxQxL + bias_BxHxQxL


def softmax_weights(s_BxHxQxL, allowed_Bx1xQxL=None):
  """The attention weights in float32: a masked logit becomes the most negative float32, so a row without an
  allowed key averages every key (uniform weights, never NaN)."""
  if allowed_Bx1xQxL is not None:
    s_BxHxQxL = jnp.where(allowed_Bx1xQxL, s_BxHxQxL, jnp.finfo(jnp.float32).min)
  return jax.nn.softmax(s_BxHxQxL.astype(jnp.float32), axis=-1)


def attention_weights(s_BxHxQxL, allowed_Bx1xQxL=None, terms: Terms | None = None, q_BxQxHxK=None, rows_Q=None):
  """The attention weights in float32 from the logits: the terms that read the masked logits first (CoPE's, from
  the rows' queries ``q_BxQxHxK``), then the terms' weight rule (stick-breaking) or the softmax
  (:func:`softmax_weights`); ``rows_Q``: the queries' sequence rows (default all)."""
  if terms is not None and terms.cope is not None:
    if q_BxQxHxK is None:
      raise ValueError("CoPE's term is q_i·e(p_ij): give the queries to build it")
    s_BxHxQxL = s_BxHxQxL + terms.cope.term(s_BxHxQxL, allowed_Bx1xQxL, q_BxQxHxK)
  if terms is not None and terms.stick_breaking is not None:
    if terms.sink is not None:
      raise ValueError("a sink joins a softmax's denominator; stick-breaking's weights are not a softmax (give the "
                       "layer one or the other)")
    return terms.stick_breaking.weights(s_BxHxQxL, allowed_Bx1xQxL, rows_Q)
  if terms is not None and terms.sink is not None:
    if allowed_Bx1xQxL is not None:
      s_BxHxQxL = jnp.where(allowed_Bx1xQxL, s_BxHxQxL, jnp.finfo(jnp.float32).min)
    return terms.sink.weights(s_BxHxQxL)
  return softmax_weights(s_BxHxQxL, allowed_Bx1xQxL)


def weighted_values(weights_BxHxQxL, v_BxLxGxV):
  """``[B, Q, H, V]``: the weighted sum of the values, in the values' dtype; ``G`` dividing ``H`` (grouped values):
  query head h reads value head ``h // (H / G)``, with no repeated copy of the values."""
  weights_BxHxQxL = weights_BxHxQxL.astype(v_BxLxGxV.dtype)
  b, heads, q, length = weights_BxHxQxL.shape
  kv_heads = v_BxLxGxV.shape[2]
  if kv_heads == heads:
    return jnp.einsum("bhqk,bkhd->bqhd", weights_BxHxQxL, v_BxLxGxV)
  group = kv_group(heads, kv_heads)
  out_BxQxGxNxV = jnp.einsum("bgnqk,bkgd->bqgnd", weights_BxHxQxL.reshape(b, kv_heads, group, q, length), v_BxLxGxV)
  return out_BxQxGxNxV.reshape(b, q, heads, v_BxLxGxV.shape[-1])


def allowed_pairs(valid_BxL, segment_ids_BxL, causal: bool, rows_Q=None, sliding_window: int = 0):
  """``[B, 1, Q, L]`` bool: key j is real, in query i's segment, (causal) not after it and (``sliding_window``)
  fewer than ``sliding_window`` tokens from it (``rows_Q``: the queries' sequence rows, default all)."""
  length = valid_BxL.shape[-1]
  rows_Q = jnp.arange(length) if rows_Q is None else rows_Q
  segment_BxQ = jnp.take(segment_ids_BxL, rows_Q, axis=1)
  allowed_Bx1xQxL = valid_BxL[:, None, None, :] & (segment_BxQ[:, None, :, None] == segment_ids_BxL[:, None, None, :])
  if causal:
    allowed_Bx1xQxL = allowed_Bx1xQxL & (jnp.arange(length)[None, :] <= rows_Q[:, None])
  if sliding_window:
    allowed_Bx1xQxL = allowed_Bx1xQxL & (jnp.abs(rows_Q[:, None] - jnp.arange(length)[None, :]) < sliding_window)
  return allowed_Bx1xQxL


def attention(q_BxQxHxK, k_BxLxHxK, v_BxLxHxV, terms: Terms, *, positions_BxL, segment_ids_BxL, valid_BxL,
              scale: float, causal: bool, dropout_rate: float = 0.0, salts_BxH=None, query_block: int | None = None,
              sliding_window: int = 0, query_offset=None):
  """``[B, Q, H, V]``; a masked logit is the most negative float32, so a fully masked row averages all keys (a
  softmax's; stick-breaking gives it no weight, or its own value with the remainder).
  Dropout: the mask of :mod:`posjax.kernels.dropout`, the kernels' own. ``query_block``: compute ``query_block``
  query rows at a time (a loop whose blocks the backward recomputes), so no more than ``[B, H, query_block, L]``
  is alive at once; default all rows at once. ``query_offset`` (an int or a traced scalar): the queries are the
  sequence's rows ``query_offset .. query_offset + Q - 1`` of the ``L`` keys (one device's share of a sequence
  split over devices, :func:`posjax.kernels.shard.per_context_shard`); default all ``L`` rows."""
  length, queries = k_BxLxHxK.shape[1], q_BxQxHxK.shape[1]
  if query_offset is None and queries != length:
    raise ValueError(f"{queries} queries for {length} keys: give the queries' query_offset in the sequence")

  def rows(rows_Q, q_BxQxHxK):
    s_BxHxQxL = logits(q_BxQxHxK, k_BxLxHxK, terms, positions_BxL, scale, rows_Q)
    allowed_Bx1xQxL = allowed_pairs(valid_BxL, segment_ids_BxL, causal, rows_Q, sliding_window)
    weights_BxHxQxL = attention_weights(s_BxHxQxL, allowed_Bx1xQxL, terms, q_BxQxHxK, rows_Q)
    if dropout_rate:
      i_Q = jnp.arange(length, dtype=jnp.int32) if rows_Q is None else rows_Q.astype(jnp.int32)
      weights_BxHxQxL = dropout.apply(weights_BxHxQxL, salts_BxH[:, :, None, None], i_Q[:, None],
                                      jnp.arange(length, dtype=jnp.int32)[None, :], dropout_rate)
    return weighted_values(weights_BxHxQxL, v_BxLxHxV)

  offset = 0 if query_offset is None else jnp.asarray(query_offset, jnp.int32)
  if query_block is None or query_block >= queries:
    return rows(None if query_offset is None else offset + jnp.arange(queries, dtype=jnp.int32), q_BxQxHxK)
  blocks = -(-queries // query_block)
  local_NxQ = jnp.minimum(jnp.arange(blocks * query_block).reshape(blocks, query_block), queries - 1)
  block = jax.checkpoint(lambda local_Q: rows(offset + local_Q, jnp.take(q_BxQxHxK, local_Q, axis=1)))
  out_NxBxQxHxV = jax.lax.map(block, local_NxQ)
  out_BxNQxHxV = jnp.moveaxis(out_NxBxQxHxV, 0, 1).reshape(q_BxQxHxK.shape[0], blocks * query_block,
                                                            *out_NxBxQxHxV.shape[-2:])
  return out_BxNQxHxV[:, :queries]
