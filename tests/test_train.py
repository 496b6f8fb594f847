"""The training system: loop, checkpoints and resumption, parallelism, configs."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posjax import config_args
from posjax.train import checkpoint, loop, metrics
from conftest import ROOT, load_config

DETERMINISTIC = loop.DETERMINISTIC_METRICS + ("eval_loss", "eval_accuracy")


def pretrain_config(arg="runlocal,position=tupe_r", **overrides):
  config = load_config("pretrain", arg)
  config.update(total_steps=6, warmup_steps=2, log_every_steps=1, eval_every_steps=3, checkpoint_every_steps=3,
                batch_size=8, max_len=32)
  for key, value in overrides.items():
    target = config
    *parents, leaf = key.split(".")
    for parent in parents:
      target = target[parent]
    target[leaf] = value
  return config


def flat_params(params):
  return {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(params)}


def assert_same_params(a, b, **tolerance):
  a, b = flat_params(a), flat_params(b)
  assert a.keys() == b.keys()
  for key in a:
    np.testing.assert_allclose(a[key], b[key], err_msg=key, **(tolerance or dict(rtol=0, atol=0)))


def stream(workdir):
  return [{k: v for k, v in line.items() if k in DETERMINISTIC + ("step",)} for line in metrics.read(workdir)]


def test_local_run_logs_evaluates_and_checkpoints(tmp_path):
  # 48 sequences at batch 8 = 6 steps; TensorBoard events and a profile of steps 2-3 on the side.
  loop.run(pretrain_config(total_examples=48, tensorboard=True, profile_start_step=2, profile_steps=2),
           str(tmp_path))
  assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
  assert [p for p in (tmp_path / "profile").rglob("*") if p.is_file()]
  lines = metrics.read(str(tmp_path))
  train = [l for l in lines if "loss" in l]
  assert [l["step"] for l in train] == [1, 2, 3, 4, 5, 6]
  assert {"loss", "accuracy", "grad_norm", "learning_rate", "tokens_per_second"} <= train[0].keys()
  assert [l["step"] for l in lines if "eval_loss" in l] == [3, 6]
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["3", "6"]
  assert json.loads((tmp_path / "config.json").read_text())["model"]["position"] == "tupe_r"
  assert train[-1]["learning_rate"] < train[1]["learning_rate"]  # linear decay after warm-up


def test_restart_with_a_different_config_is_an_error(tmp_path):
  loop.run(pretrain_config(total_steps=1), str(tmp_path))
  with pytest.raises(ValueError, match=r"different config \(changed: \['learning_rate'\]\)"):
    loop.run(pretrain_config(total_steps=1, learning_rate=0.5), str(tmp_path))


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
  config = pretrain_config(learning_rate=1e30, warmup_steps=0, checkpoint_every_steps=1, grad_clip_norm=1e30,
                           eval_every_steps=0)
  with pytest.raises(FloatingPointError, match=r"non-finite loss \(nan\) at step (\d+); stopping. The last good "
                                               r"checkpoint is step \d+"):
    loop.run(config, str(tmp_path))
  saved = sorted(int(s) for s in os.listdir(tmp_path / "checkpoints") if s.isdigit())
  assert saved and all(np.isfinite(l["loss"]) for l in metrics.read(str(tmp_path)) if "loss" in l)


def test_pmap_and_jit_give_the_same_parameters(tmp_path):
  assert jax.device_count() == 8
  common = {"model.dropout_rate": 0.0, "model.attention_dropout_rate": 0.0, "eval_every_steps": 0,
            "total_steps": 3}
  jit_params = loop.run(pretrain_config(**common, parallelism="jit"), str(tmp_path / "jit"))
  pmap_params = loop.run(pretrain_config(**common, parallelism="pmap"), str(tmp_path / "pmap"))
  assert_same_params(jit_params, pmap_params, rtol=2e-5, atol=2e-6)
  # The arms differ in what they are meant to: the update really happened.
  fresh = checkpoint.load_params(str(tmp_path / "jit" / "checkpoints"), step=3)
  assert_same_params(jit_params, fresh)


def test_gradient_accumulation_matches_the_full_batch(tmp_path):
  common = {"model.dropout_rate": 0.0, "model.attention_dropout_rate": 0.0, "eval_every_steps": 0,
            "total_steps": 2}
  whole = loop.run(pretrain_config(**common), str(tmp_path / "whole"))
  accumulated = loop.run(pretrain_config(**common, grad_accum_steps=4), str(tmp_path / "accumulated"))
  assert_same_params(whole, accumulated, rtol=2e-5, atol=2e-6)


def test_restore_onto_another_mesh_and_fsdp_sharding(tmp_path):
  common = {"model.dropout_rate": 0.0, "model.attention_dropout_rate": 0.0, "eval_every_steps": 0}
  straight = loop.run(pretrain_config(**common), str(tmp_path / "straight"))
  loop.run(pretrain_config(**common, total_steps=3), str(tmp_path / "moved"))
  moved = loop.run(pretrain_config(**common, **{"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2},
                                   allow_config_change=True), str(tmp_path / "moved"))
  embedding = moved["encoder"]["word_embeddings"]["embedding"]
  assert embedding.sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp")
  assert_same_params(straight, moved, rtol=2e-5, atol=2e-6)
  for want, got in zip(stream(str(tmp_path / "straight")), stream(str(tmp_path / "moved")), strict=True):
    assert want.keys() == got.keys() and want["step"] == got["step"]
    assert all(got[k] == pytest.approx(want[k], rel=1e-4, abs=1e-6) for k in want)


def test_warm_start_with_a_changed_position_method(tmp_path):
  loop.run(pretrain_config("runlocal,position=absolute", total_steps=2, eval_every_steps=0), str(tmp_path / "a"))
  source = checkpoint.load_params(str(tmp_path / "a" / "checkpoints"))
  params = loop.run(pretrain_config("runlocal,position=huang_m4", total_steps=1, eval_every_steps=0,
                                    learning_rate=0.0, warmup_steps=0,
                                    init_from=str(tmp_path / "a" / "checkpoints")), str(tmp_path / "b"))
  np.testing.assert_array_equal(params["encoder"]["word_embeddings"]["embedding"],
                                source["encoder"]["word_embeddings"]["embedding"])
  assert "key" in params["encoder"]["layer_0"]["attention"]["position"]  # Method 4's new table
  assert "position" not in params["encoder"]  # the absolute table is dropped


def test_corrupted_latest_checkpoint_falls_back_to_the_previous_one(tmp_path):
  manager = checkpoint.Checkpointer(str(tmp_path), keep=3, async_save=False)
  for step in (1, 2):
    manager.save(step, {"w": jnp.full((4,), float(step))}, {"blocks_consumed": step})
  manager.close()
  for path in (tmp_path / "2" / "state").rglob("*"):
    if path.is_file():
      path.write_bytes(b"garbage")
  manager = checkpoint.Checkpointer(str(tmp_path), keep=3, async_save=False)
  state, data = manager.restore({"w": jax.ShapeDtypeStruct((4,), jnp.float32)})
  np.testing.assert_array_equal(state["w"], 1.0)
  assert data == {"blocks_consumed": 1}


def test_keep_list_survives_the_latest_k(tmp_path):
  manager = checkpoint.Checkpointer(str(tmp_path), keep=2, keep_steps=(2,), async_save=False)
  for step in range(1, 7):
    manager.save(step, {"w": jnp.zeros(2)}, {})
  manager.close()
  assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [2, 5, 6]


def test_config_options_are_typed_and_checked():
  options = config_args.parse_arg("position=shaw,runlocal,layers=3", position="tupe_r", runlocal=False, layers=12)
  assert (options.position, options.runlocal, options.layers) == ("shaw", True, 3)
  with pytest.raises(ValueError, match=r"unknown config option 'postion'; known options: \['layers', 'position'"):
    config_args.parse_arg("postion=shaw", position="tupe_r", layers=12)
  with pytest.raises(ValueError, match="needs a value"):
    config_args.parse_arg("layers", layers=12)


def test_durations_in_steps_epochs_or_examples():
  import ml_collections
  cfg = ml_collections.ConfigDict({"train_steps": None, "train_epochs": 2.5, "train_examples": None})
  assert config_args.steps("train", cfg, examples_per_step=32, examples_per_epoch=100) == 8
  cfg.train_epochs, cfg.train_examples = None, 1000
  assert config_args.steps("train", cfg, examples_per_step=32) == 32
  cfg.train_steps = 5
  with pytest.raises(ValueError, match="exactly one of"):
    config_args.steps("train", cfg, examples_per_step=32)


def main_command(workdir, *overrides):
  return [sys.executable, "-m", "posjax.main", "--config=configs/pretrain.py:runlocal,position=huang_m4",
          f"--workdir={workdir}", "--config.total_steps=30", "--config.checkpoint_every_steps=10",
          "--config.log_every_steps=1", "--config.eval_every_steps=10", "--config.batch_size=8",
          "--config.max_len=32", *overrides]


@pytest.mark.slow
def test_killed_run_resumes_to_the_same_parameters_and_metrics(tmp_path):
  env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
  subprocess.run(main_command(tmp_path / "straight"), check=True, cwd=ROOT, env=env, capture_output=True)
  killed = subprocess.Popen(main_command(tmp_path / "killed"), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
  deadline = time.time() + 300
  while not (tmp_path / "killed" / "checkpoints" / "20").exists():
    assert killed.poll() is None and time.time() < deadline, "the run ended before its step-20 checkpoint"
    time.sleep(0.05)
  killed.send_signal(signal.SIGKILL)
  killed.wait()
  assert not (tmp_path / "killed" / "checkpoints" / "30").exists()
  subprocess.run(main_command(tmp_path / "killed"), check=True, cwd=ROOT, env=env, capture_output=True)
  assert_same_params(checkpoint.load_params(str(tmp_path / "straight" / "checkpoints")),
                     checkpoint.load_params(str(tmp_path / "killed" / "checkpoints")))
  assert stream(str(tmp_path / "straight")) == stream(str(tmp_path / "killed"))
  assert len(stream(str(tmp_path / "killed"))) == 33  # 30 train lines, 3 eval lines, none repeated


def test_position_options_from_the_command_line(tmp_path):
  command = [sys.executable, "-m", "posjax.main", "--config=configs/pretrain.py:runlocal,position=tupe_r",
             f"--workdir={tmp_path}", "--config.model.position_options.cls_reset=paper", "--config.total_steps=1",
             "--config.eval_every_steps=0", "--config.max_len=32", "--config.batch_size=8"]
  result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
  assert result.returncode == 0, result.stderr[-2000:]
  saved = json.loads((tmp_path / "config.json").read_text())["model"]["position_options"]
  assert saved["cls_reset"] == "paper" and saved["relative_distance"] == "buckets"
  params = checkpoint.load_params(str(tmp_path / "checkpoints"))
  assert "cls_theta" in params["encoder"]["position"]  # the paper's extra θ vectors exist


def test_unknown_override_is_an_error(tmp_path):
  result = subprocess.run(main_command(tmp_path, "--config.learning_rat=0.1"), cwd=ROOT, capture_output=True,
                          text=True)
  assert result.returncode != 0 and "learning_rat" in result.stderr


@pytest.mark.slow
def test_resume_on_a_different_number_of_devices(tmp_path):
  """3 steps on 8 devices, then 3 more on 4 devices, equal 6 straight steps on 8."""
  def run(workdir, devices, steps, *extra):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    subprocess.run(main_command(workdir, f"--config.total_steps={steps}", "--config.model.dropout_rate=0",
                                "--config.model.attention_dropout_rate=0", *extra),
                   check=True, cwd=ROOT, env=env, capture_output=True)

  run(tmp_path / "straight", 8, 6)
  run(tmp_path / "moved", 8, 3)
  run(tmp_path / "moved", 4, 6, "--config.allow_config_change=True")
  assert_same_params(checkpoint.load_params(str(tmp_path / "straight" / "checkpoints")),
                     checkpoint.load_params(str(tmp_path / "moved" / "checkpoints")), rtol=2e-5, atol=2e-6)
