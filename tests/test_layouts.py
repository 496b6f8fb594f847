"""Hybrid layouts as data: the named layouts give the layer types of the families that define them (Hugging Face's
own configs), layers of several kinds scan as groups of their repeating pattern with the per-layer model's logits and
gradients (parameters converted both ways), generate their full forward from ring caches inside the scan, and bad
layouts are one-line errors."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posjax import generate
from posjax.models import Transformer, TransformerConfig, hybrid, layout
from posjax.train import step as step_lib

SMALL = dict(vocab_size=61, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=48, max_len=64)


def test_named_layouts_give_the_layer_types_of_hugging_faces_configs():
  transformers = pytest.importorskip("transformers")
  hf = transformers.Llama4TextConfig(num_hidden_layers=8, attention_chunk_size=16)
  irope = TransformerConfig.llama(**SMALL, num_layers=8, layout="irope", layout_options={"chunk": 16})
  for kind, chunked, rope in zip(irope.layer_kinds, hf.layer_types, hf.no_rope_layers):
    assert kind.chunk == (16 if chunked == "chunked_attention" else 0)
    assert kind.position == ("rope" if rope else "none")
    # HF's attention applies the temperature on its NoPE layers (attn_temperature_tuning)
    assert (kind.temperature is not None) == (not rope)
    if kind.temperature is not None:
      assert (kind.temperature.floor_scale, kind.temperature.attn_scale) == (hf.floor_scale, hf.attn_scale)
  hf = transformers.Gemma3TextConfig(num_hidden_layers=12, sliding_window=32)
  gemma3 = TransformerConfig.llama(**SMALL, num_layers=12, layout="gemma3", layout_options={"window": 32})
  for kind, kind_hf in zip(gemma3.layer_kinds, hf.layer_types):
    local = kind_hf == "sliding_attention"
    assert (kind.window, kind.position) == ((32, "rope@local") if local else (0, "rope"))
  assert gemma3.method_specs["rope@local"].options.max_timescale == hf.rope_local_base_freq
  hf = transformers.GptOssConfig(num_hidden_layers=4)
  gpt_oss = TransformerConfig.llama(**SMALL, num_layers=4, layout="gpt_oss")
  assert [k.window for k in gpt_oss.layer_kinds] == [hf.sliding_window if t == "sliding_attention" else 0
                                                     for t in hf.layer_types]
  assert gpt_oss.attention_sinks
  swan = TransformerConfig.llama(**SMALL, num_layers=4, layout="swan", position="alibi")
  assert [(k.position, k.window) for k in swan.layer_kinds] == [("none", 0)] + [("alibi", 512)] * 3
  assert TransformerConfig(**swan.to_dict()) == swan  # a run's recorded config builds the same model
  for name in hybrid.names():
    assert len(TransformerConfig.llama(**SMALL, num_layers=6, layout=name).layer_kinds) == 6
  # every option reaches a run's model_config.json as plain JSON
  swan = TransformerConfig.llama(**SMALL, num_layers=4, layout="swan", layout_options={
      "temperature": {"kind": "ministral", "beta": 0.1, "original_max_len": 16}})
  assert json.loads(json.dumps(swan.to_dict()))["layout_options"]["temperature"]["beta"] == 0.1
  assert [k.temperature is not None for k in swan.layer_kinds] == [True, False, False, False]
  # gemma3 over a method without a RoPE base, or with local_base=0: the local layers take the method's own options
  alibi = TransformerConfig.llama(**SMALL, num_layers=2, position="alibi", layout="gemma3", layout_options={"every": 2})
  assert [k.position for k in alibi.layer_kinds] == ["alibi@local", "alibi"]
  yarn = {"max_timescale": 5e5, "scaling": "yarn", "factor": 2.0, "original_max_len": 32}
  own = TransformerConfig.llama(**SMALL, num_layers=2, position_options=yarn, layout="gemma3",
                                layout_options={"every": 2, "local_base": 0})
  assert own.method_specs["rope@local"].options == own.position_spec.options
  # a pattern that does not repeat a whole number of times is scanned as the whole depth
  assert len(TransformerConfig.llama(**SMALL, num_layers=3, layer_windows="4,0", scan_layers=True).pattern) == 3


def hybrid_model(**fields):
  """Six layers of a three-kind pattern: windowed RoPE, global NoPE with a temperature, chunked RoPE; sinks."""
  config = TransformerConfig.llama(**{**SMALL, **dict(
      num_layers=6, position_schedule="rope,none,rope", layer_windows="5,0,0", layer_chunks="0,0,4",
      query_temperature={"kind": "llama4", "floor_scale": 3.0, "attn_scale": 0.7}, temperature_layers="0,1,0",
      attention_sinks=True), **fields})
  return Transformer(config, head="lm")


def test_a_scanned_hybrid_pattern_computes_the_per_layer_model_and_generates_its_full_forward():
  per_layer, scanned = hybrid_model(), hybrid_model(scan_layers=True)
  assert len(scanned.config.pattern) == 3
  ids = jnp.asarray(np.random.default_rng(0).integers(0, 61, (2, 11)))
  params = nn.unbox(per_layer.init(jax.random.key(1), ids)["params"])
  leaves, tree = jax.tree.flatten(params)
  params = tree.unflatten([x + 0.3 * jax.random.normal(jax.random.key(i), x.shape) for i, x in enumerate(leaves)])
  grouped = layout.stack(params, 3)
  shapes = nn.unbox(jax.eval_shape(scanned.init, jax.random.key(1), ids)["params"])
  assert jax.tree.map(np.shape, grouped) == jax.tree.map(np.shape, shapes)
  assert layout.period(grouped) == 3 and jax.tree.map(np.shape, layout.unstack(grouped)) == jax.tree.map(
      np.shape, params)
  assert jax.tree.all(jax.tree.map(np.array_equal, layout.unstack(grouped), params))

  def loss(model, p):
    logits = model.apply({"params": p}, ids).logits
    return jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(jnp.roll(ids, -1, 1), 61)), logits

  (_, want), want_grads = jax.value_and_grad(lambda p: loss(per_layer, p), has_aux=True)(params)
  (_, got), got_grads = jax.value_and_grad(lambda p: loss(scanned, p), has_aux=True)(grouped)
  np.testing.assert_allclose(got, want, atol=2e-5 * np.abs(want).max(), rtol=0)
  largest = max(float(np.abs(g).max()) for g in jax.tree.leaves(want_grads))
  for path, got_g, want_g in zip(jax.tree_util.tree_flatten_with_path(want_grads)[0],
                                 jax.tree.leaves(layout.unstack(got_grads)), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(got_g, want_g, atol=1e-4 * largest, rtol=0, err_msg=jax.tree_util.keystr(path[0]))
  # layer-wise learning-rate decay reads layer i of kind_{i mod 3}
  scales = layout.unstack(step_lib.layer_scales(grouped, 0.5))
  assert float(np.ravel(scales["encoder"]["layer_4"]["mlp_in"]["kernel"])[0]) == 0.5 ** (6 - 4)

  prompt = np.asarray(ids[:, :5])
  tokens, cached = (np.asarray(t) for t in generate.generate(scanned, {"params": grouped}, prompt, max_new_tokens=8,
                                                              return_logits=True))
  full = np.asarray(per_layer.apply({"params": params}, jnp.asarray(tokens)).logits)
  np.testing.assert_array_equal(tokens[:, 5:], np.argmax(full[:, 4:-1], axis=-1))
  np.testing.assert_allclose(cached, full[:, 4:-1], atol=2e-5 * np.abs(full).max(), rtol=0)
  cache = jax.eval_shape(lambda: scanned.init(jax.random.key(0), jnp.zeros((2, 13), jnp.int32), decode=True))
  slots = [cache["cache"]["encoder"]["layers"][f"kind_{j}"]["attention"]["cached_key"].shape[-2] for j in range(3)]
  assert slots == [5, 13, 4]  # rings of the window and of the chunk; the global layer's whole context


@pytest.mark.parametrize("fields,message", [
    (dict(layout="hybrid"), r"unknown layout 'hybrid'; allowed: \['full', 'irope'"),
    (dict(layout="irope", layout_options={"size": 4}), r"layout 'irope' has no option \['size'\]"),
    (dict(layout="gemma3", layout_options={"window": 0}), r"window=0 must be an int >= 1"),
    (dict(layout="irope", layer_chunks="16"), r"layout='irope' sets layer_chunks='8192,8192,8192,0', and "
                                              r"layer_chunks='16' was given"),
    (dict(layout_options={"chunk": 4}), r"layout_options=\{'chunk': 4\} without a layout"),
    (dict(layout="swan", layout_options={"temperature": True}), r"temperature=True must be a query_temperature dict"),
    (dict(layout="gpt_oss", layout_options={"sinks": "false"}), r"sinks='false' must be True or False"),
    (dict(layout="gemma3", layout_options={"local_base": -5.0, "every": 2}), r"local_base=-5.0 must be a number >= 0"),
    (dict(layout="gemma3", layout_options={"local_base": 1e4, "every": 2}, position="alibi"),
     r"sets a RoPE base, and position 'alibi' has none \(max_timescale\); set local_base=0"),
    (dict(layout="gemma3"), r"groups every=6 layers \(one global\), more than num_layers=4"),
    (dict(layer_windows="4,0", sliding_window=3), r"layer_windows='4,0' and sliding_window=3: give each layer's"),
])
def test_bad_layouts_are_one_line_errors(fields, message):
  with pytest.raises(ValueError, match=message):
    TransformerConfig.llama(**{**SMALL, "num_layers": 4, **fields})
