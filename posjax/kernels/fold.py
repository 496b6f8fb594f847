"""TUPE's untied term folded into the content dot product, so any attention kernel computes it exactly.

Shapes: B batch, Bp batch of the untied factors (1 or B), L length, H heads, K head dim, F folded head dim,
S any shape.

The untied term is exactly low rank (:class:`~posjax.kernels.terms.Untied`: ``u_q,i·u_k,j``, rank K per head),
and so is its [CLS] reset. With ``c`` the is-[CLS] flag (position 0) and ``s`` the content scale::

    q' = [q, (1-c_i) u_q,i / s, c_i θ1 / s, (1-c_i) / s]      k' = [k, (1-c_j) u_k,j, 1, c_j θ2]
    s q'·k' = s q·k + (1-c_i)(1-c_j) u_q,i·u_k,j + c_i θ1 + (1-c_i) c_j θ2

which is :func:`~posjax.kernels.terms.untie_cls` of the untied term ([CLS] row θ1, else [CLS] column θ2);
``reset="none"`` is ``q' = [q, u_q / s]``, ``k' = [k, u_k]`` (no [CLS] factors). The folded columns carry ``1/s``
so the kernel keeps its content scale: relative vectors (``scale (q·a + a·k)``, their table padded with zero
columns) stay exact. ``paper`` makes θ replace the bucket term too: its [CLS] rows and columns read two appended
zero entries instead, so it folds as well. FlashBias (Wu et al., NeurIPS 2025) folds low-rank biases the same way.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from posjax.kernels.terms import Terms

UNTIED = ("tile", "fold")


def folded_width(head_dim: int, reset: str, multiple: int = 1) -> int:
  """F: the head dim of the folded q and k, ``2K`` (+2 with a [CLS] reset) rounded up to ``multiple``."""
  width = 2 * head_dim + (0 if reset == "none" else 2)
  return -(-width // multiple) * multiple


def fold_untied(q_BxLxHxK, k_BxLxHxK, terms: Terms, positions_BxL, scale: float, *, multiple: int = 1):
  """``(q_BxLxHxF, k_BxLxHxF, terms)``: ``terms.untied`` folded into q and k (module docstring), the returned
  terms without it (bucket entries of a ``paper`` reset moved to zeros, relative table widened to F), so that
  attention with content scale ``scale`` computes the same logits. Unchanged without an untied term.

  ``positions_BxL``: ``[B or 1, L]``, position 0 marks [CLS]. ``multiple``: F is padded with zero columns to a
  multiple of it (cuDNN needs 8).
  """
  u = terms.untied
  if u is None:
    return q_BxLxHxK, k_BxLxHxK, terms
  if not math.isfinite(scale) or scale == 0:
    raise ValueError(f"the untied term folds into q and k with 1/scale, so scale must be finite and nonzero, "
                     f"not {scale}")
  if multiple < 1:
    raise ValueError(f"multiple={multiple} must be >= 1")
  shape = q_BxLxHxK.shape
  b, length, _, d = shape
  width = folded_width(d, u.reset, multiple)
  dtype = jnp.promote_types(q_BxLxHxK.dtype, k_BxLxHxK.dtype)
  is_cls_BxLx1x1 = jnp.broadcast_to(positions_BxL == 0, (b, length))[:, :, None, None]
  keep_BxLx1x1 = jnp.where(is_cls_BxLx1x1 & (u.reset != "none"), 0.0, 1.0).astype(jnp.float32)
  u_q_BxLxHxK = jnp.broadcast_to(u.u_q, shape).astype(jnp.float32)
  u_k_BxLxHxK = jnp.broadcast_to(u.u_k, shape).astype(jnp.float32)
  q_parts = [q_BxLxHxK.astype(jnp.float32), keep_BxLx1x1 * u_q_BxLxHxK / scale]
  k_parts = [k_BxLxHxK.astype(jnp.float32), keep_BxLx1x1 * u_k_BxLxHxK]
  if u.reset != "none":
    column = lambda x_S: jnp.broadcast_to(x_S, shape[:3] + (1,))
    theta_row_1x1xHx1, theta_col_1x1xHx1 = (t_H.astype(jnp.float32)[None, None, :, None] for t_H in u.theta)
    q_parts += [column((1.0 - keep_BxLx1x1) * theta_row_1x1xHx1 / scale), column(keep_BxLx1x1 / scale)]
    k_parts += [column(jnp.ones((), jnp.float32)), column((1.0 - keep_BxLx1x1) * theta_col_1x1xHx1)]
  fold = lambda parts: jnp.pad(jnp.concatenate(parts, axis=-1),
                               [(0, 0)] * 3 + [(0, width - sum(p.shape[-1] for p in parts))]).astype(dtype)
  rest = terms.replace(untied=None)
  if u.reset == "paper" and terms.buckets is not None:
    bk = terms.buckets
    n, h = bk.table.shape
    rest = rest.replace(buckets=bk.replace(table=jnp.concatenate([bk.table, jnp.zeros((2, h), bk.table.dtype)]),
                                           cls_row=n, cls_col=n + 1))
  if terms.relative is not None:
    r = terms.relative
    rest = rest.replace(relative=r.replace(table=jnp.pad(r.table, [(0, 0), (0, width - d)])))
  return fold(q_parts), fold(k_parts), rest


def fold_for_bias(q_BxLxHxK, k_BxLxHxK, v_BxLxHxV, sources, positions_BxL, scale: float, max_width: int):
  """``(q, k, v, rest)`` for a kernel that takes a bias and one head dim (cuDNN's flash attention): the untied term
  of ``sources`` (a list of :class:`~posjax.kernels.terms.Terms`) folded into q and k (:func:`fold_untied`, widths
  a multiple of 8), v padded to the same width, and ``sources`` with the untied term replaced by what is left; None
  where it does not apply (no untied term, grouped keys: the untied term is per query head, beside relative
  vectors: their dense form needs the unfolded q and k, or wider than ``max_width``)."""
  untied = [terms for terms in sources if terms.untied is not None]
  if not untied or k_BxLxHxK.shape[2] != q_BxLxHxK.shape[2] or untied[0].relative is not None:
    return None
  width = max(folded_width(q_BxLxHxK.shape[-1], untied[0].untied.reset, 8), -(-v_BxLxHxV.shape[-1] // 8) * 8)
  if width > max_width:
    return None
  q_BxLxHxF, k_BxLxHxF, rest = fold_untied(q_BxLxHxK, k_BxLxHxK, untied[0], positions_BxL, scale, multiple=8)
  widen = lambda x_BxLxHxX: jnp.pad(x_BxLxHxX, [(0, 0)] * 3 + [(0, width - x_BxLxHxX.shape[-1])])
  return (widen(q_BxLxHxF), widen(k_BxLxHxF), widen(v_BxLxHxV),
          [rest if terms is untied[0] else terms for terms in sources])


def check_untied(untied: str) -> None:
  """Raises unless ``untied`` is a known way to compute the untied term."""
  if untied not in UNTIED:
    raise ValueError(f"untied={untied!r}; allowed: {list(UNTIED)} ('tile': in each tile from its factors, "
                     "'fold': folded into q and k)")

