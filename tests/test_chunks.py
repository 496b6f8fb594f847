"""Chunked attention (Llama 4's ``attention_chunk_size``: a query attends to its aligned block of C tokens only): the
mask's chunks as segments give, on ``xla`` and both Pallas interpreters, what a float64 loop computes over packed,
padded, windowed GQA rows (outputs; every gradient of the kernels against the dense path's); the Pallas kernels skip
the other chunks' tiles; a decoder mixing chunked, windowed and global layers with a temperature and sinks generates
what its full forward computes; bad chunks are one-line errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posjax import attention, generate, kernels
from posjax.kernels import tile
from posjax.models import Transformer, TransformerConfig
from conftest import randomize

B, L, H, G, K, CHUNK, WINDOW = 2, 21, 4, 2, 8, 8, 6
SEGMENTS = np.array([[0] * 12 + [1] * 9, [0] * 21])
LENGTHS = np.array([21, 15])


def loop(q, k, v, weights):
  """``Σ out · weights`` over real query rows, float64: keys of the query's segment and chunk, causal, in the
  window."""
  total = 0.0
  for b in range(B):
    for i in range(LENGTHS[b]):
      for h in range(H):
        g = h // (H // G)
        keys = [j for j in range(LENGTHS[b]) if SEGMENTS[b, j] == SEGMENTS[b, i] and j <= i and i - j < WINDOW
                and i // CHUNK == j // CHUNK]
        logits = np.array([q[b, i, h] @ k[b, j, g] / np.sqrt(K) for j in keys])
        w = np.exp(logits - logits.max())
        w = w / w.sum()
        total += float(np.sum(sum(w_j * v[b, j, g] for w_j, j in zip(w, keys)) * weights[b, i, h]))
  return total


def test_the_mask_of_a_chunk_is_its_aligned_block():
  mask = attention.Mask(segment_ids=jnp.asarray(SEGMENTS), causal=True, chunk=CHUNK)
  pairs = np.asarray(mask.pairs(L))[:, 0]
  chunked = np.asarray(mask.chunked(B, L).pairs(L))[:, 0]
  i, j = np.arange(L)[:, None], np.arange(L)[None, :]
  want = (SEGMENTS[:, :, None] == SEGMENTS[:, None, :]) & (j <= i) & (i // CHUNK == j // CHUNK)
  np.testing.assert_array_equal(pairs, want)
  np.testing.assert_array_equal(chunked, want)  # as segments: what the kernels read


@pytest.mark.parametrize("implementation,interpret", [("xla", None), ("pallas", True), ("pallas", "tpu")])
def test_a_chunked_layer_matches_a_float64_loop(implementation, interpret):
  rng = np.random.default_rng(0)
  q, k, v = rng.normal(size=(B, L, H, K)), rng.normal(size=(B, L, G, K)), rng.normal(size=(B, L, G, K))
  weights = rng.normal(size=(B, L, H, K))
  real = (np.arange(L)[None] < LENGTHS[:, None])[..., None, None]
  segments = attention.Mask(segment_ids=jnp.asarray(SEGMENTS), causal=True, chunk=CHUNK).chunked(B, L).segment_ids
  positions = np.array([list(range(12)) + list(range(9)), list(range(21))])

  def loss(implementation, q, k, v):
    out = kernels.relative_attention(q, k, v, positions=positions, segment_ids=segments, lengths=LENGTHS,
                                     causal=True, sliding_window=WINDOW, implementation=implementation,
                                     block_sizes=(8, 8), interpret=interpret)
    return jnp.sum(jnp.where(real, out * weights, 0.0))

  f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v)]
  value, grads = jax.jit(jax.value_and_grad(lambda *a: loss(implementation, *a), argnums=(0, 1, 2)))(*f32)
  want = loop(q, k, v, weights)
  assert abs(float(value) - want) <= 1e-5 * abs(want) + 1e-4
  if implementation == "pallas":
    dense = jax.jit(jax.grad(lambda *a: loss("xla", *a), argnums=(0, 1, 2)))(*f32)
    for g, d in zip(grads, dense):
      np.testing.assert_allclose(g, d, atol=2e-5 * float(np.abs(d).max()), rtol=0)


def test_the_kernels_skip_the_other_chunks_tiles():
  length, chunk, block = 64, 16, 8
  mask = attention.Mask(causal=True, chunk=chunk).chunked(1, length)
  plan = tile.Plan(scale=1.0, causal=True, block_q=block, block_k=block, length=length, interpret=True,
                   treedef=jax.tree_util.tree_structure(kernels.Terms()))
  keys, _ = (np.asarray(x) for x in tile.tile_ranges(plan, mask.segment_ids, jnp.ones((1, length), jnp.int32)))
  visited = int(np.sum(keys[0, :, 1] - keys[0, :, 0]))
  assert visited == (length // chunk) * 3  # each chunk's two query tiles: 1 + 2 key tiles, none of another chunk


@pytest.mark.parametrize("kernel", ["xla", "pallas"])  # the dense decoding path, then the decode kernels
def test_a_decoder_mixing_chunked_windowed_and_global_layers_generates_its_full_forward(kernel):
  config = TransformerConfig.llama(attention_kernel=kernel, vocab_size=61, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
                                   intermediate_size=48, max_len=64, position_schedule="rope,rope,none",
                                   layer_chunks="4,0,0", layer_windows="0,5,0", attention_sinks=True,
                                   query_temperature={"kind": "llama4", "floor_scale": 3.0, "attn_scale": 0.7},
                                   temperature_layers="0,0,1")
  module = Transformer(config, head="lm")
  params = randomize(module.init(jax.random.key(1), jnp.zeros((1, 8), jnp.int32))["params"], scale=0.4)
  prompt = np.random.default_rng(0).integers(0, 61, (2, 5))
  tokens, cached = (np.asarray(t) for t in generate.generate(module, {"params": params}, prompt, max_new_tokens=9,
                                                              return_logits=True))
  dense = Transformer(TransformerConfig.llama(**{**config.to_dict(), "attention_kernel": "xla"}), head="lm")
  full = np.asarray(jax.jit(dense.apply)({"params": params}, jnp.asarray(tokens)).logits)
  np.testing.assert_array_equal(tokens[:, 5:], np.argmax(full[:, 4:-1], axis=-1))
  np.testing.assert_allclose(cached, full[:, 4:-1], atol=2e-5 * np.abs(full).max(), rtol=0)


@pytest.mark.parametrize("fields,message", [
    (dict(layer_chunks="4,x"), r"layer_chunks='4,x': expected ','-separated ints >= 0"),
    (dict(layer_chunks="4,-1"), r"each chunk must be >= 0"),
])
def test_bad_chunks_are_one_line_errors(fields, message):
  with pytest.raises(ValueError, match=message):
    TransformerConfig.llama(vocab_size=61, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=48,
                            max_len=64, **fields)
