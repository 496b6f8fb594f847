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
  untied and bucket terms; each backend loads its inputs its own way through the hooks;
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

from posjax.kernels import dropout as dropout_lib
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

  def terms(self, leaves) -> Terms:
    """The call's :class:`~posjax.kernels.terms.Terms` from their array leaves."""
    return jax.tree_util.tree_unflatten(self.treedef, leaves)


def next_power_of_two(n: int) -> int:
  """The least power of two ``>= n`` (1 for ``n <= 1``): Triton's arrays must have power-of-two sizes."""
  return 1 << max(0, int(n) - 1).bit_length()


def block_sizes(length: int, block_q: int, block_k: int) -> tuple[int, int, int]:
  """``(block_q, block_k, padded length)``: power-of-two tiles (Triton's blocks must be) no longer than the
  sequence rounded up to a power of two, which is the padded length."""
  for name, block in (("block_q", block_q), ("block_k", block_k)):
    if not isinstance(block, int) or block < 1 or block & (block - 1):
      raise ValueError(f"block_sizes: {name}={block!r} must be a positive power of two")
  padded = next_power_of_two(length)
  return min(block_q, padded), min(block_k, padded), padded


def _dot_general(a, b, contract):
  return jax.lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32)


def dot(a_MxC, b_CxN):
  """``a @ b``, accumulated in float32 (both backends' matrix units take bf16 inputs)."""
  return _dot_general(a_MxC, b_CxN, ((1,), (0,)))


def dot_t(a_MxC, b_NxC):
  """``a @ b.T`` (float32), without transposing ``b`` in memory."""
  return _dot_general(a_MxC, b_NxC, ((1,), (1,)))


def t_dot(a_CxM, b_CxN):
  """``a.T @ b`` (float32), without transposing ``a`` in memory."""
  return _dot_general(a_CxM, b_CxN, ((0,), (0,)))


class TileBase:
  """One (query tile, key tile) pair: its logits, mask and what the backward needs to route gradients.

  Both backends' tiles share it, given their own loads through the hooks ``_slope``, ``_relative_term``,
  ``_untied_factors``, ``_bucket_values``, ``_theta`` and ``_salt``: the position terms and the [CLS] reset,
  the mask and the logits, dropout, and the routing of the logits' gradient to the untied and bucket terms. A
  subclass sets ``plan``, ``terms`` and the [CLS] flags ``cls_i_QxT`` / ``cls_j_QxT``, then calls
  :meth:`add_position_terms` and :meth:`mask_logits`, which set the attributes the kernels read (``s_QxT``,
  ``allowed_QxT``, ``distance_QxT``, ``bucket_QxT``, ``u_q_QxK``, ``u_k_TxK``, ...).
  """

  plan: Plan
  terms: Terms

  def add_position_terms(self, s_QxT, rel_QxT):
    """``s`` plus every position term of the pairs at relative positions ``rel``."""
    terms = self.terms
    if terms.alibi is not None:
      self.distance_QxT = jnp.abs(rel_QxT).astype(jnp.float32)
      s_QxT = s_QxT - self._slope() * self.distance_QxT
    if terms.relative is not None:
      s_QxT = s_QxT + self._relative_term(rel_QxT)
    self.reset = terms.untied.reset if terms.untied is not None else "none"
    self.neither_QxT = ~self.cls_i_QxT & ~self.cls_j_QxT
    positional_QxT = jnp.zeros_like(s_QxT)
    if terms.untied is not None:
      self.u_q_QxK, self.u_k_TxK = self._untied_factors()
      positional_QxT = dot_t(self.u_q_QxK, self.u_k_TxK)
    if self.reset == "official":
      positional_QxT = self._untie(positional_QxT)
    if terms.buckets is not None:
      self.bucket_QxT = terms.buckets.entries(rel_QxT, self.cls_i_QxT, self.cls_j_QxT)
      positional_QxT = positional_QxT + self._bucket_values(self.bucket_QxT)
    if self.reset == "paper":
      positional_QxT = self._untie(positional_QxT)
    return s_QxT + positional_QxT

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
    self.allowed_QxT = allowed_QxT
    self.index_i_QxT, self.index_j_QxT = index_i_QxT, index_j_QxT
    self.s_QxT = jnp.where(index_j_QxT < self.plan.length, jnp.where(allowed_QxT, s_QxT, MASKED), -jnp.inf)

  def dropped(self, x_QxT):
    """``x`` with this tile's dropout applied; ``x`` without dropout."""
    if not self.plan.dropout:
      return x_QxT
    return dropout_lib.apply(x_QxT, self._salt(), self.index_i_QxT, self.index_j_QxT, self.plan.dropout)

  def position_grads(self, ds_QxT):
    """``ds``'s share for the untied and bucket terms: ``(d corr, d bucket term)`` (the [CLS] reset replaces
    the untied term, and with ``paper`` the bucket term too, on the [CLS] rows and columns)."""
    untied_QxT = ds_QxT if self.reset == "none" else jnp.where(self.neither_QxT, ds_QxT, 0.0)
    bucket_QxT = jnp.where(self.neither_QxT, ds_QxT, 0.0) if self.reset == "paper" else ds_QxT
    return untied_QxT, bucket_QxT


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
