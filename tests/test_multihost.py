"""Two processes over localhost (CPU collectives) train exactly like one process with the same global batch."""

import os
import socket
import subprocess
import sys

import pytest

from posjax.train import checkpoint
from conftest import ROOT
from test_train import assert_same_params



def command(workdir, *extra):
  return [sys.executable, "-m", "posjax.main", "--config=configs/pretrain.py:runlocal,position=tupe_r",
          f"--workdir={workdir}", "--config.total_steps=3", "--config.batch_size=8", "--config.max_len=32",
          "--config.eval_every_steps=0", "--config.checkpoint_every_steps=3", "--config.data.num_shards=2",
          "--config.log_every_steps=1",
          "--config.model.dropout_rate=0", "--config.model.attention_dropout_rate=0", *extra]


def env_with_devices(n):
  return {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "XLA_FLAGS": f"--xla_force_host_platform_device_count={n}"}


@pytest.mark.slow
def test_two_processes_match_one(tmp_path):
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  workers = [subprocess.Popen(command(tmp_path / "two", f"--coordinator_address=localhost:{port}",
                                      "--num_processes=2", f"--process_id={i}", "--config.cpu_collectives=gloo"),
                              cwd=ROOT, env=env_with_devices(4), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for i in range(2)]
  outputs = [w.communicate(timeout=600)[0] for w in workers]
  assert all(w.returncode == 0 for w in workers), outputs[0][-3000:] + outputs[1][-3000:]
  subprocess.run(command(tmp_path / "one"), cwd=ROOT, env=env_with_devices(8), check=True, capture_output=True)
  assert_same_params(checkpoint.load_params(str(tmp_path / "one" / "checkpoints")),
                     checkpoint.load_params(str(tmp_path / "two" / "checkpoints")), rtol=1e-5, atol=1e-6)
  assert (tmp_path / "two" / "metrics.jsonl").read_text().count("\n") == 3  # process 0 alone writes
