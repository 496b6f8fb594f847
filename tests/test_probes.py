"""The position-probe suite (``make demo``): task definitions, results, resumption."""

import json

import numpy as np
import pytest

from posjax.experiments import probes
from posjax.main import train
from posjax.tasks import probe as probe_task
from conftest import load_config


def probes_config(arg):
  return load_config("probes", arg)


@pytest.mark.parametrize("task", probe_task.TASKS)
def test_task_labels(task):
  x, y, w = probe_task.make_batch(task, np.random.default_rng(0), 3, 10, symbols=16, shift=2, index=3)
  assert (x[:, 0] == 16).all() and (x[:, 1:] < 16).all()
  for b in range(3):
    for i in range(10):
      if task == "copy_left":
        scored, source = i >= 3, i - 2
      elif task == "reverse":
        scored, source = i >= 1, 10 - i
      else:
        scored, source = i >= 1 and i != 3, 3
      assert bool(w[b, i]) == scored
      if scored:
        assert y[b, i] == x[b, source]


@pytest.mark.slow
def test_probe_run_reports_unsupported_lengths_and_resumes(tmp_path, monkeypatch):
  config = probes_config("methods=absolute+huang_m4+tupe_a,steps=150")
  config.tasks = ("copy_left",)
  results = probes.run(config, str(tmp_path), train)
  absolute = results["absolute"]["copy_left"]
  assert absolute["32"] == absolute["64"] == "unsupported"
  assert isinstance(absolute["16"], float) and 1 / config.symbols < absolute["16"] <= 1  # trained, above chance
  assert all(isinstance(v, float) for v in results["huang_m4"]["copy_left"].values())
  assert results["huang_m4"]["copy_left"]["64"] > 0.9  # a relative task generalises under a relative method
  for name in ("results.md", "results.json", "accuracy_vs_length.png", "tupe_correlation.png"):
    assert (tmp_path / name).stat().st_size > 0
  assert "| `absolute` |" in (tmp_path / "results.md").read_text()

  def must_not_train(*args):
    raise AssertionError("a finished probe was trained again")

  monkeypatch.setattr(probes, "train_and_evaluate", must_not_train)
  assert probes.run(config, str(tmp_path), train) == json.loads((tmp_path / "results.json").read_text())


def test_unknown_task_is_an_error(tmp_path):
  config = probes_config("methods=rope,steps=1")
  config.tasks = ("sort",)
  with pytest.raises(ValueError, match=r"unknown probe task\(s\) \['sort'\]"):
    probes.run(config, str(tmp_path), train)


def test_results_of_another_config_are_not_reused(tmp_path, capsys):
  config = probes_config("methods=rope,steps=2")
  config.update(tasks=("copy_left",), warmup_steps=1, eval_multiples=(1,))
  probes.run(config, str(tmp_path), train)
  last = capsys.readouterr().out.strip().splitlines()[-1]
  assert last == f"written to {tmp_path}: results.md, results.json, accuracy_vs_length.png"  # no TUPE-A plot
  config.steps = 3
  with pytest.raises(ValueError, match=r"different config \(changed: \['steps'\]\); use another workdir$"):
    probes.run(config, str(tmp_path), train)
  config.steps, config.methods = 2, ("rope", "alibi")  # adding a method to the table is allowed
  assert set(probes.run(config, str(tmp_path), train)) == {"rope", "alibi"}


def test_bad_probe_configs_are_errors_before_anything_is_written(tmp_path):
  config = probes_config("methods=rope,steps=10")
  with pytest.raises(ValueError, match=r"config.steps=10 is shorter than the learning-rate warm-up "
                                       r"\(config.warmup_steps=30\)"):
    probes.run(config, str(tmp_path / "short"), train)
  config = probes_config("methods=rope")
  config.index = 16
  with pytest.raises(ValueError, match=r"config.index=16 must be below config.train_len=16"):
    probes.run(config, str(tmp_path / "index"), train)
  config = probes_config("methods=rope")
  config.batch_size = 0
  with pytest.raises(ValueError, match=r"config.batch_size=0 is out of range: it must be a number > 0"):
    probes.run(config, str(tmp_path / "batch"), train)
  assert not list(tmp_path.iterdir())
