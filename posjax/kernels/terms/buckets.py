"""T5's relative-position buckets (Raffel et al., JMLR 2020) and clipped distances (Shaw et al. 2018; TUPE-R's
``clip``): a learned scalar per (entry, head), as an open term (:mod:`posjax.kernels.term`) that reads its table at
an index computed in the tile, and the formulas that choose the entry.

Shapes: S any (broadcast) shape, N table entries, H heads.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from posjax.kernels.term import TABLE, Term


def clipped_index(rel_S, k: int):
  """Row of ``r = clip(rel, -k, k)`` in a ``[2k+1, ..]`` table (Shaw's, Method 4's, TUPE-R's ``clip``):
  distances past ±k share the end rows."""
  return jnp.clip(rel_S, -k, k) + k


def bucket(rel_S, num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = True):
  """T5's log-spaced bucket of the relative distance ``rel = j - i`` (key minus query), int32 of its shape.

  Bidirectional with 32 buckets: half the buckets per direction, distances below 8 get a bucket of their
  own, 8..127 share log-spaced buckets, everything at or past ``max_distance`` the last one; keys after
  the query (``j > i``) add ``num_buckets // 2``. Unidirectional: keys after the query all get bucket 0.
  """
  rel_S = jnp.asarray(rel_S, jnp.int32)
  n_S = -rel_S
  ret_S = jnp.zeros_like(rel_S)
  if bidirectional:
    num_buckets //= 2
    ret_S = ret_S + (n_S < 0).astype(jnp.int32) * num_buckets
    n_S = jnp.abs(n_S)
  else:
    n_S = jnp.maximum(n_S, 0)
  max_exact = num_buckets // 2
  large_S = max_exact + (
      jnp.log(jnp.maximum(n_S, 1).astype(jnp.float32) / max_exact) / jnp.log(max_distance / max_exact)
      * (num_buckets - max_exact)).astype(jnp.int32)
  large_S = jnp.minimum(large_S, num_buckets - 1)
  return ret_S + jnp.where(n_S < max_exact, n_S, large_S)


def check_buckets(num_buckets: int, max_distance: int, bidirectional: bool) -> None:
  """Raises unless :func:`bucket`'s options make sense (T5's options and :class:`Buckets` alike): at least 4
  buckets (even when bidirectional) and a ``max_distance`` past the exact buckets."""
  if num_buckets < 4 or (bidirectional and num_buckets % 2):
    raise ValueError(f"num_buckets={num_buckets} must be >= 4 (and even when bidirectional)")
  exact = num_buckets // (4 if bidirectional else 2)
  if max_distance <= exact:
    raise ValueError(f"max_distance={max_distance} must exceed the {exact} exact buckets")


@flax.struct.dataclass
class Buckets(Term):
  """One learned scalar per (table entry, head), the entry chosen from the relative distance.

  ``kind="buckets"``: T5's log buckets (``num_buckets``, ``max_distance``, ``bidirectional``); ``"clip"``:
  ``clip(r, -max_distance, max_distance) + max_distance``. ``cls_row`` / ``cls_col``: entries that a [CLS]
  query's row / a [CLS] key's column read instead (TUPE-R's official reset; the row wins), or None.
  """

  table: jax.Array  # [N, H]
  kind: str = flax.struct.field(pytree_node=False, default="buckets")
  num_buckets: int = flax.struct.field(pytree_node=False, default=32)
  max_distance: int = flax.struct.field(pytree_node=False, default=128)
  bidirectional: bool = flax.struct.field(pytree_node=False, default=True)
  cls_row: int | None = flax.struct.field(pytree_node=False, default=None)
  cls_col: int | None = flax.struct.field(pytree_node=False, default=None)
  KINDS = {"table": TABLE}

  def entries(self, rel_S, is_cls_i_S, is_cls_j_S):
    """Table entry of each pair; ``rel`` ``[..., Q, T]``, the [CLS] flags of the query and the key, each
    broadcastable to it (``[..., Q, 1]``, ``[..., 1, T]``)."""
    if self.kind == "buckets":
      index_S = bucket(rel_S, self.num_buckets, self.max_distance, self.bidirectional)
    else:
      index_S = clipped_index(rel_S, self.max_distance)
    if self.cls_col is not None:
      index_S = jnp.where(is_cls_j_S, self.cls_col, index_S)
    if self.cls_row is not None:
      index_S = jnp.where(is_cls_i_S, self.cls_row, index_S)
    return index_S

  def check(self, batch: int, num_heads: int, head_dim: int, length: int) -> None:
    """Shapes and options, with errors that say what was given and what is allowed."""
    del batch, head_dim, length
    if self.kind not in ("buckets", "clip"):
      raise ValueError(f"Buckets.kind={self.kind!r}; allowed: ['buckets', 'clip']")
    if self.table.ndim != 2 or self.table.shape[1] != num_heads:
      raise ValueError(f"bucket table has shape {self.table.shape}; expected (entries, {num_heads})")
    if self.kind == "buckets":
      check_buckets(self.num_buckets, self.max_distance, self.bidirectional)  # its errors name the bad option
    elif self.max_distance < 1:
      raise ValueError(f"Buckets.max_distance={self.max_distance} must be >= 1 with kind='clip'")
    for name in ("cls_row", "cls_col"):
      entry = getattr(self, name)
      if entry is not None and not 0 <= entry < self.table.shape[0]:
        raise ValueError(f"Buckets.{name}={entry} is not an entry of the {self.table.shape[0]}-row table")
    needed = (self.num_buckets if self.kind == "buckets" else 2 * self.max_distance + 1)
    needed = max([needed - 1] + [e for e in (self.cls_row, self.cls_col) if e is not None]) + 1
    if self.table.shape[0] < needed:
      raise ValueError(f"bucket table has {self.table.shape[0]} entries; the options need {needed}")

  def kernel_inputs(self, positions_BxL) -> dict:
    return {"table": self.table.T}  # [H, N]: a row per head

  def logits(self, tile, s):
    """The entry of each pair (:meth:`entries`, [CLS] at position 0) read from this head's row of the table."""
    index = self.entries(tile.k_positions - tile.q_positions, tile.q_positions == 0, tile.k_positions == 0)
    return s + tile.lookup("table", index, clamp=False)  # in the table by construction (Terms.check)
