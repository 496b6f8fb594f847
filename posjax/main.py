"""posjax's entry point: ``python -m posjax.main --config=configs/pretrain.py:position=tupe_r --workdir=DIR``.

``--config.a.b=value`` overrides any field. Restarting the same command with the same workdir resumes.
Multi-host: ``--coordinator_address``, ``--num_processes``, ``--process_id`` (defaults from the
``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID`` environment variables), or
``--distributed`` to let JAX detect a TPU pod, SLURM or Open MPI job, start ``jax.distributed`` before
anything touches a device.
"""

from __future__ import annotations

import os

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from posjax import probes
from posjax.train import loop

JOBS = {"pretrain": loop.run, "probes": probes.run}

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, with ':options'.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints, metrics and the resolved config go here.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", os.environ.get("JAX_COORDINATOR_ADDRESS"),
                                   "host:port of process 0 (multi-host).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", int(os.environ.get("JAX_NUM_PROCESSES", "1")),
                                      "Processes in the run (multi-host).")
_PROCESS_ID = flags.DEFINE_integer("process_id", int(os.environ.get("JAX_PROCESS_ID", "0")),
                                   "This process's index (multi-host).")
_DISTRIBUTED = flags.DEFINE_bool("distributed", False, "Start jax.distributed and let JAX detect the cluster "
                                 "(Cloud TPU pods, SLURM, Open MPI) instead of the three flags above.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if _CONFIG.value is None or not _WORKDIR.value:
    raise app.UsageError("--config and --workdir are required")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO; -v 0 shows it
  if _NUM_PROCESSES.value > 1 or _DISTRIBUTED.value:
    if _CONFIG.value.get("cpu_collectives"):
      jax.config.update("jax_cpu_collectives_implementation", _CONFIG.value.cpu_collectives)
    if _DISTRIBUTED.value:
      jax.distributed.initialize()
    else:
      jax.distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  logging.info("process %d of %d, %d devices", jax.process_index(), jax.process_count(), jax.device_count())
  job = _CONFIG.value.get("job", "pretrain")
  if job not in JOBS:
    raise app.UsageError(f"unknown config.job {job!r}; allowed: {sorted(JOBS)}")
  JOBS[job](_CONFIG.value, _WORKDIR.value)


def entry():
  app.run(main)


if __name__ == "__main__":
  entry()
