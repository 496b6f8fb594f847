"""posjax's entry point: ``python -m posjax.main --config=configs/pretrain.py:position=tupe_r --workdir=DIR``
(or ``configs/finetune/glue.py:task=rte``, ``configs/finetune/squad.py``, ``configs/probes.py``, a paper table's
``experiments/tupe/table1.py:row=TUPE-R``). It is the one composition root: it hands the tasks to the loop.

``--config.a.b=value`` overrides any field. Restarting the same command with the same workdir resumes.
``--target=v5e:4x4`` (or ``h100``, ``h200:8``, ...; comma-separated) compiles the run's train step for those devices
on this machine instead of training (:mod:`posjax.aot.compile`): does it compile, and does it fit?
Multi-host: ``--coordinator_address``, ``--num_processes``, ``--process_id`` (defaults from the
``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID`` environment variables), or
``--distributed`` to let JAX detect a TPU pod, SLURM or Open MPI job, start ``jax.distributed`` before
anything touches a device.

A mistake in the command (an unknown option or field, a value out of range, a missing file) ends the run
with one line, ``error: <what was wrong and what is allowed>``, and exit status 2 (``-v 1`` also logs the
traceback); Ctrl-C ends it with one line that names the last checkpoint, status 130.
"""

from __future__ import annotations

import functools
import os
import sys

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from posjax import config_args, tasks
from posjax.aot import compile as aot
from posjax.cli import check_directory, error_message, run_user_errors
from posjax.experiments import length, probes, resolution, sweep
from posjax.train import checkpoint, evaluate, loop, peers

# The one place the loop meets its tasks: ``train(config, workdir)`` trains the task ``config.task`` names, and
# ``evaluate_checkpoint(config, source, workdir)`` evaluates a finished run's checkpoint with config's evaluators.
train = functools.partial(loop.run, build_task=tasks.build)
evaluate_checkpoint = functools.partial(evaluate.checkpoint_results, build_task=tasks.build)

# ``config.job``: one training run of any task (``config.task``: mlm, glue, squad, probe), the probe table, or
# a paper table's rows (``experiments/tupe/table1.py:row=TUPE-R``: its runs in the workdir, one after the other).
JOBS = {"train": train, "probes": functools.partial(probes.run, train=train),
        "resolution": functools.partial(resolution.run, train=train),
        "length": functools.partial(length.run, train=train, evaluate=evaluate_checkpoint),
        "table": functools.partial(sweep.run_table, train=train)}

_FLAGS = {}


def _define_flags() -> None:
  """The command's flags, defined when it runs (so that importing ``train`` from here defines none)."""
  _FLAGS.update(
      config=config_flags.DEFINE_config_file("config", None, "Config file, with ':options'.", lock_config=True),
      workdir=flags.DEFINE_string("workdir", None, "Checkpoints, metrics and the resolved config go here."),
      coordinator=flags.DEFINE_string("coordinator_address", os.environ.get("JAX_COORDINATOR_ADDRESS"),
                                      "host:port of process 0 (multi-host)."),
      num_processes=flags.DEFINE_integer("num_processes", int(os.environ.get("JAX_NUM_PROCESSES", "1")),
                                         "Processes in the run (multi-host)."),
      process_id=flags.DEFINE_integer("process_id", int(os.environ.get("JAX_PROCESS_ID", "0")),
                                      "This process's index (multi-host)."),
      target=flags.DEFINE_string("target", None, "Compile the run's train step ahead of time for these devices "
                                 "(comma-separated: h100, h200, h100:8, v5e:4x4, v6e:2x2, ...) on this machine, "
                                 "print memory and kernel resources, and train nothing (no --workdir needed)."),
      aot_data=flags.DEFINE_enum("aot_data", "synthetic", list(aot.DATA), "With --target: the batches' source, "
                                 "the built-in synthetic corpus (mlm) or the config's own data."),
      distributed=flags.DEFINE_bool("distributed", False, "Start jax.distributed and let JAX detect the cluster "
                                    "(Cloud TPU pods, SLURM, Open MPI) instead of the three flags above."))


def main(argv):
  """Starts ``jax.distributed`` where asked, then runs ``config.job`` in ``--workdir``."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  value = {name: holder.value for name, holder in _FLAGS.items()}
  config = value["config"]
  if value["target"] is not None:
    if config is None:
      raise app.UsageError("--target needs --config (the run to compile)")
    if config.get("job", "train") != "train":
      raise app.UsageError(f"--target compiles one training run; config.job is {config.job!r}")
    aot.setup()
    aot.run(config, value["target"], tasks.build, value["aot_data"])
    return
  if config is None or not value["workdir"]:
    raise app.UsageError("--config and --workdir are required")
  check_directory(value["workdir"], "--workdir", "a new one, or a run's to resume")
  checkpoint.silence_abandoned_io()  # for the process: orbax's abandoned writes may report as it exits
  peer_timeout = int(config.get("peer_timeout_seconds", 60))
  if value["num_processes"] > 1 or value["distributed"]:
    if config.get("cpu_collectives"):
      jax.config.update("jax_cpu_collectives_implementation", config.cpu_collectives)
    timeouts = dict(heartbeat_timeout_seconds=peers.jax_heartbeat_timeout(peer_timeout),
                    shutdown_timeout_seconds=int(config.get("shutdown_timeout_seconds", 300)))
    if value["distributed"]:
      jax.distributed.initialize(**timeouts)
    else:
      jax.distributed.initialize(value["coordinator"], value["num_processes"], value["process_id"], **timeouts)
  logging.info("process %d of %d, %d devices", jax.process_index(), jax.process_count(), jax.device_count())
  job = config.get("job", "train")
  if job not in JOBS:
    raise app.UsageError(f"unknown config.job {job!r}; allowed: {sorted(JOBS)}")
  with peers.watching(peer_timeout):  # one process's error, or its loss, stops all of them with one line
    JOBS[job](config, value["workdir"])


def parse_flags(argv):
  """absl's flag parsing, with a config that cannot be loaded or applied reported as one line (status 2)."""
  try:
    for arg in argv[1:]:
      if arg.startswith("--config="):
        config_args.config_path(arg.removeprefix("--config=").partition(":")[0])
    return flags.FLAGS(argv)
  except Exception as error:  # noqa: BLE001  (a config file or an override that cannot be applied)
    logging.info("flag parsing failed", exc_info=True)
    print(f"error: {error_message(error)}", file=sys.stderr)
    sys.exit(2)


def run_main(argv):
  """:func:`main`, with its mistakes as one line."""
  run_user_errors(main, argv)


def entry():
  """``python -m posjax.main``."""
  _define_flags()
  app.run(run_main, flags_parser=parse_flags)


if __name__ == "__main__":
  entry()
