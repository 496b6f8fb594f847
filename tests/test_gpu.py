"""The cuDNN and the compiled Pallas kernels, where a GPU is present (skipped elsewhere): they must agree with the
XLA path."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posjax import positions
from posjax.models import TransformerConfig, TransformerStack
from conftest import one_axis

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")]

FUSABLE = [n for n in one_axis(positions.encoder_names())
           if positions.make(n, num_heads=4, hidden_size=256, max_len=128).refusal("pallas") is None]


def encoders(kernel: str, **fields):
  """Ids and a padding mask (row 1 right-padded), a 2-layer bf16 encoder on ``xla`` and the same on ``kernel``,
  and the variables they share."""
  config = dict(hidden_size=256, num_heads=4, intermediate_size=512, max_len=128, dtype="bfloat16", vocab_size=128,
                num_layers=2, **fields)
  ids = jnp.asarray(np.random.default_rng(0).integers(1, 128, (4, 128)), jnp.int32)
  mask = np.ones((4, 128), np.int32)
  mask[1, 100:] = 0
  xla = TransformerStack(TransformerConfig(**config, attention_kernel="xla"))
  other = TransformerStack(TransformerConfig(**config, attention_kernel=kernel))
  return ids, mask, xla, other, xla.init(jax.random.PRNGKey(0), ids)


@pytest.mark.parametrize("name", FUSABLE)
def test_cudnn_matches_xla(name):
  ids, mask, xla, cudnn, variables = encoders("cudnn", position=name)
  want = jax.jit(lambda v: xla.apply(v, ids, attention_mask=mask).last_hidden_state)(variables)
  compiled = jax.jit(lambda v: cudnn.apply(v, ids, attention_mask=mask).last_hidden_state).lower(variables).compile()
  assert "cudnn" in compiled.as_text().lower()  # the fused kernel really runs
  got = compiled(variables)
  np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32), atol=0.1, rtol=0.05)
  np.testing.assert_allclose(np.asarray(got[1, :100], np.float32), np.asarray(want[1, :100], np.float32),
                             atol=0.1, rtol=0.05)


KERNEL_METHODS = [("alibi", {}), ("t5", {}), ("tupe_r", {}), ("shaw", {"max_distance": 16}), ("huang_m4", {}),
                  ("rope", {})]


@pytest.mark.parametrize("name,options", KERNEL_METHODS, ids=[m for m, _ in KERNEL_METHODS])
def test_pallas_compiles_and_matches_xla(name, options):
  ids, mask, xla, fused, variables = encoders("pallas", position=name, position_options=options, dropout_rate=0.0,
                                              attention_dropout_rate=0.0)

  def loss(encoder):
    return lambda v: jnp.sum(encoder.apply(v, ids, attention_mask=mask).last_hidden_state.astype(jnp.float32) ** 2)

  want, want_grads = jax.jit(jax.value_and_grad(loss(xla)))(variables)
  got, got_grads = jax.jit(jax.value_and_grad(loss(fused)))(variables)  # compiled: interpret is off on a GPU
  np.testing.assert_allclose(got, want, rtol=2e-2)
  for (path, w), g in zip(jax.tree_util.tree_leaves_with_path(want_grads), jax.tree_util.tree_leaves(got_grads)):
    scale = float(np.abs(w).max()) or 1.0
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), atol=5e-2 * scale,
                               err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("window", [False, True])
def test_pallas_dropout_and_relative_vectors_compile_and_match_xla(window):
  """The compiled kernels with attention dropout (the same hashed mask as the xla path) and Method 4's
  relative vectors, gathered or windowed (the scratch round trip of the window's skew), packed and padded."""
  from posjax import kernels

  rng = np.random.default_rng(0)
  batch, length, heads, head_dim = 2, 200, 4, 64
  f32 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  q, k, v, weights = (f32(batch, length, heads, head_dim) for _ in range(4))
  segments = np.repeat([[1] * 120 + [2] * 80], batch, 0)
  positions = np.concatenate([np.arange(120), np.arange(80)])[None].repeat(batch, 0)
  terms = kernels.Terms(relative=kernels.Relative(0.3 * f32(2 * 150 + 1, head_dim), 150, query=True, key=True,
                                                  window=window))

  def loss(implementation, q, k, v, terms):
    out = kernels.relative_attention(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16),
                                     terms=terms, positions=positions, segment_ids=segments,
                                     lengths=np.array([200, 170]), implementation=implementation,
                                     dropout_rate=0.1, dropout_seed=5)
    return jnp.sum(out.astype(jnp.float32) * weights)

  want, got = (jax.jit(jax.grad(functools.partial(loss, impl), argnums=(0, 1, 2, 3)))(q, k, v, terms)
               for impl in ("xla", "pallas"))
  for (path, w), g in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree_util.tree_leaves(got)):
    scale = float(np.abs(w).max()) or 1.0
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), atol=5e-2 * scale,
                               err_msg=jax.tree_util.keystr(path))


def test_stick_breaking_compiles_and_matches_xla():
  """The compiled stick-breaking kernels (key tiles walked from the diagonal back, the backward's carries) on packed,
  padded, causal rows with grouped k/v heads, in float32 (three TF32 passes for the in-tile suffix sums)."""
  from posjax import kernels

  rng = np.random.default_rng(1)
  batch, length, heads, kv_heads, head_dim = 2, 300, 4, 2, 64
  f32 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  q, weights = f32(batch, length, heads, head_dim), f32(batch, length, heads, head_dim)
  k, v = f32(batch, length, kv_heads, head_dim), f32(batch, length, kv_heads, head_dim)
  segments = np.repeat([[1] * 180 + [2] * 120], batch, 0)
  terms = kernels.Terms(stick_breaking=kernels.StickBreaking())

  def loss(implementation, q, k, v):
    out = kernels.relative_attention(q, k, v, terms=terms, segment_ids=segments, lengths=np.array([300, 250]),
                                     causal=True, implementation=implementation)
    return jnp.sum(out * weights)

  want, got = (jax.jit(jax.grad(functools.partial(loss, impl), argnums=(0, 1, 2)))(q, k, v)
               for impl in ("xla", "pallas"))
  for w, g in zip(want, got):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-3 * float(np.abs(w).max()))
