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


@pytest.mark.parametrize("task", ["copy_left", "reverse", "index"])
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


def sequence_labels(task, row):
  """``(labels, scored)`` of one row of a Kazemnejad task, by a plain loop over its tokens."""
  length, symbols = len(row), 16
  labels, scored = [0] * length, [False] * length
  if task == "parity":
    ones = 0
    for i in range(1, length):
      ones += row[i]
      labels[i], scored[i] = ones % 2, True
  elif task in ("copy", "sort"):
    n = (length - 1) // 2
    inputs = list(row[1:n + 1])
    answer = inputs if task == "copy" else sorted(inputs)
    for j in range(n):
      labels[n + 1 + j], scored[n + 1 + j] = answer[j], True
    assert all(row[i] == symbols + 1 for i in range(n + 1, length))  # blank slots
  else:  # addition: two numbers of n digits, least significant first, then n + 1 slots for the sum
    n = (length - 2) // 3
    a = sum(int(row[1 + k]) * 10 ** k for k in range(n))
    b = sum(int(row[1 + n + k]) * 10 ** k for k in range(n))
    total = a + b
    for k in range(n + 1):
      labels[2 * n + 1 + k], scored[2 * n + 1 + k] = total // 10 ** k % 10, True
    assert all(row[i] == symbols + 1 for i in range(2 * n + 1, length))
    assert all(row[i] < 10 for i in range(1, 2 * n + 1))
  return labels, scored


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("length", [11, 16])
@pytest.mark.parametrize("task", ["copy", "sort", "parity", "addition"])
def test_kazemnejad_task_labels_match_a_plain_loop(task, length, causal):
  x, y, w = probe_task.make_batch(task, np.random.default_rng(1), 4, length, symbols=16, shift=2, index=3,
                                  causal=causal)
  assert x.shape == y.shape == w.shape == (4, length) and (x[:, 0] == 16).all()
  for b in range(4):
    labels, scored = sequence_labels(task, x[b].tolist())
    assert w[b].tolist() == [float(s) for s in scored]
    assert [int(y[b, i]) for i in range(length) if scored[i]] == [labels[i] for i in range(length) if scored[i]]
  if task == "parity":
    assert set(np.unique(x[:, 1:])) <= {0, 1}


def test_a_decoder_scores_index_after_the_index_and_refuses_reverse():
  x, y, w = probe_task.make_batch("index", np.random.default_rng(0), 3, 10, symbols=16, shift=2, index=3, causal=True)
  assert w.tolist() == [[0.0] * 4 + [1.0] * 6] * 3 and (y[:, 4:] == x[:, [3]]).all()
  with pytest.raises(ValueError, match=r"probe task 'reverse' labels a token with a later one, which a decoder "
                                       r"\(model.causal=True\) cannot see; decoder tasks: \['copy_left', 'index'"):
    probe_task.make_batch("reverse", np.random.default_rng(0), 3, 10, symbols=16, shift=2, index=3, causal=True)
  config = probes_config("methods=rope,decoder")
  with pytest.raises(ValueError, match=r"probe task 'reverse' labels a token with a later one"):
    probes.validate(config)
  config = probes_config("methods=rope,tasks=addition")
  config.symbols = 8
  with pytest.raises(ValueError, match=r"probe task 'addition' writes decimal digits: it needs symbols >= 10, got 8"):
    probes.validate(config)
  with pytest.raises(ValueError, match=r"probe task 'copy' needs rows of at least 3 tokens, got 2"):
    probe_task.make_batch("copy", np.random.default_rng(0), 1, 2, symbols=16, shift=1, index=1)


def test_the_demo_keeps_its_tasks_and_encoder_and_new_tasks_are_opt_in():
  demo = probes_config("")
  assert demo.tasks == ("copy_left", "reverse", "index") and "causal" not in demo.model
  assert probe_task.model_config(demo, "rope", "index").vocab_size == 17  # the demo's models, unchanged
  assert probe_task.model_config(demo, "rope", "copy").vocab_size == 18  # and a blank for the answer slots
  decoder = probes_config("tasks=copy+sort+parity+addition,decoder")
  assert decoder.tasks == ("copy", "sort", "parity", "addition") and decoder.model.causal
  assert probe_task.model_config(decoder, "alibi", "sort").causal


def test_a_decoder_probe_trains_with_the_causal_mask_and_another_config_reuses_no_result(tmp_path, capsys):
  config = probes_config("methods=alibi,steps=2,tasks=copy,decoder")
  config.update(warmup_steps=1, eval_multiples=(1, 2), eval_batch_size=8)
  results = probes.run(config, str(tmp_path), train)
  assert list(results["alibi"]["copy"]) == ["16", "32"]
  assert all(isinstance(v, float) for v in results["alibi"]["copy"].values())
  model = json.loads((tmp_path / "runs" / "alibi" / "copy" / "model_config.json").read_text())
  assert model["causal"] and model["vocab_size"] == 18
  assert "| `alibi` |" in (tmp_path / "results.md").read_text()
  last = capsys.readouterr().out.strip().splitlines()[-1]
  assert last == f"written to {tmp_path}: results.md, results.json, accuracy_vs_length.png"  # no TUPE-A plot
  config.steps = 3
  with pytest.raises(ValueError, match=r"different config \(changed: \['steps'\]\); use another workdir$"):
    probes.run(config, str(tmp_path), train)
  config.steps, config.methods = 2, ("alibi", "tupe_a")  # adding a method to the table is allowed
  assert set(probes.run(config, str(tmp_path), train)) == {"alibi", "tupe_a"}
  assert (tmp_path / "tupe_correlation.png").stat().st_size > 0  # TUPE-A's learned correlation, one map per head
  assert capsys.readouterr().out.strip().splitlines()[-1] == (
      f"written to {tmp_path}: results.md, results.json, accuracy_vs_length.png, tupe_correlation.png")


@pytest.mark.slow
def test_probe_run_reports_unsupported_lengths_and_resumes(tmp_path, monkeypatch):
  # 60 steps: huang_m4 0.77 at 64; 70: 0.991; 80: 0.997 (TUPE-A's correlation plot: the 2-step test below)
  config = probes_config("methods=absolute+huang_m4,steps=80")
  config.tasks = ("copy_left",)
  results = probes.run(config, str(tmp_path), train)
  absolute = results["absolute"]["copy_left"]
  assert absolute["32"] == absolute["64"] == "unsupported"
  assert isinstance(absolute["16"], float) and 1 / config.symbols < absolute["16"] <= 1  # trained, above chance
  assert all(isinstance(v, float) for v in results["huang_m4"]["copy_left"].values())
  assert results["huang_m4"]["copy_left"]["64"] > 0.9  # a relative task generalises under a relative method
  for name in ("results.md", "results.json", "accuracy_vs_length.png"):
    assert (tmp_path / name).stat().st_size > 0
  assert "| `absolute` |" in (tmp_path / "results.md").read_text()

  def must_not_train(*args):
    raise AssertionError("a finished probe was trained again")

  monkeypatch.setattr(probes, "train_and_evaluate", must_not_train)
  assert probes.run(config, str(tmp_path), train) == json.loads((tmp_path / "results.json").read_text())


def test_unknown_task_is_an_error(tmp_path):
  config = probes_config("methods=rope,steps=1")
  config.tasks = ("sorting",)
  with pytest.raises(ValueError, match=r"unknown probe task\(s\) \['sorting'\]"):
    probes.run(config, str(tmp_path), train)


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
