"""What both tiled backends of the op share: the GPU's (:mod:`posjax.kernels.triton`) and the TPU's
(:mod:`posjax.kernels.mosaic`).

Shapes: B batch, H heads, L padded length, K head dim, V value head dim, Q/T query/key tile rows, W window
rows (``2·block``), D relative-table rows (``2k+1``), R rows of the distance-ordered table (``2L``), P tile
diagonals, M/N/C a matrix's rows/columns/contracted axis. A tile's ``_QxT`` flag may come as ``[Q, 1]`` or
``[1, T]``: broadcastable to the tile.

- :class:`Plan`: everything static about one call (the ``custom_vjp``'s non-differentiable argument);
- :func:`block_sizes`: the tiles and the padded length;
- :func:`dot`, :func:`dot_t`, :func:`t_dot`: a tile's matrix products, accumulated in float32;
- :class:`TileBase`: the logits of one (query tile, key tile) pair from the tile's positions and the terms'
  small inputs (:mod:`posjax.kernels.terms`), its mask, dropout and how the logits' gradient reaches the
  untied term and the open terms' inputs (:mod:`posjax.kernels.term`); each backend loads its inputs its own way
  through the hooks;
- the relative vectors' distance-ordered layout (:func:`window_table`) and the folding of its gradient back
  into the table (:func:`overlap_add`, :func:`fold_window_table`); :func:`row_delta` and
  :func:`untied_grads`, the backward's steps outside the kernels.

A masked logit is the most negative float32 (not -inf) so that a fully masked row averages every key, as the
``xla`` path does; keys past the sequence (block padding) are -inf, so they never count.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from posjax.kernels import dropout as dropout_lib
from posjax.kernels import term as term_lib
from posjax.kernels.terms import Relative, Terms, Untied

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
  group: int = 1  # query heads per key/value head (grouped-query attention): head h reads k/v head h // group
  sliding_window: int = 0  # keys |i - j| < W only (with causal: i - W < j <= i); 0: no window
  splits: int = 1  # decoding (posjax.kernels.decode): programs sharing one query tile's key tiles
  chunk: int = 0  # decoding: keys in the query's aligned block of C slots only (training: chunks come as segments)

  def terms(self, leaves) -> Terms:
    """The call's :class:`~posjax.kernels.terms.Terms` from their array leaves."""
    return jax.tree_util.tree_unflatten(self.treedef, leaves)


PLATFORMS = ("cpu", "gpu", "tpu")


def backend(interpret, platform: str | None) -> tuple[bool, Any]:
  """``(tpu, interpret)``: whether the TPU (Mosaic) kernels run, and the ``interpret`` argument of their
  ``pallas_call``, from an op's ``interpret`` (None: interpret on a CPU; True: the GPU kernels in the generic
  interpreter; ``"tpu"``: the TPU kernels in the Mosaic TPU interpreter; False: compiled) and ``platform`` (the
  device compiled for, default the default backend's)."""
  platform = jax.default_backend() if platform is None else platform
  if platform not in PLATFORMS:
    raise ValueError(f"platform={platform!r}; allowed: None (the default backend's) or one of {list(PLATFORMS)}")
  tpu = interpret == "tpu" or (not interpret and platform == "tpu")
  if interpret is None:
    interpret = platform == "cpu"
  elif interpret == "tpu":
    interpret = pltpu.InterpretParams()
  elif not isinstance(interpret, bool):
    raise ValueError(f"interpret={interpret!r}; allowed: None, True, False, 'tpu'")
  return tpu, interpret


def kv_head(h, group: int):
  """The key/value head query head ``h`` (a grid index) reads: ``h // group`` (``lax.div``, exact for the
  non-negative index; no op at all without groups, so the index maps lower as before)."""
  return h if group == 1 else jax.lax.div(h, group)


def group_sum(d_BxHxLxX, group: int):
  """``[B, H, L, X] -> [B, H / group, L, X]``: per-query-head gradients of a key/value head summed over the
  ``group`` query heads that read it (grouped-query attention; unchanged for ``group=1``)."""
  if group == 1:
    return d_BxHxLxX
  b, h, l, x = d_BxHxLxX.shape
  return jnp.sum(d_BxHxLxX.reshape(b, h // group, group, l, x), axis=2)


def next_power_of_two(n: int) -> int:
  """The least power of two ``>= n`` (1 for ``n <= 1``): Triton's arrays must have power-of-two sizes."""
  return 1 << max(0, int(n) - 1).bit_length()


def pad_open(bounds, batch: int, padded: int, tpu: bool) -> tuple:
  """The bound open terms' arrays as the kernels read them: rows and embeddings broadcast to the batch and padded to
  the tiles (zeros: padded keys are masked); on GPU (Triton's arrays are powers of two) a head's scalars and
  embeddings padded with zeros, a table with its last entry (an index past the table reads it, as the dense path's
  clamp, and its gradient reaches the last entry)."""
  pow2 = next_power_of_two
  out = []
  for bound in bounds:
    arrays = {}
    for name, kind in bound.kinds:
      x = bound.arrays[name]
      if kind in (term_lib.ROWS, term_lib.EMBEDDINGS):
        x = jnp.broadcast_to(x, (batch, *x.shape[1:]))
        x = jnp.pad(x, [(0, padded - x.shape[2]) if a == 2 else (0, 0) for a in range(x.ndim)])
      if not tpu and kind != term_lib.ROWS:
        width = max(16, pow2(x.shape[-1])) if kind == term_lib.EMBEDDINGS else pow2(x.shape[-1])
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])],
                    mode="edge" if kind == term_lib.TABLE else "constant")
      arrays[name] = x
    out.append(bound.replace(arrays=arrays))
  return tuple(out)


def block_sizes(length: int, block_q: int, block_k: int) -> tuple[int, int, int]:
  """``(block_q, block_k, padded length)``: power-of-two tiles (Triton's blocks must be) no longer than the
  sequence rounded up to a power of two, and the length padded to a multiple of both (the larger tile: a 1,100-token
  row computes 1,152 at 128x64, not 2,048)."""
  for name, block in (("block_q", block_q), ("block_k", block_k)):
    if not isinstance(block, int) or block < 1 or block & (block - 1):
      raise ValueError(f"block_sizes: {name}={block!r} must be a positive power of two")
  bq, bk = min(block_q, next_power_of_two(length)), min(block_k, next_power_of_two(length))
  step = max(bq, bk)
  return bq, bk, -(-length // step) * step


def segment_bounds(segment_ids_BxP):
  """``([B, P], [B, P])``: the first and the last index of each position's segment id in its row (anywhere in it:
  exact for ids that are not contiguous runs), by a stable sort of the ids (``O(P log P)``, no ``[P, P]``)."""
  b, p = segment_ids_BxP.shape
  order_BxP = jnp.argsort(segment_ids_BxP, axis=1, stable=True)
  sorted_BxP = jnp.take_along_axis(segment_ids_BxP, order_BxP, axis=1)
  index_BxP = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
  change_BxQ = sorted_BxP[:, 1:] != sorted_BxP[:, :-1]
  starts_BxP = jnp.concatenate([jnp.ones((b, 1), bool), change_BxQ], axis=1)
  ends_BxP = jnp.concatenate([change_BxQ, jnp.ones((b, 1), bool)], axis=1)
  # a group's first and last sorted slot (the stable sort keeps its indices rising: its first and last index)
  start_BxP = jax.lax.cummax(jnp.where(starts_BxP, index_BxP, 0), axis=1)
  end_BxP = jax.lax.cummin(jnp.where(ends_BxP, index_BxP, p - 1), axis=1, reverse=True)
  inverse_BxP = jnp.argsort(order_BxP, axis=1)
  back = lambda slot_BxP: jnp.take_along_axis(jnp.take_along_axis(order_BxP, slot_BxP, axis=1), inverse_BxP, axis=1)
  return back(start_BxP).astype(jnp.int32), back(end_BxP).astype(jnp.int32)


def diagonal_may_hold_pairs(plan: Plan, diagonal):
  """Whether the tile diagonal ``key tile - query tile = diagonal`` (square tiles) can hold an allowed pair: not above
  the causal one, nor (sliding window) one whose nearest pair is ``sliding_window`` tokens apart or more."""
  nearest = jnp.abs(diagonal) * plan.block_q - (plan.block_q - 1)  # the smallest |i - j| off the main diagonal
  in_window = (diagonal == 0) | (nearest < plan.sliding_window) if plan.sliding_window else jnp.bool_(True)
  return in_window & (diagonal <= 0) if plan.causal else in_window


def tile_ranges(plan: Plan, segment_ids_BxP, valid_BxP):
  """``(keys_BxNx2, queries_BxMx2)``: for each query tile the key tiles ``[lo, hi)`` it must visit, for each key tile
  the query tiles, computed at run time from the segment ids and the mask; the tiles outside hold no allowed pair
  (above the causal diagonal, outside the sliding window, in another packed document), so the kernels skip them.

  A query row with no allowed key (a padded or masked query: every key tile of its row is masked) averages every
  real key, as the ``xla`` path does: its query tile visits every key tile, and every key tile visits its tile
  (``valid`` is 0 at the padding past the real length too, whose rows visit everything: never an empty row)."""
  b, p = segment_ids_BxP.shape
  bq, bk, w = plan.block_q, plan.block_k, plan.sliding_window
  first_BxP, last_BxP = segment_bounds(segment_ids_BxP)
  index_P = jnp.arange(p, dtype=jnp.int32)
  lo_BxP, hi_BxP = first_BxP, last_BxP  # the keys of query row i
  if plan.causal:
    hi_BxP = jnp.minimum(hi_BxP, index_P)
  if w:
    lo_BxP = jnp.maximum(lo_BxP, index_P - w + 1)
    if not plan.causal:
      hi_BxP = jnp.minimum(hi_BxP, index_P + w - 1)
  masked_BxP = valid_BxP == 0
  per_tile = lambda x_BxP, block: x_BxP.reshape(b, p // block, block)
  all_keys_BxN = jnp.any(per_tile(masked_BxP, bq), axis=2)
  keys_lo_BxN = jnp.where(all_keys_BxN, 0, jnp.min(per_tile(lo_BxP, bq), axis=2) // bk)
  keys_hi_BxN = jnp.where(all_keys_BxN, p // bk, jnp.max(per_tile(hi_BxP, bq), axis=2) // bk + 1)
  lo_BxP, hi_BxP = first_BxP, last_BxP  # the queries of key row j
  if plan.causal:
    lo_BxP = jnp.maximum(lo_BxP, index_P)
  if w:
    hi_BxP = jnp.minimum(hi_BxP, index_P + w - 1)
    if not plan.causal:
      lo_BxP = jnp.maximum(lo_BxP, index_P - w + 1)
  queries_lo_BxM = jnp.min(per_tile(lo_BxP, bk), axis=2) // bq
  queries_hi_BxM = jnp.max(per_tile(hi_BxP, bk), axis=2) // bq + 1
  # a masked query row of the real sequence reads every key: every key tile visits its query tile
  real_masked_BxP = masked_BxP & (index_P < plan.length)
  first_masked_B = jnp.min(jnp.where(real_masked_BxP, index_P, p), axis=1) // bq
  last_masked_B = jnp.max(jnp.where(real_masked_BxP, index_P, -1), axis=1) // bq
  any_B = jnp.any(real_masked_BxP, axis=1)
  queries_lo_BxM = jnp.where(any_B[:, None], jnp.minimum(queries_lo_BxM, first_masked_B[:, None]), queries_lo_BxM)
  queries_hi_BxM = jnp.where(any_B[:, None], jnp.maximum(queries_hi_BxM, last_masked_B[:, None] + 1), queries_hi_BxM)
  return (jnp.stack([keys_lo_BxN, keys_hi_BxN], axis=2).astype(jnp.int32),
          jnp.stack([queries_lo_BxM, queries_hi_BxM], axis=2).astype(jnp.int32))


def query_share(ranges, offset, rows: int, block_q: int):
  """:func:`tile_ranges` for the ``rows`` queries at ``offset`` of the sequence (a context shard's: ``offset`` a
  traced multiple of ``block_q``): the key tiles of its query tiles, and each key tile's range of them counted from
  its first (empty, ``[n, n)`` or ``[0, 0)``, for a key tile no query of the share reads)."""
  keys_BxNx2, queries_BxMx2 = ranges
  first, n = offset // block_q, rows // block_q
  return (jax.lax.dynamic_slice_in_dim(keys_BxNx2, first, n, axis=1),
          jnp.clip(queries_BxMx2 - first, 0, n).astype(jnp.int32))


def query_side(open_bounds, positions_BxL, segment_ids_BxL, offset, rows: int) -> dict:
  """A context shard's queries (``rows`` of them from ``offset``) as the kernels read them: ``q_positions``,
  ``q_segments`` and ``q_slots`` (their indices in the sequence) ``[B, Q]``, and the open terms' query rows
  (``<key>@q``, :func:`posjax.kernels.term.query_rows`)."""
  b = positions_BxL.shape[0]
  slots_BxQ = jnp.broadcast_to(offset + jnp.arange(rows, dtype=jnp.int32), (b, rows))
  share = lambda x_BxL: jax.lax.dynamic_slice_in_dim(x_BxL, offset, rows, axis=1)
  return {"q_positions": share(positions_BxL), "q_segments": share(segment_ids_BxL), "q_slots": slots_BxQ,
          **term_lib.query_rows(open_bounds, slots_BxQ)}


def place_rows(d_BxHxQxX, offset, length: int):
  """A context shard's query-side gradient rows ``[B, H, Q, ...]`` at ``offset`` of ``length`` rows (zeros
  elsewhere): the gradient of the share's rows of a whole-sequence input."""
  shape = (*d_BxHxQxX.shape[:2], length, *d_BxHxQxX.shape[3:])
  return jax.lax.dynamic_update_slice_in_dim(jnp.zeros(shape, d_BxHxQxX.dtype), d_BxHxQxX, offset, axis=2)


def _dot_general(a, b, contract, precision=None):
  return jax.lax.dot_general(a, b, (contract, ((), ())), precision=precision, preferred_element_type=jnp.float32)


def dot(a_MxC, b_CxN, precision=None):
  """``a @ b``, accumulated in float32 (both backends' matrix units take bf16 inputs; ``precision=HIGHEST``: float32
  inputs multiplied in float32, not TF32)."""
  return _dot_general(a_MxC, b_CxN, ((1,), (0,)), precision)


def dot_t(a_MxC, b_NxC, precision=None):
  """``a @ b.T`` (float32), without transposing ``b`` in memory."""
  return _dot_general(a_MxC, b_NxC, ((1,), (1,)), precision)


def t_dot(a_CxM, b_CxN):
  """``a.T @ b`` (float32), without transposing ``a`` in memory."""
  return _dot_general(a_CxM, b_CxN, ((0,), (0,)))


class TileBase:
  """One (query tile, key tile) pair: its logits, mask and what the backward needs to route gradients.

  Both backends' tiles share it, given their own loads through the hooks ``_relative_term``, ``_untied_factors``,
  ``_theta``, ``_salt``, ``_exact`` (a float32-accurate product's precision) and the open terms' (:meth:`open_logits`):
  the position terms and the [CLS] reset, the mask and the logits, dropout, and the routing of the logits' gradient
  to the untied term and the open terms. A subclass sets ``plan``, ``terms``, the [CLS] flags ``cls_i_QxT`` /
  ``cls_j_QxT``, the open terms' pairs (``open_q_positions``, ...) and the pairs' indices ``index_i_QxT`` /
  ``index_j_QxT``, then calls :meth:`add_position_terms` and :meth:`mask_logits`, which set the attributes the
  kernels read (``s_QxT``, ``allowed_QxT``, ``u_q_QxK``, ``u_k_TxK``, ...).
  """

  plan: Plan
  terms: Terms

  def open_logits(self, s_QxT):
    """The content score ``s`` after the open terms (:func:`posjax.kernels.term.tile_logits`), through the backend's
    hooks ``open_load(key, kind, side)``, ``open_gather(key, index)``, ``open_entries(key)`` and ``open_inner(a, b)``
    and the pairs the subclass sets (``open_q_positions``, ``open_k_positions``, ``open_q_index``, ``open_k_index``)."""
    if not self.terms.open:
      return s_QxT
    self.open_shape = s_QxT.shape
    return term_lib.tile_logits(self, self.terms.open, s_QxT)

  def open_grads(self, ds_QxT, acc=None, add=None):
    """``(d content, {(key, side): d value}, [(key, index, d value)], acc)`` of the open terms from the logits'
    gradient (:func:`posjax.kernels.term.tile_grads`; ``acc``, ``add``: where hand-written gradients add their heads'
    shares); ``(ds, {}, [], acc)`` without them."""
    if not self.terms.open:
      return ds_QxT, {}, [], acc
    return term_lib.tile_grads(self, self.terms.open, ds_QxT, acc, add)

  def add_position_terms(self, s_QxT, rel_QxT):
    """``s`` plus every position term of the pairs at relative positions ``rel``."""
    terms = self.terms
    if terms.relative is not None:
      s_QxT = s_QxT + self._relative_term(rel_QxT)
    self.reset = terms.untied.reset if terms.untied is not None else "none"
    self.neither_QxT = ~self.cls_i_QxT & ~self.cls_j_QxT
    if terms.untied is None:
      return s_QxT
    self.u_q_QxK, self.u_k_TxK = self._untied_factors()
    positional_QxT = dot_t(self.u_q_QxK, self.u_k_TxK)
    return s_QxT + (positional_QxT if self.reset == "none" else self._untie(positional_QxT))

  def _exact(self):
    """The precision of a float32 product that needs float32 accuracy (Sandwich's inner products reach ``F``)."""
    return jax.lax.Precision.HIGHEST

  def _untie(self, positional_QxT):
    """The tile's part of :func:`posjax.kernels.terms.untie_cls`: [CLS] column θ2, then [CLS] row θ1."""
    theta_row, theta_col = self._theta()
    positional_QxT = jnp.where(self.cls_j_QxT, theta_col, positional_QxT)
    return jnp.where(self.cls_i_QxT, theta_row, positional_QxT)

  def mask_logits(self, s_QxT, allowed_QxT, index_i_QxT, index_j_QxT):
    """Sets the tile's logits ``s_QxT``: masked pairs the most negative float32, keys past the sequence -inf
    (and ``allowed_QxT``, the causal mask included, and the pairs' sequence indices, for dropout)."""
    if self.plan.causal:
      allowed_QxT = allowed_QxT & (index_j_QxT <= index_i_QxT)
    if self.plan.sliding_window:
      allowed_QxT = allowed_QxT & (jnp.abs(index_i_QxT - index_j_QxT) < self.plan.sliding_window)
    if self.plan.chunk:  # slots are >= 0: truncating division is the floor (and needs no sign, which Mosaic's
      # lowering reads the TPU generation for, so that compiling for a TPU on a CPU would fail)
      chunk_of = lambda index_QxT: jax.lax.div(index_QxT, jnp.asarray(self.plan.chunk, index_QxT.dtype))
      allowed_QxT = allowed_QxT & (chunk_of(index_i_QxT) == chunk_of(index_j_QxT))
    self.allowed_QxT = allowed_QxT
    self.index_i_QxT, self.index_j_QxT = index_i_QxT, index_j_QxT
    self.s_QxT = jnp.where(index_j_QxT < self.plan.length, jnp.where(allowed_QxT, s_QxT, MASKED), -jnp.inf)

  def dropped(self, x_QxT):
    """``x`` with this tile's dropout applied; ``x`` without dropout."""
    if not self.plan.dropout:
      return x_QxT
    return dropout_lib.apply(x_QxT, self._salt(), self.index_i_QxT, self.index_j_QxT, self.plan.dropout)

  def untied_grads(self, ds_QxT):
    """``ds``'s share for the untied term (the [CLS] reset replaces it on the [CLS] rows and columns; with
    ``paper`` the bucket term too, which :meth:`posjax.kernels.terms.Terms.kernel_form` reads as zero there)."""
    return ds_QxT if self.reset == "none" else jnp.where(self.neither_QxT, ds_QxT, 0.0)


def row_delta(d_out_BxHxLxV, out_BxHxLxV, keepdims: bool = False):
  """``Σ_k d_out·out`` per row (the softmax backward's correction), counting nothing where ``d_out`` is 0: a NaN
  row (a windowed table's flag) whose output the loss ignores must not poison every other gradient."""
  prod_BxHxLxV = jnp.where(d_out_BxHxLxV == 0, 0.0,
                           d_out_BxHxLxV.astype(jnp.float32) * out_BxHxLxV.astype(jnp.float32))
  return jnp.sum(prod_BxHxLxV, axis=-1, keepdims=keepdims)


def window_table(relative: Relative, padded: int):
  """``[2L, K]``: row ``u`` is ``a_clip(u - L)``, so a tile's window is a contiguous, block-aligned slice."""
  k = relative.max_distance
  return jnp.take(relative.table, np.clip(np.arange(2 * padded) - padded, -k, k) + k, axis=0)


def overlap_add(d_window_PxWxK, block: int):
  """``[2L, K]`` from the diagonals' window gradients ``[2n - 1, 2 block, K]`` (diagonal p's window starts at
  row ``p·block``): windows overlap by half, so each half adds into its block. Static pads and adds."""
  pad_blocks = lambda x_PxQxK, before: jnp.pad(x_PxQxK, ((before, 1 - before), (0, 0), (0, 0)))
  return (pad_blocks(d_window_PxWxK[:, :block], 0)
          + pad_blocks(d_window_PxWxK[:, block:], 1)).reshape(-1, d_window_PxWxK.shape[-1])


def fold_window_table(d_RxK, relative: Relative, padded: int):
  """The table's gradient ``[2k+1, K]`` from its ``[2L, K]`` distance layout's (:func:`window_table`): rows
  fold into the table's, the clipped ends summed; static slices and sums, deterministic."""
  k = relative.max_distance
  lo, hi = max(1 - k, -padded), min(k - 1, padded - 1)
  grad_DxK = jnp.zeros(relative.table.shape, jnp.float32).at[lo + k:hi + k + 1].set(
      d_RxK[lo + padded:hi + padded + 1])
  if k <= padded:
    grad_DxK = grad_DxK.at[0].set(jnp.sum(d_RxK[:padded - k + 1], axis=0))
  if k < padded:
    grad_DxK = grad_DxK.at[2 * k].set(jnp.sum(d_RxK[padded + k:], axis=0))
  return grad_DxK


def untied_grads(untied: Untied, du_q_BxHxLxK, du_k_BxHxLxK) -> Untied:
  """The untied term's gradient (θ's zero) from the kernels' ``[B, H, L, K]`` rows, summed over the batch
  where the factors were shared by it."""
  def to_input(g_BxHxLxK, like_BpxLxHxK):
    g_BxLxHxK = g_BxHxLxK.transpose(0, 2, 1, 3)
    if like_BpxLxHxK.shape[0] == 1 and g_BxLxHxK.shape[0] != 1:
      g_BxLxHxK = jnp.sum(g_BxLxHxK, axis=0, keepdims=True)
    return g_BxLxHxK.astype(like_BpxLxHxK.dtype)

  return untied.replace(u_q=to_input(du_q_BxHxLxK, untied.u_q), u_k=to_input(du_k_BxHxLxK, untied.u_k),
                        theta=None if untied.theta is None else jnp.zeros_like(untied.theta))
