"""What a run reports, and which of its evaluations counts: ``results.json`` and ``evaluations.jsonl``.

Every evaluation of a run is appended to ``evaluations.jsonl`` (``{"step", "metrics": {evaluator: {metric:
value}}}``); a resumed run drops the lines after its checkpoint, so the log is the one an uninterrupted run
writes. ``results.json`` holds what the run was, all its evaluations (``"evaluations"``) and the one the
protocol selects (``"metrics"``, ``"selected_step"``), which sweeps and reports read:

- ``select="last"``: the last evaluation (Huang et al.'s SQuAD protocol: the model after 2 epochs);
- ``select="best"`` with ``select_metric="<evaluator>/<metric>"``: the evaluation where that number is
  highest (TUPE's fine-tuning: fairseq's ``--best-checkpoint-metric ... --maximize-best-checkpoint-metric``
  over its validations; for MNLI the first validation set, matched, chooses, and mismatched comes from the
  same evaluation). Ties go to the earlier evaluation; a non-finite value is never the best.

Imports nothing of JAX: the report reads these files where JAX is not installed.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

UNSUPPORTED = "unsupported"  # an evaluation the model cannot run (e.g. longer than its learned position table)
SELECTIONS = ("best", "last")
EVALUATIONS = "evaluations.jsonl"


def write_text(path: str, text: str) -> None:
  """``text`` to ``path`` atomically: a reader (or a run killed mid-write) sees the old file or the new one."""
  with open(path + ".tmp", "w") as f:
    f.write(text)
  os.replace(path + ".tmp", path)


def write_json(path: str, value: Any, *, indent: int | None = 1, sort_keys: bool = True) -> None:
  """``value`` to ``path`` as JSON, atomically (:func:`write_text`)."""
  write_text(path, json.dumps(value, indent=indent, sort_keys=sort_keys))


def read_json(path: str) -> Any | None:
  """The JSON value in ``path``; None when there is no such file."""
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    return json.load(f)


def check_selection(select: str, metric: str, evaluators) -> None:
  """``select`` and ``select_metric`` against the run's evaluator names; an error names what is allowed."""
  if select not in SELECTIONS:
    raise ValueError(f"config.select={select!r}; allowed: {list(SELECTIONS)}")
  if select == "best":
    evaluator, slash, name = metric.partition("/")
    if not slash or not name or evaluator not in evaluators:
      raise ValueError(f"config.select='best' needs config.select_metric='<evaluator>/<metric>' with an evaluator "
                       f"of config.evals {sorted(evaluators)}; got {metric!r}")


def metric_value(metrics: dict, metric: str) -> float | None:
  """``metrics[evaluator][name]`` for ``metric="evaluator/name"``, as a finite float, else ``None``."""
  evaluator, _, name = metric.partition("/")
  value = metrics.get(evaluator, {}).get(name)
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
    return None
  return float(value)


def select(evaluations: list[dict], how: str, metric: str = "") -> dict | None:
  """The evaluation the protocol reports (see the module docstring); ``None`` when there is none."""
  if not evaluations:
    return None
  if how == "last":
    return evaluations[-1]
  if how != "best":
    raise ValueError(f"unknown selection {how!r}; allowed: {list(SELECTIONS)}")
  evaluator, _, name = metric.partition("/")
  if not any(name in e["metrics"].get(evaluator, {}) for e in evaluations):
    known = sorted({m for e in evaluations for m in e["metrics"].get(evaluator, {})})
    raise ValueError(f"config.select_metric={metric!r}: evaluator {evaluator!r} reports no {name!r}; it reports {known}")
  scored = [(metric_value(e["metrics"], metric), -i, e) for i, e in enumerate(evaluations)]
  finite = [s for s in scored if s[0] is not None]
  if not finite:
    return evaluations[-1]  # every value failed (NaN): the run is failed whichever we show
  return max(finite, key=lambda s: s[:2])[2]


class EvaluationLog:
  """``workdir/evaluations.jsonl`` of a run that starts (or resumes) at ``step``: the evaluations up to that step
  are kept, later ones dropped (the resumed run makes them again). Only process 0 (``enabled``) writes it; every
  process holds the list."""

  def __init__(self, workdir: str, step: int, enabled: bool = True):
    self.path = os.path.join(workdir, EVALUATIONS)
    self.enabled = enabled
    self.evaluations = [e for e in read_evaluations(workdir) if e["step"] <= step]
    self._write()

  def append(self, step: int, metrics: dict) -> list[dict]:
    """Adds this evaluation (replacing one of the same step) and returns them all."""
    self.evaluations = [e for e in self.evaluations if e["step"] != step] + [{"step": step, "metrics": metrics}]
    self._write()
    return self.evaluations

  def _write(self) -> None:
    if not self.enabled:
      return
    write_text(self.path, "".join(json.dumps(e, sort_keys=True) + "\n" for e in self.evaluations))


def read_evaluations(workdir: str) -> list[dict]:
  """A run's ``evaluations.jsonl``, in order; none when it has not evaluated yet."""
  path = os.path.join(workdir, EVALUATIONS)
  if not os.path.isfile(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def run_results(info: dict, evaluations: list[dict], how: str, metric: str) -> dict:
  """``results.json``'s content: ``info`` (what the run was), every evaluation and the selected one."""
  chosen = select(evaluations, how, metric)
  return {**info, "evaluations": evaluations, "select": how, "select_metric": metric or None,
          "selected_step": None if chosen is None else chosen["step"],
          "metrics": {} if chosen is None else chosen["metrics"]}
