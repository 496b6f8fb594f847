"""PaTH attention's accumulated Householder transformations (Yang, Shen, Wen, Tan, Mishra, Ren, Panda, Kim; NeurIPS
2025, "PaTH Attention: Position Encoding via Accumulating Householder Transformations"; official code
fla-org/flash-linear-attention, ``fla/layers/path_attn.py`` and ``fla/ops/path_attn/``): the content logits of a
key ``j`` at or before the query ``i`` are

    q_i^T H_i H_{i-1} ... H_{j+1} k_j,   H_t = I - β_t w_t w_t^T,

a data-dependent product in place of RoPE's fixed rotations (the diagonal, ``j = i``, untransformed). ``w_t`` and
``β_t`` are one per token and key/value head; the query heads of a group share their key head's products.

The dense form (:meth:`Path.content`) is the authors' chunkwise one: per chunk of ``C`` tokens the UT transform
``T = (I + diag(β) strict_lower(W W^T))^{-1}`` gives, in closed form, every product inside the chunk, each query
carried back to its chunk's start and each key forward to its chunk's end, and the chunk's whole product
``H_C ... H_1 = I - W^T T diag(β) W``; a scan over the query chunks then carries the earlier keys forward chunk by
chunk, so the cost is the attention's ``O(L^2 K)``, nothing is ``[L, K, K]`` and nothing but the logits is ``[L,
L]``. Packed documents need no restart of the products: a pair of one document only spans that document's tokens.

The Pallas kernels take its blocked form (:func:`blocks`, :class:`PathBlocks`): blocks of ``band`` tokens, each
block's own logits dense (the chunkwise form on the block alone), and across blocks plain ``q·k`` of each query
carried back to its block's first token and each key carried forward to the same token (a copy of the keys per
block). Every product stays in XLA, differentiated there; the kernels compute a softmax over tiles that read the band
or a copy, and their backward returns the band's and the copies' gradients, which flow back through :func:`blocks`.
Memory ``[B, H, L, band]`` and ``L / band`` copies of the keys against the dense form's ``[B, H, L, L]``; exact, no
atomics. (fla's kernels instead carry each query tile through the chunk products inside the kernel, and keep queries
at superblock boundaries for the backward.)

Decoding (:meth:`Path.step`, :meth:`Path.keys_at_end`) keeps the keys of a cache transformed up to the newest token,
as the official decoding does: each new token's factor applied to every cached key (a rank-one update), the new key
appended raw.

Shapes: B batch, L length (or cache slots), Q query rows, H heads, G key/value heads, N the query heads of a group,
K head dim, C chunk, M chunks, P the length padded to whole chunks.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

CHUNK = 64  # the dense form's default chunk
BAND = 256  # the Pallas kernels' default block of dense logits (PathBlocks)


def unit_lower_inverse(n_SxCxC):
  """``(I + N)^{-1}`` of strictly lower-triangular ``N`` ``[..., C, C]`` by blocks doubling from 1 (the inverse of
  ``[[A, 0], [B, D]]`` is ``[[A^-1, 0], [-D^-1 B A^-1, D^-1]]``), in products alone: no LAPACK call (XLA:CPU's
  triangular solve can stall its thread pool under concurrent programs), ``log2 C`` levels of ``[C, C]`` products;
  ``C`` padded to a power of two with identity rows."""
  shape, c = n_SxCxC.shape, n_SxCxC.shape[-1]
  size = 1 << max(c - 1, 0).bit_length()
  n_SxZxZ = jnp.pad(n_SxCxC.reshape(-1, c, c), [(0, 0), (0, size - c), (0, size - c)])  # one batch axis
  batch = n_SxZxZ.shape[:-2]
  t_SxZxZ = jnp.broadcast_to(jnp.eye(size, dtype=n_SxZxZ.dtype), n_SxZxZ.shape)
  half = 1
  while half < size:  # the diagonal blocks of 2 * half, each from its two inverted halves
    p = size // (2 * half)
    blocks = lambda x: jnp.moveaxis(jnp.diagonal(x.reshape(*batch, p, 2 * half, p, 2 * half), axis1=-4, axis2=-2),
                                    -1, -3)  # [..., P, 2h, 2h]
    t_SxPxWxW, n_SxPxWxW = blocks(t_SxZxZ), blocks(n_SxZxZ)
    first, second = t_SxPxWxW[..., :half, :half], t_SxPxWxW[..., half:, half:]
    lower = -second @ n_SxPxWxW[..., half:, :half] @ first
    t_SxPxWxW = t_SxPxWxW.at[..., half:, :half].set(lower)
    t_SxZxZ = (t_SxPxWxW[..., :, :, None, :] * jnp.eye(p, dtype=n_SxZxZ.dtype)[:, None, :, None]).reshape(
        *batch, size, size)
    half *= 2
  return t_SxZxZ[..., :c, :c].reshape(shape)


@flax.struct.dataclass
class Path:
  """PaTH's Householder factors ``H_t = I - β_t w_t w_t^T`` of one attention call: ``w`` ``[B, Q, G, K]`` and ``β``
  ``[B, Q, G]``, per token and key/value head (float32), of the call's query rows (all ``L`` in training; a decoding
  step's new tokens, the cached keys already carrying theirs). The content logits become ``q_i^T H_i ... H_{j+1} k_j``
  (:meth:`content`); every other term adds to them as usual. ``chunk``: the dense form's chunk; ``band``: the Pallas
  kernels' blocks (:func:`blocks`: ``[B, H, L, band]`` dense logits and ``L / band`` copies of the keys against
  ``[B, H, L, L]``); both set the cost and memory, not the result."""

  w: jax.Array  # [B, Q, G, K]
  beta: jax.Array  # [B, Q, G]
  chunk: int = flax.struct.field(pytree_node=False, default=CHUNK)
  band: int = flax.struct.field(pytree_node=False, default=BAND)

  def check(self, batch: int, num_heads: int, head_dim: int, length: int) -> None:
    """Shapes, with errors that say what was given and what is allowed."""
    if (jnp.ndim(self.w) != 4 or jnp.shape(self.w)[0] != batch or not 1 <= jnp.shape(self.w)[1] <= length
        or jnp.shape(self.w)[3] != head_dim or num_heads % jnp.shape(self.w)[2]):
      raise ValueError(f"Path.w has shape {jnp.shape(self.w)}; expected ({batch}, Q, G, {head_dim}): the factors of "
                       f"Q <= {length} consecutive query rows, G the key/value heads, dividing the {num_heads} query "
                       "heads")
    if jnp.shape(self.beta) != jnp.shape(self.w)[:3]:
      raise ValueError(f"Path.beta has shape {jnp.shape(self.beta)}; expected {jnp.shape(self.w)[:3]} (one per token "
                       "and key/value head)")
    if not isinstance(self.chunk, int) or self.chunk < 1:
      raise ValueError(f"Path.chunk={self.chunk!r} must be a positive int")
    if not isinstance(self.band, int) or self.band < 1:
      raise ValueError(f"Path.band={self.band!r} must be a positive int")

  def content(self, q_BxQxHxK, k_BxLxGxK, rows_Q=None):
    """``[B, H, Q, L]`` float32: ``q_i^T H_i ... H_{j+1} k_j`` for the queries at rows ``rows_Q`` (consecutive rows,
    default all ``L``; this term's factors are theirs, every other key's factor the identity: a decoding cache's keys
    already carry theirs) and every key; a key after its query is left to the mask (its value is not the
    product)."""
    offset = 0 if rows_Q is None else rows_Q[0]
    return self._walk(q_BxQxHxK, k_BxLxGxK, offset)[0]

  def keys_at_end(self, k_BxLxGxK, offset=0):
    """``[B, L, G, K]`` float32: each key carried through the factors after it, ``H_L ... H_{j+1} k_j``, this term's
    factors those of the rows from ``offset`` on (a decoding cache's keys after a prefill at slot ``offset``)."""
    return self._walk(None, k_BxLxGxK, offset)[1]

  def step(self, k_BxGxTxK, index):
    """A cache's keys ``[B, G, T, K]`` after one new token at slot ``index`` (this term's single row): its factor
    applied to the keys of the slots before it, ``k - β (k·w) w`` (the official decoding's rank-one update), its own
    key and the later slots as they are."""
    w_BxGx1xK = jnp.swapaxes(self.w, 1, 2).astype(jnp.float32)
    beta_BxGx1 = jnp.swapaxes(self.beta, 1, 2).astype(jnp.float32)
    k_BxGxTxK = k_BxGxTxK.astype(jnp.float32)
    before_T = jnp.arange(k_BxGxTxK.shape[2]) < index
    along_BxGxT = jnp.einsum("bgtk,bgok->bgt", k_BxGxTxK, w_BxGx1xK) * beta_BxGx1
    return k_BxGxTxK - jnp.where(before_T[:, None], along_BxGxT[..., None], 0.0) * w_BxGx1xK

  def _chunking(self):
    """``(C, M, pad, chunks)``: the chunk, the rows' chunks, the rows padded to whole chunks (identity factors, zero
    queries) and ``[B, R, G, X]`` rows as ``[B, G, M, C, X]`` chunks."""
    b, rows, g, _ = self.w.shape
    c = min(self.chunk, rows)
    m = -(-rows // c)
    pad = lambda x: jnp.pad(x.astype(jnp.float32), [(0, 0), (0, m * c - rows)] + [(0, 0)] * (x.ndim - 2))
    chunks = lambda x_BxRxGxX: x_BxRxGxX.reshape(b, m, c, g, -1).transpose(0, 3, 1, 2, 4)
    return c, m, pad, chunks

  def _chunk_factors(self):
    """``(W [B, G, M, C, K], β [B, G, M, C], T [B, G, M, C, C], U [B, G, M, C, K])`` per chunk: the UT transform
    ``T = (I + diag(β) strict_lower(W W^T))^{-1}`` and ``U = T diag(β) W``, the chunk's product ``H_C ... H_1 = I -
    W^T U``."""
    c, _, pad, chunks = self._chunking()
    w_BxGxMxCxK, beta_BxGxMxC = chunks(pad(self.w)), chunks(pad(self.beta)[..., None])[..., 0]
    gram_BxGxMxCxC = jnp.einsum("bgmtk,bgmsk->bgmts", w_BxGxMxCxK, w_BxGxMxCxK)
    lower_CxC = jnp.tril(jnp.ones((c, c), bool), -1)  # t > j
    t_BxGxMxCxC = unit_lower_inverse(jnp.where(lower_CxC, beta_BxGxMxC[..., None] * gram_BxGxMxCxC, 0.0))
    u_BxGxMxCxK = jnp.einsum("bgmts,bgmsk->bgmtk", t_BxGxMxCxC, beta_BxGxMxC[..., None] * w_BxGxMxCxK)
    return w_BxGxMxCxK, beta_BxGxMxC, t_BxGxMxCxC, u_BxGxMxCxK

  def product(self):
    """``[B, G, K, K]``: the whole product of this term's factors, ``H_Q ... H_1`` (a column vector's operator),
    chunk by chunk."""
    w_BxGxMxCxK, _, _, u_BxGxMxCxK = self._chunk_factors()
    k = w_BxGxMxCxK.shape[-1]
    step = lambda p_BxGxKxK, wu: (p_BxGxKxK - jnp.einsum("bgck,bgcx->bgkx", wu[0], jnp.einsum(
        "bgcx,bgxy->bgcy", wu[1], p_BxGxKxK)), None)
    eye_BxGxKxK = jnp.broadcast_to(jnp.eye(k, dtype=jnp.float32), (*w_BxGxMxCxK.shape[:2], k, k))
    return jax.lax.scan(step, eye_BxGxKxK, (jnp.moveaxis(w_BxGxMxCxK, 2, 0), jnp.moveaxis(u_BxGxMxCxK, 2, 0)))[0]

  def _walk(self, q_BxQxHxK, k_BxLxGxK, offset=0):
    """``([B, H, Q, L] logits, or None without queries; [B, L, G, K] keys carried to the end)``, the factors (this
    term's ``Q`` rows) and the queries at rows ``offset ..`` (traced) of the ``L`` keys: the rows' chunks' products
    in closed form, then a scan over the rows' chunks carrying every earlier key to the chunk's start (``[B, G, L,
    K]``: the scan's whole state, so its backward keeps one per chunk, and the logits come out row block by row
    block, ``[B, H, C, L]`` each)."""
    b, length, g, k = k_BxLxGxK.shape
    rows = self.w.shape[1]
    c, m, pad, chunks = self._chunking()
    all_BxPxGxK = pad(k_BxLxGxK)
    offset = jnp.asarray(offset, jnp.int32)
    # [B, G, M, C, K] the rows' keys and w, [B, G, M, C] β, [B, G, N, M, C, K] queries
    k_BxGxMxCxK = chunks(jax.lax.dynamic_slice_in_dim(all_BxPxGxK, offset, m * c, axis=1))
    w_BxGxMxCxK, beta_BxGxMxC, t_BxGxMxCxC, u_BxGxMxCxK = self._chunk_factors()
    solve = lambda rhs: jnp.einsum("bgmts,bgmsx->bgmtx", t_BxGxMxCxC, rhs)
    lower_CxC = jnp.tril(jnp.ones((c, c), bool), -1)  # t > j
    lower_incl_CxC = jnp.tril(jnp.ones((c, c), bool))  # t <= i
    wk_BxGxMxCxC = jnp.einsum("bgmtk,bgmjk->bgmtj", w_BxGxMxCxK, k_BxGxMxCxK)
    x_BxGxMxCxC = solve(jnp.where(lower_CxC, beta_BxGxMxC[..., None] * wk_BxGxMxCxC, 0.0))  # key j's coefficients
    ends_BxGxMxCxK = k_BxGxMxCxK - jnp.einsum("bgmtj,bgmtk->bgmjk", x_BxGxMxCxC, w_BxGxMxCxK)  # to the chunk's end
    # every key: the rows' at their own chunk's end, the others as given
    keys_BxGxPxK = jax.lax.dynamic_update_slice_in_dim(all_BxPxGxK.transpose(0, 2, 1, 3),
                                                       ends_BxGxMxCxK.reshape(b, g, m * c, k), offset, axis=2)
    slot_P = jnp.arange(keys_BxGxPxK.shape[2])

    def through(keys_BxGxPxK, a):
      """The keys before chunk ``a`` carried through it: ``y - (y U_a^T) W_a``."""
      u_BxGxCxK, w_BxGxCxK = u_BxGxMxCxK[:, :, a], w_BxGxMxCxK[:, :, a]
      moved_BxGxPxK = keys_BxGxPxK - jnp.einsum("bgpt,bgtk->bgpk", jnp.einsum("bgpk,bgtk->bgpt", keys_BxGxPxK,
                                                                             u_BxGxCxK), w_BxGxCxK)
      return jnp.where((slot_P < offset + a * c)[:, None], moved_BxGxPxK, keys_BxGxPxK)

    if q_BxQxHxK is None:
      keys_BxGxPxK = jax.lax.fori_loop(0, m, lambda a, y: through(y, a), keys_BxGxPxK)
      return None, keys_BxGxPxK.transpose(0, 2, 1, 3)[:, :length]

    heads = q_BxQxHxK.shape[2]
    n = heads // g  # the query heads of a key head's group
    q_BxGxNxMxCxK = pad(q_BxQxHxK).reshape(b, m, c, g, n, k).transpose(0, 3, 4, 1, 2, 5)
    qw_BxGxNxMxCxC = jnp.where(lower_incl_CxC, jnp.einsum("bgnmik,bgmtk->bgnmit", q_BxGxNxMxCxK, w_BxGxMxCxK), 0.0)
    qk_BxGxNxMxCxC = jnp.einsum("bgnmik,bgmjk->bgnmij", q_BxGxNxMxCxK, k_BxGxMxCxK)
    local_BxGxNxMxCxC = qk_BxGxNxMxCxC - jnp.einsum("bgnmit,bgmtj->bgnmij", qw_BxGxNxMxCxC, x_BxGxMxCxC)
    # each query carried back to its chunk's start: q_i^T H_i ... H_1 of the chunk
    start_BxGxNxMxCxK = q_BxGxNxMxCxK - jnp.einsum("bgnmit,bgmtk->bgnmik", qw_BxGxNxMxCxC, u_BxGxMxCxK)

    def query_chunk(keys_BxGxPxK, a):
      """Chunk ``a``'s rows: its queries (at the chunk's start) against the earlier keys (at the end of the chunk
      before), its own block in closed form; then those keys through chunk ``a``."""
      s_BxGxNxCxP = jnp.einsum("bgnik,bgpk->bgnip", start_BxGxNxMxCxK[:, :, :, a], keys_BxGxPxK)
      s_BxGxNxCxP = jax.lax.dynamic_update_slice_in_dim(s_BxGxNxCxP, local_BxGxNxMxCxC[:, :, :, a], offset + a * c,
                                                        axis=4)
      return through(keys_BxGxPxK, a), s_BxGxNxCxP

    keys_BxGxPxK, rows_MxBxGxNxCxP = jax.lax.scan(query_chunk, keys_BxGxPxK, jnp.arange(m))
    s_BxHxRxP = rows_MxBxGxNxCxP.transpose(1, 2, 3, 0, 4, 5).reshape(b, heads, m * c, -1)
    return s_BxHxRxP[:, :, :rows, :length], keys_BxGxPxK.transpose(0, 2, 1, 3)[:, :length]


@flax.struct.dataclass
class PathBlocks:
  """The Pallas kernels' form of :class:`Path` (:func:`blocks`): the sequence cut into blocks of ``size`` tokens. A
  pair in one block reads its content logit from ``band`` ``[B, H, P, S]`` (row ``i``, column ``j`` less the block's
  first token); a pair across blocks is ``q_b,i · copies[I]_j``, the query carried to its block's start and the key
  to the same token (``copies`` ``[B, G, N P, K]``: block ``I``'s keys at rows ``I P ..``, every key carried to
  block ``I``'s first token, zero at and after it). So the kernels see plain ``q·k`` tiles off the band, and the
  products' gradients flow back through :func:`blocks` in XLA. The copies come to the kernels as their keys."""

  band: jax.Array  # [B, H, P, S] float32, unscaled
  size: int = flax.struct.field(pytree_node=False, default=BAND)


def blocks(path: Path, q_BxPxHxK, k_BxPxGxK, size: int):
  """``(q_b [B, P, H, K], copies [B, G, N P, K], PathBlocks)`` of PaTH's content logits for blocks of ``size``
  tokens (``P`` a multiple of it, the factors ``path``'s ``P`` rows), in float32:

  - the band: each block's own logits, :meth:`Path.content` of the block alone;
  - ``q_b``: each query carried to its block's first token ``s``, ``H_s ... H_i q_i`` (the factors are symmetric,
    so ``q_i^T H_i ... H_s = q_b^T``): :meth:`Path.keys_at_end` on the block reversed, its factors one slot later;
  - the copies: a scan over the blocks carrying every key to each block's first token, through each block's whole
    product (:meth:`Path.product`, ``K x K``), the block's own keys entering at its end.

  Memory: the band ``P S`` a head, the copies ``N`` keys' worth (``N = P / size``), against ``P^2`` dense."""
  b, length, h, k = q_BxPxHxK.shape
  g = k_BxPxGxK.shape[2]
  n = length // size
  fold = lambda x_BxPxX: x_BxPxX.reshape(b * n, size, *x_BxPxX.shape[2:])
  inner = Path(fold(path.w), fold(path.beta), path.chunk)
  band_BnxHxSxS = inner.content(fold(q_BxPxHxK), fold(k_BxPxGxK))
  band_BxHxPxS = band_BnxHxSxS.reshape(b, n, h, size, size).transpose(0, 2, 1, 3, 4).reshape(b, h, length, size)
  # the queries: the block reversed (slot p holds query size - 1 - p), factor size - p at slot p (identity at 0)
  group = h // g
  reverse = lambda x_BnxSxX: jnp.flip(x_BnxSxX, axis=1)
  later = lambda x_BnxSxX: jnp.pad(reverse(x_BnxSxX), [(0, 0), (1, 0)] + [(0, 0)] * (x_BnxSxX.ndim - 2))
  per_query_head = lambda x_BnxSxX: jnp.repeat(x_BnxSxX, group, axis=0)  # [B n N, ...]: a group's heads as rows
  q_BnNxSxGxK = fold(q_BxPxHxK).reshape(b * n, size, g, group, k).transpose(0, 3, 1, 2, 4).reshape(
      b * n * group, size, g, k)
  keys_BnNxSxGxK = jnp.pad(reverse(q_BnNxSxGxK), [(0, 0), (0, 1), (0, 0), (0, 0)])
  carried = Path(per_query_head(later(inner.w)), per_query_head(later(inner.beta)), path.chunk).keys_at_end(
      keys_BnNxSxGxK)[:, :size]
  q_b_BxPxHxK = reverse(carried).reshape(b * n, group, size, g, k).transpose(0, 2, 3, 1, 4).reshape(b, length, h, k)
  # the copies
  ends_BxNxSxGxK = inner.keys_at_end(fold(k_BxPxGxK)).reshape(b, n, size, g, k)
  products_NxBxGxKxK = jnp.moveaxis(inner.product().reshape(b, n, g, k, k), 1, 0)
  slot_P = jnp.arange(length)

  def step(keys_BxGxPxK, a):
    """Block ``a``'s copy (the keys before it, at its first token), then the keys through it and its own keys."""
    copy_BxGxPxK = jnp.where((slot_P < a * size)[:, None], keys_BxGxPxK, 0.0)
    moved_BxGxPxK = jnp.einsum("bgpk,bgxk->bgpx", keys_BxGxPxK, products_NxBxGxKxK[a])
    own_BxGxSxK = jnp.moveaxis(ends_BxNxSxGxK[:, a], 1, 2)
    return jax.lax.dynamic_update_slice_in_dim(moved_BxGxPxK, own_BxGxSxK, a * size, axis=2), copy_BxGxPxK

  keys_BxGxPxK = jnp.zeros((b, g, length, k), jnp.float32)
  _, copies_NxBxGxPxK = jax.lax.scan(step, keys_BxGxPxK, jnp.arange(n))
  copies_BxGxNPxK = jnp.moveaxis(copies_NxBxGxPxK, 0, 2).reshape(b, g, n * length, k)
  return q_b_BxPxHxK, copies_BxGxNPxK, PathBlocks(band_BxHxPxS, size)
