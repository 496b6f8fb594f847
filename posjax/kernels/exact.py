"""Exact for every input: a fast path where it holds, a general one where it does not, chosen at run time.

Shapes: B batch, H heads, P padded length, L real length, K head dim, V value head dim.

:func:`fall_back_where` runs a fast call and, where a run-time test of its inputs or output says it does not hold
for this batch, the general one instead (``lax.cond``), forward and backward: the fast call's residuals are kept
for the backward, the general call's backward recomputes its forward (it runs only for batches that need it). Two
fast paths use it:

- a kernel that reads Shaw's / Method 4's table windowed (:class:`posjax.kernels.Relative`) takes a pair's distance
  as its index distance ``j - i``, which is its position distance only where positions rise by one inside each
  segment (posjax's packing). Other pipelines make other ids: Hugging Face's ``cumsum(mask) - 1`` with left
  padding repeats a position at the padded queries. The kernel marks every query row it misread NaN, and the call
  then runs on the dense ``xla`` path by blocks of query rows (:func:`dense`: memory linear in the length too);
- cuDNN takes padding as sequence lengths, right padding only; a batch with another layout takes its padding as a
  bias (:func:`posjax.attention.fused_attention`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from posjax.kernels import term as term_lib
from posjax.kernels import xla
from posjax.kernels.tile import Plan


def fall_back_where(fails, fast, general):
  """``(floats, others) -> out``: ``fast(*floats, *others)`` unless ``fails(out, *floats, *others)`` (a scalar
  bool computed at run time), else ``general(*floats, *others)``. ``floats``: the differentiable inputs (a tuple
  of pytrees), ``others``: the rest (ints, masks; no gradient)."""

  @jax.custom_vjp
  def call(floats, others):
    out = fast(*floats, *others)
    return jax.lax.cond(fails(out, *floats, *others), lambda: general(*floats, *others), lambda: out)

  def call_fwd(floats, others):
    out, fast_vjp = jax.vjp(lambda *xs: fast(*xs, *others), *floats)
    failed = fails(out, *floats, *others)
    out = jax.lax.cond(failed, lambda: general(*floats, *others), lambda: out)
    return out, (failed, fast_vjp, floats, others)

  def call_bwd(residuals, d_out):
    failed, fast_vjp, floats, others = residuals
    general_vjp = lambda: jax.vjp(lambda *xs: general(*xs, *others), *floats)[1](d_out)
    return jax.lax.cond(failed, general_vjp, lambda: fast_vjp(d_out)), None

  call.defvjp(call_fwd, call_bwd)
  return call


QUERY_BLOCK = 128  # the dense fallback's query rows at a time: [B, H, 128, L] alive, never [B, H, L, L]


def dense(plan: Plan, leaves, q_BxHxPxK, k_BxHxPxK, v_BxHxPxV, positions_BxP, segment_ids_BxP, valid_BxP, salts_BxH):
  """The kernel call's output ``[B, H, P, V]`` by the dense ``xla`` path on the call's padded, heads-first inputs
  (the padded rows and keys cut off first, so a fully masked row averages the real keys, as the kernels do),
  :data:`QUERY_BLOCK` query rows at a time, so that its memory grows with ``L``, not ``L²``, like the kernel's."""
  terms, n = plan.terms(leaves), plan.length
  rows = lambda x_BxHxPxX: x_BxHxPxX[:, :, :n].transpose(0, 2, 1, 3)
  if terms.untied is not None:
    u = terms.untied
    terms = terms.replace(untied=u.replace(u_q=u.u_q[:, :n], u_k=u.u_k[:, :n]))
  terms = terms.replace(open=tuple(bound.replace(arrays={
      name: bound.arrays[name][:, :, :n] if kind in (term_lib.ROWS, term_lib.EMBEDDINGS) else bound.arrays[name]
      for name, kind in bound.kinds}) for bound in terms.open))  # the open terms' rows cut like the sequence
  out_BxLxHxV = xla.attention(rows(q_BxHxPxK), rows(k_BxHxPxK), rows(v_BxHxPxV), terms,
                              positions_BxL=positions_BxP[:, :n], segment_ids_BxL=segment_ids_BxP[:, :n],
                              valid_BxL=valid_BxP[:, :n] > 0, scale=plan.scale, causal=plan.causal,
                              dropout_rate=plan.dropout, salts_BxH=salts_BxH, query_block=QUERY_BLOCK,
                              sliding_window=plan.sliding_window)
  pad = q_BxHxPxK.shape[2] - n
  return jnp.pad(out_BxLxHxV.transpose(0, 2, 1, 3), ((0, 0), (0, 0), (0, pad), (0, 0)))


def windowed(plan: Plan, kernel, fallback):
  """A windowed kernel call (``(leaves, q, k, v, positions, segment_ids, valid, salts) -> [B, H, P, V]``), or
  ``fallback`` (same signature) where one of the call's real rows comes out NaN (misread)."""
  misread = lambda out_BxHxPxV, *inputs: jnp.any(jnp.isnan(out_BxHxPxV[:, :, :plan.length]))
  call = fall_back_where(misread, kernel, fallback)
  return lambda leaves, q, k, v, *others: call((leaves, q, k, v), others)
