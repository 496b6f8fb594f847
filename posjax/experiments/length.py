"""The length-generalisation harness: each position method trained at one length by the training loop (a decoder on
next-token prediction: ``model="lm"``, the Llama-family decoder of ``configs/lm.py``, or ``"clm"``, a causal BERT;
or an encoder on MLM, ``model="mlm"``) and evaluated on held-out text of the
same corpus at 1x, 2x, 4x, 8x and 16x that length (the corpus evaluators' ``length_multiple``). ``run(config,
workdir, train, evaluate)`` takes the loop as ``train(config, workdir)`` and evaluation alone as ``evaluate(config,
source, workdir)`` (:mod:`posjax.main` composes both).

It writes ``length.md`` (a table per measure, method x length: perplexity, next-token or masked-token, token accuracy
and, for a decoder with ``config.passkey``, passkey retrieval of whole keys and of key tokens,
:mod:`posjax.tasks.passkey`), ``length.json`` and ``length.png`` (perplexity against length, one line per row, the
positive control in a panel of its own) in the workdir. A method with a learned position table reports
``unsupported`` past it, never clamped. Each method runs in ``workdir/runs/<method>``; a restarted harness skips
finished methods (and a killed run resumes).

``config.probes`` (probe tasks, :mod:`posjax.tasks.probe`) runs the position probes too
(:func:`posjax.experiments.probes.run` in ``workdir/probes``: a tiny probe model per method and task, a decoder for
``model="lm"`` / ``"clm"``, trained at the probes' own length and evaluated at the same multiples) and adds a table per probe
task to ``length.md`` (method x length, token accuracy).

``config.runs`` names finished runs (workdirs of ``python -m posjax.main --config=configs/lm.py ...``, ``clm.py``
for ``model="clm"``, ``pretrain.py`` for ``model="mlm"``) to read instead of training: each run's last checkpoint is evaluated, with its
own config (model, corpus, tokenizer) and the harness's evaluators, in ``workdir/runs/<row>`` (``<row>``: the
run's position method and the options it changed, :func:`read_runs`; a row in both ``methods`` and ``runs`` is read,
not trained). A run must be of the harness's model and trained at ``train_len``, or fine-tuned at another length from
a run trained at it: a zero-shot and a fine-tuned row. ``length.md`` opens with how every row was trained.

Rows beyond one per method (each in ``workdir/runs/<row>``, in the same tables and plot):

- ``config.control`` (a method; runlocal default the first method when passkey is on): the positive control of
  passkey retrieval, ``<method>+keys``, the method trained for ``control_steps`` with passkey prompts in
  ``control_fraction`` of its rows (:class:`posjax.tasks.passkey.TrainingRows`, the harness's passkey texts): it
  retrieves at its training length, so the other rows' zeros mean "not retrieved", not "not measurable".
- ``config.passkey.depths`` (N >= 2; runlocal 5): the needle-in-a-haystack grid, passkey retrieval at each depth
  fraction x length, a table per row and a heatmap panel per row in ``needle.png``.
- ``config.extension`` (``variants``, :mod:`posjax.experiments.extension`): context extension of a RoPE model
  trained at ``train_len`` (``base``: a method among the harness's rows, trained here, or the workdir of a finished
  posjax run or of ``python -m posjax.convert hf-to-posjax``), each variant evaluated zero-shot (``<variant> x<F>``)
  and after ``finetune_steps`` of training at ``train_len * factor`` from the base's parameters at ``lr_fraction`` of
  its learning rate (``<variant> x<F> +<N> steps``).
"""

from __future__ import annotations

import json
import math
import os
import re
import time

from typing import Callable, NamedTuple

import flax.traverse_util
import jax
import ml_collections
import numpy as np

from posjax import config_args, positions
from posjax import results as results_lib
from posjax.config_args import POSITIVE
from posjax.experiments import extension, plots, probes
from posjax.kernels import terms as terms_lib
from posjax.models import hybrid
from posjax.tasks import passkey as passkey_task
from posjax.tasks import ruler_eval
from posjax.train import checkpoint as checkpoint_lib
from posjax.train import validate as run_checks

MODELS = {"lm": "configs/lm.py", "clm": "configs/clm.py", "mlm": "configs/pretrain.py"}
TASKS = {"lm": "clm", "clm": "clm", "mlm": "mlm"}  # the training task (and evaluator kind) of each model
DECODERS = ("lm", "clm")
# passkey: the fraction of prompts whose whole key is retrieved; passkey_digits: of the key's tokens (chance: one in
# the number of symbols).
MEASURES = ("perplexity", "accuracy", "passkey", "passkey_digits")
RANGES = {"steps": POSITIVE, "train_len": POSITIVE, "batch_size": POSITIVE, "eval_batches": POSITIVE, "seeds": POSITIVE,
          "control_steps": POSITIVE, "ruler_control_steps": POSITIVE, "extension.finetune_steps": POSITIVE}


class Row(NamedTuple):
  """A row of the tables: its position method (the plot's style), ``train`` (its run config is trained) or
  ``evaluate`` (a checkpoint is evaluated), ``make() -> config`` or ``(config, source)`` (built when the row runs:
  a fine-tune reads its base's finished run), and a line for ``length.md`` ("" none)."""
  method: str
  kind: str
  make: Callable
  note: str = ""


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


def layout_config(config, name: str, options=None):
  """The training-loop config of a layout's row: ``layout_method``'s (:func:`run_config`) with ``model.layout`` and
  its options (``options``, or the harness's ``layout_options``)."""
  run = run_config(config, config.layout_method)
  run.model.layout = name
  found = dict((config.get("layout_options") or {}).get(name, {})) if options is None else dict(options)
  run.model.layout_options = ml_collections.ConfigDict(found)
  return run


def layout_row(config, name: str) -> str:
  """A layout row's name: the layout's, with its method where that is not RoPE."""
  return name if config.layout_method == "rope" else f"{name} ({config.layout_method})"


def evaluators(config) -> dict:
  """A run's evaluators: ``x<m>`` on the held-out corpus at each multiple of the harness's training length (an
  absolute ``max_len``: a row fine-tuned at a longer length is measured at the same lengths) and, with
  ``config.passkey``, ``passkey_x<m>`` (passkey retrieval at that length)."""
  spec = {"kind": TASKS[config.model], "split": "eval", "tokens": eval_tokens(config)}
  if spec["kind"] == "mlm":  # the encoder: the same masked text at every length (posjax.tasks.mlm.same_text)
    spec["same_text"] = True
  found = {f"x{m}": {**spec, "max_len": config.train_len * m} for m in config.eval_multiples}
  if config.get("stride"):  # the same text in windows of each length every `stride` tokens
    found.update({f"sw_x{m}": {**spec, "max_len": config.train_len * m, "stride": config.stride}
                  for m in config.eval_multiples})
  if config.get("passkey") is not None:
    found.update({f"passkey_x{m}": {**config.passkey.to_dict(), "kind": "passkey", "max_len": config.train_len * m}
                  for m in config.eval_multiples})
  for name, task in (config.get("ruler") or {}).items():
    found.update({f"ruler_{name}_x{m}": {**task.to_dict(), "kind": "ruler", "max_len": config.train_len * m}
                  for m in config.eval_multiples})
  return found


def eval_tokens(config) -> int:
  """The tokens every length is scored on: ``eval_batches`` batches of the longest length (``batch_size`` rows).
  Every length reads the same text, cut into rows of its length, so only the context changes (Press et al. 2022's
  protocol): a decoder's stream packing does it, and an encoder's evaluators mask that text once (``same_text``)."""
  return config.eval_batches * config.batch_size * config.train_len * max(config.eval_multiples)


def needle_depths(config) -> int:
  """The passkey grid's depths (0: none)."""
  return int(config.passkey.get("depths", 0)) if config.get("passkey") is not None else 0


def measured(config) -> tuple[str, ...]:
  """The measures of ``config``'s tables (passkey retrieval where it is on, sliding-window perplexity where
  ``config.stride`` is)."""
  found = MEASURES if config.get("passkey") is not None else MEASURES[:2]
  return found + (("sliding",) if config.get("stride") else ()) + tuple(
      f"ruler_{name}" for name in (config.get("ruler") or {}))


def measures(metrics: dict, config) -> dict:
  """``{measure: {length: value or "unsupported"}}`` from a run's ``results.json`` metrics."""
  out = {measure: {} for measure in measured(config)}
  out["tokens"] = {}  # the predictions each length's perplexity averages (for the record: not a table)
  fractions = passkey_task.depth_fractions(needle_depths(config))
  if len(fractions):
    out["needle"] = {}
  for m in config.eval_multiples:
    values = metrics[f"x{m}"]
    length = str(config.train_len * m)
    if "passkey" in out:
      found = metrics[f"passkey_x{m}"]
      out["passkey"][length] = found["accuracy"]
      out["passkey_digits"][length] = found["digit_accuracy"]
      if len(fractions):
        out["needle"][length] = {f"{f:.2f}": found[f"accuracy@{f:.2f}"] for f in fractions}
    if "sliding" in out:
      out["sliding"][length] = metrics[f"sw_x{m}"]["perplexity"]
    for name in config.get("ruler") or {}:
      out[f"ruler_{name}"][length] = metrics[f"ruler_{name}_x{m}"]["accuracy"]
    if values.get("loss") == results_lib.UNSUPPORTED:
      out["perplexity"][length] = out["accuracy"][length] = results_lib.UNSUPPORTED
      continue
    out["perplexity"][length] = values.get("perplexity", math.exp(min(values["loss"], 700.0)))
    out["accuracy"][length] = values["accuracy"]
    if "tokens" in values:
      out["tokens"][length] = values["tokens"]
    if "loss_by_position" in values:
      out.setdefault("loss_by_position", {})[length] = values["loss_by_position"]
  return out


def probe_config(config, methods) -> ml_collections.ConfigDict:
  """The probes' config: ``configs/probes.py`` with the harness's methods, ``config.probes`` as its tasks, its
  multiples, decoders for ``model="clm"`` (tiny models in runlocal, small ones otherwise), then
  ``config.probe_overrides``."""
  layouts = f",layouts={'+'.join(config.layouts)},layout_method={config.layout_method}" if config.get(
      "layouts") else ""
  probe = config_args.load_config(f"configs/probes.py:methods={'+'.join(methods)},tasks={'+'.join(config.probes)},"
                                  f"size={'tiny' if config.runlocal else 'small'},decoder={config.model in DECODERS},"
                                  f"lm={config.model == 'lm'}{layouts}")
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


class Finished(NamedTuple):
  """A row read from ``config.runs``: its position method, the run whose config it is evaluated with (``workdir``),
  the checkpoint evaluated (``source``: that run's, or for a fine-tune's zero-shot row the run it started from) and
  its line for ``length.md``, how it was trained."""

  method: str
  workdir: str
  source: str
  note: str


def option_changes(config, method: str, options: dict) -> dict:
  """The position options of a run of ``method`` that differ from the harness's recipe for it (``configs/lm.py`` /
  ``clm.py`` / ``pretrain.py``), in the run's order."""
  default = run_config(config, method).model.position_options.to_dict()
  return {k: v for k, v in options.items() if k not in default or default[k] != v}


def _options_text(changes: dict) -> str:
  """``scaling=yarn, factor=4`` ("" for none; a list of values as its length: LongRoPE's factors)."""
  shown = lambda v: (f"{v:g}" if isinstance(v, float) else f"[{len(v)} values]" if isinstance(v, (list, tuple))
                     else str(v))
  return ", ".join(f"{k}={shown(v)}" for k, v in changes.items())


# A read run's fields that say how long and where it ran, not what it trained (the note says its steps and length).
BOOKKEEPING = ("total_steps", "max_len", "eval_every_steps", "checkpoint_every_steps", "log_every_steps", "evals",
               "progress", "keep_checkpoints", "keep_steps", "allow_config_change", "init_from", "warmup_steps",
               "device_prefetch", "data.workers", "peer_timeout_seconds", "shutdown_timeout_seconds")


def recipe_changes(config, method: str, run: dict) -> dict:
  """The fields of a read run's config, besides its position options and :data:`BOOKKEEPING`, that differ from the
  harness's recipe for its method, or its layout's (data, optimiser, size, ...: what else made it another
  experiment)."""
  name = run["model"].get("layout") or ""
  recipe = run_config(config, method)
  if name:
    recipe = layout_config(config, name, (config.get("layout_options") or {}).get(name, {}))
    recipe.model.position = method
  recipe, mine = (flax.traverse_util.flatten_dict(tree, sep=".")
                  for tree in (json.loads(recipe.to_json_best_effort()), run))
  return {k: mine.get(k) for k in sorted(set(recipe) | set(mine))
          if mine.get(k) != recipe.get(k) and not k.startswith(("model.position_options.", "evals."))
          and k not in BOOKKEEPING}


def read_runs(config) -> dict[str, Finished]:
  """``{row: Finished}`` of ``config.runs``: each a finished run (``config.json``, ``results.json``) of the
  harness's model. A run trained at ``train_len`` is the row of its method and the options it changed from the
  recipe's, ``<method> (<option>=<value>, ...)`` (a second run of the same: `` (<its directory's name>)`` after it);
  a run fine-tuned at another length from a run trained at ``train_len`` (its ``init_from``) is two rows,
  ``<label> zero-shot`` (the run it started from, evaluated with its options) and ``<label> +<steps> steps at
  <length>`` (the fine-tune itself). Each row's note says how it was trained."""
  found = {}
  for source in config.runs:
    run = results_lib.read_json(os.path.join(source, "config.json"))
    finished = results_lib.read_json(os.path.join(source, "results.json"))
    if run is None or finished is None:
      raise FileNotFoundError(f"config.runs: {source} is not a finished run (it has no config.json and results.json)")
    method, task = run["model"]["position"], run.get("task", "mlm")
    if task != TASKS[config.model]:
      raise ValueError(f"config.runs: {source} is a run of task {task!r}, not of the harness's model={config.model!r}")
    changes = option_changes(config, method, run["model"].get("position_options", {}))
    options = _options_text(changes) or "the recipe's defaults"
    other = recipe_changes(config, method, run)
    trained = (f"{finished.get('step')} steps at length {run['max_len']}, position options {options}"
               + (f", and beside the recipe {_options_text(other)}" if other else ""))
    layout_name = run["model"].get("layout") or ""
    label = (layout_name if layout_name and method == "rope" else f"{layout_name} ({method})" if layout_name
             else method) + (f" ({text})" if (text := _options_text(
        {k: v for k, v in changes.items() if not (k == "original_max_len" and v == config.train_len)})) else "")
    if run["max_len"] != config.train_len:  # a fine-tune's own schedule is in its note, not its name
      other_named = {k: v for k, v in other.items() if k not in ("learning_rate", "lr_schedule", "lr_end_fraction")}
    else:
      other_named = other
    if other_named:  # another experiment than the harness's recipe: its first difference in the row's name
      label += f" [{_options_text(dict(list(other_named.items())[:1]))}{', ...' if len(other_named) > 1 else ''}]"
    if run["max_len"] == config.train_len:
      taken = label in found or label in config.methods  # a row of its own, never one trained here
      name = label if not taken else f"{label} ({os.path.basename(os.path.normpath(source))})"
      if name in found:
        raise ValueError(f"config.runs: {found[name].workdir} and {source} are both runs of {label!r} in directories "
                         "of the same name; rename one (its name names the row)")
      found[name] = Finished(method, source, source, f"`{name}`: read from {source}: {trained}; not trained here")
      continue
    base = run.get("init_from") or ""
    base_config = results_lib.read_json(os.path.join(base, "config.json")) if base else None
    base_len = (base_config or {}).get("max_len") or (
        checkpoint_lib.read_model_config(base, f"config.runs: {source}'s init_from").get("max_len") if base else None)
    if base_len != config.train_len:
      raise ValueError(f"config.runs: {source} was trained at length {run['max_len']}, the harness's "
                       f"config.train_len is {config.train_len}; evaluate it with train_len={run['max_len']}, or "
                       f"read a fine-tune (init_from) of a run trained at {config.train_len}"
                       + (f" (its init_from {base} was trained at length {base_len})" if base else ""))
    base_steps = (results_lib.read_json(os.path.join(base, "results.json")) or {}).get("step")
    before = f"{base} ({base_steps} steps at length {base_len})" if base_steps else f"{base} (at length {base_len})"
    tuned = f"{label} +{finished.get('step')} steps at {run['max_len']}"
    for name in (f"{label} zero-shot", tuned):
      if name in found:
        raise ValueError(f"config.runs: {found[name].workdir} and {source} both make the row {name!r}; read one")
    found[f"{label} zero-shot"] = Finished(
        method, source, base, f"`{label} zero-shot`: {before} evaluated with the position options of {source} "
        f"({options}), without its fine-tuning")
    found[tuned] = Finished(method, source, source, f"`{tuned}`: read from {source}: fine-tuned from {before}, "
                            f"{trained}; not trained here")
  return found


def source_config(config, source: str) -> ml_collections.ConfigDict:
  """The config a finished run is evaluated with: its own (``source/config.json``), the harness's evaluators."""
  run = ml_collections.ConfigDict(results_lib.read_json(os.path.join(source, "config.json")))
  run.evals = evaluators(config)
  run.eval_every_steps = max(run.eval_every_steps, 1)  # evaluators on (a run may have trained without them)
  run.progress = False
  return run


def table_methods(config, sources: dict) -> list[str]:
  """The tables' first rows: ``config.methods``, then the rows of ``config.runs`` not among them."""
  return list(config.methods) + [m for m in sources if m not in config.methods]


def probe_methods(config, sources: dict) -> list[str]:
  """The methods the probes train: the first rows named by their method (a variant read from ``config.runs`` has
  no probe of its own)."""
  return [m for m in table_methods(config, sources) if m in positions.names()]


def control_name(config) -> str:
  """The positive control's row: ``<method>+keys``."""
  return f"{config.control}+keys"


def ruler_control_name(config) -> str:
  """The RULER tasks' positive control's row: ``<method>+ruler``."""
  return f"{config.ruler_control}+ruler"


def ruler_control_config(config) -> ml_collections.ConfigDict:
  """The RULER positive control's run: ``config.ruler_control`` trained for ``ruler_control_steps`` (default
  ``control_steps``) with the harness's RULER tasks' prompts and answers in half its rows
  (:class:`posjax.tasks.ruler_eval.TrainingRows`)."""
  run = run_config(config, config.ruler_control)
  steps = config.get("ruler_control_steps") or config.control_steps
  run.update(total_steps=steps, eval_every_steps=steps, checkpoint_every_steps=steps)
  run.warmup_steps = min(run.warmup_steps, steps // 10)
  tasks = {name: {"task": spec.task, "options": spec.options.to_dict()} for name, spec in config.ruler.items()}
  tokens = max(spec.get("tokens") or ruler_eval.TOKENS[spec.task] for spec in config.ruler.values())
  run.ruler_train = ml_collections.ConfigDict({"fraction": config.control_fraction, "tasks": tasks, "tokens": tokens})
  return run


def control_config(config) -> ml_collections.ConfigDict:
  """The positive control's run: ``config.control`` trained for ``control_steps`` with passkey prompts (the
  harness's passkey texts) in ``control_fraction`` of its rows."""
  run = run_config(config, config.control)
  run.update(total_steps=config.control_steps, eval_every_steps=config.control_steps,
             checkpoint_every_steps=config.control_steps)
  run.warmup_steps = min(run.warmup_steps, config.control_steps // 10)
  texts = {k: v for k, v in config.passkey.to_dict().items() if k in passkey_task.TRAINING}
  run.passkey_train = ml_collections.ConfigDict({**run.passkey_train.to_dict(), **texts,
                                                 "fraction": config.control_fraction})
  return run


def base_source(config, workdir: str, sources: dict) -> tuple[str, bool]:
  """``(the context-extension base's workdir, whether it is a row of the tables)``: a method's row (its run of
  ``config.runs``, or its run here) or a directory."""
  base = config.extension.base
  if base in sources:
    return sources[base].source, True
  if base in config.methods or (config.get("control") and base == control_name(config)):
    return run_dir(workdir, base), True
  return base, False


def base_run(config, workdir: str) -> tuple[ml_collections.ConfigDict, str]:
  """The context-extension base: ``(its config with the harness's evaluators, its workdir)``; a converted model
  (no ``config.json``) gets ``configs/lm.py:init_from=`` its directory (with runlocal's corpus in runlocal, and the
  harness's ``overrides``) at ``train_len``."""
  source, _ = base_source(config, workdir, read_runs(config))
  if os.path.isfile(os.path.join(source, "config.json")):
    return source_config(config, source), source
  run = config_args.load_config(f"configs/lm.py:init_from={source}" + (",runlocal" if config.runlocal else ""))
  run = config_args.apply_overrides(run, dict(config.overrides))
  run.update(max_len=config.train_len, batch_size=config.batch_size, seed=config.seed, progress=False,
             eval_every_steps=1, evals=evaluators(config))
  return run, source


def extended(run, variant: str, config) -> ml_collections.ConfigDict:
  """``run`` with the RoPE options of ``variant`` (:func:`posjax.experiments.extension.options`)."""
  model = run.model
  if model.position != "rope":
    raise ValueError(f"config.extension: the base is a {model.position!r} model; context extension scales RoPE")
  head_dim = model.get("head_dim") or model.hidden_size // model.num_heads
  options = extension.options(variant, dict(model.position_options), head_dim, config.train_len,
                              config.extension.factor)
  run = ml_collections.ConfigDict(run.to_dict())
  run.model.position_options = ml_collections.ConfigDict(options)
  return run


def finetuned(run, source: str, variant: str, config) -> ml_collections.ConfigDict:
  """The fine-tune of ``variant``: from ``source``'s parameters, at ``train_len * factor`` for ``finetune_steps``,
  at ``lr_fraction`` of the base's learning rate, a tenth of the steps warming up, on the base's own data (the
  positive control's passkey prompts included, built at the longer length)."""
  ext, steps = config.extension, config.extension.finetune_steps
  run = extended(run, variant, config)
  run.update(init_from=source, max_len=int(config.train_len * ext.factor), total_steps=steps, eval_every_steps=steps,
             checkpoint_every_steps=steps, warmup_steps=steps // 10, learning_rate=run.learning_rate * ext.lr_fraction)
  run.progress = False
  return run


def zero_shot(config, workdir: str, variant: str) -> tuple[ml_collections.ConfigDict, str]:
  """``(config, source)`` evaluating the base's checkpoint with ``variant``'s options."""
  run, source = base_run(config, workdir)
  return extended(run, variant, config), source


def extension_names(config, variant: str, base_is_row: bool) -> tuple[str | None, str]:
  """The rows of ``variant``: zero-shot (None for ``unscaled`` over a row of the tables, which is that row) and
  fine-tuned."""
  ext = config.extension
  factor = f"x{ext.factor:g}"
  first = None if variant == "unscaled" and base_is_row else "base" if variant == "unscaled" else f"{variant} {factor}"
  return first, f"{variant} {factor} +{ext.finetune_steps} steps"


def plan(config, workdir: str) -> dict[str, Row]:
  """The tables' rows in order: the methods (trained or read from ``config.runs``), the positive control, the
  context-extension variants (zero-shot, then fine-tuned)."""
  sources = read_runs(config)
  rows = {}
  for method in table_methods(config, sources):
    if method in sources:
      read = sources[method]
      rows[method] = Row(read.method, "evaluate", lambda r=read: (source_config(config, r.workdir), r.source),
                         read.note)
    else:
      rows[method] = Row(method, "train", lambda m=method: run_config(config, m))
  for name in config.get("layouts") or ():
    row = layout_row(config, name)
    if row in rows:
      continue  # read from config.runs
    options = dict((config.get("layout_options") or {}).get(name, {}))
    rows[row] = Row(config.layout_method, "train", lambda n=name: layout_config(config, n),
                    f"`{row}`: `{config.layout_method}` in the `{name}` layout, {hybrid.describe(name, options)}; "
                    f"trained here like the methods")
  if config.get("control"):
    rows[control_name(config)] = Row(
        config.control, "train", lambda: control_config(config),
        f"`{control_name(config)}`: the positive control, trained for {config.control_steps} steps at length "
        f"{config.train_len} with passkey prompts in {100 * config.control_fraction:g}% of its rows")
  if config.get("ruler") and config.get("ruler_control"):
    rows[ruler_control_name(config)] = Row(
        config.ruler_control, "train", lambda: ruler_control_config(config),
        f"`{ruler_control_name(config)}`: the positive control of the RULER tasks, trained for "
        f"{config.get('ruler_control_steps') or config.control_steps} "
        f"steps at length {config.train_len} with their prompts and answers in {100 * config.control_fraction:g}% "
        "of its rows")
  ext = config.get("extension")
  if ext is not None and ext.variants:
    _, is_row = base_source(config, workdir, sources)
    where = f"the `{ext.base}` row" if is_row else ext.base
    for variant in ext.variants:
      first, tuned = extension_names(config, variant, is_row)
      if first:
        rows[first] = Row("rope", "evaluate", lambda v=variant: zero_shot(config, workdir, v),
                          f"`{first}`: {where} (trained at length {config.train_len}), {variant} "
                          f"x{ext.factor:g} zero-shot")
      rows[tuned] = Row("rope", "train", lambda v=variant: finetuned(*base_run(config, workdir), v, config),
                        f"`{tuned}`: {where} with {variant}, trained {ext.finetune_steps} steps at length "
                        f"{int(config.train_len * ext.factor)} at {ext.lr_fraction:g} of its learning rate")
  return rows


def header(config, rows: dict[str, Row], scored: dict) -> str:
  """``length.md``'s first lines: how every row was trained (a list: the methods trained here by the harness's recipe
  in one item, every other row in one of its own, its note), then how they are evaluated."""
  here = [name for name, row in rows.items() if row.kind == "train" and not row.note]
  overrides = ", ".join(f"{k}={v!r}" for k, v in dict(config.overrides).items())
  lines = [f"{', '.join(f'`{name}`' for name in here)}: trained here, {config.steps} steps at length {config.train_len} "
           f"({config.model}: {MODELS[config.model]}" + (f" with {overrides}" if overrides else "")
           + ", each method's default position options)"] if here else []
  lines += [row.note for row in rows.values() if row.note]
  return "\n".join(f"- {line}" for line in lines) + (
      f"\n\nEvaluated at {', '.join(f'{m}x' for m in config.eval_multiples)} of length {config.train_len}, each "
      f"length on the first {eval_tokens(config)} tokens of the held-out text (the same text at every length, cut "
      "into rows of its length, with a decoder's stream packing or an encoder's text masked once)"
      + (f"; predictions scored: {', '.join(f'@{l} {n}' for l, n in scored.items())}" if scored else ""))


def run_dir(workdir: str, name: str) -> str:
  """A row's run directory: ``workdir/runs/<name>``, each run of characters other than letters, digits, ``.``, ``-``
  and ``_`` as one ``_``."""
  return os.path.join(workdir, "runs", re.sub(r"[^A-Za-z0-9_.-]+", "_", name))


def tables(results: dict, config, methods) -> str:
  """A markdown table per measure: a row per method, a column per evaluation length."""
  lengths = [str(config.train_len * m) for m in config.eval_multiples]
  what = "next-token" if config.model in DECODERS else "masked-token"
  titles = {"perplexity": f"{what} perplexity (lower is better)", "accuracy": f"{what} accuracy (%)",
            "passkey": "passkey retrieval (% of prompts whose whole key greedy decoding reproduces)",
            "passkey_digits": "passkey key tokens retrieved (%)",
            "sliding": f"sliding-window {what} perplexity (windows of each length every {config.get('stride')} tokens, "
                       "each token predicted once)",
            **{f"ruler_{name}": f"RULER `{name}` ({spec.task}): string_match_all (%) of the answers greedy decoding "
                                f"writes in {spec.get('tokens') or ruler_eval.TOKENS[spec.task]} tokens"
               for name, spec in (config.get("ruler") or {}).items()}}
  parts = []
  for measure in measured(config):
    title = titles[measure]
    rows = [f"**{title}**", "", "| method | " + " | ".join(f"@{l}" for l in lengths) + " |",
            "|" + "---|" * (1 + len(lengths))]
    for method in methods:
      cells = []
      for length in lengths:
        value = results.get(method, {}).get(measure, {}).get(length)
        flag = "†" if results.get(method, {}).get("untrained_buckets", {}).get(length, 0) > 0 else ""
        spread = results.get(method, {}).get("spread", {}).get(measure, {}).get(length)
        show = (lambda v: f"{v:.2f}") if measure in ("perplexity", "sliding") else (lambda v: f"{100 * v:.1f}")
        cells.append("—" if value is None else value if value == results_lib.UNSUPPORTED
                     else show(value) + ("" if spread is None else f" ± {show(spread)}") + flag)
      rows.append(f"| `{method}` | " + " | ".join(cells) + " |")
    parts.append("\n".join(rows))
  return "\n\n".join(parts)


def across_seeds(runs: list[dict]) -> dict:
  """One row's measures over its seeds' runs (:func:`measures` each): each value the mean, and with two seeds or more
  ``spread`` (``{measure: {length: sample standard deviation}}``) and ``seeds`` (every run's values); a length any
  run cannot measure is ``unsupported``."""
  if len(runs) == 1:
    return runs[0]
  out, spread, values = {}, {}, {}

  def mean(items):
    if any(v == results_lib.UNSUPPORTED for v in items):
      return results_lib.UNSUPPORTED, None
    if isinstance(items[0], dict):  # the needle grid: {length: {depth: value}}
      return {k: mean([v[k] for v in items])[0] for k in items[0]}, None
    if isinstance(items[0], list):  # the loss by position
      return [None if None in column else float(np.mean(column)) for column in zip(*items)], None
    return float(np.mean(items)), float(np.std(items, ddof=1))

  for measure, by_length in runs[0].items():
    if measure == "tokens":
      out[measure] = by_length
      continue
    out[measure], spread[measure], values[measure] = {}, {}, {}
    for length in by_length:
      items = [run[measure][length] for run in runs]
      out[measure][length], deviation = mean(items)
      if deviation is not None:
        spread[measure][length], values[measure][length] = deviation, items
  return {**out, "spread": {m: v for m, v in spread.items() if v}, "seeds": {m: v for m, v in values.items() if v}}


def untrained_bucket_share(options: dict, train_len: int, length: int, causal: bool) -> float:
  """The share of the pairs a row of ``length`` attends (``causal``: each query's keys up to it) whose T5 bucket
  (``options``: the run's ``num_buckets``, ``max_distance``, ``bidirectional``) no pair of a ``train_len`` row
  reaches: there the bias is the table's initial value, never trained, and perplexity at that length does not
  measure extrapolation."""
  given = {k: v for k, v in options.items() if v is not None}
  n, far = given.get("num_buckets", 32), given.get("max_distance", 128)
  both = given.get("bidirectional", not causal)
  pairs = lambda size: np.arange(-(size - 1), 1 if causal else size)  # key minus query
  trained = np.unique(np.asarray(terms_lib.bucket(pairs(train_len), n, far, both)))
  rel = pairs(length)
  count = length - np.abs(rel)  # pairs at each distance
  untrained = ~np.isin(np.asarray(terms_lib.bucket(rel, n, far, both)), trained)
  return float(count[untrained].sum() / count.sum())


def bucket_footnote(results: dict, config, rows) -> str:
  """The T5 rows' untrained-bucket shares (:func:`untrained_bucket_share`) under the tables ("" without any)."""
  lines = []
  for name in rows:
    shares = results.get(name, {}).get("untrained_buckets", {})
    if any(share > 0 for share in shares.values()):
      lines.append(f"† `{name}`: the share of attended pairs in T5 buckets never trained at {config.train_len}: "
                   + ", ".join(f"@{length} {100 * share:.0f}%" for length, share in shares.items() if share > 0)
                   + " (its numbers there read untrained biases, not extrapolation)")
  return "\n".join(lines)


def needle_table(results: dict, config, rows) -> str:
  """The needle-in-a-haystack grid: for each row, passkey retrieval (%) at each depth fraction x length."""
  lengths = [str(config.train_len * m) for m in config.eval_multiples]
  fractions = [f"{f:.2f}" for f in passkey_task.depth_fractions(needle_depths(config))]
  lines = ["**needle in a haystack: passkey retrieval (%) by the key's depth in the filler (0: first, 1: last) and "
           "length**", "", "| row | depth | " + " | ".join(f"@{l}" for l in lengths) + " |",
           "|" + "---|" * (2 + len(lengths))]
  for name in rows:
    grid = results.get(name, {}).get("needle", {})
    for fraction in fractions:
      cells = [grid.get(l, {}).get(fraction) for l in lengths]
      lines.append(f"| `{name}` | {fraction} | " + " | ".join(
          "—" if v is None else v if v == results_lib.UNSUPPORTED else f"{100 * v:.0f}" for v in cells) + " |")
  return "\n".join(lines)


def needle_plot(results: dict, config, rows, path: str):
  """A heatmap panel per row: retrieval by depth (rows) and length (columns), unsupported cells blank."""
  plt = plots.pyplot()
  lengths = [str(config.train_len * m) for m in config.eval_multiples]
  fractions = [f"{f:.2f}" for f in passkey_task.depth_fractions(needle_depths(config))]
  columns = min(len(rows), 4)
  lines = math.ceil(len(rows) / columns)
  fig, axes = plt.subplots(lines, columns, figsize=(2.4 * columns + 1.2, 2.2 * lines + 0.6), squeeze=False,
                           layout="constrained")
  for i, (ax, name) in enumerate(zip(axes.ravel(), rows)):
    grid = results.get(name, {}).get("needle", {})
    values = [[grid.get(l, {}).get(f) for l in lengths] for f in fractions]
    image = ax.imshow([[v if isinstance(v, float) else math.nan for v in line] for line in values], vmin=0.0,
                      vmax=1.0, cmap="viridis", aspect="auto")
    for y, line in enumerate(values):  # each cell's percentage written on it, light on the dark end of the scale
      for x, v in enumerate(line):
        if isinstance(v, float):
          ax.text(x, y, f"{100 * v:.0f}", ha="center", va="center", fontsize=6, color="black" if v > 0.6 else "white")
    ax.set_xticks(range(len(lengths)), lengths, fontsize=7)
    ax.set_yticks(range(len(fractions)), fractions if i % columns == 0 else [], fontsize=7)
    ax.set_title(name, fontsize=8)
  for ax in axes.ravel()[len(rows):]:
    ax.axis("off")
  fig.supxlabel("evaluation length", fontsize=8)
  fig.supylabel("key depth (fraction of the filler)", fontsize=8)
  fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label="retrieved")
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return fig


def ruler_plot(results: dict, config, rows, path: str):
  """A heatmap per RULER task: its string-match score (%) by row (methods, layouts, controls) and length, unsupported
  cells blank."""
  plt = plots.pyplot()
  lengths = [str(config.train_len * m) for m in config.eval_multiples]
  tasks = list(config.ruler)
  fig, axes = plt.subplots(1, len(tasks), figsize=(0.5 * len(lengths) * len(tasks) + 2.4 * len(tasks), 0.32 * len(rows)
                                                  + 1.4), squeeze=False, layout="constrained")
  for i, (ax, task) in enumerate(zip(axes[0], tasks)):
    values = [[results.get(name, {}).get(f"ruler_{task}", {}).get(l) for l in lengths] for name in rows]
    image = ax.imshow([[100 * v if isinstance(v, float) else math.nan for v in line] for line in values], vmin=0.0,
                      vmax=100.0, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(lengths)), lengths, fontsize=7)
    ax.set_yticks(range(len(rows)), rows if i == 0 else [], fontsize=7)
    ax.set_title(task, fontsize=8)
  fig.supxlabel("evaluation length", fontsize=8)
  fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label="string_match_all (%)")
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return fig


def panels(config, rows) -> list[tuple[str, list[str]]]:
  """The plots' panels: ``(title, rows)``, the methods' rows first, then, where there is one, the positive control with
  the context extensions of it (trained on passkey prompts too, its perplexity is on another scale: beside the
  methods it would stretch their axis)."""
  control = set()
  if config.get("control"):
    control.add(control_name(config))
    ext = config.get("extension")
    if ext is not None and ext.variants and ext.base == control_name(config):
      control.update(name for variant in ext.variants for name in extension_names(config, variant, True) if name)
  ruler = {ruler_control_name(config)} if config.get("ruler") and config.get("ruler_control") else set()
  found = [("methods", [name for name in rows if name not in control | ruler])]
  if any(name in control for name in rows):
    found.append((f"positive control ({config.control}, {config.control_steps:,} steps with passkey prompts)"
                  + ("\nand its context extensions" if len(control) > 1 else ""),
                  [name for name in rows if name in control]))
  if any(name in ruler for name in rows):
    found.append((f"RULER's positive control ({config.ruler_control}, {config.control_steps:,} steps with its "
                  "prompts)", [name for name in rows if name in ruler]))
  return [(title, names) for title, names in found if names]


def _panel_plot(config, rows, path: str, title: str, draw, axes_set):
  """A figure of a panel per group of :func:`panels` side by side (the control's narrower), every row a style of its
  own across them (:func:`posjax.experiments.plots.method_styles`), each panel's legend right of it, written to
  ``path`` and closed. ``draw(ax, name, style)`` draws a row and returns the values it drew (the value axis spans
  them); ``axes_set(ax)`` sets the x axis and the labels."""
  plt = plots.pyplot()
  styles = plots.method_styles(rows)
  groups = panels(config, rows)
  widths = [1.0] + [0.7] * (len(groups) - 1)
  fig, axes = plt.subplots(1, len(groups), figsize=(7.2 * sum(widths), 4.4), squeeze=False, layout="constrained",
                           gridspec_kw={"width_ratios": widths})
  for ax, (panel, names) in zip(axes[0], groups):
    plots.value_axis(ax, [v for name in names for v in draw(ax, name, styles[name])])
    axes_set(ax)
    ax.set_title(panel if len(groups) > 1 else "")  # one panel: the figure's title says it all
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
  fig.suptitle(title)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return fig


def position_plot(results: dict, config, rows, path: str):
  """The loss by context length at the longest length every row measures (each token index's mean over the rows of
  the held-out text, averaged over doubling spans of the index: past the training length a token sees more context
  than any trained), a line per row; the positive control in a panel of its own (:func:`panels`). None where no row
  reports it."""
  lengths = [str(config.train_len * m) for m in config.eval_multiples]
  found = {name: results.get(name, {}).get("loss_by_position", {}) for name in rows}
  shared = [l for l in lengths if all(isinstance(found[name].get(l), list) for name in rows)]
  if not shared:
    return None
  length = shared[-1]

  def draw(ax, name, style):
    # averaged over doubling spans of context (1, 2-3, 4-7, ...): a few rows per length leave each index noisy
    values = found[name][length]
    spans = [(lo, min(2 * lo, len(values) + 1)) for lo in (2 ** k for k in range(len(values).bit_length()))]
    points = [(np.sqrt(lo * (hi - 1)), np.mean(kept)) for lo, hi in spans
              if (kept := [v for v in values[lo - 1:hi - 1] if v is not None])]
    ax.plot(*zip(*points), label=name, **style)
    return [v for _, v in points]

  def axes_set(ax):
    ax.set_xscale("log", base=2)
    ticks = [2 ** k for k in range(int(length).bit_length())]
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.xaxis.set_minor_locator(plots.pyplot().NullLocator())
    ax.axvline(config.train_len, color="0.6", linestyle=":", linewidth=1)
    ax.set(xlabel="context (tokens before the predicted one)", ylabel="next-token loss")

  return _panel_plot(config, rows, path, f"loss by position in rows of {length} tokens, trained at "
                     f"{config.train_len} (dotted line)", draw, axes_set)


def plot(results: dict, config, rows, path: str):
  """Perplexity against evaluation length (log 2 lengths; :func:`posjax.experiments.plots.value_axis`), one line per
  row (the mean over its seeds, shaded between the lowest and the highest seed), a style of its own each; a row that
  runs at the training length alone is a point; the positive control in a panel of its own (:func:`panels`). Returns
  the figure (closed)."""
  lengths = [config.train_len * m for m in config.eval_multiples]

  def draw(ax, name, style):
    values = results.get(name, {}).get("perplexity", {})
    points = [(l, values[str(l)]) for l in lengths if isinstance(values.get(str(l)), float)]
    if points:
      ax.plot(*zip(*points), label=name, **style)
    seeds = results.get(name, {}).get("seeds", {}).get("perplexity", {})
    band = [(l, min(seeds[str(l)]), max(seeds[str(l)])) for l, _ in points if str(l) in seeds]
    if band:  # every seed's run inside the band
      ax.fill_between(*zip(*band), color=style.get("color"), alpha=0.15, linewidth=0)
    return [v for _, v in points] + [v for _, low, high in band for v in (low, high)]

  def axes_set(ax):
    plots.length_axis(ax, lengths, config.train_len)
    ax.set(xlabel="evaluation length", ylabel=f"{'next' if config.model in DECODERS else 'masked'}-token perplexity")

  return _panel_plot(config, rows, path, f"{config.model}: perplexity against evaluation length, trained at "
                     f"{config.train_len} (dotted line)", draw, axes_set)


def validate(config) -> None:
  """What can fail before the workdir is written: ranges, the model, the multiples, every method's run config, the
  runs to read, the positive control, the context extension, the probes."""
  config_args.check_ranges(config, RANGES)
  if config.model not in MODELS:
    raise ValueError(f"config.model={config.model!r}; allowed: {list(MODELS)}")
  stride = config.get("stride", 0)
  if stride and (stride < 0 or config.train_len % stride or config.model not in DECODERS):
    raise ValueError(f"config.stride={stride}: sliding-window perplexity needs a decoder (model='lm' or 'clm') and a "
                     f"positive stride dividing train_len={config.train_len}; 0: off")
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
    source_config(config, source.workdir)
  ext = config.get("extension")
  if not config.methods and not sources and not (ext is not None and ext.variants):
    raise ValueError("config.methods, config.runs and config.extension.variants are all empty: no row to measure")
  if config.get("control"):
    if config.get("passkey") is None:
      raise ValueError(f"config.control={config.control!r}: the positive control of passkey retrieval needs "
                       "config.passkey (a decoder's); set config.control=''")
    if not 0.0 < config.control_fraction <= 1.0:
      raise ValueError(f"config.control_fraction={config.control_fraction!r} must be in (0, 1]")
    control_config(config)
  if ext is not None and ext.variants:
    validate_extension(config, sources)
  if config.probes:
    probes.validate(probe_config(config, probe_methods(config, sources)))


def validate_extension(config, sources: dict) -> None:
  """The extension's base and options: a decoder harness, a RoPE base (a row here, or a finished run or converted
  model at ``train_len``), known variants, a factor > 1."""
  ext = config.extension
  if config.model not in DECODERS:
    raise ValueError(f"config.extension: context extension is measured on decoders (model='lm' or 'clm'), not "
                     f"model={config.model!r}")
  if not 0.0 < ext.lr_fraction:
    raise ValueError(f"config.extension.lr_fraction={ext.lr_fraction!r} must be > 0")
  if config.get("control") and ext.base == control_name(config):
    run = control_config(config)
  elif ext.base in sources or ext.base in config.methods:
    run = source_config(config, sources[ext.base].workdir) if ext.base in sources else run_config(config, ext.base)
  elif os.path.isdir(ext.base):
    if os.path.isfile(os.path.join(ext.base, "config.json")):
      trained = results_lib.read_json(os.path.join(ext.base, "config.json"))["max_len"]
    else:
      trained = checkpoint_lib.read_model_config(ext.base, "config.extension.base").get("max_len")
    if trained != config.train_len:
      raise ValueError(f"config.extension.base={ext.base!r} was trained at length {trained}, the harness's "
                       f"config.train_len is {config.train_len}; set train_len={trained}")
    run, _ = base_run(config, "")
  else:
    raise ValueError(f"config.extension.base={ext.base!r} is neither a method of config.methods or config.runs "
                     f"({table_methods(config, sources)}) nor a run's directory")
  for variant in ext.variants:
    extended(run, variant, config)


def run(config, workdir: str, train, evaluate=None) -> dict:
  """Trains or evaluates every row of :func:`plan` not yet in ``workdir/length.json``, each in its run directory
  (:func:`run_dir`; a row read from ``config.runs`` or evaluated zero-shot goes through ``evaluate(config, source,
  workdir)``), then the probes not yet in ``workdir/probes`` (``config.probes``); writes the tables and the plots.
  The workdir's config must match (``methods``, ``runs``, ``probes``, ``control`` and ``extension`` excepted: a rerun
  may add rows or probe tasks). Compiled programs are cached in ``workdir/compilation_cache``."""
  validate(config)
  rows = plan(config, workdir)
  if any(row.kind == "evaluate" for row in rows.values()) and evaluate is None:
    raise ValueError("config.runs and zero-shot extension rows need evaluate(config, source, workdir) "
                     "(posjax.main.evaluate_checkpoint)")
  os.makedirs(workdir, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", os.path.join(workdir, "compilation_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  run_checks.check_workdir_config(config, workdir, ignore=("methods", "probes", "runs", "control", "extension"))
  path = os.path.join(workdir, "length.json")
  results = {}
  if os.path.exists(path):
    with open(path) as f:
      results = json.load(f)
  seeds_path = os.path.join(workdir, "length_seeds.json")
  per_seed = results_lib.read_json(seeds_path) or {}
  start = time.perf_counter()
  for name, row in rows.items():
    if name in results:
      continue
    found = per_seed.setdefault(name, {})
    for seed in range(config.get("seeds", 1) if row.kind == "train" else 1):
      if str(seed) in found:
        continue
      directory = run_dir(workdir, name if seed == 0 else f"{name}@seed{seed}")
      if row.kind == "evaluate":
        evaluate(*row.make(), directory)
      else:
        run = row.make()
        run.seed = run.seed + seed
        train(run, directory)
      with open(os.path.join(directory, "results.json")) as f:
        found[str(seed)] = measures(json.load(f)["metrics"], config)
      results_lib.write_json(seeds_path, per_seed, sort_keys=False)
    results[name] = across_seeds([found[str(seed)] for seed in range(len(found))])
    if row.method == "t5":  # its bucket options as the run had them (the config it wrote)
      ran = results_lib.read_json(os.path.join(run_dir(workdir, name), "config.json"))
      options = ran["model"]["position_options"]
      results[name]["untrained_buckets"] = {
          str(config.train_len * m): untrained_bucket_share(options, config.train_len, config.train_len * m,
                                                            causal=config.model in DECODERS)
          for m in config.eval_multiples}
    results_lib.write_json(path, results, sort_keys=False)
    print(f"[{time.perf_counter() - start:5.0f}s] {name:>12} " + "; ".join(
        f"{measure} " + ", ".join(f"@{l}: {v if v == results_lib.UNSUPPORTED else f'{v:.2f}'}" for l, v in values.items())
        for measure, values in results[name].items() if measure in measured(config)),
        flush=True)
  names = list(rows)
  text = tables(results, config, names)
  footnote = bucket_footnote(results, config, names)
  text += f"\n\n{footnote}" if footnote else ""
  if needle_depths(config):
    text += "\n\n" + needle_table(results, config, names)
    needle_plot(results, config, names, os.path.join(workdir, "needle.png"))
  if config.get("ruler"):
    ruler_plot(results, config, names, os.path.join(workdir, "ruler.png"))
  if config.probes:
    methods = probe_methods(config, read_runs(config))
    probe = probe_config(config, methods)
    found = probes.run(probe, os.path.join(workdir, "probes"), train)
    for method in methods:
      results[method]["probes"] = {task: found[method][task] for task in probe.tasks}
    results_lib.write_json(path, results, sort_keys=False)
    text += "\n\n" + probe_tables(found, probe)
  with open(os.path.join(workdir, "length.md"), "w") as f:
    scored = next((results[name]["tokens"] for name in names if results.get(name, {}).get("tokens")), {})
    f.write(f"{header(config, rows, scored)}\n\n{text}\n")
  plot(results, config, names, os.path.join(workdir, "length.png"))
  by_position = position_plot(results, config, names, os.path.join(workdir, "position.png"))
  print(f"\n{text}\n\nwritten to {workdir}: length.md, length.json, length.png"
        + (", needle.png" if needle_depths(config) else "") + (", ruler.png" if config.get("ruler") else "")
        + (", position.png" if by_position else ""), flush=True)
  return results
