"""Papers' tables as experiments: a table config names its rows by the paper's names; each row is a pipeline
(pre-train once, then fine-tune every task x learning rate x seed from the right checkpoint) that
:func:`expand` turns into runs with dependencies, and the report protocol that turns their results into the
table (median over seeds per learning rate, best learning rate per task).

A table config (``configs/tupe/table1.py``, ``configs/huang2020/table1.py``, ...) is a ConfigDict with
``job = "table"`` and:

- ``pretrain``: ``{config, options, overrides}``, the pre-training config file every row starts from
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
import importlib.util
import json
import os
import re
import shlex
import statistics
import sys
from typing import Any, Iterable

import ml_collections

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNSUPPORTED = "unsupported"  # an evaluation a model cannot run (a length beyond its learned table)


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
  if isinstance(value, bool):
    return str(value)
  if isinstance(value, (tuple, list)):
    return "(" + ",".join(format_value(v) for v in value) + ("," if len(value) == 1 else "") + ")"
  return str(value)


def slug(text: str) -> str:
  """A directory name from a paper's row name: ``TUPE-A (mid)`` -> ``TUPE-A_mid``, ``BERT-A^d`` -> ``BERT-A^d``."""
  return re.sub(r"[^A-Za-z0-9^.+=-]+", "_", text).strip("_")


def load_config(spec: str) -> ml_collections.ConfigDict:
  """``path/to/config.py[:options]`` -> ``get_config(options)``, as ``--config`` loads it."""
  path, _, options = spec.partition(":")
  full = path if os.path.isabs(path) else os.path.join(ROOT, path)
  if not os.path.isfile(full):
    raise FileNotFoundError(f"config file {path} does not exist")
  module_spec = importlib.util.spec_from_file_location(f"posjax_config_{slug(path)}", full)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(options or None)


def apply_overrides(config: ml_collections.ConfigDict, overrides: dict) -> ml_collections.ConfigDict:
  """``config`` with dotted fields set (as ``--config.a.b=value``); an unknown field is an error."""
  for key, value in overrides.items():
    target = config
    *parents, leaf = key.split(".")
    for parent in parents:
      target = target[parent]
    if leaf not in target:
      raise ValueError(f"unknown config field {key!r} (in an override or --grid)")
    target[leaf] = value
  return config


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
      if steps:
        overrides["keep_steps"] = tuple(steps)
      run = Run(f"{slug(owner)}/pretrain", owner, "pretrain", table.pretrain.config,
                _options(table.pretrain.options, own.options), overrides,
                os.path.join(root, slug(owner), "pretrain"))
      pretrain_runs[owner] = runs[run.name] = run
    pre = pretrain_runs[owner]
    for task, job in table.finetune.items():
      for lr in table.lrs:
        for seed in table.seeds:
          overrides = {**dict(job.get("overrides", ())), "init": pre.workdir}
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
  os.makedirs(root, exist_ok=True)
  path = os.path.join(root, "manifest.json")
  with open(path + ".tmp", "w") as f:
    json.dump({"config": source, "runs": [dataclasses.asdict(r) | {"command": r.command()} for r in runs]}, f,
              indent=1)
  os.replace(path + ".tmp", path)
  return path


def read_manifest(root: str) -> tuple[str, list[Run]]:
  path = os.path.join(root, "manifest.json")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{root} has no manifest.json (python -m posjax.sweep writes it)")
  with open(path) as f:
    manifest = json.load(f)
  fields = {f.name for f in dataclasses.fields(Run)}
  return manifest["config"], [Run(**{k: v for k, v in r.items() if k in fields}) for r in manifest["runs"]]


def build(run: Run) -> ml_collections.ConfigDict:
  return apply_overrides(load_config(f"{run.config}:{run.options}" if run.options else run.config), run.overrides)


# ----------------------------------------------------------------------------------------------------------
# The report protocol.


def results(run: Run) -> dict | None:
  path = os.path.join(run.workdir, "results.json")
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    return json.load(f)


def score(table: ml_collections.ConfigDict, runs: list[Run]) -> dict:
  """``{row: {column: {value, lr, seeds, spread}}}``: per task the median over seeds of each learning rate, and
  the best learning rate's median (TUPE's protocol; one lr and one seed give that run's number); missing runs
  are listed under ``"missing"``."""
  table_out: dict[str, Any] = {"rows": {}, "missing": []}
  for row in row_order(table):
    cells = {}
    for column, evaluator, metric in table.columns:
      by_lr: dict[float, list[float]] = {}
      unsupported = False
      task = _task_of(table, evaluator)
      for run in runs:
        if run.row != row or run.kind != "finetune" or run.task != task:
          continue
        found = results(run)
        value = None if found is None else found.get("metrics", {}).get(evaluator, {}).get(metric)
        if isinstance(value, (int, float)):
          by_lr.setdefault(run.lr, []).append(float(value))
        elif value == UNSUPPORTED:
          unsupported = True
        elif run.name not in table_out["missing"]:
          table_out["missing"].append(run.name)
      if unsupported and not by_lr:
        cells[column] = {"value": UNSUPPORTED, "lr": None, "seeds": None, "spread": None}
      if by_lr:
        medians = {lr: statistics.median(values) for lr, values in by_lr.items()}
        best = max(medians, key=medians.get)
        cells[column] = {"value": medians[best], "lr": best, "seeds": len(by_lr[best]),
                         "spread": max(by_lr[best]) - min(by_lr[best])}
    table_out["rows"][row] = cells
  return table_out


def row_order(table) -> list[str]:
  return [row for row in table.get("row_order", ()) if row in table.rows] or list(table.rows)


def _task_of(table, evaluator: str) -> str:
  """The fine-tuning task whose run reports ``evaluator`` (``mnli_matched`` -> ``mnli``)."""
  for task in table.finetune:
    if evaluator == task or evaluator.startswith(f"{task}_") or evaluator.startswith(f"{task}@"):
      return task
  raise ValueError(f"column evaluator {evaluator!r} matches no fine-tuning task of {list(table.finetune)}")
