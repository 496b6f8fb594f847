"""One run per workdir: a lease file, ``WORKDIR/run.lock``, that process 0 holds for every process of a run.

The file names its holder (host, pid, the pid's start time, when the run started) and the time of its last
renewal; a thread renews it every ``LEASE_SECONDS / 4``. A second run on the workdir is refused at once with an
error naming the holder. A lock left by a killed run does not block the next: on the same host when its pid is
gone (or is another process, started at another time), on another host when it has not been renewed for
``LEASE_SECONDS``. Creating the file is atomic (``O_EXCL``), so of two runs starting together one wins. Taking
over, renewing and releasing each read and write the file under an exclusive ``flock`` of the workdir itself
(:func:`guard`), so a renewal never overwrites a lock another run has just taken over (where the filesystem has no
``flock``, as before: the renewal checks the holder first).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import threading
import time

NAME = "run.lock"
LEASE_SECONDS = 120.0


@contextlib.contextmanager
def guard(workdir: str):
  """An exclusive ``flock`` of the workdir (a directory: no file of its own) while the lock file is read and
  written; nothing where the filesystem refuses one."""
  fd = os.open(workdir, os.O_RDONLY)
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
      pass
    yield
  finally:
    os.close(fd)  # closing the descriptor releases the flock


def _stat(pid: int) -> list[str] | None:
  """Fields of Linux's ``/proc/PID/stat`` after the command name (state first), None where unknown."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rpartition(")")[2].split()
  except OSError:
    return None


def _pid_start(pid: int) -> str | None:
  """The start time of process ``pid`` (in clock ticks since boot), None where unknown."""
  fields = _stat(pid)
  return fields[19] if fields and len(fields) > 19 else None


def _alive(pid: int, start: str | None) -> bool:
  """Whether ``pid`` is still the process that started at ``start`` (a zombie, killed but not yet reaped, is not)."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  fields = _stat(pid)
  if fields is None:
    return True
  return fields[0] not in ("Z", "X") and (start is None or len(fields) <= 19 or fields[19] == start)


def holder_is_gone(holder: dict, now: float | None = None) -> bool:
  """Whether the run named in a lock file has stopped: its pid gone on this host, or, on another, no renewal for
  ``LEASE_SECONDS``."""
  if holder.get("host") == socket.gethostname():
    return not _alive(int(holder.get("pid", -1)), holder.get("pid_start"))
  return (time.time() if now is None else now) - float(holder.get("renewed", 0.0)) > LEASE_SECONDS


def describe(holder: dict) -> str:
  """The holder of a lock file in words: host, pid and start time."""
  started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder.get("started", 0.0))))
  return f"host {holder.get('host')}, pid {holder.get('pid')}, started {started}"


def check(workdir: str) -> None:
  """Raises ``OSError`` naming the run that holds ``workdir`` (a live lock), before anything is written; the
  run takes the lock itself later (:class:`WorkdirLock`)."""
  path = os.path.join(workdir, NAME)
  try:
    with open(path) as f:
      holder = json.load(f)
  except (OSError, ValueError):
    return
  if not holder_is_gone(holder):
    raise OSError(in_use(path, holder))


def in_use(path: str, holder: dict) -> str:
  """The refusal of a second run on a workdir held by ``holder``."""
  return (f"{os.path.dirname(path)} is in use by another run ({describe(holder)}; lock file {path}); one run per "
          "workdir: wait for it, stop it, or use another --workdir")


class WorkdirLock:
  """The workdir's lease while the run holds it (``acquire`` ... ``release``); ``enabled=False`` on processes
  other than 0, which hold nothing."""

  def __init__(self, workdir: str, enabled: bool = True):
    self.path = os.path.join(workdir, NAME)
    self.enabled = enabled
    self._stop = threading.Event()
    self._thread = None
    self._record = None

  def acquire(self) -> None:
    """Takes the lease or raises ``OSError`` naming the run that holds it."""
    if not self.enabled:
      return
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    now = time.time()
    self._record = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": _pid_start(os.getpid()),
                    "started": now, "renewed": now}
    for _ in range(2):
      with guard(os.path.dirname(self.path)):
        try:
          fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
          holder = self._read()
          if holder is not None and not holder_is_gone(holder):
            raise OSError(in_use(self.path, holder)) from None
          try:
            os.remove(self.path)  # a stopped run's lock: take over
          except FileNotFoundError:
            pass
          continue
        with os.fdopen(fd, "w") as f:
          json.dump(self._record, f)
      self._thread = threading.Thread(target=self._renew, name="workdir-lock", daemon=True)
      self._thread.start()
      return
    raise OSError(f"{os.path.dirname(self.path)}: another run took the workdir's lock ({self.path}) at the same "
                  "time; one run per workdir")

  def _read(self) -> dict | None:
    try:
      with open(self.path) as f:
        return json.load(f)
    except (OSError, ValueError):
      return None  # half written by a run killed while creating it, or removed meanwhile

  def _ours(self, holder: dict | None) -> bool:
    return holder is not None and all(holder.get(k) == self._record[k] for k in ("host", "pid", "started"))

  def _renew(self) -> None:
    """Renews the lease until released; stops for good once another run holds the file (our lease had lapsed and
    it took over), so that run's lock is never overwritten."""
    while not self._stop.wait(LEASE_SECONDS / 4):
      try:
        with guard(os.path.dirname(self.path)):
          holder = self._read()
          if holder is not None and not self._ours(holder):
            return
          self._record["renewed"] = time.time()
          temporary = f"{self.path}.{os.getpid()}.tmp"
          with open(temporary, "w") as f:
            json.dump(self._record, f)
          os.replace(temporary, self.path)
      except OSError:
        pass  # a full or flaky disk, a workdir removed: the next renewal tries again

  def release(self) -> None:
    """Gives the lease up (removing the file only if it is still this run's)."""
    if not self.enabled or self._record is None:
      return
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
    try:
      with guard(os.path.dirname(self.path)):
        if self._ours(self._read()):
          os.remove(self.path)
    except FileNotFoundError:
      pass
    self._record = None

  def __enter__(self):
    self.acquire()
    return self

  def __exit__(self, *exc):
    self.release()
