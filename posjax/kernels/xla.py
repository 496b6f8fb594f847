"""The op's ``xla`` implementation: every term materialised as ``[B, H, L, L]`` and a plain float32 softmax.

It is the oracle the kernels are tested against. It builds each term with the position modules' own helpers
(:func:`posjax.positions.t5.bucket`, :func:`posjax.positions.relative.query_term`,
:func:`posjax.positions.tupe.untie_cls`), which are checked against loop references in ``tests/test_positions.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from posjax.kernels import dropout
from posjax.kernels.terms import Terms
from posjax.positions import base, relative, tupe


def logits(q_BxLxHxK, k_BxLxHxK, terms: Terms, positions_BxL, scale: float):
  """``[B, H, L, L]`` float32: ``scale q·k`` plus every position term."""
  rel_BxLxL = base.relative_positions(positions_BxL)
  is_cls_BxL = positions_BxL == 0
  out = scale * jnp.einsum("bqhd,bkhd->bhqk", q_BxLxHxK, k_BxLxHxK, preferred_element_type=jnp.float32)
  if terms.alibi is not None:
    out = out - terms.alibi.slopes[None, :, None, None] * jnp.abs(rel_BxLxL)[:, None].astype(jnp.float32)
  if terms.relative is not None:
    r = terms.relative
    index = r.entries(rel_BxLxL)
    if r.query:
      out = out + scale * relative.query_term(q_BxLxHxK, r.table, index, "table").astype(jnp.float32)
    if r.key:
      out = out + scale * relative.key_term(k_BxLxHxK, r.table, index, "table").astype(jnp.float32)
  positional = 0.0
  if terms.untied is not None:
    positional = base.dot_heads(terms.untied.u_q, terms.untied.u_k).astype(jnp.float32)
  reset = terms.untied.reset if terms.untied is not None else "none"
  if reset == "official":
    positional = tupe.untie_cls(jnp.broadcast_to(positional, out.shape), is_cls_BxL, *terms.untied.theta)
  if terms.buckets is not None:
    index = terms.buckets.entries(rel_BxLxL, is_cls_BxL[:, :, None], is_cls_BxL[:, None, :])
    positional = positional + jnp.take(terms.buckets.table, index, axis=0).transpose(0, 3, 1, 2)
  if reset == "paper":
    positional = tupe.untie_cls(jnp.broadcast_to(positional, out.shape), is_cls_BxL, *terms.untied.theta)
  return out + positional


def allowed_pairs(valid_BxL, segment_ids_BxL, causal: bool):
  """``[B, 1, L, L]`` bool: key j is real, in query i's segment and (causal) not after it."""
  allowed = valid_BxL[:, None, None, :] & (segment_ids_BxL[:, None, :, None] == segment_ids_BxL[:, None, None, :])
  if causal:
    length = valid_BxL.shape[-1]
    allowed = allowed & jnp.tril(jnp.ones((length, length), bool))
  return allowed


def attention(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, terms: Terms, *, positions_BxL, segment_ids_BxL, valid_BxL,
              scale: float, causal: bool, dropout_rate: float = 0.0, salts_BxH=None):
  """``[B, L, H, K]``; a masked logit is the most negative float32, so a fully masked row averages all keys.
  Dropout: the mask of :mod:`posjax.kernels.dropout`, the kernels' own."""
  s = logits(q_BxLxHxK, k_BxLxHxK, terms, positions_BxL, scale)
  s = jnp.where(allowed_pairs(valid_BxL, segment_ids_BxL, causal), s, jnp.finfo(jnp.float32).min)
  weights = jax.nn.softmax(s, axis=-1)
  if dropout_rate:
    length = s.shape[-1]
    i = jnp.arange(length, dtype=jnp.int32)
    weights = dropout.apply(weights, salts_BxH[:, :, None, None], i[:, None], i[None, :], dropout_rate)
  return jnp.einsum("bhqk,bkhd->bqhd", weights.astype(v_BxLxHxK.dtype), v_BxLxHxK)
