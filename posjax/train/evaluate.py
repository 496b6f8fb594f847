"""Evaluation inside a run: every evaluator over every process's rows, the predictors (e.g. test-set files) of
the evaluation that ``config.select`` reports, and ``results.json`` (see :mod:`posjax.results`); and evaluation
alone, of another run's checkpoint (:func:`checkpoint_results`)."""

from __future__ import annotations

import os

import flax.linen as nn
import jax
import numpy as np
from absl import logging

from posjax import results as results_lib
from posjax.data import features
from posjax.train import checkpoint as checkpoint_lib
from posjax.train import sharding, validate
from posjax.train.task import Evaluator


def evaluation(evaluators: dict[str, Evaluator], parallel, workdir: str | None):
  """``evaluate(state) -> {name: {metric: value}}`` over every evaluator.

  Every process runs the same number of batches (each batch is a collective): a process with fewer fills in
  padding batches, which weigh nothing. Outputs are gathered to every process, so each computes the metrics
  of all rows; ``workdir`` (process 0's) receives any files an evaluator writes (e.g. SQuAD predictions)."""
  counts = {name: int(sharding.per_process(np.int32(len(ev.batches))).max())
            for name, ev in evaluators.items() if ev.unsupported is None}
  compiled = {name: parallel.compile_predict(ev.predict) for name, ev in evaluators.items() if name in counts}

  def evaluate(state) -> dict:
    results = {}
    for name, ev in evaluators.items():
      if ev.unsupported is not None:
        logging.info("%s: unsupported (%s)", name, ev.unsupported)
        results[name] = {metric: results_lib.UNSUPPORTED for metric in ev.metric_names}
        continue
      batches = ev.batches + [ev.empty] * (counts[name] - len(ev.batches))
      outputs = [jax.device_get(compiled[name](state.params, parallel.put_batch(b))) for b in batches]
      results[name] = ev.metrics(features.join_outputs(outputs), workdir)
    return results

  return evaluate


def predict_if_reported(config, log: results_lib.EvaluationLog, step: int, predict, predictors: dict,
                         state) -> None:
  """Runs the task's predictors (e.g. test-set files) when this step's evaluation is the one results.json reports
  (so far): for ``select="last"`` the last step, for ``best`` each new best. Process 0 decides (it alone holds the
  evaluations of an earlier attempt when the workdir is not shared), and every process follows it."""
  if not predictors:
    return
  how = config.get("select", "last")
  if how == "last":
    reported = step == config.total_steps
  else:
    reported = results_lib.select(log.evaluations, how, config.get("select_metric", ""))["step"] == step
  if sharding.per_process(np.int32(reported))[0]:
    predict(state)


def write_results(path: str, config, task, step: int, log: results_lib.EvaluationLog, is_main: bool, say,
                  info: dict | None = None) -> None:
  """``results.json``: what the run was (``info``: more of it), its evaluations and the one ``config.select``
  reports (what sweeps and reports read)."""
  if is_main:
    info = {"task": task.name, "step": step, "seed": config.seed, "learning_rate": config.learning_rate, **task.info,
            **(info or {})}
    results_lib.write_json(path, results_lib.run_results(info, log.evaluations, config.get("select", "last"),
                                                          config.get("select_metric", "")))
    say(f"results in {path}")


def checkpoint_results(config, source: str, workdir: str, build_task) -> dict:
  """Evaluates the last checkpoint of another, finished run (``source``: its workdir, whose ``results.json`` names
  that step, or a converted model's, its latest checkpoint) with ``config``'s evaluators, training nothing: ``workdir`` gets ``config.json`` and ``results.json``
  (``evaluated_from``: ``source``), ``source`` is only read. ``config`` must build the model that run trained (its own
  config, other evaluators); a parameter missing on either side is an error. Returns ``{evaluator: {metric:
  value}}``."""
  finished = results_lib.read_json(os.path.join(source, "results.json"))
  if finished is None and not os.path.isdir(os.path.join(source, "checkpoints")):
    raise FileNotFoundError(f"{source} has no results.json and no checkpoints: not a finished run or a converted "
                            "model")
  step = int(finished["step"]) if finished else checkpoint_lib.latest_step(source)
  validate.check_vocabulary(config, workdir, write=False, sources=(source,))
  prepared = validate.validate_everywhere(config, workdir, build_task)
  parallel, task = prepared.parallel, prepared.task
  is_main = jax.process_index() == 0
  os.makedirs(workdir, exist_ok=True)
  validate.check_workdir_config(config, workdir)
  fresh = parallel.to_checkpoint(parallel.init(lambda rng: nn.unbox(prepared.init_boxed(rng)), prepared.init_rng))
  params, created, unused = checkpoint_lib.merge_params(fresh.params, checkpoint_lib.load_params(source, step))
  if created or unused:
    raise ValueError(f"the checkpoint of {source} (step {step}) does not fit the model of the config it is evaluated "
                     f"with: parameters not in the checkpoint {created[:3]}, not in the model {unused[:3]}")
  state = parallel.from_checkpoint(fresh.replace(params=params))
  metrics = evaluation(task.evaluators, parallel, workdir if is_main else None)(state)
  log = results_lib.EvaluationLog(workdir, step, enabled=is_main)
  log.append(step, metrics)
  write_results(os.path.join(workdir, "results.json"), config, task, step, log, is_main, lambda message: None,
                info={"evaluated_from": os.path.abspath(source)})
  return metrics
