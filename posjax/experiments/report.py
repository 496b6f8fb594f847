"""The table of a sweep beside the paper's: ``python -m posjax.experiments.report --root=DIR``.

Reads only ``DIR/manifest.json`` and the runs' ``results.json``; applies the protocol of the table config
(:func:`posjax.experiments.protocol.score`: per task the median over seeds of each learning rate, then the best learning
rate among complete ones, MNLI's two columns from one learning rate, failed runs left out) and prints, per row
and column, the paper's number, posjax's, and the difference, the seeds behind each number and their spread, a
*partial* mark on every number (and average) built from an incomplete grid, the pre-training step each row
starts from, the average as the paper computes it (TUPE: the GLUE average of the nine numbers), and the runs
that are missing, unfinished or failed. Written to ``DIR/report.md`` and ``DIR/report.csv``. A partial sweep gives a partial table.
"""

from __future__ import annotations

import csv
import os
import sys

from absl import app, flags

from posjax import cli, config_args
from posjax.experiments import protocol
from posjax.finetune import metrics as metrics_lib


def average(table, cells: dict) -> tuple[float | None, bool]:
  """The row's average as its paper computes it (``None`` while a column is missing), and whether every number
  in it comes from a complete grid."""
  if table.get("average") != "glue":
    return None, True
  evaluators = {evaluator: (column, metric) for column, evaluator, metric in table.columns}
  try:
    value = metrics_lib.glue_score({evaluator: {metric: cells[column]["value"]}
                                    for evaluator, (column, metric) in evaluators.items() if column in cells})
  except (ValueError, TypeError):
    return None, True
  return value, all(cells[column].get("complete", True) for column, _ in evaluators.values())


def build(root: str) -> tuple[str, list[list], list[str]]:
  """``(markdown, csv rows, missing runs)`` for the sweep in ``root``."""
  source, runs = protocol.read_manifest(root)
  table = config_args.load_config(source)
  if table.get("job") != "table":
    raise ValueError(f"{source} is not a table config: nothing to report beside a paper")
  scored = protocol.score(table, runs)
  columns = [column for column, _, _ in table.columns] + (["Avg"] if table.get("average") else [])
  header = ["row", "start"] + columns
  how = [table.protocol, ""] if table.get("protocol") else []
  lines = [f"# {table.name}", "", *how, "Each cell: posjax (paper, difference); n = seeds at the best learning rate, "
           "± = their spread (max - min); *partial k/n*: only k of the task's n runs finished with a number, so "
           "the cell (and the average) may change. start: the pre-training step the row fine-tunes from.", "",
           "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  rows_csv = [["row", "column", "posjax", "paper", "difference", "best_lr", "seeds", "spread", "complete", "start"]]
  for row, cells in scored["rows"].items():
    if not any(run.row == scored["base"][row] for run in runs):
      continue
    start = ", ".join(str(s) for s in scored["starts"].get(row, [])) or "—"
    paper = dict(table.rows[scored["base"][row]].get("paper", {}))
    texts = []
    for column in columns:
      cell = {"value": None}
      if column == "Avg":
        cell["value"], cell["complete"] = average(table, cells)
      elif column in cells:
        cell = cells[column]
      mine, theirs = cell["value"], paper.get(column)
      diff = None if not isinstance(mine, float) or theirs is None else mine - theirs
      texts.append(_cell(mine, theirs, diff, cell))
      rows_csv.append([row, column, mine, theirs, diff, cell.get("lr"), cell.get("seeds"), cell.get("spread"),
                       cell.get("complete"), start])
    lines.append(f"| {row} | {start} | " + " | ".join(texts) + " |")
  missing, failed = scored["missing"], scored["failed"]
  if missing:
    lines += ["", f"Missing or unfinished runs ({len(missing)}): " + ", ".join(missing)]
  if failed:
    lines += ["", f"Failed runs ({len(failed)}: a non-finite number, left out of every median): " + ", ".join(failed)]
  return "\n".join(lines) + "\n", rows_csv, missing


def _cell(mine, theirs, diff, cell: dict) -> str:
  if mine == protocol.UNSUPPORTED:
    return mine
  if mine is None:
    return "—" if theirs is None else f"— ({theirs:.2f})"
  text = f"{mine:.2f}"
  if theirs is not None:
    text += f" ({theirs:.2f}, {diff:+.2f})"
  seeds, spread = cell.get("seeds"), cell.get("spread")
  if seeds:
    text += f" n={seeds}" + (f" ±{spread:.2f}" if seeds > 1 else "")
  if not cell.get("complete", True):
    text += f" *partial {cell['finished']}/{cell['runs']}*" if "runs" in cell else " *partial*"
  return text


def write(root: str) -> str:
  """``report.md`` and ``report.csv`` in ``root``; returns the markdown."""
  markdown, rows_csv, _ = build(root)
  with open(os.path.join(root, "report.md"), "w") as f:
    f.write(markdown)
  with open(os.path.join(root, "report.csv"), "w", newline="") as f:
    csv.writer(f).writerows(rows_csv)
  return markdown


def main(argv):
  """Writes the report of ``--root`` and prints it."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS.root:
    raise app.UsageError("--root is required")
  print(write(flags.FLAGS.root) + f"\nwritten to {flags.FLAGS.root}: report.md, report.csv", file=sys.stdout)


def entry():
  """``python -m posjax.experiments.report``: its flag, and its mistakes as one line."""
  flags.DEFINE_string("root", None, "The sweep's root directory (holding manifest.json).")
  app.run(lambda argv: cli.run_user_errors(main, argv))


if __name__ == "__main__":
  entry()
