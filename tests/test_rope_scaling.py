"""RoPE's context-extension scalings against Hugging Face's own frequency functions
(``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS``) and the rotation a model applies with them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posjax import positions
from posjax.positions import rotary

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

HEAD_DIM, HEADS, MAX_LEN = 64, 4, 2048

CASES = [
    ("linear", dict(factor=4.0), {}),
    ("dynamic", dict(factor=2.0), {}),
    ("yarn", dict(factor=8.0), {}),
    ("yarn", dict(factor=4.0, original_max_len=512, beta_fast=16.0, beta_slow=2.0, mscale=0.707, mscale_all_dim=0.5,
                  truncate=False), {}),
    ("yarn", dict(factor=4.0, attention_factor=1.5, max_timescale=500_000.0), {}),
    ("llama3", dict(factor=8.0, original_max_len=1024, max_timescale=500_000.0), {}),
    ("llama3", dict(factor=4.0, original_max_len=512, low_freq_factor=2.0, high_freq_factor=8.0), {}),
]
HF_KEYS = dict(original_max_len="original_max_position_embeddings")


def hugging_face(scaling, options, seq_len):
  """Hugging Face's inverse frequencies and attention factor for the same options (its names)."""
  rope_scaling = {"rope_type": scaling, **{HF_KEYS.get(k, k): v for k, v in options.items() if k != "max_timescale"}}
  if scaling == "llama3":
    rope_scaling = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, **rope_scaling}
  config = transformers.LlamaConfig(hidden_size=HEAD_DIM * HEADS, num_attention_heads=HEADS,
                                    max_position_embeddings=MAX_LEN, rope_theta=options.get("max_timescale", 10_000.0),
                                    rope_scaling=rope_scaling)
  inv_freq, factor = ROPE_INIT_FUNCTIONS[scaling](config, "cpu", seq_len=seq_len)
  return inv_freq.numpy(), factor


@pytest.mark.parametrize("scaling,options,_", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
@pytest.mark.parametrize("length", [512, 6000])
def test_frequencies_and_attention_factor_equal_hugging_faces(scaling, options, _, length):
  spec = positions.make("rope", {"scaling": scaling, **options}, num_heads=HEADS, hidden_size=HEAD_DIM * HEADS,
                        max_len=MAX_LEN)
  got, factor = rotary.frequencies(spec.options, HEAD_DIM, MAX_LEN, length)
  want, want_factor = hugging_face(scaling, options, length)
  np.testing.assert_allclose(got, want, rtol=2e-6)
  assert factor == pytest.approx(want_factor, rel=1e-9)


def test_the_state_rotates_by_the_scaled_frequencies_times_the_attention_factor():
  spec = positions.make("rope", {"scaling": "yarn", "factor": 4.0}, num_heads=HEADS, hidden_size=HEAD_DIM * HEADS,
                        max_len=MAX_LEN)
  pos = np.array([[0, 5, 4000, 7]])
  state = spec.method.encoder(spec=spec).apply({}, jnp.asarray(pos))
  inv_freq, factor = hugging_face("yarn", {"factor": 4.0}, 4)
  angle = pos[..., None, None].astype(np.float64) * inv_freq.astype(np.float64)
  # float32 angles, as Hugging Face's: at position 4000 they are off by ~1e-4
  np.testing.assert_allclose(state.sin, factor * np.sin(angle), atol=5e-4)
  np.testing.assert_allclose(state.cos, factor * np.cos(angle), atol=5e-4)
  assert factor > 1


def test_dynamic_scaling_changes_nothing_up_to_the_original_length():
  options = positions.make("rope", {"scaling": "dynamic", "factor": 4.0}, num_heads=HEADS,
                           hidden_size=HEAD_DIM * HEADS, max_len=MAX_LEN).options
  plain = 10_000.0 ** (-np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
  np.testing.assert_allclose(rotary.frequencies(options, HEAD_DIM, MAX_LEN, MAX_LEN)[0], plain, rtol=1e-6)
  assert rotary.frequencies(options, HEAD_DIM, MAX_LEN, 2 * MAX_LEN)[0][-1] < plain[-1]


def test_a_scaled_model_runs_and_stays_shift_invariant():
  """Scaling changes frequencies only: relative (q·k depends on p_j - p_i) at any offset."""
  spec = positions.make("rope", {"scaling": "llama3", "factor": 8.0, "original_max_len": 64}, num_heads=2,
                        hidden_size=16, max_len=128)
  rng = np.random.default_rng(0)
  q, k = (jnp.asarray(rng.normal(size=(1, 6, 2, 8)), jnp.float32) for _ in range(2))
  logits = []
  for offset in (0, 90):
    state = spec.method.encoder(spec=spec).apply({}, jnp.arange(offset, offset + 6)[None])
    terms = spec.method.layer(spec=spec).apply({}, q, k, state, spec.scale)
    logits.append(np.asarray(terms.content_logits(spec.scale)))
  np.testing.assert_allclose(logits[0], logits[1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("options,message", [
    ({"factor": 2.0}, r"factor=2.0 needs a scaling \(linear, dynamic, yarn, llama3, longrope\)"),
    ({"scaling": "ntk"}, (r"option scaling='ntk' is not allowed; choose one of \['none', 'linear', 'dynamic', "
                          r"'yarn', 'llama3', 'longrope'\]")),
    ({"scaling": "longrope", "factor": 2.0}, r"short_factor and long_factor go with scaling='longrope'"),
    ({"layout": "gptj"}, r"option layout='gptj' is not allowed; choose one of \['half', 'interleaved'\]"),
    ({"scaling": "linear", "factor": 0.5}, r"factor=0.5 must be >= 1 with scaling='linear'"),
    ({"scaling": "llama3", "factor": 8.0}, r"scaling='llama3' needs original_max_len"),
])
def test_bad_scaling_options_are_errors(options, message):
  with pytest.raises(ValueError, match=message):
    positions.make("rope", options, num_heads=2, hidden_size=16, max_len=64)


def test_unscaled_rope_is_unchanged():
  spec = positions.make("rope", num_heads=2, hidden_size=16, max_len=64)
  state = spec.method.encoder(spec=spec).apply({}, jnp.arange(5)[None])
  angle = np.arange(5)[:, None] * 10_000.0 ** (-np.arange(0, 8, 2) / 8)
  np.testing.assert_allclose(state.sin[0, :, 0], np.sin(angle), rtol=1e-5, atol=1e-6)
  assert jax.tree.structure(state).num_leaves == 3  # positions, sin, cos


def test_longrope_equals_hugging_faces_short_and_long_frequencies():
  """Phi-3's LongRoPE: the short factors up to the original length, the long ones past it, and the attention factor
  from max_len / original_max_len, as Hugging Face's ``_compute_longrope_parameters``."""
  rng = np.random.default_rng(0)
  short, long = (list(map(float, rng.uniform(1.0, 8.0, HEAD_DIM // 2))) for _ in range(2))
  options = dict(scaling="longrope", factor=MAX_LEN / 512, original_max_len=512, short_factor=short, long_factor=long)
  config = transformers.LlamaConfig(hidden_size=HEAD_DIM * HEADS, num_attention_heads=HEADS,
                                    max_position_embeddings=MAX_LEN,
                                    rope_scaling={"rope_type": "longrope", "short_factor": short, "long_factor": long})
  config.original_max_position_embeddings = 512
  for length in (256, 1024):
    inv_freq, factor = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=length)
    ours, our_factor = rotary.frequencies(rotary.RopeOptions(**options), HEAD_DIM, MAX_LEN, length)
    np.testing.assert_allclose(ours, inv_freq.numpy(), rtol=1e-6)
    assert our_factor == pytest.approx(factor, rel=1e-6)


def _rotated(options, q_BxLxHxK, positions_BxL):
  sin, cos = rotary.rotation(jnp.asarray(positions_BxL), q_BxLxHxK.shape[-1], rotary.RopeOptions(**options))
  return np.asarray(rotary.rotate(jnp.asarray(q_BxLxHxK), sin, cos, options.get("layout", "half")))


def test_partial_and_interleaved_rotary_equal_gpt_neox_and_gpt_j():
  """GPT-NeoX's partial rotate-half (rotary_pct 0.25) and GPT-J's interleaved rotation of its first rotary_dim
  features, by Hugging Face's own functions on the same q."""
  import torch
  from transformers.models.gpt_neox import modeling_gpt_neox
  from transformers.models.gptj import modeling_gptj

  rng = np.random.default_rng(1)
  q = rng.normal(size=(2, 12, HEADS, HEAD_DIM)).astype(np.float32)
  positions = np.tile(np.arange(12), (2, 1))
  config = transformers.GPTNeoXConfig(hidden_size=HEAD_DIM * HEADS, num_attention_heads=HEADS, rotary_pct=0.25)
  inv_freq, _ = ROPE_INIT_FUNCTIONS["default"](config, "cpu")
  angles = torch.from_numpy(positions).float()[..., None] * inv_freq
  emb = torch.cat([angles, angles], -1)
  want, _ = modeling_gpt_neox.apply_rotary_pos_emb(torch.from_numpy(q), torch.from_numpy(q), emb.cos(), emb.sin(),
                                                   unsqueeze_dim=2)
  np.testing.assert_allclose(_rotated(dict(rotary_fraction=0.25), q, positions), want.numpy(), atol=1e-5)
  rotary_dim = 16
  sin, cos = torch.chunk(modeling_gptj.create_sinusoidal_positions(12, rotary_dim)[torch.from_numpy(positions)], 2, -1)
  rot = modeling_gptj.apply_rotary_pos_emb(torch.from_numpy(q[..., :rotary_dim]), sin, cos)
  want = np.concatenate([rot.numpy(), q[..., rotary_dim:]], -1)
  got = _rotated(dict(rotary_fraction=rotary_dim / HEAD_DIM, layout="interleaved"), q, positions)
  np.testing.assert_allclose(got, want, atol=1e-5)


def test_p_rope_keeps_the_highest_frequencies_and_leaves_the_rest_unrotated():
  """p-RoPE at p = 0.25 against float64 loops: frequency f < p·d/2 rotates pair (f, f + d/2) by p·θ^(-2f/d), the
  others are unchanged."""
  rng = np.random.default_rng(2)
  q = rng.normal(size=(1, 7, 1, HEAD_DIM))
  positions = np.arange(7)[None]
  got = _rotated(dict(frequency_fraction=0.25, max_timescale=500.0), q.astype(np.float32), positions)
  want = q.copy()
  half = HEAD_DIM // 2
  for i in range(7):
    for f in range(int(0.25 * half)):
      angle = i * 500.0 ** (-2 * f / HEAD_DIM)
      x1, x2 = q[0, i, 0, f], q[0, i, 0, f + half]
      want[0, i, 0, f] = x1 * np.cos(angle) - x2 * np.sin(angle)
      want[0, i, 0, f + half] = x2 * np.cos(angle) + x1 * np.sin(angle)
  np.testing.assert_allclose(got, want, atol=1e-5)
  with pytest.raises(ValueError, match=r"rope rotates 3 of head_dim=10 features \(rotary_fraction=0.3\); that must be"):
    rotary.rotary_dim(rotary.RopeOptions(rotary_fraction=0.3), 10)
