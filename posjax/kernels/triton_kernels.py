"""The GPU (Triton) kernels' bodies: the tile (:class:`Tile`, reading whole (batch, head) rows) and the four kernels
the op's ``custom_vjp`` in :mod:`posjax.kernels.triton` launches (its docstring describes the design).

Shapes: B batch, H heads, L padded length, K head dim, V value head dim, Q/T query/key tile rows, W window
rows (``2·block``), D relative-table rows (``2k+1``), N bucket entries, X any last axis.

A kernel is called as ``kernel(plan, terms, names, *refs)``: ``refs`` are its inputs' blocks (whole ``[1, 1, L,
X]`` rows of its (batch, head); per-head ``[1, X]`` parameter rows) and its outputs' blocks (this program's tile),
in the order of ``names``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from posjax.kernels import term as term_lib
from posjax.kernels.terms import Terms
from posjax.kernels.tile import Plan, TileBase, diagonal_may_hold_pairs, dot, dot_t, t_dot


def _one_hot(index_QxT, size: int):
  """``[..., size]`` float32 one-hot of ``index`` (no batched matmul or scatter, which Triton does not lower)."""
  return (index_QxT[..., None] == jax.lax.broadcasted_iota(jnp.int32, (*index_QxT.shape, size),
                                                             index_QxT.ndim)).astype(jnp.float32)


class Tile(TileBase):
  """One (query tile, key tile) pair read from whole (batch, head) rows (refs ``[1, 1, L, X]``) at rows
  ``i0`` and ``j0``: its logits, mask and what the backward needs to route gradients."""

  def __init__(self, plan: Plan, terms: Terms, refs: dict, i0, j0):
    bq, bk = plan.block_q, plan.block_k
    self.plan, self.terms, self.refs, self.i0, self.j0 = plan, terms, refs, i0, j0
    rows, cols = pl.ds(i0, bq), pl.ds(j0, bk)
    self.rows, self.cols = rows, cols
    self.q_QxK, self.k_TxK = refs["q"][0, 0, rows, :], self._keys()
    pos_j_T = refs["positions"][0, cols]
    allowed_QxT = jnp.broadcast_to(refs["valid"][0, cols][None, :] > 0, (bq, bk))
    if "q_slots" in refs:  # the queries' own positions and slots: a context shard's (with their segment ids) or
      pos_i_Q = refs["q_positions"][0, rows]  # decoding's (decode_kernel, one document)
      index_i_QxT = jnp.broadcast_to(refs["q_slots"][0, rows][:, None], (bq, bk))
      if "q_segments" in refs:
        allowed_QxT = allowed_QxT & (refs["q_segments"][0, rows][:, None] == refs["segment_ids"][0, cols][None, :])
    else:  # self-attention: the query rows of the keys' arrays
      pos_i_Q = refs["positions"][0, rows]
      allowed_QxT = allowed_QxT & (refs["segment_ids"][0, rows][:, None] == refs["segment_ids"][0, cols][None, :])
      index_i_QxT = i0 + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
    rel_QxT = pos_j_T[None, :] - pos_i_Q[:, None]
    self.cls_i_QxT, self.cls_j_QxT = (pos_i_Q == 0)[:, None], (pos_j_T == 0)[None, :]
    self.index_i_QxT, self.index_j_QxT = index_i_QxT, j0 + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    self.open_q_positions, self.open_k_positions = pos_i_Q[:, None], pos_j_T[None, :]
    self.open_q_index, self.open_k_index = self.index_i_QxT, self.index_j_QxT
    s_QxT = self.add_position_terms(self.open_logits(self._content()), rel_QxT)
    self.mask_logits(s_QxT, allowed_QxT, self.index_i_QxT, self.index_j_QxT)

  WRITTEN = ()  # accumulators the tile writes itself (the kernels' last stores skip them)

  def _keys(self):
    """The key tile ``[T, K]``."""
    return self.refs["k"][0, 0, self.cols, :]

  def _content(self):
    """The content logits ``scale q·k`` ``[Q, T]`` the terms add to."""
    return self.plan.scale * dot_t(self.q_QxK, self.k_TxK)

  def add_query_grads(self, acc: dict, d_content_QxT) -> dict:
    """``dq`` from the content logits' gradient."""
    return {**acc, "dq": acc["dq"] + self.plan.scale * dot_in(dot, d_content_QxT, self.k_TxK)}

  def add_key_grads(self, acc: dict, d_content_QxT) -> dict:
    """``dk`` from the content logits' gradient."""
    return {**acc, "dk": acc["dk"] + self.plan.scale * dot_in(t_dot, d_content_QxT, self.q_QxK)}

  def open_load(self, key: str, kind: str, side):
    """An open term's input (:mod:`posjax.kernels.term`): a head's scalar, or the tile's query / key rows (decoding:
    the queries' own, ``<key>@q``, read at their slots)."""
    if kind == term_lib.HEAD:
      return self.refs[key][0, side].astype(jnp.float32)
    if side == "q":
      ref = self.refs[key + "@q"] if key + "@q" in self.refs else self.refs[key]
      value = ref[0, 0, self.rows]
    else:
      value = self.refs[key][0, 0, self.cols]
    if kind == term_lib.ROWS:
      return (value[:, None] if side == "q" else value[None, :]).astype(jnp.float32)
    return value.astype(jnp.float32)

  def open_entries(self, key: str) -> int:
    return self.refs[key].shape[-1]

  def open_gather(self, key: str, index_QxT):
    """``table[h, index]``: a gather load of this head's row (its entries edge-padded to a power of two, so clamping
    to them reads the last real one, as the dense path's clamp)."""
    return self.gather(key, None, index_QxT)

  def open_inner(self, a_QxE, b_TxE):
    return dot_t(a_QxE, b_TxE, self._exact())

  def _untied_factors(self):
    return self.refs["u_q"][0, 0, self.rows, :], self.refs["u_k"][0, 0, self.cols, :]

  def _theta(self):
    return (self.refs["theta_row"][0, 0].astype(jnp.float32), self.refs["theta_col"][0, 0].astype(jnp.float32))

  def _salt(self):
    return self.refs["salts"][0, 0]

  def _exact(self):
    """Compiled: three TF32 passes on the tensor cores (IEEE float32 dots spill on sm_90); interpreted: float32."""
    return jax.lax.Precision.HIGHEST if self.plan.interpret else jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3

  def _relative_term(self, rel_QxT):
    """The relative-vector logits: gathered from ``qe`` / ``ke``, or (window) from the tile's products with the
    ``2·block`` table rows its index distances reach, skewed: pair (a, c) has distance ``j0 - i0 + c - a``,
    window row ``c - a + block``."""
    r, i0, j0 = self.terms.relative, self.i0, self.j0
    bq, bk = self.plan.block_q, self.plan.block_k
    row_QxT = jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
    col_QxT = jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    term_QxT = jnp.zeros((bq, bk), jnp.float32)
    if not r.window:
      self.rel_index_QxT = r.entries(rel_QxT)
      if r.query:
        term_QxT = term_QxT + self.gather("qe", i0 + row_QxT, self.rel_index_QxT)
      if r.key:
        term_QxT = term_QxT + self.gather("ke", j0 + col_QxT, self.rel_index_QxT)
      return term_QxT
    self.skew_QxT = col_QxT - row_QxT + bq
    self.misplaced_QxT = (rel_QxT != j0 - i0 + col_QxT - row_QxT) & (i0 + row_QxT < self.plan.length)
    start = j0 - i0 - bq + self.refs["q"].shape[2]
    self.window_WxK = self.refs["window_table"][pl.ds(start, 2 * bq), :]
    if r.query:
      qe_QxW = self.plan.scale * dot_t(self.q_QxK, self.window_WxK.astype(self.q_QxK.dtype))
      term_QxT = term_QxT + self._skew(qe_QxW, key=False)
    if r.key:
      ke_TxW = self.plan.scale * dot_t(self.k_TxK, self.window_WxK.astype(self.k_TxK.dtype))
      term_QxT = term_QxT + self._skew(ke_TxW, key=True)
    return term_QxT

  def _skew(self, x_QxW, key: bool):
    """``[bq, 2 bq]`` window products to ``[bq, bk]`` logits: ``out[a, c] = x[a or c, c - a + bq]`` (a on the
    query side, c on the key side), through this program's scratch block in memory (a register array cannot be
    gathered from)."""
    scratch = self.refs["scratch"]
    barrier(self.plan)
    scratch[0, 0, 0, :, :] = x_QxW
    barrier(self.plan)
    source_QxT = jax.lax.broadcasted_iota(jnp.int32, self.skew_QxT.shape, 1 if key else 0)
    return scratch[0, 0, 0, source_QxT, self.skew_QxT]

  def unskew(self, ds_QxT, key: bool):
    """The transpose of :meth:`_skew`: ``[bq, bk]`` logit gradients to ``[bq, 2 bq]`` window-product
    gradients (row a: the query side; row c: the key side)."""
    bq = self.plan.block_q
    scratch = self.refs["scratch"]
    barrier(self.plan)
    scratch[0, 0, 0, :, pl.ds(0, bq)] = ds_QxT
    barrier(self.plan)
    row_QxW = jax.lax.broadcasted_iota(jnp.int32, (bq, 2 * bq), 0)
    window_row_QxW = jax.lax.broadcasted_iota(jnp.int32, (bq, 2 * bq), 1)
    # the pair's query (key side) or key
    other_QxW = row_QxW - window_row_QxW + bq if key else window_row_QxW + row_QxW - bq
    inside_QxW = (other_QxW >= 0) & (other_QxW < bq)
    other_QxW = jnp.clip(other_QxW, 0, bq - 1)
    values_QxW = scratch[0, 0, 0, other_QxW, row_QxW] if key else scratch[0, 0, 0, row_QxW, other_QxW]
    return jnp.where(inside_QxW, values_QxW, 0.0)

  def gather(self, name: str, row_index_QxT, column_index_QxT):
    """``ref[row, column]`` per pair (``[B, H, L, X]`` rows, or the ``[1, N]`` per-head table when ``row_index``
    is None): a gather load (Triton lowers integer-array indexers to pointer gathers)."""
    ref = self.refs[name]
    if row_index_QxT is None:
      return ref[0, column_index_QxT].astype(jnp.float32)
    return ref[0, 0, row_index_QxT, column_index_QxT].astype(jnp.float32)


class PathTile(Tile):
  """A tile of PaTH's blocked form (:class:`posjax.kernels.terms.path.PathBlocks`): in the query's block its content
  logits are the band's columns; before it, ``q_b · k`` with the keys of the query block's copy (rows ``I P ..`` of
  ``k``). Its gradients: the band's into the ``dq`` kernel's ``dband`` block, the copies' into the ``dk/dv``
  kernel's ``[N, T, K]`` block, each block's sum stored as its query tiles are walked (the kernels' last stores
  skip ``dk``)."""

  WRITTEN = ("dk",)

  def _block(self):
    size = self.terms.path.size
    return self.i0 // size, self.i0 // size == self.j0 // size, jnp.clip(self.j0 - (self.i0 // size) * size, 0,
                                                                          size - self.plan.block_k)

  def _keys(self):
    block, _, _ = self._block()
    return self.refs["k"][0, 0, pl.ds(block * self.refs["v"].shape[2] + self.j0, self.plan.block_k), :]

  def _content(self):
    _, in_band, column = self._block()
    band_QxT = self.refs["band"][0, 0, self.rows, pl.ds(column, self.plan.block_k)]
    return self.plan.scale * jnp.where(in_band, band_QxT, dot_t(self.q_QxK, self.k_TxK))

  def add_query_grads(self, acc: dict, d_content_QxT) -> dict:
    _, in_band, column = self._block()

    @pl.when(in_band)
    def _():
      self.refs["dband"][0, 0, :, pl.ds(column, self.plan.block_k)] = self.plan.scale * d_content_QxT

    return super().add_query_grads(acc, jnp.where(in_band, 0.0, d_content_QxT))

  def add_key_grads(self, acc: dict, d_content_QxT) -> dict:
    block, in_band, _ = self._block()
    fresh = self.i0 % self.terms.path.size == 0  # the block's first query tile
    acc = super().add_key_grads({**acc, "dk": jnp.where(fresh, 0.0, acc["dk"])},
                                jnp.where(in_band, 0.0, d_content_QxT))
    self.refs["dk"][0, 0, block, :, :] = acc["dk"]
    return acc


def tile_class(terms: Terms):
  """The kernels' tile for ``terms``: PaTH's blocked form reads its own."""
  return PathTile if terms.path is not None else Tile


# ----------------------------------------------------------------------------------------------------------
# Kernels. Inputs are whole (batch, head) rows; outputs are this program's tile.


def forward_kernel(plan: Plan, terms: Terms, names, *refs):
  """One query tile against the key tiles it visits (online softmax): the output rows, and each row's maximum and
  sum for the backward pass (a row that a windowed relative term misread comes out NaN)."""
  r = dict(zip(names, refs))
  row_max_Q, row_sum_Q, acc_QxV, misplaced_Q = _attend(plan, terms, r, pl.program_id(2) * plan.block_q, *tile_range(r))
  # A windowed relative term read index distances: rows whose positions disagree with them are NaN, not wrong.
  out_QxV = jnp.where(misplaced_Q[:, None] > 0, jnp.nan, acc_QxV / row_sum_Q[:, None])
  r["out"][0, 0, :, :] = out_QxV.astype(r["out"].dtype)
  # The row maximum and sum, not their log-sum-exp: in a fully masked row m is the most negative float32 and
  # m + log(l) would round back to m.
  r["row_max"][0, 0, :] = row_max_Q
  r["row_sum"][0, 0, :] = row_sum_Q


def decode_kernel(plan: Plan, terms: Terms, names, *refs):
  """Decoding (:func:`posjax.kernels.triton.decode`): grid point ``(b, h, i · splits + s)`` takes split ``s`` of the
  key tiles query tile ``i`` visits (flash decoding: the splits of one query tile run side by side) and writes its
  unnormalised output rows with their maximum and sum; the splits are combined after the kernel."""
  r = dict(zip(names, refs))
  splits = plan.splits
  i, s = pl.program_id(2) // splits, pl.program_id(2) % splits
  lo, hi = tile_range(r)
  per = (hi - lo + splits - 1) // splits
  start = jnp.minimum(lo + s * per, hi)
  row_max_Q, row_sum_Q, acc_QxV, _ = _attend(plan, terms, r, i * plan.block_q, start, jnp.minimum(start + per, hi))
  r["out"][0, 0, 0, :, :] = acc_QxV
  r["row_max"][0, 0, 0, :] = row_max_Q
  r["row_sum"][0, 0, 0, :] = row_sum_Q


def _attend(plan: Plan, terms: Terms, r: dict, i0, lo, hi):
  """Online softmax of query tile ``i0`` over key tiles ``[lo, hi)``: each row's maximum and sum, its unnormalised
  output and whether a windowed relative term misread it (1.0)."""
  bq, value_dim = plan.block_q, r["v"].shape[-1]
  window = terms.relative is not None and terms.relative.window

  def body(t, carry):
    row_max_Q, row_sum_Q, acc_QxV, misplaced_Q = carry
    tile = tile_class(terms)(plan, terms, r, i0, t * plan.block_k)
    new_max_Q = jnp.maximum(row_max_Q, jnp.max(tile.s_QxT, axis=1))
    alpha_Q = jnp.exp(row_max_Q - new_max_Q)
    p_QxT = jnp.exp(tile.s_QxT - new_max_Q[:, None])
    v_TxV = r["v"][0, 0, tile.cols, :]
    p_dropped_QxT = tile.dropped(p_QxT)
    if window:
      bad_QxT = jnp.where(tile.allowed_QxT & tile.misplaced_QxT, 1.0, 0.0)
      misplaced_Q = jnp.maximum(misplaced_Q, jnp.max(bad_QxT, axis=1))
    return (new_max_Q, alpha_Q * row_sum_Q + jnp.sum(p_QxT, axis=1),
            alpha_Q[:, None] * acc_QxV + dot(p_dropped_QxT.astype(v_TxV.dtype), v_TxV), misplaced_Q)

  init = (jnp.full((bq,), -jnp.inf, jnp.float32), jnp.zeros((bq,), jnp.float32),
          jnp.zeros((bq, value_dim), jnp.float32), jnp.zeros((bq,), jnp.float32))
  return jax.lax.fori_loop(lo, hi, body, init)


def tile_range(r: dict):
  """The other side's tiles ``[lo, hi)`` this program visits (:func:`posjax.kernels.tile.tile_ranges`): the rest hold
  no allowed pair."""
  return r["tiles"][0, 0, 0], r["tiles"][0, 0, 1]


def _ds(plan: Plan, r: dict, tile: Tile):
  """The tile's softmax weights after dropout and the gradient of its logits (zero where masked)."""
  rows = tile.rows
  p_QxT = jnp.exp(tile.s_QxT - r["row_max"][0, 0, rows][:, None]) / r["row_sum"][0, 0, rows][:, None]
  do_QxV = r["d_out"][0, 0, rows, :]
  dp_QxT = tile.dropped(dot_t(do_QxV, r["v"][0, 0, tile.cols, :]))
  ds_QxT = p_QxT * (dp_QxT - r["delta"][0, 0, rows][:, None])
  return tile.dropped(p_QxT), jnp.where(tile.allowed_QxT, ds_QxT, 0.0)


CHUNK_ELEMENTS = 1 << 12  # a step's [bq, bk, chunk] one-hot: one entry at 64x64 (two spilled in the T5 dq)


def _chunk(plan: Plan, entries: int) -> int:
  """Table entries per scatter step: a ``[bq, bk, chunk]`` one-hot of at most ``CHUNK_ELEMENTS``."""
  return min(entries, max(1, CHUNK_ELEMENTS // (plan.block_q * plan.block_k)))


def _block(start, size: int, rows: bool):
  """Entries ``start : start + size`` of an output block: rows ``[1, 1, R, E]`` or a partial sum ``[1, 1, 1, E]``."""
  return (0, 0, slice(None) if rows else 0, pl.ds(start, size))


def zero_block(plan: Plan, out, rows: bool):
  """Zeroes a scatter's output block (:func:`scatter_add` adds into it), a chunk at a time."""
  chunk = _chunk(plan, out.shape[-1])
  shape = (out.shape[2], chunk) if rows else (chunk,)

  def body(c, carry):
    out[_block(pl.multiple_of(c * chunk, chunk), chunk, rows)] = jnp.zeros(shape, out.dtype)
    return carry

  jax.lax.fori_loop(0, out.shape[-1] // chunk, body, 0)


def scatter_add(plan: Plan, out, values_QxT, index_QxT, allowed_QxT, axis):
  """Adds each pair's gradient ``values`` (zero where not ``allowed``) to its table entry ``index`` in this
  program's output block (a partial sum, ``axis=(0, 1)``, or the tile's rows, ``axis`` the other side's),
  ``chunk`` entries a step over the entries the allowed pairs reach: a ``[bq, bk, chunk]`` one-hot summed per
  step, so neither registers nor the PTX grow with the table. The block is this program's only
  (deterministic); the barrier orders the previous step's stores before this step's loads."""
  entries = out.shape[-1]
  chunk = _chunk(plan, entries)
  first = jnp.min(jnp.where(allowed_QxT, index_QxT, entries - 1)) // chunk
  last = jnp.max(jnp.where(allowed_QxT, index_QxT, 0)) // chunk

  def body(c, carry):
    start = pl.multiple_of(c * chunk, chunk)
    part_X = jnp.sum(values_QxT[:, :, None] * _one_hot(index_QxT - start, chunk), axis=axis)
    barrier(plan)
    at = _block(start, chunk, rows=axis != (0, 1))
    out[at] = out[at] + part_X
    return carry

  jax.lax.fori_loop(first, last + 1, body, 0)


def _write(out, value, rows: bool):
  """An accumulator into this program's output block: rows ``[b, L, X]`` (``[b]``: one value a row, the Forget
  term's) or a partial sum ``[X]``."""
  if out.ndim == 3:
    out[0, 0, :] = value.astype(out.dtype)
  elif rows:
    out[0, 0, :, :] = value.astype(out.dtype)
  else:
    out[0, 0, 0, :] = value.astype(out.dtype)


def dq_kernel(plan: Plan, terms: Terms, names, *refs):
  """One query tile against the key tiles it visits: its ``dq`` (and ``dqe``, ``du_q`` rows) and the per-tile
  partial sums of the scalar inputs' gradients (θ, the open terms' heads and tables)."""
  r = dict(zip(names, refs))
  i0 = pl.program_id(2) * plan.block_q
  bq, head_dim = plan.block_q, r["q"].shape[-1]
  acc = {"dq": jnp.zeros((bq, head_dim), jnp.float32)}
  window = terms.relative is not None and terms.relative.window
  if terms.untied is not None:
    acc["du_q"] = jnp.zeros((bq, head_dim), jnp.float32)
    if terms.untied.reset != "none":
      acc["dtheta_row"] = acc["dtheta_col"] = jnp.zeros((1,), jnp.float32)
  open_kinds = _open_kinds(terms)
  for key, kind in open_kinds.items():
    if kind == term_lib.TABLE:  # its entries' partial sums, scattered into (scatter_add)
      zero_block(plan, r["d" + key], rows=False)
    elif kind == term_lib.HEAD:  # a partial sum per column
      acc["d" + key] = jnp.zeros(r["d" + key].shape[-1:], jnp.float32)
    else:  # the query rows'
      acc["d" + key + "@q"] = jnp.zeros(r["d" + key + "@q"].shape[2:], jnp.float32)
  if "dqe" in r:
    zero_block(plan, r["dqe"], rows=True)

  def body(t, acc):
    tile = tile_class(terms)(plan, terms, r, i0, t * plan.block_k)
    _, ds_QxT = _ds(plan, r, tile)
    d_content_QxT, d_values, d_lookups, acc = tile.open_grads(ds_QxT, dict(acc), _add_to_head)
    acc = tile.add_query_grads(acc, d_content_QxT)
    for (key, side), d_value in d_values.items():  # the query side's and the heads' shares
      if open_kinds[key] == term_lib.HEAD:
        acc = _add_to_head(acc, key, side, d_value)
      elif side == "q":
        acc["d" + key + "@q"] = acc["d" + key + "@q"] + (jnp.sum(d_value, axis=1) if open_kinds[key] == term_lib.ROWS
                                                         else d_value)
    for key, index_QxT, d_QxT in d_lookups:
      scatter_add(plan, r["d" + key], d_QxT, index_QxT, tile.allowed_QxT, (0, 1))
    if "dqe" in r:
      scatter_add(plan, r["dqe"], ds_QxT, tile.rel_index_QxT, tile.allowed_QxT, 1)
    if window and terms.relative.query:
      acc["dq"] = acc["dq"] + plan.scale * dot_in(dot, tile.unskew(ds_QxT, key=False), tile.window_WxK)
    if "du_q" in acc:
      acc["du_q"] = acc["du_q"] + dot_in(dot, tile.untied_grads(ds_QxT), tile.u_k_TxK)
    if "dtheta_row" in acc:
      acc["dtheta_row"] = acc["dtheta_row"] + jnp.sum(jnp.where(tile.cls_i_QxT, ds_QxT, 0.0))
      acc["dtheta_col"] = acc["dtheta_col"] + jnp.sum(jnp.where(~tile.cls_i_QxT & tile.cls_j_QxT, ds_QxT, 0.0))
    return acc

  acc = jax.lax.fori_loop(*tile_range(r), body, acc)
  for name, value in acc.items():
    _write(r[name], value, rows=name not in ("dtheta_row", "dtheta_col")
           and open_kinds.get(name[1:]) != term_lib.HEAD)


def dkv_kernel(plan: Plan, terms: Terms, names, *refs):
  """One key tile against the query tiles that visit it: its ``dk``, ``dv`` (and ``dke``, ``du_k``) rows."""
  r = dict(zip(names, refs))
  j0 = pl.program_id(2) * plan.block_k
  bk, head_dim = plan.block_k, r["k"].shape[-1]
  acc = {"dk": jnp.zeros((bk, head_dim), jnp.float32), "dv": jnp.zeros((bk, r["v"].shape[-1]), jnp.float32)}
  window = terms.relative is not None and terms.relative.window
  if terms.untied is not None:
    acc["du_k"] = jnp.zeros((bk, head_dim), jnp.float32)
  if "dke" in r:
    zero_block(plan, r["dke"], rows=True)
  open_kinds = _open_kinds(terms)
  for key, kind in open_kinds.items():
    if kind in (term_lib.ROWS, term_lib.EMBEDDINGS):
      acc["d" + key + "@k"] = jnp.zeros(r["d" + key + "@k"].shape[2:], jnp.float32)

  def body(t, acc):
    tile = tile_class(terms)(plan, terms, r, t * plan.block_q, j0)
    p_QxT, ds_QxT = _ds(plan, r, tile)
    acc = dict(acc)
    do_QxV = r["d_out"][0, 0, tile.rows, :]
    acc["dv"] = acc["dv"] + dot_in(t_dot, p_QxT, do_QxV)
    d_content_QxT, d_values, _, _ = tile.open_grads(ds_QxT)
    acc = tile.add_key_grads(acc, d_content_QxT)
    for (key, side), d_value in d_values.items():  # the key side's shares
      if side == "k":
        acc["d" + key + "@k"] = acc["d" + key + "@k"] + (jnp.sum(d_value, axis=0) if open_kinds[key] == term_lib.ROWS
                                                         else d_value)
    if "dke" in r:
      scatter_add(plan, r["dke"], ds_QxT, tile.rel_index_QxT, tile.allowed_QxT, 0)
    if window and terms.relative.key:
      acc["dk"] = acc["dk"] + plan.scale * dot_in(dot, tile.unskew(ds_QxT, key=True), tile.window_WxK)
    if "du_k" in acc:
      acc["du_k"] = acc["du_k"] + dot_in(t_dot, tile.untied_grads(ds_QxT), tile.u_q_QxK)
    return acc

  acc = jax.lax.fori_loop(*tile_range(r), body, acc)
  for name, value in acc.items():
    if name not in tile_class(terms).WRITTEN:
      _write(r[name], value, rows=True)


def window_grad_kernel(plan: Plan, terms: Terms, names, *refs):
  """The windowed table's gradient without atomics: program ``p`` takes the tile diagonal
  ``t - s = p - (n - 1)``, whose tiles all read the same ``2·block`` window rows, and sums their
  ``scale (dqeᵀ q + dkeᵀ k)`` over the diagonal (``[B, H, 2n - 1, 2 block, K]`` partials, ``O(L)``)."""
  r = dict(zip(names, refs))
  block, n = plan.block_q, r["q"].shape[2] // plan.block_q
  diagonal = pl.program_id(2) - (n - 1)
  first = jnp.maximum(0, -diagonal)

  def body(step, acc_WxK):
    s = first + step
    tile = Tile(plan, terms, r, s * block, (s + diagonal) * block)
    _, ds_QxT = _ds(plan, r, tile)
    if terms.relative.query:
      acc_WxK = acc_WxK + dot_in(t_dot, tile.unskew(ds_QxT, key=False), tile.q_QxK)
    if terms.relative.key:
      acc_WxK = acc_WxK + dot_in(t_dot, tile.unskew(ds_QxT, key=True), tile.k_TxK)
    return acc_WxK

  steps = jnp.where(diagonal_may_hold_pairs(plan, diagonal), n - jnp.abs(diagonal), 0)
  acc_WxK = jax.lax.fori_loop(0, steps, body,
                              jnp.zeros((2 * block, r["q"].shape[-1]), jnp.float32))
  r["d_window"][0, 0, 0, :, :] = plan.scale * acc_WxK


def _add_to_head(acc: dict, key: str, column, part_QxT) -> dict:
  """A share of a :data:`~posjax.kernels.term.HEAD` input's ``column`` (derived or hand-written): its sum, added to
  the program's partial sums."""
  column_X = jax.lax.broadcasted_iota(jnp.int32, acc["d" + key].shape, 0)
  return {**acc, "d" + key: acc["d" + key] + jnp.where(column_X == column, jnp.sum(part_QxT), 0.0)}


def _open_kinds(terms: Terms) -> dict:
  """``{key: kind}`` of the call's open-term inputs (:func:`posjax.kernels.term.kernel_arrays`)."""
  return {key: kind for key, (kind, _) in term_lib.kernel_arrays(terms.open, trainable=True).items()}


def dot_in(product, gradient_MxX, operand_XxN):
  """A backward product of a float32 gradient tile and an input tile, the gradient cast to the input's dtype (as
  flash attention's ``ds·k``): bf16 operands on the tensor cores, half the shared memory of float32 ones."""
  return product(gradient_MxX.astype(operand_XxN.dtype), operand_XxN)


def barrier(plan: Plan):
  """Orders a program's scratch stores before its loads on GPU (the interpreters run a program sequentially)."""
  if plan.interpret is False:
    pltriton.debug_barrier()
