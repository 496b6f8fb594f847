"""Windowed relative vectors, exact for any positions: the kernel where its window reads the right rows, the dense
``xla`` path where it does not.

Shapes: B batch, H heads, P padded length, L real length, K head dim, V value head dim.

A kernel that reads Shaw's / Method 4's table windowed (:class:`posjax.kernels.Relative`) takes a pair's distance as
its index distance ``j - i``, which is its position distance only where positions rise by one inside each segment
(posjax's packing). Other pipelines make other ids: Hugging Face's ``cumsum(mask) - 1`` with left padding repeats a
position at the padded queries. The kernel flags every query row it misread (NaN); :func:`exact_where_misread`
then computes the call on the dense path instead, at run time (``lax.cond``), forward and backward: the same
numbers as ``xla`` for every input, at the kernel's cost and memory wherever the window holds.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from posjax.kernels import xla
from posjax.kernels.tile import Plan


def dense(plan: Plan, leaves, q_BxHxPxK, k_BxHxPxK, v_BxHxPxV, positions_BxP, segment_ids_BxP, valid_BxP, salts_BxH):
  """The kernel call's output ``[B, H, P, V]`` by the dense ``xla`` path on the call's padded, heads-first inputs
  (the padded rows and keys cut off first, so a fully masked row averages the real keys, as the kernels do)."""
  terms, n = plan.terms(leaves), plan.length
  rows = lambda x_BxHxPxX: x_BxHxPxX[:, :, :n].transpose(0, 2, 1, 3)
  if terms.untied is not None:
    u = terms.untied
    terms = terms.replace(untied=u.replace(u_q=u.u_q[:, :n], u_k=u.u_k[:, :n]))
  out_BxLxHxV = xla.attention(rows(q_BxHxPxK), rows(k_BxHxPxK), rows(v_BxHxPxV), terms,
                              positions_BxL=positions_BxP[:, :n], segment_ids_BxL=segment_ids_BxP[:, :n],
                              valid_BxL=valid_BxP[:, :n] > 0, scale=plan.scale, causal=plan.causal,
                              dropout_rate=plan.dropout, salts_BxH=salts_BxH)
  pad = q_BxHxPxK.shape[2] - n
  return jnp.pad(out_BxLxHxV.transpose(0, 2, 1, 3), ((0, 0), (0, 0), (0, pad), (0, 0)))


def exact_where_misread(plan: Plan, kernel, fallback):
  """``kernel`` (a windowed call, ``(leaves, q, k, v, positions, segment_ids, valid, salts) -> [B, H, P, V]``)
  where none of the call's real rows is misread (NaN), else ``fallback`` (same signature): chosen at run time, and
  the backward follows the forward's choice (the fallback's is recomputed; the kernel's residuals are kept)."""

  def misread(out_BxHxPxV):
    return jnp.any(jnp.isnan(out_BxHxPxV[:, :, :plan.length]))

  @jax.custom_vjp
  def call(leaves, q_BxHxPxK, k_BxHxPxK, v_BxHxPxV, ints):
    out_BxHxPxV = kernel(leaves, q_BxHxPxK, k_BxHxPxK, v_BxHxPxV, *ints)
    return jax.lax.cond(misread(out_BxHxPxV), lambda: fallback(leaves, q_BxHxPxK, k_BxHxPxK, v_BxHxPxV, *ints),
                        lambda: out_BxHxPxV)

  def call_fwd(leaves, q_BxHxPxK, k_BxHxPxK, v_BxHxPxV, ints):
    floats = (leaves, q_BxHxPxK, k_BxHxPxK, v_BxHxPxV)
    out_BxHxPxV, kernel_vjp = jax.vjp(lambda *xs: kernel(*xs, *ints), *floats)
    bad = misread(out_BxHxPxV)
    out_BxHxPxV = jax.lax.cond(bad, lambda: fallback(*floats, *ints), lambda: out_BxHxPxV)
    return out_BxHxPxV, (bad, kernel_vjp, floats, ints)

  def call_bwd(residuals, d_out_BxHxPxV):
    bad, kernel_vjp, floats, ints = residuals
    fallback_vjp = lambda: jax.vjp(lambda *xs: fallback(*xs, *ints), *floats)[1](d_out_BxHxPxV)
    grads = jax.lax.cond(bad, fallback_vjp, lambda: kernel_vjp(d_out_BxHxPxV))
    return (*grads, None)

  call.defvjp(call_fwd, call_bwd)
  return lambda leaves, q, k, v, *ints: call(leaves, q, k, v, ints)

