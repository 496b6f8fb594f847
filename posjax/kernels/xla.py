"""The op's ``xla`` implementation: every term materialised as ``[B, H, L, L]`` and a plain float32 softmax.

Shapes: B batch, L length, H heads, K head dim, V value head dim.

It is the oracle the kernels are tested against. It builds each term with the formulas of
:mod:`posjax.kernels.terms` (:func:`~posjax.kernels.terms.bucket`, :func:`~posjax.kernels.terms.query_term`,
:func:`~posjax.kernels.terms.untie_cls`, ...), the ones the position methods compute too, checked against loop
references in ``tests/test_positions.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from posjax.kernels import dropout
from posjax.kernels.terms import Terms, dot_heads, key_term, query_term, relative_positions, untie_cls


def logits(q_BxLxHxK, k_BxLxHxK, terms: Terms, positions_BxL, scale: float):
  """``[B, H, L, L]`` float32: ``scale q·k`` plus every position term."""
  rel_BxLxL = relative_positions(positions_BxL)
  is_cls_BxL = positions_BxL == 0
  s_BxHxLxL = scale * jnp.einsum("bqhd,bkhd->bhqk", q_BxLxHxK, k_BxLxHxK, preferred_element_type=jnp.float32)
  if terms.alibi is not None:
    s_BxHxLxL = s_BxHxLxL - terms.alibi.slopes[None, :, None, None] * jnp.abs(rel_BxLxL)[:, None].astype(jnp.float32)
  if terms.relative is not None:
    r = terms.relative
    index_BxLxL = r.entries(rel_BxLxL)
    if r.query:
      s_BxHxLxL = s_BxHxLxL + scale * query_term(q_BxLxHxK, r.table, index_BxLxL, "table").astype(jnp.float32)
    if r.key:
      s_BxHxLxL = s_BxHxLxL + scale * key_term(k_BxLxHxK, r.table, index_BxLxL, "table").astype(jnp.float32)
  positional_BxHxLxL = 0.0
  if terms.untied is not None:
    positional_BxHxLxL = dot_heads(terms.untied.u_q, terms.untied.u_k).astype(jnp.float32)
  reset = terms.untied.reset if terms.untied is not None else "none"
  if reset == "official":
    positional_BxHxLxL = untie_cls(jnp.broadcast_to(positional_BxHxLxL, s_BxHxLxL.shape), is_cls_BxL,
                                   *terms.untied.theta)
  if terms.buckets is not None:
    index_BxLxL = terms.buckets.entries(rel_BxLxL, is_cls_BxL[:, :, None], is_cls_BxL[:, None, :])
    positional_BxHxLxL = (positional_BxHxLxL
                          + jnp.take(terms.buckets.table, index_BxLxL, axis=0).transpose(0, 3, 1, 2))
  if reset == "paper":
    positional_BxHxLxL = untie_cls(jnp.broadcast_to(positional_BxHxLxL, s_BxHxLxL.shape), is_cls_BxL,
                                   *terms.untied.theta)
  return s_BxHxLxL + positional_BxHxLxL


def allowed_pairs(valid_BxL, segment_ids_BxL, causal: bool):
  """``[B, 1, L, L]`` bool: key j is real, in query i's segment and (causal) not after it."""
  allowed_Bx1xLxL = (valid_BxL[:, None, None, :]
                     & (segment_ids_BxL[:, None, :, None] == segment_ids_BxL[:, None, None, :]))
  if causal:
    length = valid_BxL.shape[-1]
    allowed_Bx1xLxL = allowed_Bx1xLxL & jnp.tril(jnp.ones((length, length), bool))
  return allowed_Bx1xLxL


def attention(q_BxLxHxK, k_BxLxHxK, v_BxLxHxV, terms: Terms, *, positions_BxL, segment_ids_BxL, valid_BxL,
              scale: float, causal: bool, dropout_rate: float = 0.0, salts_BxH=None):
  """``[B, L, H, V]``; a masked logit is the most negative float32, so a fully masked row averages all keys.
  Dropout: the mask of :mod:`posjax.kernels.dropout`, the kernels' own."""
  s_BxHxLxL = logits(q_BxLxHxK, k_BxLxHxK, terms, positions_BxL, scale)
  s_BxHxLxL = jnp.where(allowed_pairs(valid_BxL, segment_ids_BxL, causal), s_BxHxLxL, jnp.finfo(jnp.float32).min)
  weights_BxHxLxL = jax.nn.softmax(s_BxHxLxL, axis=-1)
  if dropout_rate:
    length = s_BxHxLxL.shape[-1]
    i_L = jnp.arange(length, dtype=jnp.int32)
    weights_BxHxLxL = dropout.apply(weights_BxHxLxL, salts_BxH[:, :, None, None], i_L[:, None], i_L[None, :],
                                    dropout_rate)
  return jnp.einsum("bhqk,bkhd->bqhd", weights_BxHxLxL.astype(v_BxLxHxV.dtype), v_BxLxHxV)
