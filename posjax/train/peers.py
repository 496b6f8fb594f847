"""The processes of a multi-process run stop together, fast, with one line.

JAX alone leaves two faults to its coordination service: a process that raises while the others wait in a
collective (they wait until the shutdown barrier times out, 300 s by default, then abort with native stack
dumps), and a peer that dies or hangs (every other process aborts with ``F... client.h`` and pages of native
and Python stacks after the heartbeat timeout). :class:`Watch`, around a multi-process job, replaces both:

- A process whose job raises posts its one-line error to the coordination service's key-value store: status 2
  for a mistake in the command or the data (:data:`posjax.cli.USER_ERRORS`), else 1 with its traceback. Every
  other process reads it within a second, wherever its main thread is waiting. Each prints the same line,
  ``error: process 1 stopped: <its words>``, says so in the store, and exits with that status once every live
  process has (at most ``grace_seconds``): together, since one that left early would make the runtime abort
  the others.
- Every process beats once a second; process 0 watches the beats and, when a process has not beaten for
  ``peer_timeout`` seconds (killed, hung, unreachable), posts ``process 1 sent no heartbeat for 5 s ...`` the
  same way. A process that gets no answer from process 0 (which hosts the service) for ``peer_timeout`` seconds
  stops with a line that says so. JAX's own heartbeat timeout (:func:`jax_heartbeat_timeout`) stays longer, as a
  backstop.

The store is reached through ``jax._src.distributed.global_state.client``, as orbax's multihost utilities do:
JAX has no public key-value API. :func:`key_value_client` is the one place that names it.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
import traceback
from typing import NamedTuple

import jax
import tqdm
from absl import logging

from posjax.cli import USER_ERRORS, error_message

PREFIX = "posjax/peers"
LOST = "killed, hung or unreachable; config.peer_timeout_seconds"
RERUN = "every process stops: rerun the job to resume from its last checkpoint"
BACKSTOP_SECONDS = 30


class Stopped(ValueError):
  """This process stops because another one failed; the message names it and quotes its words."""


def describe(error: BaseException) -> str:
  """An error in one line: a mistake's own words (as the command line prints them), anything else with its
  type."""
  return error_message(error) if isinstance(error, USER_ERRORS) else f"{type(error).__name__}: {error_message(error)}"


def jax_heartbeat_timeout(peer_timeout: int) -> int:
  """JAX's heartbeat timeout for a run whose :class:`Watch` stops lost peers after ``peer_timeout``: longer, so
  that the one-line stop comes first and JAX's abort only where the watch itself cannot run."""
  return int(peer_timeout) + BACKSTOP_SECONDS


def key_value_client():
  """JAX's distributed key-value client: private (``jax._src.distributed.global_state.client``); a JAX that moved
  the name fails here with one line that says so."""
  try:
    from jax._src import distributed  # private: the only import of it
    client = distributed.global_state.client
  except (ImportError, AttributeError) as error:
    raise RuntimeError(f"jax {jax.__version__} has no jax._src.distributed.global_state.client ({error}): the "
                       "multi-process peer watch (posjax.train.peers) needs JAX's key-value client; use the jax "
                       "version pyproject.toml pins") from None
  if client is None:
    raise RuntimeError("peers.Watch needs jax.distributed.initialize first")
  return client


def _not_found(error: Exception) -> bool:
  return "NOT_FOUND" in str(error) or "not found" in str(error).lower()


def _say_last(line: str) -> None:
  """Prints ``error: line`` as this process's last words: its stderr then goes to /dev/null, because a peer's
  exit can make the runtime abort this process (a CPU collective, the coordination client) with pages of dumps
  that would bury the line."""
  sys.stdout.flush()
  print(("\n" if getattr(tqdm.tqdm, "_instances", None) else "") + f"error: {line}", file=sys.stderr, flush=True)
  devnull = os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, 2)


def _leave(status: int) -> None:
  os._exit(status)  # noqa: SLF001  (the main thread may be inside a collective that will never finish)


def watching(peer_timeout: float):
  """A :class:`Watch` in a multi-process run, else nothing to do."""
  return Watch(peer_timeout) if jax.process_count() > 1 else contextlib.nullcontext()


class Watch:
  """Around a multi-process job: any process's error, and a lost peer, stop every process (module docstring).

  ``poll_seconds`` is how often each process beats and reads the store; ``grace_seconds`` how long a failing
  process waits for the others to read its line."""

  def __init__(self, peer_timeout: float, poll_seconds: float = 1.0, grace_seconds: float = 10.0, *, client=None,
               index: int | None = None, count: int | None = None):
    self.peer_timeout, self.poll, self.grace = float(peer_timeout), float(poll_seconds), float(grace_seconds)
    self.client = client
    self.index = jax.process_index() if index is None else index
    self.count = jax.process_count() if count is None else count
    self._stop = threading.Event()
    self._exiting = threading.Lock()
    self._answered = time.monotonic()

  def __enter__(self):
    self.client = self.client or key_value_client()
    self._threads = [threading.Thread(target=self._beat, name=f"posjax-peers-{self.index}", daemon=True),
                     threading.Thread(target=self._judge, name=f"posjax-peers-judge-{self.index}", daemon=True)]
    for thread in self._threads:
      thread.start()
    return self

  def __exit__(self, kind, error, tb):
    self._stop.set()
    if error is None or isinstance(error, SystemExit):
      return False
    user = isinstance(error, USER_ERRORS)
    if not user and not isinstance(error, KeyboardInterrupt):
      traceback.print_exception(kind, error, tb, file=sys.stderr)
    logging.info("process %d stopped", self.index, exc_info=(kind, error, tb))
    status = 2 if user else 130 if isinstance(error, KeyboardInterrupt) else 1
    line = str(error) if isinstance(error, Stopped) else f"process {self.index} stopped: {describe(error)}"
    self._finish(*self._post(Stop(status, line)))
    return False  # only reached where _leave is replaced (tests)

  def _post(self, stop: "Stop") -> tuple["Stop", bool]:
    """Posts why every process stops; the first post wins (returned, with whether the store answered)."""
    try:
      self.client.key_value_set(f"{PREFIX}/stop", json.dumps(stop._asdict()))
      return stop, True
    except Exception:  # noqa: BLE001  (another process posted first, or the store is gone)
      try:
        return self._posted() or stop, True
      except Exception:  # noqa: BLE001
        return stop, False

  def _posted(self) -> "Stop | None":
    try:
      value = self.client.key_value_try_get(f"{PREFIX}/stop")
    except Exception as error:  # noqa: BLE001
      if _not_found(error):
        return None
      raise
    fields = json.loads(value)
    return Stop(fields["status"], fields["line"], tuple(fields["lost"]))

  def _finish(self, stop: "Stop", tell: bool = True) -> None:
    """Prints the line and exits. With ``tell``, first says so in the store and waits (at most
    ``grace_seconds``) until every live process has: they leave together, because one that leaves early makes
    the runtime abort the others (a CPU collective sees its socket close; the clients lose process 0's store)."""
    if not self._exiting.acquire(blocking=False):  # this process's other thread is on its way out
      time.sleep(self.grace + 60)
      return
    self._stop.set()
    _say_last(stop.line)
    readers = {f"{PREFIX}/read/{peer}" for peer in range(self.count) if peer not in stop.lost}
    deadline = time.monotonic() + self.grace
    try:
      if tell:
        self.client.key_value_set(f"{PREFIX}/read/{self.index}", "1")
      while tell and time.monotonic() < deadline:
        if readers <= {key for key, _ in self.client.key_value_dir_get(f"{PREFIX}/read/")}:
          break
        time.sleep(0.01)
    except Exception:  # noqa: BLE001  (the store is gone: nobody left to wait for)
      pass
    _leave(stop.status)

  def _beat(self) -> None:
    """Beats, reads the stop and (process 0) watches the others' beats, once per ``poll_seconds``."""
    watched = range(1, self.count) if self.index == 0 else ()
    changed = {peer: (None, time.monotonic()) for peer in watched}  # the last beat seen of each, and when
    while not self._stop.wait(self.poll):
      try:
        self.client.key_value_increment(f"{PREFIX}/beat/{self.index}", 1)
        posted = self._posted()
        beats = dict(self.client.key_value_dir_get(f"{PREFIX}/beat/")) if self.index == 0 else {}
        self._answered = time.monotonic()
      except Exception as error:  # noqa: BLE001
        if self.index != 0 and not self._stop.is_set():
          self._finish(Stop(1, f"lost process 0, which coordinates the run ({' '.join(str(error).split())[:200]}); "
                               f"{RERUN}"), tell=False)
        continue
      if posted is not None and not self._stop.is_set():
        self._finish(posted)
      now = time.monotonic()
      for peer, (beat, when) in changed.items():
        if beats.get(f"{PREFIX}/beat/{peer}") != beat:
          changed[peer] = (beats.get(f"{PREFIX}/beat/{peer}"), now)
        elif now - when > self.peer_timeout and not self._stop.is_set():
          self._finish(*self._post(Stop(1, f"process {peer} sent no heartbeat for {self.peer_timeout:g} s "
                                           f"({LOST}); {RERUN}", (peer,))))

  def _judge(self) -> None:
    """Process 1 and up: stops when process 0 has not answered for ``peer_timeout`` (a hung coordinator)."""
    while self.index != 0 and not self._stop.wait(self.poll):
      if time.monotonic() - self._answered > self.peer_timeout:
        self._finish(Stop(1, f"process 0, which coordinates the run, has not answered for {self.peer_timeout:g} s "
                             f"({LOST}); {RERUN}"), tell=False)


class Stop(NamedTuple):
  """Why every process stops: the status each exits with, the line each prints, the processes lost."""
  status: int
  line: str
  lost: tuple[int, ...] = ()
