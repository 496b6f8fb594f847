"""The position terms a fused attention kernel computes inside its tiles, as small structured inputs.

A term never carries an ``[H, L, L]`` tensor: only what each tile needs to build its part of the logits from
the batch's positions (so packed rows are exact):

| term           | inputs                                    | logit contribution at (i, j), r = p_j - p_i       |
|----------------|-------------------------------------------|----------------------------------------------------|
| ``Alibi``      | slopes ``[H]`` (constant)                 | ``-m_h |r|``                                       |
| ``Buckets``    | table ``[N, H]``                          | ``table[entry(r), h]`` (T5 log buckets or clipping)|
| ``Relative``   | table ``[2k+1, K]``                       | ``scale (q_i·a_r + a_r·k_j)`` (Shaw, Method 4)     |
| ``Untied``     | ``u_q, u_k [Bp, L, H, K]``, θ ``[2, H]``  | ``u_q,i·u_k,j`` with the [CLS] reset (TUPE)        |

``scale`` is the op's content scale (the factor on ``q·k``); the other terms come scaled as the model adds
them. [CLS] tokens are those at position 0 (the first token of each packed segment), as in
:mod:`posjax.positions.tupe`.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

RESETS = ("official", "paper", "none")


@flax.struct.dataclass
class Alibi:
  """ALiBi's fixed slopes, one per head (no gradient: they are constants)."""

  slopes: jax.Array  # [H]


@flax.struct.dataclass
class Buckets:
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

  def entries(self, rel, is_cls_i, is_cls_j):
    """Table entry of each pair; ``rel`` ``[..., Q, K]``, the [CLS] flags of the query and the key, each
    broadcastable to it (``[..., Q, 1]``, ``[..., 1, K]``)."""
    if self.kind == "buckets":
      from posjax.positions import t5 as t5_lib  # imported here: position methods import this module

      index = t5_lib.bucket(rel, self.num_buckets, self.max_distance, self.bidirectional)
    else:
      index = jnp.clip(rel, -self.max_distance, self.max_distance) + self.max_distance
    if self.cls_col is not None:
      index = jnp.where(is_cls_j, self.cls_col, index)
    if self.cls_row is not None:
      index = jnp.where(is_cls_i, self.cls_row, index)
    return index


@flax.struct.dataclass
class Relative:
  """Shaw's / Method 4's relative vectors ``a_r``, ``r = clip(p_j - p_i, -k, k)``; ``query``: the
  ``q_i·a_r`` term, ``key``: the ``a_r·k_j`` term (Shaw: query only; Method 4: both).

  ``window`` chooses how the Pallas kernel reads the table (the ``xla`` path ignores it):

  - False ("gather"): ``scale q·a_r`` and ``scale k·a_r`` for every row and every ``r`` (``[B, H, L, 2k+1]``)
    are computed before the kernel and gathered per pair: exact for any positions, ``O(L·k)`` memory.
  - True ("window"): each tile multiplies its queries and keys by the ``2·block`` table rows its distances can
    reach and skews the product in the tile: ``O(L)`` memory for any ``k``. It takes ``r`` as the index
    distance ``j - i``, so it needs positions that rise by one inside each segment (as posjax's packing makes
    them); a query row with an attended key where ``p_j - p_i != j - i`` comes out NaN, never silently wrong.
    Needs equal query and key blocks.
  - None (default): the window when the table is wider than a window (``2k+1 > 2·block``) and the blocks are
    equal, else the gather.
  """

  table: jax.Array  # [2k+1, K]
  max_distance: int = flax.struct.field(pytree_node=False, default=1)
  query: bool = flax.struct.field(pytree_node=False, default=True)
  key: bool = flax.struct.field(pytree_node=False, default=False)
  window: bool | None = flax.struct.field(pytree_node=False, default=None)

  def entries(self, rel):
    return jnp.clip(rel, -self.max_distance, self.max_distance) + self.max_distance


@flax.struct.dataclass
class Untied:
  """TUPE's untied positional term ``u_q,i · u_k,j`` (rank K per head, already scaled), with the [CLS]
  reset: ``official`` (the row of a [CLS] query is θ1, the column of a [CLS] key θ2, added to any bucket
  term), ``paper`` (θ replaces the whole positional term, bucket term included) or ``none``."""

  u_q: jax.Array  # [Bp, L, H, K]
  u_k: jax.Array  # [Bp, L, H, K]
  theta: jax.Array | None = None  # [2, H]
  reset: str = flax.struct.field(pytree_node=False, default="official")


@flax.struct.dataclass
class Terms:
  """All position terms of one attention call (each None when absent)."""

  alibi: Alibi | None = None
  buckets: Buckets | None = None
  relative: Relative | None = None
  untied: Untied | None = None

  def check(self, batch: int, num_heads: int, head_dim: int, length: int) -> None:
    """Shapes and options, with errors that say what was given and what is allowed."""
    if self.alibi is not None and self.alibi.slopes.shape != (num_heads,):
      raise ValueError(f"ALiBi slopes have shape {self.alibi.slopes.shape}; expected ({num_heads},) (one per head)")
    if self.buckets is not None:
      b = self.buckets
      if b.kind not in ("buckets", "clip"):
        raise ValueError(f"Buckets.kind={b.kind!r}; allowed: ['buckets', 'clip']")
      if b.table.ndim != 2 or b.table.shape[1] != num_heads:
        raise ValueError(f"bucket table has shape {b.table.shape}; expected (entries, {num_heads})")
      if b.kind == "buckets":
        from posjax.positions import t5 as t5_lib

        t5_lib.T5Options(b.num_buckets, b.max_distance, b.bidirectional)  # its errors name the bad option
      elif b.max_distance < 1:
        raise ValueError(f"Buckets.max_distance={b.max_distance} must be >= 1 with kind='clip'")
      for name in ("cls_row", "cls_col"):
        entry = getattr(b, name)
        if entry is not None and not 0 <= entry < b.table.shape[0]:
          raise ValueError(f"Buckets.{name}={entry} is not an entry of the {b.table.shape[0]}-row table")
      needed = (b.num_buckets if b.kind == "buckets" else 2 * b.max_distance + 1)
      needed = max([needed - 1] + [e for e in (b.cls_row, b.cls_col) if e is not None]) + 1
      if b.table.shape[0] < needed:
        raise ValueError(f"bucket table has {b.table.shape[0]} entries; the options need {needed}")
    if self.relative is not None:
      r = self.relative
      if r.max_distance < 1:
        raise ValueError(f"Relative.max_distance={r.max_distance} must be >= 1")
      if r.table.shape != (2 * r.max_distance + 1, head_dim):
        raise ValueError(f"relative table has shape {r.table.shape}; expected ({2 * r.max_distance + 1}, "
                         f"{head_dim}) for max_distance={r.max_distance}")
      if not (r.query or r.key):
        raise ValueError("Relative term with neither the query nor the key side")
      if r.window not in (None, True, False):
        raise ValueError(f"Relative.window={r.window!r}; allowed: None (choose), True, False")
    if self.untied is not None:
      u = self.untied
      if u.reset not in RESETS:
        raise ValueError(f"Untied.reset={u.reset!r}; allowed: {list(RESETS)}")
      for name, x in (("u_q", u.u_q), ("u_k", u.u_k)):
        if x.ndim != 4 or x.shape[0] not in (1, batch) or x.shape[1:] != (length, num_heads, head_dim):
          raise ValueError(f"Untied.{name} has shape {x.shape}; expected ({batch} or 1, {length}, {num_heads}, "
                           f"{head_dim})")
      if u.reset != "none" and (u.theta is None or u.theta.shape != (2, num_heads)):
        raise ValueError(f"Untied.theta must have shape (2, {num_heads}) with reset={u.reset!r}")



def merge(*parts: Terms | None) -> Terms:
  """One :class:`Terms` from an encoder's and a layer's (each term may come from one of them only)."""
  fields = {}
  for part in parts:
    if part is None:
      continue
    for name in ("alibi", "buckets", "relative", "untied"):
      value = getattr(part, name)
      if value is not None:
        if name in fields:
          raise ValueError(f"two {name} terms given to one attention call")
        fields[name] = value
  return Terms(**fields)
