"""SIGTERM and Ctrl-C during a run: stop at a step every process reaches, save, and say how to resume."""

from __future__ import annotations

import os
import signal
import sys
import threading

import jax
from jax.experimental import multihost_utils

from posjax.train.metrics import say as _say


class Interruptions:
  """SIGTERM (the preemption notice of TPU VMs and Slurm) and Ctrl-C, from the start of a run to its end.

  One process: SIGTERM sets a flag, and the run saves a checkpoint after the current step and stops. The
  first Ctrl-C stops the run after the current step (:class:`Interrupted`); a second one stops it at once.
  Under ``jax.distributed`` the runtime owns SIGTERM and tells every process at the same step that it is time
  to stop (``reached_preemption_sync_point``, which every process calls after every step), so all of them
  save that step; Ctrl-C is handed to the runtime as a SIGTERM, because a process that stopped alone would
  leave the others waiting in their next collective for ever.
  """

  def __enter__(self):
    self.terminated = self.interrupted = False
    self.distributed = jax.process_count() > 1 or getattr(jax.distributed, "is_initialized", lambda: False)()
    self.previous = {}
    if threading.current_thread() is threading.main_thread():
      if not self.distributed:
        self.previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._terminate)
      self.previous[signal.SIGINT] = signal.signal(signal.SIGINT,
                                                   self._to_runtime if self.distributed else self._interrupt)
    return self

  def __exit__(self, *exc):
    for signum, handler in self.previous.items():
      signal.signal(signum, handler)

  def _terminate(self, signum, frame):
    del signum, frame
    self.terminated = True

  def _interrupt(self, signum, frame):
    del signum, frame
    self.interrupted = True
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _say("Ctrl-C: stopping after this step (press it again to stop at once)")

  def _to_runtime(self, signum, frame):
    del signum, frame
    print("Ctrl-C: every process stops, and saves, at the next step they all reach", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)

  def preempted(self, step: int) -> bool:
    if self.distributed:
      return multihost_utils.reached_preemption_sync_point(step)
    return self.terminated


class Interrupted(KeyboardInterrupt):
  """Ctrl-C, with what a rerun of the same command will do."""
