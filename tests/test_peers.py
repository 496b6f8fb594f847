"""The watch that stops every process of a run together, on a store shared by threads standing in for the
processes (the two-process runs are in test_multihost)."""

import threading
import time

import pytest

from conftest import ROOT
from posjax.train import peers


class Store:
  """The coordination service's key-value store, as the JAX client presents it."""

  def __init__(self):
    self.values, self.lock, self.down = {}, threading.Lock(), False

  def _check(self):
    if self.down:
      raise RuntimeError("UNAVAILABLE: Failed to send RPC to coordination service")

  def key_value_set(self, key, value, allow_overwrite=False):
    self._check()
    with self.lock:
      if key in self.values and not allow_overwrite:
        raise RuntimeError(f"ALREADY_EXISTS: {key}")
      self.values[key] = value

  def key_value_try_get(self, key):
    self._check()
    with self.lock:
      if key not in self.values:
        raise RuntimeError(f"NOT_FOUND: Config key {key} not found.")
      return self.values[key]

  def key_value_increment(self, key, increment):
    self._check()
    with self.lock:
      self.values[key] = str(int(self.values.get(key, "0")) + increment)
      return int(self.values[key])

  def key_value_dir_get(self, prefix):
    self._check()
    with self.lock:
      return [(k, v) for k, v in self.values.items() if k.startswith(prefix)]


@pytest.fixture
def exits(monkeypatch):
  """What each watch said and its exit status, by thread, instead of leaving the test process."""
  said, left = {}, {}
  monkeypatch.setattr(peers, "_say_last", lambda line: said.setdefault(threading.current_thread().name, line))
  monkeypatch.setattr(peers, "_leave", lambda status: left.setdefault(threading.current_thread().name, status))
  return said, left


def wait_for(condition, seconds=5.0):
  deadline = time.monotonic() + seconds
  while not condition():
    assert time.monotonic() < deadline, "timed out"
    time.sleep(0.01)


def test_process_0_stops_every_process_when_one_stops_beating(exits):
  said, left = exits
  store = Store()
  watches = [peers.Watch(0.3, poll_seconds=0.02, grace_seconds=2, client=store, index=i, count=3) for i in range(3)]
  with watches[0], watches[1]:  # process 2 never beats
    wait_for(lambda: len(left) == 2)
  assert set(said.values()) == {"process 2 sent no heartbeat for 0.3 s (killed, hung or unreachable; "
                                "config.peer_timeout_seconds); every process stops: rerun the job to resume from "
                                "its last checkpoint"}
  assert set(left.values()) == {1}
  assert "posjax/peers/read/1" in store.values  # process 0 waited for process 1, not for the lost one


def test_a_beating_process_is_not_lost_however_long_it_runs(exits):
  said, left = exits
  store = Store()
  watches = [peers.Watch(0.2, poll_seconds=0.02, client=store, index=i, count=2) for i in range(2)]
  with watches[0], watches[1]:
    time.sleep(1.0)
  assert not said and not left
  assert int(store.values["posjax/peers/beat/1"]) > 10


@pytest.mark.parametrize("error, status, words", [
    (ValueError("text file x.txt is not UTF-8 text"), 2, "text file x.txt is not UTF-8 text"),
    (RuntimeError("a bug"), 1, "RuntimeError: a bug"),
])
def test_an_error_in_one_process_stops_every_process_with_its_words_and_status(exits, error, status, words):
  said, left = exits
  store = Store()
  failing = peers.Watch(60, poll_seconds=0.02, grace_seconds=2, client=store, index=1, count=2)
  other = peers.Watch(60, poll_seconds=0.02, grace_seconds=2, client=store, index=0, count=2)
  with other:
    with pytest.raises(type(error)), failing:  # raised on only where _leave does not leave
      raise error
    wait_for(lambda: len(left) == 2)
  assert set(said.values()) == {f"process 1 stopped: {words}"} and set(left.values()) == {status}
  assert {"posjax/peers/read/0", "posjax/peers/read/1"} <= set(store.values)


def test_the_first_post_wins_and_an_agreed_error_keeps_its_words(exits):
  said, left = exits
  store = Store()
  store.key_value_set("posjax/peers/stop", '{"status": 2, "line": "process 1 stopped: the config is wrong", '
                                           '"lost": []}')
  with pytest.raises(RuntimeError), peers.Watch(60, grace_seconds=0, client=store, index=0, count=2):
    raise RuntimeError("what process 0 met after process 1 stopped")
  assert list(said.values()) == ["process 1 stopped: the config is wrong"] and list(left.values()) == [2]
  fresh = Store()
  with pytest.raises(peers.Stopped), peers.Watch(60, grace_seconds=0, client=fresh, index=0, count=2):
    raise peers.Stopped("process 1 stopped: the config is wrong")  # validate.agree's words for process 1's error
  assert '"line": "process 1 stopped: the config is wrong"' in fresh.values["posjax/peers/stop"]  # not "process 0"


def test_a_process_that_loses_process_0_stops_with_a_line(exits):
  said, left = exits
  store = Store()
  with peers.Watch(60, poll_seconds=0.02, client=store, index=1, count=2):
    store.down = True
    wait_for(lambda: left)
  (line,) = said.values()
  assert line.startswith("lost process 0, which coordinates the run (UNAVAILABLE") and list(left.values()) == [1]


def test_a_hung_process_0_is_noticed_by_the_others(exits):
  said, left = exits
  store = Store()
  hang = threading.Event()
  answer = store.key_value_increment
  store.key_value_increment = lambda key, n: (hang.wait(), answer(key, n))[1]  # process 0 stops answering
  with peers.Watch(0.2, poll_seconds=0.02, client=store, index=1, count=2):
    wait_for(lambda: left)
    hang.set()
  assert list(said.values())[0].startswith("process 0, which coordinates the run, has not answered for 0.2 s")


def test_jaxs_private_key_value_client_is_reached_in_one_place_and_a_moved_name_says_so(monkeypatch):
  """The installed JAX has the private name (only ``initialize`` is missing here); a JAX without it is one line."""
  with pytest.raises(RuntimeError, match=r"^peers.Watch needs jax.distributed.initialize first$"):
    peers.key_value_client()
  from jax._src import distributed
  monkeypatch.delattr(distributed, "global_state")
  with pytest.raises(RuntimeError, match=r"has no jax._src.distributed.global_state.client .* use the jax version "
                                         r"pyproject.toml pins$"):
    peers.key_value_client()
  sources = [p.read_text() for p in (ROOT / "posjax").rglob("*.py")]
  assert sum(text.count("jax._src import distributed") for text in sources) == 1
