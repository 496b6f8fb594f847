"""The decode kernels (:func:`posjax.kernels.decode_attention`): the newest queries of a sequence, read from a cache
longer than what is written, with left padding, grouped k/v and the position terms the kernels build per tile, equal
the float64 reference's rows of the whole sequence; errors for what they cannot compute."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference
from posjax import kernels
from test_kernels import learned_terms


@pytest.mark.parametrize("interpreter,blocks,queries,window,chunk,slots", [
    (True, (16, 16), 1, 0, 0, 165),  # a decode step: one query, every key tile split among programs
    (True, (16, 16), 19, 9, 48, 165),  # a prefill of two query tiles in a window and chunks: the tiles before skipped
    ("tpu", (8, 128), 11, 9, 48, 165),
    ("xla", None, 3, 9, 48, 165),  # the dense formulas (implementation="xla") over the whole cache (FoX's rows)
    ("xla", None, 1, 0, 0, 1000),  # without FoX: over the filled cache's 256-slot prefix, not its 1,000 slots
])
def test_the_decode_kernels_equal_the_reference_rows_of_the_whole_sequence(interpreter, blocks, queries, window,
                                                                           chunk, slots):
  rng = np.random.default_rng(7)
  batch, heads, kv_heads, head_dim, written = 2, 4, 2, 8, 150
  f32 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  positions = np.stack([np.arange(written), np.maximum(np.arange(written) - 4, 0)])  # row 1: 4 slots of padding
  valid = np.stack([np.ones(written, bool), np.arange(written) >= 4])
  learned = learned_terms(rng, heads, "log")
  c = np.cumsum(np.log(rng.uniform(0.5, 1.0, (batch, heads, written))), axis=-1)  # the Forgetting Transformer's
  terms = learned.replace(alibi=kernels.Alibi(jnp.asarray(rng.uniform(0.1, 0.5, heads), jnp.float32)),
                          buckets=kernels.Buckets(f32(32, heads), num_buckets=32, max_distance=40, bidirectional=False),
                          forget=kernels.Forget(jnp.asarray(np.pad(c, ((0, 0), (0, 0), (0, slots - written))),
                                                            jnp.float32)) if slots < 1000 else None)
  q, k, v = f32(batch, written, heads, head_dim), f32(batch, written, kv_heads, head_dim), f32(batch, written,
                                                                                              kv_heads, head_dim)
  fused = reference.FusedAttention(positions, np.zeros_like(positions), valid, causal=True, sliding_window=window,
                                   chunk=chunk,
                                   buckets=dict(kind="buckets", num_buckets=32, max_distance=40, bidirectional=False,
                                                cls_row=None, cls_col=None))
  fire, kerple, sw = terms.fire, terms.kerple, terms.sandwich
  expected = fused(q, k, v, scale=head_dim ** -0.5, alibi=np.asarray(terms.alibi.slopes),
                   bucket_table=np.asarray(terms.buckets.table), kerple_r1=np.asarray(kerple.r1),
                   kerple_r2=np.asarray(kerple.r2), kerple_kind="log", fire_w1=np.asarray(fire.w1),
                   fire_b1=np.asarray(fire.b1), fire_w2=np.asarray(fire.w2), fire_b2=np.asarray(fire.b2),
                   fire_c=float(fire.c), fire_threshold=float(fire.threshold), fire_eps=fire.eps,
                   forget_c=c if slots < 1000 else None, sandwich=dict(ratios=np.asarray(sw.ratios), dim=sw.dim, base=sw.base, scale=sw.scale,
                                             divide=sw.divide, first=sw.first))[:, -queries:]
  # the cache: heads first, slots past the written ones zero and invalid
  cache = lambda x: jnp.pad(jnp.swapaxes(x, 1, 2), ((0, 0), (0, 0), (0, slots - written), (0, 0)))
  out = kernels.decode_attention(
      q[:, -queries:], cache(k), cache(v), start=written - queries,
      key_positions=np.pad(positions, ((0, 0), (0, slots - written))),
      key_valid=np.pad(valid, ((0, 0), (0, slots - written))), terms=terms, sliding_window=window, chunk=chunk,
      **(dict(implementation="xla") if interpreter == "xla" else dict(interpret=interpreter, block_sizes=blocks)))
  np.testing.assert_allclose(out, expected, rtol=2e-5, atol=2e-5)
  if slots == 1000:  # one program per prefix (128 ... 1,000 slots), chosen by the filled length
    assert kernels.decode.filled_sizes(slots) == (128, 256, 512, 1000)
    assert str(jax.make_jaxpr(lambda q: kernels.decode_attention(
        q, cache(k), cache(v), start=written - queries, key_positions=np.pad(positions, ((0, 0), (0, slots - written))),
        key_valid=np.pad(valid, ((0, 0), (0, slots - written))), terms=terms, implementation="xla"))(
            q[:, -queries:])).count("cond[") == 1


def test_what_the_decode_kernels_cannot_compute_is_an_error():
  q, cache = jnp.zeros((1, 1, 2, 8)), jnp.zeros((1, 2, 16, 8))
  rows = dict(start=3, key_positions=np.zeros((1, 16), np.int32), key_valid=np.ones((1, 16), bool))
  shaw = kernels.Terms(relative=kernels.Relative(jnp.ones((5, 8)), 2, query=True))
  with pytest.raises(ValueError, match=r"implementation='pallas'\): the decode kernels do not build the relative "
                                       r"term; use implementation='xla'"):
    kernels.decode_attention(q, cache, cache, terms=shaw, **rows)
  with pytest.raises(ValueError, match=r"cache k \[B, G, T, K\], v \[B, G, T, V\] \(heads first\)"):
    kernels.decode_attention(q, cache[0], cache, **rows)
  with pytest.raises(ValueError, match=r"the query tile 12 must be a power of two on GPU"):
    kernels.decode_attention(q, cache, cache, block_sizes=(12, 16), **rows)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_the_decode_kernels_lower_for_gpu_and_tpu(platform, monkeypatch):
  # Lowering from this CPU (Triton for CUDA, Mosaic for TPU): each backend's constraints on the kernel's arrays and
  # ops are checked without the device; one kernel call, the cache read in place (a multiple of the key tile).
  if platform == "tpu":
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  rng = np.random.default_rng(0)
  terms = learned_terms(rng, 4, "power").replace(
      sandwich=None, alibi=kernels.Alibi(jnp.ones(4)),
      buckets=kernels.Buckets(jnp.ones((32, 4)), num_buckets=32, max_distance=128, bidirectional=False),
      forget=kernels.Forget(jnp.zeros((2, 4, 1024))))
  q, cache = jnp.ones((2, 1, 4, 64), jnp.bfloat16), jnp.ones((2, 2, 1024, 64), jnp.bfloat16)
  step = lambda q, k, v, positions, valid, start: kernels.decode_attention(
      q, k, v, start=start, key_positions=positions, key_valid=valid, terms=terms, sliding_window=512, interpret=False)
  lowered = jax.jit(step).trace(q, cache, cache, jnp.zeros((2, 1024), jnp.int32), jnp.ones((2, 1024), bool),
                                jnp.int32(700)).lower(lowering_platforms=(platform,))
  text = lowered.as_text()
  assert text.count("xla.gpu.triton" if platform == "cuda" else "tpu_custom_call") == 1
  assert not [line for line in text.splitlines() if "pad" in line and "1024x64" in line]  # the cache not copied
