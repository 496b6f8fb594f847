"""What both Pallas backends share for PaTH's blocked form (:class:`posjax.kernels.terms.path.PathBlocks`): the
gradients their kernels store block by block, kept where a visited tile wrote them (the tiles the ranges skip write
nothing, and the copies' rows at and after their block take no pair).

Shapes: B batch, H heads, P padded length, S block (band) size, N blocks, M/T query/key tiles, K head dim.
"""

from __future__ import annotations

import jax.numpy as jnp

from posjax.kernels.tile import Plan


def visited_grads(plan: Plan, size: int, dband_BxHxPxS, dk_BxHxNxPxK, key_tiles_BxMx2, query_tiles_BxTx2):
  """``(dband, dk [B, H, N P, K])``: the band's gradient where its query tile visited the key tile (zero elsewhere),
  each copy's where one of its block's query tiles visited the key tile and the key is before the block."""
  b, h, p, _ = dband_BxHxPxS.shape
  bq, bk = plan.block_q, plan.block_k
  n_q, n_k, n = p // bq, p // bk, p // size
  # the band: query tile i's column tile c is key tile (i bq // size) (size / bk) + c
  lo_M, hi_M = key_tiles_BxMx2[..., 0], key_tiles_BxMx2[..., 1]
  key_tile_MxC = (jnp.arange(n_q) * bq // size * (size // bk))[:, None] + jnp.arange(size // bk)[None, :]
  seen_BxMxC = (key_tile_MxC >= lo_M[..., None]) & (key_tile_MxC < hi_M[..., None])
  dband = jnp.where(seen_BxMxC[:, None, :, None, :, None],
                    dband_BxHxPxS.reshape(b, h, n_q, bq, size // bk, bk), 0.0).reshape(dband_BxHxPxS.shape)
  # the copies: block a's query tiles [a size / bq, (a + 1) size / bq) meet key tile j's range, and j is before a
  lo_T, hi_T = query_tiles_BxTx2[..., 0], query_tiles_BxTx2[..., 1]
  first_N, last_N = jnp.arange(n) * size // bq, (jnp.arange(n) + 1) * size // bq
  meets_BxNxT = (first_N[None, :, None] < hi_T[:, None, :]) & (last_N[None, :, None] > lo_T[:, None, :])
  before_NxT = (jnp.arange(n_k) * bk // size)[None, :] < jnp.arange(n)[:, None]
  dk = jnp.where((meets_BxNxT & before_NxT)[:, None, :, :, None, None],
                 dk_BxHxNxPxK.reshape(b, h, n, n_k, bk, -1), 0.0)
  return dband, dk.reshape(b, h, n * p, -1)
