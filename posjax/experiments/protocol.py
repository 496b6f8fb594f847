"""Papers' tables as experiments: a table config names its rows by the paper's names; each row is a pipeline
(pre-train once, then fine-tune every task x learning rate x seed from the right checkpoint) that
:func:`expand` turns into runs with dependencies, and the report protocol that turns their results into the
table (median over seeds per learning rate, best learning rate per task).

A table config (``experiments/tupe/table1.py``, ``experiments/huang2020/table1.py``, ...) is a ConfigDict with
``job = "table"`` and:

- ``pretrain``: ``{config, options, overrides}``, the pre-training config file every row starts from (its
  ``get_config`` takes ``keep=`` for the steps "mid" rows start from, kept beside its own ``keep_steps``)
  (``overrides``: ``[dotted field, value]`` pairs, as ``--config.<field>=<value>``);
- ``finetune``: ``{task: {config, options, overrides}}``, one fine-tuning config per task;
- ``lrs``, ``seeds``: the fine-tuning grid;
- ``rows``: ``{row name: {options, overrides, step, pretrain_of, paper}}``: the row's pre-training options and
  overrides, the kept step fine-tuning starts from (``None``: the last), the row whose pre-training it shares
  (TUPE's "mid" rows), and the paper's numbers (``{column: value}``);
- ``columns``: ``[[column, evaluator name, metric], ...]`` read from each task's results.json, in the paper's
  order; ``row_order``: the rows in the paper's order (a ConfigDict sorts its keys); ``average``: ``glue``
  (TUPE's GLUE average) or ``""``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shlex
import statistics
import sys
from typing import Any, Iterable

import ml_collections

from posjax import config_args
from posjax import results as results_lib

ROOT = config_args.ROOT
UNSUPPORTED = results_lib.UNSUPPORTED


@dataclasses.dataclass
class Run:
  """One training run: a config file with options and field overrides, in its own workdir."""
  name: str
  row: str
  kind: str  # pretrain | finetune | run
  config: str  # a config file (relative to the repository root, or absolute)
  options: str
  overrides: dict
  workdir: str
  depends_on: list[str] = dataclasses.field(default_factory=list)
  task: str = ""
  lr: float | None = None
  seed: int | None = None

  def command(self, python: str | None = None) -> str:
    """The command line that runs it (any launcher can execute it); ``python``: default this interpreter."""
    config = f"--config={self.config}" + (f":{self.options}" if self.options else "")
    parts = [python or sys.executable, "-m", "posjax.main", config, f"--workdir={self.workdir}"]
    parts += [f"--config.{key}={format_value(value)}" for key, value in self.overrides.items()]
    return " ".join(shlex.quote(p) for p in parts)

  def finished(self) -> bool:
    return os.path.isfile(os.path.join(self.workdir, "results.json"))


def format_value(value: Any) -> str:
  """A value as ``--config.<field>=`` reads it back (tuples in parentheses)."""
  if isinstance(value, bool):
    return str(value)
  if isinstance(value, (tuple, list)):
    return "(" + ",".join(format_value(v) for v in value) + ("," if len(value) == 1 else "") + ")"
  return str(value)


def slug(text: str) -> str:
  """A directory name from a paper's row name: ``TUPE-A (mid)`` -> ``TUPE-A_mid``, ``BERT-A^d`` -> ``BERT-A^d``."""
  return re.sub(r"[^A-Za-z0-9^.+=-]+", "_", text).strip("_")


def _options(*parts: str) -> str:
  return ",".join(p for p in parts if p)


def expand(table: ml_collections.ConfigDict, root: str, rows: Iterable[str] | None = None) -> list[Run]:
  """The runs of ``rows`` (default all), pre-training first, each fine-tuning run after its pre-training."""
  names = row_order(table)
  chosen = names if not rows else list(rows)
  unknown = [r for r in chosen if r not in table.rows]
  if unknown:
    raise ValueError(f"unknown row(s) {unknown}; {table.name} has {names}")
  runs: dict[str, Run] = {}
  pretrain_runs = {}
  for row in chosen:
    spec = table.rows[row]
    owner = spec.get("pretrain_of") or row
    if owner not in pretrain_runs:
      own = table.rows[owner]
      overrides = {**dict(table.pretrain.get("overrides", ())), **dict(own.get("overrides", ()))}
      steps = sorted({table.rows[r].step for r in names if (table.rows[r].get("pretrain_of") or r) == owner
                      and table.rows[r].get("step")})
      # The mid rows' steps are kept beside the recipe's own (TUPE's Figure 5 needs 100k, 300k, 600k): the
      # pre-training config's ``keep`` option, so that listing the runs needs no config built.
      keep = f"keep={'+'.join(str(int(s)) for s in steps)}" if steps else ""
      run = Run(f"{slug(owner)}/pretrain", owner, "pretrain", table.pretrain.config,
                _options(table.pretrain.options, own.options, keep), overrides,
                os.path.join(root, slug(owner), "pretrain"))
      pretrain_runs[owner] = runs[run.name] = run
    pre = pretrain_runs[owner]
    for task, job in table.finetune.items():
      for lr in table.lrs:
        for seed in table.seeds:
          # One cache of encoded features for the whole sweep: each task is tokenized once, not once a run.
          overrides = {"data.cache_dir": os.path.join(root, "feature_cache"), **dict(job.get("overrides", ())),
                       "init": pre.workdir}
          if spec.get("step"):
            overrides["init_step"] = int(spec.step)
          name = f"{slug(row)}/{task}/lr{lr:g}_seed{seed}"
          runs[name] = Run(name, row, "finetune", job.config, _options(job.options, f"lr={lr:g}", f"seed={seed}"),
                           overrides, os.path.join(root, name), [pre.name], task, lr, seed)
  return list(runs.values())


def single(config_spec: str, root: str) -> list[Run]:
  """A plain config (not a table) as one run."""
  path, _, options = config_spec.partition(":")
  return [Run("run", "", "run", path, options, {}, os.path.join(root, "run"))]


def add_grid(runs: list[Run], grid: dict[str, list]) -> list[Run]:
  """Every run (fine-tuning runs, for a table) once per combination of ``grid`` values, in its own workdir."""
  for key, values in grid.items():
    expanded = []
    for run in runs:
      if run.kind == "pretrain":
        expanded.append(run)
        continue
      for value in values:
        suffix = f"{key.split('.')[-1]}={format_value(value)}"
        expanded.append(dataclasses.replace(run, name=f"{run.name}/{suffix}", workdir=os.path.join(run.workdir, suffix),
                                            overrides={**run.overrides, key: value}))
    runs = expanded
  return runs


def write_manifest(runs: list[Run], root: str, source: str) -> str:
  """``root/manifest.json``: the table config and every run with its command; returns its path."""
  os.makedirs(root, exist_ok=True)
  path = os.path.join(root, "manifest.json")
  results_lib.write_json(path, {"config": source, "runs": [dataclasses.asdict(r) | {"command": r.command()}
                                                           for r in runs]}, sort_keys=False)
  return path


def read_manifest(root: str) -> tuple[str, list[Run]]:
  """The table config and the runs that ``root/manifest.json`` lists."""
  path = os.path.join(root, "manifest.json")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{root} has no manifest.json (python -m posjax.experiments.sweep writes it)")
  with open(path) as f:
    manifest = json.load(f)
  fields = {f.name for f in dataclasses.fields(Run)}
  return manifest["config"], [Run(**{k: v for k, v in r.items() if k in fields}) for r in manifest["runs"]]


def build(run: Run) -> ml_collections.ConfigDict:
  """The run's full config: its config file with its options, then its overrides."""
  return config_args.apply_overrides(config_args.load_config(f"{run.config}:{run.options}" if run.options else run.config),
                                     run.overrides)


# ----------------------------------------------------------------------------------------------------------
# The report protocol.


def results(run: Run) -> dict | None:
  """The run's ``results.json``; None while it has not finished."""
  return results_lib.read_json(os.path.join(run.workdir, "results.json"))


def _value(found: dict, evaluator: str, metric: str):
  """A run's number for a column (a float, possibly NaN), ``UNSUPPORTED``, or ``None`` when it has none."""
  value = found.get("metrics", {}).get(evaluator, {}).get(metric)
  if value == UNSUPPORTED:
    return UNSUPPORTED
  return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _finite(value) -> bool:
  return isinstance(value, float) and math.isfinite(value)


def task_columns(table) -> dict[str, list[tuple[str, str, str]]]:
  """``{task: [(column, evaluator, metric), ...]}`` in the table's order; the first column of a task is the one
  its learning rate is chosen by (``table.selection``: ``{task: column}`` names another)."""
  grouped: dict[str, list] = {}
  for column, evaluator, metric in table.columns:
    grouped.setdefault(_task_of(table, evaluator), []).append((column, evaluator, metric))
  for task, column in dict(table.get("selection", {})).items():
    chosen = [c for c in grouped.get(task, []) if c[0] == column]
    if not chosen:
      raise ValueError(f"table.selection.{task}={column!r} is not a column of task {task!r}")
    grouped[task] = chosen + [c for c in grouped[task] if c[0] != column]
  return grouped


def score(table: ml_collections.ConfigDict, runs: list[Run]) -> dict:
  """TUPE's protocol over a sweep's results (each run's ``metrics``: the evaluation its config selects):

  - per task and learning rate, the median over seeds; the reported learning rate is the best median of the
    task's selection column (its first; MNLI: matched), and every column of the task comes from that learning
    rate's runs (MNLI-mm from the learning rate MNLI-m chose);
  - a learning rate is eligible only with all its runs finished and finite while any learning rate has that;
    otherwise (a partial sweep) the best of what finished, and the cell is ``complete: False``;
  - a finished run whose selection number is not finite (NaN: e.g. STS-B's Pearson of constant predictions) is
    failed: never in a median, listed under ``failed``; runs without results are listed under ``missing``.

  Runs of a ``--grid`` are scored per grid value, as rows ``"<row> [<key>=<value>]"`` (``base``: their row).
  Returns ``{"rows": {row: {column: cell}}, "starts": {row: [init steps]}, "base": {row: table row}, "missing":
  [...], "failed": [...]}``
  with cells ``{value, lr, seeds, spread, complete, runs, finished}`` (``finished``: runs of the task's grid
  with a finite number, ``runs``: all of them)."""
  out: dict[str, Any] = {"rows": {}, "starts": {}, "base": {}, "missing": [], "failed": []}
  grouped = task_columns(table)
  for row, arm in ((row, arm) for row in row_order(table) for arm in grid_arms(runs, row)):
    label = f"{row} [{arm}]" if arm else row
    cells, starts = {}, set()
    for task, columns in grouped.items():
      task_runs = [r for r in runs if r.row == row and r.kind == "finetune" and r.task == task
                   and grid_arm(r) == arm]
      lrs = list(dict.fromkeys(r.lr for r in task_runs))
      good: dict[float, list[dict]] = {lr: [] for lr in lrs}
      unsupported = False
      for run in task_runs:
        found = results(run)
        if found is None:
          out["missing"].append(run.name)
          continue
        if found.get("init_step") is not None:
          starts.add(int(found["init_step"]))
        values = {column: _value(found, evaluator, metric) for column, evaluator, metric in columns}
        chosen = values[columns[0][0]]
        if chosen == UNSUPPORTED:
          unsupported = True
        elif chosen is None:
          out["missing"].append(run.name)
        elif any(isinstance(v, float) and not math.isfinite(v) for v in values.values()):
          out["failed"].append(run.name)  # e.g. MNLI-mm NaN beside a finite MNLI-m: the run failed
        else:
          good[run.lr].append(values)
      expected = {lr: sum(r.lr == lr for r in task_runs) for lr in lrs}
      complete = [lr for lr in lrs if good[lr] and len(good[lr]) == expected[lr]]
      eligible = complete or [lr for lr in lrs if good[lr]]
      if not eligible:
        if unsupported:
          cells.update({c[0]: {"value": UNSUPPORTED, "lr": None, "seeds": None, "spread": None, "complete": True}
                        for c in columns})
        continue
      median = {lr: statistics.median(v[columns[0][0]] for v in good[lr]) for lr in eligible}
      best = max(eligible, key=lambda lr: (median[lr], -lrs.index(lr)))  # a tie: the first learning rate
      finished = sum(map(len, good.values()))
      for column, _, _ in columns:
        numbers = [v[column] for v in good[best] if _finite(v[column])]
        if not numbers:
          if any(v[column] == UNSUPPORTED for v in good[best]):
            cells[column] = {"value": UNSUPPORTED, "lr": best, "seeds": None, "spread": None, "complete": True}
          continue
        cells[column] = {"value": statistics.median(numbers), "lr": best, "seeds": len(numbers),
                         "spread": max(numbers) - min(numbers), "complete": finished == len(task_runs),
                         "finished": finished, "runs": len(task_runs)}
    out["rows"][label], out["starts"][label], out["base"][label] = cells, sorted(starts), row
  return out


def grid_arm(run: Run) -> str:
  """The ``--grid`` values a fine-tuning run adds to its table cell (``"data.batching=fixed"``), or ``""``."""
  base = f"{slug(run.row)}/{run.task}/lr{run.lr:g}_seed{run.seed}"
  return run.name[len(base) + 1:] if run.name.startswith(base + "/") else ""


def grid_arms(runs: list[Run], row: str) -> list[str]:
  """A row's grid arms, each scored as a row of its own (``[""]``: no grid)."""
  return list(dict.fromkeys(grid_arm(r) for r in runs if r.row == row and r.kind == "finetune")) or [""]


def row_order(table) -> list[str]:
  """The rows in the paper's order (``row_order``, else as the config holds them)."""
  return [row for row in table.get("row_order", ()) if row in table.rows] or list(table.rows)


def _task_of(table, evaluator: str) -> str:
  """The fine-tuning task whose run reports ``evaluator`` (``mnli_matched`` -> ``mnli``)."""
  for task in table.finetune:
    if evaluator == task or evaluator.startswith(f"{task}_") or evaluator.startswith(f"{task}@"):
      return task
  raise ValueError(f"column evaluator {evaluator!r} matches no fine-tuning task of {list(table.finetune)}")
