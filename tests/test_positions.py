"""Every method's logits against an explicit (i, j) loop of its paper formula; method properties."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax.linen import unbox as nn_unbox

from posjax import attention, positions
from posjax.kernels.xla import position_bias
from posjax.positions import absolute, alibi, relative, t5
from conftest import PACKED_POSITIONS, PACKED_SEGMENTS, OneLayer, one_axis, randomize
import reference

NUM_HEADS, HIDDEN, MAX_LEN = 4, 32, 16

CASES = [
    ("none", {}), ("absolute", {}), ("sinusoidal", {}), ("t5", {}), ("bert_r", {}), ("alibi", {}), ("rope", {}),
    ("bert_ad", {}), ("bert_ad", {"layernorm": True, "projection_bias": False}),
    ("tupe_a", {}), ("tupe_a", {"cls_reset": "paper"}), ("tupe_a", {"cls_reset": "none"}),
    ("tupe_a", {"share_across_layers": False, "projection_bias": False, "layernorm": False}),
    ("tupe_r", {}), ("tupe_r", {"cls_reset": "paper"}), ("tupe_r", {"cls_reset": "none"}),
    ("tupe_r", {"relative_distance": "clip", "max_distance": 3}),
    ("tupe_r", {"relative_distance": "clip", "max_distance": 3, "cls_reset": "paper"}),
    ("tupe_r", {"share_across_layers": False}),
    ("shaw", {}), ("shaw", {"max_distance": 3, "impl": "skew"}), ("shaw", {"share_across_layers": True}),
    ("huang_m1", {}), ("huang_m1", {"max_distance": 2}), ("huang_m2", {"max_distance": 3}),
    ("huang_m3", {}), ("huang_m3", {"max_distance": 2, "share_across_layers": True}),
    ("huang_m4", {}), ("huang_m4", {"max_distance": 3, "impl": "skew"}), ("relative_key_query", {"impl": "table"}),
    ("kerple_log", {}), ("kerple_power", {}), ("kerple_log", {"eps": 0.3, "share_across_layers": False}), ("fire", {}), ("fire", {"threshold": 4.0}),
    ("fire", {"share_across_layers": True, "c": 0.5, "threshold": 2.0}),
    ("xpos", {}), ("xpos", {"scale_base": 4.0, "gamma": 0.2}),
    ("sandwich", {}), ("sandwich", {"dim": 10, "compression": "none", "scale": 0.3, "base": 100.0}),
    ("sandwich", {"compression": "bias", "dim": None, "first_frequency": 1}),  # NVIDIA NeMo's form
    ("fox", {}), ("fox", {"gate": "bias_only", "rope": True, "rope_base": 100.0}),
    ("fox", {"gate": "fixed", "decay_time": (2.0, 64.0)}),
]


def run_one_layer(name, options, positions_BxL, seed=0, mask=None):
  spec = positions.make(name, options, num_heads=NUM_HEADS, hidden_size=HIDDEN, max_len=MAX_LEN)
  x = np.random.default_rng(seed).normal(size=(positions_BxL.shape[0], positions_BxL.shape[1], HIDDEN))
  x = x.astype(np.float32)
  model = OneLayer(spec)
  params = randomize(jax.eval_shape(model.init, jax.random.PRNGKey(0), x, positions_BxL)["params"], seed)
  out, state = model.apply({"params": params}, x, positions_BxL, mask, mutable=["intermediates"])
  numpy_params = jax.tree.map(np.asarray, params)
  return x, numpy_params, np.asarray(state["intermediates"]["attn"]["attention_logits"][0]), out


@pytest.mark.parametrize("name,options", CASES, ids=[f"{n}-{'-'.join(f'{k}={v}' for k, v in o.items())}"
                                                     for n, o in CASES])
def test_logits_match_loop_reference(name, options):
  x, params, got, _ = run_one_layer(name, options, PACKED_POSITIONS)
  want = reference.logits(name, options, params, x, PACKED_POSITIONS, MAX_LEN, NUM_HEADS)
  np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("impl", ["table", "skew"])
@pytest.mark.parametrize("share", [False, True])
def test_shaw_value_term_matches_loop_reference(impl, share):
  options = {"value_term": True, "max_distance": 3, "impl": impl, "share_across_layers": share}
  x, params, logits, out = run_one_layer("shaw", options, PACKED_POSITIONS)
  weights = jax.nn.softmax(logits, axis=-1)
  z = reference.shaw_value_output(params, x, PACKED_POSITIONS, weights, MAX_LEN, options)
  want = np.einsum("blhk,hkd->bld", z, params["attn"]["out"]["kernel"]) + params["attn"]["out"]["bias"]
  np.testing.assert_allclose(out, want, rtol=2e-4, atol=2e-4)


def test_input_embeddings_match_their_formulas(rng):
  pos = PACKED_POSITIONS
  for scale in (1.0, None):
    spec = positions.make("sinusoidal", {} if scale is None else {"scale": scale}, num_heads=2, hidden_size=6,
                          max_len=8)
    got, _ = absolute.Sinusoidal(spec).init_with_output(jax.random.PRNGKey(0), pos)
    scale = 0.02 * math.sqrt(2) if scale is None else scale
    for b, i, f in np.ndindex(*pos.shape, 3):
      angle = pos[b, i] / 10_000 ** (2 * f / 6)
      np.testing.assert_allclose(got.embedding[b, i, 2 * f], scale * math.sin(angle), atol=1e-5)
      np.testing.assert_allclose(got.embedding[b, i, 2 * f + 1], scale * math.cos(angle), atol=1e-5)
  spec = positions.make("absolute", num_heads=2, hidden_size=6, max_len=10)
  got, variables = absolute.Absolute(spec).init_with_output(jax.random.PRNGKey(0), pos)
  np.testing.assert_array_equal(got.embedding, np.asarray(variables["params"]["table"]["embedding"].value)[pos])


def test_t5_bucket_table_matches_the_spec_exactly():
  rel = np.arange(-300, 301)
  np.testing.assert_array_equal(np.asarray(t5.bucket(rel)), [reference.t5_bucket_tabulated(int(r)) for r in rel])
  assert [reference.t5_bucket(int(r)) for r in rel] == [reference.t5_bucket_tabulated(int(r)) for r in rel]
  assert 16 not in np.asarray(t5.bucket(rel)).tolist()  # the official [CLS] row re-uses this free bucket


def test_alibi_slopes_follow_the_paper():
  np.testing.assert_allclose(alibi.slopes(8), [2.0 ** -(i + 1) for i in range(8)])
  # 6 heads: the 4 slopes of 4 heads, then every other slope of 8 heads.
  np.testing.assert_allclose(alibi.slopes(6), [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -1, 2.0 ** -3])


@pytest.mark.parametrize("name,options", [("shaw", {"value_term": True}), ("huang_m4", {}),
                                          ("shaw", {"max_distance": 2, "value_term": True})])
def test_table_and_skew_agree(name, options, rng):
  spec_of = lambda impl: positions.make(name, {**options, "impl": impl}, num_heads=NUM_HEADS, hidden_size=HIDDEN,
                                        max_len=MAX_LEN)
  x = rng.normal(size=PACKED_POSITIONS.shape + (HIDDEN,)).astype(np.float32)
  table, skew = OneLayer(spec_of("table")), OneLayer(spec_of("skew"))
  params = randomize(jax.eval_shape(table.init, jax.random.PRNGKey(0), x, PACKED_POSITIONS)["params"])
  loss = lambda model: lambda p: jnp.sum(model.apply({"params": p}, x, PACKED_POSITIONS) ** 2)
  np.testing.assert_allclose(table.apply({"params": params}, x, PACKED_POSITIONS),
                             skew.apply({"params": params}, x, PACKED_POSITIONS), rtol=1e-4, atol=1e-4)
  grads_table, grads_skew = jax.jit(jax.grad(loss(table)))(params), jax.jit(jax.grad(loss(skew)))(params)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-3), grads_table, grads_skew)


def test_auto_impl_is_chosen_by_shape():
  index = lambda length: np.zeros((1, length, length), np.int32)
  # BERT-Base training shapes: B·H = 768 heads, d_h = 64, L = 512 -> the [L, L, d_h] table.
  assert relative.choose_impl("auto", 768, 64, index(512)) == "table"
  # Long sequence, one example: 12 heads, L = 2048 -> the [B, H, L, 2k+1] skew.
  assert relative.choose_impl("auto", 12, 64, index(2048)) == "skew"
  assert relative.choose_impl("table", 12, 64, index(2048)) == "table"


@pytest.mark.parametrize("name", ["shaw", "huang_m3", "huang_m4"])
@pytest.mark.parametrize("impl", ["table", "skew"])
def test_relative_terms_never_build_a_five_dimensional_tensor(name, impl):
  b, h, l, k = 2, 4, 12, 8
  options = {"impl": impl, **({"value_term": True} if name == "shaw" else {})} if name != "huang_m3" else {}
  spec = positions.make(name, options, num_heads=h, hidden_size=h * k, max_len=l)
  x = np.ones((b, l, h * k), np.float32)
  pos = np.broadcast_to(np.arange(l), (b, l))  # per-row positions: the [Bp, L, L, d_h] table has Bp = B
  model = OneLayer(spec)
  params = model.init(jax.random.PRNGKey(0), x, pos)["params"]
  step = jax.grad(lambda p: jnp.sum(model.apply({"params": p}, x, pos)))
  limit = b * h * l * l * k
  for eqn in all_equations(jax.make_jaxpr(step)(params).jaxpr):
    for var in eqn.outvars:
      assert math.prod(getattr(var.aval, "shape", ())) < limit, (eqn.primitive, var.aval)


def all_equations(jaxpr):
  """Every equation of a jaxpr, including those of nested jaxprs (scan bodies, custom derivatives)."""
  for eqn in jaxpr.eqns:
    yield eqn
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          yield from all_equations(sub)


def test_out_of_range_positions_give_nan_not_a_clamped_row():
  spec = positions.make("absolute", num_heads=2, hidden_size=4, max_len=4)
  module = absolute.Absolute(spec)
  variables = module.init(jax.random.PRNGKey(0), np.zeros((1, 4), np.int32))
  emb = module.apply(variables, np.array([[0, 1, 4, -1]])).embedding
  assert np.isfinite(emb[0, :2]).all() and np.isnan(emb[0, 2:]).all()


@pytest.mark.parametrize("name", ["tupe_a", "tupe_r"])
@pytest.mark.parametrize("reset", ["official", "paper"])
def test_tupe_cls_row_and_column_are_one_constant_per_head(name, reset):
  spec = positions.make(name, {"cls_reset": reset}, num_heads=NUM_HEADS, hidden_size=HIDDEN, max_len=MAX_LEN)
  model = OneLayer(spec)
  x = np.zeros((1, 9, HIDDEN), np.float32)  # zero input: the logits are the positional term alone
  params = randomize(jax.eval_shape(model.init, jax.random.PRNGKey(0), x, PACKED_POSITIONS[:1])["params"])
  params["attn"]["query"]["bias"] *= 0
  _, state = model.apply({"params": params}, x, PACKED_POSITIONS[:1], mutable=["intermediates"])
  term = np.asarray(state["intermediates"]["attn"]["attention_logits"][0][0])  # [H, L, L]
  for h in range(NUM_HEADS):
    np.testing.assert_allclose(term[h, 0, :], term[h, 0, 0], rtol=1e-5)  # [CLS] -> everything
    np.testing.assert_allclose(term[h, 1:, 0], term[h, 1, 0], rtol=1e-5)  # everything else -> [CLS]
    assert not np.isclose(term[h, 0, 0], term[h, 1, 0])
    assert np.unique(np.round(term[h, 1:, 1:], 5)).size > 1


def test_tupe_reset_modes_differ_as_specified():
  """paper: θ replaces positional + relative term; official: the relative table's extra entries add to θ."""
  x = np.zeros((1, 9, HIDDEN), np.float32)
  pos = PACKED_POSITIONS[:1]
  terms = {}
  for reset in ("paper", "official"):
    spec = positions.make("tupe_r", {"cls_reset": reset}, num_heads=NUM_HEADS, hidden_size=HIDDEN, max_len=MAX_LEN)
    model = OneLayer(spec)
    params = randomize(jax.eval_shape(model.init, jax.random.PRNGKey(0), x, pos)["params"])
    params["attn"]["query"]["bias"] *= 0
    _, state = model.apply({"params": params}, x, pos, mutable=["intermediates"])
    terms[reset] = params, np.asarray(state["intermediates"]["attn"]["attention_logits"][0][0])
  params, term = terms["official"]
  rel = params["pos"]["correlation"]["relative_bias"]["rel_bias"]
  assert rel.shape == (33, NUM_HEADS)
  corr = params["pos"]["correlation"]
  table, ln = params["pos"]["table"]["embedding"], params["pos"]["pos_ln"]
  p0 = reference.layer_norm(table[0], ln["scale"], ln["bias"])
  theta1 = np.sum(reference.project(p0, corr["query"]) * reference.project(p0, corr["key"]), -1) / math.sqrt(2 * HIDDEN // NUM_HEADS)
  np.testing.assert_allclose(term[:, 0, 3], theta1 + rel[16], rtol=1e-4)
  params, term = terms["paper"]
  assert params["pos"]["correlation"]["relative_bias"]["rel_bias"].shape == (33, NUM_HEADS)
  assert params["pos"]["cls_theta"].shape == (2, HIDDEN)
  corr, ln = params["pos"]["correlation"], params["pos"]["pos_ln"]
  p_theta = reference.layer_norm(params["pos"]["cls_theta"][0], ln["scale"], ln["bias"])
  theta1 = np.sum(reference.project(p_theta, corr["query"]) * reference.project(p_theta, corr["key"]), -1)
  np.testing.assert_allclose(term[:, 0, 3], theta1 / math.sqrt(2 * HIDDEN // NUM_HEADS), rtol=1e-4)


def test_relative_clipping_is_explicit():
  """Distances past k share the last row (the method's definition), never an index error."""
  x, params, got, _ = run_one_layer("shaw", {"max_distance": 2}, np.arange(12)[None] % MAX_LEN)
  want = reference.logits("shaw", {"max_distance": 2}, params, x, np.arange(12)[None], MAX_LEN, NUM_HEADS)
  np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


def test_fully_padded_row_gives_no_nan():
  spec = positions.make("tupe_r", num_heads=NUM_HEADS, hidden_size=HIDDEN, max_len=MAX_LEN)
  x = np.ones((2, 5, HIDDEN), np.float32)
  mask = attention.Mask(padding=np.array([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0]], bool))
  model = OneLayer(spec)
  variables = model.init(jax.random.PRNGKey(0), x, np.arange(5)[None])
  assert np.isfinite(model.apply(variables, x, np.arange(5)[None], mask)).all()


def reference_output(name, params, x, positions_BxL):
  """One layer's output in float64 from the loop reference's logits: softmax over every key, the value and output
  projections."""
  params = jax.tree.map(lambda p: np.asarray(p, np.float64), params)
  weights = reference.softmax(reference.logits(name, {}, params, np.asarray(x, np.float64), positions_BxL, MAX_LEN,
                                               NUM_HEADS))
  z = np.einsum("bhij,bjhk->bihk", weights, reference.project(np.asarray(x, np.float64), params["attn"]["value"]))
  return np.einsum("bihk,hkd->bid", z, params["attn"]["out"]["kernel"]) + params["attn"]["out"]["bias"]


@pytest.mark.parametrize("name", one_axis(positions.encoder_names()))  # the decoder-only ones: their weight rules' test
def test_bfloat16_compute_errs_no_more_than_a_small_multiple_of_rounding_its_inputs(name):
  """One layer in bfloat16 (float32 parameters, under jit) against the float64 loop reference: its error stays within
  a small multiple (3x; 1.3-2.3x measured) of the error that rounding the input and the parameters to bfloat16 alone
  causes in the reference, for every method."""
  spec = positions.make(name, {}, num_heads=NUM_HEADS, hidden_size=HIDDEN, max_len=MAX_LEN, dtype=jnp.bfloat16)
  x = np.random.default_rng(1).normal(size=PACKED_POSITIONS.shape + (HIDDEN,)).astype(np.float32)
  model = OneLayer(spec)
  params = randomize(jax.eval_shape(model.init, jax.random.PRNGKey(0), x, PACKED_POSITIONS)["params"], 1, scale=0.3)
  out = jax.jit(model.apply)({"params": params}, x, PACKED_POSITIONS)
  assert out.dtype == jnp.bfloat16 and jax.tree.leaves(params)[0].dtype == jnp.float32
  to_bf16 = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64)
  want = reference_output(name, params, x, PACKED_POSITIONS)
  rounding = np.abs(reference_output(name, jax.tree.map(to_bf16, params), to_bf16(x), PACKED_POSITIONS) - want).max()
  error = np.abs(np.asarray(out, np.float64) - want).max()
  assert error <= 3 * rounding, f"{name}: bfloat16 error {error:.3g}, {error / rounding:.1f}x rounding's {rounding:.3g}"


def test_kerple_parameters_below_eps_keep_training_and_start_as_the_official_code():
  """The clamp is straight-through (a stored value below eps still gets its gradient), and the power kernel draws its
  exponent from U(0, 2) and its scale from U(0, 1) (chijames/KERPLE's ParallelKerplePower)."""
  spec = positions.make("kerple_power", {"share_across_layers": False}, num_heads=256, hidden_size=512, max_len=16)
  layer = spec.method.layer(spec=spec)
  q = jnp.ones((1, 6, 256, 2))
  state = spec.method.encoder(spec=spec).apply({}, jnp.arange(6)[None])
  params = layer.init(jax.random.PRNGKey(0), q, q, state, 1.0)["params"]
  r1, r2 = np.asarray(nn_unbox(params["r1"])), np.asarray(nn_unbox(params["r2"]))
  assert r1.max() < 1.0 < r2.max() < 2.0 and r1.min() > 0 and r2.min() > 0
  low = {"r1": jnp.full((256,), -0.5), "r2": jnp.full((256,), 0.001)}
  bias = lambda p: jnp.sum(jnp.sin(position_bias_of(layer.apply({"params": p}, q, q, state, 1.0).terms, state.positions)))
  grads = jax.jit(jax.grad(bias))(low)
  assert np.all(np.asarray(grads["r1"]) != 0) and np.all(np.asarray(grads["r2"]) != 0)


def test_options_a_decoder_cannot_compute_are_errors():
  spec = positions.make("t5", {"max_distance": 16}, num_heads=2, hidden_size=16, max_len=64, causal=True)
  with pytest.raises(ValueError, match=r"max_distance=16 must exceed the 16 exact buckets"):
    spec.method.encoder(spec=spec).init(jax.random.PRNGKey(0), jnp.arange(8)[None])
  with pytest.raises(ValueError, match=r"scaling='dynamic' grows the base from the model's max_len"):
    positions.make("rope", {"scaling": "dynamic", "factor": 2.0, "original_max_len": 512}, num_heads=2,
                   hidden_size=16, max_len=64)


def position_bias_of(terms, positions_BxL):
  return position_bias(terms, positions_BxL, 1.0)


@pytest.mark.parametrize("share,pairs", [(True, 1), (False, 3)])
def test_kerple_holds_one_kernel_for_the_whole_model_as_the_official_code(share, pairs):
  # chijames/KERPLE builds one ParallelKerpleLog and hands it to every layer: (r1, r2) per head, once per model
  from posjax.models import TransformerConfig, Transformer
  config = TransformerConfig.tiny(position="kerple_log", num_layers=3, position_options={"share_across_layers": share})
  shapes = jax.eval_shape(Transformer(config).init, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]
  found = [(jax.tree_util.keystr(path), x.shape) for path, x in jax.tree_util.tree_leaves_with_path(shapes)
           if jax.tree_util.keystr(path).endswith(("['r1']", "['r2']", "['r1'].value", "['r2'].value"))]
  assert len(found) == 2 * pairs and all(shape == (config.num_heads,) for _, shape in found), found
  assert all(("layer_" in name) != share for name, _ in found), found


def test_fire_starts_as_the_official_modules_torch_linear_layers():
  # nn.Linear(1, W) then nn.Linear(W, H), PyTorch's default: weights and biases from U(-1/sqrt(fan_in), 1/sqrt(fan_in))
  width = 4096
  spec = positions.make("fire", {"mlp_width": width, "share_across_layers": True}, num_heads=256, hidden_size=512,
                        max_len=16)
  params = nn_unbox(spec.method.encoder(spec=spec).init(jax.random.PRNGKey(0), jnp.arange(4)[None])["params"])
  for name, bound in (("w1", 1.0), ("b1", 1.0), ("w2", width ** -0.5), ("b2", width ** -0.5)):
    x = np.asarray(params["fire"][name]).ravel()
    assert np.abs(x).max() <= bound and np.abs(x).max() > 0.9 * bound, name
    np.testing.assert_allclose(x.var(), bound ** 2 / 3, rtol=0.1, err_msg=name)


WEIGHT_RULES = [("cope", {}), ("cope", {"npos_max": 3, "scaled": False}), ("stick_breaking", {}),
                ("stick_breaking", {"attend_current": True, "remainder": False})]


@pytest.mark.parametrize("name,options", WEIGHT_RULES, ids=[f"{n}-{'-'.join(f'{k}={v}' for k, v in o.items())}"
                                                            for n, o in WEIGHT_RULES])
def test_weight_rules_and_their_gradients_match_loop_reference(name, options):
  # CoPE and stick-breaking read the masked logits: the layer's output (packed, causal, grouped k/v) against the
  # loops, and a directional derivative of a loss against the loops' central difference in float64
  spec = positions.make(name, options, num_heads=NUM_HEADS, hidden_size=HIDDEN, max_len=MAX_LEN, causal=True,
                        num_kv_heads=2)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(*PACKED_POSITIONS.shape, HIDDEN)).astype(np.float32)
  model = OneLayer(spec)
  params = randomize(jax.eval_shape(model.init, jax.random.PRNGKey(0), x, PACKED_POSITIONS)["params"], 0)
  mask = attention.Mask(segment_ids=PACKED_SEGMENTS, causal=True)
  weights_BxLxD = rng.normal(size=x.shape)
  direction = jax.tree.map(lambda p: rng.normal(size=p.shape), params)

  def reference_loss(p):
    out = reference.weight_rule_output(name, options, p, x.astype(np.float64), PACKED_POSITIONS, PACKED_SEGMENTS)
    out = np.einsum("blhk,hkd->bld", out, p["attn"]["out"]["kernel"]) + p["attn"]["out"]["bias"]
    return out, np.sum(out * weights_BxLxD)

  numpy_params = jax.tree.map(lambda p: np.asarray(p, np.float64), params)
  want, _ = reference_loss(numpy_params)
  loss = lambda p: jnp.sum(model.apply({"params": p}, x, PACKED_POSITIONS, mask) * weights_BxLxD)
  np.testing.assert_allclose(model.apply({"params": params}, x, PACKED_POSITIONS, mask), want, rtol=2e-4, atol=2e-4)
  grads = jax.grad(loss)(params)
  got = sum(np.vdot(g, d) for g, d in zip(jax.tree.leaves(grads), jax.tree.leaves(direction)))
  eps = 1e-5
  shifted = lambda sign: reference_loss(jax.tree.map(lambda p, d: p + sign * eps * d, numpy_params, direction))[1]
  np.testing.assert_allclose(got, (shifted(1) - shifted(-1)) / (2 * eps), rtol=2e-3)
