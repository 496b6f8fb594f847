"""Flash attention in Pallas with the position terms built inside each tile: the GPU (Triton) kernels of the op's
``pallas`` implementation (TPU: :mod:`posjax.kernels.mosaic`).

Three Triton-style kernels over a ``(batch, head, tile)`` grid, each reading its (batch, head) rows and looping
over the other side's tiles: the forward (online softmax; saves each row's maximum and sum), the ``dq`` kernel
(one query tile against every key tile) and the ``dk/dv`` kernel (one key tile against every query tile). Every tile
recomputes its logits from the tile's positions, segment ids and the terms' small inputs
(:mod:`posjax.kernels.terms`), so no ``[B, H, L, L]`` array exists, forward or backward.

Gradients of the position inputs, all without atomics (deterministic):

- bucket table, θ and ALiBi slopes (a scalar per head: cheap, and exact should one learn them): the ``dq`` kernel
  writes per-(batch, head, query tile) partial sums, summed after it;
- TUPE's ``u_q`` / ``u_k``: rows of the ``dq`` / ``dk`` kernel, like ``dq`` / ``dk`` themselves;
- relative vectors, gathered (``Relative.window=False``): ``qe = scale q·a_r`` and ``ke = scale k·a_r``
  (``[B, H, L, 2k+1]``) are computed outside the kernel and gathered per tile; their gradients are rows of the
  ``dq`` / ``dk`` kernels, and ``dq += scale dqe·a``, ``da = scale (dqeᵀq + dkeᵀk)`` outside. ``O(L·k)`` memory:
  small for a clipped ``k``, ``O(L²)`` at ``k = max_len - 1``;
- relative vectors, windowed (``window=True``; ``O(L)`` for any ``k``): the table is laid out by distance
  (``[2L, K]``, clipped rows repeated), a tile (i0, j0) reads the ``2·block`` rows from ``j0 - i0 - block``
  and skews ``q_tile·windowᵀ`` (and ``k_tile·windowᵀ``) into its logits; ``dq`` / ``dk`` take the unskewed
  ``ds`` times the window inside their kernels, and a fourth kernel, one program per tile diagonal (whose
  tiles share a window), sums the window's gradient along the diagonal: per-(batch, head, diagonal) partials
  added by halves into the ``[2L, K]`` layout and folded back into the table (clipped ends summed).

Per-pair lookups (``qe``, ``ke``, the bucket table, the window's skew through a per-program scratch block) are
gather loads from refs (Triton lowers integer-array indexers to pointer gathers); the backward's scatter of a
pair's gradient to its distance or bucket is a one-hot product summed (deterministic, exact for any positions; no batched matmul,
which Triton does not lower).

Attention dropout: each tile rebuilds its mask from a hash of the (batch row, head) salt and the pair's indices
(:mod:`posjax.kernels.dropout`), in the forward and again in the backward; nothing is stored.

A masked logit is the most negative float32 (not -inf) so that a fully masked row averages every key, as the
``xla`` path does; keys past the sequence (block padding) are -inf, so they never count.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from posjax.kernels import dropout as dropout_lib
from posjax.kernels.terms import Terms

MASKED = float(jnp.finfo(jnp.float32).min)


@dataclasses.dataclass(frozen=True)
class Plan:
  """Everything static about one call: hashable, so it is a ``custom_vjp`` non-differentiable argument."""

  scale: float
  causal: bool
  block_q: int
  block_k: int
  length: int  # the real sequence length (inputs are padded to a multiple of both blocks)
  interpret: Any  # False, True or the TPU interpreter's parameters
  treedef: jax.tree_util.PyTreeDef  # of the Terms (its static options included)
  dropout: float = 0.0  # the rate on the attention weights (mask: posjax.kernels.dropout)

  def terms(self, leaves) -> Terms:
    return jax.tree_util.tree_unflatten(self.treedef, leaves)


def _dot(a, b, contract=((1,), (0,))):
  return jax.lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32)


def _dot_t(a, b):
  """``a @ b.T``."""
  return _dot(a, b, ((1,), (1,)))


def _t_dot(a, b):
  """``a.T @ b``."""
  return _dot(a, b, ((0,), (0,)))


def _one_hot(index, size: int):
  return (index[..., None] == jax.lax.broadcasted_iota(jnp.int32, (*index.shape, size), index.ndim)).astype(
      jnp.float32)


class TileBase:
  """What the tiles of both backends (this module's and :mod:`posjax.kernels.mosaic`'s) share, given their own
  loads through the hooks ``_slope``, ``_relative_term``, ``_untied_factors``, ``_bucket_values``, ``_theta``
  and ``_salt``: the position terms and the [CLS] reset, the mask and the logits, dropout, and the routing of the
  logits' gradient to the untied and bucket terms. ``cls_i`` / ``cls_j``: [CLS] flags broadcastable to the tile."""

  plan: Plan
  terms: Terms

  def _position_terms(self, s, rel):
    """``s`` plus every position term of the pairs at relative positions ``rel``."""
    terms = self.terms
    if terms.alibi is not None:
      self.distance = jnp.abs(rel).astype(jnp.float32)
      s = s - self._slope() * self.distance
    if terms.relative is not None:
      s = s + self._relative_term(rel)
    self.reset = terms.untied.reset if terms.untied is not None else "none"
    self.neither = ~self.cls_i & ~self.cls_j
    positional = jnp.zeros_like(s)
    if terms.untied is not None:
      self.u_q, self.u_k = self._untied_factors()
      positional = _dot_t(self.u_q, self.u_k)
    if self.reset == "official":
      positional = self._untie(positional)
    if terms.buckets is not None:
      self.bucket_index = terms.buckets.entries(rel, self.cls_i, self.cls_j)  # [bq, bk]
      positional = positional + self._bucket_values(self.bucket_index)
    if self.reset == "paper":
      positional = self._untie(positional)
    return s + positional

  def _untie(self, positional):
    theta_row, theta_col = self._theta()
    positional = jnp.where(self.cls_j, theta_col, positional)
    return jnp.where(self.cls_i, theta_row, positional)

  def _mask(self, s, allowed, index_i, index_j):
    """The tile's logits: masked pairs the most negative float32, keys past the sequence -inf."""
    if self.plan.causal:
      allowed = allowed & (index_j <= index_i)
    self.allowed = allowed
    self.index_i, self.index_j = index_i, index_j
    self.logits = jnp.where(index_j < self.plan.length, jnp.where(allowed, s, MASKED), -jnp.inf)

  def dropped(self, x):
    """``x`` with this tile's dropout applied; ``x`` without dropout."""
    if not self.plan.dropout:
      return x
    return dropout_lib.apply(x, self._salt(), self.index_i, self.index_j, self.plan.dropout)

  def position_grads(self, ds):
    """``ds``'s share for the untied and bucket terms: ``(d corr, d bucket term)``."""
    untied = ds if self.reset == "none" else jnp.where(self.neither, ds, 0.0)
    bucket = jnp.where(self.neither, ds, 0.0) if self.reset == "paper" else ds
    return untied, bucket


class _Tile(TileBase):
  """One (query tile, key tile) pair: its logits, mask and what the backward needs to route gradients."""

  def __init__(self, plan: Plan, terms: Terms, refs: dict, i0, j0):
    bq, bk = plan.block_q, plan.block_k
    self.plan, self.terms, self.refs, self.i0, self.j0 = plan, terms, refs, i0, j0
    rows, cols = pl.ds(i0, bq), pl.ds(j0, bk)
    self.rows, self.cols = rows, cols
    self.q, self.k = refs["q"][0, 0, rows, :], refs["k"][0, 0, cols, :]
    pos_i, pos_j = refs["positions"][0, rows], refs["positions"][0, cols]
    rel = pos_j[None, :] - pos_i[:, None]
    self.cls_i, self.cls_j = (pos_i == 0)[:, None], (pos_j == 0)[None, :]
    s = self._position_terms(plan.scale * _dot_t(self.q, self.k), rel)
    valid_j = refs["valid"][0, cols] > 0
    allowed = valid_j[None, :] & (refs["segment_ids"][0, rows][:, None] == refs["segment_ids"][0, cols][None, :])
    index_i = i0 + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
    index_j = j0 + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    self._mask(s, allowed, index_i, index_j)

  def _slope(self):
    return self.refs["slopes"][0, 0]

  def _untied_factors(self):
    return self.refs["u_q"][0, 0, self.rows, :], self.refs["u_k"][0, 0, self.cols, :]

  def _bucket_values(self, index):
    return self._gather("bucket_table", None, index)

  def _theta(self):
    return (self.refs["theta_row"][0, 0].astype(jnp.float32), self.refs["theta_col"][0, 0].astype(jnp.float32))

  def _salt(self):
    return self.refs["salts"][0, 0]

  def _relative_term(self, rel):
    """The relative-vector logits: gathered from ``qe`` / ``ke``, or (window) from the tile's products with the
    ``2·block`` table rows its index distances reach, skewed: pair (a, c) has distance ``j0 - i0 + c - a``,
    window row ``c - a + block``."""
    r, i0, j0 = self.terms.relative, self.i0, self.j0
    bq, bk = self.plan.block_q, self.plan.block_k
    row = jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    term = jnp.zeros((bq, bk), jnp.float32)
    if not r.window:
      self.rel_index = r.entries(rel)  # [bq, bk]
      if r.query:
        term = term + self._gather("qe", i0 + row, self.rel_index)
      if r.key:
        term = term + self._gather("ke", j0 + col, self.rel_index)
      return term
    self.skew_index = col - row + bq
    self.misplaced = (rel != j0 - i0 + col - row) & (i0 + row < self.plan.length)
    start = j0 - i0 - bq + self.refs["q"].shape[2]
    self.e_win = self.refs["window_table"][pl.ds(start, 2 * bq), :]  # [2 bq, K]
    if r.query:
      term = term + self._skew(self.plan.scale * _dot_t(self.q, self.e_win.astype(self.q.dtype)), key=False)
    if r.key:
      term = term + self._skew(self.plan.scale * _dot_t(self.k, self.e_win.astype(self.k.dtype)), key=True)
    return term

  def _skew(self, x, key: bool):
    """``[bq, 2 bq]`` window products to ``[bq, bk]`` logits: ``out[a, c] = x[a or c, c - a + bq]`` (a on the
    query side, c on the key side), through this program's scratch block in memory (a register array cannot be
    gathered from)."""
    scratch = self.refs["scratch"]
    _barrier(self.plan)
    scratch[0, 0, 0, :, :] = x
    _barrier(self.plan)
    source = jax.lax.broadcasted_iota(jnp.int32, self.skew_index.shape, 1 if key else 0)
    return scratch[0, 0, 0, source, self.skew_index]

  def unskew(self, ds, key: bool):
    """The transpose of :meth:`_skew`: ``[bq, bk]`` logit gradients to ``[bq, 2 bq]`` window-product
    gradients (row a: the query side; row c: the key side)."""
    bq = self.plan.block_q
    scratch = self.refs["scratch"]
    _barrier(self.plan)
    scratch[0, 0, 0, :, pl.ds(0, bq)] = ds
    _barrier(self.plan)
    row = jax.lax.broadcasted_iota(jnp.int32, (bq, 2 * bq), 0)
    window_row = jax.lax.broadcasted_iota(jnp.int32, (bq, 2 * bq), 1)
    other = row - window_row + bq if key else window_row + row - bq  # the pair's query (key side) or key
    inside = (other >= 0) & (other < bq)
    other = jnp.clip(other, 0, bq - 1)
    values = scratch[0, 0, 0, other, row] if key else scratch[0, 0, 0, row, other]
    return jnp.where(inside, values, 0.0)

  def _gather(self, name: str, row_index, column_index):
    """``ref[row, column]`` per pair (``[B, H, L, X]`` rows, or the ``[1, N]`` per-head table when ``row_index``
    is None): a gather load (Triton lowers integer-array indexers to pointer gathers)."""
    ref = self.refs[name]
    if row_index is None:
      return ref[0, column_index].astype(jnp.float32)
    return ref[0, 0, row_index, column_index].astype(jnp.float32)

  def scatter(self, values, index, entries: int, axis):
    """The backward's scatter of each pair's gradient to its table entry (distance or bucket): ``values``
    ``[bq, bk]`` times ``one_hot(index, entries)`` summed over ``axis``, in pieces of :func:`_chunk` entries
    (a tuple): Triton caps an array at 2^20 elements, which ``[bq, bk, entries]`` exceeds for wide tables."""
    chunk = _chunk(self.plan, entries)
    return tuple(jnp.sum(values[:, :, None] * _one_hot(index - start, chunk), axis=axis)
                 for start in range(0, entries, chunk))


# ----------------------------------------------------------------------------------------------------------
# Kernels. Inputs are whole (batch, head) rows; outputs are this program's tile.


def _forward_kernel(plan: Plan, terms: Terms, names, *refs):
  r = dict(zip(names, refs))
  i0 = pl.program_id(2) * plan.block_q
  bq, head_dim = plan.block_q, r["v"].shape[-1]

  window = terms.relative is not None and terms.relative.window

  def body(t, carry):
    m, l, acc, misplaced = carry
    tile = _Tile(plan, terms, r, i0, t * plan.block_k)
    m_new = jnp.maximum(m, jnp.max(tile.logits, axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(tile.logits - m_new[:, None])
    v = r["v"][0, 0, tile.cols, :]
    p_dropped = tile.dropped(p)
    if window:
      misplaced = jnp.maximum(misplaced, jnp.max(jnp.where(tile.allowed & tile.misplaced, 1.0, 0.0), axis=1))
    return m_new, alpha * l + jnp.sum(p, axis=1), alpha[:, None] * acc + _dot(p_dropped.astype(v.dtype), v), misplaced

  init = (jnp.full((bq,), -jnp.inf, jnp.float32), jnp.zeros((bq,), jnp.float32),
          jnp.zeros((bq, head_dim), jnp.float32), jnp.zeros((bq,), jnp.float32))
  m, l, acc, misplaced = jax.lax.fori_loop(0, r["k"].shape[2] // plan.block_k, body, init)
  # A windowed relative term read index distances: rows whose positions disagree with them are NaN, not wrong.
  out = jnp.where(misplaced[:, None] > 0, jnp.nan, acc / l[:, None])
  r["out"][0, 0, :, :] = out.astype(r["out"].dtype)
  # The row maximum and sum, not their log-sum-exp: in a fully masked row m is the most negative float32 and
  # m + log(l) would round back to m.
  r["row_max"][0, 0, :] = m
  r["row_sum"][0, 0, :] = l


def _ds(plan: Plan, r: dict, tile: _Tile):
  """The tile's softmax weights after dropout and the gradient of its logits (zero where masked)."""
  rows = tile.rows
  p = jnp.exp(tile.logits - r["row_max"][0, 0, rows][:, None]) / r["row_sum"][0, 0, rows][:, None]
  do = r["d_out"][0, 0, rows, :]
  dp = tile.dropped(_dot_t(do, r["v"][0, 0, tile.cols, :]))
  ds = p * (dp - r["delta"][0, 0, rows][:, None])
  return tile.dropped(p), jnp.where(tile.allowed, ds, 0.0)


def _chunk(plan: Plan, entries: int) -> int:
  """Table entries per scatter piece: a ``[bq, bk, piece]`` one-hot of at most 2^18 elements."""
  return min(entries, max(1, (1 << 18) // (plan.block_q * plan.block_k)))


def _zero_pieces(plan: Plan, rows: tuple, entries: int):
  chunk = _chunk(plan, entries)
  return tuple(jnp.zeros((*rows, chunk), jnp.float32) for _ in range(entries // chunk))


def _add(acc, pieces):
  return tuple(a + p for a, p in zip(acc, pieces))


def _write(out, value, rows: bool):
  """An accumulator into this program's output block: rows ``[b, L, X]`` or a partial sum ``[X]``; a tuple of
  scatter pieces fills the last axis piece by piece."""
  pieces = value if isinstance(value, tuple) else (value,)
  width = pieces[0].shape[-1]
  for c, piece in enumerate(pieces):
    if rows:
      out[0, 0, :, pl.ds(c * width, width)] = piece.astype(out.dtype)
    else:
      out[0, 0, 0, pl.ds(c * width, width)] = piece.astype(out.dtype)


def _dq_kernel(plan: Plan, terms: Terms, names, *refs):
  r = dict(zip(names, refs))
  i0 = pl.program_id(2) * plan.block_q
  bq, head_dim = plan.block_q, r["q"].shape[-1]
  acc = {"dq": jnp.zeros((bq, head_dim), jnp.float32)}
  window = terms.relative is not None and terms.relative.window
  if terms.relative is not None and terms.relative.query and not window:
    acc["dqe"] = _zero_pieces(plan, (bq,), terms.relative.table.shape[0])
  if terms.untied is not None:
    acc["du_q"] = jnp.zeros((bq, head_dim), jnp.float32)
    if terms.untied.reset != "none":
      acc["dtheta_row"] = acc["dtheta_col"] = jnp.zeros((1,), jnp.float32)
  if terms.buckets is not None:
    acc["dbucket"] = _zero_pieces(plan, (), terms.buckets.table.shape[0])
  if terms.alibi is not None:
    acc["dslope"] = jnp.zeros((1,), jnp.float32)

  def body(t, acc):
    tile = _Tile(plan, terms, r, i0, t * plan.block_k)
    _, ds = _ds(plan, r, tile)
    acc = dict(acc)
    acc["dq"] = acc["dq"] + plan.scale * _dot(ds.astype(tile.k.dtype), tile.k).astype(jnp.float32)
    if "dqe" in acc:
      acc["dqe"] = _add(acc["dqe"], tile.scatter(ds, tile.rel_index, terms.relative.table.shape[0], 1))
    if window and terms.relative.query:
      acc["dq"] = acc["dq"] + plan.scale * _dot(tile.unskew(ds, key=False), tile.e_win.astype(jnp.float32))
    d_untied, d_bucket = tile.position_grads(ds)
    if "du_q" in acc:
      acc["du_q"] = acc["du_q"] + _dot(d_untied, tile.u_k.astype(jnp.float32))
    if "dtheta_row" in acc:
      acc["dtheta_row"] = acc["dtheta_row"] + jnp.sum(jnp.where(tile.cls_i, ds, 0.0))
      acc["dtheta_col"] = acc["dtheta_col"] + jnp.sum(jnp.where(~tile.cls_i & tile.cls_j, ds, 0.0))
    if "dbucket" in acc:
      acc["dbucket"] = _add(acc["dbucket"], tile.scatter(d_bucket, tile.bucket_index,
                                                         terms.buckets.table.shape[0], (0, 1)))
    if "dslope" in acc:
      acc["dslope"] = acc["dslope"] - jnp.sum(ds * tile.distance)
    return acc

  acc = jax.lax.fori_loop(0, r["k"].shape[2] // plan.block_k, body, acc)
  for name, value in acc.items():
    _write(r[name], value, rows=name not in ("dtheta_row", "dtheta_col", "dbucket", "dslope"))


def _dkv_kernel(plan: Plan, terms: Terms, names, *refs):
  r = dict(zip(names, refs))
  j0 = pl.program_id(2) * plan.block_k
  bk, head_dim = plan.block_k, r["k"].shape[-1]
  acc = {"dk": jnp.zeros((bk, head_dim), jnp.float32), "dv": jnp.zeros((bk, r["v"].shape[-1]), jnp.float32)}
  window = terms.relative is not None and terms.relative.window
  if terms.relative is not None and terms.relative.key and not window:
    acc["dke"] = _zero_pieces(plan, (bk,), terms.relative.table.shape[0])
  if terms.untied is not None:
    acc["du_k"] = jnp.zeros((bk, head_dim), jnp.float32)

  def body(t, acc):
    tile = _Tile(plan, terms, r, t * plan.block_q, j0)
    p, ds = _ds(plan, r, tile)
    acc = dict(acc)
    do = r["d_out"][0, 0, tile.rows, :]
    acc["dv"] = acc["dv"] + _t_dot(p.astype(do.dtype), do)
    acc["dk"] = acc["dk"] + plan.scale * _t_dot(ds.astype(tile.q.dtype), tile.q)
    if "dke" in acc:
      acc["dke"] = _add(acc["dke"], tile.scatter(ds, tile.rel_index, terms.relative.table.shape[0], 0))
    if window and terms.relative.key:
      acc["dk"] = acc["dk"] + plan.scale * _dot(tile.unskew(ds, key=True), tile.e_win.astype(jnp.float32))
    if "du_k" in acc:
      d_untied, _ = tile.position_grads(ds)
      acc["du_k"] = acc["du_k"] + _t_dot(d_untied, tile.u_q.astype(jnp.float32))
    return acc

  acc = jax.lax.fori_loop(0, r["q"].shape[2] // plan.block_q, body, acc)
  for name, value in acc.items():
    _write(r[name], value, rows=True)


def _window_grad_kernel(plan: Plan, terms: Terms, names, *refs):
  """The windowed table's gradient without atomics: program ``p`` takes the tile diagonal
  ``t - s = p - (n - 1)``, whose tiles all read the same ``2·block`` window rows, and sums their
  ``scale (dqeᵀ q + dkeᵀ k)`` over the diagonal (``[B, H, 2n - 1, 2 block, K]`` partials, ``O(L)``)."""
  r = dict(zip(names, refs))
  block, n = plan.block_q, r["q"].shape[2] // plan.block_q
  diagonal = pl.program_id(2) - (n - 1)
  first = jnp.maximum(0, -diagonal)

  def body(step, acc):
    s = first + step
    tile = _Tile(plan, terms, r, s * block, (s + diagonal) * block)
    _, ds = _ds(plan, r, tile)
    if terms.relative.query:
      acc = acc + _t_dot(tile.unskew(ds, key=False), tile.q.astype(jnp.float32))
    if terms.relative.key:
      acc = acc + _t_dot(tile.unskew(ds, key=True), tile.k.astype(jnp.float32))
    return acc

  acc = jax.lax.fori_loop(0, n - jnp.abs(diagonal), body, jnp.zeros((2 * block, r["q"].shape[-1]), jnp.float32))
  r["d_window"][0, 0, 0, :, :] = plan.scale * acc


# ----------------------------------------------------------------------------------------------------------
# pallas_call plumbing.


def _barrier(plan: Plan):
  """Orders a program's scratch stores before its loads on GPU (the interpreters run a program sequentially)."""
  if plan.interpret is False:
    from jax.experimental.pallas import triton as pltriton

    pltriton.debug_barrier()


def _window_table(relative, padded: int):
  """``[2L, K]``: row ``u`` is ``a_clip(u - L)``, so a tile's window is a contiguous, block-aligned slice."""
  k = relative.max_distance
  return jnp.take(relative.table, np.clip(np.arange(2 * padded) - padded, -k, k) + k, axis=0)


def _overlap_add(d_window, block: int):
  """``[2L, K]`` from the diagonals' window gradients ``[2n - 1, 2 block, K]`` (diagonal p's window starts at
  row ``p·block``): windows overlap by half, so each half adds into its block. Static pads and adds."""
  pad_blocks = lambda x, before: jnp.pad(x, ((before, 1 - before), (0, 0), (0, 0)))
  return (pad_blocks(d_window[:, :block], 0) + pad_blocks(d_window[:, block:], 1)).reshape(-1, d_window.shape[-1])


def _fold_window_table(d_pad, relative, padded: int):
  """The table's gradient from its ``[2L, K]`` distance layout's (:func:`_window_table`): rows fold into the
  table's, the clipped ends summed; static slices and sums, deterministic."""
  k = relative.max_distance
  lo, hi = max(1 - k, -padded), min(k - 1, padded - 1)
  grad = jnp.zeros(relative.table.shape, jnp.float32).at[lo + k:hi + k + 1].set(d_pad[lo + padded:hi + padded + 1])
  if k <= padded:
    grad = grad.at[0].set(jnp.sum(d_pad[:padded - k + 1], axis=0))
  if k < padded:
    grad = grad.at[2 * k].set(jnp.sum(d_pad[padded + k:], axis=0))
  return grad


def _row_spec(array, block: int | None = None):
  """A ``[B, H, L, X]`` array: the program's (batch, head) rows, all of them or its tile of ``block``."""
  if block is None:
    return pl.BlockSpec((1, 1, *array.shape[2:]), lambda b, h, i: (b, h, 0, 0))
  return pl.BlockSpec((1, 1, block, *array.shape[3:]), lambda b, h, i: (b, h, i, *[0] * (array.ndim - 3)))


def _batch_spec(array):
  return pl.BlockSpec((1, array.shape[1]), lambda b, h, i: (b, 0))


def _head_spec(array):
  return pl.BlockSpec((1, array.shape[1]), lambda b, h, i: (h, 0))


def _inputs(plan: Plan, terms: Terms, q, k, v, positions, segment_ids, valid, salts, extra: dict):
  """Names, arrays and block specs of a kernel's inputs (whole rows; per-head parameter rows)."""
  inputs = {"q": q, "k": k, "v": v, **extra}
  specs = {name: _row_spec(x) for name, x in inputs.items()}
  if plan.dropout:
    inputs["salts"], specs["salts"] = salts, pl.BlockSpec((1, 1), lambda b, h, i: (b, h))
  for name, x in (("positions", positions), ("segment_ids", segment_ids), ("valid", valid)):
    inputs[name], specs[name] = x, _batch_spec(x)
  if terms.alibi is not None:
    inputs["slopes"] = terms.alibi.slopes.astype(jnp.float32)[:, None]
  if terms.buckets is not None:
    inputs["bucket_table"] = terms.buckets.table.T
  if terms.untied is not None and terms.untied.reset != "none":
    inputs["theta_row"], inputs["theta_col"] = terms.untied.theta[0][:, None], terms.untied.theta[1][:, None]
  if terms.relative is not None and terms.relative.window:
    inputs["window_table"] = _window_table(terms.relative, q.shape[2])
    specs["window_table"] = pl.BlockSpec(inputs["window_table"].shape, lambda b, h, i: (0, 0))
  for name in ("slopes", "bucket_table", "theta_row", "theta_col"):
    if name in inputs:
      specs[name] = _head_spec(inputs[name])
  return inputs, specs


def _call(kernel, plan: Plan, terms: Terms, inputs: dict, specs: dict, outputs: dict, out_specs: dict, tiles: int):
  b, h = inputs["q"].shape[:2]
  if terms.relative is not None and terms.relative.window:
    block = plan.block_q
    outputs = {**outputs, "scratch": jax.ShapeDtypeStruct((b, h, tiles, block, 2 * block), jnp.float32)}
    out_specs = {**out_specs, "scratch": pl.BlockSpec((1, 1, 1, block, 2 * block),
                                                      lambda b, h, i: (b, h, i, 0, 0))}
  names = list(inputs) + list(outputs)
  results = pl.pallas_call(
      functools.partial(kernel, plan, terms, names),
      compiler_params=_triton_params(),
      grid=(b, h, tiles),
      in_specs=[specs[n] for n in inputs],
      out_specs=[out_specs[n] for n in outputs],
      out_shape=[outputs[n] for n in outputs],
      interpret=plan.interpret,
      name=kernel.__name__.strip("_"),
  )(*inputs.values())
  return dict(zip(outputs, results))


def _triton_params():
  """Pallas's Triton backend (the default GPU backend of this jax is Mosaic GPU, which these kernels are not
  written for)."""
  from jax.experimental.pallas import triton as pltriton

  return pltriton.CompilerParams(num_warps=4, num_stages=2)


def _per_head_rows(terms: Terms, q, k, scale: float, batch: int) -> dict:
  """The ``[B, H, L, X]`` inputs computed outside the kernel: ``qe``/``ke`` and the broadcast ``u_q``/``u_k``."""
  extra = {}
  if terms.relative is not None and not terms.relative.window:
    table = terms.relative.table
    if terms.relative.query:
      extra["qe"] = scale * jnp.einsum("bhlk,rk->bhlr", q, table.astype(q.dtype), preferred_element_type=jnp.float32)
    if terms.relative.key:
      extra["ke"] = scale * jnp.einsum("bhlk,rk->bhlr", k, table.astype(k.dtype), preferred_element_type=jnp.float32)
  if terms.untied is not None:
    for name in ("u_q", "u_k"):
      u = getattr(terms.untied, name).transpose(0, 2, 1, 3)
      extra[name] = jnp.broadcast_to(u, (batch, *u.shape[1:]))
  return extra


def _forward(plan: Plan, leaves, q, k, v, positions, segment_ids, valid, salts):
  terms = plan.terms(leaves)
  b, h, l, _ = q.shape
  extra = _per_head_rows(terms, q, k, plan.scale, b)
  inputs, specs = _inputs(plan, terms, q, k, v, positions, segment_ids, valid, salts, extra)
  out = _call(_forward_kernel, plan, terms, inputs, specs,
              {"out": jax.ShapeDtypeStruct((b, h, l, v.shape[-1]), v.dtype),
               "row_max": jax.ShapeDtypeStruct((b, h, l), jnp.float32),
               "row_sum": jax.ShapeDtypeStruct((b, h, l), jnp.float32)},
              {"out": _row_spec(v, plan.block_q),
               "row_max": pl.BlockSpec((1, 1, plan.block_q), lambda b, h, i: (b, h, i)),
               "row_sum": pl.BlockSpec((1, 1, plan.block_q), lambda b, h, i: (b, h, i))},
              l // plan.block_q)
  return out["out"], ((out["row_max"], out["row_sum"]), extra)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def attention(plan: Plan, leaves, q, k, v, positions, segment_ids, valid, salts):
  """``[B, H, L, K]`` attention of ``[B, H, L, K]`` inputs (L a multiple of both blocks); ``leaves``: the
  Terms' arrays (``plan.treedef``); ``salts``: ``[B, H]`` int32, the dropout masks' (unread without dropout)."""
  return _forward(plan, leaves, q, k, v, positions, segment_ids, valid, salts)[0]


def _attention_fwd(plan, leaves, q, k, v, positions, segment_ids, valid, salts):
  out, (stats, extra) = _forward(plan, leaves, q, k, v, positions, segment_ids, valid, salts)
  return out, (leaves, q, k, v, positions, segment_ids, valid, salts, out, stats, extra)


def _attention_bwd(plan, residuals, d_out):
  leaves, q, k, v, positions, segment_ids, valid, salts, out, (row_max, row_sum), extra = residuals
  terms = plan.terms(leaves)
  b, h, l, d = q.shape
  n_q, n_k = l // plan.block_q, l // plan.block_k
  delta = row_delta(d_out, out)
  inputs, specs = _inputs(plan, terms, q, k, v, positions, segment_ids, valid, salts,
                          {**extra, "d_out": d_out})
  inputs.update(row_max=row_max, row_sum=row_sum, delta=delta)
  for name in ("row_max", "row_sum", "delta"):
    specs[name] = pl.BlockSpec((1, 1, l), lambda b, h, i: (b, h, 0))
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  partial_spec = lambda n: pl.BlockSpec((1, 1, 1, n), lambda b, h, i: (b, h, i, 0))

  dq_out, dq_specs = {"dq": f32(b, h, l, d)}, {"dq": _row_spec(q, plan.block_q)}
  if "qe" in extra:
    dq_out["dqe"], dq_specs["dqe"] = f32(*extra["qe"].shape), _row_spec(extra["qe"], plan.block_q)
  if terms.untied is not None:
    dq_out["du_q"], dq_specs["du_q"] = f32(b, h, l, d), _row_spec(q, plan.block_q)
    if terms.untied.reset != "none":
      for name in ("dtheta_row", "dtheta_col"):
        dq_out[name], dq_specs[name] = f32(b, h, n_q, 1), partial_spec(1)
  if terms.buckets is not None:
    n = terms.buckets.table.shape[0]
    dq_out["dbucket"], dq_specs["dbucket"] = f32(b, h, n_q, n), partial_spec(n)
  if terms.alibi is not None:
    dq_out["dslope"], dq_specs["dslope"] = f32(b, h, n_q, 1), partial_spec(1)
  dq_res = _call(_dq_kernel, plan, terms, inputs, specs, dq_out, dq_specs, n_q)

  dkv_out = {"dk": f32(b, h, l, d), "dv": f32(b, h, l, v.shape[-1])}
  dkv_specs = {"dk": _row_spec(k, plan.block_k), "dv": _row_spec(v, plan.block_k)}
  if "ke" in extra:
    dkv_out["dke"], dkv_specs["dke"] = f32(*extra["ke"].shape), _row_spec(extra["ke"], plan.block_k)
  if terms.untied is not None:
    dkv_out["du_k"], dkv_specs["du_k"] = f32(b, h, l, d), _row_spec(k, plan.block_k)
  dkv_res = _call(_dkv_kernel, plan, terms, inputs, specs, dkv_out, dkv_specs, n_k)

  dq, dk, dv = dq_res["dq"], dkv_res["dk"], dkv_res["dv"]
  d_terms = jax.tree.map(jnp.zeros_like, terms)
  if terms.relative is not None and terms.relative.window:
    d_window = _call(_window_grad_kernel, plan, terms, inputs, specs,
                     {"d_window": f32(b, h, n_q + n_k - 1, 2 * plan.block_q, d)},
                     {"d_window": pl.BlockSpec((1, 1, 1, 2 * plan.block_q, d), lambda b, h, i: (b, h, i, 0, 0))},
                     n_q + n_k - 1)["d_window"]
    d_table = _fold_window_table(_overlap_add(jnp.sum(d_window, axis=(0, 1)), plan.block_q), terms.relative, l)
    d_terms = d_terms.replace(relative=d_terms.relative.replace(table=d_table.astype(terms.relative.table.dtype)))
  elif terms.relative is not None:
    table = terms.relative.table.astype(jnp.float32)
    d_table = jnp.zeros_like(table)
    if "dqe" in dq_res:
      dq = dq + plan.scale * jnp.einsum("bhlr,rk->bhlk", dq_res["dqe"], table)
      d_table = d_table + plan.scale * jnp.einsum("bhlr,bhlk->rk", dq_res["dqe"], q.astype(jnp.float32))
    if "dke" in dkv_res:
      dk = dk + plan.scale * jnp.einsum("bhlr,rk->bhlk", dkv_res["dke"], table)
      d_table = d_table + plan.scale * jnp.einsum("bhlr,bhlk->rk", dkv_res["dke"], k.astype(jnp.float32))
    d_terms = d_terms.replace(relative=d_terms.relative.replace(
        table=d_table.astype(terms.relative.table.dtype)))
  if terms.untied is not None:
    untied = _untied_grads(terms.untied, dq_res["du_q"], dkv_res["du_k"])
    if "dtheta_row" in dq_res:
      d_theta = jnp.stack([jnp.sum(dq_res[name], axis=(0, 2, 3)) for name in ("dtheta_row", "dtheta_col")])
      untied = untied.replace(theta=d_theta.astype(terms.untied.theta.dtype))
    d_terms = d_terms.replace(untied=untied)
  if terms.buckets is not None:
    d_bucket = jnp.sum(dq_res["dbucket"], axis=(0, 2)).T.astype(terms.buckets.table.dtype)
    d_terms = d_terms.replace(buckets=d_terms.buckets.replace(table=d_bucket))
  if terms.alibi is not None:
    d_slopes = jnp.sum(dq_res["dslope"], axis=(0, 2, 3)).astype(terms.alibi.slopes.dtype)
    d_terms = d_terms.replace(alibi=d_terms.alibi.replace(slopes=d_slopes))
  d_leaves = jax.tree_util.tree_leaves(d_terms)
  return (d_leaves, dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None)


def row_delta(d_out, out, keepdims: bool = False):
  """``Σ_k d_out·out`` per row (the softmax backward's correction), counting nothing where ``d_out`` is 0: a NaN
  row (a windowed table's flag) whose output the loss ignores must not poison every other gradient."""
  terms = jnp.where(d_out == 0, 0.0, d_out.astype(jnp.float32) * out.astype(jnp.float32))
  return jnp.sum(terms, axis=-1, keepdims=keepdims)


def _untied_grads(untied, du_q, du_k):
  """The untied term's gradient (θ's zero) from the kernels' ``[B, H, L, K]`` rows, summed over the batch
  where the factors were shared by it."""
  def to_input(g, like):
    g = g.transpose(0, 2, 1, 3)
    g = jnp.sum(g, axis=0, keepdims=True) if like.shape[0] == 1 and g.shape[0] != 1 else g
    return g.astype(like.dtype)

  return untied.replace(u_q=to_input(du_q, untied.u_q), u_k=to_input(du_k, untied.u_k),
                        theta=None if untied.theta is None else jnp.zeros_like(untied.theta))


attention.defvjp(_attention_fwd, _attention_bwd)


def next_power_of_two(n: int) -> int:
  return 1 << max(0, int(n) - 1).bit_length()


def block_sizes(length: int, block_q: int, block_k: int) -> tuple[int, int, int]:
  """``(block_q, block_k, padded length)``: power-of-two tiles (Triton's blocks must be) no longer than the
  sequence rounded up to a power of two, which is the padded length."""
  for name, block in (("block_q", block_q), ("block_k", block_k)):
    if not isinstance(block, int) or block < 1 or block & (block - 1):
      raise ValueError(f"block_sizes: {name}={block!r} must be a positive power of two")
  padded = next_power_of_two(length)
  return min(block_q, padded), min(block_k, padded), padded
