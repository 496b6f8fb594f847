"""Sweeps from the command line: a table config's rows (or any config) expanded into runs with dependencies.

  python -m posjax.sweep --config=configs/tupe/table1.py[:options] --root=DIR [--rows=TUPE-A,TUPE-R]
      [--launcher=local|print] [--grid=key=v1,v2 ...] [--dry_run]

Each run gets its own workdir under ``--root`` with a readable name (``TUPE-R/pretrain``,
``TUPE-R/rte/lr2e-05_seed1``); fine-tuning runs depend on their row's pre-training run. ``manifest.json`` in
the root lists every run, its command and its dependencies (``python -m posjax.report`` reads it).

- ``local`` runs them here, one after the other, dependencies first: finished runs (those with a
  results.json) are skipped and unfinished ones resume from their last checkpoint, so the same command after an
  interruption carries on. Compiled programs are shared through JAX's persistent cache in ``ROOT/compilation_cache``.
- ``print`` writes one command per run, in dependency order, for any launcher: a shell loop, a Slurm or TPU
  pod script (``gcloud compute tpus tpu-vm ssh ... --worker=all --command="..."``; add ``--distributed`` to a
  multi-host pre-training command).

``--grid key=v1,v2`` (repeatable) runs every fine-tuning run (or the single run of a plain config) once per
value of any config field: ablations nobody wrote a file for.
"""

from __future__ import annotations

import ast
import os
import sys

import jax
from absl import app, flags

from posjax import experiments

LAUNCHERS = ("local", "print")



def _define_flags() -> None:
  """The command's flags (defined when it runs, not on import: ``posjax.main`` has its own ``--config``)."""
  flags.DEFINE_string("config", None, "A table config (or any config) file, with ':options'.")
  flags.DEFINE_string("root", None, "Directory of the runs' workdirs and the manifest.")
  flags.DEFINE_list("rows", [], "Rows of a table config to run (default: all, or the config's row=).")
  flags.DEFINE_enum("launcher", "local", LAUNCHERS, "How to run them.")
  flags.DEFINE_multi_string("grid", [], "key=v1,v2: a grid over a config field.")
  flags.DEFINE_bool("dry_run", False, "Write the manifest and list the runs; run nothing.")


def parse_grid(items: list[str]) -> dict[str, list]:
  grid = {}
  for item in items:
    key, sep, values = item.partition("=")
    if not sep or not values:
      raise ValueError(f"--grid {item!r}: expected key=v1,v2,...")
    grid[key] = [_literal(v) for v in values.split(",")]
  return grid


def _literal(text: str):
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def plan(config_spec: str, root: str, rows=(), grid=None) -> list[experiments.Run]:
  """The runs of a table config (or one run of any other config), with ``grid`` applied; the manifest is
  written to ``root``."""
  config = experiments.load_config(config_spec)
  if config.get("job") == "table":
    runs = experiments.expand(config, root, rows or config.get("selected") or None)
  else:
    if rows:
      raise ValueError(f"--rows given, but {config_spec} is not a table config")
    runs = experiments.single(config_spec, root)
  runs = experiments.add_grid(runs, grid or {})
  for run in runs:  # every run's config builds (a wrong override or grid key fails here, before anything runs)
    experiments.build(run)
  experiments.write_manifest(runs, root, config_spec)
  return runs


def run_table(config, workdir: str) -> None:
  """``python -m posjax.main --config=<table config> --workdir=ROOT``: the selected rows, here (local)."""
  runs = experiments.expand(config, workdir, config.get("selected") or None)
  experiments.write_manifest(runs, workdir, config.name)
  run_local(runs, workdir)


def run_local(runs: list[experiments.Run], root: str, say=print) -> None:
  """Runs every unfinished run in order (each resumes from its own checkpoints)."""
  from posjax.train import loop  # imported here: the training stack is slow to load

  jax.config.update("jax_compilation_cache_dir", os.path.join(root, "compilation_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  for n, run in enumerate(runs, 1):
    if run.finished():
      say(f"[{n}/{len(runs)}] {run.name}: finished")
      continue
    say(f"[{n}/{len(runs)}] {run.name}")
    config = experiments.build(run)
    config.progress = False
    loop.run(config, run.workdir)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  f = flags.FLAGS
  if not f.config or not f.root:
    raise app.UsageError("--config and --root are required")
  runs = plan(f.config, f.root, f.rows, parse_grid(f.grid))
  if f.dry_run or f.launcher == "print":
    for run in runs:
      print(run.command() if f.launcher == "print" else f"{run.name}: {run.workdir}")
    print(f"# {len(runs)} runs; manifest: {os.path.join(f.root, 'manifest.json')}", file=sys.stderr)
    return
  run_local(runs, f.root)
  print(f"{len(runs)} runs done; python -m posjax.report --root={f.root}")


def entry():
  from posjax import cli  # imported here: it loads the training stack

  _define_flags()
  app.run(lambda argv: cli.run_user_errors(main, argv))


if __name__ == "__main__":
  entry()
