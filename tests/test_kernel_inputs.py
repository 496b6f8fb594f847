"""Every kernel with inputs as other pipelines make them: docs/api.md's own-model pattern with packed positions,
Hugging Face's left-padded position ids, left padding and holes on cuDNN, bf16, a layer called without its state,
options of the wrong type and meshes that do not divide the model. Checked against the float64 loops of
``tests/reference.py``, numpy, or the ``xla`` path (itself checked against those loops in test_positions.py)."""

import dataclasses
import tempfile

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference
from conftest import OneLayer, load_config, one_axis, override, randomize
from posjax import attention, kernels, positions, tasks
from posjax.kernels import xla
from posjax.models import TransformerConfig, TransformerStack
from posjax.train import validate

PALLAS_METHODS = [n for n in one_axis(positions.encoder_names())
                  if positions.make(n, num_heads=4, hidden_size=32, max_len=64).refusal("pallas") is None]
PACKED = np.array([list(range(9)) + list(range(7)), list(range(16))])  # two documents in the first row
LEFT_PADDED = np.array([[False] * 5 + [True] * 11, [True] * 16])


class MyEncoder(nn.Module):
  """docs/api.md's own-model pattern, verbatim but for the method, the kernel and the sizes."""

  name_: str
  kernel: str

  @nn.compact
  def __call__(self, x_BxLxD, positions_BxL, padding_BxL):
    spec = positions.make(self.name_, num_heads=4, hidden_size=32, max_len=64)
    state = spec.method.encoder(spec=spec, name="position")(positions_BxL)
    mask = attention.Mask(padding=padding_BxL)
    x_BxLxD = x_BxLxD + attention.SelfAttention(spec, self.kernel, name="attention_0")(x_BxLxD, state, mask)
    return nn.LayerNorm()(x_BxLxD)


def test_pallas_computes_the_methods_the_issue_names():
  assert {"none", "alibi", "t5", "tupe_a", "tupe_r", "shaw", "huang_m4", "rope"} <= set(PALLAS_METHODS)


@pytest.mark.parametrize("name", PALLAS_METHODS)
def test_own_model_pattern_on_pallas_equals_xla_with_packed_positions(name):
  """The state every method's encoder returns carries the batch's positions, so the kernel builds its terms from
  them (it used to get 0..L-1: ALiBi off by 8e-3 on packed rows); the pattern runs unchanged for ``none``."""
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 16, 32)), jnp.float32)
  padding = np.ones((2, 16), bool)
  padding[1, 12:] = False
  params = randomize(MyEncoder(name, "xla").init(jax.random.PRNGKey(0), x, PACKED, padding)["params"], scale=0.3)
  run = lambda kernel: MyEncoder(name, kernel).apply({"params": params}, x, PACKED, padding)
  np.testing.assert_allclose(run("pallas"), run("xla"), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", one_axis(positions.names()))
def test_every_encoder_returns_the_positions_it_was_given(name):
  spec = positions.make(name, num_heads=4, hidden_size=32, max_len=64, causal=positions.get(name).decoder_only)
  state, _ = spec.method.encoder(spec=spec).init_with_output(jax.random.PRNGKey(0), PACKED)
  np.testing.assert_array_equal(state.positions, PACKED)


@pytest.mark.parametrize("name", ["shaw", "huang_m4"])
def test_hugging_face_position_ids_on_pallas_give_the_xla_outputs(name):
  """Ids as Hugging Face makes them (``cumsum(mask) - 1``, padding at position 1) do not rise by one at the padded
  queries, where the windowed table misreads: no NaN anywhere, two layers deep, and the xla path's outputs."""
  mask = LEFT_PADDED.astype(np.int32)
  ids = np.where(mask, np.cumsum(mask, -1) - 1, 1)
  tokens = np.random.default_rng(1).integers(1, 128, size=mask.shape)
  config = TransformerConfig.tiny(position=name, max_len=64)
  params = randomize(TransformerStack(config).init(jax.random.PRNGKey(0), tokens)["params"], scale=0.3)
  run = lambda kernel: TransformerStack(dataclasses.replace(config, attention_kernel=kernel)).apply(
      {"params": params}, tokens, attention_mask=mask, positions=ids).last_hidden_state
  got, want = run("pallas"), run("xla")
  assert not np.isnan(got).any()
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.fixture
def cudnn_as_xla(monkeypatch):
  """``jax.nn.dot_product_attention``'s cuDNN implementation swapped for JAX's xla one, which takes sequence
  lengths the same way (keys past a row's length masked): the cuDNN path's inputs, checked on a CPU."""
  original = jax.nn.dot_product_attention
  monkeypatch.setattr(jax.nn, "dot_product_attention",
                      lambda *args, implementation=None, **kwargs: original(*args, implementation="xla", **kwargs))


def masked_softmax_f64(q, k, v, padding, scale):
  """Float64 numpy: each query attends to the real keys of its row."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  logits = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
  logits = np.where(padding[:, None, None, :], logits, -np.inf)
  return np.einsum("bhqk,bkhd->bqhd", reference.softmax(logits), v)


HOLES = np.array([[False] * 5 + [True] * 11, [True] * 10 + [False] * 6, [True] * 3 + [False] * 3 + [True] * 10])


def test_cudnn_takes_left_padding_and_holes(cudnn_as_xla):
  """Left padding and holes reach cuDNN as a bias (lengths would point the real tokens at the padding: off by ~1
  relative), right padding as lengths: the real tokens' outputs and gradients are float64 numpy's."""
  rng = np.random.default_rng(2)
  q, k, v = (jnp.asarray(rng.normal(size=(3, 16, 2, 8)), jnp.float32) for _ in range(3))
  weights = rng.normal(size=(3, 16, 2, 8)) * HOLES[:, :, None, None]
  for padding in (HOLES, np.arange(16)[None] < np.array([[16], [9], [4]])):
    mask = attention.Mask(padding=jnp.asarray(padding))
    out = attention.fused_attention(q, k, v, None, mask, 0.25)
    want = masked_softmax_f64(q, k, v, padding, 0.25)
    np.testing.assert_allclose(np.where(padding[:, :, None, None], out, 0),
                               np.where(padding[:, :, None, None], want, 0), rtol=1e-5, atol=1e-5)
  # a row with no real token averages every value, as the xla path does (cuDNN's length 0 is not asked for)
  empty = np.arange(16)[None] < np.array([[16], [0], [4]])
  out = attention.fused_attention(q, k, v, None, attention.Mask(padding=jnp.asarray(empty)), 0.25)
  np.testing.assert_allclose(out[1], np.broadcast_to(np.mean(np.asarray(v[1]), axis=0), (16, 2, 8)), atol=1e-5)
  mask = attention.Mask(padding=jnp.asarray(HOLES))
  grads = jax.grad(lambda q, k, v: jnp.sum(attention.fused_attention(q, k, v, None, mask, 0.25) * weights),
                   argnums=(0, 1, 2))(q, k, v)
  loss = lambda q, k, v: np.sum(masked_softmax_f64(q, k, v, HOLES, 0.25) * weights)
  eps, inputs = 1e-4, [np.asarray(x, np.float64) for x in (q, k, v)]
  for i, grad in enumerate(grads):
    d = rng.normal(size=inputs[i].shape)
    plus, minus = list(inputs), list(inputs)
    plus[i], minus[i] = inputs[i] + eps * d, inputs[i] - eps * d
    numeric = (loss(*plus) - loss(*minus)) / (2 * eps)
    assert abs(np.sum(np.asarray(grad) * d) - numeric) <= 1e-4 * np.linalg.norm(grad) * np.linalg.norm(d)


@pytest.mark.parametrize("name", ["none", "t5", "tupe_a"])
def test_cudnn_layer_with_left_padding_equals_xla_at_real_tokens(cudnn_as_xla, name):
  """The layer on ``cudnn`` (bf16, TUPE-A's folded q/k included) with left-padded rows: xla's outputs at the real
  tokens, to bf16's precision."""
  x = jnp.asarray(np.random.default_rng(3).normal(size=(2, 16, 32)), jnp.float32)
  pos = np.arange(16)[None]
  mask = attention.Mask(padding=jnp.asarray(LEFT_PADDED))
  spec = lambda dtype: positions.make(name, num_heads=4, hidden_size=32, max_len=64, dtype=dtype)
  params = randomize(OneLayer(spec(jnp.float32)).init(jax.random.PRNGKey(0), x, pos)["params"], scale=0.3)
  got = OneLayer(spec(jnp.bfloat16), "cudnn").apply({"params": params}, x, pos, mask).astype(jnp.float32)
  want = OneLayer(spec(jnp.float32), "xla").apply({"params": params}, x, pos, mask)
  real = LEFT_PADDED[:, :, None]
  error = np.max(np.abs(np.where(real, got - want, 0))) / np.max(np.abs(want))
  assert error < 2e-2, error


def test_cudnn_layers_initialise_without_a_gpu():
  """Initialising computes no attention kernel (the parameters are every kernel's): a model for a GPU target
  (``platform="gpu"``, ``auto`` -> cuDNN) initialises on a CPU, as compiling ahead of time needs."""
  spec = positions.make("t5", num_heads=4, hidden_size=32, max_len=64, dtype=jnp.bfloat16)
  layer = attention.SelfAttention(spec, "auto", platform="gpu")
  x = jnp.ones((2, 16, 32), jnp.bfloat16)
  state = spec.method.encoder(spec=spec).init_with_output(jax.random.PRNGKey(0), np.arange(16)[None])[0]
  assert "query" in layer.init(jax.random.PRNGKey(0), x, state)["params"]


def logit_error(name, seed, length=32):
  """``max |bf16 - float32| / max |float32|`` of one layer's attention logits (random parameters)."""
  x = np.random.default_rng(seed).normal(size=(2, length, 64)).astype(np.float32)
  pos = np.arange(length)[None]
  spec = lambda dtype: positions.make(name, num_heads=4, hidden_size=64, max_len=length, dtype=dtype)
  params = randomize(OneLayer(spec(jnp.float32)).init(jax.random.PRNGKey(0), x, pos)["params"], seed, scale=0.3)

  def logits(dtype):
    _, inter = OneLayer(spec(dtype)).apply({"params": params}, x, pos, mutable=["intermediates"])
    return np.asarray(inter["intermediates"]["attn"]["attention_logits"][0], np.float64)

  want = logits(jnp.float32)
  return np.max(np.abs(logits(jnp.bfloat16) - want)) / np.max(np.abs(want))


def test_bf16_logits_lose_no_more_than_plain_attention():
  """Every sum over a model dimension accumulates in float32: each method's bf16 logit error is within 1.5x of
  plain attention's (Method 3's triple product in bf16 was 2.45x, Method 2's 1.53x)."""
  plain = np.mean([logit_error("none", seed) for seed in range(3)])
  ratios = {name: np.mean([logit_error(name, seed) for seed in range(3)]) / plain
            for name in one_axis(positions.encoder_names())}
  assert max(ratios.values()) <= 1.5, ratios


def test_mlm_logits_accumulate_in_float32():
  """The vocabulary logits of a bf16 model: float32, and the sum over the width as float64 numpy computes it from
  the same bf16 inputs (a bf16 sum is off by ~1e-2 relative)."""
  config = TransformerConfig.tiny(dtype="bfloat16")
  tokens = np.random.default_rng(4).integers(1, 128, size=(2, 8))
  model = TransformerStack(config)
  params = model.init(jax.random.PRNGKey(0), tokens)["params"]
  h = jnp.asarray(np.random.default_rng(5).normal(size=(2, 8, 32)) * 4, jnp.bfloat16)
  got = model.apply({"params": params}, h, method=TransformerStack.attend_words)
  table = np.asarray(nn.unbox(params)["word_embeddings"]["embedding"], np.float32).astype(jnp.bfloat16)
  want = np.asarray(h, np.float64) @ np.asarray(table, np.float64).T
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("name", ["alibi", "t5", "tupe_a", "rope", "shaw"])
def test_a_layer_without_its_state_is_an_error(name):
  spec = positions.make(name, num_heads=4, hidden_size=32, max_len=64)
  x = jnp.ones((2, 16, 32))
  with pytest.raises(ValueError, match=rf"^SelfAttention with position method '{name}' needs the PositionState its "
                                       r"encoder returns .*spec.method.encoder\(spec=spec\)\(positions_BxL\)"):
    attention.SelfAttention(spec).init(jax.random.PRNGKey(0), x)
  with pytest.raises(TypeError, match="positions"):
    positions.PositionState()  # every state carries the batch's positions


@pytest.mark.parametrize("name", ["none", "absolute", "sinusoidal"])
def test_a_layer_whose_method_reads_no_state_runs_without_one(name):
  spec = positions.make(name, num_heads=4, hidden_size=32, max_len=64)
  attention.SelfAttention(spec).init(jax.random.PRNGKey(0), jnp.ones((2, 16, 32)))


def test_a_state_of_another_length_is_an_error():
  spec = positions.make("alibi", num_heads=4, hidden_size=32, max_len=64)
  state = spec.method.encoder(spec=spec).apply({}, np.arange(8)[None])
  with pytest.raises(ValueError, match=r"^state.positions has shape \(1, 8\); expected \[2 or 1, 16\]"):
    attention.SelfAttention(spec).init(jax.random.PRNGKey(0), jnp.ones((2, 16, 32)), state)


def test_an_option_of_the_wrong_type_is_an_error():
  make = lambda name, options: positions.make(name, options, num_heads=4, hidden_size=32, max_len=64)
  with pytest.raises(ValueError, match=r"^position method 't5': option num_buckets='32' is a str; it must be int$"):
    make("t5", {"num_buckets": "32"})
  with pytest.raises(ValueError, match=r"option bidirectional=1 is a int; it must be bool \| None$"):
    make("t5", {"bidirectional": 1})
  with pytest.raises(ValueError, match=r"option max_distance=3.0 is a float; it must be int \| None$"):
    make("shaw", {"max_distance": 3.0})
  assert make("rope", {"max_timescale": 500}).options.max_timescale == 500
  assert make("shaw", {"max_distance": None}).options.max_distance is None


def test_a_mesh_that_does_not_divide_the_heads_is_refused_before_tracing():
  """Two heads over four tensor devices: one line naming the parameter and the axis, at validation (jit, or the
  kernels' per-shard split, would fail later while tracing)."""
  config = load_config("pretrain", "runlocal,position=alibi")
  config = override(config, **{"model.attention_kernel": "pallas", "model.num_heads": 2, "batch_size": 16,
                               "mesh.data": 2, "mesh.tensor": 4, "max_len": 16})
  with tempfile.TemporaryDirectory() as workdir, pytest.raises(
      ValueError, match=r"\['attention'\]\['key'\]\['bias'\] has 2 along its axis 'heads', which does not divide "
                        r"over mesh axes \['tensor'\] \(4 devices\); choose mesh sizes that divide it$"):
    validate.validate(config, workdir, tasks.build)


@pytest.mark.parametrize("reset", ["official", "paper"])
def test_the_dense_path_by_query_blocks_is_the_reference(reset):
  """The windowed kernels' fallback (``xla.attention(query_block=)``, its memory linear in L): every term at once on
  packed rows, a fully padded row and causal masking, against the float64 reference; gradients against the dense
  path at once."""

  rng = np.random.default_rng(6)
  batch, length, heads, head_dim = 3, 20, 2, 8
  f32 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  positions = np.array([list(range(12)) + list(range(8)), list(range(20)), list(range(20))])
  segments = np.array([[0] * 12 + [1] * 8, [0] * 20, [0] * 20])
  valid = np.ones((batch, length), bool)
  valid[1, 15:], valid[2] = False, False
  terms = kernels.Terms(
      alibi=kernels.Alibi(jnp.asarray([0.5, 0.25])),
      buckets=kernels.Buckets(f32(34, heads), num_buckets=32, max_distance=20, cls_row=32 if reset == "official"
                              else None, cls_col=33 if reset == "official" else None),
      relative=kernels.Relative(0.5 * f32(2 * 7 + 1, head_dim), max_distance=7, query=True, key=True),
      untied=kernels.Untied(f32(1, length, heads, head_dim), f32(1, length, heads, head_dim), f32(2, heads),
                            reset=reset))
  q, k, v, weights = (f32(batch, length, heads, head_dim) for _ in range(4))
  run = lambda block, q, k, v, terms: xla.attention(
      q, k, v, terms, positions_BxL=jnp.asarray(positions), segment_ids_BxL=jnp.asarray(segments),
      valid_BxL=jnp.asarray(valid), scale=0.3, causal=True, query_block=block)
  fused = reference.FusedAttention(positions, segments, valid, causal=True, relative_max_distance=7, buckets=dict(
      kind="buckets", num_buckets=32, max_distance=20, bidirectional=True, cls_row=terms.buckets.cls_row,
      cls_col=terms.buckets.cls_col))
  want = fused(q, k, v, scale=0.3, alibi=np.asarray([0.5, 0.25]), bucket_table=terms.buckets.table,
               relative_table=terms.relative.table, relative_query=True, relative_key=True,
               u_q=terms.untied.u_q, u_k=terms.untied.u_k, theta=terms.untied.theta, reset=reset)
  np.testing.assert_allclose(run(8, q, k, v, terms), want, rtol=1e-5, atol=1e-5)
  grad = lambda block: jax.jit(jax.grad(lambda *args: jnp.sum(run(block, *args) * weights), argnums=(0, 1, 2, 3)))(
      q, k, v, terms)
  for got, expected in zip(jax.tree.leaves(grad(8)), jax.tree.leaves(grad(None))):
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(expected).max())))


def test_inputs_as_other_pipelines_make_them_are_refused_in_one_line():
  """An additive mask (0 at real tokens, -1e4 at padding: cast to bool it would flip), fractional or 1-D positions,
  masks of another shape or rank, a q without heads: each one line that names the argument, on every entry point."""
  rng = np.random.default_rng(7)
  q = jnp.asarray(rng.normal(size=(3, 16, 4, 8)), jnp.float32)
  padding = np.ones((3, 16), bool)
  padding[0, :4] = False
  additive = np.where(padding, 0.0, -1e4).astype(np.float32)
  attend = lambda **kw: kernels.relative_attention(q, q, q, implementation="xla", **kw)
  with pytest.raises(ValueError, match=r"^padding has dtype float32; it must hold bool or 0/1 integers"):
    attend(padding=additive)
  with pytest.raises(ValueError, match=r"^positions has dtype float32; it must hold integers$"):
    attend(positions=np.arange(16)[None] * 0.5)
  with pytest.raises(ValueError, match=r"^positions has shape \(2, 16\); expected \[3 or 1, 16\]"):
    attend(positions=np.zeros((2, 16), np.int32))
  with pytest.raises(ValueError, match=r"^padding has shape \(3, 1, 1, 16\); expected \[3 or 1, 16\]"):
    attend(padding=padding[:, None, None, :])
  with pytest.raises(ValueError, match=r"^q has shape \(3, 16, 32\); expected \[B, L, H, K\]"):
    kernels.relative_attention(q.reshape(3, 16, 32), q.reshape(3, 16, 32), q.reshape(3, 16, 32))
  spec = positions.make("t5", num_heads=4, hidden_size=32, max_len=64)
  with pytest.raises(ValueError, match=r"^positions has shape \(16,\); expected \[B, L\]"):
    spec.method.encoder(spec=spec).init(jax.random.PRNGKey(0), jnp.arange(16))
  state = spec.method.encoder(spec=spec).apply({"params": {"relative_bias": {"rel_bias": jnp.zeros((32, 4))}}},
                                               np.arange(16)[None])
  x = jnp.ones((3, 16, 32))
  with pytest.raises(ValueError, match=r"^Mask.padding has dtype float32; it must hold bool or 0/1 integers"):
    attention.SelfAttention(spec).init(jax.random.PRNGKey(0), x, state, attention.Mask(padding=additive))
  with pytest.raises(ValueError, match=r"^Mask.segment_ids has shape \(4, 16\); expected \[3 or 1, 16\]"):
    attention.SelfAttention(spec).init(jax.random.PRNGKey(0), x, state,
                                       attention.Mask(segment_ids=np.zeros((4, 16), np.int32)))
  config = TransformerConfig.tiny()
  tokens = np.ones((3, 16), np.int32)
  params = TransformerStack(config).init(jax.random.PRNGKey(0), tokens)["params"]
  with pytest.raises(ValueError, match=r"^attention_mask has dtype float32; it must hold bool or 0/1 integers"):
    TransformerStack(config).apply({"params": params}, tokens, attention_mask=additive)


def test_a_negative_position_reads_no_table_row():
  """TUPE's official table is read at ``p + 1`` (row 0 is the [CLS] reset's): -1 must still give NaN, as on every
  other learned table, not row 0."""
  spec = positions.make("tupe_a", num_heads=4, hidden_size=32, max_len=64)
  pos = np.array([[0, 1, 2, -1]])
  state, _ = spec.method.encoder(spec=spec).init_with_output(jax.random.PRNGKey(0), pos)
  bias = np.asarray(state.bias)
  assert np.isnan(bias[0, :, 3, 1:3]).all() and np.isfinite(bias[0, :, :3, :3]).all()
