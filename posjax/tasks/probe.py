"""Position probes as a task of the training loop: tiny encoders on synthetic sequences where position is the
whole difficulty, trained at one length and evaluated at multiples of it (:mod:`posjax.experiments.probes` runs
every method on every probe and tabulates them).

Every sequence is ``[CLS]`` followed by random symbols; the model labels every token:

- ``copy_left``: the symbol ``shift`` places to the left (a purely relative task);
- ``reverse``: the symbol at the mirrored place of the sequence (needs to know where the sequence ends);
- ``index``: the symbol at absolute index ``index`` (a purely absolute task).
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from posjax.data import features
from posjax.models import BertConfig, BertEncoder
from posjax.train.task import Evaluator, Task, summed_metrics

TASKS = ("copy_left", "reverse", "index")


def make_batch(task: str, rng: np.random.Generator, batch: int, length: int, symbols: int, shift: int, index: int):
  """``(input_ids, labels, weights)``, each ``[batch, length]``; id ``symbols`` is [CLS]."""
  x = rng.integers(0, symbols, size=(batch, length))
  x[:, 0] = symbols
  positions = np.arange(length)
  labels = np.zeros_like(x)
  weights = np.zeros(x.shape, np.float32)
  if task == "copy_left":
    labels[:, shift + 1:] = x[:, 1:length - shift]
    weights[:, shift + 1:] = 1
  elif task == "reverse":
    labels[:, 1:] = x[:, length - positions[1:]]
    weights[:, 1:] = 1
  elif task == "index":
    labels[:, 1:] = x[:, [index]]
    weights[:, 1:] = 1
    weights[:, index] = 0
  else:
    raise ValueError(f"unknown probe task {task!r}; allowed: {list(TASKS)}")
  return x.astype(np.int32), labels.astype(np.int32), weights


class Probe(nn.Module):
  """A BERT encoder and a per-token classifier over the probe's symbols."""

  config: BertConfig
  symbols: int

  @nn.compact
  def __call__(self, input_ids):
    h = BertEncoder(self.config, name="encoder")(input_ids).last_hidden_state
    return nn.Dense(self.symbols, name="classifier")(h).astype(jnp.float32)


def model_config(config, method: str) -> BertConfig:
  """The probe encoder of ``method`` (``config``: symbols, train_len, model), without dropout."""
  return BertConfig(vocab_size=config.symbols + 1, max_len=config.train_len, type_vocab_size=0, position=method,
                    dropout_rate=0.0, attention_dropout_rate=0.0, **config.model.to_dict())


class ProbeBatches:
  """Endless training batches of one probe task; batch ``n`` is drawn from ``[seed, task, n]`` whole and each
  process takes its rows, so the batches depend on the seed alone and restoring costs nothing."""

  def __init__(self, probe, *, seed: int, global_batch: int, length: int):
    self.probe, self.seed, self.global_batch, self.length = probe, seed, global_batch, length
    self.drawn = 0
    self._rows = features.process_rows(global_batch)

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    rng = np.random.default_rng([self.seed, TASKS.index(self.probe.task), self.drawn])
    self.drawn += 1
    return _rows(draw(self.probe, rng, self.global_batch, self.length), self._rows)

  def state(self) -> dict:
    return {"batches_drawn": self.drawn}

  def restore(self, state: dict) -> None:
    self.drawn = int(state["batches_drawn"])


def draw(probe, rng: np.random.Generator, batch: int, length: int) -> dict:
  """A global batch of the probe's task, as the loss reads it."""
  x, y, w = make_batch(probe.task, rng, batch, length, symbols=probe.symbols, shift=probe.shift, index=probe.index)
  return {"input_ids": x, "labels": y, "weights": w}


def _rows(batch: dict, rows: slice) -> dict:
  return {k: v[rows] for k, v in batch.items()}


def build(config, local_batch: int) -> Task:
  """One (method, task) probe for the training loop (``config.task = "probe"``, ``config.probe``: method, task,
  symbols, shift, index, eval_multiples); evaluators of kind ``probe`` report token accuracy at each multiple
  of the training length as ``<name>@<length>`` (``unsupported`` beyond a learned table)."""
  del local_batch
  probe = config.probe
  if probe.task not in TASKS:
    raise ValueError(f"unknown probe task {probe.task!r}; allowed: {list(TASKS)}")
  settings = ml_collections.ConfigDict(dict(symbols=probe.symbols, train_len=config.max_len, model=config.model))
  bert = model_config(settings, probe.method)
  model = Probe(bert, probe.symbols)

  def token_sums(params, batch):
    logits = model.apply({"params": params}, batch["input_ids"])
    weights = batch["weights"]
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
    correct = (jnp.argmax(logits, -1) == batch["labels"]).astype(jnp.float32)
    return {"loss": jnp.sum(losses * weights, -1), "correct": jnp.sum(correct * weights, -1),
            "weight": jnp.sum(weights, -1)}

  def loss_fn(params, batch, rng):
    del rng  # no dropout
    rows = token_sums(params, batch)
    return jnp.sum(rows["loss"]), {"correct": jnp.sum(rows["correct"]), "weight": jnp.sum(rows["weight"])}

  eval_batch = config.get("eval_batch_size") or config.batch_size
  evaluators = {}
  for name in config.evals:
    for multiple in probe.eval_multiples:
      length = config.max_len * multiple
      try:
        bert.position_spec.check_length(length)
      except ValueError as error:
        evaluators[f"{name}@{length}"] = Evaluator([], token_sums, None, unsupported=str(error),
                                                         metric_names=("accuracy",))
        continue
      batch = draw(probe, np.random.default_rng([config.seed, 99, multiple]), eval_batch, length)
      evaluators[f"{name}@{length}"] = Evaluator([_rows(batch, features.process_rows(eval_batch))],
                                                       token_sums, summed_metrics)
  batches = ProbeBatches(probe, seed=config.seed, global_batch=config.batch_size, length=config.max_len)
  return Task(f"probe/{probe.task}", model, bert, {"input_ids": jnp.zeros((1, config.max_len), jnp.int32)},
                    loss_fn, batches, evaluators, info={"position": bert.position})
