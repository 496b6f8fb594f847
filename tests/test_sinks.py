"""Attention sinks (GPT-OSS's learned logit per head in each row's softmax denominator): the op on ``xla`` and on both
Pallas interpreters against a float64 loop, in outputs and in every gradient (q, k, v and the sinks: a directional
derivative of the loop by central differences), over packed, padded, windowed GQA rows; a decoder with sinks generates
what its full forward computes, on the dense path and on the decode kernels; cuDNN refuses them in one line."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posjax import generate, kernels
from posjax.models import Transformer, TransformerConfig
from conftest import randomize

B, L, H, G, K, WINDOW = 2, 21, 4, 2, 8, 6
SEGMENTS = np.array([[0] * 12 + [1] * 9, [0] * 21])
POSITIONS = np.array([list(range(12)) + list(range(9)), list(range(21))])
LENGTHS = np.array([21, 15])


def loop(q, k, v, sink, weights):
  """The loss ``Σ out · weights`` over real query rows, float64, one pair at a time."""
  total = 0.0
  for b in range(B):
    for i in range(LENGTHS[b]):
      for h in range(H):
        g = h // (H // G)
        keys = [j for j in range(LENGTHS[b]) if SEGMENTS[b, j] == SEGMENTS[b, i] and j <= i and i - j < WINDOW]
        logits = np.array([q[b, i, h] @ k[b, j, g] / np.sqrt(K) for j in keys])
        top = max(logits.max(), sink[h])
        e = np.exp(logits - top)
        w = e / (e.sum() + np.exp(sink[h] - top))
        total += float(np.sum(sum(w_j * v[b, j, g] for w_j, j in zip(w, keys)) * weights[b, i, h]))
  return total


@pytest.mark.parametrize("implementation,interpret", [("xla", None), ("pallas", True), ("pallas", "tpu")])
def test_sinked_attention_matches_a_float64_loop_in_outputs_and_every_gradient(implementation, interpret):
  rng = np.random.default_rng(0)
  q, k, v = rng.normal(size=(B, L, H, K)), rng.normal(size=(B, L, G, K)), rng.normal(size=(B, L, G, K))
  sink, weights = rng.normal(size=H) + 1.0, rng.normal(size=(B, L, H, K))
  real = (np.arange(L)[None] < LENGTHS[:, None])[..., None, None]

  def loss(q, k, v, sink):
    out = kernels.relative_attention(q, k, v, terms=kernels.Terms(sink=kernels.Sink(sink)), positions=POSITIONS,
                                     segment_ids=SEGMENTS, lengths=LENGTHS, causal=True, sliding_window=WINDOW,
                                     implementation=implementation, block_sizes=(8, 8), interpret=interpret)
    return jnp.sum(jnp.where(real, out * weights, 0.0))

  f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v, sink)]
  value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(*f32)
  want = loop(q, k, v, sink, weights)
  assert abs(float(value) - want) <= 1e-5 * abs(want) + 1e-4
  direction = [rng.normal(size=x.shape) for x in (q, k, v, sink)]
  step = 1e-5
  shifted = lambda sign: loop(*(x + sign * step * d for x, d in zip((q, k, v, sink), direction)), weights)
  numeric = (shifted(1) - shifted(-1)) / (2 * step)
  analytic = sum(float(np.sum(np.asarray(g, np.float64) * d)) for g, d in zip(grads, direction))
  assert abs(analytic - numeric) <= 1e-4 * max(float(np.abs(np.asarray(g)).max()) for g in grads) * 10
  # the sinks' own gradient, head by head (the directional check mixes it with q, k and v's)
  for h in range(H):
    d = np.zeros(H)
    d[h] = step
    numeric_h = (loop(q, k, v, sink + d, weights) - loop(q, k, v, sink - d, weights)) / (2 * step)
    assert abs(float(grads[3][h]) - numeric_h) <= 1e-4 * max(1.0, abs(numeric_h)), (h, float(grads[3][h]), numeric_h)


@pytest.mark.parametrize("kernel", ["xla", "pallas"])
def test_a_decoder_with_sinks_generates_its_full_forward(kernel):
  config = TransformerConfig.llama(vocab_size=61, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                   intermediate_size=48, max_len=64, attention_sinks=True, layer_windows="6,0",
                                   attention_kernel=kernel)
  module = Transformer(config, head="lm")
  params = randomize(module.init(jax.random.key(1), jnp.zeros((1, 8), jnp.int32))["params"], scale=0.5)
  assert params["encoder"]["layer_0"]["attention"]["sinks"].shape == (4,)
  prompt = np.random.default_rng(0).integers(0, 61, (2, 5))
  tokens, cached = (np.asarray(t) for t in generate.generate(module, {"params": params}, prompt, max_new_tokens=9,
                                                              return_logits=True))
  full = np.asarray(jax.jit(Transformer(TransformerConfig.llama(**{**config.to_dict(), "attention_kernel": "xla"}),
                                        head="lm").apply)({"params": params}, jnp.asarray(tokens)).logits)
  np.testing.assert_array_equal(tokens[:, 5:], np.argmax(full[:, 4:-1], axis=-1))
  np.testing.assert_allclose(cached, full[:, 4:-1], atol=2e-5 * np.abs(full).max(), rtol=0)


def test_a_cudnn_layer_refuses_sinks_in_one_line():
  from posjax import attention, positions

  spec = positions.make("rope", num_heads=4, hidden_size=32, max_len=64, causal=True, dtype=jnp.bfloat16)
  x = jnp.zeros((1, 8, 32), jnp.bfloat16)
  state = spec.method.encoder(spec=spec).apply({}, jnp.arange(8)[None])
  with pytest.raises(ValueError, match=r"attention kernel 'cudnn' cannot run this layer: cuDNN's softmax has no sink"):
    attention.SelfAttention(spec, "cudnn", sinks=True).init(jax.random.key(0), x, state, attention.Mask(causal=True))


@pytest.mark.parametrize("layer", [0, 1])  # GPT-OSS's sliding layer (window 5 here), then its full one
def test_gpt_oss_attention_equals_hugging_faces_module(layer):
  """Hugging Face's ``GptOssAttention`` on random weights (q/k/v/o biases, GQA, YaRN RoPE, sinks, a window on its
  sliding layers) and posjax's layer with those weights: the same outputs (its mixture-of-experts blocks are not
  attention and are out of this comparison)."""
  transformers = pytest.importorskip("transformers")
  torch = pytest.importorskip("torch")
  from transformers.models.gpt_oss import modeling_gpt_oss as hf_gpt_oss

  from posjax import attention, positions

  config = transformers.GptOssConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                     num_hidden_layers=2, sliding_window=5, vocab_size=61, intermediate_size=32,
                                     num_local_experts=2, num_experts_per_tok=1, attn_implementation="eager")
  torch.manual_seed(0)
  module = hf_gpt_oss.GptOssAttention(config, layer).eval()
  with torch.no_grad():
    for parameter in module.parameters():
      parameter.copy_(0.3 * torch.randn_like(parameter))
  x = np.random.default_rng(0).normal(size=(2, 12, 32)).astype(np.float32)
  position_ids = torch.arange(12)[None].expand(2, -1)
  cos, sin = hf_gpt_oss.GptOssRotaryEmbedding(config)(torch.from_numpy(x), position_ids)
  i, j = np.arange(12)[:, None], np.arange(12)[None, :]
  allowed = (j <= i) & ((i - j < 5) if layer == 0 else True)
  mask = torch.from_numpy(np.where(allowed, 0.0, np.finfo(np.float32).min).astype(np.float32))[None, None]
  with torch.no_grad():
    want = module(torch.from_numpy(x), (cos, sin), mask.expand(2, 1, 12, 12))[0].numpy()

  scaling = {k: v for k, v in config.rope_scaling.items() if k != "rope_type"}
  scaling["original_max_len"] = scaling.pop("original_max_position_embeddings")
  spec = positions.make("rope", {"max_timescale": config.rope_theta, "scaling": "yarn", **scaling}, num_heads=4,
                        hidden_size=32, max_len=config.max_position_embeddings, causal=True, num_kv_heads=2,
                        head_dim=16)
  ours = attention.SelfAttention(spec, "xla", use_bias=True, out_bias=True, sinks=True)
  w = {name: p.detach().numpy() for name, p in module.named_parameters()}
  params = {"query": {"kernel": w["q_proj.weight"].T.reshape(32, 4, 16), "bias": w["q_proj.bias"].reshape(4, 16)},
            "key": {"kernel": w["k_proj.weight"].T.reshape(32, 2, 16), "bias": w["k_proj.bias"].reshape(2, 16)},
            "value": {"kernel": w["v_proj.weight"].T.reshape(32, 2, 16), "bias": w["v_proj.bias"].reshape(2, 16)},
            "out": {"kernel": w["o_proj.weight"].T.reshape(4, 16, 32), "bias": w["o_proj.bias"]},
            "sinks": w["sinks"]}
  state = spec.method.encoder(spec=spec).apply({}, jnp.arange(12)[None])
  got = ours.apply({"params": params}, jnp.asarray(x), state,
                   attention.Mask(causal=True, sliding_window=5 if layer == 0 else 0))
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-5 * np.abs(want).max(), rtol=0)


@pytest.mark.parametrize("fields,message", [
    (dict(attention_kernel="cudnn", dtype="bfloat16"), r"attention_sinks=True: attention kernel 'cudnn' cannot run "
                                                       r"them \(cuDNN's softmax has no sink"),
    (dict(position="stick_breaking"), r"stick-breaking's weights are not a softmax"),
])
def test_sinks_where_they_cannot_be_are_config_errors(fields, message):
  with pytest.raises(ValueError, match=message):
    TransformerConfig.llama(vocab_size=61, hidden_size=32, num_layers=1, num_heads=4, intermediate_size=48,
                            max_len=64, attention_sinks=True, **fields)

