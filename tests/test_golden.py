"""Golden values per position method at a fixed seed: the parameter shapes of a tiny MLM model and its loss
over two training steps (before and after one update), from parameters drawn at random so that no position
term hides behind a zero or one initialisation; the first step's gradient (the optimizer's first moment) reaches
every parameter. Any change to a method's parameters, forward pass,
initialisation or the train step shows up here; an intended change regenerates the file:

  POSJAX_REGENERATE_GOLDEN=1 python -m pytest tests/test_golden.py

ELECTRA has its own file (two methods: absolute, whose table goes with the shared embeddings, and TUPE-A with
its table shared), with the joint loss and its parts.
"""

import functools
import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from posjax import positions
from posjax.data import corpus, mlm, synthetic
from posjax.data.tokenizer import Tokenizer
from posjax.models import TransformerConfig, Transformer
from posjax.tasks import mlm as mlm_task
from conftest import one_axis
from posjax.train.step import TrainState, make_optimizer, train_step
from conftest import ROOT, randomize

GOLDEN = ROOT / "tests" / "golden" / "mlm_two_steps.json"
REGENERATE = os.environ.get("POSJAX_REGENERATE_GOLDEN") == "1"


def one_batch(tokenizer):
  data = ml_collections.ConfigDict(dict(source="text", train_files=os.path.join(synthetic.BUILTIN_DIR, "tiny_train.txt")))
  return next(mlm.MlmBatches(functools.partial(corpus.documents, data, "train"), tokenizer, max_len=32, batch_size=4,
                             seed=0))


# Methods with options whose parameters or gradients differ from their defaults', beside every method at its defaults
OPTIONS = {"tupe_r-cls_reset=paper": ("tupe_r", {"cls_reset": "paper"}),
           "tupe_a-share_across_layers=False": ("tupe_a", {"share_across_layers": False}),
           "shaw-value_term=True": ("shaw", {"value_term": True}),
           "huang_m4-share_across_layers=True,impl=skew": ("huang_m4", {"share_across_layers": True, "impl": "skew"})}
CASES = {**{name: (name, {}) for name in one_axis(positions.names())}, **OPTIONS}


def measure(case: str) -> dict:
  method, options = CASES[case]
  tokenizer = Tokenizer.load(os.path.join(synthetic.BUILTIN_DIR, "tiny_vocab.txt"))
  model = Transformer(TransformerConfig.tiny(position=method, position_options=options, vocab_size=tokenizer.vocab_size,
                                             max_len=32, causal=positions.get(method).decoder_only), head="mlm")
  params = randomize(jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.ones((1, 32), jnp.int32))["params"], scale=0.5)
  # FIRE's threshold L is its initial value (8 here) times a multiplier: at 4 + |drawn|, L is past the batch's 32
  # positions, so that every query's normaliser reads it and its gradient flows
  params = jax.tree_util.tree_map_with_path(
      lambda path, p: 4 + abs(p) if "threshold_multiplier" in jax.tree_util.keystr(path) else p, params)
  optimizer, schedule = make_optimizer(ml_collections.ConfigDict(dict(
      learning_rate=1e-3, warmup_steps=0, total_steps=10, grad_clip_norm=1.0, adam_b1=0.9, adam_b2=0.999,
      adam_eps=1e-6, weight_decay=0.01)))
  state = TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params))
  step = jax.jit(functools.partial(train_step, loss_fn=mlm_task.mlm_loss(model), optimizer=optimizer, schedule=schedule))
  batch = one_batch(tokenizer)
  losses = []
  for i in range(2):
    state, metrics = step(state, batch, jax.random.PRNGKey(1))
    losses.append(float(metrics["loss"]))
    if i == 0:  # Adam's first moment after one step: (1 - b1) times the (clipped) gradient
      adam = next(s for s in jax.tree.leaves(state.opt_state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))
                  if isinstance(s, optax.ScaleByAdamState))
      unreached = [jax.tree_util.keystr(path) for path, m in jax.tree_util.tree_leaves_with_path(adam.mu)
                   if not np.all(np.isfinite(m)) or not np.abs(np.asarray(m)).max() > 0]
  shapes = {jax.tree_util.keystr(path): list(np.shape(leaf))
            for path, leaf in jax.tree_util.tree_leaves_with_path(params)}
  return {"losses": losses, "param_shapes": shapes, "unreached": unreached}


def golden() -> dict:
  return json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}


@pytest.mark.parametrize("case", CASES)
def test_parameter_shapes_and_two_step_loss_match_the_golden_file_and_every_parameter_has_a_gradient(case):
  got = measure(case)
  assert got.pop("unreached") == [], "no finite, non-zero gradient reaches these parameters"
  if REGENERATE:
    pytest.skip(f"regenerating: {case} measured")
  want = golden().get(case)
  assert want is not None, f"{GOLDEN} has no entry for {case}: regenerate it (see this file's docstring)"
  assert got["param_shapes"] == want["param_shapes"]
  # CPU float32; the tolerance covers other CPUs' vectorisation, not a change of a method (switching
  # sinusoidal embeddings off moves the loss by 2e-5 of itself, ALiBi's bias by 2e-4).
  np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-5)
  assert got["losses"][1] != got["losses"][0]  # the update happened


def test_golden_file_covers_every_method():
  if REGENERATE:
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps({case: {k: v for k, v in measure(case).items() if k != "unreached"}
                                  for case in CASES}, indent=1, sort_keys=True) + "\n")
  assert sorted(golden()) == sorted(CASES)


ELECTRA_GOLDEN = ROOT / "tests" / "golden" / "electra_two_steps.json"
ELECTRA_METHODS = ("absolute", "tupe_a")  # embeddings shared with the input table; TUPE's table shared in the layers


def measure_electra(method: str) -> dict:
  """A tiny ELECTRA (generator half the discriminator's width) over two steps: the joint loss and its parts."""
  from posjax.models.electra import Electra
  from posjax.tasks import electra

  tokenizer = Tokenizer.load(os.path.join(synthetic.BUILTIN_DIR, "tiny_vocab.txt"))
  discriminator = TransformerConfig.tiny(position=method, vocab_size=tokenizer.vocab_size, max_len=32)
  generator = TransformerConfig.tiny(position=method, vocab_size=tokenizer.vocab_size, max_len=32, hidden_size=16,
                                     num_heads=2, intermediate_size=32, embedding_size=32)
  model = Electra(generator, discriminator, share_position_table=method == "tupe_a")
  params = randomize(jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.ones((1, 32), jnp.int32))["params"], scale=0.5)
  optimizer, schedule = make_optimizer(ml_collections.ConfigDict(dict(
      learning_rate=1e-3, warmup_steps=0, total_steps=10, grad_clip_norm=1.0, adam_b1=0.9, adam_b2=0.999,
      adam_eps=1e-6, weight_decay=0.01)))
  state = TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params))
  step = jax.jit(functools.partial(
      train_step, loss_fn=electra.electra_loss(model, discriminator_weight=50.0, temperature=1.0, use_segments=False),
      optimizer=optimizer, schedule=schedule, loss_totals=electra.loss_totals,
      step_metrics=functools.partial(electra.metrics, discriminator_weight=50.0)))
  batch = one_batch(tokenizer)
  measured = {"loss": [], "mlm_loss": [], "disc_loss": [], "replaced_fraction": []}
  for _ in range(2):
    state, metrics = step(state, batch, jax.random.PRNGKey(1))
    for name in measured:
      measured[name].append(float(metrics[name]))
  shapes = {jax.tree_util.keystr(path): list(np.shape(leaf))
            for path, leaf in jax.tree_util.tree_leaves_with_path(params)}
  return {**measured, "param_shapes": shapes}


@pytest.mark.parametrize("method", ELECTRA_METHODS)
def test_an_electra_models_shapes_and_two_steps_match_the_golden_file(method):
  got = measure_electra(method)
  if REGENERATE:
    entries = json.loads(ELECTRA_GOLDEN.read_text()) if ELECTRA_GOLDEN.exists() else {}
    ELECTRA_GOLDEN.write_text(json.dumps({**entries, method: got}, indent=1, sort_keys=True) + "\n")
    pytest.skip(f"regenerating: ELECTRA {method} measured")
  want = json.loads(ELECTRA_GOLDEN.read_text()).get(method)
  assert want is not None, f"{ELECTRA_GOLDEN} has no entry for {method}: regenerate it (see this file's docstring)"
  assert got["param_shapes"] == want["param_shapes"]
  for name in ("loss", "mlm_loss", "disc_loss", "replaced_fraction"):
    np.testing.assert_allclose(got[name], want[name], rtol=1e-5, err_msg=name)
  assert got["loss"][1] != got["loss"][0]
