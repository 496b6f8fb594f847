"""Sweeps from the command line: a table config's rows (or any config) expanded into runs with dependencies.

  python -m posjax.experiments.sweep --config=experiments/tupe/table1.py[:options] --root=DIR [--rows=TUPE-A,TUPE-R]
      [--launcher=local|print|slurm] [--grid=key=v1,v2 ...] [--dry_run]

Each run gets its own workdir under ``--root`` with a readable name (``TUPE-R/pretrain``,
``TUPE-R/rte/lr2e-05_seed1``); fine-tuning runs depend on their row's pre-training run. ``manifest.json`` in
the root lists every run, its command and its dependencies (``python -m posjax.experiments.report`` reads it).

- ``local`` runs them here, one after the other, dependencies first, each as its printed command in a child
  process: finished runs (those with a results.json) are skipped and unfinished ones resume from their last
  checkpoint, so the same command after an interruption carries on. Compiled programs are shared through JAX's
  persistent cache in ``ROOT/compilation_cache``.
- ``print`` writes one command per run, in dependency order, for any launcher: a shell loop, a Slurm or TPU
  pod script (``gcloud compute tpus tpu-vm ssh ... --worker=all --command="..."``; add ``--distributed`` to a
  multi-host pre-training command).
- ``slurm`` submits through submitit: one multi-process JAX job per pre-training run (``--slurm_nodes`` x
  ``--slurm_tasks_per_node`` processes, ``--distributed``), and per row one job array of its fine-tuning runs
  that starts when that pre-training has succeeded (``afterok``). Job files and logs: ``ROOT/slurm``. Finished
  runs are not submitted again.

``--grid key=v1,v2`` (repeatable) runs every fine-tuning run (or the single run of a plain config) once per
value of any config field: ablations nobody wrote a file for.
"""

from __future__ import annotations

import ast
import os
import shlex
import signal
import subprocess
import sys

from absl import app, flags

from posjax import cli, config_args
from posjax.experiments import protocol

LAUNCHERS = ("local", "print", "slurm")



def _define_flags() -> None:
  """The command's flags (defined when it runs, not on import: ``posjax.main`` has its own ``--config``)."""
  flags.DEFINE_string("config", None, "A table config (or any config) file, with ':options'.")
  flags.DEFINE_string("root", None, "Directory of the runs' workdirs and the manifest.")
  flags.DEFINE_list("rows", [], "Rows of a table config to run (default: all, or the config's row=).")
  flags.DEFINE_enum("launcher", "local", LAUNCHERS, "How to run them.")
  flags.DEFINE_multi_string("grid", [], "key=v1,v2: a grid over a config field.")
  flags.DEFINE_bool("dry_run", False, "Write the manifest and list the runs; run nothing.")
  flags.DEFINE_string("slurm_partition", "", "slurm: the partition.")
  flags.DEFINE_integer("slurm_nodes", 1, "slurm: nodes per pre-training job.")
  flags.DEFINE_integer("slurm_tasks_per_node", 1, "slurm: JAX processes per node (e.g. one per GPU or TPU host).")
  flags.DEFINE_integer("slurm_gpus_per_node", 0, "slurm: GPUs per node.")
  flags.DEFINE_integer("slurm_timeout_min", 60 * 24, "slurm: time limit of each job, in minutes.")


def parse_grid(items: list[str]) -> dict[str, list]:
  """``--grid key=v1,v2`` items -> ``{key: [v1, v2]}``, each value a Python literal where it parses as one."""
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


def plan(config_spec: str, root: str, rows=(), grid=None) -> list[protocol.Run]:
  """The runs of a table config (or one run of any other config), with ``grid`` applied; the manifest is
  written to ``root``. Paths are made absolute (runs start in the checkout, wherever the sweep was started)."""
  root = os.path.abspath(root)
  config = config_args.load_config(config_spec)
  if config.get("job") == "table":
    runs = protocol.expand(config, root, rows or config.get("selected") or None)
  else:
    if rows:
      raise ValueError(f"--rows given, but {config_spec} is not a table config")
    path, sep, options = config_spec.partition(":")
    if os.path.isfile(path) and not os.path.isfile(os.path.join(protocol.ROOT, path)):
      config_spec = os.path.abspath(path) + sep + options  # a config of the user's, outside the checkout
    runs = protocol.single(config_spec, root)
  runs = protocol.add_grid(runs, grid or {})
  try:
    for run in runs:  # every run's config builds (a wrong override or grid key fails here, before anything runs)
      protocol.build(run)
  except ImportError as missing:  # run configs read the position registry's defaults, which needs JAX
    print(f"# the runs' configs are not checked here ({missing}); each run checks its own when it starts",
          file=sys.stderr)
  protocol.write_manifest(runs, root, config_spec)
  return runs


def run_table(config, workdir: str, train) -> None:
  """``python -m posjax.main --config=<table config> --workdir=ROOT``: the selected rows, here, in this process
  (``train(config, workdir)``: the training loop with its tasks, as :mod:`posjax.main` composes it)."""
  runs = protocol.expand(config, workdir, config.get("selected") or None)
  protocol.write_manifest(runs, workdir, config.name)
  run_local(runs, workdir, train)


def _say(message: str) -> None:
  print(message, flush=True)  # before the children's output, which shares the terminal (or pipe)


def run_local(runs: list[protocol.Run], root: str, train=None, say=_say) -> bool:
  """Runs every unfinished run in order (each resumes from its own checkpoints): through ``train(config,
  workdir)`` in this process, or without ``train`` each as its printed command in a child process (the sweep
  command itself needs no JAX). Either way compiled programs are shared through ``ROOT/compilation_cache``.
  Returns whether every run finished (a preempted child stops the sweep)."""
  cache = os.path.join(root, "compilation_cache")
  if train is not None:
    import jax  # imported here: the print and slurm launchers and the report run without JAX

    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  for n, run in enumerate(runs, 1):
    if run.finished():
      say(f"[{n}/{len(runs)}] {run.name}: finished")
      continue
    say(f"[{n}/{len(runs)}] {run.name}")
    if train is not None:
      config = protocol.build(run)
      config.progress = False
      train(config, run.workdir)
    else:
      status = _child(run, cache)
      if status == 130:
        raise KeyboardInterrupt(f"interrupted in {run.name}; rerun the same command to resume")
      if status:
        raise ValueError(f"{run.name} failed (exit status {status}; its output above says why); rerun the same "
                         "command to resume after fixing it")
    if not run.finished():  # preempted (SIGTERM): it saved a checkpoint; what depends on it must wait
      say(f"{run.name} stopped before its end (preempted); rerun the same command to resume")
      return False
  return True


def _child(run: protocol.Run, cache: str) -> int:
  """Runs ``run.command()`` in the checkout and waits for it. Ctrl-C reaches the child too (one process group):
  the sweep waits for the child's own stop (it finishes the step and names its checkpoint); SIGTERM is passed
  on, so a preempted sweep saves the run it was in."""
  env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  child = subprocess.Popen(shlex.split(run.command()), cwd=protocol.ROOT, env=env)
  forward = signal.signal(signal.SIGTERM, lambda signum, frame: child.send_signal(signal.SIGTERM))
  try:
    while True:
      try:
        return child.wait()
      except KeyboardInterrupt:
        continue
  finally:
    signal.signal(signal.SIGTERM, forward)


def run_slurm(runs: list[protocol.Run], root: str, *, partition: str = "", nodes: int = 1,
              tasks_per_node: int = 1, gpus_per_node: int = 0, timeout_min: int = 24 * 60) -> list:
  """Submits the unfinished runs (see the module docstring); returns the submitted jobs."""
  import submitit  # imported here: only this launcher needs it

  executor = submitit.AutoExecutor(folder=os.path.join(root, "slurm", "%j"))
  common = dict(timeout_min=timeout_min, gpus_per_node=gpus_per_node or None,
                slurm_partition=partition or None)
  common = {k: v for k, v in common.items() if v is not None}
  jobs, pretrain_jobs = [], {}
  for run in runs:
    if run.kind == "pretrain" and not run.finished():
      executor.update_parameters(name=run.name, nodes=nodes, tasks_per_node=tasks_per_node, **common)
      command = shlex.split(run.command()) + (["--distributed"] if nodes * tasks_per_node > 1 else [])
      pretrain_jobs[run.name] = executor.submit(submitit.helpers.CommandFunction(command, cwd=protocol.ROOT))
      jobs.append(pretrain_jobs[run.name])
  groups: dict[tuple, list[protocol.Run]] = {}
  for run in runs:
    if run.kind != "pretrain" and not run.finished():
      groups.setdefault(tuple(run.depends_on), []).append(run)
  for depends_on, group in groups.items():
    waits = [pretrain_jobs[name].job_id for name in depends_on if name in pretrain_jobs]
    extra = {"dependency": "afterok:" + ":".join(waits)} if waits else {}
    executor.update_parameters(name=f"{group[0].row} fine-tuning", nodes=1, tasks_per_node=1,
                               slurm_additional_parameters=extra, **common)
    with executor.batch():  # one job array
      array = [executor.submit(submitit.helpers.CommandFunction(shlex.split(run.command()), cwd=protocol.ROOT))
               for run in group]
    jobs += array
  return jobs


def main(argv):
  """Plans the runs and hands them to ``--launcher``."""
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
  if f.launcher == "slurm":
    jobs = run_slurm(runs, f.root, partition=f.slurm_partition, nodes=f.slurm_nodes,
                     tasks_per_node=f.slurm_tasks_per_node, gpus_per_node=f.slurm_gpus_per_node,
                     timeout_min=f.slurm_timeout_min)
    print(f"submitted {len(jobs)} jobs (logs in {os.path.join(f.root, 'slurm')}); when they are done: "
          f"python -m posjax.experiments.report --root={f.root}")
    return
  if run_local(runs, os.path.abspath(f.root)):
    print(f"{len(runs)} runs done; python -m posjax.experiments.report --root={f.root}")


def entry():
  """``python -m posjax.experiments.sweep``: the command's flags, and its mistakes as one line."""
  _define_flags()
  app.run(lambda argv: cli.run_user_errors(main, argv))


if __name__ == "__main__":
  entry()
