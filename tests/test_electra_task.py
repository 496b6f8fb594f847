"""The ``electra`` task against a numpy re-computation on a fixed batch: the samples, the replaced tokens and
their labels, the joint loss and every metric; the sampling's distribution; no gradient through the samples;
the loss's normalisation over the whole step (accumulation and devices change nothing); samples reproducible
from the seed and new at every step."""

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from posjax.models import TransformerConfig
from posjax.models.electra import Electra
from posjax.tasks import electra
from posjax.train import sharding, step as step_lib
from conftest import randomize

VOCAB, L, M = 128, 12, 4
DISCRIMINATOR = TransformerConfig.tiny(hidden_size=32, num_heads=4, max_len=16, dropout_rate=0.0,
                                       attention_dropout_rate=0.0)
GENERATOR = TransformerConfig.tiny(hidden_size=16, num_heads=2, intermediate_size=32, embedding_size=32, max_len=16,
                                   dropout_rate=0.0, attention_dropout_rate=0.0)


def model_and_params(seed=0):
  model = Electra(GENERATOR, DISCRIMINATOR)
  shapes = nn.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.ones((1, L), jnp.int32))["params"])
  return model, randomize(flax.core.unfreeze(shapes), seed=seed, scale=0.3)  # from the shapes: no initialiser runs


def fixed_batch(rows=4, seed=0):
  """Masked rows with padding tokens and padding entries among the masked positions (weight 0, position 0)."""
  rng = np.random.default_rng(seed)
  lengths = [L, 9, 6, L][:rows] + [7] * max(0, rows - 4)
  ids = np.zeros((rows, L), np.int32)
  mask = np.zeros((rows, L), np.int32)
  positions = np.zeros((rows, M), np.int32)
  labels = np.zeros((rows, M), np.int32)
  weights = np.zeros((rows, M), np.float32)
  for r, n in enumerate(lengths):
    ids[r, :n] = rng.integers(5, VOCAB, n)
    mask[r, :n] = 1
    chosen = np.sort(rng.choice(np.arange(1, n), size=2 + r % 3, replace=False))
    positions[r, :len(chosen)] = chosen
    labels[r, :len(chosen)] = ids[r, chosen]
    weights[r, :len(chosen)] = 1.0
    ids[r, chosen] = 4  # [MASK]
  return {"input_ids": jnp.asarray(ids), "attention_mask": jnp.asarray(mask),
          "masked_positions": jnp.asarray(positions), "masked_labels": jnp.asarray(labels),
          "masked_weights": jnp.asarray(weights)}


def log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def reference(model, params, batch, sampled, weight=50.0):
  """ELECTRA's loss and metrics written out in numpy from the two models' logits and the samples."""
  b = {k: np.asarray(v) for k, v in batch.items()}
  logits = np.asarray(model.apply({"params": params}, batch["input_ids"], batch["masked_positions"],
                                  attention_mask=batch["attention_mask"], method=Electra.generate), np.float64)
  fake, replaced = b["input_ids"].copy(), np.zeros(b["input_ids"].shape, bool)
  for r in range(fake.shape[0]):
    for m in range(M):
      if b["masked_weights"][r, m] > 0:
        fake[r, b["masked_positions"][r, m]] = sampled[r, m]
        replaced[r, b["masked_positions"][r, m]] = sampled[r, m] != b["masked_labels"][r, m]
  disc = np.asarray(model.apply({"params": params}, jnp.asarray(fake), attention_mask=batch["attention_mask"],
                                method=Electra.discriminate), np.float64)
  w, t = b["masked_weights"], b["attention_mask"].astype(np.float64)
  ce = -np.take_along_axis(log_softmax(logits), b["masked_labels"][..., None], -1)[..., 0]
  y = replaced.astype(np.float64)
  bce = np.maximum(disc, 0) - disc * y + np.log1p(np.exp(-np.abs(disc)))
  predicted = disc > 0
  real = t > 0
  mlm_loss, disc_loss = (ce * w).sum() / w.sum(), (bce * t).sum() / t.sum()
  return fake, replaced, {
      "loss": mlm_loss + weight * disc_loss, "mlm_loss": mlm_loss,
      "mlm_accuracy": ((logits.argmax(-1) == b["masked_labels"]) * w).sum() / w.sum(),
      "sampled_accuracy": ((sampled == b["masked_labels"]) * w).sum() / w.sum(),
      "disc_loss": disc_loss, "disc_accuracy": ((predicted == replaced) & real).sum() / real.sum(),
      "disc_precision": (predicted & replaced & real).sum() / max((predicted & real).sum(), 1),
      "disc_recall": (predicted & replaced & real).sum() / max((replaced & real).sum(), 1),
      "replaced_fraction": (replaced & real).sum() / real.sum()}


def test_the_loss_samples_and_metrics_equal_the_numpy_recomputation():
  model, params = model_and_params()
  batch = fixed_batch()
  loss_fn = electra.electra_loss(model, discriminator_weight=50.0, temperature=1.0, use_segments=False)
  rng = jax.random.PRNGKey(3)
  totals = electra.loss_totals(batch)
  loss, sums = jax.jit(loss_fn)(params, batch, rng, totals=totals)
  keys, _ = electra.training_keys(rng, 4)
  _, sampled, fake, replaced = electra.corrupt(model, params, batch, keys, temperature=1.0, use_segments=False)
  want_fake, want_replaced, want = reference(model, params, batch, np.asarray(sampled))
  np.testing.assert_array_equal(fake, want_fake)
  np.testing.assert_array_equal(replaced, want_replaced)
  assert want_replaced.sum() > 2
  assert not want_replaced[np.asarray(batch["attention_mask"]) == 0].any()
  assert not want_replaced[:, 0].any()  # the padding entries of the masked positions point at 0 and write nothing
  np.testing.assert_allclose(float(loss) / float(sums["weight"]), want["loss"], rtol=1e-5)
  got = electra.metrics(sums, 50.0)
  for name, value in want.items():
    np.testing.assert_allclose(float(got[name]), value, rtol=1e-5, atol=1e-7, err_msg=name)


def test_the_evaluation_scores_like_the_reference_with_its_fixed_keys():
  model, params = model_and_params(seed=1)
  batch = fixed_batch(seed=1)
  rows = electra.row_sums(model, params, batch, electra.row_keys(batch["input_ids"]), temperature=1.0,
                          use_segments=False)
  _, sampled, _, _ = electra.corrupt(model, params, batch, electra.row_keys(batch["input_ids"]), temperature=1.0,
                                     use_segments=False)
  want = reference(model, params, batch, np.asarray(sampled))[2]
  got = electra.evaluation_metrics(jax.device_get(rows), None, discriminator_weight=50.0)
  for name, value in want.items():
    np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-7, err_msg=name)
  # a row's key depends on its tokens only: the same row in another batch draws the same samples
  keys = electra.row_keys(batch["input_ids"])
  np.testing.assert_array_equal(jax.random.key_data(electra.row_keys(batch["input_ids"][2:3]))[0],
                                jax.random.key_data(keys)[2])


def test_a_sample_equal_to_the_original_is_not_replaced_and_padding_writes_nothing():
  batch = fixed_batch()
  labels, weights = np.asarray(batch["masked_labels"]), np.asarray(batch["masked_weights"])
  sampled = np.where(np.arange(M) % 2 == 0, labels, (labels + 1) % VOCAB)  # every other sample is the original
  sampled[weights == 0] = 7  # what a padding entry draws must land nowhere
  fake, replaced = electra.replace_tokens(batch["input_ids"], batch["masked_positions"], batch["masked_weights"],
                                          jnp.asarray(sampled), batch["masked_labels"])
  want_fake, want_replaced = np.asarray(batch["input_ids"]).copy(), np.zeros((4, L), bool)
  for r in range(4):
    for m in np.flatnonzero(weights[r]):
      want_fake[r, batch["masked_positions"][r, m]] = sampled[r, m]
      want_replaced[r, batch["masked_positions"][r, m]] = m % 2 == 1
  np.testing.assert_array_equal(fake, want_fake)
  np.testing.assert_array_equal(replaced, want_replaced)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_samples_follow_the_softmax_of_logits_over_temperature(temperature):
  logits = jnp.asarray([[[2.0, 0.5, -1.0, 0.0, 1.0]]])
  draws = np.asarray(jax.vmap(lambda k: electra.sample(k[None], logits, temperature))(
      jax.random.split(jax.random.PRNGKey(0), 40_000)))[:, 0, 0]
  frequencies = np.bincount(draws, minlength=5) / len(draws)
  p = np.exp(np.asarray(logits[0, 0]) / temperature)
  np.testing.assert_allclose(frequencies, p / p.sum(), atol=0.01)


def test_no_gradient_flows_through_the_samples():
  """The generator's layers get the MLM loss's gradient only: the discriminator's weight changes none of it."""
  model, params = model_and_params()
  batch = fixed_batch()
  totals = electra.loss_totals(batch)
  grads = {}
  for weight in (0.0, 50.0):
    loss_fn = electra.electra_loss(model, discriminator_weight=weight, temperature=1.0, use_segments=False)
    grads[weight] = jax.jit(jax.grad(lambda p: loss_fn(p, batch, jax.random.PRNGKey(3), totals=totals)[0]))(params)
  for part in ("generator", "generator_head"):
    for a, b in zip(jax.tree.leaves(grads[0.0][part]), jax.tree.leaves(grads[50.0][part])):
      np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  shared = grads[50.0]["encoder"]["word_embeddings"]["embedding"] - grads[0.0]["encoder"]["word_embeddings"]["embedding"]
  assert float(jnp.abs(shared).max()) > 1e-3 * float(jnp.abs(grads[50.0]["encoder"]["word_embeddings"]["embedding"]).max())


def run_step(params, batch, accum_steps, temperature=1e-4):
  """One train step; near-zero temperature makes the samples the generator's argmax, the same whatever the keys,
  so that only the normalisation can differ between ways of splitting the batch."""
  model = Electra(GENERATOR, DISCRIMINATOR)
  loss_fn = electra.electra_loss(model, discriminator_weight=50.0, temperature=temperature, use_segments=False)
  optimizer = optax.sgd(1.0)
  state = step_lib.TrainState(jnp.int32(0), params, optimizer.init(params))
  return step_lib.train_step(state, batch, jax.random.PRNGKey(0), loss_fn=loss_fn, optimizer=optimizer,
                             schedule=lambda s: 1.0, accum_steps=accum_steps, loss_totals=electra.loss_totals,
                             step_metrics=lambda sums: electra.metrics(sums, 50.0))


def test_accumulation_gives_the_update_and_metrics_of_one_batch():
  _, params = model_and_params()
  batch = fixed_batch(rows=4)
  step = jax.jit(run_step, static_argnums=2)
  (one, metrics_one), (two, metrics_two) = step(params, batch, 1), step(params, batch, 2)
  for name in ("loss", "mlm_loss", "disc_loss", "disc_recall", "tokens"):
    np.testing.assert_allclose(metrics_one[name], metrics_two[name], rtol=1e-5, err_msg=name)
  largest = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(one.params))
  for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(two.params)):
    np.testing.assert_allclose(a, b, atol=1e-5 * largest)


def test_accumulation_on_an_8_device_mesh_gives_the_update_of_one_batch():
  # 16 rows over data=8 in 2 micro-batches (one row per device per micro-step), against the whole batch at once.
  _, params = model_and_params()
  batch = fixed_batch(rows=16)
  mesh = sharding.make_mesh({"data": 8})
  rows = sharding.batch_sharding(mesh)

  def on_mesh(accum_steps):
    def step(params, batch):
      with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        return run_step(params, batch, accum_steps)
    return jax.jit(step, in_shardings=(sharding.replicated(mesh), rows))(params, batch)

  (one, metrics_one), (two, metrics_two) = jax.jit(run_step, static_argnums=2)(params, batch, 1), on_mesh(2)
  for name in ("loss", "mlm_loss", "disc_loss", "tokens"):
    np.testing.assert_allclose(metrics_one[name], metrics_two[name], rtol=1e-5, err_msg=name)
  largest = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(one.params))
  for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(two.params)):
    np.testing.assert_allclose(a, b, atol=1e-5 * largest)


def test_samples_are_reproducible_from_the_seed_and_new_at_every_step():
  model, params = model_and_params()
  batch = fixed_batch()

  def samples(seed, step):
    rng = jax.random.fold_in(step_lib.step_rng(jax.random.PRNGKey(seed), step), 0)  # the first micro-batch's
    keys, _ = electra.training_keys(rng, 4)
    return np.asarray(electra.corrupt(model, params, batch, keys, temperature=1.0, use_segments=False)[1])

  np.testing.assert_array_equal(samples(0, 5), samples(0, 5))
  assert (samples(0, 5) != samples(0, 6)).any() and (samples(0, 5) != samples(1, 5)).any()


def test_the_generators_fields_and_the_options_are_checked_with_their_names():
  from conftest import load_config

  config = load_config("electra", "runlocal")
  generator = electra.model_config(config, 128).generator
  assert (generator.hidden_size, generator.embedding_size, generator.num_layers) == (32, 64, 2)
  config.generator.hiden_size = 8
  with pytest.raises(ValueError, match=r"config.generator has unknown field\(s\) \['hiden_size'\]"):
    electra.model_config(config, 128)
  for field, value, message in (("temperature", 0.0, "config.electra.temperature=0.0 must be > 0"),
                                ("tempreature", 1.0, r"config.electra has unknown field\(s\) \['tempreature'\]")):
    config = load_config("electra", "runlocal")
    config.electra[field] = value
    with pytest.raises(ValueError, match=message):
      electra.options(config)
