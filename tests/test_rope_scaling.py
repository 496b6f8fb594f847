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
    ({"factor": 2.0}, r"factor=2.0 needs a scaling \(linear, dynamic, yarn, llama3\)"),
    ({"scaling": "ntk"}, (r"option scaling='ntk' is not allowed; choose one of \['none', 'linear', 'dynamic', "
                          r"'yarn', 'llama3'\]")),
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
