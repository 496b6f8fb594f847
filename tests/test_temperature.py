"""Query temperature (Llama 4's, Ministral's, SSMax): each query row's logits are the plain layer's times the factor
a float64 loop computes from the query's position (packed and left-padded rows, grouped k/v); the Pallas kernels
give the xla path's outputs and gradients, the SSMax scale's included (against central differences in float64); a
decoder mixing temperature and plain layers generates what its full forward computes; bad options are one line."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posjax import attention, positions
from posjax.models import Transformer, TransformerConfig
from posjax.positions import temperature as temperature_lib
from conftest import randomize

TEMPERATURES = {"llama4": dict(kind="llama4", floor_scale=3.0, attn_scale=0.7),
                "ministral": dict(kind="ministral", beta=0.4, original_max_len=2),
                "ssmax": dict(kind="ssmax", init=0.6)}


def factor(kind, options, p, s_h=None, window=0):
  """The factor of a query at position ``p`` (float64, one number at a time)."""
  if kind == "llama4":
    return 1.0 + options["attn_scale"] * math.log(1.0 + math.floor((p + 1) / options["floor_scale"]))
  if kind == "ministral":
    return 1.0 + options["beta"] * math.log(1.0 + math.floor(p / options["original_max_len"]))
  return s_h * math.log(min(p + 1, window) if window else p + 1)


def layer(temperature, kernel="xla", dtype=jnp.float32):
  spec = positions.make("none", num_heads=4, hidden_size=32, max_len=64, causal=True, num_kv_heads=2, dtype=dtype,
                        param_dtype=dtype)
  return attention.SelfAttention(spec, kernel, use_bias=False,
                                 temperature=temperature_lib.Temperature.parse(temperature))


def batch():
  """Row 0: two packed documents (positions restart); row 1: left padding, then one document."""
  positions_ = np.array([[0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4], [0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8]], np.int32)
  segments = np.array([[0] * 7 + [1] * 5, [0] * 12], np.int32)
  padding = np.array([[True] * 12, [False] * 3 + [True] * 9])
  x = np.random.default_rng(0).normal(size=(2, 12, 32)).astype(np.float32)
  return x, positions_, segments, padding


@pytest.mark.parametrize("kind", TEMPERATURES)
def test_each_query_rows_logits_are_the_plain_layers_times_its_factor(kind):
  x, positions_, segments, padding = batch()
  mask = attention.Mask(jnp.asarray(padding), jnp.asarray(segments), causal=True, sliding_window=5)
  state = positions.get("none").encoder(spec=layer({}).spec).apply({}, jnp.asarray(positions_))
  warm = layer(TEMPERATURES[kind])
  params = randomize(warm.init(jax.random.key(0), x, state, mask)["params"], scale=0.5)
  logits = lambda module, p: module.apply({"params": p}, x, state, mask, mutable=["intermediates"])[1][
      "intermediates"]["attention_logits"][0]
  plain = np.asarray(logits(layer({}), {k: v for k, v in params.items() if k != "temperature"}), np.float64)
  scaled = np.asarray(logits(warm, params), np.float64)
  s = np.asarray(params["temperature"]["ssmax_scale"], np.float64) if kind == "ssmax" else [None] * 4
  want = np.array([[[[factor(kind, TEMPERATURES[kind], positions_[b, i], s[h], window=5)] for i in range(12)]
                    for h in range(4)] for b in range(2)]) * plain
  np.testing.assert_allclose(scaled, want, atol=1e-5 * np.abs(want).max(), rtol=0)


@pytest.mark.parametrize("kind,interpret", [("ssmax", True), ("llama4", "tpu")])
def test_the_pallas_kernels_give_the_xla_outputs_and_gradients(kind, interpret, monkeypatch):
  x, positions_, segments, padding = batch()
  mask = attention.Mask(jnp.asarray(padding), jnp.asarray(segments), causal=True)
  state = positions.get("none").encoder(spec=layer({}).spec).apply({}, jnp.asarray(positions_))
  params = randomize(layer(TEMPERATURES[kind]).init(jax.random.key(0), x, state, mask)["params"], scale=0.5)
  weights = np.random.default_rng(1).normal(size=(2, 12, 32)).astype(np.float32)
  real = padding[..., None]

  def loss(kernel, p, x, dtype=jnp.float32):
    out = layer(TEMPERATURES[kind], kernel, dtype).apply({"params": p}, x, state, mask)
    return jnp.sum(jnp.where(real, out, 0.0) * weights)

  from posjax import kernels
  monkeypatch.setattr(kernels, "relative_attention", _with_interpret(kernels.relative_attention, interpret))
  want = jax.grad(lambda p, x: loss("xla", p, x), argnums=(0, 1))(params, x)
  got = jax.grad(lambda p, x: loss("pallas", p, x), argnums=(0, 1))(params, x)
  for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    np.testing.assert_allclose(g, w, atol=2e-4 * np.abs(w).max(), rtol=0)
  if kind == "ssmax":  # its scale's gradient against central differences, in float64
    with jax.enable_x64():
      p64 = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
      f64 = jax.jit(lambda p: loss("xla", p, x.astype(np.float64), jnp.float64))
      base = np.asarray(jax.grad(f64)(p64)["temperature"]["ssmax_scale"])
      for h in range(4):
        step = np.zeros(4)
        step[h] = 1e-3  # the layer accumulates its logits in float32: a step well above their rounding
        shift = lambda d: jax.tree_util.tree_map_with_path(
            lambda path, a: a + d if "ssmax_scale" in jax.tree_util.keystr(path) else a, p64)
        numeric = (f64(shift(step)) - f64(shift(-step))) / 2e-3
        assert abs(float(numeric) - base[h]) <= 1e-3 * np.abs(base).max(), (h, float(numeric), base[h])
      assert np.abs(base).max() > 1e-2


def _with_interpret(op, interpret):
  return lambda *args, **kwargs: op(*args, **{**kwargs, "interpret": interpret})


def test_a_decoder_mixing_temperature_and_plain_layers_generates_its_full_forward():
  """Llama 4's layout: RoPE layers, and every other layer NoPE with its temperature, GQA, a window."""
  from posjax import generate

  config = TransformerConfig.llama(vocab_size=61, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2,
                                   intermediate_size=48, max_len=64, position_schedule="rope,none",
                                   query_temperature=TEMPERATURES["llama4"], temperature_layers="0,1",
                                   layer_windows="6,0")
  module = Transformer(config, head="lm")
  variables = randomize(module.init(jax.random.key(1), jnp.zeros((1, 8), jnp.int32))["params"], scale=0.3)
  prompt = np.random.default_rng(0).integers(0, 61, (2, 5))
  tokens, cached = (np.asarray(t) for t in generate.generate(module, {"params": variables}, prompt, max_new_tokens=9,
                                                              return_logits=True))
  full = np.asarray(jax.jit(module.apply)({"params": variables}, jnp.asarray(tokens)).logits)
  np.testing.assert_array_equal(tokens[:, 5:], np.argmax(full[:, 4:-1], axis=-1))
  np.testing.assert_allclose(cached, full[:, 4:-1], atol=2e-5 * np.abs(full).max(), rtol=0)
  assert "temperature" not in variables["encoder"]["layer_0"]["attention"]  # llama4's factor has no parameter


@pytest.mark.parametrize("fields,message", [
    (dict(query_temperature={"kind": "cosine"}), r"option query_temperature kind='cosine' is not allowed"),
    (dict(query_temperature={"floor_scale": 2.0}), r"needs 'kind'"),
    (dict(query_temperature={"kind": "llama4", "scale": 2.0}), r"unknown \['scale'\]"),
    (dict(temperature_layers="0,1"), r"temperature_layers='0,1' without a query_temperature"),
    (dict(query_temperature={"kind": "llama4"}, temperature_layers="0,2"), r"expected ','-separated 0 / 1"),
    (dict(query_temperature={"kind": "ssmax"}, causal=False), "a causal model only"),
])
def test_bad_temperatures_are_one_line_errors(fields, message):
  with pytest.raises(ValueError, match=message):
    TransformerConfig.llama(vocab_size=61, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=48,
                            max_len=64, **fields)


@pytest.mark.parametrize("layer", [0, 3])  # a chunked RoPE layer, then a NoPE layer with its temperature
def test_llama_4_attention_equals_hugging_faces_module(layer):
  """Hugging Face's ``Llama4TextAttention`` on random weights and posjax's layer with them: interleaved RoPE with
  Llama 3's scaling and the L2 q/k norm in its RoPE layers (posjax's q/k RMSNorm without a scale,
  ``qk_norm_scale=False``; before the rotation, which it commutes with), chunked attention there, and in its NoPE
  layers the query
  temperature (its mixture-of-experts blocks are not attention and out of this comparison)."""
  transformers = pytest.importorskip("transformers")
  torch = pytest.importorskip("torch")
  from transformers.models.llama4 import modeling_llama4 as hf_llama4

  from posjax import attention, positions as positions_lib

  rope = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=16)
  config = transformers.Llama4TextConfig(
      hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_hidden_layers=4,
      intermediate_size=32, intermediate_size_mlp=32, vocab_size=61, rope_theta=500_000.0, rope_scaling=rope,
      attention_chunk_size=4, attn_temperature_tuning=True, floor_scale=4, attn_scale=0.5, use_qk_norm=True,
      rms_norm_eps=1e-5, no_rope_layer_interval=4, attn_implementation="eager")
  torch.manual_seed(0)
  module = hf_llama4.Llama4TextAttention(config, layer).eval()
  with torch.no_grad():
    for parameter in module.parameters():
      parameter.copy_(0.3 * torch.randn_like(parameter))
  x = np.random.default_rng(0).normal(size=(2, 12, 32)).astype(np.float32)
  freqs = hf_llama4.Llama4TextRotaryEmbedding(config)(torch.from_numpy(x), torch.arange(12)[None].expand(2, -1))
  i, j = np.arange(12)[:, None], np.arange(12)[None, :]
  allowed = (j <= i) & ((i // 4 == j // 4) if layer == 0 else True)
  mask = torch.from_numpy(np.where(allowed, 0.0, np.finfo(np.float32).min).astype(np.float32))[None, None]
  with torch.no_grad():
    want = module(torch.from_numpy(x), freqs, mask.expand(2, 1, 12, 12), cache_position=torch.arange(12))[0].numpy()

  if layer == 0:
    options = {"max_timescale": config.rope_theta, "scaling": "llama3", "layout": "interleaved",
               **{k: v for k, v in rope.items() if k not in ("rope_type", "original_max_position_embeddings")},
               "original_max_len": 16}
    spec = positions_lib.make("rope", options, num_heads=4, hidden_size=32, max_len=64, causal=True, num_kv_heads=2,
                              head_dim=8)
    ours = attention.SelfAttention(spec, "xla", use_bias=False, qk_norm=True, qk_norm_scale=False, norm_eps=1e-5)
  else:
    spec = positions_lib.make("none", num_heads=4, hidden_size=32, max_len=64, causal=True, num_kv_heads=2, head_dim=8)
    ours = attention.SelfAttention(spec, "xla", use_bias=False, temperature=temperature_lib.Temperature(
        "llama4", floor_scale=4.0, attn_scale=0.5))
  w = {name: p.detach().numpy() for name, p in module.named_parameters()}
  params = {"query": {"kernel": w["q_proj.weight"].T.reshape(32, 4, 8)},
            "key": {"kernel": w["k_proj.weight"].T.reshape(32, 2, 8)},
            "value": {"kernel": w["v_proj.weight"].T.reshape(32, 2, 8)},
            "out": {"kernel": w["o_proj.weight"].T.reshape(4, 8, 32)}}
  state = spec.method.encoder(spec=spec).apply({}, jnp.arange(12)[None])
  got = ours.apply({"params": params}, jnp.asarray(x), state,
                   attention.Mask(causal=True, chunk=4 if layer == 0 else 0))
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-5 * np.abs(want).max(), rtol=0)
