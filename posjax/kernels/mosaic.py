"""Flash attention for TPU (Pallas Mosaic) with the position terms built inside each tile.

Grouped-query attention as on GPU (:mod:`posjax.kernels.triton`): the k/v BlockSpecs read head ``h // plan.group``,
the ``dk/dv`` kernel writes each query head's share and a group's shares are summed after it.

Shapes: B batch, H heads, L padded length, K head dim, V value head dim, Q/T query/key tile rows, W window
rows (``2·block``), C the ``dq`` kernel's gradient columns, P tile diagonals, M/N any matrix's rows/columns,
X any last axis.

The TPU counterpart of :mod:`posjax.kernels.triton` (same op, same terms, same numerics; what they share:
:mod:`posjax.kernels.tile`), shaped the way Mosaic kernels are: a ``(batch, head, tile, tile)`` grid whose last
axis runs sequentially, q/k/v tiles brought in by BlockSpecs, running statistics in VMEM scratch; no gathers
(Mosaic has none). The tiles without an allowed pair (:func:`posjax.kernels.tile.tile_ranges`: above the causal
diagonal, outside the sliding window, in another packed document; computed at run time, scalar-prefetched into
SMEM) are skipped: their grid steps compute nothing and their index maps repeat the last visited block, so no copy
is issued (as JAX's splash attention does):

- the open terms' inputs (:mod:`posjax.kernels.term`) by kind: a head's scalars and tables in SMEM (a table lookup
  is a select per entry the tile's index reaches: Mosaic has no gather), rows as the query rows replicated across
  the lanes and the key rows as one row, embeddings as query and key row blocks; their per-tile gradient derived
  (:func:`posjax.kernels.term.tile_grads`): a head's scalars, the query side of rows and a table's entries as
  per-row columns of the ``dq`` kernel's ``dopen`` output (:func:`open_layout`), the key side of rows and
  embeddings as outputs of the ``dk/dv`` kernel;
- relative vectors are always windowed (``Relative.window``): a tile's ``2·block`` table rows arrive as two
  blocks of a distance-ordered ``[2L, K]`` table (and of its reverse, for the key side) and the products are
  skewed by :func:`_skew` (static rolls and selects: Mosaic's strided rotate exists only along lanes, with a
  small positive stride, and only from v5 on); the table's gradient is summed along tile diagonals in an output block
  that stays resident across the sequential axis (no atomics);
- the gradients of θ (in SMEM) are per-row partial sums (columns of one ``[B, H, L, C]`` output of the ``dq``
  kernel), summed after it.

A context shard's queries (``query_offset``) bring their own positions, segment ids, indices and open-term rows,
as on GPU (:mod:`posjax.kernels.triton`).

Query-side integers (positions, segment ids) come replicated across the key tile's lanes (``[B, L, block]``) and
the row statistics are kept ``[B, H, L, block]``, as in JAX's own TPU flash attention: no vector relayouts.
Blocks must be multiples of (8, 128) or the whole padded sequence (Mosaic's rule); relative vectors need
square tiles.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from posjax.kernels import path_blocks, term as term_lib
from posjax.kernels.terms import Terms, sink as sink_lib
from posjax.kernels.tile import (Plan, TileBase, diagonal_may_hold_pairs, dot, dot_t, fold_window_table,
                                 group_sum, kv_head, overlap_add, place_rows, query_share, query_side, row_delta,
                                 t_dot, tile_ranges, untied_grads, window_table)


class _Tile(TileBase):
  """The logits of tile (i, j) of one (batch, head) from this program's blocks, and the masks the backward
  needs (as :class:`posjax.kernels.triton_kernels.Tile`, reading blocks instead of rows)."""

  def __init__(self, plan: Plan, terms: Terms, r: dict, b, h, i, j):
    bq, bk = plan.block_q, plan.block_k
    self.plan, self.terms, self.r, self.b, self.h, self.i, self.j = plan, terms, r, b, h, i, j
    self.q_QxK, self.k_TxK = r["q"][0, 0], r["k"][0, 0]
    pos_i_QxT, pos_j_1xT = r["q_positions"][0], r["k_positions"][0]
    self.cls_i_QxT, self.cls_j_QxT = pos_i_QxT == 0, pos_j_1xT == 0
    self.row_QxT = jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
    self.col_QxT = jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    # decoding (:func:`decode`): the queries' cache slots; self-attention: their rows of the sequence
    self.index_i_QxT = r["q_slots"][0] if "q_slots" in r else i * bq + self.row_QxT
    self.index_j_QxT = j * bk + self.col_QxT
    self.open_q_positions, self.open_k_positions = pos_i_QxT, pos_j_1xT
    self.open_q_index, self.open_k_index = self.index_i_QxT, self.index_j_QxT
    content_QxT = plan.scale * dot_t(self.q_QxK, self.k_TxK)
    if terms.path is not None:  # PaTH's blocked form: in the query's block the band's logits, before it q_b·k
      size = terms.path.size
      self.in_band = (i * bq) // size == (j * bk) // size
      content_QxT = jnp.where(self.in_band, plan.scale * r["band"][0, 0], content_QxT)
    s_QxT = self.add_position_terms(self.open_logits(content_QxT), pos_j_1xT - pos_i_QxT)
    allowed_QxT = (r["k_valid"][0] > 0) & (r["q_segments"][0] == r["k_segments"][0])
    self.mask_logits(s_QxT, allowed_QxT, self.index_i_QxT, self.index_j_QxT)

  def open_load(self, key: str, kind: str, side):
    """An open term's input (:mod:`posjax.kernels.term`): a head's scalar from SMEM as a ``[Q, 1]`` column (so its
    gradient is per-row sums, as the other scalars'), the query rows (replicated across lanes: the first) or the
    key rows."""
    if kind == term_lib.HEAD:
      return jnp.full((self.plan.block_q, 1), self.r[key][self.h, side], jnp.float32)
    value = self.r[f"{key}@{side}"][0, 0]
    if kind == term_lib.ROWS and side == "q":
      value = value[:, :1]
    return value.astype(jnp.float32)

  def open_entries(self, key: str) -> int:
    return self.r[key].shape[1]

  def open_gather(self, key: str, index_QxT):
    """``table[h, index]``: one select per entry the tile's index reaches (Mosaic has no gather), the entry read
    from SMEM."""
    select = lambda n, value_QxT: jnp.where(index_QxT == n, self.r[key][self.h, n], value_QxT)
    return jax.lax.fori_loop(jnp.min(index_QxT), jnp.max(index_QxT) + 1, select,
                             jnp.zeros(index_QxT.shape, jnp.float32))

  def open_inner(self, a_QxE, b_TxE):
    return dot_t(a_QxE, b_TxE, jax.lax.Precision.HIGHEST)

  def _untied_factors(self):
    return self.r["u_q"][0, 0], self.r["u_k"][0, 0]

  def _theta(self):
    return self.r["theta"][0, self.h], self.r["theta"][1, self.h]

  def _salt(self):
    return self.r["salts"][self.b, self.h]

  def _relative_term(self, rel_QxT):
    """``scale (q_i·a + a·k_j)`` from the windows: ``out[a, c] = qe[a, c - a + bq]`` is a roll of row a by
    ``bq + a``; the key side multiplies the reversed window, ``out[a, c] = g[a - c + bq - 1, c]``, a roll of
    column c by ``bq + 1 + c``."""
    bq, rel_terms = self.plan.block_q, self.terms.relative
    index_distance_QxT = (self.j - self.i) * bq + self.col_QxT - self.row_QxT
    self.misplaced_QxT = (rel_QxT != index_distance_QxT) & (self.i * bq + self.row_QxT < self.plan.length)
    term_QxT = 0.0
    if rel_terms.query:
      self.window_WxK = jnp.concatenate([self.r["window_lo"][...], self.r["window_hi"][...]], axis=0)
      qe_QxW = self.plan.scale * dot_t(self.q_QxK, self.window_WxK.astype(self.q_QxK.dtype))
      term_QxT = term_QxT + _skew(qe_QxW, bq, 1, 1)[:, :bq]
    if rel_terms.key:
      self.reversed_WxK = jnp.concatenate([self.r["reversed_lo"][...], self.r["reversed_hi"][...]], axis=0)
      g_WxT = self.plan.scale * dot_t(self.reversed_WxK.astype(self.k_TxK.dtype), self.k_TxK)
      term_QxT = term_QxT + _skew(g_WxT, bq + 1, 0, 1)[:bq, :]
    return term_QxT

  def unskew_query(self, ds_QxT):
    """``[bq, 2 bq]``: the gradient of ``qe`` (the transpose of its roll, on ds padded with zeros)."""
    bq = self.plan.block_q
    padded_QxW = jnp.concatenate([ds_QxT, jnp.zeros_like(ds_QxT)], axis=1)
    return _skew(padded_QxW, bq, 1, -1)

  def unskew_key(self, ds_QxT):
    """``[2 bq, bk]``: the gradient of the key side's ``g``."""
    bq = self.plan.block_q
    padded_WxT = jnp.concatenate([ds_QxT, jnp.zeros_like(ds_QxT)], axis=0)
    return _skew(padded_WxT, bq - 1, 0, -1)


def _skew(x_MxN, shift: int, axis: int, sign: int):
  """``x`` with each line along ``axis`` (row t for axis 1, column t for axis 0) rolled by ``shift + sign·t``
  (as ``jnp.roll``): one static roll, then a static roll and a select per bit of t. Exact, and made of rotates
  every TPU generation has in either direction."""
  size, lines = x_MxN.shape[axis], x_MxN.shape[1 - axis]
  line_MxN = jax.lax.broadcasted_iota(jnp.int32, x_MxN.shape, 1 - axis)
  if shift % size:
    x_MxN = pltpu.roll(x_MxN, shift % size, axis)
  bit = 1
  while bit < lines:
    x_MxN = jnp.where((line_MxN & bit) != 0, pltpu.roll(x_MxN, sign * bit % size, axis), x_MxN)
    bit *= 2
  return x_MxN


def _ds(plan: Plan, r: dict, tile: _Tile):
  """The tile's softmax weights after dropout and the gradient of its logits (zero where masked)."""
  p_QxT = jnp.exp(tile.s_QxT - r["row_max"][0, 0]) / r["row_sum"][0, 0]
  dp_QxT = tile.dropped(dot_t(r["d_out"][0, 0], r["v"][0, 0]))
  return tile.dropped(p_QxT), jnp.where(tile.allowed_QxT, p_QxT * (dp_QxT - r["delta"][0, 0]), 0.0)


# ----------------------------------------------------------------------------------------------------------
# Kernels. Grid (batch, head, outer tile, inner tile); the inner axis is sequential.


def _forward_kernel(plan: Plan, terms: Terms, names, *refs):
  r = dict(zip(names, refs))
  b, h, i, j = (pl.program_id(a) for a in range(4))

  @pl.when(j == 0)
  def _():
    r["m"][...] = jnp.full(r["m"].shape, -jnp.inf, jnp.float32)
    r["l"][...] = jnp.zeros(r["l"].shape, jnp.float32)
    r["acc"][...] = jnp.zeros(r["acc"].shape, jnp.float32)
    r["misplaced"][...] = jnp.zeros(r["misplaced"].shape, jnp.float32)

  @pl.when(visits_tile(r, b, i, j))
  def _():
    tile = _Tile(plan, terms, r, b, h, i, j)
    m_QxT = r["m"][...]  # the row maximum, replicated across the lanes
    new_max_QxT = jnp.maximum(m_QxT, jnp.max(tile.s_QxT, axis=1, keepdims=True))
    alpha_QxT = jnp.exp(m_QxT - new_max_QxT)
    p_QxT = jnp.exp(tile.s_QxT - new_max_QxT)
    v_TxV = r["v"][0, 0]
    r["m"][...] = new_max_QxT
    r["l"][...] = alpha_QxT * r["l"][...] + jnp.sum(p_QxT, axis=1, keepdims=True)
    r["acc"][...] = alpha_QxT[:, :1] * r["acc"][...] + dot(tile.dropped(p_QxT).astype(v_TxV.dtype), v_TxV)
    if terms.relative is not None:
      bad_Qx1 = jnp.max(jnp.where(tile.allowed_QxT & tile.misplaced_QxT, 1.0, 0.0), axis=1, keepdims=True)
      r["misplaced"][...] = jnp.maximum(r["misplaced"][...], bad_Qx1)

  @pl.when(j == pl.num_programs(3) - 1)
  def _():
    out_QxV = r["acc"][...] / r["l"][...][:, :1]
    out_QxV = jnp.where(r["misplaced"][...][:, :1] > 0, jnp.nan, out_QxV)
    r["out"][0, 0] = out_QxV.astype(r["out"].dtype)
    r["row_max"][0, 0] = r["m"][...]
    r["row_sum"][0, 0] = r["l"][...]


def _dq_kernel(plan: Plan, terms: Terms, names, *refs):
  r = dict(zip(names, refs))
  b, h, i, j = (pl.program_id(a) for a in range(4))
  accumulators = [n for n in r if n in ("dq", "du_q", "dpos", "dopen") or n.endswith("@q") and "acc_" + n in r]
  zero_on_first_step(r, accumulators, j)

  @pl.when(visits_tile(r, b, i, j))
  def _():
    tile = _Tile(plan, terms, r, b, h, i, j)
    _, ds_QxT = _ds(plan, r, tile)
    shape = r["acc_dopen"].shape if "dopen" in r else (plan.block_q, 1)
    add = _column_adder(terms, shape)
    d_content_QxT, d_values, d_lookups, hand_QxC = tile.open_grads(ds_QxT, jnp.zeros(shape, jnp.float32), add)
    if terms.path is not None:  # the band's gradient, its own; the copies' only off the band
      band_QxT = plan.scale * d_content_QxT

      @pl.when(tile.in_band)
      def _():
        r["dband"][0, 0] = band_QxT

      d_content_QxT = jnp.where(tile.in_band, 0.0, d_content_QxT)
    dq_QxK = plan.scale * dot(d_content_QxT.astype(tile.k_TxK.dtype), tile.k_TxK)
    if "dopen" in r:
      r["acc_dopen"][...] += _open_columns(terms, d_values, d_lookups, hand_QxC, add)
    for (key, side), d_value in d_values.items():  # the query side of embeddings
      if side == "q" and "acc_d" + key + "@q" in r:
        r["acc_d" + key + "@q"][...] += d_value
    rel = terms.relative
    if rel is not None and rel.query:
      dq_QxK = dq_QxK + plan.scale * dot(tile.unskew_query(ds_QxT), tile.window_WxK.astype(jnp.float32))
    r["acc_dq"][...] += dq_QxK
    if "du_q" in r:
      r["acc_du_q"][...] += dot(tile.untied_grads(ds_QxT), tile.u_k_TxK.astype(jnp.float32))
    if "dpos" in r:
      r["acc_dpos"][...] += _position_columns(terms, tile, ds_QxT, r["acc_dpos"].shape)

  write_on_last_step(r, accumulators, j)


def open_layout(terms: Terms) -> dict:
  """``{key: (first column, columns)}`` of the open terms' per-row gradient columns in the dq kernel's ``dopen``:
  a head's scalars (``X``), the query side of rows (1), a table's entries (``N``); embeddings have their own."""
  layout, start = {}, 0
  for key, (kind, x) in term_lib.kernel_arrays(terms.open, trainable=True).items():
    width = {term_lib.HEAD: x.shape[-1], term_lib.ROWS: 1, term_lib.TABLE: x.shape[-1]}.get(kind, 0)
    if width:
      layout[key], start = (start, width), start + width
  return layout


def _column_adder(terms: Terms, shape):
  """``add(acc_QxC, key, column, part_QxT) -> acc_QxC``: ``part``'s row sums added to column ``column`` of input
  ``key``'s columns (:func:`open_layout`) of a ``[bq, C]`` accumulator of shape ``shape``."""
  layout = open_layout(terms)
  lane_QxC = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
  return lambda acc_QxC, key, column, part_QxT: acc_QxC + jnp.where(
      lane_QxC == layout[key][0] + column, jnp.sum(part_QxT, axis=1, keepdims=True), 0.0)


def _open_columns(terms: Terms, d_values: dict, d_lookups: list, out_QxC, add):
  """``[bq, C]``: a tile's share of the open terms' columns (:func:`open_layout`, through :func:`_column_adder`'s
  ``add``) added to ``out`` (the hand-written gradients' shares): a head's scalars and the query rows, and a
  lookup's per entry (one entry at a time over the entries its index reaches)."""
  layout = open_layout(terms)
  for (key, side), d_value in d_values.items():
    if key in layout and side != "k":
      out_QxC = add(out_QxC, key, side if isinstance(side, int) else 0, d_value)
  for key, index_QxT, d_QxT in d_lookups:

    def entry(n, out_QxC, key=key, index_QxT=index_QxT, d_QxT=d_QxT):
      return add(out_QxC, key, n, jnp.where(index_QxT == n, d_QxT, 0.0))

    out_QxC = jax.lax.fori_loop(jnp.min(index_QxT), jnp.max(index_QxT) + 1, entry, out_QxC)
  return out_QxC


def tile_range(ranges, outers, b, outer):
  """The inner tiles ``[lo, hi)`` grid row (b, outer) visits (:func:`posjax.kernels.tile.tile_ranges`, flattened
  ``[B, N, 2]`` in SMEM, ``outers = N`` outer tiles per batch row): the rest hold no allowed pair."""
  at = (b * outers + outer) * 2
  return ranges[at], ranges[at + 1]


def visits_tile(r: dict, b, outer, inner):
  """Whether grid point (b, outer, inner) computes its tile (the skipped ones keep the previous blocks: their
  index maps clamp the inner tile into the range, so no copy is issued)."""
  lo, hi = tile_range(r["tiles"], pl.num_programs(2), b, outer)
  return (inner >= lo) & (inner < hi)


def zero_on_first_step(r: dict, names, step):
  """Zeroes the VMEM accumulators ``acc_<name>`` when the sequential axis starts."""
  @pl.when(step == 0)
  def _():
    for name in names:
      r["acc_" + name][...] = jnp.zeros(r["acc_" + name].shape, jnp.float32)


def write_on_last_step(r: dict, names, step):
  """Writes each accumulator to its output block when the sequential axis ends."""
  @pl.when(step == pl.num_programs(3) - 1)
  def _():
    for name in names:
      r[name][0, 0] = r["acc_" + name][...].astype(r[name].dtype)


def _position_columns(terms: Terms, tile: _Tile, ds_QxT, shape):
  """``[bq, C]`` row sums of the tile's gradient per scalar input: θ1, θ2 (:func:`_columns`)."""
  lane_QxC = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
  out_QxC = jnp.zeros(shape, jnp.float32)
  for column, part_QxT in _columns(terms, tile, ds_QxT):
    out_QxC = jnp.where(lane_QxC == column, jnp.sum(part_QxT, axis=1, keepdims=True), out_QxC)
  return out_QxC


def _columns(terms: Terms, tile, ds_QxT):
  """``(column, gradient part [bq, bk])`` of each scalar input, in :func:`_position_columns`' order."""
  column = 0
  if terms.untied is not None and terms.untied.reset != "none":
    yield column, jnp.where(tile.cls_i_QxT, ds_QxT, 0.0)
    yield column + 1, jnp.where(~tile.cls_i_QxT & tile.cls_j_QxT, ds_QxT, 0.0)
    column += 2


def _column_count(terms: Terms) -> int:
  count = 0
  return count + 2 * (terms.untied is not None and terms.untied.reset != "none")


def _dkv_kernel(plan: Plan, terms: Terms, names, *refs):
  r = dict(zip(names, refs))
  b, h, j, i = (pl.program_id(a) for a in range(4))
  accumulators = [n for n in r if n in ("dk", "dv", "du_k") or n.endswith("@k") and "acc_" + n in r]
  zero_on_first_step(r, accumulators, i)

  @pl.when(visits_tile(r, b, j, i))
  def _():
    tile = _Tile(plan, terms, r, b, h, i, j)
    p_QxT, ds_QxT = _ds(plan, r, tile)
    do_QxV = r["d_out"][0, 0]
    r["acc_dv"][...] += t_dot(p_QxT.astype(do_QxV.dtype), do_QxV)
    d_content_QxT, d_values, _, _ = tile.open_grads(ds_QxT)
    if terms.path is not None:  # the copies' gradient: off the band, a sum per block of query tiles
      d_content_QxT = jnp.where(tile.in_band, 0.0, d_content_QxT)

      @pl.when((i * plan.block_q) % terms.path.size == 0)
      def _():
        r["acc_dk"][...] = jnp.zeros(r["acc_dk"].shape, jnp.float32)

    dk_TxK = plan.scale * t_dot(d_content_QxT.astype(tile.q_QxK.dtype), tile.q_QxK)
    for (key, side), d_value in d_values.items():  # the key side of rows (column sums) and embeddings
      if side == "k":
        r["acc_d" + key + "@k"][...] += d_value  # [1, T] (rows) or [T, E] (embeddings)
    if terms.relative is not None and terms.relative.key:
      dk_TxK = dk_TxK + plan.scale * t_dot(tile.unskew_key(ds_QxT), tile.reversed_WxK.astype(jnp.float32))
    r["acc_dk"][...] += dk_TxK
    if terms.path is not None:  # its block of the copies' rows, written back as the next block starts
      r["dk"][0, 0] = r["acc_dk"][...]
    if "du_k" in r:
      r["acc_du_k"][...] += t_dot(tile.untied_grads(ds_QxT), tile.u_q_QxK.astype(jnp.float32))

  write_on_last_step(r, [n for n in accumulators if n != "dk" or terms.path is None], i)


def _window_grad_kernel(plan: Plan, terms: Terms, names, *refs):
  """Grid (batch, head, diagonal p, step s): tile (s, s + p - (n - 1)) when it exists; the window gradients
  (``d_window``, ``d_reversed``: ``[2 bq, K]``) stay resident across the steps."""
  r = dict(zip(names, refs))
  b, h, p, s = (pl.program_id(a) for a in range(4))
  n = pl.num_programs(3)
  t = s + p - (n - 1)
  outputs = [name for name in ("d_window", "d_reversed") if name in r]

  @pl.when(s == 0)
  def _():
    for name in outputs:
      r[name][...] = jnp.zeros(r[name].shape, jnp.float32)

  @pl.when((t >= 0) & (t < n) & diagonal_may_hold_pairs(plan, p - (n - 1)))
  def _():
    tile = _Tile(plan, terms, r, b, h, s, t)
    _, ds_QxT = _ds(plan, r, tile)
    if "d_window" in r:
      r["d_window"][0, 0, 0] += plan.scale * t_dot(tile.unskew_query(ds_QxT), tile.q_QxK.astype(jnp.float32))
    if "d_reversed" in r:
      r["d_reversed"][0, 0, 0] += plan.scale * dot(tile.unskew_key(ds_QxT), tile.k_TxK.astype(jnp.float32))



# ----------------------------------------------------------------------------------------------------------
# pallas_call plumbing. A kernel's ``tiles(b, h, x, y, ranges)`` maps its grid to (query tile i, key tile j); ``ranges``:
# the flattened tile ranges in SMEM (scalar prefetch), which the index maps clamp the inner tile into.


def _specs(plan: Plan, terms: Terms, arrays: dict, tiles, more_specs=None):
  """BlockSpecs of every input, each a function of the tile pair the grid point works on; ``more_specs(at, name,
  array)``: the spec of an array of a caller's own (:mod:`posjax.kernels.rules.walk_tpu`), ``at(block, index map)``
  the spec maker, or None."""
  bq, bk = plan.block_q, plan.block_k
  n = arrays["q"].shape[2] // bq
  smem = pl.BlockSpec(memory_space=pltpu.SMEM)
  at = lambda shape, where: pl.BlockSpec(shape, lambda *g: where(*g[:2], *tiles(*g[:4], g[4])))
  row_block = lambda a_BxHxLxX, size: (1, 1, size, a_BxHxLxX.shape[-1])
  specs = {}
  open_kinds = {key: kind for key, (kind, _) in term_lib.kernel_arrays(terms.open).items()}
  for name, a in arrays.items():
    key, _, side = name.partition("@")
    if key in open_kinds:  # an open term's input, by kind
      kind = open_kinds[key]
      if kind in (term_lib.HEAD, term_lib.TABLE):
        specs[name] = smem
      elif side == "q":
        specs[name] = at((1, 1, bq, a.shape[-1]), lambda b, h, i, j: (b, h, i, 0))
      elif kind == term_lib.ROWS:
        specs[name] = at((1, 1, 1, bk), lambda b, h, i, j: (b, h, 0, j))
      else:
        specs[name] = at(row_block(a, bk), lambda b, h, i, j: (b, h, j, 0))
    elif name in ("q", "d_out", "u_q"):
      specs[name] = at(row_block(a, bq), lambda b, h, i, j, a=a: (b if a.shape[0] > 1 else 0, h, i, 0))
    elif name in ("k", "v"):  # a head per plan.group query heads (grouped-query attention)
      copy = path_copy(plan, terms, arrays["v"].shape[2]) if name == "k" else lambda i: 0
      specs[name] = at(row_block(a, bk), lambda b, h, i, j, copy=copy: (b, kv_head(h, plan.group), copy(i) + j, 0))
    elif name == "band":  # PaTH's band: the tile's columns in the query's block
      specs[name] = at((1, 1, bq, bk), lambda b, h, i, j: (b, h, i, band_column(plan, terms, i, j)))
    elif name == "u_k":
      specs[name] = at(row_block(a, bk), lambda b, h, i, j, a=a: (b if a.shape[0] > 1 else 0, h, j, 0))
    elif name in ("row_max", "row_sum", "delta"):
      specs[name] = at(row_block(a, bq), lambda b, h, i, j: (b, h, i, 0))
    elif name in ("q_positions", "q_segments", "q_slots"):
      specs[name] = at((1, bq, bk), lambda b, h, i, j: (b, i, 0))
    elif name in ("k_positions", "k_segments", "k_valid"):
      specs[name] = at((1, 1, bk), lambda b, h, i, j: (b, 0, j))
    elif name in ("theta", "salts"):
      specs[name] = smem
    elif name in ("window_lo", "window_hi"):  # window rows from (j - i - 1 + n) bq
      shift = name == "window_hi"
      specs[name] = at((bq, a.shape[-1]), lambda b, h, i, j, shift=shift: (j - i - 1 + n + shift, 0))
    elif name in ("reversed_lo", "reversed_hi"):  # the same rows of the reversed table
      shift = name == "reversed_hi"
      specs[name] = at((bq, a.shape[-1]), lambda b, h, i, j, shift=shift: (n - 1 - (j - i) + shift, 0))
    else:
      spec = more_specs(at, name, a) if more_specs is not None else None
      if spec is None:
        raise AssertionError(name)
      specs[name] = spec
  return specs


def path_copy(plan: Plan, terms: Terms, length: int):
  """Query tile i's first key tile among PaTH's copies (its block's copy; 0 without PaTH)."""
  if terms.path is None:
    return lambda i: 0
  return lambda i: (i * plan.block_q) // terms.path.size * (length // plan.block_k)


def band_column(plan: Plan, terms: Terms, i, j):
  """Key tile j's column tile in PaTH's band of query tile i (clamped into the band off it)."""
  per = terms.path.size // plan.block_k
  return jnp.clip(j - (i * plan.block_q) // terms.path.size * per, 0, per - 1)


def _inputs(plan: Plan, terms: Terms, q_BxHxLxK, k_BxHxLxK, v_BxHxLxV, positions_BxL, segment_ids_BxL, valid_BxL,
            salts_BxH, extra: dict, query_offset=None):
  """The kernels' arrays (see the module docstring for their layouts); ``query_offset``: q holds a context shard's
  queries from there, with their own positions, segment ids, slots and open-term rows."""
  bk = plan.block_k
  replicate = lambda x_BxL: jnp.broadcast_to(x_BxL[:, :, None], (*x_BxL.shape, bk))
  arrays = {"q": q_BxHxLxK, "k": k_BxHxLxK, "v": v_BxHxLxV, **extra,
            "q_positions": replicate(positions_BxL), "q_segments": replicate(segment_ids_BxL),
            "k_positions": positions_BxL[:, None], "k_segments": segment_ids_BxL[:, None],
            "k_valid": valid_BxL[:, None]}
  if plan.dropout:
    arrays["salts"] = salts_BxH
  if terms.path is not None:
    arrays["band"] = terms.path.band
  if terms.untied is not None:
    arrays["u_q"], arrays["u_k"] = (getattr(terms.untied, n).transpose(0, 2, 1, 3) for n in ("u_q", "u_k"))
    if terms.untied.reset != "none":
      arrays["theta"] = terms.untied.theta.astype(jnp.float32)
  for key, (kind, x) in term_lib.kernel_arrays(terms.open).items():
    if kind in (term_lib.HEAD, term_lib.TABLE):  # SMEM, a row per head
      arrays[key] = x
    elif kind == term_lib.ROWS:  # the query rows across min(bk, 128) lanes, the key rows as one row
      arrays[key + "@q"] = jnp.broadcast_to(x[..., None], (*x.shape, min(bk, 128)))
      arrays[key + "@k"] = x[:, :, None, :]
    else:
      arrays[key + "@q"] = arrays[key + "@k"] = x
  if query_offset is not None:
    add_query_arrays(arrays, query_side(terms.open, positions_BxL, segment_ids_BxL, query_offset,
                                        q_BxHxLxK.shape[2]), bk)
    if "u_q" in arrays:
      arrays["u_q"] = jax.lax.dynamic_slice_in_dim(arrays["u_q"], query_offset, q_BxHxLxK.shape[2], axis=2)
  rel = terms.relative
  if rel is not None:
    table_RxK = window_table(rel, q_BxHxLxK.shape[2])
    if rel.query:
      arrays["window_lo"] = arrays["window_hi"] = table_RxK
    if rel.key:
      arrays["reversed_lo"] = arrays["reversed_hi"] = table_RxK[::-1]
  return arrays


def add_query_arrays(arrays: dict, side: dict, bk: int):
  """The queries' own arrays (a context shard's or a decoding step's, :func:`posjax.kernels.tile.query_side`) in
  the kernels' layout: ``[B, Q]`` integers and an open term's rows replicated across the lanes."""
  for name, x in side.items():
    if x.ndim == 2:
      arrays[name] = jnp.broadcast_to(x[:, :, None], (*x.shape, bk))
    else:
      arrays[name] = jnp.broadcast_to(x[..., None], (*x.shape, arrays[name].shape[-1])) if x.ndim == 3 else x


def call(kernel, plan: Plan, terms: Terms, arrays: dict, outputs: dict, grid, tiles, scratch: dict | None = None,
         ranges_BxNx2=None, more_specs=None):
  """``outputs``: name → (ShapeDtypeStruct, BlockSpec); ``tiles(b, h, x, y, ranges)``: the grid point's (i, j);
  ``scratch``: name → shape of a float32 VMEM buffer; ``ranges``: the inner tiles each (b, outer tile) visits
  (:func:`posjax.kernels.tile.tile_ranges`; None: all); ``more_specs``: as :func:`_specs`'."""
  scratch = scratch or {}
  if ranges_BxNx2 is None:
    ranges_BxNx2 = jnp.broadcast_to(jnp.array([0, grid[3]], jnp.int32), (grid[0], grid[2], 2))
  specs = _specs(plan, terms, arrays, tiles, more_specs)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1, grid=grid, in_specs=[specs[n] for n in arrays],
      out_specs=[spec for _, spec in outputs.values()],
      scratch_shapes=[pltpu.VMEM(shape, jnp.float32) for shape in scratch.values()])
  results = pl.pallas_call(
      functools.partial(kernel, plan, terms, ["tiles"] + list(arrays) + list(outputs) + list(scratch)),
      grid_spec=grid_spec,
      out_shape=[shape for shape, _ in outputs.values()],
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
      interpret=plan.interpret,
      name=kernel.__name__.strip("_"),
  )(ranges_BxNx2.reshape(-1), *arrays.values())
  return dict(zip(outputs, results))


def row_output(shape, block: int, dtype=jnp.float32, *, axis: int = 2):
  """A ``[B, H, L, X]`` output written a tile of ``block`` rows at a time (tile index: grid axis ``axis``)."""
  spec = pl.BlockSpec((1, 1, block, shape[-1]), lambda b, h, x, y, ranges: (b, h, (x, y)[axis - 2], 0))
  return jax.ShapeDtypeStruct(shape, dtype), spec


def clamped(ranges, outers: int, b, outer, inner):
  """The inner tile, clamped into the range grid row (b, outer) visits (:func:`tile_range`): a skipped step keeps its
  blocks."""
  lo, hi = tile_range(ranges, outers, b, outer)
  return jnp.maximum(jnp.minimum(jnp.maximum(inner, lo), hi - 1), 0)  # 0 for an empty range at 0


def query_major(n_q: int, reverse: int = 0):
  """Grid (b, h, query tile i, key tile j): the key tile clamped into i's range (``reverse=N``: step s visits key tile
  ``N - 1 - s``, the key tiles from the last back)."""
  if reverse:
    return lambda b, h, i, step, ranges: (i, clamped(ranges, n_q, b, i, reverse - 1 - step))
  return lambda b, h, i, j, ranges: (i, clamped(ranges, n_q, b, i, j))


def lane_row_output(shape, block: int):
  """A ``[B, H, 1, L]`` float32 output of lane-major rows, a tile of ``block`` at a time (grid axis 2)."""
  return (jax.ShapeDtypeStruct(shape, jnp.float32),
          pl.BlockSpec((1, 1, 1, block), lambda b, h, x, y, ranges: (b, h, 0, x)))


def key_major(n_k: int):
  """Grid (b, h, key tile j, query tile i): the query tile clamped into j's range."""
  return lambda b, h, j, i, ranges: (clamped(ranges, n_k, b, j, i), j)


def _forward(plan: Plan, leaves, q_BxHxLxK, k_BxHxLxK, v_BxHxLxV, positions_BxL, segment_ids_BxL, valid_BxL,
             salts_BxH, query_offset=None):
  terms = plan.terms(leaves)
  b, h, l, _ = q_BxHxLxK.shape  # l: the queries (a context shard's, from query_offset; else the sequence)
  bq, bk = plan.block_q, plan.block_k
  ranges = tile_ranges(plan, segment_ids_BxL, valid_BxL)  # the backward's too
  if query_offset is not None:
    ranges = query_share(ranges, query_offset, l, bq)
  arrays = _inputs(plan, terms, q_BxHxLxK, k_BxHxLxK, v_BxHxLxV, positions_BxL, segment_ids_BxL, valid_BxL,
                   salts_BxH, {}, query_offset)
  out = call(_forward_kernel, plan, terms, arrays,
             {"out": row_output((b, h, l, v_BxHxLxV.shape[-1]), bq, v_BxHxLxV.dtype),
              "row_max": row_output((b, h, l, bk), bq), "row_sum": row_output((b, h, l, bk), bq)},
              (b, h, l // bq, v_BxHxLxV.shape[2] // bk), query_major(l // bq),
              {"m": (bq, bk), "l": (bq, bk), "acc": (bq, v_BxHxLxV.shape[-1]), "misplaced": (bq, bk)},
              ranges[0])
  out_BxHxLxV, row_max_BxHxLxT, row_sum_BxHxLxT = out["out"], out["row_max"], out["row_sum"]
  if terms.sink is not None:  # the rows' statistics take the sink; the backward recomputes its weights from them
    out_BxHxLxV, row_max_BxHxLxT, row_sum_BxHxLxT = sink_lib.rescale(terms.sink, out_BxHxLxV, row_max_BxHxLxT,
                                                                     row_sum_BxHxLxT)
  return out_BxHxLxV, ((row_max_BxHxLxT, row_sum_BxHxLxT), ranges)


def default_block_sizes(terms: Terms, length: int, head_dim: int) -> tuple[int, int]:
  """The (query, key) tile when the caller gives none, from what Mosaic compiles for v5e and v6e (their speed is not
  measured yet): 256x256, where every term fits the scoped VMEM up to L=2048 (512x512 does not with a bucket
  table at 2048); 128x128 (the lane width) with relative vectors, whose skew and window products grow with the
  tile."""
  del length, head_dim
  return (128, 128) if terms.relative is not None else (256, 256)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def attention(plan: Plan, leaves, q_BxHxLxK, k_BxHxLxK, v_BxHxLxV, positions_BxL, segment_ids_BxL, valid_BxL,
              salts_BxH, query_offset=None):
  """As :func:`posjax.kernels.triton.attention`, on TPU: ``[B, H, L, V]`` from ``[B, H, L, K]`` inputs (with
  ``query_offset``, a context shard's ``[B, H, Q, V]``)."""
  return _forward(plan, leaves, q_BxHxLxK, k_BxHxLxK, v_BxHxLxV, positions_BxL, segment_ids_BxL, valid_BxL,
                  salts_BxH, query_offset)[0]


def _attention_fwd(plan, leaves, q_BxHxLxK, k_BxHxLxK, v_BxHxLxV, positions_BxL, segment_ids_BxL, valid_BxL,
                   salts_BxH, query_offset=None):
  out_BxHxLxV, (stats, ranges) = _forward(plan, leaves, q_BxHxLxK, k_BxHxLxK, v_BxHxLxV, positions_BxL,
                                          segment_ids_BxL, valid_BxL, salts_BxH, query_offset)
  return out_BxHxLxV, (leaves, q_BxHxLxK, k_BxHxLxK, v_BxHxLxV, positions_BxL, segment_ids_BxL, valid_BxL,
                       salts_BxH, query_offset, out_BxHxLxV, stats, ranges)


def _attention_bwd(plan, residuals, d_out_BxHxLxV):
  (leaves, q_BxHxLxK, k_BxHxLxK, v_BxHxLxV, positions_BxL, segment_ids_BxL, valid_BxL, salts_BxH, query_offset,
   out_BxHxLxV, (row_max_BxHxLxT, row_sum_BxHxLxT), (key_tiles_BxNx2, query_tiles_BxMx2)) = residuals
  terms = plan.terms(leaves)
  b, h, l, d = q_BxHxLxK.shape  # l: the queries; t: the keys (k: PaTH's copies of them)
  bq, bk, t = plan.block_q, plan.block_k, v_BxHxLxV.shape[2]
  n_q, n_k = l // bq, t // bk
  delta_BxHxLx1 = row_delta(d_out_BxHxLxV, out_BxHxLxV, keepdims=True)
  arrays = _inputs(plan, terms, q_BxHxLxK, k_BxHxLxK, v_BxHxLxV, positions_BxL, segment_ids_BxL, valid_BxL,
                   salts_BxH, {"d_out": d_out_BxHxLxV, "row_max": row_max_BxHxLxT, "row_sum": row_sum_BxHxLxT,
                               "delta": jnp.broadcast_to(delta_BxHxLx1, row_max_BxHxLxT.shape)}, query_offset)

  dq_out, dq_scratch = {"dq": row_output(q_BxHxLxK.shape, bq)}, {"acc_dq": (bq, d)}
  if terms.untied is not None:
    dq_out["du_q"], dq_scratch["acc_du_q"] = row_output((b, h, l, d), bq), (bq, d)
  columns = _column_count(terms)
  if columns:
    dq_out["dpos"], dq_scratch["acc_dpos"] = row_output((b, h, l, columns), bq), (bq, columns)
  open_columns = sum(width for _, width in open_layout(terms).values())
  if open_columns:
    dq_out["dopen"], dq_scratch["acc_dopen"] = row_output((b, h, l, open_columns), bq), (bq, open_columns)
  open_arrays = term_lib.kernel_arrays(terms.open, trainable=True)
  for key, (kind, x) in open_arrays.items():
    if kind == term_lib.EMBEDDINGS:
      dq_out["d" + key + "@q"] = row_output((b, h, l, x.shape[-1]), bq)
      dq_scratch["acc_d" + key + "@q"] = (bq, x.shape[-1])
  if terms.path is not None:  # a band tile at a time, the key tile clamped as the inputs' (a skipped step keeps it)
    column = lambda b, h, i, j, ranges: band_column(plan, terms, i, clamped(ranges, n_q, b, i, j))
    dq_out["dband"] = (jax.ShapeDtypeStruct(terms.path.band.shape, jnp.float32), pl.BlockSpec(
        (1, 1, bq, bk), lambda b, h, i, j, ranges: (b, h, i, column(b, h, i, j, ranges))))
  dq_res = call(_dq_kernel, plan, terms, arrays, dq_out, (b, h, n_q, n_k), query_major(n_q), dq_scratch,
                key_tiles_BxNx2)

  dkv_out = {"dk": row_output((b, h, t, d), bk), "dv": row_output((b, h, t, v_BxHxLxV.shape[-1]), bk)}  # per query head
  dkv_scratch = {"acc_dk": (bk, d), "acc_dv": (bk, v_BxHxLxV.shape[-1])}
  if terms.path is not None:  # the copies' rows: block (query tile i's) a key tile at a time
    copy = path_copy(plan, terms, t)
    dkv_out["dk"] = (jax.ShapeDtypeStruct((b, h, k_BxHxLxK.shape[2], d), jnp.float32), pl.BlockSpec(
        (1, 1, bk, d), lambda b, h, j, i, ranges: (b, h, copy(clamped(ranges, n_k, b, j, i)) + j, 0)))
  if terms.untied is not None:
    dkv_out["du_k"], dkv_scratch["acc_du_k"] = row_output((b, h, t, d), bk), (bk, d)
  for key, (kind, x) in open_arrays.items():
    if kind == term_lib.ROWS:
      dkv_out["d" + key + "@k"] = (jax.ShapeDtypeStruct((b, h, 1, t), jnp.float32),
                                   pl.BlockSpec((1, 1, 1, bk), lambda b, h, j, i, ranges: (b, h, 0, j)))
      dkv_scratch["acc_d" + key + "@k"] = (1, bk)
    elif kind == term_lib.EMBEDDINGS:
      dkv_out["d" + key + "@k"], dkv_scratch["acc_d" + key + "@k"] = row_output(x.shape, bk), (bk, x.shape[-1])
  dkv_res = call(_dkv_kernel, plan, terms, arrays, dkv_out, (b, h, n_k, n_q), key_major(n_k), dkv_scratch,
                  query_tiles_BxMx2)

  if query_offset is not None:  # the share's query rows of the whole sequence's inputs
    dq_res.update({name: place_rows(x, query_offset, t) for name, x in dq_res.items()
                   if name in ("du_q", "dopen") or name.endswith("@q")})
  d_terms = jax.tree.map(jnp.zeros_like, terms)
  rel = terms.relative
  if rel is not None:
    window_out = {}
    spec = pl.BlockSpec((1, 1, 1, 2 * bq, d), lambda b, h, p, s, ranges: (b, h, p, 0, 0))
    for name, side in (("d_window", rel.query), ("d_reversed", rel.key)):
      if side:
        window_out[name] = jax.ShapeDtypeStruct((b, h, 2 * n_q - 1, 2 * bq, d), jnp.float32), spec
    # grid point (p, s) works on tile (s, s + p - (n - 1)), clamped into the sequence where it does not exist
    diagonal = lambda b, h, p, s, ranges: (s, jnp.clip(s + p - (n_q - 1), 0, n_q - 1))
    res = call(_window_grad_kernel, plan, terms, arrays, window_out, (b, h, 2 * n_q - 1, n_q), diagonal)
    d_RxK = jnp.zeros((2 * l, d), jnp.float32)
    if "d_window" in res:
      d_RxK = d_RxK + overlap_add(jnp.sum(res["d_window"], axis=(0, 1)), bq)
    if "d_reversed" in res:
      d_RxK = d_RxK + overlap_add(jnp.sum(res["d_reversed"], axis=(0, 1))[::-1], bq)[::-1]
    d_table_DxK = fold_window_table(d_RxK, rel, l)
    d_terms = d_terms.replace(relative=d_terms.relative.replace(table=d_table_DxK.astype(rel.table.dtype)))
  if terms.untied is not None:
    d_terms = d_terms.replace(untied=untied_grads(terms.untied, dq_res["du_q"], dkv_res["du_k"]))
  if columns:
    d_columns_HxC = jnp.sum(dq_res["dpos"], axis=(0, 2))
    column = 0
    if terms.untied is not None and terms.untied.reset != "none":
      d_terms = d_terms.replace(untied=d_terms.untied.replace(
          theta=d_columns_HxC[:, column:column + 2].T.astype(terms.untied.theta.dtype)))
      column += 2
  if terms.open:  # the columns and rows in the layout both backends give term.gradients
    sums = {**dq_res, **{name: x_BxHx1xL[:, :, 0] for name, x_BxHx1xL in dkv_res.items()
                         if name.endswith("@k") and x_BxHx1xL.ndim == 4 and x_BxHx1xL.shape[2] == 1}}
    for key, (first, width) in open_layout(terms).items():
      part_BxHxLxX = dq_res["dopen"][..., first:first + width]
      if open_arrays[key][0] == term_lib.ROWS:
        sums["d" + key + "@q"] = part_BxHxLxX[..., 0]
      else:
        sums["d" + key] = part_BxHxLxX
    for key, (kind, _) in open_arrays.items():
      if kind == term_lib.EMBEDDINGS:
        sums["d" + key + "@k"] = dkv_res["d" + key + "@k"]
    d_terms = d_terms.replace(open=term_lib.gradients(terms.open, sums))
  if terms.sink is not None:
    d_terms = d_terms.replace(sink=sink_lib.gradient(terms.sink, row_max_BxHxLxT, row_sum_BxHxLxT, delta_BxHxLx1))
  if terms.path is not None:
    dband_BxHxPxS, dkv_res["dk"] = path_blocks.visited_grads(
        plan, terms.path.size, dq_res["dband"], dkv_res["dk"].reshape(b, h, -1, t, d), key_tiles_BxNx2,
        query_tiles_BxMx2)
    d_terms = d_terms.replace(path=terms.path.replace(band=dband_BxHxPxS))
  dq_BxHxLxK = dq_res["dq"]
  dk_BxHxLxK, dv_BxHxLxV = (group_sum(dkv_res[name], plan.group) for name in ("dk", "dv"))  # over each group
  return (jax.tree_util.tree_leaves(d_terms), dq_BxHxLxK.astype(q_BxHxLxK.dtype), dk_BxHxLxK.astype(k_BxHxLxK.dtype),
          dv_BxHxLxV.astype(v_BxHxLxV.dtype), None, None, None, None, None)


attention.defvjp(_attention_fwd, _attention_bwd)


def decode(plan: Plan, leaves, q_BxHxQxK, k_BxGxTxK, v_BxGxTxV, q_positions_BxQ, q_slots_BxQ, positions_BxT, valid_BxT,
           ranges_BxNx2):
  """Decoding on TPU (:func:`posjax.kernels.decode.decode_attention`): ``[B, H, Q, V]`` for ``Q`` queries (a
  multiple of ``plan.block_q``) at cache slots ``q_slots`` against a cache of ``T`` slots (a multiple of
  ``plan.block_k``): the forward kernel over a ``(b, h, query tile, key tile)`` grid, the query side's positions and
  slots its own, the key tiles outside each query tile's range (``ranges``) skipped."""
  terms = plan.terms(leaves)
  b, h, q, _ = q_BxHxQxK.shape
  t, bq, bk = k_BxGxTxK.shape[2], plan.block_q, plan.block_k
  arrays = _inputs(plan, terms, q_BxHxQxK, k_BxGxTxK, v_BxGxTxV, positions_BxT, jnp.zeros_like(positions_BxT),
                   valid_BxT, None, {})
  add_query_arrays(arrays, {"q_positions": q_positions_BxQ, "q_segments": jnp.zeros_like(q_positions_BxQ),
                            "q_slots": q_slots_BxQ, **term_lib.query_rows(terms.open, q_slots_BxQ)}, bk)
  out = call(_forward_kernel, plan, terms, arrays,
             {"out": row_output((b, h, q, v_BxGxTxV.shape[-1]), bq, jnp.float32),
              "row_max": row_output((b, h, q, bk), bq), "row_sum": row_output((b, h, q, bk), bq)},
              (b, h, q // bq, t // bk), query_major(q // bq),
              {"m": (bq, bk), "l": (bq, bk), "acc": (bq, v_BxGxTxV.shape[-1]), "misplaced": (bq, bk)}, ranges_BxNx2)
  if terms.sink is not None:
    return sink_lib.rescale(terms.sink, out["out"], out["row_max"], out["row_sum"])[0]
  return out["out"]
