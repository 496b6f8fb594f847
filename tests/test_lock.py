"""One run per workdir (posjax.train.lock): a second run is refused naming the first, a killed run's lock does not
block the next, a lock on another host counts until its lease runs out."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from posjax.main import train
from posjax.train import lock
from conftest import ROOT
from test_train import pretrain_config


def dead_pid():
  child = subprocess.Popen([sys.executable, "-c", "pass"])
  child.wait()
  return child.pid


def write_lock(workdir, **holder):
  os.makedirs(workdir, exist_ok=True)
  record = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": None, "started": time.time(),
            "renewed": time.time(), **holder}
  with lock.guard(workdir), open(os.path.join(workdir, lock.NAME), "w") as f:  # as another run's takeover does
    json.dump(record, f)


def test_a_held_workdir_is_refused_naming_its_holder(tmp_path):
  with lock.WorkdirLock(str(tmp_path)):
    with pytest.raises(OSError, match=rf"{tmp_path} is in use by another run \(host {socket.gethostname()}, pid "
                                      rf"{os.getpid()}, started .*; lock file .*run.lock\); one run per workdir"):
      lock.WorkdirLock(str(tmp_path)).acquire()
  assert not (tmp_path / lock.NAME).exists()  # released
  with lock.WorkdirLock(str(tmp_path)):  # and free again
    pass


@pytest.mark.parametrize("holder,taken", [
    (lambda: dict(pid=dead_pid()), True),  # a killed run on this host
    (lambda: dict(pid=os.getpid(), pid_start="1"), True),  # its pid reused by another process
    (lambda: dict(host="elsewhere", renewed=time.time()), False),  # a live lease on another host
    (lambda: dict(host="elsewhere", renewed=time.time() - lock.LEASE_SECONDS - 1), True),  # a lapsed one
])
def test_a_stopped_runs_lock_does_not_block(tmp_path, holder, taken):
  write_lock(str(tmp_path), **holder())
  held = lock.WorkdirLock(str(tmp_path))
  if not taken:
    with pytest.raises(OSError, match="host elsewhere"):
      held.acquire()
    return
  held.acquire()
  assert json.loads((tmp_path / lock.NAME).read_text())["pid"] == os.getpid()
  held.release()


def test_the_lease_is_renewed_and_release_leaves_another_runs_lock(tmp_path, monkeypatch):
  monkeypatch.setattr(lock, "LEASE_SECONDS", 0.2)
  held = lock.WorkdirLock(str(tmp_path))
  held.acquire()
  first = json.loads((tmp_path / lock.NAME).read_text())["renewed"]
  time.sleep(0.3)
  assert json.loads((tmp_path / lock.NAME).read_text())["renewed"] > first
  write_lock(str(tmp_path), host="elsewhere")  # taken over meanwhile (our lease had lapsed)
  time.sleep(0.15)  # three renewal periods: the renewal leaves the other run's lock alone
  assert json.loads((tmp_path / lock.NAME).read_text())["host"] == "elsewhere"
  held.release()
  assert json.loads((tmp_path / lock.NAME).read_text())["host"] == "elsewhere"


def test_a_second_run_on_a_workdir_in_use_stops_at_once(tmp_path):
  workdir = str(tmp_path / "run")
  first = subprocess.Popen([sys.executable, "-m", "posjax.main", "--config=configs/pretrain.py:position=absolute,runlocal",
                            f"--workdir={workdir}", "--config.total_steps=400", "--config.eval_every_steps=0"],
                           cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.time() + 300
    while not os.path.exists(os.path.join(workdir, lock.NAME)) and time.time() < deadline and first.poll() is None:
      time.sleep(0.2)
    assert first.poll() is None, first.stderr.read()
    # Another config than the first run's (6 steps, not 400): the lock is named, before the config change.
    with pytest.raises(OSError, match=rf"{workdir} is in use by another run \(host .*, pid {first.pid}, started"):
      train(pretrain_config("runlocal,position=absolute", eval_every_steps=0), workdir)
  finally:
    first.terminate()  # SIGTERM: it saves, releases the lock and exits 0
    assert first.wait(timeout=300) == 0
  assert not os.path.exists(os.path.join(workdir, lock.NAME))
