"""The Forgetting Transformer's forget gate (Lin, Nikishin, He, Courville; ICLR 2025) as an open term
(:mod:`posjax.kernels.term`): its cumulative log gates are per-token rows."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from posjax.kernels.term import ROWS, Term


def forget_sums(log_f_BxHxL, positions_BxL):
  """``[B, H, L]`` float32 ``c_i = Σ log f_t`` over the tokens ``t <= i`` of ``i``'s run of positions (a run starts
  at each position 0: a packed document's state restarts at its first token), so ``c_i - c_j`` is the sum over
  ``j < t <= i`` for any pair of one document, and the sums stay as short as the documents."""
  log_f_BxHxL = log_f_BxHxL.astype(jnp.float32)
  sums_BxHxL = jnp.cumsum(log_f_BxHxL, axis=-1)
  index_L = jnp.arange(log_f_BxHxL.shape[-1], dtype=jnp.int32)
  starts_BxL = jax.lax.cummax(jnp.where(jnp.asarray(positions_BxL) == 0, index_L, 0), axis=1)
  before_BxHxL = jnp.take_along_axis(sums_BxHxL - log_f_BxHxL,
                                     jnp.broadcast_to(starts_BxL[:, None, :], sums_BxHxL.shape), axis=-1)
  return sums_BxHxL - before_BxHxL


@flax.struct.dataclass
class Forget(Term):
  """The Forgetting Transformer's forget gate (Lin, Nikishin, He, Courville; ICLR 2025): ``c_i - c_j`` added to the
  logits for a key ``j`` at or before the query ``i`` (in index order), ``c`` the cumulative log forget gates of each
  query head (:func:`forget_sums`), so a key's weight decays by the product of the gates after it: ``exp(c_i - c_j)
  = Π_{j<t<=i} f_t``, the paper's (causal) form. [unconfirmed] Past the causal mask (an encoder), ``c_j - c_i``: the
  gates between the two tokens either way. (Not ``-|c_i - c_j|``: equal where ``c`` does not increase, but its
  gradient at a tie, where a gate rounds to 1, would be the wrong one.) One ``c`` serves the queries and the keys
  (the queries' rows of it); a decoding cache holds the keys' ``c`` beside their k and v."""

  c: jax.Array  # [B, H, L] float32
  KINDS = {"c": ROWS}

  def bias(self, rows_Q=None):
    """``[B, H, Q, L]`` float32 at query rows ``rows_Q`` (default all): ``c_i - c_j``, or ``c_j - c_i`` for a key
    after the query."""
    c_BxHxL = self.c.astype(jnp.float32)
    length = c_BxHxL.shape[-1]
    rows_Q = jnp.arange(length) if rows_Q is None else rows_Q
    difference_BxHxQxL = jnp.take(c_BxHxL, rows_Q, axis=2)[..., :, None] - c_BxHxL[..., None, :]
    return jnp.where(jnp.arange(length)[None, :] > rows_Q[:, None], -difference_BxHxQxL, difference_BxHxQxL)

  def check(self, batch: int, num_heads: int, head_dim: int, length: int) -> None:
    """Shapes and options, with errors that say what was given and what is allowed."""
    del head_dim
    if jnp.ndim(self.c) != 3 or jnp.shape(self.c)[1:] != (num_heads, length) or jnp.shape(self.c)[0] not in (1, batch):
      raise ValueError(f"Forget.c has shape {jnp.shape(self.c)}; expected ({batch} or 1, {num_heads}, {length}) "
                       "(one cumulative log gate per query head and token)")

  def decode_state(self, slots: int):
    """The cache's ``c`` of every slot, ``[B, H, slots]`` float32."""
    return (*jnp.shape(self.c)[:2], slots), jnp.float32

  def continued(self, cache_BxHxT, positions_BxQ, index):
    """The new tokens' ``c`` (summed over the new tokens alone) continued from the previous slot's, unless a token's
    run restarted (a position 0) among them, written into the cache at ``index``: the term over every slot."""
    c_BxHxQ = self.c.astype(jnp.float32)
    b, _, q = c_BxHxQ.shape
    previous_BxH = jnp.where(index > 0, jax.lax.dynamic_index_in_dim(cache_BxHxT, jnp.maximum(index - 1, 0), axis=2,
                                                                     keepdims=False), 0.0)
    restarted_BxQ = jax.lax.cummax((jnp.broadcast_to(positions_BxQ, (b, q)) == 0).astype(jnp.int32), axis=1) > 0
    c_BxHxQ = c_BxHxQ + jnp.where(restarted_BxQ[:, None, :], 0.0, previous_BxH[:, :, None])
    cache_BxHxT = jax.lax.dynamic_update_slice_in_dim(cache_BxHxT, c_BxHxQ, index, axis=2)
    return Forget(cache_BxHxT), cache_BxHxT

  def logits(self, tile, s):
    """``c_i - c_j`` for a key at or before the query (index order), ``c_j - c_i`` after it; in decoding the
    queries' ``c`` at their cache slots."""
    difference = tile.rows_q("c") - tile.rows_k("c")
    return s + jnp.where(tile.k_index > tile.q_index, -difference, difference)
