"""Shaw et al.'s (2018) and Huang et al.'s Method 4 (2020) relative vectors: the term whose kernels stay special.

Shapes: S any (broadcast) shape, K head dim.
"""

from __future__ import annotations

import flax.struct
import jax

from posjax.kernels.terms.buckets import clipped_index


@flax.struct.dataclass
class Relative:
  """Shaw's / Method 4's relative vectors ``a_r``, ``r = clip(p_j - p_i, -k, k)``; ``query``: the
  ``q_i·a_r`` term, ``key``: the ``a_r·k_j`` term (Shaw: query only; Method 4: both).

  ``window`` chooses how the Pallas kernel reads the table (the ``xla`` path ignores it):

  - False ("gather"): ``scale q·a_r`` and ``scale k·a_r`` for every row and every ``r`` (``[B, H, L, 2k+1]``)
    are computed before the kernel and gathered per pair: exact for any positions, ``O(L·k)`` memory.
  - True ("window"): each tile multiplies its queries and keys by the ``2·block`` table rows its distances can
    reach and skews the product in the tile: ``O(L)`` memory for any ``k``. It takes ``r`` as the index
    distance ``j - i``, which is right where positions rise by one inside each segment (as posjax's packing
    makes them); the kernel marks a query row with an attended key where ``p_j - p_i != j - i`` NaN, and
    :func:`posjax.kernels.relative_attention` then computes the call on the dense path instead
    (:mod:`posjax.kernels.exact`): exact for any positions either way.
    Needs equal query and key blocks.
  - None (default): the window when the table is wider than a window (``2k+1 > 2·block``) and the blocks are
    equal, else the gather.

  ``impl`` is how the ``xla`` path contracts the table (:func:`posjax.kernels.terms.query_term`): ``table``
  (default), ``skew`` or ``auto`` (by shape); the kernels ignore it.

  Not an open term: its kernels stay written for it (the windowed table's skew through a scratch block on GPU and
  rolls on TPU, its gradient summed along tile diagonals by a kernel of its own, the gathered ``q·a`` rows computed
  before the kernel), in :mod:`posjax.kernels.tile`, :mod:`posjax.kernels.triton_kernels` and
  :mod:`posjax.kernels.mosaic`.
  """

  table: jax.Array  # [2k+1, K]
  max_distance: int = flax.struct.field(pytree_node=False, default=1)
  query: bool = flax.struct.field(pytree_node=False, default=True)
  key: bool = flax.struct.field(pytree_node=False, default=False)
  window: bool | None = flax.struct.field(pytree_node=False, default=None)
  impl: str = flax.struct.field(pytree_node=False, default="table")

  def entries(self, rel_S):
    """Table row of each pair's distance (:func:`clipped_index`)."""
    return clipped_index(rel_S, self.max_distance)
