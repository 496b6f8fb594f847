"""ELECTRA's two models: the generator reads the discriminator's embeddings (one set of arrays), through its own
projection where the widths differ; an encoder with other embeddings cannot share them."""

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posjax.models import TransformerConfig, Transformer
from posjax.models.electra import Electra
from conftest import randomize

DISCRIMINATOR = TransformerConfig.tiny(hidden_size=32, num_heads=4, max_len=16)
GENERATOR = TransformerConfig.tiny(hidden_size=16, num_heads=2, intermediate_size=32, embedding_size=32, max_len=16)


def init(model, position="absolute"):
  ids = jnp.ones((2, 8), jnp.int32)
  params = nn.unbox(model.init(jax.random.PRNGKey(0), ids, jnp.zeros((2, 3), jnp.int32))["params"])
  return randomize(flax.core.unfreeze(params), scale=0.3)


@pytest.mark.parametrize("position", ["absolute", "t5"])
def test_the_generator_reads_the_discriminators_embeddings_and_a_gradient_moves_both(position):
  model = Electra(GENERATOR.__class__(**{**GENERATOR.to_dict(), "position": position}),
                  DISCRIMINATOR.__class__(**{**DISCRIMINATOR.to_dict(), "position": position}))
  params = init(model)
  generator = params["generator"]
  assert not {"word_embeddings", "token_type_embeddings", "embedding_norm"} & set(generator)
  assert "embeddings_project" in generator and "position" in params["encoder"]
  assert ("position" in generator) == (position == "t5")  # T5's bucket table is each model's own
  ids = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 8)))
  masked = jnp.asarray([[1, 3, 5], [0, 2, 7]])
  projection = jax.random.normal(jax.random.PRNGKey(1), (2, 3, 128))

  def generator_loss(p):
    return jnp.sum(model.apply({"params": p}, ids, masked, method=Electra.generate) * projection)

  grads = jax.grad(generator_loss)(params)
  largest = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads))
  for name in ("word_embeddings", "token_type_embeddings", "embedding_norm") + (
      ("position",) if position == "absolute" else ()):
    moved = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads["encoder"][name]))
    assert moved > 1e-3 * largest, name  # the generator's loss reaches the shared arrays
  for name in ("layer_0", "layer_1"):  # and none of the discriminator's own
    assert all(float(jnp.abs(g).max()) == 0 for g in jax.tree.leaves(grads["encoder"][name]))


def test_the_generator_equals_a_bert_mlm_model_built_on_the_same_arrays():
  model = Electra(GENERATOR, DISCRIMINATOR)
  params = init(model)
  shared = {k: params["encoder"][k] for k in ("word_embeddings", "token_type_embeddings", "embedding_norm",
                                              "position")}
  alone = {"encoder": {**params["generator"], **shared}, **params["generator_head"]}
  ids = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 8)))
  mask = jnp.asarray([[1] * 8, [1] * 5 + [0] * 3])
  types = jnp.asarray([[0] * 4 + [1] * 4, [0] * 8])
  logits = model.apply({"params": params}, ids, jnp.broadcast_to(jnp.arange(8), (2, 8)), token_type_ids=types,
                       attention_mask=mask, method=Electra.generate)
  bert = Transformer(GENERATOR, head="mlm").apply({"params": alone}, ids, token_type_ids=types, attention_mask=mask)
  np.testing.assert_allclose(logits, bert.logits, atol=1e-5)
  rtd = model.apply({"params": params}, ids, token_type_ids=types, attention_mask=mask, method=Electra.discriminate)
  disc = Transformer(DISCRIMINATOR, head="rtd").apply(
      {"params": {"encoder": params["encoder"], "rtd": params["rtd"], "rtd_output": params["rtd_output"]}}, ids,
      token_type_ids=types, attention_mask=mask)
  np.testing.assert_allclose(rtd, disc.logits, atol=1e-5)


@pytest.mark.parametrize("change, message", [
    (dict(embedding_size=24), r"embed_width \(here 24, there 32\)"),
    (dict(position="sinusoidal"), r"position \(here 'sinusoidal', there 'absolute'\)"),
])
def test_embeddings_that_do_not_match_cannot_be_shared(change, message):
  generator = GENERATOR.__class__(**{**GENERATOR.to_dict(), **change})
  with pytest.raises(ValueError, match="an encoder that shares another's embeddings needs the same " + message):
    Electra(generator, DISCRIMINATOR).init(jax.random.PRNGKey(0), jnp.ones((1, 4), jnp.int32))


def with_position(config, position, **options):
  return config.__class__(**{**config.to_dict(), "position": position, "position_options": options})


@pytest.mark.parametrize("share", [False, True])
def test_a_shared_tupe_table_is_one_array_read_by_both_models_through_their_own_projections(share):
  model = Electra(with_position(GENERATOR, "tupe_r"), with_position(DISCRIMINATOR, "tupe_r"), share_position_table=share)
  params = init(model)
  own = set(params["generator"]["position"])
  assert own == ({"correlation"} if share else {"correlation", "table", "pos_ln"})
  ids = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 8)))
  masked = jnp.asarray([[1, 3, 5], [0, 2, 7]])
  projection = jax.random.normal(jax.random.PRNGKey(1), (2, 3, 128))
  grads = jax.grad(lambda p: jnp.sum(model.apply({"params": p}, ids, masked, method=Electra.generate) * projection))(
      params)
  largest = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads))
  reached = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(
      {k: grads["encoder"]["position"][k] for k in ("table", "pos_ln")}))
  assert (reached > 1e-3 * largest) if share else reached == 0
  # the generator's projections read the discriminator's 32-wide table (its own would be 16 wide)
  kernel = params["generator"]["position"]["correlation"]["query"]["kernel"]
  assert kernel.shape[0] == (32 if share else 16)


@pytest.mark.parametrize("generator, discriminator, message", [
    (("absolute",), ("absolute",), r"a method whose table feeds the layers \(tupe_a, tupe_r\); here 'absolute'"),
    (("tupe_a", {"cls_reset": "paper"}), ("tupe_a",), r"needs the same position options \(here TupeAOptions\(cls_reset='paper'"),
    (("tupe_r",), ("tupe_a",), r"needs the same position \(here 'tupe_r', there 'tupe_a'\)"),
])
def test_a_position_table_that_cannot_be_shared_is_an_error(generator, discriminator, message):
  model = Electra(with_position(GENERATOR, generator[0], **(generator[1] if len(generator) > 1 else {})),
                  with_position(DISCRIMINATOR, discriminator[0]), share_position_table=True)
  with pytest.raises(ValueError, match=message):
    model.init(jax.random.PRNGKey(0), jnp.ones((1, 4), jnp.int32))
