"""The tiles the kernels skip: :func:`posjax.kernels.tile.tile_ranges` against a brute-force list of the tile pairs
that hold an allowed pair (causal, sliding window, packed documents, masked rows), and the kernels that skip them
against the float64 reference on rows where most tiles are skipped."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posjax import kernels
from posjax.kernels import tile
from test_kernels import assert_matches_reference, compiled_grad


def allowed_pairs(segments, valid, causal, window):
  """``[B, L, L]``: the pairs attention may use (numpy, pair by pair)."""
  b, n = segments.shape
  i, j = np.arange(n)[:, None], np.arange(n)[None, :]
  allowed = (segments[:, :, None] == segments[:, None, :]) & valid[:, None, :].astype(bool)
  if causal:
    allowed &= j <= i
  if window:
    allowed &= np.abs(i - j) < window
  return allowed


def plan(causal, window, bq, bk, length):
  return tile.Plan(scale=1.0, causal=causal, block_q=bq, block_k=bk, length=length, interpret=True,
                   treedef=jax.tree_util.tree_structure(kernels.Terms()), sliding_window=window)


@pytest.mark.parametrize("causal,window,bq,bk", [(True, 0, 8, 8), (True, 11, 8, 16), (False, 0, 16, 8),
                                                 (True, 5, 16, 16), (False, 11, 16, 8)])
def test_tile_ranges_hold_every_allowed_pair_and_skip_the_rest(causal, window, bq, bk):
  rng = np.random.default_rng(3)
  batch, length = 4, 64
  segments = np.stack([np.sort(rng.integers(1, 5, length)) for _ in range(batch)])  # contiguous documents
  segments[3] = rng.integers(1, 4, length)  # ids that are not contiguous runs
  valid = np.ones((batch, length), np.int32)
  valid[1, 50:] = 0  # right padding: masked query rows average every key
  keys, queries = (np.asarray(x) for x in tile.tile_ranges(plan(causal, window, bq, bk, length),
                                                             jnp.asarray(segments), jnp.asarray(valid)))
  allowed = allowed_pairs(segments, valid, causal, window)
  tiles = allowed.reshape(batch, length // bq, bq, length // bk, bk).any(axis=(2, 4))  # [B, query tile, key tile]
  masked = (valid == 0).reshape(batch, length // bq, bq).any(axis=2)
  for row in range(batch):
    for t in range(length // bq):
      lo, hi = keys[row, t]
      needed = np.flatnonzero(tiles[row, t])
      if masked[row, t]:
        assert (lo, hi) == (0, length // bk)
      elif row != 3:  # contiguous documents: exactly the tiles between the first and the last needed one
        assert (lo, hi) == (needed.min(), needed.max() + 1), (row, t)
      else:
        assert lo <= needed.min() and needed.max() < hi
    for t in range(length // bk):
      lo, hi = queries[row, t]
      needed = set(np.flatnonzero(tiles[row, :, t])) | set(np.flatnonzero(masked[row]))
      assert lo <= min(needed) and max(needed) < hi, (row, t)
      if row in (0, 2):
        assert (lo, hi) == (min(needed), max(needed) + 1)
  if causal:  # a causal row skips about half its tiles; in a window shorter than a tile, at most two a row remain
    visited = np.sum(keys[0, :, 1] - keys[0, :, 0]) / (length // bq * length // bk)
    assert visited <= (2 / (length // bk) if window else 0.65)


def test_a_context_shard_visits_the_tiles_its_own_queries_need():
  """:func:`posjax.kernels.tile.query_share`: each of 4 shards' query tiles keep their key tiles, and each key tile
  visits only the shard's query tiles that hold an allowed pair with it (none: an empty range, so a causal row's
  key tiles past the shard cost nothing), on packed rows with a padded tail."""
  rng = np.random.default_rng(4)
  batch, length, bq, bk, shards = 2, 64, 8, 8, 4
  segments = np.stack([np.sort(rng.integers(1, 4, length)) for _ in range(batch)])
  valid = np.ones((batch, length), np.int32)
  valid[1, 55:] = 0
  full = tile.tile_ranges(plan(True, 0, bq, bk, length), jnp.asarray(segments), jnp.asarray(valid))
  allowed = allowed_pairs(segments, valid, True, 0)
  tiles = allowed.reshape(batch, length // bq, bq, length // bk, bk).any(axis=(2, 4))
  rows = length // shards
  for shard in range(shards):
    keys, queries = (np.asarray(x) for x in tile.query_share(full, jnp.int32(shard * rows), rows, bq))
    mine = slice(shard * rows // bq, (shard + 1) * rows // bq)
    np.testing.assert_array_equal(keys, np.asarray(full[0])[:, mine])
    for row in range(batch):
      for t in range(length // bk):
        lo, hi = queries[row, t]
        needed = np.flatnonzero(tiles[row, mine, t])
        if row == 0:  # no masked query: exactly the share's tiles that need key tile t
          assert (lo, hi) == ((needed.min(), needed.max() + 1) if needed.size else (lo, lo)), (shard, t)
        assert 0 <= lo <= hi <= rows // bq and all(lo <= n < hi for n in needed)
        if t * bk >= (shard + 1) * rows:  # causal: a key past the share is read by none of its queries
          assert lo == hi


def test_lengths_pad_to_the_tile_not_a_power_of_two():
  assert tile.block_sizes(1100, 128, 64) == (128, 64, 1152)
  assert tile.block_sizes(21, 8, 8) == (8, 8, 24)
  assert tile.block_sizes(5, 64, 64) == (8, 8, 8)


@pytest.mark.parametrize("interpreter,causal", [(True, False), ("tpu", True)])
def test_kernels_that_skip_tiles_match_the_reference(interpreter, causal):
  """Causal or not, a sliding window of 9 (on both sides without causal: ModernBERT's local layers) and packed
  documents over 5 key tiles a row (most pairs of tiles skipped) in a row whose tail is padding, a fully masked row
  and a length that is not a multiple of the tile, with ALiBi and T5 buckets: outputs and gradients against the
  float64 reference."""
  rng = np.random.default_rng(5)
  batch, length, heads, head_dim = 2, 37, 1, 8  # one head: the interpreters' cost is per grid point
  f32 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  segments = np.array([[1] * 20 + [2] * 17, [1] * 37])
  positions = np.stack([np.concatenate([np.arange(20), np.arange(17)]), np.arange(37)])
  lengths = np.array([30, 0])  # the second document's last 7 tokens padding; the last row fully masked: each of its
  # rows averages every key
  terms = kernels.Terms(alibi=kernels.Alibi(jnp.asarray(rng.uniform(0.1, 1.0, heads), jnp.float32)),
                        buckets=kernels.Buckets(f32(32, heads), num_buckets=32, max_distance=20, bidirectional=False))
  q, k, v, weights = (f32(batch, length, heads, head_dim) for _ in range(4))

  def loss(implementation, q, k, v, terms):
    out = kernels.relative_attention(q, k, v, terms=terms, positions=positions, segment_ids=segments,
                                     lengths=lengths, causal=causal, sliding_window=9, implementation=implementation,
                                     block_sizes=(8, 8), interpret=interpreter)
    return jnp.sum(out * weights), out

  grads, out = compiled_grad(loss, "pallas")(q, k, v, terms)
  assert_matches_reference(out, grads, q, k, v, terms, weights, positions=positions, segments=segments,
                           lengths=lengths, causal=causal, directions=1, sliding_window=9)
