"""The contract between the training loop and what it trains: a :class:`Task` (model, batches, loss) and its
:class:`Evaluator` s. The loop knows this module alone; tasks live in :mod:`posjax.tasks` and reach the loop as
a builder, ``build_task(config, local_batch) -> Task`` (handed over by :mod:`posjax.main`).

A loss function returns the summed loss and sums (``weight`` counts the examples or tokens; ``correct`` becomes
``accuracy``; ``tokens``, where counted, the real tokens of the step), so padding rows of weight 0 change nothing
and accumulation equals one big batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import numpy as np


@dataclasses.dataclass
class Evaluator:
  """One evaluation: this process's rows of every global batch, a pure per-row ``predict(params, batch)``, and
  ``metrics(outputs, workdir)`` over the outputs of all processes' rows (concatenated in global order)."""
  batches: list[dict]
  predict: Callable[[Any, dict], dict]
  metrics: Callable[[dict, str | None], dict]
  empty: dict | None = None  # a padding batch, for processes with fewer batches than others
  unsupported: str | None = None  # why it cannot run (e.g. longer than a learned position table)
  metric_names: tuple[str, ...] = ()  # reported as "unsupported" when it cannot run


@dataclasses.dataclass
class Task:
  """What the loop needs to train and evaluate one job."""
  name: str
  model: nn.Module
  model_config: Any  # written to model_config.json (``to_dict()``): what a later run starts from
  init_inputs: dict  # one row of the model's inputs: ``model.init(rng, **init_inputs)``
  loss_fn: Callable  # (params, batch, rng) -> (summed loss, {"weight": ..., other sums})
  train_batches: Any  # an endless iterator of this process's rows, with state() / restore(state)
  evaluators: dict[str, Evaluator]
  examples_per_epoch: int | None = None
  load_init: Callable | None = None  # fresh params -> params taken from the run it starts from
  info: dict = dataclasses.field(default_factory=dict)  # written to results.json
  # Lines the loop prints before training: what the run starts from, what its numbers can mean.
  notes: tuple[str, ...] = ()
  # Run after an evaluation that config.select reports (e.g. test-set predictions, written to the workdir).
  predictors: dict[str, Evaluator] = dataclasses.field(default_factory=dict)
  # A loss with several denominators: sums over the step's whole batch, given to loss_fn as ``totals=``, and the
  # step's metrics from its summed sums (see posjax.train.step.train_step).
  loss_totals: Callable | None = None  # batch -> {name: sum}
  step_metrics: Callable | None = None  # summed sums -> {metric: value}


def summed_metrics(outputs: dict, workdir: str | None = None) -> dict:
  """``loss`` and ``accuracy`` from per-row sums (``loss``, ``correct``, ``weight``)."""
  del workdir
  weight = max(float(np.sum(outputs["weight"], dtype=np.float64)), 1.0)
  return {"loss": float(np.sum(outputs["loss"], dtype=np.float64)) / weight,
          "accuracy": float(np.sum(outputs["correct"], dtype=np.float64)) / weight}


def counted_metrics(outputs: dict, workdir: str | None = None) -> dict:
  """:func:`summed_metrics` and ``tokens``: how many predictions they average."""
  return {**summed_metrics(outputs, workdir), "tokens": int(round(float(np.sum(outputs["weight"], dtype=np.float64))))}
