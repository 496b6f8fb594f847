"""Fine-tuning on the one training loop: every task type learns, runs resume exactly, runs start from a
pre-training run as they should, and bad input fails before the workdir is written."""

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from posjax.data import features
from posjax.finetune import init as init_lib
from posjax.main import train
from posjax.train import checkpoint, metrics, validate
from conftest import ROOT, load_config, override
from test_train import assert_same_params, flat_params, saved_steps


def finetune_config(name, arg, **overrides):
  return override(load_config(f"finetune/{name}", arg), **overrides)


def pretrain(workdir, position="shaw", steps=2):
  config = load_config("pretrain", f"runlocal,position={position}")
  config.update(total_steps=steps, warmup_steps=1, checkpoint_every_steps=1, eval_every_steps=0, batch_size=8,
                max_len=64)
  train(config, str(workdir))
  return workdir


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
  """A two-step Shaw pre-training run (checkpoints 1 and 2) that the tests below start from; a test that changes it
  copies it first."""
  return pretrain(tmp_path_factory.mktemp("pretrain") / "run")


def train_losses(workdir):
  return [line["loss"] for line in metrics.read(str(workdir)) if "loss" in line]


def assert_lowers_its_loss(workdir, task, steps=60):
  losses = train_losses(workdir)
  assert len(losses) == steps and np.mean(losses[-8:]) < 0.8 * np.mean(losses[:8]), losses
  results = json.loads((workdir / "results.json").read_text())
  assert (results["task"], results["step"]) == (task, steps)


def test_regression_lowers_its_loss(tmp_path):  # classification: sst2_run; span extraction: squad_run
  # 30 steps: the last 8 losses 0.55 of the first 8 (60 steps: 0.30)
  train(finetune_config("glue", "task=stsb,runlocal", total_steps=30, log_every_steps=1, eval_every_steps=30),
        str(tmp_path))
  assert_lowers_its_loss(tmp_path, "glue/stsb", steps=30)


SQUAD_STEPS = 40


@pytest.fixture(scope="module")
def squad_run(tmp_path_factory):
  """SQuAD, 40 steps of the absolute method, evaluated at 64 and 128 tokens (beyond its table) at the end (40 steps:
  the last 8 losses 0.65 of the first 8)."""
  workdir = tmp_path_factory.mktemp("squad") / "absolute"
  with contextlib.redirect_stderr(io.StringIO()) as said:  # the lines for the terminal, kept beside the run
    train(finetune_config("squad", "runlocal,eval_max_lens=64+128", total_steps=SQUAD_STEPS, log_every_steps=1,
                          eval_every_steps=SQUAD_STEPS), str(workdir))
  (workdir.parent / "said.txt").write_text(said.getvalue())
  return workdir


@pytest.mark.xdist_group("squad_run")
def test_span_extraction_lowers_its_loss(squad_run):
  assert_lowers_its_loss(squad_run, "squad", steps=SQUAD_STEPS)


SST2_RUN = dict(checkpoint_every_steps=10, log_every_steps=1)


@pytest.fixture(scope="module")
def sst2_run(tmp_path_factory):
  """An SST-2 run (60 steps, seed 3) with a test split holding the dev sentences, which three tests read."""
  root = tmp_path_factory.mktemp("sst2")
  glue_dir = root / "glue"
  shutil.copytree(ROOT / "configs" / "data" / "glue" / "SST-2", glue_dir / "SST-2")
  dev = [line.split("\t")[1:] for line in (glue_dir / "SST-2" / "dev.tsv").read_text().splitlines()[1:]]
  (glue_dir / "SST-2" / "test.tsv").write_text("index\tsentence\n" + "".join(
      f"{i}\t{sentence}\n" for i, (sentence, _) in enumerate(dev)))
  config = lambda: finetune_config("glue", "task=sst2,runlocal,seed=3", **SST2_RUN,  # noqa: E731
                                   **{"data.data_dir": str(glue_dir)})
  train(config(), str(root / "run"))
  return root / "run", config, dev


@pytest.mark.xdist_group("sst2_run")
def test_classification_learns_the_made_up_signal_and_results_say_what_ran(sst2_run):
  workdir, _, _ = sst2_run
  assert_lowers_its_loss(workdir, "glue/sst2")
  results = json.loads((workdir / "results.json").read_text())
  assert results["metrics"]["sst2"]["accuracy"] >= 90.0
  assert {k: results[k] for k in ("task", "step", "seed", "learning_rate", "init", "init_step", "position")} == {
      "task": "glue/sst2", "step": 60, "seed": 3, "learning_rate": 1e-3, "init": None, "init_step": None,
      "position": "absolute"}
  # TUPE's protocol: two evaluations an epoch (120 examples / batch 16), all kept, the best by accuracy reported.
  steps = [e["step"] for e in results["evaluations"]]
  assert steps == [4, 8, 11, 15, 19, 23, 26, 30, 34, 38, 41, 45, 49, 53, 56, 60]
  assert [line["step"] for line in metrics.read(str(workdir)) if "sst2_accuracy" in line] == steps
  best = max(results["evaluations"], key=lambda e: (e["metrics"]["sst2"]["accuracy"], -e["step"]))
  assert (results["select"], results["select_metric"]) == ("best", "sst2/accuracy")
  assert results["selected_step"] == best["step"] and results["metrics"] == best["metrics"]
  logged = [json.loads(line) for line in (workdir / "evaluations.jsonl").read_text().splitlines()]
  assert logged == results["evaluations"]


@pytest.mark.xdist_group("sst2_run")
def test_test_set_predictions_are_the_reported_evaluations_in_the_glue_servers_format(sst2_run):
  # The test split holds the dev sentences: the written predictions must score exactly what results.json reports
  # (the best evaluation, not the last model).
  workdir, _, dev = sst2_run
  results = json.loads((workdir / "results.json").read_text())
  lines = (workdir / "glue_test" / "SST-2.tsv").read_text().splitlines()
  assert lines[0] == "index\tprediction" and [line.split("\t")[0] for line in lines[1:]] == [str(i) for i in range(len(dev))]
  predicted = [line.split("\t")[1] for line in lines[1:]]
  accuracy = 100 * np.mean([p == label for p, (_, label) in zip(predicted, dev)])
  assert accuracy == pytest.approx(results["metrics"]["sst2"]["accuracy"])
  assert results["selected_step"] != results["step"] or len({e["metrics"]["sst2"]["accuracy"]
                                                               for e in results["evaluations"]}) == 1


def test_mnli_reports_matched_and_mismatched(tmp_path):
  train(finetune_config("glue", "task=mnli,runlocal", total_steps=1), str(tmp_path))
  results = json.loads((tmp_path / "results.json").read_text())["metrics"]
  assert set(results) == {"mnli_matched", "mnli_mismatched"} and all("accuracy" in r for r in results.values())


@pytest.mark.xdist_group("squad_run")
def test_squad_writes_predictions_and_marks_lengths_a_learned_table_cannot_reach(tmp_path, squad_run):
  results = json.loads((squad_run / "results.json").read_text())["metrics"]
  assert results["squad@128"] == {"exact_match": "unsupported", "f1": "unsupported"}
  said = (squad_run.parent / "said.txt").read_text()  # and the run said why, before training
  assert ("\nsquad@128: unsupported (position method 'absolute' has a learned table of max_len=64 positions and "
          "cannot encode a sequence of length 128;") in said
  assert set(results["squad@64"]) == {"exact_match", "f1"}
  predictions = json.loads((squad_run / "predictions_squad@64.json").read_text())
  dev = json.loads((ROOT / "configs" / "data" / "squad" / "dev-v1.1.json").read_text())
  ids = {qa["id"] for article in dev["data"] for p in article["paragraphs"] for qa in p["qas"]}
  assert set(predictions) == ids and all(isinstance(text, str) for text in predictions.values())
  nbest = json.loads((squad_run / "nbest_predictions_squad@64.json").read_text())
  assert set(nbest) == ids and all(nbest[i][0]["text"] == predictions[i] for i in ids)
  assert all(abs(sum(a["probability"] for a in answers) - 1) < 1e-6 and len({a["text"] for a in answers}) == len(answers)
             and len(answers) <= 20 for answers in nbest.values())

  train(finetune_config("squad", "runlocal,eval_max_lens=64+128,position=shaw", total_steps=1),
           str(tmp_path / "shaw"))
  results = json.loads((tmp_path / "shaw" / "results.json").read_text())["metrics"]
  assert all(isinstance(v, float) for r in results.values() for v in r.values())


class Died(Exception):
  """Stands in for the death of a run's process (its tests compare what it left and what a rerun makes of it)."""


def stopped_and_resumed(monkeypatch, config, workdir, stop_at: int):
  """Trains ``config`` in ``workdir``, dying as step ``stop_at`` ends (checkpoints and the metrics lines logged
  before it kept, the state after the last checkpoint lost), then trains the same config there again."""
  push = metrics.DelayedMetrics.push

  def dying(self, step, values):
    if step == stop_at:
      raise Died(f"died at step {step}")
    return push(self, step, values)

  with monkeypatch.context() as patch:
    patch.setattr(metrics.DelayedMetrics, "push", dying)
    with pytest.raises(Died):
      train(config(), str(workdir))
  assert 0 < saved_steps(workdir)[-1] < stop_at and not (workdir / "results.json").exists()
  train(config(), str(workdir))


def assert_same_run(straight, resumed):
  """The same final parameters and the same metrics lines (throughput aside), none repeated."""
  assert_same_params(checkpoint.load_params(str(straight / "checkpoints")),
                     checkpoint.load_params(str(resumed / "checkpoints")))
  deterministic = lambda w: [{k: v for k, v in line.items() if k != "tokens_per_second"} for line in metrics.read(str(w))]
  assert deterministic(straight) == deterministic(resumed)


@pytest.mark.xdist_group("sst2_run")
def test_a_finetuning_run_that_died_resumes_to_the_uninterrupted_result(sst2_run, tmp_path, monkeypatch):
  """Died after step 13 (lines past checkpoint 10 written): the rerun restores the state, the example stream and the
  evaluation log at step 10 and ends with the uninterrupted run's parameters, metrics, results and predictions.
  (A process killed by a real signal: tests/test_train.py's faults test.)"""
  straight, config, _ = sst2_run
  stopped_and_resumed(monkeypatch, config, tmp_path, stop_at=13)
  assert_same_run(straight, tmp_path)
  assert json.loads((straight / "results.json").read_text()) == json.loads((tmp_path / "results.json").read_text())
  assert (straight / "glue_test" / "SST-2.tsv").read_text() == (tmp_path / "glue_test" / "SST-2.tsv").read_text()


@pytest.mark.xdist_group("pretrained")
def test_init_takes_the_encoder_model_and_vocabulary_of_the_pretraining_run(tmp_path, pretrained, capfd):
  # Learning rate 0: the fine-tuned encoder is the pre-trained one, step 1 of the two kept.
  params = train(finetune_config("glue", "task=sst2,runlocal", total_steps=1, learning_rate=0.0,
                                    init=str(pretrained), init_step=1), str(tmp_path / "ft"))
  assert f"fine-tuning from {pretrained} (step 1): its encoder (shaw) and vocabulary\n" in capfd.readouterr().err
  loaded = checkpoint.load_params(str(pretrained / "checkpoints"), 1)["encoder"]
  assert_same_params(params["encoder"], loaded)
  assert not np.allclose(flat_params(loaded)["['word_embeddings']['embedding']"],
                         flat_params(checkpoint.load_params(str(pretrained / "checkpoints"), 2)["encoder"])[
                             "['word_embeddings']['embedding']"])
  model = json.loads((tmp_path / "ft" / "model_config.json").read_text())
  assert model == {**json.loads((pretrained / "model_config.json").read_text()), "attention_kernel": "xla",
                   "dtype": "float32"}
  results = json.loads((tmp_path / "ft" / "results.json").read_text())
  assert (results["init"], results["init_step"], results["position"]) == (str(pretrained), 1, "shaw")


@pytest.mark.xdist_group("pretrained")
def test_an_unfinished_pretraining_run_is_an_error_unless_init_step_names_a_step(tmp_path, pretrained):
  pretrained = shutil.copytree(pretrained, tmp_path / "pretrain")
  (pretrained / "results.json").unlink()  # as if killed by its wall-clock limit after step 1's checkpoint
  shutil.rmtree(pretrained / "checkpoints" / "2")
  with pytest.raises(ValueError, match=r"did not finish \(no results.json; last kept step 1 of total_steps=2\); "
                                       r"resume it, or set config.init_step=1"):
    train(finetune_config("glue", "task=sst2,runlocal", init=str(pretrained)), str(tmp_path / "a"))
  assert not (tmp_path / "a").exists()
  # init_step named: the run starts from that step (a fine-tuning that starts from a named step: the test above)
  start = init_lib.find(finetune_config("glue", "task=sst2,runlocal", init=str(pretrained), init_step=1))
  assert (start.workdir, start.step) == (str(pretrained), 1)


def test_a_run_sized_in_epochs_without_results_counts_as_unfinished(tmp_path):
  import ml_collections

  (tmp_path / "checkpoints" / "5").mkdir(parents=True)
  (tmp_path / "config.json").write_text(json.dumps({"total_steps": 1_000_000, "total_epochs": 3.0}))
  with pytest.raises(ValueError, match=r"did not finish \(no results.json; last kept step 5 of total_steps=None\)"):
    init_lib.find(ml_collections.ConfigDict({"init": str(tmp_path), "init_step": None}))


@pytest.mark.xdist_group("pretrained")
def test_a_position_change_needs_allow_position_change_and_starts_those_parameters_fresh(tmp_path, pretrained):
  # step 1 has learning rate 0: the table moves at step 2
  with pytest.raises(ValueError, match=r"init run .* uses position 'shaw'.* asks for 'huang_m4'.*allow_position_change"):
    train(finetune_config("glue", "task=sst2,runlocal,position=huang_m4", init=str(pretrained)), str(tmp_path / "a"))
  with pytest.raises(ValueError, match=r"asks for 'shaw' with \{'max_distance': 4"):
    train(finetune_config("glue", "task=sst2,runlocal", **{"model.position": "shaw",
                                                                "model.position_options": {"max_distance": 4}},
                             init=str(pretrained)), str(tmp_path / "a"))
  assert not (tmp_path / "a").exists()
  params = train(finetune_config("glue", "task=sst2,runlocal,position=huang_m4", total_steps=1, learning_rate=0.0,
                                    init=str(pretrained), allow_position_change=True), str(tmp_path / "b"))
  loaded = flat_params(checkpoint.load_params(str(pretrained / "checkpoints"))["encoder"])
  mine = flat_params(params["encoder"])
  table = "['layer_0']['attention']['position']['key']"
  assert mine[table].shape == loaded[table].shape and not np.allclose(mine[table], loaded[table])
  query = "['layer_0']['attention']['query']['kernel']"
  np.testing.assert_array_equal(mine[query], loaded[query])


@pytest.mark.xdist_group("pretrained")
@pytest.mark.parametrize("change, error, message", [
    (dict(init="/nonexistent/run"), FileNotFoundError, r"config.init='/nonexistent/run' holds no checkpoint"),
    (dict(init="PRETRAIN", init_step=7), ValueError, r"config.init_step=7 was not kept in .*; kept steps: \[1, 2\]"),
    (dict(init="PRETRAIN", **{"model.hidden_size": 32}), ValueError,
     r"config.model.hidden_size=32, but the init run .* has hidden_size=64"),
    (dict(init_step=1), ValueError, r"config.init_step=1 needs config.init"),
    ({"data.glue_task": "glue9"}, ValueError, r"unknown GLUE task 'glue9'; allowed: \['cola', 'sst2'"),
    ({"data.data_dir": "/nonexistent"}, FileNotFoundError, r"GLUE sst2 train: no file /nonexistent/SST-2/train.tsv"),
    ({"evals.sst2.kind": "squad"}, ValueError, r"config.evals.sst2.kind='squad' does not fit task 'glue'"),
    ({"evals.sst2.split": "test"}, ValueError, r"sst2 has no split 'test'; allowed: \['train', 'validation'\]"),
    (dict(warmup_fraction=1.5), ValueError, r"config.warmup_fraction=1.5 is out of range: it must be a number in"),
])
def test_bad_finetuning_input_is_an_error_before_the_workdir_is_written(tmp_path, pretrained, change, error, message):
  if change.get("init") == "PRETRAIN":
    change["init"] = str(pretrained)
  with pytest.raises(error, match=message):
    train(finetune_config("glue", "task=sst2,runlocal", **change), str(tmp_path / "w"))
  assert not (tmp_path / "w").exists()


def test_bad_data_files_name_the_file_line_and_value(tmp_path):
  root = tmp_path / "glue" / "SST-2"
  root.mkdir(parents=True)
  (root / "train.tsv").write_text("sentence\tlabel\na fine film .\t1\nawful .\tmaybe\n")
  (root / "dev.tsv").write_text("sentence\tlabel\nfine .\t1\n")
  with pytest.raises(ValueError, match=r"train.tsv:3: sst2 label 'maybe' is not one of \['0', '1'\]"):
    train(finetune_config("glue", "task=sst2,runlocal", **{"data.data_dir": str(tmp_path / "glue")}),
             str(tmp_path / "w"))
  broken = tmp_path / "train.json"
  broken.write_text('{"data": [{"paragraphs": [{"qas": [{"id": "a", "question": "q", "answers": []}]}]}]}')
  with pytest.raises(ValueError, match=rf"SQuAD file {broken} is not in the official v1.1 format \(KeyError: 'context'"):
    train(finetune_config("squad", "runlocal", **{"data.train_file": str(broken)}), str(tmp_path / "w"))
  long_question = tmp_path / "long.json"
  long_question.write_text(json.dumps({"data": [{"paragraphs": [{"context": "the cat sat .", "qas": [
      {"id": "q1", "question": "what " * 80, "answers": [{"text": "cat", "answer_start": 4}]}]}]}]}))
  with pytest.raises(ValueError, match=r"question 'q1': 64 tokens leave no room for context in max_len=64"):
    train(finetune_config("squad", "runlocal", **{"data.train_file": str(long_question)}), str(tmp_path / "w"))
  assert not (tmp_path / "w").exists()


def test_the_commands_of_the_readme_run_and_report(tmp_path):
  out = subprocess.run([sys.executable, "-m", "posjax.main", "--config=configs/finetune/glue.py:task=rte,runlocal",
                        f"--workdir={tmp_path}", "--config.total_steps=2"], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
  assert out.returncode == 0, out.stderr[-2000:]
  assert f"results in {tmp_path}/results.json" in out.stderr
  # What the numbers mean: a run from scratch, on made-up data, beside the dev set's majority class.
  labels = [line.split("\t")[-1] for line in (ROOT / "configs/data/glue/RTE/dev.tsv").read_text().splitlines()[1:]]
  majority = max(set(labels), key=labels.count)
  assert ("fine-tuning from scratch: no config.init, so the encoder (absolute) starts from random weights; "
          "--config.init=PRETRAIN_WORKDIR starts it from a pre-training run\n") in out.stderr
  assert "a tiny run on them shows that the pipeline runs, not what a position method does\n" in out.stderr
  assert (f"rte: {len(labels)} examples; always answering the most frequent label ({majority}) scores "
          f"{100 * labels.count(majority) / len(labels):.1f} accuracy\n") in out.stderr
  finished = [line for line in out.stderr.replace("\r", "\n").splitlines() if "100%|" in line]
  assert len(finished) == 1 and " 2/2 " in finished[0], finished  # the bar's last line once, when it closes
  bad = subprocess.run([sys.executable, "-m", "posjax.main", "--config=configs/finetune/glue.py:task=rtee,runlocal",
                        f"--workdir={tmp_path}/x"], cwd=ROOT, capture_output=True, text=True)
  assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("error: unknown GLUE task 'rtee'")


def test_example_stream_visits_each_example_once_per_epoch_and_restores_in_place():
  rows = [{"input_ids": np.arange(1, 2 + i % 5, dtype=np.int32), "label": np.int32(i)} for i in range(10)]
  stream_ = features.ExampleBatches(rows, global_batch=4, max_len=8, pad_id=0, seed=0)
  labels = np.concatenate([next(stream_)["label"] for _ in range(5)])  # 20 examples: two epochs
  assert sorted(labels[:10]) == list(range(10)) and sorted(labels[10:]) == list(range(10))
  assert list(labels[:10]) != list(labels[10:])  # reshuffled
  restored = features.ExampleBatches(rows, global_batch=4, max_len=8, pad_id=0, seed=0)
  restored.restore({"examples_consumed": 8})
  again = features.ExampleBatches(rows, global_batch=4, max_len=8, pad_id=0, seed=0)
  for _ in range(2):
    next(again)
  for _ in range(3):
    a, b = next(restored), next(again)
    assert all(np.array_equal(a[k], b[k]) for k in a)
  batch = next(features.ExampleBatches(rows, global_batch=4, max_len=8, pad_id=0, seed=1))
  lengths = batch["attention_mask"].sum(1)
  assert np.array_equal(lengths, [1 + int(i) % 5 for i in batch["label"]]) and np.all(batch["weight"] == 1)
  assert np.all(batch["input_ids"][np.arange(8)[None] >= lengths[:, None]] == 0)


def test_eval_batches_cover_every_example_once_with_weightless_padding():
  rows = [{"input_ids": np.ones(3, np.int32), "label": np.int32(i)} for i in range(10)]
  batches = features.eval_batches(rows, global_batch=4, max_len=5, pad_id=0)
  index = np.concatenate([b["index"] for b in batches])
  weight = np.concatenate([b["weight"] for b in batches])
  assert list(index) == list(range(10)) + [-1, -1] and list(weight) == [1.0] * 10 + [0.0, 0.0]


def test_position_parameters_are_recognised_by_their_module():
  assert init_lib.is_position_parameter("encoder/layer_3/attention/position/key")
  assert init_lib.is_position_parameter("encoder/position/table/embedding")
  assert not init_lib.is_position_parameter("encoder/layer_3/attention/query/kernel")


@pytest.mark.parametrize("name, arg", [("glue", "task=mrpc,runlocal,source=tfds"), ("squad", "runlocal,source=tfds")])
def test_training_reads_tfds(tmp_path, name, arg):
  import tensorflow_datasets as tfds

  with tfds.testing.mock_data(num_examples=6):
    # The mock's random answers are not at their answer_start: SQuAD trains on them anyway here.
    extra = {"data.skip_misplaced_answers": False} if name == "squad" else {}
    train(finetune_config(name, arg, total_steps=1, batch_size=8, eval_batch_size=8, **extra), str(tmp_path))
  results = json.loads((tmp_path / "results.json").read_text())["metrics"]
  assert set(results) == ({"mrpc"} if name == "glue" else {"squad@64", "squad@128"})


def test_epochs_and_warmup_fraction_become_steps():
  config = finetune_config("glue", "task=sst2,runlocal", total_steps=None, total_epochs=2.0)
  resolved = validate.resolve_durations(config, examples_per_epoch=120)
  assert (resolved.total_steps, resolved.warmup_steps) == (15, 1)  # 240 examples / 16; 6% of 15 steps
  resolved = validate.resolve_durations(finetune_config("glue", "task=sst2", total_epochs=3.0), examples_per_epoch=3000)
  assert (resolved.total_steps, resolved.warmup_steps) == (282, 17)  # ceil(9000 / 32); round(0.06 * 282)


@pytest.mark.xdist_group("sst2_run")
def test_a_run_killed_before_its_results_evaluates_its_last_checkpoint_on_restart(tmp_path, sst2_run):
  straight, config, _ = sst2_run
  run = shutil.copytree(straight, tmp_path / "run")
  first = json.loads((run / "results.json").read_text())
  (run / "results.json").unlink()
  train(config(), str(run))
  assert json.loads((run / "results.json").read_text()) == first
