"""Causal attention at the module level (``Mask(causal=True)``, ``TransformerConfig(causal=True)``): no method on any
kernel lets a token see a later one, and the methods take their decoder form (T5's unidirectional buckets)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posjax import attention, positions
from posjax.models import TransformerConfig, Transformer
import reference
from conftest import one_axis

LENGTH = 12


def decoder(name, **overrides):
  config = TransformerConfig.tiny(position=name, causal=True, dropout_rate=0.0, attention_dropout_rate=0.0, **overrides)
  return Transformer(config)


def outputs(model, params, ids, **kwargs):
  return np.asarray(model.apply({"params": params}, jnp.asarray(ids), **kwargs).last_hidden_state)


@pytest.mark.parametrize("name", one_axis(positions.names()))
def test_no_token_sees_a_later_one(name):
  """Changing the tokens after position 6 leaves every output at or before it unchanged (and changes later ones)."""
  rng = np.random.default_rng(0)
  model = decoder(name)
  ids = rng.integers(5, 128, (2, LENGTH)).astype(np.int32)
  params = model.init(jax.random.PRNGKey(0), ids)["params"]
  changed = ids.copy()
  changed[:, 7:] = rng.integers(5, 128, (2, LENGTH - 7))
  a, b = outputs(model, params, ids), outputs(model, params, changed)
  np.testing.assert_allclose(a[:, :7], b[:, :7], rtol=1e-5, atol=1e-5)
  assert not np.allclose(a[:, 7:], b[:, 7:], atol=1e-3)


@pytest.mark.parametrize("name", ["alibi", "t5", "rope", "huang_m4"])
def test_every_kernel_computes_the_causal_layer_of_the_xla_path(name, monkeypatch):
  """Pallas (interpreted) and the cuDNN code path (through jax's XLA implementation) with padding and packed rows."""
  monkeypatch.setattr(attention, "fused_attention", functools.partial(attention.fused_attention,
                                                                      implementation="xla"))
  monkeypatch.setattr(attention, "FUSED_DTYPES", (jnp.float32,))
  rng = np.random.default_rng(1)
  ids = rng.integers(5, 128, (2, LENGTH)).astype(np.int32)
  kwargs = dict(attention_mask=np.arange(LENGTH)[None] < np.array([[LENGTH], [9]]),
                positions=np.array([list(range(7)) + list(range(5))] * 2),
                segment_ids=np.array([[0] * 7 + [1] * 5] * 2))
  params = decoder(name).init(jax.random.PRNGKey(0), ids)["params"]
  want = outputs(decoder(name), params, ids, **kwargs)
  for kernel in ("pallas", "cudnn"):
    got = outputs(decoder(name, attention_kernel=kernel), params, ids, **kwargs)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-4, err_msg=kernel)
    np.testing.assert_allclose(got[1, :9], want[1, :9], rtol=1e-4, atol=1e-4, err_msg=kernel)


@pytest.mark.parametrize("bidirectional", [None, True])
def test_t5_in_a_decoder_takes_unidirectional_buckets_unless_told(bidirectional):
  options = {} if bidirectional is None else {"bidirectional": bidirectional}
  spec = positions.make("t5", options, num_heads=2, hidden_size=16, max_len=64, causal=True)
  pos = np.arange(40)[None]
  state = spec.method.encoder(spec=spec).init_with_output(jax.random.PRNGKey(0), pos)[0]
  table = np.asarray(state.terms.buckets.table)
  unidirectional = bidirectional is None
  want = np.array([[table[reference.t5_bucket(j - i, bidirectional=not unidirectional), h] for j in range(40)]
                   for h in range(2) for i in range(40)]).reshape(2, 40, 40)
  np.testing.assert_allclose(np.asarray(state.bias)[0], want, rtol=1e-6)
  if unidirectional:  # every earlier distance gets a bucket of its own side: 8 exact ones, not 16 shared
    assert len({reference.t5_bucket(-d, bidirectional=False) for d in range(40)}) > len(
        {reference.t5_bucket(-d) for d in range(40)})


def test_an_encoder_keeps_t5s_bidirectional_buckets():
  spec = positions.make("t5", num_heads=2, hidden_size=16, max_len=64)
  state = spec.method.encoder(spec=spec).init_with_output(jax.random.PRNGKey(0), np.arange(8)[None])[0]
  assert state.terms.buckets.bidirectional and not spec.causal


@pytest.mark.parametrize("schedule", ["none,alibi", "alibi,none"])
def test_a_position_schedule_gives_each_layer_its_method(schedule):
  """Two batches that differ only in their positions: a NoPE layer whose input is the same (the first) computes the
  same logits for both, an ALiBi layer different ones; so each layer runs the method the schedule names."""
  config = TransformerConfig.decoder(vocab_size=64, hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32,
                                     max_len=16, position="alibi", position_schedule=schedule)
  model = Transformer(config, head="lm")
  ids = jnp.arange(8)[None] % 64
  variables = model.init(jax.random.PRNGKey(0), ids)
  logits = lambda positions: model.apply(variables, ids, positions=positions, mutable=["intermediates"])[1][
      "intermediates"]["encoder"]["layer_0"]["attention"]["attention_logits"][0]
  same = np.allclose(logits(jnp.arange(8)[None]), logits(3 * jnp.arange(8)[None]))
  assert same == schedule.startswith("none")
  assert config.layer_positions == tuple(schedule.split(","))


@pytest.mark.parametrize("fields,message", [
    (dict(position_schedule="rope,absolute"), "'absolute' adds an input embedding"),
    (dict(position_schedule="rope,nope"), "unknown position method 'nope'"),
    (dict(position_schedule="rope,rope@local", schedule_options={"rope@x": {}}),
     r"schedule_options names \['rope@x'\], which are not entries of position_schedule"),
    (dict(position_schedule="rope,rope@local", schedule_options={"rope@local": {"base": 5.0}}), "base"),
])
def test_a_schedule_that_cannot_run_is_an_error(fields, message):
  with pytest.raises(ValueError, match=message):
    TransformerConfig.llama(vocab_size=64, hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32,
                            max_len=16, **fields)


@pytest.mark.parametrize("fields,message", [
    (dict(num_kv_heads=3), r"num_kv_heads=3 must divide num_heads=4"),
    (dict(sliding_window=-4), r"sliding_window must be an int >= 0"),
    (dict(parallel_residual=True, norm="post"), r"parallel_residual=True needs norm='pre'"),
    (dict(norm_type="batchnorm"), r"option norm_type='batchnorm' is not allowed"),
    (dict(head_dim=-1), r"head_dim must be an int >= 0"),
])
def test_decoder_fields_that_cannot_work_are_errors(fields, message):
  with pytest.raises(ValueError, match=message):
    TransformerConfig.llama(vocab_size=64, hidden_size=16, num_layers=1, num_heads=4, intermediate_size=32,
                            max_len=16, **fields).position_spec
