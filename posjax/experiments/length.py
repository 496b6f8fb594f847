"""The length-generalisation harness: each position method trained at one length by the training loop (a decoder on
next-token prediction: ``model="lm"``, the Llama-family decoder of ``configs/lm.py``, or ``"clm"``, a causal BERT;
or an encoder on MLM, ``model="mlm"``) and evaluated on held-out text of the
same corpus at 1x, 2x, 4x, 8x and 16x that length (the corpus evaluators' ``length_multiple``). ``run(config,
workdir, train, evaluate)`` takes the loop as ``train(config, workdir)`` and evaluation alone as ``evaluate(config,
source, workdir)`` (:mod:`posjax.main` composes both).

It writes ``length.md`` (a table per measure, method x length: perplexity, next-token or masked-token, token accuracy
and, for a decoder with ``config.passkey``, passkey retrieval of whole keys and of key tokens,
:mod:`posjax.tasks.passkey`), ``length.json`` and ``length.png`` (perplexity against length, one line per method) in
the workdir. A method with a learned position table reports ``unsupported`` past it, never clamped. Each method runs
in ``workdir/runs/<method>``; a restarted harness skips finished methods (and a killed run resumes).

``config.probes`` (probe tasks, :mod:`posjax.tasks.probe`) runs the position probes too
(:func:`posjax.experiments.probes.run` in ``workdir/probes``: a tiny probe model per method and task, a decoder for
``model="lm"`` / ``"clm"``, trained at the probes' own length and evaluated at the same multiples) and adds a table per probe
task to ``length.md`` (method x length, token accuracy).

``config.runs`` names finished runs (workdirs of ``python -m posjax.main --config=configs/lm.py ...``, ``clm.py``
for ``model="clm"``, ``pretrain.py`` for ``model="mlm"``) to read instead of training: each run's last checkpoint is evaluated, with its
own config (model, corpus, tokenizer) and the harness's evaluators, in ``workdir/runs/<method>`` (``<method>``: the
run's position method, one run per method; a method in both ``methods`` and ``runs`` is read, not trained). A run
must be of the harness's model and trained at ``train_len``.
"""

from __future__ import annotations

import json
import math
import os
import time

import jax
import ml_collections

from posjax import config_args
from posjax import results as results_lib
from posjax.config_args import POSITIVE
from posjax.experiments import plots, probes
from posjax.train import validate as run_checks

MODELS = {"lm": "configs/lm.py", "clm": "configs/clm.py", "mlm": "configs/pretrain.py"}
TASKS = {"lm": "clm", "clm": "clm", "mlm": "mlm"}  # the training task (and evaluator kind) of each model
DECODERS = ("lm", "clm")
# passkey: the fraction of prompts whose whole key is retrieved; passkey_digits: of the key's tokens (chance: one in
# the number of symbols).
MEASURES = ("perplexity", "accuracy", "passkey", "passkey_digits")
RANGES = {"steps": POSITIVE, "train_len": POSITIVE, "batch_size": POSITIVE, "eval_batches": POSITIVE}


def run_config(config, method: str):
  """The training-loop config of one method: the model's base config (``configs/clm.py`` or ``pretrain.py``) with
  the harness's length, steps and an evaluator per multiple."""
  base = config_args.load_config(f"{MODELS[config.model]}:position={method},size={config.size}"
                                 + (",runlocal" if config.runlocal else ""))
  base = config_args.apply_overrides(base, dict(config.overrides))
  base.update(total_steps=config.steps, max_len=config.train_len, batch_size=config.batch_size,
              eval_every_steps=config.steps, checkpoint_every_steps=config.steps, seed=config.seed)
  base.warmup_steps = min(base.warmup_steps, config.steps // 10)
  base.progress = False
  base.evals = evaluators(config)
  return base


def evaluators(config) -> dict:
  """A run's evaluators: ``x<m>`` on the held-out corpus at each multiple of the training length and, with
  ``config.passkey``, ``passkey_x<m>`` (passkey retrieval at that length)."""
  spec = {"kind": TASKS[config.model], "split": "eval", "batches": config.eval_batches}
  found = {f"x{m}": {**spec, "length_multiple": m} for m in config.eval_multiples}
  if config.get("passkey") is not None:
    found.update({f"passkey_x{m}": {**config.passkey.to_dict(), "kind": "passkey", "length_multiple": m}
                  for m in config.eval_multiples})
  return found


def measured(config) -> tuple[str, ...]:
  """The measures of ``config``'s tables (passkey retrieval where it is on)."""
  return MEASURES if config.get("passkey") is not None else MEASURES[:2]


def measures(metrics: dict, config) -> dict:
  """``{measure: {length: value or "unsupported"}}`` from a run's ``results.json`` metrics."""
  out = {measure: {} for measure in measured(config)}
  for m in config.eval_multiples:
    values = metrics[f"x{m}"]
    length = str(config.train_len * m)
    if "passkey" in out:
      out["passkey"][length] = metrics[f"passkey_x{m}"]["accuracy"]
      out["passkey_digits"][length] = metrics[f"passkey_x{m}"]["digit_accuracy"]
    if values.get("loss") == results_lib.UNSUPPORTED:
      out["perplexity"][length] = out["accuracy"][length] = results_lib.UNSUPPORTED
      continue
    out["perplexity"][length] = values.get("perplexity", math.exp(min(values["loss"], 700.0)))
    out["accuracy"][length] = values["accuracy"]
  return out


def probe_config(config, methods) -> ml_collections.ConfigDict:
  """The probes' config: ``configs/probes.py`` with the harness's methods, ``config.probes`` as its tasks, its
  multiples, decoders for ``model="clm"`` (tiny models in runlocal, small ones otherwise), then
  ``config.probe_overrides``."""
  probe = config_args.load_config(f"configs/probes.py:methods={'+'.join(methods)},tasks={'+'.join(config.probes)},"
                                  f"size={'tiny' if config.runlocal else 'small'},decoder={config.model in DECODERS},"
                                  f"lm={config.model == 'lm'}")
  probe.eval_multiples = tuple(config.eval_multiples)
  return config_args.apply_overrides(probe, dict(config.probe_overrides))


def probe_tables(results: dict, probe) -> str:
  """A table per probe task (:func:`posjax.experiments.probes.results_table`): method x length, token accuracy."""
  model = "decoder" if probe.model.get("causal") else "encoder"
  return "\n\n".join(
      f"**probe `{task}`: token accuracy (%), a {model} of {probe.model.num_layers} x {probe.model.hidden_size} trained "
      f"at length {probe.train_len} for {probe.steps} steps**\n\n"
      + probes.results_table(results, ml_collections.ConfigDict({**probe.to_dict(), "tasks": (task,)}))
      for task in probe.tasks)


def read_runs(config) -> dict[str, str]:
  """``{method: workdir}`` of ``config.runs``: each a finished run (``config.json``, ``results.json``) of the
  harness's model at its training length, under its position method, one run per method."""
  found = {}
  for source in config.runs:
    run = results_lib.read_json(os.path.join(source, "config.json"))
    if run is None or not os.path.isfile(os.path.join(source, "results.json")):
      raise FileNotFoundError(f"config.runs: {source} is not a finished run (it has no config.json and results.json)")
    method, task = run["model"]["position"], run.get("task", "mlm")
    if task != TASKS[config.model]:
      raise ValueError(f"config.runs: {source} is a run of task {task!r}, not of the harness's model={config.model!r}")
    if run["max_len"] != config.train_len:
      raise ValueError(f"config.runs: {source} was trained at length {run['max_len']}, the harness's "
                       f"config.train_len is {config.train_len}; evaluate it with train_len={run['max_len']}")
    if method in found:
      raise ValueError(f"config.runs: {found[method]} and {source} are both runs of {method!r}; give one per method")
    found[method] = source
  return found


def source_config(config, source: str) -> ml_collections.ConfigDict:
  """The config a finished run is evaluated with: its own (``source/config.json``), the harness's evaluators."""
  run = ml_collections.ConfigDict(results_lib.read_json(os.path.join(source, "config.json")))
  run.evals = evaluators(config)
  run.eval_every_steps = max(run.eval_every_steps, 1)  # evaluators on (a run may have trained without them)
  run.progress = False
  return run


def table_methods(config, sources: dict) -> list[str]:
  """The tables' rows: ``config.methods``, then the methods of ``config.runs`` not among them."""
  return list(config.methods) + [m for m in sources if m not in config.methods]


def tables(results: dict, config, methods) -> str:
  """A markdown table per measure: a row per method, a column per evaluation length."""
  lengths = [str(config.train_len * m) for m in config.eval_multiples]
  what = "next-token" if config.model in DECODERS else "masked-token"
  titles = {"perplexity": f"{what} perplexity (lower is better)", "accuracy": f"{what} accuracy (%)",
            "passkey": "passkey retrieval (% of prompts whose whole key greedy decoding reproduces)",
            "passkey_digits": "passkey key tokens retrieved (%)"}
  parts = []
  for measure in measured(config):
    title = titles[measure]
    rows = [f"**{title}**", "", "| method | " + " | ".join(f"@{l}" for l in lengths) + " |",
            "|" + "---|" * (1 + len(lengths))]
    for method in methods:
      cells = []
      for length in lengths:
        value = results.get(method, {}).get(measure, {}).get(length)
        cells.append("—" if value is None else value if value == results_lib.UNSUPPORTED
                     else f"{value:.2f}" if measure == "perplexity" else f"{100 * value:.1f}")
      rows.append(f"| `{method}` | " + " | ".join(cells) + " |")
    parts.append("\n".join(rows))
  return "\n\n".join(parts)


def plot(results: dict, config, methods, path: str):
  """Perplexity against evaluation length (both log scale), one line per method; a method that runs at the training
  length alone is a point. Returns the figure (closed)."""
  plt = plots.pyplot()
  lengths = [config.train_len * m for m in config.eval_multiples]
  styles = plots.method_styles(methods)
  fig, ax = plt.subplots(figsize=(6.5, 4.2))
  for method in methods:
    values = results.get(method, {}).get("perplexity", {})
    points = [(l, values[str(l)]) for l in lengths if isinstance(values.get(str(l)), float)]
    if points:
      ax.plot(*zip(*points), label=method, **styles[method])
  ax.set_yscale("log")
  plots.length_axis(ax, lengths, config.train_len)
  ax.yaxis.set_major_formatter(plt.FormatStrFormatter("%g"))
  ax.yaxis.set_minor_formatter(plt.FormatStrFormatter("%g"))
  ax.set(xlabel="evaluation length", ylabel=f"{'next' if config.model in DECODERS else 'masked'}-token perplexity",
         title=f"{config.model}, trained at length {config.train_len} (dotted line), {config.steps} steps")
  ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return fig


def validate(config) -> None:
  """What can fail before the workdir is written: ranges, the model, the multiples, every method's run config, the
  runs to read, the probes."""
  config_args.check_ranges(config, RANGES)
  if config.model not in MODELS:
    raise ValueError(f"config.model={config.model!r}; allowed: {list(MODELS)}")
  if not config.eval_multiples or any(int(m) != m or m < 1 for m in config.eval_multiples):
    raise ValueError(f"config.eval_multiples={tuple(config.eval_multiples)} must be whole numbers >= 1")
  if config.get("passkey") is not None and config.model not in DECODERS:
    raise ValueError(f"config.passkey: passkey retrieval needs a decoder (model='lm' or 'clm'), not "
                     f"model={config.model!r}; "
                     "set config.passkey=None")
  for method in config.methods:
    run_config(config, method)
  sources = read_runs(config)
  for source in sources.values():
    source_config(config, source)
  if not config.methods and not sources:
    raise ValueError("config.methods and config.runs are both empty: no method to measure")
  if config.probes:
    probes.validate(probe_config(config, table_methods(config, sources)))


def run(config, workdir: str, train, evaluate=None) -> dict:
  """Trains and evaluates every method not yet in ``workdir/length.json``, each a run of the training loop in
  ``workdir/runs/<method>`` (or, for a run of ``config.runs``, ``evaluate`` of its checkpoint there), then the probes
  not yet in ``workdir/probes`` (``config.probes``); writes the tables and the plot. The workdir's config must match
  (``methods``, ``runs`` and ``probes`` excepted: a rerun may add rows or probe tasks). Compiled programs are cached
  in ``workdir/compilation_cache``."""
  validate(config)
  sources = read_runs(config)
  methods = table_methods(config, sources)
  if sources and evaluate is None:
    raise ValueError("config.runs needs evaluate(config, source, workdir) (posjax.main.evaluate_checkpoint)")
  os.makedirs(workdir, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", os.path.join(workdir, "compilation_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  run_checks.check_workdir_config(config, workdir, ignore=("methods", "probes", "runs"))
  path = os.path.join(workdir, "length.json")
  results = {}
  if os.path.exists(path):
    with open(path) as f:
      results = json.load(f)
  start = time.perf_counter()
  for method in methods:
    if method in results:
      continue
    run_dir = os.path.join(workdir, "runs", method)
    if method in sources:
      evaluate(source_config(config, sources[method]), sources[method], run_dir)
    else:
      train(run_config(config, method), run_dir)
    with open(os.path.join(run_dir, "results.json")) as f:
      results[method] = measures(json.load(f)["metrics"], config)
    results_lib.write_json(path, results, sort_keys=False)
    print(f"[{time.perf_counter() - start:5.0f}s] {method:>12} " + "; ".join(
        f"{measure} " + ", ".join(f"@{l}: {v if v == results_lib.UNSUPPORTED else f'{v:.2f}'}" for l, v in values.items())
        for measure, values in results[method].items()), flush=True)
  text = tables(results, config, methods)
  if config.probes:
    probe = probe_config(config, methods)
    found = probes.run(probe, os.path.join(workdir, "probes"), train)
    for method in methods:
      results[method]["probes"] = {task: found[method][task] for task in probe.tasks}
    results_lib.write_json(path, results, sort_keys=False)
    text += "\n\n" + probe_tables(found, probe)
  read = ""
  for method, source in sources.items():
    steps = results_lib.read_json(os.path.join(source, "results.json"))["step"]
    read += f"`{method}`: read from {source} (its own recipe, {steps} steps), not trained here\n"
  with open(os.path.join(workdir, "length.md"), "w") as f:
    f.write(f"Trained at length {config.train_len} for {config.steps} steps ({config.model}); evaluated at "
            f"{', '.join(f'{m}x' for m in config.eval_multiples)}\n{read}\n{text}\n")
  plot(results, config, methods, os.path.join(workdir, "length.png"))
  print(f"\n{text}\n\nwritten to {workdir}: length.md, length.json, length.png", flush=True)
  return results
