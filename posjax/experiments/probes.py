"""The position probes of ``make demo``: one tiny encoder per position method and probe task
(:mod:`posjax.tasks.probe`: copy the symbol to the left, reverse, copy an absolute index; opt-in, Kazemnejad et al.
2023's copy, sort, parity and addition), each trained by the training loop at one length and evaluated at 1×, 2× and
4× that length (Huang et al.'s inductive question: which methods work on sequences longer than seen in training).
With ``model.causal=True`` the probe models are decoders, as Kazemnejad et al.'s, and the tasks take their decoder
form. ``run(config, workdir, train)`` takes the loop as ``train(config, workdir)`` (:mod:`posjax.main` composes it);
the length harness (:mod:`posjax.experiments.length`) runs it too.

A method with a learned table of positions cannot encode the longer sequences: its cells say
``unsupported`` instead of clamping. Results go to ``results.md`` / ``results.json`` in the workdir, with
``accuracy_vs_length.png`` and, for ``tupe_a``, ``tupe_correlation.png`` (its learned positional correlation,
one map per head). Each (method, task) result is written as soon as it is done, and a restarted run skips
finished ones.
"""

from __future__ import annotations

import json
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import ml_collections

from posjax import config_args
from posjax import results as results_lib
from posjax.config_args import NON_NEGATIVE, POSITIVE, at_least
from posjax.experiments import plots
from posjax.tasks import probe as probe_task
from posjax.train import validate as run_checks



def rows(config) -> dict[str, tuple[str, dict]]:
  """The table's rows: ``{name: (position method, model fields)}``, the methods then the hybrid layouts
  (``config.layouts`` over ``config.layout_method``, :mod:`posjax.models.hybrid`, with ``config.layout_options``;
  named by the layout, with the method where it is not RoPE)."""
  found = {method: (method, {}) for method in config.methods}
  method = config.get("layout_method", "rope")
  for name in config.get("layouts") or ():
    options = dict((config.get("layout_options") or {}).get(name, {}))
    found[name if method == "rope" else f"{name} ({method})"] = (method, {"layout": name, "layout_options": options})
  return found


def run_config(config, method: str, task: str, model: dict | None = None) -> ml_collections.ConfigDict:
  """The training-loop config of one (method, task) probe (``model``: fields over ``config.model``'s)."""
  return ml_collections.ConfigDict(dict(
      task="probe", seed=config.seed, total_steps=config.steps, warmup_steps=config.warmup_steps,
      learning_rate=config.learning_rate, batch_size=config.batch_size, eval_batch_size=config.eval_batch_size,
      max_len=config.train_len, grad_accum_steps=1, adam_b1=0.9, adam_b2=0.999, adam_eps=1e-8,
      weight_decay=0.01, weight_decay_exclusion="none", grad_clip_norm=1.0, parallelism="jit",
      mesh=dict(data=-1, fsdp=1, tensor=1), log_every_steps=config.steps, eval_every_steps=config.steps,
      checkpoint_every_steps=config.steps, keep_checkpoints=1, keep_steps=(), tensorboard=False,
      profile_start_step=-1, profile_steps=1, progress=False, model={**config.model.to_dict(), **(model or {})},
      probe=dict(method=method, task=task, symbols=config.symbols, shift=config.shift, index=config.index,
                 eval_multiples=tuple(config.eval_multiples)),
      evals=dict(probe=dict(kind="probe"))))


def train_and_evaluate(config, method: str, task: str, workdir: str, train, model: dict | None = None):
  """``({length: accuracy or "unsupported"}, params)``: one probe trained by the training loop in ``workdir``
  (a killed run resumes there)."""
  params = train(run_config(config, method, task, model), workdir)
  with open(os.path.join(workdir, "results.json")) as f:
    metrics = json.load(f)["metrics"]
  return {config.train_len * m: metrics[f"probe@{config.train_len * m}"]["accuracy"]
          for m in config.eval_multiples}, params


def results_table(results: dict, config) -> str:
  """The probes' markdown table: a row per method, accuracy (%) per task and evaluation length."""
  lengths = [config.train_len * m for m in config.eval_multiples]
  header = "| method | " + " | ".join(f"{t} @{l}" for t in config.tasks for l in lengths) + " |"
  lines = [header, "|" + "---|" * (1 + len(config.tasks) * len(lengths))]
  for method in rows(config):
    cells = []
    for task in config.tasks:
      for length in lengths:
        value = results.get(method, {}).get(task, {}).get(str(length))
        cells.append("—" if value is None else results_lib.UNSUPPORTED if value == results_lib.UNSUPPORTED else f"{100 * value:.1f}")
    lines.append(f"| `{method}` | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def plot_accuracy(results: dict, config, path: str):
  """Accuracy against evaluation length, one panel per task; returns the figure (closed). Methods that only run at
  the training length (a learned table) are single points, set side by side to its left so that none hides
  another."""
  plt = plots.pyplot()
  names = list(rows(config))
  styles = plots.method_styles(names)
  lengths = [config.train_len * m for m in config.eval_multiples]
  fig, axes = plt.subplots(1, len(config.tasks), figsize=(5 * len(config.tasks), 4), squeeze=False)
  short = [m for m in names if any(results_lib.UNSUPPORTED in results.get(m, {}).get(t, {}).values()
                                   for t in config.tasks)]
  for ax, task in zip(axes[0], config.tasks):
    for method in names:
      values = [results.get(method, {}).get(task, {}).get(str(l)) for l in lengths]
      points = [(l, v) for l, v in zip(lengths, values) if isinstance(v, float)]
      if not points:
        continue
      style = styles[method]
      if method in short:  # side by side left of the training length, clear of the lines' markers there
        shift = -0.2 - 0.5 * short.index(method) / max(len(short) - 1, 1)
        ax.plot([l * 2 ** shift for l, _ in points], [v for _, v in points], **{**style, "linestyle": "none"},
                label=f"{method} (≤ {config.train_len} only)")
      else:
        ax.plot(*zip(*points), label=method, **style)
    plots.length_axis(ax, lengths, config.train_len)
    ax.set(title=task, xlabel="evaluation length", ylabel="accuracy", ylim=(0, 1.04),
           xlim=(lengths[0] * 2 ** -0.9, lengths[-1] * 2 ** 0.2))
  axes[0][-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
  fig.suptitle(f"trained at length {config.train_len} (dotted line)")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return fig


def plot_tupe_correlation(config, params, path: str) -> None:
  """The learned positional correlation of a TUPE-A probe: one ``[L, L]`` map per head (TUPE's Figure 6)."""
  plt = plots.pyplot()
  model = probe_task.Probe(probe_task.model_config(config, "tupe_a", config.tasks[0]),
                           probe_task.classes(config.tasks[0], config.symbols))
  _, state = model.apply({"params": params}, jnp.zeros((1, config.train_len), jnp.int32), mutable=["intermediates"])
  bias_HxLxL = np.asarray(state["intermediates"]["encoder"]["position_bias"][0][0])
  plots.head_maps(bias_HxLxL, path, "TUPE-A learned positional correlation", panel=(3.0, 3.0), tick_every=4)


RANGES = {"steps": POSITIVE, "warmup_steps": NON_NEGATIVE, "learning_rate": NON_NEGATIVE, "batch_size": POSITIVE,
          "eval_batch_size": POSITIVE, "symbols": at_least(2), "train_len": at_least(2), "shift": POSITIVE,
          "index": POSITIVE}


def validate(config) -> None:
  """Every check that can fail before the workdir is written: ranges, tasks (their decoder form with
  ``model.causal``), methods and their models."""
  config_args.check_ranges(config, RANGES)
  unknown = sorted(set(config.tasks) - set(probe_task.TASKS))
  if unknown:
    raise ValueError(f"unknown probe task(s) {unknown}; allowed: {list(probe_task.TASKS)}")
  for task in config.tasks:
    probe_task.check(task, causal=bool(config.model.get("causal", False)), symbols=config.symbols,
                     length=config.train_len)
  if config.warmup_steps > config.steps:
    raise ValueError(f"config.steps={config.steps} is shorter than the learning-rate warm-up "
                     f"(config.warmup_steps={config.warmup_steps}); give at least as many steps")
  for field in ("shift", "index"):
    if config[field] >= config.train_len:
      raise ValueError(f"config.{field}={config[field]} must be below config.train_len={config.train_len}")
  if not config.eval_multiples or any(m < 1 for m in config.eval_multiples):
    raise ValueError(f"config.eval_multiples={tuple(config.eval_multiples)} must be whole numbers >= 1")
  task = config.tasks[0] if config.tasks else probe_task.TASKS[0]  # its vocabulary changes nothing checked here
  for method, fields in rows(config).values():
    model_config = probe_task.model_config(ml_collections.ConfigDict({**config.to_dict(), "model": {
        **config.model.to_dict(), **fields}}), method, task)
    model = probe_task.Probe(model_config, probe_task.classes(task, config.symbols))
    jax.eval_shape(model.init, jax.random.PRNGKey(0), jax.ShapeDtypeStruct((1, config.train_len), jnp.int32))


def run(config, workdir: str, train) -> dict:
  """Trains and evaluates every (method, task) not yet in ``workdir``'s results, each a run of the training
  loop in ``workdir/runs/<row>/<task>`` (a row: a method or a layout, :func:`rows`). The workdir's config must
  match (``methods``, ``tasks`` and the layouts excepted: a run may add rows or tasks to a table; a layout's results
  are kept while its name is). Compiled programs are cached in ``workdir/compilation_cache`` (JAX's persistent
  cache): a method's three tasks compile the same programs, and a rerun compiles nothing."""
  validate(config)
  os.makedirs(workdir, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", os.path.join(workdir, "compilation_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  path = os.path.join(workdir, "results.json")
  known = os.path.exists(os.path.join(workdir, "config.json"))
  run_checks.check_workdir_config(config, workdir, ignore=("methods", "tasks", "layouts", "layout_options"))
  results = {}
  if os.path.exists(path) and known:
    with open(path) as f:
      results = json.load(f)
  elif os.path.exists(path):
    print(f"{path} has no config.json beside it, so its results cannot be checked: computing them anew", flush=True)
  correlation_plot = os.path.join(workdir, "tupe_correlation.png")
  start = time.perf_counter()
  for method, (position, fields) in rows(config).items():
    for task in config.tasks:
      plot = method == "tupe_a" and task == config.tasks[0] and not os.path.exists(correlation_plot)
      if task in results.get(method, {}) and not plot:
        continue
      directory = os.path.join(workdir, "runs", re.sub(r"[^A-Za-z0-9_.-]+", "_", method), task)
      accuracy, params = train_and_evaluate(config, position, task, directory, train, fields)
      results.setdefault(method, {})[task] = {str(length): value for length, value in accuracy.items()}
      if plot and jax.process_index() == 0:
        plot_tupe_correlation(config, params, correlation_plot)
      results_lib.write_json(path, results, sort_keys=False)
      cells = ", ".join(f"@{l}: {v if v == results_lib.UNSUPPORTED else f'{100 * v:.0f}%'}" for l, v in accuracy.items())
      print(f"[{time.perf_counter() - start:5.0f}s] {method:>10} {task:<9} {cells}", flush=True)
  table = results_table(results, config)
  with open(os.path.join(workdir, "results.md"), "w") as f:
    f.write(f"Probe accuracy (%), trained at length {config.train_len}, {config.steps} steps\n\n{table}\n")
  plot_accuracy(results, config, os.path.join(workdir, "accuracy_vs_length.png"))
  written = ["results.md", "results.json", "accuracy_vs_length.png"] + (
      ["tupe_correlation.png"] if "tupe_a" in config.methods and os.path.exists(correlation_plot) else [])
  print("\n" + table + f"\n\nwritten to {workdir}: {', '.join(written)}", flush=True)
  return results
