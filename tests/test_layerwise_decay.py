"""Layer-wise learning-rate decay (``config.layerwise_lr_decay``) against a plain AdamW loop, the official ELECTRA
optimizer (``model/optimization.py``: Adam without bias correction, ``_get_layer_lrs``) against its formula, and
the ``recipe`` option of the fine-tuning configs (ELECTRA's values)."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from conftest import load_config
from posjax.models import SIZES, TransformerConfig, Transformer
from posjax.train import step as step_lib
from posjax.train.step import decays, layer_scales, learning_rate_schedule, make_optimizer

LAYERS, PEAK, TOTAL, WEIGHT_DECAY, EPS = 3, 0.1, 10, 0.3, 1e-6


def params_tree(seed=0):
  """posjax's layout in small: embeddings, their norm and the layers under ``encoder``, a head beside it."""
  rng = np.random.default_rng(seed)
  dense = lambda: {"kernel": rng.normal(size=(3, 2)).astype(np.float32), "bias": rng.normal(size=2).astype(np.float32)}
  encoder = {f"layer_{i}": {"attention": dense(), "mlp_norm": {"scale": np.ones(2, np.float32)}} for i in range(LAYERS)}
  encoder.update(word_embeddings={"embedding": rng.normal(size=(5, 2)).astype(np.float32)},
                 embedding_norm={"scale": np.ones(2, np.float32)})
  return {"encoder": encoder, "classifier": dense()}


def optimizer_config(**fields):
  defaults = dict(learning_rate=PEAK, warmup_steps=0, total_steps=TOTAL, grad_clip_norm=1e9, adam_b1=0.9, adam_b2=0.999,
                  adam_eps=EPS, weight_decay=WEIGHT_DECAY)
  return ml_collections.ConfigDict({**defaults, **fields})


def grads_at(step, params):
  rng = np.random.default_rng(100 + step)
  return jax.tree.map(lambda p: rng.normal(size=p.shape).astype(np.float32), params)


def run(optimizer, params, steps=3):
  """``steps`` updates from the same gradients: the parameters and the optimizer's state."""
  params = jax.tree.map(jnp.asarray, params)
  state = optimizer.init(params)
  for step in range(steps):
    updates, state = optimizer.update(grads_at(step, params), state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def reference_lr_factor(keys, decay):
  """ELECTRA's per-parameter learning rate over the peak: layer i of n at decay^(n - i), embeddings at
  decay^(n + 1), the head at 1."""
  if keys[0] != "encoder":
    return 1.0
  layer = re.fullmatch(r"layer_(\d+)", keys[1])
  return decay ** (LAYERS - int(layer[1])) if layer else decay ** (LAYERS + 1)


def reference_adamw(params, factor, steps=3, bias_correction=True):
  """A plain float64 AdamW loop, parameter by parameter, each at its own learning rate ``lr_t * factor(keys)``
  times the Adam step plus weight decay (not on biases or norm scales), ``lr_t`` linear from the peak to 0;
  ``bias_correction=False``: the official ELECTRA / BERT ``AdamWeightDecayOptimizer``'s ``m / (sqrt(v) + eps)``."""
  flat = {tuple(k.key for k in path): np.float64(p) for path, p in jax.tree_util.tree_leaves_with_path(params)}
  m = {k: np.zeros_like(p) for k, p in flat.items()}
  v = {k: np.zeros_like(p) for k, p in flat.items()}
  for step in range(steps):
    current = jax.tree_util.tree_map_with_path(lambda path, _: flat[tuple(k.key for k in path)].astype(np.float32),
                                               params)
    grads = {tuple(k.key for k in path): np.float64(g)
             for path, g in jax.tree_util.tree_leaves_with_path(grads_at(step, current))}
    lr = PEAK * (1 - step / TOTAL)
    first, second = (1 - 0.9 ** (step + 1), 1 - 0.999 ** (step + 1)) if bias_correction else (1.0, 1.0)
    for k, p in flat.items():
      m[k] = 0.9 * m[k] + 0.1 * grads[k]
      v[k] = 0.999 * v[k] + 0.001 * grads[k] ** 2
      adam = (m[k] / first) / (np.sqrt(v[k] / second) + EPS)
      decayed = 0.0 if k[-1] in ("bias", "scale") else WEIGHT_DECAY * p
      flat[k] = p - lr * factor(k) * (adam + decayed)
  return flat


@pytest.mark.parametrize("decay", [0.8, 0.5])
def test_layerwise_decay_equals_a_plain_adamw_loop_with_per_layer_learning_rates(decay):
  params = params_tree()
  optimizer, _ = make_optimizer(optimizer_config(layerwise_lr_decay=decay))
  got, _ = run(optimizer, params)
  want = reference_adamw(params, lambda keys: reference_lr_factor(keys, decay))
  for path, value in jax.tree_util.tree_leaves_with_path(got):
    key = tuple(k.key for k in path)
    np.testing.assert_allclose(np.asarray(value), want[key], rtol=2e-5, atol=1e-6, err_msg=str(key))


def test_decay_one_is_the_optimizer_without_it_bit_for_bit():
  schedule = learning_rate_schedule(PEAK, 0, TOTAL)
  current = optax.chain(optax.clip_by_global_norm(1e9),
                        optax.adamw(schedule, b1=0.9, b2=0.999, eps=EPS, weight_decay=WEIGHT_DECAY, mask=decays))
  want_params, want_state = run(current, params_tree())
  for fields in ({}, {"layerwise_lr_decay": 1.0}):
    got_params, got_state = run(make_optimizer(optimizer_config(**fields))[0], params_tree())
    assert jax.tree.structure(got_state) == jax.tree.structure(want_state)  # checkpoints stay loadable
    jax.tree.map(np.testing.assert_array_equal, (got_params, got_state), (want_params, want_state))


@pytest.mark.parametrize("decay", [0.0, -0.5, 1.5, float("nan")])
def test_a_decay_outside_zero_to_one_is_an_error(decay):
  with pytest.raises(ValueError, match=r"config.layerwise_lr_decay=.* must be in \(0, 1\]"):
    make_optimizer(optimizer_config(layerwise_lr_decay=decay))


def test_decay_needs_an_encoder():
  optimizer, _ = make_optimizer(optimizer_config(layerwise_lr_decay=0.8))
  with pytest.raises(ValueError, match="layerwise_lr_decay needs a model whose parameters hold an 'encoder'"):
    optimizer.init({"classifier": {"kernel": jnp.ones((2, 2))}})


def test_a_real_models_parameters_get_their_layers_factors():
  """posjax's own names (the encoder's position module, token types, the pooler), boxed as validation inits them."""
  config = TransformerConfig(**SIZES["tiny"], vocab_size=50, max_len=16, position="tupe_r")
  model = Transformer(config, head="classification", num_labels=2)
  boxed = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"])
  jax.eval_shape(make_optimizer(optimizer_config(layerwise_lr_decay=0.5))[0].init, boxed)
  scales = {jax.tree_util.keystr(path)[:40]: s for path, s in
            jax.tree_util.tree_leaves_with_path(layer_scales(nn.unbox(boxed), 0.5))}
  n = config.num_layers
  assert {k: s for k, s in scales.items() if "layer_" in k} == {
      k: 0.5 ** (n - int(re.search(r"layer_(\d+)", k)[1])) for k in scales if "layer_" in k}
  for name in ("word_embeddings", "token_type_embeddings", "embedding_norm", "position"):
    assert {s for k, s in scales.items() if f"['encoder']['{name}']" in k} == {0.5 ** (n + 1)}, name
  assert {s for k, s in scales.items() if not k.startswith("['encoder']")} == {1.0}
  assert any(k.startswith("['pooler']") for k in scales)


def test_glue_electra_recipe_has_electras_values():
  config = load_config("finetune/glue", "task=rte,recipe=electra")
  assert (config.learning_rate, config.layerwise_lr_decay, config.warmup_fraction, config.weight_decay,
          config.adam_eps, config.total_epochs, config.batch_size) == (1e-4, 0.8, 0.1, 0.0, 1e-6, 10.0, 32)
  assert (config.adam_b1, config.adam_b2, config.model.dropout_rate, config.model.attention_dropout_rate) == (
      0.9, 0.999, 0.1, 0.1)
  assert load_config("finetune/glue", "task=sst2,recipe=electra").total_epochs == 3.0
  large = load_config("finetune/glue", "task=stsb,recipe=electra,size=large")
  assert (large.learning_rate, large.layerwise_lr_decay, large.total_epochs) == (5e-5, 0.9, 10.0)
  given = load_config("finetune/glue", "task=rte,recipe=electra,lr=3e-5,epochs=4")
  assert (given.learning_rate, given.total_epochs) == (3e-5, 4.0)
  tupe = load_config("finetune/glue", "task=rte")
  assert (tupe.learning_rate, tupe.layerwise_lr_decay, tupe.warmup_fraction, tupe.weight_decay,
          tupe.total_epochs) == (2e-5, 1.0, 0.06, 0.01, 10.0)
  local = load_config("finetune/glue", "task=rte,recipe=electra,runlocal")
  assert (local.learning_rate, local.total_steps, local.total_epochs, local.layerwise_lr_decay) == (1e-3, 60, None, 0.8)
  squad = load_config("finetune/squad", "recipe=electra")
  assert (squad.learning_rate, squad.total_epochs, squad.batch_size, squad.layerwise_lr_decay) == (1e-4, 2.0, 32, 0.8)
  assert (load_config("finetune/squad", "").learning_rate, load_config("finetune/squad", "").batch_size) == (3e-5, 48)


@pytest.mark.parametrize("name", ["finetune/glue", "finetune/squad"])
def test_an_unknown_recipe_is_an_error(name):
  with pytest.raises(ValueError, match=r"^unknown recipe 'nope'; allowed: \['tupe', 'electra'\]$"):
    load_config(name, "recipe=nope")


def official_layer_factor(keys, decay):
  """``model/optimization.py``'s ``_get_layer_lrs`` over the peak, on posjax's names: embeddings at depth 0,
  ``layer_i`` at ``i + 1``, the task head (``task_specific/``) at ``n + 2``; each ``decay ** (n + 2 - depth)``."""
  layer = re.fullmatch(r"layer_(\d+)", keys[1]) if keys[0] == "encoder" else None
  depth = int(layer[1]) + 1 if layer else 0 if keys[0] == "encoder" else LAYERS + 2
  return decay ** (LAYERS + 2 - depth)


def flat_params(tree):
  return {tuple(k.key for k in path): np.float64(p) for path, p in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.mark.parametrize("decay", [None, 0.8])
def test_adam_without_bias_correction_and_the_released_depths_equal_the_official_optimizer(decay):
  fields = dict(adam_bias_correction=False)
  if decay is not None:
    fields.update(layerwise_lr_decay=decay, layerwise_lr_decay_depth="released")
  got = flat_params(run(make_optimizer(optimizer_config(**fields))[0], params_tree())[0])
  want = reference_adamw(params_tree(), lambda keys: 1.0 if decay is None else official_layer_factor(keys, decay),
                         bias_correction=False)
  start = flat_params(params_tree())
  moved = max(np.abs(want[k] - start[k]).max() for k in want)
  for key, value in want.items():
    np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-5 * moved, err_msg=str(key))
  # Bias correction changes the first steps: posjax's default is not the official optimizer.
  corrected = flat_params(run(make_optimizer(optimizer_config(**{**fields, "adam_bias_correction": True}))[0],
                              params_tree())[0])
  assert max(np.abs(corrected[k] - want[k]).max() for k in want) > 0.1 * moved


def test_the_intended_depths_give_every_encoder_parameter_one_factor_of_decay_more_than_the_released():
  """posjax's default (Clark's stated intent): each encoder parameter at 1/decay of the released code's rate, the
  head at the same. One step, whose Adam step is the same for every choice, shows the ratio of the rates."""
  def first(depth):
    optimizer = make_optimizer(optimizer_config(adam_bias_correction=False, weight_decay=0.0, layerwise_lr_decay=0.8,
                                                layerwise_lr_decay_depth=depth))[0]
    return flat_params(run(optimizer, params_tree(), steps=1)[0])
  start, intended, released = flat_params(params_tree()), first("intended"), first("released")
  for key in start:
    ratio = (intended[key] - start[key]) / (released[key] - start[key])
    np.testing.assert_allclose(ratio, 1.0 / 0.8 if key[0] == "encoder" else 1.0, rtol=1e-4, err_msg=str(key))
  with pytest.raises(ValueError, match=r"layerwise_lr_decay_depth='paper' is not one of \['intended', 'released'\]"):
    make_optimizer(optimizer_config(layerwise_lr_decay=0.8, layerwise_lr_decay_depth="paper"))


def test_the_electra_schedule_is_the_official_create_optimizers():
  """``tf.train.polynomial_decay(lr, step, T, 0, power=1)`` times ``min(1, step / warmup)``: no step reaches the
  peak at 10% warm-up, where posjax's linear schedule does."""
  official = lambda step, warmup, total: PEAK * (1 - min(step, total) / total) * min(1.0, step / warmup)
  for warmup, total in ((10, 100), (7, 33)):
    schedule = learning_rate_schedule(PEAK, warmup, total, "electra")
    for step in range(total + 3):
      np.testing.assert_allclose(float(schedule(step)), official(step, warmup, total), rtol=1e-6, atol=1e-9)
  assert max(float(learning_rate_schedule(PEAK, 10, 100, "electra")(s)) for s in range(100)) < 0.91 * PEAK
  assert float(learning_rate_schedule(PEAK, 10, 100)(10)) == pytest.approx(PEAK)
  # cosine (the decoders'): linear warm-up, then peak * (f + (1 - f) * (1 + cos(pi * t)) / 2) over the remaining steps.
  def cosine(step, warmup, total, f=0.1):
    if step < warmup:
      return PEAK * step / warmup
    t = min(step - warmup, total - warmup) / (total - warmup)
    return PEAK * (f + (1 - f) * 0.5 * (1 + np.cos(np.pi * t)))
  for warmup, total in ((10, 100), (7, 33)):
    schedule = learning_rate_schedule(PEAK, warmup, total, "cosine", 0.1)
    for step in range(total + 3):
      np.testing.assert_allclose(float(schedule(step)), cosine(step, warmup, total), rtol=1e-5, atol=1e-9)
  with pytest.raises(ValueError, match=r"config.lr_schedule='step' is not one of \['linear', 'electra', 'cosine'\]"):
    make_optimizer(optimizer_config(lr_schedule="step"))


def test_a_summed_loss_gives_the_batchs_summed_gradient():
  """ELECTRA's fine-tuning loss is ``tf.reduce_sum`` over the batch: its gradient is the weight (the examples)
  times the mean's; the reported loss stays per example."""
  params = {"w": jnp.asarray([0.5, -1.0, 2.0])}
  batch = {"x": jnp.asarray(np.random.default_rng(0).normal(size=(6, 3)), jnp.float32)}

  def loss_fn(p, b, rng):
    losses = jnp.square(b["x"] @ p["w"] - 1.0)
    return jnp.sum(losses), {"weight": jnp.float32(len(losses))}

  def step(reduction):
    sgd = optax.sgd(1.0)
    state = step_lib.TrainState(jnp.int32(0), params, sgd.init(params))
    new, metrics = step_lib.train_step(state, batch, jax.random.PRNGKey(0), loss_fn=loss_fn, optimizer=sgd,
                                       schedule=lambda s: 1.0, loss_reduction=reduction)
    return params["w"] - new.params["w"], metrics["loss"]

  (mean_update, mean_loss), (sum_update, sum_loss) = step("mean"), step("sum")
  x = np.float64(batch["x"])
  want = 2 * x.T @ (x @ np.float64(params["w"]) - 1.0)
  np.testing.assert_allclose(sum_update, want, rtol=1e-5)
  np.testing.assert_allclose(mean_update, want / 6, rtol=1e-5)
  assert float(sum_loss) == pytest.approx(float(mean_loss))
