"""Two processes over localhost (CPU collectives) train, evaluate, checkpoint and stop on SIGTERM exactly like
one process with the same global batch."""

import functools
import json
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import pytest

from posjax.data import corpus, mlm, prepare
from posjax.data.tokenizer import Tokenizer
from posjax.main import train
from posjax.train import checkpoint, metrics
from conftest import ROOT, devices_env, load_config
from test_prepare import config
from test_train import assert_same_params, command_config, saved_steps, stream

STEPS, EVAL_EVERY = 20, 10


def command(workdir, *extra):
  return [sys.executable, "-m", "posjax.main", "--config=configs/pretrain.py:runlocal,position=tupe_r",
          f"--workdir={workdir}", f"--config.total_steps={STEPS}", "--config.batch_size=8", "--config.max_len=32",
          f"--config.eval_every_steps={EVAL_EVERY}", "--config.evals.eval.batches=50", "--config.checkpoint_every_steps=5",
          "--config.data.num_shards=2", "--config.log_every_steps=1",
          "--config.model.dropout_rate=0", "--config.model.attention_dropout_rate=0", *extra]


def two_processes(workdir, sigterm_once_saved=None, command=command):
  """Both processes' (return code, output); with ``sigterm_once_saved``, process 1 alone gets SIGTERM once that
  checkpoint exists."""
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  workers = [subprocess.Popen(command(workdir, f"--coordinator_address=localhost:{port}", "--num_processes=2",
                                      f"--process_id={i}", "--config.cpu_collectives=gloo"),
                              cwd=ROOT, env=devices_env(4), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for i in range(2)]
  try:
    if sigterm_once_saved is not None:
      deadline = time.time() + 120
      while not (workdir / "checkpoints" / str(sigterm_once_saved)).exists():
        assert all(w.poll() is None for w in workers) and time.time() < deadline, "no checkpoint: a hang?"
        time.sleep(0.02)
      workers[1].send_signal(signal.SIGTERM)
    outputs = [w.communicate(timeout=240)[0] for w in workers]
  finally:
    for w in workers:
      w.kill()
  return [(w.returncode, out) for w, out in zip(workers, outputs)]


def one_process(command, workdir):
  """The run of ``command`` in one process with 8 devices: this one's (the reference that two processes match)."""
  assert jax.device_count() == 8
  train(command_config(command(workdir)), str(workdir))


def eval_batches_per_shard():
  config = load_config("pretrain", "runlocal")
  tokenizer = Tokenizer.load(config.data.vocab_file)
  return [sum(1 for _ in mlm.MlmBatches(functools.partial(corpus.documents, config.data, "eval", shard, 2), tokenizer,
                                        max_len=32, batch_size=4, seed=1, repeat=False, shard=shard))
          for shard in range(2)]


@pytest.mark.slow
def test_two_processes_evaluate_stop_on_sigterm_and_resume_like_one(tmp_path):
  # The processes' eval shards hold different numbers of batches: every process must still run as many.
  counts = eval_batches_per_shard()
  assert counts[0] != counts[1] and max(counts) < 50

  first = two_processes(tmp_path / "two", sigterm_once_saved=5)
  assert all(code == 0 for code, _ in first), first[0][1][-3000:] + first[1][1][-3000:]
  saved = sorted(int(p.name) for p in (tmp_path / "two" / "checkpoints").iterdir() if p.name.isdigit())
  # Process 1 got the signal; both stopped and saved at one step (a save is collective: had process 0 gone on,
  # neither would have exited).
  assert f"preempted (SIGTERM) at step {saved[-1]}: checkpoint saved" in first[0][1] and saved[-1] < STEPS

  second = two_processes(tmp_path / "two")
  assert all(code == 0 for code, _ in second), second[0][1][-3000:] + second[1][1][-3000:]
  assert f"resumed from step {saved[-1]}" in second[0][1]

  one_process(command, tmp_path / "one")
  assert_same_params(checkpoint.load_params(str(tmp_path / "one" / "checkpoints")),
                     checkpoint.load_params(str(tmp_path / "two" / "checkpoints")), rtol=1e-5, atol=1e-6)
  one, two = stream(str(tmp_path / "one")), stream(str(tmp_path / "two"))
  assert [l["step"] for l in one] == [l["step"] for l in two] and len(one) == STEPS + STEPS // EVAL_EVERY
  for want, got in zip(one, two):  # process 0 alone writes; evaluation included, equal to the one-process run
    assert got == pytest.approx(want, rel=1e-4, abs=1e-6)
  assert len(metrics.read(str(tmp_path / "two"))) == STEPS + STEPS // EVAL_EVERY


def finetune_command(workdir, *extra):
  # 40 dev examples in global batches of 16: process 1's rows of the last batch are all padding. Two evaluations an
  # epoch of 7.5 steps and the last: at steps 4, 8 and 10.
  return [sys.executable, "-m", "posjax.main", "--config=configs/finetune/glue.py:task=sst2,runlocal",
          f"--workdir={workdir}", "--config.total_steps=10", "--config.eval_every_steps=10",
          "--config.checkpoint_every_steps=10", "--config.eval_batch_size=16", "--config.log_every_steps=1",
          "--config.model.dropout_rate=0", "--config.model.attention_dropout_rate=0", *extra]


@pytest.mark.slow
def test_two_processes_finetune_and_evaluate_like_one(tmp_path):
  # With a test split: its predictions are made by both processes at the evaluations they agree are reported.
  glue_dir = tmp_path / "glue"
  shutil.copytree(ROOT / "configs" / "data" / "glue" / "SST-2", glue_dir / "SST-2")
  dev = (glue_dir / "SST-2" / "dev.tsv").read_text().splitlines()[1:]
  (glue_dir / "SST-2" / "test.tsv").write_text("index\tsentence\n" + "".join(
      "\t".join(line.split("\t")[:2]) + "\n" for line in dev))
  command = functools.partial(finetune_command_in, glue_dir)
  runs = two_processes(tmp_path / "two", command=command)
  assert all(code == 0 for code, _ in runs), runs[0][1][-3000:] + runs[1][1][-3000:]
  one_process(command, tmp_path / "one")
  assert_same_params(checkpoint.load_params(str(tmp_path / "one" / "checkpoints")),
                     checkpoint.load_params(str(tmp_path / "two" / "checkpoints")), rtol=1e-5, atol=1e-6)
  one, two = (json.loads((tmp_path / name / "results.json").read_text()) for name in ("one", "two"))
  assert one["metrics"] == two["metrics"] and one["step"] == two["step"] == 10
  assert one["evaluations"] == two["evaluations"] and len(one["evaluations"]) > 2
  assert ((tmp_path / "one" / "glue_test" / "SST-2.tsv").read_text()
          == (tmp_path / "two" / "glue_test" / "SST-2.tsv").read_text())


def finetune_command_in(glue_dir, workdir, *extra):
  return finetune_command(workdir, f"--config.data.data_dir={glue_dir}", *extra)


def prepared_command(workdir, data_dir, *extra):
  return [sys.executable, "-m", "posjax.main", "--config=configs/pretrain.py:runlocal", f"--workdir={workdir}",
          "--config.max_len=32", "--config.batch_size=8", "--config.data.source=prepared",
          f"--config.data.prepared_dir={data_dir}", "--config.data.eval_source=text", "--config.total_steps=12",
          "--config.warmup_steps=2", "--config.checkpoint_every_steps=4", "--config.eval_every_steps=6",
          "--config.log_every_steps=1", "--config.data.num_shards=2", "--config.model.dropout_rate=0",
          "--config.model.attention_dropout_rate=0", *extra]


@pytest.fixture(scope="module")
def prepared_one(tmp_path_factory):
  """A prepared corpus, the command that trains on it, and its run in one process with 8 devices, which the two
  tests below must reproduce. (data.num_shards: the streamed evaluation split is cut into the same document shards
  in every run.)"""
  root = tmp_path_factory.mktemp("prepared")
  prepare.prepare(config(), str(root / "data"), chunks=2, progress=False)
  command = lambda workdir, *extra: prepared_command(workdir, root / "data", *extra)  # noqa: E731
  one_process(command, root / "one")
  assert len(stream(str(root / "one"))) == 14
  return command, root / "one"


@pytest.mark.slow
@pytest.mark.xdist_group("prepared_one")
def test_on_a_prepared_corpus_two_processes_train_like_one(prepared_one, tmp_path):
  """Two processes (4 devices each) train like one with 8."""
  command, one = prepared_one
  runs = two_processes(tmp_path / "two", command=command)
  assert all(code == 0 for code, _ in runs), runs[0][1][-3000:] + runs[1][1][-3000:]
  assert_same_params(checkpoint.load_params(str(one / "checkpoints")),
                     checkpoint.load_params(str(tmp_path / "two" / "checkpoints")), rtol=1e-5, atol=1e-6)
  for want, got in zip(stream(str(one)), stream(str(tmp_path / "two")), strict=True):
    assert got == pytest.approx(want, rel=1e-4, abs=1e-6)


@pytest.mark.slow
@pytest.mark.xdist_group("prepared_one")
def test_on_a_prepared_corpus_a_killed_run_resumed_with_reader_processes_ends_like_the_uninterrupted_one(
    prepared_one, tmp_path):
  """Killed by SIGKILL after its first checkpoint and resumed with two grain reader processes."""
  command, one = prepared_one
  run = tmp_path / "killed"
  process = subprocess.Popen(command(run), cwd=ROOT, env=devices_env(8), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
  deadline = time.time() + 300
  while not (run / "checkpoints").exists() or not saved_steps(run):
    assert process.poll() is None and time.time() < deadline, "the run ended before its first checkpoint"
    time.sleep(0.02)
  process.kill()
  process.wait()
  assert saved_steps(run)[-1] < 12
  subprocess.run(command(run, "--config.data.workers=2"), cwd=ROOT, env=devices_env(8), check=True,
                 capture_output=True)
  assert_same_params(checkpoint.load_params(str(one / "checkpoints")), checkpoint.load_params(str(run / "checkpoints")))
  assert stream(str(run)) == stream(str(one))


def pair_at_checkpoint_2(workdir, failing=None):
  """Two processes of an endless run (peer timeout 5 s, no evaluation) once checkpoint 2 exists; ``failing`` runs
  through tests/faults.py, which raises an OSError after step 5 there."""
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  commands = [command(workdir, f"--coordinator_address=localhost:{port}", "--num_processes=2", f"--process_id={i}",
                      "--config.cpu_collectives=gloo", "--config.total_steps=100000",
                      "--config.peer_timeout_seconds=5", "--config.eval_every_steps=0",
                      "--config.checkpoint_every_steps=2") for i in range(2)]
  if failing is not None:
    commands[failing][1:3] = [str(ROOT / "tests" / "faults.py"), "5"]
  workers = [subprocess.Popen(c, cwd=ROOT, env=devices_env(4), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for c in commands]
  deadline = time.time() + 180
  while not (workdir / "checkpoints" / "2").exists():
    if not (all(w.poll() is None for w in workers) and time.time() < deadline):
      for w in workers:
        w.kill()
      raise AssertionError("no checkpoint: " + "".join(w.communicate()[0][-2000:] for w in workers))
    time.sleep(0.05)
  return workers


def assert_stopped_with(output, line):
  """One line at the end, and none of the runtime's aborts or stack dumps."""
  assert output.rstrip().splitlines()[-1] == f"error: {line}", output[-3000:]
  for dump in ("Fatal Python error", "Check failure", "Traceback", "terminate called"):
    assert dump not in output, output[-3000:]


@pytest.mark.slow
def test_an_error_in_one_process_during_training_stops_both_at_once_with_its_line(tmp_path):
  workers = pair_at_checkpoint_2(tmp_path, failing=1)
  try:
    outputs = [w.communicate(timeout=60)[0] for w in workers]
  finally:
    for w in workers:
      w.kill()
  for w, output in zip(workers, outputs):  # not JAX's 300 s shutdown barrier: the first process to read it leaves
    assert w.returncode != 0  # 2; where a peer left first, the runtime's abort (after the line)
    assert_stopped_with(output, "process 1 stopped: cannot read shard-00001 (injected after step 5)")
  assert checkpoint.load_params(str(tmp_path / "checkpoints"))  # the last good checkpoint stays


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_a_killed_or_hung_peer_ends_the_other_process_within_the_peer_timeout_with_one_line(tmp_path, fault):
  # config.peer_timeout_seconds=5: process 1 SIGKILLed or SIGSTOPped after its first checkpoint; process 0 stops with
  # a line naming it and status 1 within that timeout and a margin (not after JAX's default of 100 s, not with
  # JAX's abort and its dumps).
  workers = pair_at_checkpoint_2(tmp_path)
  try:
    workers[1].send_signal(signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
    lost = time.time()
    output = workers[0].communicate(timeout=60)[0]
    assert time.time() - lost < 15
  finally:
    for w in workers:
      w.kill()
  assert workers[0].returncode == 1
  assert_stopped_with(output, "process 1 sent no heartbeat for 5 s (killed, hung or unreachable; "
                              "config.peer_timeout_seconds); every process stops: rerun the job to resume from its "
                              "last checkpoint")
