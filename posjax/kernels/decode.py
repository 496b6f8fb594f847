"""Attention of a few new queries over a KV cache, the position terms built from positions: :func:`decode_attention`.

A decoder's prefill (the prompt) and each decode step (one token) write their keys, values, positions and validity
into the cache's next slots, then attend over it: causal in slot order, the sliding window counted in slots. Every
term is a function of (query position, key position, q, k), so a method decodes exactly where its terms are given
the queries' positions (the prompt's, continuing past it) and the cached keys' (:mod:`posjax.kernels.terms`).

Implementations: ``xla`` (dense ``[B, H, Q, T]`` logits from :mod:`posjax.kernels.xla`'s formulas, the reference;
every term) and ``pallas``, a decode kernel per backend that reads the cache in place, tile by tile, building ALiBi,
T5 buckets, KERPLE, FIRE and the Forgetting Transformer's cached sums inside each tile from the positions
(:data:`KERNEL_TERMS`; RoPE, xPos and the absolute methods only change q and k before the call) and skipping the key tiles no query can see (past the newest query's
slot, before the sliding window):

- GPU (Triton, :func:`posjax.kernels.triton.decode`): grid ``(batch, head, query tile x split)``: the key tiles a
  query tile visits are shared by ``splits`` programs (flash decoding: a batch of one still fills the GPU), each
  writing unnormalised rows and their maximum and sum, combined after the kernel;
- TPU (Mosaic, :func:`posjax.kernels.mosaic.decode`): the forward kernel over ``(batch, head, query tile, key
  tile)``, the query side's positions and slots its own, skipped key tiles issuing no copy.

Grouped-query attention: the cache holds the G key/value heads, heads first (``[B, G, T, K]``, the kernels' layout:
no transpose of the cache per step); query head h reads head ``h // (H / G)`` through the kernels' index maps.

Shapes: B batch, Q new queries, H heads, G key/value heads, T cache slots, K head dim, V value head dim, N query
tiles.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from posjax.kernels import capability, mosaic, tile, triton, xla
from posjax.kernels.shard import per_shard
from posjax.kernels.terms import Terms, as_terms, bind_open, check_rows, kv_group

IMPLEMENTATIONS = ("pallas", "xla")
KERNEL_TERMS = capability.DECODE_BUILT  # the built-in terms the decode kernels build per tile


def kernel_refusal(terms: Terms | None) -> str | None:
  """Why the decode kernels cannot compute ``terms`` (None: they can): :func:`posjax.kernels.capability.refusal`."""
  return capability.refusal("decode", terms)


def decode_attention(q_BxQxHxK, k_BxGxTxK, v_BxGxTxV, *, start, key_positions, key_valid, terms: Terms | None = None,
                     scale: float | None = None, sliding_window: int = 0, chunk: int = 0,
                     implementation: str = "pallas",
                     block_sizes: tuple[int, int] | None = None, splits: int | None = None,
                     interpret: bool | str | None = None, platform: str | None = None, batch_axes=None,
                     head_axes=None):
  """``[B, Q, H, V]``: queries at cache slots ``start .. start + Q - 1`` over a cache of ``T`` slots.

  The queries' own keys, values, positions and validity are already in the cache at their slots.

  Args:
    q_BxQxHxK: the new queries (after the position method's transform: RoPE-rotated).
    k_BxGxTxK, v_BxGxTxV: the cache, heads first; G divides H (grouped-query attention).
    start: the first query's slot (an int32 scalar, traced).
    key_positions: ``[B, T]`` int, each slot's position (the queries' too: theirs are read at their slots).
    key_valid: ``[B, T]``, True at slots holding a real token (not padding, not yet written).
    terms: the position terms (:class:`~posjax.kernels.terms.Terms`, an open term or a sequence of either; an open
      term's rows and embeddings span the cache's slots).
    scale: the factor on ``q·k`` (default ``1/sqrt(K)``).
    sliding_window: key slot j only for queries at slots ``j <= i < j + sliding_window`` (0: every earlier slot).
    chunk: key slot j only for queries in its aligned block of ``chunk`` slots, ``i // C == j // C`` (0: none); the
      kernels skip the earlier chunks' tiles.
    implementation: ``pallas`` (the decode kernels: :data:`KERNEL_TERMS` only) or ``xla`` (every term).
    block_sizes: the kernels' (query, key) tile (default GPU: queries padded to a power of two of 16 to 64 rows,
      :func:`posjax.kernels.triton.default_block_sizes`' key tile; TPU: up to 256 query rows, a multiple of 8, and
      256 keys). The cache is padded to a multiple of the key tile: one whose length is a multiple is read in place.
    splits: GPU programs per query tile (default: enough for about 256 programs in all, at most one per key tile).
    interpret, platform, batch_axes, head_axes: as :func:`posjax.kernels.relative_attention`'s; under a mesh the
      kernels run once per shard, the cache split like the queries (rows over the batch's axes, heads over the
      heads').
  """
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"unknown implementation {implementation!r}; allowed: {list(IMPLEMENTATIONS)}")
  terms = as_terms(terms)
  if q_BxQxHxK.ndim != 4 or k_BxGxTxK.ndim != 4 or v_BxGxTxV.shape[:3] != k_BxGxTxK.shape[:3]:
    raise ValueError(f"q {q_BxQxHxK.shape}, k {k_BxGxTxK.shape} and v {v_BxGxTxV.shape}: expected q [B, Q, H, K] and "
                     "a cache k [B, G, T, K], v [B, G, T, V] (heads first)")
  b, q, h, d = q_BxQxHxK.shape
  g, t = k_BxGxTxK.shape[1], k_BxGxTxK.shape[2]
  if k_BxGxTxK.shape[0] != b or k_BxGxTxK.shape[3] != d or q > t:
    raise ValueError(f"q {q_BxQxHxK.shape} and the cache k {k_BxGxTxK.shape} must agree on B and K, with no more "
                     "queries than cache slots")
  group = kv_group(h, g)
  check_rows("key_positions", key_positions, b, t)
  check_rows("key_valid", key_valid, b, t, "mask")
  for name, value in (("sliding_window", sliding_window), ("chunk", chunk)):
    if not isinstance(value, int) or value < 0:
      raise ValueError(f"{name}={value!r} must be an int >= 0 (0: none)")
  terms.check(b, h, d, t)
  scale = 1.0 / d ** 0.5 if scale is None else float(scale)
  positions_BxT = jnp.broadcast_to(jnp.asarray(key_positions, jnp.int32), (b, t))
  valid_BxT = jnp.broadcast_to(jnp.asarray(key_valid, bool), (b, t))
  start = jnp.asarray(start, jnp.int32)
  if implementation == "xla":
    dense = functools.partial(_dense, q_BxQxHxK, start=start, terms=terms, scale=scale, sliding_window=sliding_window,
                              chunk=chunk)
    sizes = (tuple(size for size in filled_sizes(t) if size >= q)  # (a prefix shorter than the queries holds none)
             if not any(t in jnp.shape(x) for x in jax.tree.leaves(terms)) else (t,))
    if len(sizes) == 1:  # (a term with an array over the slots, the Forgetting Transformer's: the whole cache)
      return dense(k_BxGxTxK, v_BxGxTxV, positions_BxT, valid_BxT)
    # the smallest prefix of the cache that holds every slot the step reads, [0, start + Q): one program per size
    branch = lambda size: lambda *cache: dense(*(x[:, :, :size] if x.ndim == 4 else x[:, :size] for x in cache))
    index = jnp.sum(jnp.asarray(sizes[:-1], jnp.int32) < start + q)
    return jax.lax.switch(index, [branch(size) for size in sizes], k_BxGxTxK, v_BxGxTxV, positions_BxT, valid_BxT)
  refusal = kernel_refusal(terms)
  if refusal:
    raise ValueError(f"decode_attention(implementation='pallas'): {refusal}; use implementation='xla'")
  terms = terms.kernel_form()
  terms = bind_open(terms, positions_BxT, b, h, t)
  tpu, interpret = tile.backend(interpret, platform)
  bq, bk = block_sizes or default_block_sizes(terms, q, d, tpu)
  for name, block, multiple in (("query", bq, 8 if tpu else 1), ("key", bk, 128 if tpu else 1)):
    if not isinstance(block, int) or block < 1 or block % multiple or (not tpu and block & (block - 1)):
      raise ValueError(f"decode block_sizes: the {name} tile {block!r} must be "
                       + (f"a multiple of {multiple} on TPU" if tpu else "a power of two on GPU"))
  padded_q, padded_t = -(-q // bq) * bq, -(-t // bk) * bk
  n_q = padded_q // bq
  splits = 1 if tpu else splits or max(1, min(padded_t // bk, -(-256 // (b * h * n_q))))
  # padded query rows repeat the last query's slot (their rows are dropped)
  slots_Q = start + jnp.minimum(jnp.arange(padded_q, dtype=jnp.int32), q - 1)
  first_N, last_N = slots_Q[::bq], slots_Q[bq - 1::bq]
  lo_N = jnp.maximum(first_N - sliding_window + 1, 0) // bk if sliding_window else jnp.zeros_like(first_N)
  if chunk:  # the tile's first query's chunk starts the keys it needs
    lo_N = jnp.maximum(lo_N, (first_N // chunk) * chunk // bk)
  # each row's keys start at its first valid slot (a left-padded row's padding tiles are not read); a query tile
  # of padding alone still reads its last tile (masked: finite rows, as before)
  first_B = jnp.argmax(valid_BxT, axis=1).astype(jnp.int32)
  hi_N = last_N // bk + 1
  lo_BxN = jnp.minimum(jnp.maximum(lo_N[None], (first_B // bk)[:, None]), hi_N[None] - 1)
  ranges_BxNx2 = jnp.stack([lo_BxN, jnp.broadcast_to(hi_N, (b, n_q))], axis=2)
  pad = lambda x_S, axis, size: x_S if x_S.shape[axis] == size else jnp.pad(
      x_S, [(0, size - x_S.shape[a] if a == axis else 0) for a in range(x_S.ndim)])  # the cache in place when it fits
  head_dim, value_dim = (d, v_BxGxTxV.shape[-1]) if tpu else (tile.next_power_of_two(d),
                                                              tile.next_power_of_two(v_BxGxTxV.shape[-1]))
  terms = terms.replace(open=tile.pad_open(terms.open, b, padded_t, tpu))
  leaves, treedef = jax.tree_util.tree_flatten(terms)
  plan = tile.Plan(scale=scale, causal=True, block_q=bq, block_k=bk, length=t, interpret=interpret, treedef=treedef,
                   group=group, sliding_window=sliding_window, splits=splits, chunk=chunk)
  q_BxHxQxK = pad(pad(q_BxQxHxK, 1, padded_q), 3, head_dim).transpose(0, 2, 1, 3)
  cache = lambda x_BxGxTxX, dim: pad(pad(x_BxGxTxX, 2, padded_t), 3, dim)
  line = lambda x_BxT: pad(x_BxT, 1, padded_t)
  # q, k, v [B, H or G, S, X]; query positions and slots, key positions and validity [B, S]; the tile ranges
  specs = lambda b_, h_: (P(b_, h_, None, None),) * 3 + (P(b_, None),) * 4 + (P(b_, None, None),)
  backend = functools.partial((mosaic if tpu else triton).decode, plan)
  out_BxHxQxV = per_shard(backend, terms, b, h, batch_axes, head_axes, kv_heads=g, arg_specs=specs)(
      leaves, q_BxHxQxK, cache(k_BxGxTxK, head_dim), cache(v_BxGxTxV, value_dim),
      jnp.take(positions_BxT, slots_Q, axis=1), jnp.broadcast_to(slots_Q, (b, padded_q)), line(positions_BxT),
      line(valid_BxT.astype(jnp.int32)), ranges_BxNx2)
  return out_BxHxQxV.transpose(0, 2, 1, 3)[:, :q, :, :v_BxGxTxV.shape[-1]].astype(v_BxGxTxV.dtype)


FILLED_MIN = 128  # the dense step's smallest cache prefix


def filled_sizes(slots: int) -> tuple[int, ...]:
  """The cache prefixes the dense step chooses among: 128, 256, ... (doubling) below ``slots``, then ``slots``. A
  step reads the smallest that holds its slots, so its cost follows the filled cache (within 2x), not its size."""
  sizes = []
  while (FILLED_MIN << len(sizes)) < slots:
    sizes.append(FILLED_MIN << len(sizes))
  return (*sizes, slots)


def _dense(q_BxQxHxK, k_BxGxTxK, v_BxGxTxV, positions_BxT, valid_BxT, *, start, terms: Terms, scale: float,
           sliding_window: int, chunk: int):
  """``[B, Q, H, V]`` on :mod:`posjax.kernels.xla`'s formulas over the T slots given (``[B, H, Q, T]`` logits)."""
  (b, q, h, _), t = q_BxQxHxK.shape, k_BxGxTxK.shape[2]
  terms = bind_open(terms, positions_BxT, b, h, t)
  rows_Q = start + jnp.arange(q, dtype=jnp.int32)
  k_BxTxGxK, v_BxTxGxV = jnp.swapaxes(k_BxGxTxK, 1, 2), jnp.swapaxes(v_BxGxTxV, 1, 2)
  s_BxHxQxT = xla.logits(q_BxQxHxK, k_BxTxGxK, terms, positions_BxT, scale, rows_Q)
  slots_BxT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) // chunk, (b, t)) if chunk else jnp.zeros_like(
      positions_BxT)  # a chunk's slots are one segment
  allowed_Bx1xQxT = xla.allowed_pairs(valid_BxT, slots_BxT, True, rows_Q, sliding_window)
  weights_BxHxQxT = xla.attention_weights(s_BxHxQxT, allowed_Bx1xQxT, terms, q_BxQxHxK, rows_Q)
  return xla.weighted_values(weights_BxHxQxT, v_BxTxGxV)


def default_block_sizes(terms: Terms, queries: int, head_dim: int, tpu: bool) -> tuple[int, int]:
  """The decode kernels' (query, key) tile: on TPU up to 256 query rows (a multiple of 8) and 256 keys; on GPU the
  queries padded to a power of two of 16 (Triton's smallest product) to 64 rows, the training kernels' key tile."""
  if tpu:
    return min(256, -(-queries // 8) * 8), 256
  return min(64, max(16, tile.next_power_of_two(queries))), triton.default_block_sizes(terms, queries, head_dim)[1]
