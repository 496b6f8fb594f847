"""BERT encoder properties for every position method: invariances, packing, gradients, precision, transforms."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posjax import attention, positions
from posjax.models import TransformerConfig, TransformerStack, Transformer
from conftest import one_axis, randomize

ALL = one_axis(positions.encoder_names())
SHIFT_INVARIANT = ["none", "t5", "alibi", "rope", "shaw", "huang_m1", "huang_m2", "huang_m3", "huang_m4", "kerple_log",
                   "kerple_power", "fire", "xpos", "pope", "sandwich", "fox"]  # FIRE: below its threshold L (512 here)
ABSOLUTE = ["absolute", "sinusoidal", "bert_r", "bert_ad", "tupe_a", "tupe_r"]
assert sorted(SHIFT_INVARIANT + ABSOLUTE) == sorted(ALL)


def build(name, options=None, **overrides):
  config = TransformerConfig.tiny(position=name, position_options=options or {}, **overrides)
  model = TransformerStack(config)
  params = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.ones((1, 8), jnp.int32))["params"]
  return config, model, randomize(params, scale=0.3)  # from the shapes alone: no initialiser runs


def hidden(model, params, ids, **kwargs):
  return np.asarray(jax.jit(model.apply)({"params": params}, jnp.asarray(ids), **kwargs).last_hidden_state)


def tokens(rng, *shape):
  return rng.integers(1, 128, size=shape).astype(np.int32)


@pytest.mark.parametrize("name", ALL)
def test_padding_packing_and_shifts(name, rng):
  """Appended padding changes nothing (against the unpadded row); packed segments do not attend to each other
  (each equals its row alone); moving a sequence behind padding changes nothing for the relative methods and must
  change the absolute ones. One padded batch, one program (and the unpadded row's): the rows
    0: a (8 tokens) + padding        1: c (6) + padding        2: padding (4) + c + padding
    3: a[:5] and b (4), packed       4: a[:5] + padding        5: b + padding
  Gradients reach every parameter: tests/test_golden.py."""
  _, model, params = build(name, {"threshold": 512.0} if name == "fire" else None)  # FIRE: shift-invariant below L
  a, b, c, length = tokens(rng, 8), tokens(rng, 4), tokens(rng, 6), 13
  ids, mask = np.zeros((6, length), np.int32), np.zeros((6, length), np.int32)
  positions_ = np.tile(np.arange(length, dtype=np.int32), (6, 1))
  segments = np.zeros((6, length), np.int32)
  for row, start, content in ((0, 0, a), (1, 0, c), (2, 4, c), (3, 0, a[:5]), (3, 5, b), (4, 0, a[:5]), (5, 0, b)):
    ids[row, start:start + len(content)], mask[row, start:start + len(content)] = content, 1
  positions_[3, 5:9], segments[3, 5:] = np.arange(4), 1
  h = hidden(model, params, ids, attention_mask=mask, positions=positions_, segment_ids=segments)
  np.testing.assert_allclose(h[0, :8], hidden(model, params, a[None])[0], atol=1e-4, rtol=1e-4)
  np.testing.assert_allclose(h[3, :5], h[4, :5], atol=1e-4, rtol=1e-4)
  np.testing.assert_allclose(h[3, 5:9], h[5, :4], atol=1e-4, rtol=1e-4)
  assert np.allclose(h[1, :6], h[2, 4:10], atol=1e-4) == (name in SHIFT_INVARIANT)


def test_a_bfloat16_encoder_computes_in_bfloat16_on_float32_parameters(rng):
  # Its precision, method by method against a float64 reference: tests/test_positions.py.
  _, model, params = build("tupe_r", dtype="bfloat16")
  out = jax.jit(lambda p, x: model.apply({"params": p}, x).last_hidden_state)(params, tokens(rng, 2, 10))
  assert out.dtype == jnp.bfloat16 and np.isfinite(np.asarray(out, np.float32)).all()
  assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}


@pytest.mark.parametrize("name", ["tupe_r", "huang_m3", "huang_m4", "rope"])
def test_jit_and_vmap(name, rng):
  _, model, params = build(name)
  ids = tokens(rng, 3, 2, 7)
  apply = lambda x: model.apply({"params": params}, x).last_hidden_state
  row = jax.jit(apply)
  eager = np.stack([row(x) for x in ids])
  np.testing.assert_allclose(jax.jit(jax.vmap(apply))(ids), eager, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("share", [True, False])
def test_tupe_positional_term_shared_or_per_layer(share):
  """With the content term switched off, each layer's logits are the positional term alone."""
  config, model, params = build("tupe_r", {"share_across_layers": share}, num_layers=3)
  for i in range(3):
    for name in ("query", "key"):
      params[f"layer_{i}"]["attention"][name] = jax.tree.map(jnp.zeros_like, params[f"layer_{i}"]["attention"][name])
  _, state = jax.jit(lambda p: model.apply({"params": p}, jnp.ones((1, 9), jnp.int32), mutable=["intermediates"]))(
      params)
  logits = [np.asarray(state["intermediates"][f"layer_{i}"]["attention"]["attention_logits"][0]) for i in range(3)]
  assert ("position_bias" in state["intermediates"]) == share
  if share:
    for layer_logits in logits:
      np.testing.assert_array_equal(layer_logits, np.asarray(state["intermediates"]["position_bias"][0]))
  else:
    assert not np.allclose(logits[0], logits[1]) and not np.allclose(logits[1], logits[2])


@pytest.mark.parametrize("name", ["tupe_a", "tupe_r", "bert_ad"])
def test_tupe_and_bert_ad_add_nothing_at_the_input(name):
  """The embedding output must not depend on positions: shuffling the positions of a one-layer encoder with
  its attention switched off (zero value/output projections) leaves it unchanged."""
  _, model, params = build(name, num_layers=1)
  for part in ("value", "out"):
    params["layer_0"]["attention"][part] = jax.tree.map(jnp.zeros_like, params["layer_0"]["attention"][part])
  ids = np.full((1, 6), 7, np.int32)
  in_order, shuffled = np.arange(6)[None], np.array([[0, 5, 3, 2, 4, 1]])  # one program per model: positions given
  np.testing.assert_allclose(hidden(model, params, ids, positions=in_order),
                             hidden(model, params, ids, positions=shuffled), atol=1e-6)
  _, absolute_model, absolute_params = build("absolute", num_layers=1)
  for part in ("value", "out"):
    absolute_params["layer_0"]["attention"][part] = jax.tree.map(
        jnp.zeros_like, absolute_params["layer_0"]["attention"][part])
  assert not np.allclose(hidden(absolute_model, absolute_params, ids, positions=in_order),
                         hidden(absolute_model, absolute_params, ids, positions=shuffled))


FUSABLE = [n for n in ALL if positions.make(n, num_heads=4, hidden_size=32, max_len=64).refusal("pallas") is None]


@pytest.mark.parametrize("name", FUSABLE)
def test_fused_kernel_path_matches_reference(name, rng, monkeypatch):
  """The cuDNN code path (bias folding, padding as sequence lengths) run through jax's XLA implementation."""
  monkeypatch.setattr(attention, "fused_attention", functools.partial(attention.fused_attention,
                                                                      implementation="xla"))
  monkeypatch.setattr(attention, "FUSED_DTYPES", (jnp.float32,))
  _, reference_model, params = build(name)
  fused_model = TransformerStack(TransformerConfig.tiny(position=name, attention_kernel="cudnn"))  # the same shapes
  ids = tokens(rng, 2, 9)
  mask = np.ones((2, 9), np.int32)
  mask[1, 7:] = 0
  kwargs = dict(attention_mask=mask, positions=np.array([[0, 1, 2, 3, 4, 0, 1, 2, 3]] * 2),
                segment_ids=np.array([[0] * 5 + [1] * 4] * 2))
  want = hidden(reference_model, params, ids, **kwargs)
  got = hidden(fused_model, params, ids, **kwargs)
  np.testing.assert_allclose(got[0], want[0], atol=1e-4, rtol=1e-4)
  np.testing.assert_allclose(got[1, :7], want[1, :7], atol=1e-4, rtol=1e-4)


def test_pre_layer_norm(rng):
  """With every residual branch's output projection zeroed, Pre-LN gives final_norm(embedding_norm(E[ids]))
  while Post-LN applies the layers' own norms."""
  ids = tokens(rng, 2, 8)
  outputs = {}
  for norm in ("pre", "post"):
    _, model, params = build("none", norm=norm, type_vocab_size=0)
    for i in range(2):
      layer = params[f"layer_{i}"]
      layer["attention"]["out"] = jax.tree.map(jnp.zeros_like, layer["attention"]["out"])
      layer["mlp_out"] = jax.tree.map(jnp.zeros_like, layer["mlp_out"])
    outputs[norm] = params, hidden(model, params, ids)
  params, h = outputs["pre"]
  layer_norm = lambda x, p: (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-12) * np.asarray(
      p["scale"]) + np.asarray(p["bias"])
  embedded = np.asarray(params["word_embeddings"]["embedding"])[ids]
  want = layer_norm(layer_norm(embedded, params["embedding_norm"]), params["final_norm"])
  np.testing.assert_allclose(h, want, atol=1e-4, rtol=1e-4)
  assert "final_norm" not in outputs["post"][0]
  assert not np.allclose(outputs["post"][1], want, atol=1e-2)


def test_heads(rng):
  config = TransformerConfig.tiny(position="tupe_r")
  ids = tokens(rng, 2, 10)
  mlm = Transformer(config, head="mlm")
  variables = randomize(jax.eval_shape(mlm.init, jax.random.PRNGKey(0), ids), scale=0.3)
  apply = jax.jit(mlm.apply)  # one program for the whole rows, one for the gathered positions (both sets)
  full = apply(variables, ids).logits
  assert full.shape == (2, 10, config.vocab_size)
  where = np.array([[1, 4], [0, 9]])
  np.testing.assert_allclose(apply(variables, ids, masked_positions=where).logits,
                             np.take_along_axis(np.asarray(full), where[..., None], axis=1), atol=1e-5)
  assert np.isnan(apply(variables, ids, masked_positions=np.array([[0, 10], [0, 1]])).logits[0, 1]).all()
  # The output layer is tied to the word embeddings: no separate [D, V] matrix.
  assert all(leaf.size != config.hidden_size * config.vocab_size or "word_embeddings" in jax.tree_util.keystr(p)
             for p, leaf in jax.tree_util.tree_leaves_with_path(variables["params"]))
  # the other heads' shapes: traced, not compiled
  cls = Transformer(config, head="classification", num_labels=3)
  assert jax.eval_shape(lambda: cls.apply(cls.init(jax.random.PRNGKey(0), ids), ids)).logits.shape == (2, 3)
  qa = Transformer(config, head="span")
  spans = jax.eval_shape(lambda: qa.apply(qa.init(jax.random.PRNGKey(0), ids), ids))
  assert spans.start_logits.shape == spans.end_logits.shape == (2, 10)


def test_presets_and_logical_axes():
  assert TransformerConfig.base().hidden_size == 768 and TransformerConfig.base().num_layers == 12
  large = TransformerConfig.large(position="tupe_r")
  assert (large.hidden_size, large.num_layers, large.num_heads, large.intermediate_size) == (1024, 24, 16, 4096)
  config = TransformerConfig.tiny(position="tupe_r")
  shapes = jax.eval_shape(Transformer(config, head="mlm").init, jax.random.PRNGKey(0), jnp.ones((1, 8), jnp.int32))
  boxed = jax.tree.leaves(shapes["params"], is_leaf=lambda x: hasattr(x, "names"))
  assert boxed and all(hasattr(x, "names") and len(x.names) == len(x.value.shape) for x in boxed)
  parameters = sum(x.value.size for x in jax.eval_shape(
      TransformerStack(TransformerConfig.bert()).init, jax.random.PRNGKey(0),
      jnp.ones((1, 8), jnp.int32))["params"].values()
                   for x in jax.tree.leaves(x, is_leaf=lambda y: hasattr(y, "names")))
  assert 108_000_000 < parameters < 111_000_000  # BERT-Base encoder without heads


BAD_CONFIGS = [
    (dict(position="bogus"), "unknown position method 'bogus'; allowed: none, absolute"),
    (dict(attention_kernel="flash"), "unknown attention kernel 'flash'"),
    (dict(num_heads=5), "num_heads=5 must be positive and divide hidden_size=32"),
    (dict(position="tupe_a", position_options={"relative_distance": "clip"}),
     "'tupe_a' has no option(s) ['relative_distance']"),
    (dict(position="tupe_r", position_options={"cls_reset": "first"}), "cls_reset='first' is not allowed"),
    (dict(position="huang_m1", attention_kernel="cudnn"), "'cudnn' cannot compute position method 'huang_m1'"),
    (dict(position="shaw", position_options={"value_term": True}, attention_kernel="cudnn"),
     "'cudnn' cannot compute position method 'shaw'"),
    (dict(position="shaw", position_options={"max_distance": 0}), "max_distance=0 must be >= 1"),
    (dict(norm="sandwich"), "norm='sandwich' is not allowed"),
    (dict(causal=True, layer_windows="4,x"), "layer_windows='4,x': expected ','-separated ints >= 0"),
    (dict(attention_softcap=30.0, attention_kernel="cudnn"), "attention_softcap=30.0: attention kernel 'cudnn' "
                                                             "cannot run it (cuDNN adds a bias; an open term may"),
]


@pytest.mark.parametrize("overrides,message", BAD_CONFIGS, ids=[m for _, m in BAD_CONFIGS])
def test_bad_configs_say_what_is_wrong(overrides, message):
  with pytest.raises(ValueError) as error:
    TransformerConfig.tiny(**overrides)
  assert message in str(error.value)


@pytest.mark.parametrize("name", ["absolute", "bert_r", "bert_ad", "tupe_a", "tupe_r"])
def test_sequence_longer_than_a_learned_table_is_an_error(name):
  model = TransformerStack(TransformerConfig.tiny(position=name, max_len=8))
  with pytest.raises(ValueError, match=f"{name!r} has a learned table of max_len=8 positions and cannot encode a "
                                       "sequence of length 9"):
    model.init(jax.random.PRNGKey(0), jnp.ones((1, 9), jnp.int32))


@pytest.mark.parametrize("name", ["shaw", "huang_m4", "t5", "rope", "alibi", "sinusoidal"])
def test_methods_without_a_learned_table_take_longer_sequences(name):
  model = TransformerStack(TransformerConfig.tiny(position=name, max_len=8))
  variables = randomize(jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.ones((1, 8), jnp.int32)), scale=0.3)
  assert np.isfinite(jax.jit(model.apply)(variables, jnp.ones((1, 20), jnp.int32)).last_hidden_state).all()


def test_kernel_choice():
  spec = positions.make("t5", num_heads=4, hidden_size=32, max_len=8)
  assert attention.resolve_kernel("auto", spec, dtype=jnp.bfloat16, dropout=False) == "xla"  # CPU: falls back
  with pytest.raises(ValueError, match="dropout on attention weights"):
    attention.resolve_kernel("cudnn", spec, dtype=jnp.bfloat16, dropout=True)
  with pytest.raises(ValueError, match="compute dtype float32 is not bfloat16/float16"):
    attention.resolve_kernel("cudnn", spec, dtype=jnp.float32, dropout=False)
  assert attention.resolve_kernel("cudnn", spec, dtype=jnp.bfloat16, dropout=False) == "cudnn"


def test_fully_padded_row_gives_finite_output_and_gradients(rng):
  config = TransformerConfig.tiny(position="huang_m4")
  model = Transformer(config, head="mlm")
  ids, mask = tokens(rng, 2, 6), np.array([[1] * 6, [0] * 6])
  params = randomize(jax.eval_shape(model.init, jax.random.PRNGKey(0), ids)["params"], scale=0.3)
  grads = jax.jit(jax.grad(lambda p: jnp.sum(model.apply({"params": p}, ids, attention_mask=mask).logits)))(params)
  assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


def test_the_names_before_0_2_are_deprecated_aliases():
  import posjax.models as models
  from posjax.models import bert

  for old, new in models.DEPRECATED.items():
    with pytest.warns(DeprecationWarning, match=f"posjax.models.{old} is deprecated: use posjax.models.{new}"):
      assert getattr(models, old) is getattr(models, new)
    with pytest.warns(DeprecationWarning):
      assert getattr(bert, old) is getattr(models, new)
  with pytest.warns(DeprecationWarning, match="mlm_head is posjax.models.heads.mlm_head"):
    assert bert.mlm_head is models.heads.mlm_head
  assert TransformerConfig.decoder.__func__ is TransformerConfig.llama.__func__
  assert TransformerConfig.base() == TransformerConfig.bert()
