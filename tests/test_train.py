"""The training system: loop, checkpoints and resumption, parallelism, configs."""

import errno
import json
import logging
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import flags
from absl import logging as absl_logging
from ml_collections import config_flags

from posjax import config_args, tasks
from posjax.data import mlm as mlm_data
from posjax.main import train
from posjax.models import TransformerConfig, layout
from posjax.train import checkpoint, metrics, peers, sharding, validate
from posjax.train.step import make_optimizer, step_rng
from conftest import ROOT, devices_env, load_config, override

DATA = ROOT / "configs" / "data"

DETERMINISTIC = ("loss", "accuracy", "grad_norm", "learning_rate", "eval_loss", "eval_accuracy")


def pretrain_config(arg="runlocal,position=tupe_r", **overrides):
  config = load_config("pretrain", arg)
  config.update(total_steps=6, warmup_steps=2, log_every_steps=1, eval_every_steps=3, checkpoint_every_steps=3,
                batch_size=8, max_len=32)
  return override(config, **overrides)


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
  train(pretrain_config(total_examples=48, tensorboard=True, profile_start_step=2, profile_steps=2),
           str(tmp_path))
  assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
  assert [p for p in (tmp_path / "profile").rglob("*") if p.is_file()]
  lines = metrics.read(str(tmp_path))
  logged = [l for l in lines if "loss" in l]
  assert [l["step"] for l in logged] == [1, 2, 3, 4, 5, 6]
  assert {"loss", "accuracy", "grad_norm", "learning_rate", "tokens_per_second"} <= logged[0].keys()
  assert [l["step"] for l in lines if "eval_loss" in l] == [3, 6]
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["3", "6"]
  assert json.loads((tmp_path / "config.json").read_text())["model"]["position"] == "tupe_r"
  assert logged[-1]["learning_rate"] < logged[1]["learning_rate"]  # linear decay after warm-up


@pytest.mark.xdist_group("straight")
def test_restart_with_a_different_config_is_an_error_that_leads_with_a_changed_task(tmp_path, straight):
  from posjax.train import validate
  run = shutil.copytree(straight[0], tmp_path / "run")
  same = lambda **fields: pretrain_config(**NO_DROPOUT, eval_every_steps=0, **fields)  # noqa: E731  (the run's)
  with pytest.raises(ValueError, match=r"different config \(changed: \['learning_rate'\]\)"):
    train(same(learning_rate=0.5), str(run))
  with pytest.raises(ValueError, match=r"holds a 'mlm' run and this config is a 'clm' run \(\d+ fields differ: "):
    validate.check_workdir_config(load_config("lm", "runlocal"), str(run), write=False)
  # a run from before data.random_positions_first resumes as it ran: the field's absence is the old draw (first at 0)
  recorded = json.loads((run / "config.json").read_text())
  del recorded["data"]["random_positions_first"]
  (run / "config.json").write_text(json.dumps(recorded))
  validate.check_workdir_config(same(), str(run), write=False)  # no draw: no change
  recorded["data"]["random_positions"] = 512
  (run / "config.json").write_text(json.dumps(recorded))
  with pytest.raises(ValueError, match=r"different config \(changed: \['data.random_positions_first'\]\)"):
    validate.check_workdir_config(same(**{"data.random_positions": 512}), str(run), write=False)
  validate.check_workdir_config(same(**{"data.random_positions": 512, "data.random_positions_first": "zero"}),
                                str(run), write=False)


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
  config = pretrain_config(learning_rate=1e30, warmup_steps=0, checkpoint_every_steps=1, grad_clip_norm=1e30,
                           eval_every_steps=0)
  with pytest.raises(FloatingPointError, match=r"non-finite loss \(nan\) at step (\d+); stopping. The last good "
                                               r"checkpoint is step \d+"):
    train(config, str(tmp_path))
  saved = sorted(int(s) for s in os.listdir(tmp_path / "checkpoints") if s.isdigit())
  assert saved and all(np.isfinite(l["loss"]) for l in metrics.read(str(tmp_path)) if "loss" in l)
  config.checkpoint_every_steps = 100
  with pytest.raises(FloatingPointError, match=r"at step \d+; stopping. No checkpoint had been saved yet$"):
    train(config, str(tmp_path / "none_saved"))


def test_pmap_devices_draw_their_own_dropout_masks():
  rng = jax.random.key(0)
  draw = lambda _: jax.random.uniform(step_rng(rng, 3, "batch"), (4,))
  draws = np.asarray(jax.pmap(draw, axis_name="batch")(jnp.arange(jax.device_count())))
  assert len({tuple(row) for row in draws}) == jax.device_count()
  np.testing.assert_array_equal(draws[0], jax.random.uniform(jax.random.fold_in(jax.random.fold_in(rng, 3), 0), (4,)))


NO_DROPOUT = {"model.dropout_rate": 0.0, "model.attention_dropout_rate": 0.0}
BATCH_OF_32 = {**NO_DROPOUT, "eval_every_steps": 0, "total_steps": 3, "batch_size": 32}


@pytest.fixture(scope="module")
def whole_batch(tmp_path_factory):
  """Three steps of 32 rows as one jit program over the 8-device mesh, which the accumulation tests reproduce, and
  the initial parameters of that run."""
  config = pretrain_config(**BATCH_OF_32)
  prepared = validate.validate(config, str(tmp_path_factory.mktemp("unused")), tasks.build)
  initial = prepared.parallel.init(lambda rng: nn.unbox(prepared.init_boxed(rng)), prepared.init_rng).params
  return train(config, str(tmp_path_factory.mktemp("whole") / "run")), flat_params(initial)


@pytest.mark.xdist_group("whole_batch")
def test_pmap_with_accumulation_gives_the_parameters_of_jit_without(tmp_path, whole_batch):
  # On 8 devices: pmap with its 32 rows in 2 micro-batches of 2 rows per device.
  assert jax.device_count() == 8
  jit_params, initial = whole_batch
  pmap_params = train(pretrain_config(**BATCH_OF_32, parallelism="pmap", grad_accum_steps=2), str(tmp_path / "pmap"))
  assert_same_params(jit_params, pmap_params, rtol=2e-5, atol=2e-6)
  # Both trained: every parameter moved away from its initial value, except the key projection's bias, whose
  # gradient is zero (softmax ignores a shift shared by all keys).
  for key, value in flat_params(jit_params).items():
    moved = np.abs(value - initial[key]).max() > 1e-4
    assert moved != key.endswith("['attention']['key']['bias']"), key


@pytest.mark.xdist_group("whole_batch")
def test_gradient_accumulation_on_the_mesh_matches_the_full_batch(tmp_path, whole_batch):
  # 32 rows on 8 data devices in 4 micro-batches of 8 (what each device computes: tests/test_pod_program.py).
  accumulated = train(pretrain_config(**BATCH_OF_32, grad_accum_steps=4), str(tmp_path / "accumulated"))
  assert_same_params(whole_batch[0], accumulated, rtol=2e-5, atol=2e-6)


def test_a_micro_batch_that_does_not_span_the_data_devices_is_an_error(tmp_path):
  with pytest.raises(ValueError, match=r"^batch_size=8 must divide over the mesh's 8 data x fsdp devices times "
                                       r"grad_accum_steps=4 \(each micro-batch spans every data device\)$"):
    train(pretrain_config(grad_accum_steps=4), str(tmp_path))


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """Six steps without dropout or evaluation (checkpoints 3 and 6) in one go, which the resumed runs below must
  end like, and whose checkpoints the tests of this group start from, refuse or damage (a test that changes its
  workdir copies it first)."""
  workdir = tmp_path_factory.mktemp("straight") / "run"
  return workdir, train(pretrain_config(**NO_DROPOUT, eval_every_steps=0), str(workdir))


@pytest.mark.xdist_group("straight")
def test_restore_onto_another_mesh_and_fsdp_sharding(tmp_path, straight):
  """The straight run's checkpoint 3 resumed on a data x fsdp x tensor mesh ends like the straight run."""
  workdir, params = straight
  shutil.copytree(workdir, tmp_path / "moved")
  shutil.rmtree(tmp_path / "moved" / "checkpoints" / "6")
  moved = train(pretrain_config(**NO_DROPOUT, eval_every_steps=0, **{"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2},
                                allow_config_change=True), str(tmp_path / "moved"))
  embedding = moved["encoder"]["word_embeddings"]["embedding"]
  assert embedding.sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp")
  assert_same_params(params, moved, rtol=2e-5, atol=2e-6)
  for want, got in zip(stream(str(workdir)), stream(str(tmp_path / "moved")), strict=True):
    assert want.keys() == got.keys() and want["step"] == got["step"]
    assert all(got[k] == pytest.approx(want[k], rel=1e-4, abs=1e-6) for k in want)


@pytest.mark.xdist_group("straight")
def test_warm_start_with_a_changed_position_method(tmp_path, straight):
  """Method 4 (huang_m4) started from the straight run's TUPE-R checkpoint."""
  source = checkpoint.load_params(str(straight[0] / "checkpoints"))
  assert "position" in source["encoder"]  # TUPE's table
  params = train(pretrain_config("runlocal,position=huang_m4", total_steps=1, eval_every_steps=0,
                                    learning_rate=0.0, warmup_steps=0,
                                    init_from=str(straight[0] / "checkpoints")), str(tmp_path / "b"))
  np.testing.assert_array_equal(params["encoder"]["word_embeddings"]["embedding"],
                                source["encoder"]["word_embeddings"]["embedding"])
  assert "key" in params["encoder"]["layer_0"]["attention"]["position"]  # Method 4's new table
  assert "position" not in params["encoder"]  # TUPE's table is dropped


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


@pytest.mark.parametrize("failures,restored", [(2, True), (9, False)])
def test_an_io_error_while_reading_is_retried_and_never_moves_a_checkpoint_aside(tmp_path, monkeypatch, failures,
                                                                                 restored):
  manager = checkpoint.Checkpointer(str(tmp_path), keep=3, async_save=False, attempts=3, backoff=0.01)
  manager.save(1, {"w": jnp.full((4,), 1.0)}, {"blocks_consumed": 1})
  reads, original = [], manager.manager.restore

  def flaky(step, args):
    reads.append(step)
    if len(reads) <= failures:
      raise OSError(5, "Input/output error")  # EIO, as from a network file system that is briefly away
    return original(step, args=args)

  monkeypatch.setattr(manager.manager, "restore", flaky)
  abstract = {"w": jax.ShapeDtypeStruct((4,), jnp.float32)}
  if restored:
    state, data = manager.restore(abstract)
    np.testing.assert_array_equal(state["w"], 1.0)
    assert reads == [1, 1, 1] and data == {"blocks_consumed": 1}
  else:
    with pytest.raises(OSError, match=r"checkpoint 1 in .* could not be read after 3 attempts on process\(es\) \[0\] "
                                      r"\(OSError: \[Errno 5\] Input/output error\), an I/O error rather than a "
                                      r"damaged checkpoint: it is left in place"):
      manager.restore(abstract)
    assert reads == [1, 1, 1]
  assert os.listdir(tmp_path) == ["1"]  # nothing moved aside


def process_hooks():
  """What quieting orbax's abandoned I/O changes: the unraisable hook and two loggers' filters."""
  return (sys.unraisablehook, list(logging.getLogger("asyncio").filters),
          list(absl_logging.get_absl_logger().filters))


def test_a_checkpointer_leaves_the_processs_hooks_as_they_were(tmp_path):
  before = process_hooks()
  checkpoint.Checkpointer(str(tmp_path), keep=1, async_save=False).close()
  assert process_hooks() == before
  with checkpoint.quiet_abandoned_io():
    assert process_hooks() != before
  assert process_hooks() == before


@pytest.mark.xdist_group("straight")
def test_unreadable_checkpoint_is_moved_aside_and_the_run_finishes(tmp_path, capfd, straight):
  hooks = process_hooks()
  workdir, params = straight
  shutil.copytree(workdir, tmp_path / "run")
  latest = tmp_path / "run" / "checkpoints" / "6"
  biggest = max((p for p in latest.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
  biggest.write_bytes(biggest.read_bytes()[:1000])  # truncated, as by a full disk
  capfd.readouterr()
  resumed = train(pretrain_config(**NO_DROPOUT, eval_every_steps=0), str(tmp_path / "run"))
  err = capfd.readouterr().err
  assert_same_params(params, resumed, rtol=2e-5, atol=2e-6)  # retrained 4..6 from step 3, same result
  assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["3", "6"]
  assert os.listdir(tmp_path / "run" / "checkpoints.unreadable") == ["6"]  # kept for inspection
  assert "resumed from step 3" in err and "Traceback" not in err and "Event loop is closed" not in err
  assert len(err.splitlines()) < 40
  assert process_hooks() == hooks  # the runs quieted orbax's abandoned reads only while they ran


@pytest.mark.xdist_group("straight")
def test_checkpoints_none_of_which_can_be_read_are_an_error(tmp_path, straight):
  run = shutil.copytree(straight[0], tmp_path / "run")
  for path in (run / "checkpoints").glob("*/state/**/*"):
    if path.is_file():
      path.write_bytes(b"garbage")
  with pytest.raises(ValueError, match=r"no checkpoint in .*checkpoints can be restored \(step 6: .*; step 3: .*\). "
                                       r"They are left in place"):
    train(pretrain_config(**NO_DROPOUT, eval_every_steps=0), str(run))
  assert sorted(os.listdir(run / "checkpoints")) == ["3", "6"]


def test_the_terminal_says_where_things_go_shows_evaluations_and_that_a_run_is_finished(tmp_path, capsys):
  train(pretrain_config(total_steps=2, eval_every_steps=2), str(tmp_path))
  err = capsys.readouterr().err
  assert f"metrics in {tmp_path}/metrics.jsonl, checkpoints in {tmp_path}/checkpoints" in err
  evaluation = metrics.read(str(tmp_path))[-1]
  assert f"step 2: eval_loss {evaluation['eval_loss']:.4f}, eval_accuracy {evaluation['eval_accuracy']:.4f}" in err
  train(pretrain_config(total_steps=2, eval_every_steps=2), str(tmp_path))
  assert f"{tmp_path} is already complete at step 2 (total_steps=2); nothing to do" in capsys.readouterr().err


@pytest.mark.parametrize("override, message", [
    ({"batch_size": 0}, r"config.batch_size=0 is out of range: it must be a number > 0"),
    ({"batch_size": -8}, r"config.batch_size=-8 is out of range"),
    ({"learning_rate": -1e-3}, r"config.learning_rate=-0.001 is out of range: it must be a number >= 0"),
    ({"data.mask_rate": 1.5}, r"data.mask_rate=1.5 must be in \(0, 1\)"),
    ({"model.dropout_rate": 1.0}, r"dropout_rate must be in \[0, 1\), got 1.0"),
    ({"model.position_options.cls_reset": "bogus"}, r"cls_reset='bogus' is not allowed"),
    ({"mesh.data": 3}, r"needs 3 devices; there are 8"),
    ({"seed": -1}, r"config.seed=-1 is out of range: it must be a number >= 0"),
    ({"learning_rate": float("inf")}, r"config.learning_rate=inf is out of range"),
    ({"data.packing": "bogus"}, r"unknown packing 'bogus'; allowed: \['full_sentence', 'documents', 'stream', 'stream_documents'\]"),
    ({"data.num_shards": 3}, r"the per-process batch 8 must divide over its 3 data shards"),
    ({"data.source": "bogus"}, r"unknown data.source 'bogus'; allowed: \['text', 'tfds'\]"),
    ({"batch_size": 12}, r"batch_size=12 must divide over the mesh's 8 data x fsdp devices"),
    ({"init_from": "/nonexistent"}, r"config.init_from='/nonexistent' holds no checkpoint"),
    ({"data.train_files": "/nonexistent/*.txt", "data.eval_files": "/nonexistent/*.txt",
      "data.vocab_file": "/nonexistent/vocab.txt"}, r"vocabulary file '/nonexistent/vocab.txt' does not exist"),
])
def test_bad_configs_are_errors_before_the_workdir_is_written(tmp_path, override, message):
  with pytest.raises(FileNotFoundError if "vocab" in message or "init_from" in message else ValueError, match=message):
    train(pretrain_config("runlocal,position=tupe_a", **override), str(tmp_path / "w"))
  assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("workdir", ["file", "file/run"])
def test_a_workdir_that_is_or_is_under_a_file_is_refused_before_anything_is_written(tmp_path, monkeypatch, workdir):
  from posjax import main as main_lib

  (tmp_path / "file").write_text("mine")
  values = dict(config=pretrain_config(), workdir=str(tmp_path / workdir), target=None, aot_data="synthetic",
                coordinator=None, num_processes=1, process_id=0, distributed=False)
  monkeypatch.setattr(main_lib, "_FLAGS", {name: types.SimpleNamespace(value=value) for name, value in values.items()})
  where = "is a file" if workdir == "file" else f"is under the file {tmp_path}/file"
  with pytest.raises(ValueError, match=rf"^--workdir={tmp_path}/{workdir} {where}; --workdir names a directory: a "
                                       r"new one, or a run's to resume$"):
    main_lib.main(["posjax.main"])
  assert (tmp_path / "file").read_text() == "mine"


@pytest.mark.xdist_group("straight")
def test_a_corrected_command_runs_in_the_workdir_of_the_failed_one(tmp_path, straight):
  """The straight run's command, after a mistaken one in its workdir, runs as the straight run did."""
  with pytest.raises(ValueError, match="cls_reset"):
    train(pretrain_config(**NO_DROPOUT, eval_every_steps=0, **{"model.position_options.cls_reset": "bogus"}),
          str(tmp_path))
  assert_same_params(straight[1], train(pretrain_config(**NO_DROPOUT, eval_every_steps=0), str(tmp_path)))


def test_a_failed_config_change_names_the_change_and_leaves_the_run_resumable(tmp_path):
  from posjax.train import validate
  # One's own copy of the corpus, so that another vocabulary may read it.
  own = {}
  for split in ("train", "eval"):
    own[f"data.{split}_files"] = str(tmp_path / f"{split}.txt")
    shutil.copy(f"configs/data/tiny_{split}.txt", own[f"data.{split}_files"])
  vocab = pathlib.Path("configs/data/tiny_vocab.txt").read_text().splitlines()
  (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n")
  (tmp_path / "smaller.txt").write_text("\n".join(vocab[:150]) + "\n")
  own.update({"data.source": "text", "data.vocab_file": str(tmp_path / "vocab.txt")})
  run = tmp_path / "run"
  train(pretrain_config(total_steps=2, eval_every_steps=0, **own), str(run))
  with pytest.raises(ValueError, match=r"checkpoint 2 in \S+ holds parameters of other shapes than this run's model "
                                       r"\(encoder/layer_0/mlp_in/bias: \(128,\) in the checkpoint, \(32,\) "
                                       r"now; 6 changed in all\): resume with the model it was trained "
                                       rf"with, or start another workdir from it with init_from={run} "):
    train(pretrain_config(total_steps=2, eval_every_steps=0, allow_config_change=True,
                          **own, **{"model.intermediate_size": 32}), str(run))
  with pytest.raises(ValueError, match=r"run was trained with the tokenizer \S+vocab.txt \(sha256 \w+\); this "
                                       r"config's \S+smaller.txt is another"):
    train(pretrain_config(total_steps=2, eval_every_steps=0, allow_config_change=True,
                          **{**own, "data.vocab_file": str(tmp_path / "smaller.txt")}), str(run))
  assert json.loads((run / "config.json").read_text())["model"]["intermediate_size"] == 128  # not overwritten
  # another tokenizer of the same size (two pieces swapped) is refused too, allow_config_change or not, and so is a
  # warm start from the run on it, or a run from before the record (its config.json names its file); the same
  # tokenizer moved and saved with CRLF line ends is not
  lines = list(vocab)
  lines[10], lines[11] = lines[11], lines[10]
  (tmp_path / "swapped.txt").write_text("\n".join(lines) + "\n")
  (tmp_path / "moved.txt").write_bytes((tmp_path / "vocab.txt").read_bytes().replace(b"\n", b"\r\n"))  # CRLF
  changed = lambda name, **fields: override(pretrain_config(total_steps=3, eval_every_steps=0, allow_config_change=True,
                                                            **{**own, "data.vocab_file": str(tmp_path / name)}), **fields)
  swapped = rf"was trained with the tokenizer {tmp_path / 'vocab.txt'} \(sha256 \w{{12}}\); this config's \S+swapped"
  with pytest.raises(ValueError, match=rf"{run} {swapped}"):
    validate.check_workdir_config(changed("swapped.txt"), str(run), write=False)
  for field, source in (("init_from", run), ("init", run / "checkpoints")):  # init takes a checkpoint directory too
    with pytest.raises(ValueError, match=rf"{run} \(config.{field}\) {swapped}"):
      validate.check_workdir_config(changed("swapped.txt", **{field: str(source)}), str(tmp_path / "warm"), write=False)
  validate.check_workdir_config(changed("moved.txt"), str(run), write=False)
  os.rename(run / "vocabulary.json", tmp_path / "record.json")
  with pytest.raises(ValueError, match=rf"{run} {swapped}"):
    validate.check_workdir_config(changed("swapped.txt"), str(run), write=False)
  os.rename(tmp_path / "record.json", run / "vocabulary.json")
  train(pretrain_config(total_steps=3, eval_every_steps=0, allow_config_change=True, **own), str(run))
  train(pretrain_config(total_steps=3, eval_every_steps=0, **own), str(run))  # allow_config_change is no change


def test_a_partial_last_metrics_line_is_dropped_on_resume(tmp_path):
  writer = metrics.MetricWriter(str(tmp_path), tensorboard=False)
  for step in (1, 2, 3):
    writer.write(step, {"loss": 1.0})
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 4, "lo')  # killed mid-write
  writer.truncate_after(2)
  assert [line["step"] for line in metrics.read(str(tmp_path))] == [1, 2]


def tensorboard_scalars(workdir):
  import tensorflow as tf  # the writer's own reader
  seen = []
  for path in sorted((workdir / "tensorboard").glob("events.out.tfevents.*")):
    for event in tf.compat.v1.train.summary_iterator(str(path)):
      seen += [(event.step, v.tag, float(tf.make_ndarray(v.tensor))) for v in event.summary.value]
  return seen


def test_tensorboard_after_a_resume_shows_each_step_once(tmp_path):
  # Steps 4 and 5 were logged by a run killed before its next checkpoint; the resumed run logs them again.
  writer = metrics.MetricWriter(str(tmp_path))
  for step in (1, 2, 3, 4, 5):
    writer.write(step, {"loss": float(step)})
  writer.close()
  resumed = metrics.MetricWriter(str(tmp_path))
  resumed.truncate_after(3)
  for step in (4, 5):
    resumed.write(step, {"loss": 10.0 + step})
  resumed.close()
  assert sorted(tensorboard_scalars(tmp_path)) == [(1, "loss", 1.0), (2, "loss", 2.0), (3, "loss", 3.0),
                                                  (4, "loss", 14.0), (5, "loss", 15.0)]


def test_an_error_on_another_process_stops_this_one_with_its_message(monkeypatch):
  # What every process raises when one fails before the first step (validation, the workdir's lock, restoring
  # the state or the input position): its own error there, the failed process's words everywhere else.
  text = b"the saved input position has no entry for shard(s) [1]"

  def two_processes(value):  # process 0 (this one) and a process 1 that failed
    other = np.zeros_like(value)
    other[0], other[1:1 + len(text)] = 1, np.frombuffer(text, np.uint8)
    return np.stack([value, other])

  monkeypatch.setattr(sharding, "per_process", two_processes)
  with pytest.raises(peers.Stopped, match=r"^process 1 stopped: the saved input position has no entry "
                                         r"for shard\(s\) \[1\]$"):
    validate.agree(None)
  with pytest.raises(OSError, match="^mine$"):
    validate.agree(OSError("mine"))


def test_a_resume_with_another_number_of_data_shards_is_refused():
  class Stream:  # one shard's stream: only its id and its restore matter here
    def __init__(self, shard):
      self.shard, self.restored = shard, None

    def restore(self, state):
      self.restored = state

  saved = {"shards": {"0": 3, "1": 5}}  # two shards: a run of two processes with data.num_shards=0
  one = mlm_data.ShardedBatches([Stream(0)], num_shards=1)
  with pytest.raises(ValueError, match=r"input position is for 2 data shards and this run reads 1 \(data.num_shards; "
                                       r"0 is one per process\): its batches would differ"):
    one.restore(saved)
  both = mlm_data.ShardedBatches([Stream(0), Stream(1)], num_shards=2)  # one process reading both shards
  both.restore(saved)
  assert [s.restored for s in both.streams] == [{"blocks_consumed": 3}, {"blocks_consumed": 5}]


def test_runlocal_does_not_mix_its_corpus_with_ones_own(tmp_path):
  own = tmp_path / "own.txt"
  own.write_text("a sentence of my own .\nanother one .\n")
  vocab = tmp_path / "vocab.txt"
  vocab.write_text((ROOT / "configs" / "data" / "tiny_vocab.txt").read_text())
  with pytest.raises(ValueError, match=r"data.eval_files is runlocal's built-in synthetic corpus .* "
                                       r"but data.train_files, data.vocab_file are your own: set "
                                       r"--config.data.eval_files=... to your data as well, or "
                                       r"--config.eval_every_steps=0"):
    train(pretrain_config(**{"data.train_files": str(own), "data.vocab_file": str(vocab)}), str(tmp_path / "w"))
  with pytest.raises(ValueError, match=r"data.eval_files, data.vocab_file are runlocal's built-in"):
    train(pretrain_config(**{"data.train_files": str(own)}), str(tmp_path / "w"))
  assert not (tmp_path / "w").exists()


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
          f"--workdir={workdir}", "--config.total_steps=200", "--config.checkpoint_every_steps=10",
          "--config.log_every_steps=1", "--config.eval_every_steps=50", "--config.batch_size=8",
          "--config.max_len=32", *overrides]


def command_config(command):
  """The config of a ``posjax.main`` command line, parsed as the command parses it (for a run in this process that a
  subprocess of the command must match)."""
  argv = [command[2], *(arg for arg in command[3:] if arg.startswith("--config"))]
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", flag_values=values)
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(sys, "argv", argv)  # config_flags reads its overrides from sys.argv
    values(argv)
  return values.config


def saved_steps(workdir) -> list[int]:
  return sorted(int(p.name) for p in (workdir / "checkpoints").glob("*") if p.name.isdigit())


def saving_steps(workdir) -> list[str]:
  """The checkpoints orbax is writing (their temporary directories)."""
  return sorted(p.name for p in (workdir / "checkpoints").glob("*.orbax-checkpoint-tmp*"))


def interrupt(workdir, sig, *overrides, saving=False, fault=None) -> subprocess.CompletedProcess:
  """Starts the run in ``workdir`` and, once it has saved a new checkpoint (with ``saving``: started writing
  one), sends ``sig`` or calls ``fault()``; waits for the end."""
  before = saved_steps(workdir) if (workdir / "checkpoints").exists() else []
  env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
  process = subprocess.Popen(main_command(workdir, *overrides), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 300
  ready = lambda: (workdir / "checkpoints").exists() and saved_steps(workdir)[-1:] != before[-1:]
  if saving:
    ready = lambda: (workdir / "checkpoints").exists() and saved_steps(workdir)[-1:] != before[-1:] and any(
        int(name.split(".")[0]) > saved_steps(workdir)[-1] for name in saving_steps(workdir))
  while not ready():
    assert process.poll() is None and time.time() < deadline, "the run ended before a new checkpoint"
    time.sleep(0.002 if saving else 0.02)
  if fault is None:
    process.send_signal(sig)
  else:
    fault()
  out, err = process.communicate(timeout=300)
  return subprocess.CompletedProcess(process.args, process.returncode, out, err)


@pytest.fixture
def small_disk(tmp_path):
  """A 64 MB file system of its own (tmpfs; needs root), or None where it cannot be mounted."""
  disk = tmp_path / "disk"
  disk.mkdir()
  mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)], capture_output=True)
  yield disk if mounted.returncode == 0 else None
  if mounted.returncode == 0:
    subprocess.run(["umount", "-l", str(disk)], check=True)


@pytest.mark.slow
def test_faults_each_stop_the_run_and_the_resumes_end_like_the_uninterrupted_run(tmp_path, small_disk):
  """Ctrl-C, SIGTERM, SIGKILL, SIGKILL while a checkpoint is being written, a full disk while saving, a data file
  that cannot be read mid-run: each stops the run (with one line where it says anything), keeps the last complete
  checkpoint, and the same command resumes; the end equals an uninterrupted run."""
  data = tmp_path / "data"
  data.mkdir()
  (data / "train.txt").write_text("".join((DATA / "tiny_train.txt").read_text().splitlines(True)[:100]))
  for name in ("tiny_eval.txt", "tiny_vocab.txt"):
    shutil.copy(DATA / name, data / name)
  own_data = (f"--config.data.train_files={data / 'train.txt'}", f"--config.data.eval_files={data / 'tiny_eval.txt'}",
              f"--config.data.vocab_file={data / 'tiny_vocab.txt'}",  # a short epoch: the file is read again soon
              "--config.total_steps=50", "--config.checkpoint_every_steps=5", "--config.eval_every_steps=25",
              "--config.keep_checkpoints=100")  # none deleted: a full disk stays full
  env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
  subprocess.run(main_command(tmp_path / "straight", *own_data), check=True, cwd=ROOT, env=env, capture_output=True)
  run = (small_disk or tmp_path) / "interrupted"

  ctrl_c = interrupt(run, signal.SIGINT, *own_data)
  assert ctrl_c.returncode == 130 and "Traceback" not in ctrl_c.stderr
  last = re.fullmatch(rf"interrupted at step \d+, last checkpoint: step (\d+) in {run}/checkpoints; rerun the "
                      r"same command to resume", ctrl_c.stderr.strip().splitlines()[-1])
  assert last and int(last.group(1)) == saved_steps(run)[-1] < 50

  preempted = interrupt(run, signal.SIGTERM, *own_data)
  assert preempted.returncode == 0, preempted.stderr[-2000:]
  saved = int(re.search(r"preempted \(SIGTERM\) at step (\d+): checkpoint saved in", preempted.stderr).group(1))
  assert saved == saved_steps(run)[-1] < 50

  killed = interrupt(run, signal.SIGKILL, *own_data)
  assert killed.returncode == -signal.SIGKILL and saved < saved_steps(run)[-1] < 50

  complete = saved_steps(run)[-1]
  killed_saving = interrupt(run, signal.SIGKILL, *own_data, saving=True)
  assert killed_saving.returncode == -signal.SIGKILL and saving_steps(run)  # a checkpoint left half-written
  assert saved_steps(run)[-1] > complete

  text = (data / "train.txt").read_bytes()
  unreadable = interrupt(run, None, *own_data, fault=lambda: (data / "train.txt").write_bytes(b"\xff\xfe\n" * 50))
  assert unreadable.returncode == 2 and "Traceback" not in unreadable.stderr
  assert unreadable.stderr.strip().splitlines()[-1] == (f"error: text file {data / 'train.txt'} is not UTF-8 text "
                                                         "(invalid start byte)")
  (data / "train.txt").write_bytes(text)

  if small_disk is not None:
    filler = small_disk / "filler"

    def fill():
      """Fills the disk but 200 KB while the run writes to it too (a size read first can be gone by the write)."""
      written = 0
      with open(filler, "wb", buffering=0) as f:
        try:
          while True:
            written += f.write(b"\0" * 1_000_000)
        except OSError as error:
          assert error.errno == errno.ENOSPC, error
        f.truncate(max(0, written - 200_000))

    full = interrupt(run, None, *own_data, fault=fill)
    assert full.returncode == 2 and "Traceback" not in full.stderr, full.stderr[-3000:]
    assert re.fullmatch(rf"error: saving checkpoint \d+ in {run}/checkpoints failed \(\[Errno 28\] No space left on "
                        rf"device\); the last complete checkpoint \(step {saved_steps(run)[-1]}\) is kept: fix the "
                        r"storage \(free space, permissions\) and rerun the same command to resume from it",
                        full.stderr.strip().splitlines()[-1]), full.stderr[-3000:]
    assert "orbax" not in full.stderr, full.stderr[-3000:]  # nor its background threads' logs of the error
    filler.unlink()

  subprocess.run(main_command(run, *own_data), check=True, cwd=ROOT, env=env, capture_output=True)
  assert_same_params(checkpoint.load_params(str(tmp_path / "straight" / "checkpoints")),
                     checkpoint.load_params(str(run / "checkpoints")))
  assert stream(str(tmp_path / "straight")) == stream(str(run))
  assert len(stream(str(run))) == 52  # 50 train lines, 2 eval lines, none repeated


def test_position_options_from_the_command_line(monkeypatch):
  """``--config.model.position_options.<option>=`` reaches the model the run builds: TUPE-R with the paper's [CLS]
  reset has its extra θ vectors."""
  from absl import flags
  from ml_collections import config_flags
  from posjax.models import Transformer, TransformerConfig
  argv = ["main", "--config=configs/pretrain.py:runlocal,position=tupe_r",
          "--config.model.position_options.cls_reset=paper"]
  monkeypatch.setattr(sys, "argv", argv)  # config_flags reads its overrides from sys.argv
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", flag_values=values)
  values(argv)
  model = TransformerConfig.from_config(values.config.model, vocab_size=128, max_len=32)
  assert model.position_spec.options.cls_reset == "paper" and model.position_spec.options.relative_distance == "buckets"
  params = jax.eval_shape(Transformer(model, head="mlm").init, jax.random.PRNGKey(0), jnp.ones((1, 8), jnp.int32))
  assert "cls_theta" in params["params"]["encoder"]["position"]  # the paper's extra θ vectors exist


def test_every_position_option_can_be_set_from_the_command_line_none_defaults_included(monkeypatch):
  """Each method's options whose default is None (RoPE's original_max_len, so scaling=llama3; T5's bidirectional;
  the relative methods' max_distance) take a value from ``--config.model.position_options.<option>=``."""
  import dataclasses
  import typing
  from absl import flags
  from ml_collections import config_flags
  from posjax import positions
  examples = {int: ("7", 7), float: ("1.5", 1.5), bool: ("True", True), tuple: ("(1.0,2.0)", (1.0, 2.0))}
  covered = set()
  for name in positions.names():
    options = positions.get(name).options()
    hints = typing.get_type_hints(type(options))
    given, want = [], {}
    for field in dataclasses.fields(options):
      if getattr(options, field.name) is None:
        kind = [t for t in typing.get_args(hints[field.name]) if t is not type(None)][0]
        text, want[field.name] = examples[typing.get_origin(kind) or kind if kind in examples else tuple]
        given.append(f"--config.model.position_options.{field.name}={text}")
    if not given:
      continue
    argv = ["main", f"--config=configs/pretrain.py:position={name},runlocal", *given]
    monkeypatch.setattr(sys, "argv", argv)  # config_flags reads its overrides from sys.argv
    values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", flag_values=values)
    values(argv)
    assert {k: values.config.model.position_options[k] for k in want} == want, name
    covered |= {f"{name}.{k}" for k in want}
  assert {"rope.original_max_len", "rope.short_factor", "t5.bidirectional", "shaw.max_distance"} <= covered


def test_a_warm_start_at_a_longer_length_extends_from_the_base_runs_length(tmp_path):
  """The base run's max_len becomes RoPE's and FIRE's original_max_len where the user left it None; a value given
  stays, and ``dynamic`` (which takes none) and a warm start at the same length are left alone."""
  from posjax.train.validate import carry_training_length
  (tmp_path / "base").mkdir()
  (tmp_path / "base" / "model_config.json").write_text(json.dumps({"max_len": 32}))
  for options, length, original in [(dict(scaling="yarn", factor=4.0), 128, 32),
                                    (dict(scaling="yarn", factor=4.0, original_max_len=64), 128, 64),
                                    (dict(scaling="linear", factor=2.0), 32, None),
                                    (dict(scaling="dynamic", factor=4.0), 128, None)]:
    config = pretrain_config("runlocal,position=rope", init_from=str(tmp_path / "base"), max_len=length,
                             **{f"model.position_options.{k}": v for k, v in options.items()})
    assert carry_training_length(config).model.position_options.original_max_len == original, options
  fire = pretrain_config("runlocal,position=fire", init_from=str(tmp_path / "base"), max_len=128)
  assert carry_training_length(fire).model.position_options.original_max_len == 32  # FIRE keeps its threshold
  # configs/lm.py's warm start takes the base run's model, max_len included: the run's own length is config.max_len
  (tmp_path / "base" / "model_config.json").write_text(json.dumps(TransformerConfig.decoder(max_len=32).to_dict()))
  lm = override(load_config("lm", f"runlocal,init_from={tmp_path / 'base'}"), max_len=128,
                **{"model.position_options.scaling": "yarn", "model.position_options.factor": 4.0})
  assert lm.model.max_len == 32 and carry_training_length(lm).model.position_options.original_max_len == 32
  # a warm start from that run (trained at 128; its model_config.json says its base's 32) extends from 128
  (tmp_path / "base" / "config.json").write_text(json.dumps({"max_len": 128}))
  lm.max_len = 512
  assert carry_training_length(lm).model.position_options.original_max_len == 128


@pytest.mark.parametrize("change, message", [
    ("--config.learning_rat=0.1", 'error: unknown config field --config.learning_rat; Did you mean "learning_rate" '
                                  'instead of "learning_rat"?'),
    ("--config=configs/pretrain.py:runlocal,position=tupe_x", "error: unknown position method 'tupe_x'; allowed: "),
    ("--config=configs/pretrain.py:runlocal,size=huge", "error: unknown size 'huge'; allowed: ['tiny', 'base', "),
    ("--config.batch_size=0", "error: config.batch_size=0 is out of range: it must be a number > 0"),
    ("--config.batch_size=abc", "error: flag --config.batch_size=abc: invalid literal for int()"),
])
def test_a_mistake_in_the_command_is_one_line(tmp_path, change, message):
  command = main_command(tmp_path / "w", change)
  if change.startswith("--config="):
    command[3] = change
  result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
  assert result.returncode == 2
  assert [line for line in result.stderr.splitlines() if line.strip()][-1].startswith(message), result.stderr[-2000:]
  assert "Traceback" not in result.stderr and not (tmp_path / "w").exists()


@pytest.mark.xdist_group("straight")
def test_resume_on_a_different_number_of_devices(tmp_path, straight):
  """The straight run's checkpoint 3 (8 devices) resumed for 3 more steps by a process with 4 devices ends like the
  straight run."""
  workdir, params = straight
  shutil.copytree(workdir, tmp_path / "moved")
  shutil.rmtree(tmp_path / "moved" / "checkpoints" / "6")
  fields = {**NO_DROPOUT, "eval_every_steps": 0, "warmup_steps": 2, "checkpoint_every_steps": 3, "total_steps": 6,
            "allow_config_change": True}
  command = main_command(tmp_path / "moved", *(f"--config.{k}={v}" for k, v in fields.items()))
  command[3] = "--config=configs/pretrain.py:runlocal,position=tupe_r"
  result = subprocess.run(command, cwd=ROOT, env=devices_env(4), capture_output=True, text=True)
  assert result.returncode == 0 and "resumed from step 3" in result.stderr, result.stderr[-2000:]
  assert_same_params(params, checkpoint.load_params(str(tmp_path / "moved" / "checkpoints")), rtol=2e-5, atol=2e-6)


def test_every_bert_config_field_can_be_set_from_the_command_line(tmp_path):
  import dataclasses
  from posjax.models import TransformerConfig
  config = pretrain_config()
  assert {f.name for f in dataclasses.fields(TransformerConfig)} == set(config.model.keys())
  params = train(pretrain_config(**{"model.type_vocab_size": 0, "model.layer_norm_eps": 1e-5,
                                       "weight_decay_exclusion": "none"}, total_steps=1, eval_every_steps=0),
                    str(tmp_path))
  assert "token_type_embeddings" not in params["encoder"]
  with pytest.raises(ValueError, match=r"unknown weight_decay_exclusion 'fairseq'; allowed: \['bert', 'none'\]"):
    train(pretrain_config(weight_decay_exclusion="fairseq"), str(tmp_path / "w"))


def test_weight_decay_exclusion_decides_which_parameters_decay():
  params = {"dense": {"kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)}, "norm": {"scale": jnp.ones(2)}}
  zero_grads = jax.tree.map(jnp.zeros_like, params)
  for exclusion, decayed in [("bert", {"kernel"}), ("none", {"kernel", "bias", "scale"})]:
    config = pretrain_config(learning_rate=1.0, warmup_steps=0, weight_decay=0.5, weight_decay_exclusion=exclusion)
    optimizer, _ = make_optimizer(config)
    updates, _ = optimizer.update(zero_grads, optimizer.init(params), params)
    moved = {jax.tree_util.keystr(p).split("'")[-2] for p, u in jax.tree_util.tree_leaves_with_path(updates)
             if np.abs(u).max() > 0}
    assert moved == decayed, exclusion


@pytest.mark.xdist_group("straight")
def test_a_checkpoint_starts_a_run_of_the_other_layer_layout_and_refuses_to_resume_in_it(tmp_path, straight):
  common = {"model.dropout_rate": 0.0, "model.attention_dropout_rate": 0.0, "eval_every_steps": 0,
            "checkpoint_every_steps": 1}
  unrolled = shutil.copytree(straight[0], tmp_path / "unrolled")  # the straight run's per-layer checkpoints
  with pytest.raises(ValueError, match=r"checkpoint 6 in \S+ holds its layers per-layer, this run's model scanned "
                                       r"\(model.scan_layers=True\): resume with model.scan_layers=False, or start "
                                       r"another workdir from it with init_from="):
    train(pretrain_config(**common, total_steps=7, allow_config_change=True, **{"model.scan_layers": True}),
          str(unrolled))
  # A zero learning rate keeps the warm start's parameters: the checkpoint's, stacked.
  scanned = train(pretrain_config(**common, total_steps=1, learning_rate=0.0, init_from=str(unrolled),
                                  **{"model.scan_layers": True}), str(tmp_path / "scanned"))
  assert_same_params(layout.stack(straight[1]), scanned)
  # layers of two kinds scan in groups of two: a checkpoint of single layers says how to go on
  with pytest.raises(ValueError, match=r"checkpoint 1 in \S+ scans its layers in groups of 1 kinds, this run's model "
                                       r"in groups of 2 \(its layers' kinds changed\): start another workdir"):
    train(pretrain_config(**common, total_steps=2, allow_config_change=True,
                          **{"model.scan_layers": True, "model.layer_windows": "4,0"}), str(tmp_path / "scanned"))
