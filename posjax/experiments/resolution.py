"""The resolution probe (``configs/resolution.py``): one tiny vision transformer per position method and image task
(:mod:`posjax.tasks.vision`), each trained by the training loop at one grid of patches and evaluated at larger ones,
the images' question of the length harness (rope-vit, Heo et al. 2024: which position methods keep their accuracy
when a ViT reads images larger than it was trained on). A learned 2-D table is read at a larger grid resized to it
(:attr:`posjax.positions.base.Method.regrid`, ViT's practice); a 1-D learned table past its length is
``unsupported``.

Each (method, task) trains ``seeds`` times (seeds ``seed``, ``seed + 1``, ...: the initialisation and the batches);
the table gives the mean accuracy over them and, with several, their standard deviation. Results go to
``results.md`` / ``results.json`` (every seed's accuracy) in the workdir; each (method, task) is written as soon as
its seeds are done, and a restarted run skips finished ones (its config must match, ``methods`` and ``tasks``
excepted: rows and tasks may be added; a method's ``options`` are part of the config). Every seed is evaluated on
the same images. ``run(config, workdir, train)`` takes the loop as ``train(config, workdir)`` (:mod:`posjax.main`
composes it).
"""

from __future__ import annotations

import json
import os
import time

import jax
import ml_collections
import numpy as np

from posjax import config_args
from posjax import results as results_lib
from posjax.config_args import NON_NEGATIVE, POSITIVE
from posjax.positions import base
from posjax.tasks import vision as vision_task
from posjax.train import validate as run_checks

RANGES = {"steps": POSITIVE, "warmup_steps": NON_NEGATIVE, "learning_rate": NON_NEGATIVE, "batch_size": POSITIVE,
          "eval_batch_size": POSITIVE, "seeds": POSITIVE}


def settings(config, method: str, task: str) -> ml_collections.ConfigDict:
  """The ``config.vision`` of one (method, task) run."""
  return ml_collections.ConfigDict(dict(
      method=method, options=dict((config.get("options") or {}).get(method, {})), task=task, grid=config.grid,
      patch_size=config.patch_size, channels=config.channels, segment=config.segment,
      scale_objects=config.scale_objects, noise=config.noise, pooling=config.pooling,
      eval_grids=tuple(config.eval_grids)))


def run_config(config, method: str, task: str, seed: int) -> ml_collections.ConfigDict:
  """The training-loop config of one (method, task) image probe with ``seed``."""
  vision = settings(config, method, task)
  return ml_collections.ConfigDict(dict(
      task="vision", seed=seed, total_steps=config.steps, warmup_steps=config.warmup_steps,
      learning_rate=config.learning_rate, batch_size=config.batch_size, eval_batch_size=config.eval_batch_size,
      max_len=vision_task.tokens(vision, config.grid), grad_accum_steps=1, adam_b1=0.9, adam_b2=0.999,
      adam_eps=1e-8, weight_decay=0.01, weight_decay_exclusion="none", grad_clip_norm=1.0, parallelism="jit",
      mesh=dict(data=-1, fsdp=1, tensor=1), log_every_steps=config.steps, eval_every_steps=config.steps,
      checkpoint_every_steps=config.steps, keep_checkpoints=1, keep_steps=(), tensorboard=False,
      profile_start_step=-1, profile_steps=1, progress=False, model=config.model.to_dict(),
      vision=vision, evals=dict(vision=dict(kind="vision"))))


def validate(config) -> None:
  """Every check that can fail before the workdir is written: ranges, the images' settings, the methods."""
  config_args.check_ranges(config, RANGES)
  if config.warmup_steps > config.steps:
    raise ValueError(f"config.steps={config.steps} is shorter than the learning-rate warm-up "
                     f"(config.warmup_steps={config.warmup_steps}); give at least as many steps")
  stray = sorted(set(config.get("options") or {}) - set(config.methods))
  if stray:
    raise ValueError(f"config.options names {stray}, which are not among config.methods {list(config.methods)}")
  for task in config.tasks:
    for method in config.methods:
      base.get(method)  # an unknown name: its one line, listing the registry
      vision_task.check(settings(config, method, task))
      vision_task.model_config(settings(config, method, task), config.model)


def cell(values) -> str:
  """A cell of the table: ``unsupported``, or the mean accuracy (%) over the seeds, ``± std`` with several."""
  if values == results_lib.UNSUPPORTED:
    return values
  mean = 100 * float(np.mean(values))
  return f"{mean:.1f}" if len(values) == 1 else f"{mean:.1f} ± {100 * float(np.std(values)):.1f}"


def results_table(results: dict, config) -> str:
  """A row per method, accuracy (%) per task and grid (the mean over the seeds); the training grid first."""
  header = "| method | " + " | ".join(f"{t} {g}×{g}" for t in config.tasks for g in config.eval_grids) + " |"
  lines = [header, "|" + "---|" * (1 + len(config.tasks) * len(config.eval_grids))]
  for method in config.methods:
    cells = []
    for task in config.tasks:
      for grid in config.eval_grids:
        value = results.get(method, {}).get(task, {}).get(str(grid))
        cells.append("—" if value is None else cell(value))
    lines.append(f"| `{method}` | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def run(config, workdir: str, train) -> dict:
  """Trains and evaluates every (method, task) not yet in ``workdir``'s results, each seed a run of the training loop
  in ``workdir/runs/<method>/<task>/seed<seed>``; writes the table."""
  validate(config)
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, "results.json")
  run_checks.check_workdir_config(config, workdir, ignore=("methods", "tasks"))
  results = {}
  if os.path.exists(path):
    with open(path) as f:
      results = json.load(f)
  start = time.perf_counter()
  for method in config.methods:
    for task in config.tasks:
      if task in results.get(method, {}):
        continue
      accuracy = {str(g): [] for g in config.eval_grids}
      for seed in range(config.seed, config.seed + config.seeds):
        directory = os.path.join(workdir, "runs", method, task, f"seed{seed}")
        train(run_config(config, method, task, seed), directory)
        with open(os.path.join(directory, "results.json")) as f:
          metrics = json.load(f)["metrics"]
        for g in config.eval_grids:
          found = metrics[f"vision@{g}"]
          if found.get("loss") is not None and found["loss"] != results_lib.UNSUPPORTED and not np.isfinite(
              found["loss"]):
            raise ValueError(f"{directory}: the evaluation at {g}x{g} has a non-finite loss ({found['loss']}); its "
                             "accuracy would be a NaN's argmax")
          accuracy[str(g)].append(found["accuracy"])
      accuracy = {g: results_lib.UNSUPPORTED if results_lib.UNSUPPORTED in v else v for g, v in accuracy.items()}
      results.setdefault(method, {})[task] = accuracy
      if jax.process_index() == 0:
        results_lib.write_json(path, results, sort_keys=False)
      cells = ", ".join(f"{g}×{g}: {cell(v)}" for g, v in accuracy.items())
      print(f"[{time.perf_counter() - start:5.0f}s] {method:>13} {task:<11} {cells}", flush=True)
  table = results_table(results, config)
  if jax.process_index() == 0:
    with open(os.path.join(workdir, "results.md"), "w") as f:
      f.write(f"Image probe accuracy (%), trained on {config.grid}×{config.grid} patches, {config.steps} steps, "
              f"{config.seeds} seed(s)\n\n"
              f"{table}\n")
  print("\n" + table + f"\n\nwritten to {workdir}: results.md, results.json", flush=True)
  return results
