"""ELECTRA runs on the one training loop: their metrics (metrics.jsonl and TensorBoard), checkpoints holding both
models, fine-tuning that starts from the discriminator, and a run that died resuming to the uninterrupted result."""

import json
import logging
import shutil

import numpy as np
import pytest

from posjax.main import train
from posjax.models.electra import ElectraConfig
from posjax.train import checkpoint, metrics
from conftest import load_config, override
from test_finetune_train import assert_same_run, finetune_config
from test_train import assert_same_params, tensorboard_scalars

pytestmark = pytest.mark.xdist_group("electra_run")  # every test reads the module fixture's run: one worker makes it

STEP_METRICS = ("loss", "mlm_loss", "mlm_accuracy", "sampled_accuracy", "disc_loss", "disc_accuracy",
                "disc_precision", "disc_recall", "replaced_fraction")
FIELDS = dict(total_steps=4, warmup_steps=1, log_every_steps=1, eval_every_steps=2, checkpoint_every_steps=2,
              batch_size=8, max_len=32, tensorboard=True)


def electra_config(**overrides):
  config = load_config("electra", "runlocal,position=tupe_a")
  config.update(FIELDS)
  config.evals.eval.batches = 2
  return override(config, **overrides)


@pytest.fixture(scope="module")
def electra_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("electra")
  train(electra_config(), str(workdir))
  return workdir


def test_an_electra_run_logs_both_models_metrics_and_keeps_both_models(electra_run):
  lines = metrics.read(str(electra_run))
  train_lines = [line for line in lines if "mlm_loss" in line]
  assert [line["step"] for line in train_lines] == [1, 2, 3, 4]
  for line in train_lines:
    assert set(STEP_METRICS) <= set(line)
    assert 0 <= line["disc_precision"] <= 1 and 0 <= line["disc_recall"] <= 1
    np.testing.assert_allclose(line["loss"], line["mlm_loss"] + 50 * line["disc_loss"], rtol=1e-4)
  evals = [line for line in lines if "eval_disc_loss" in line]
  assert [line["step"] for line in evals] == [2, 4]
  assert {f"eval_{name}" for name in STEP_METRICS} <= set(evals[-1])
  tags = {tag for _, tag, _ in tensorboard_scalars(electra_run)}
  assert {"disc_loss", "disc_precision", "disc_recall", "mlm_loss", "eval_disc_accuracy"} <= tags
  params = checkpoint.load_params(str(electra_run / "checkpoints"), 4)
  assert set(params) == {"encoder", "generator", "generator_head", "rtd", "rtd_output"}
  config = ElectraConfig.from_dict(json.loads((electra_run / "model_config.json").read_text()))
  assert (config.discriminator.hidden_size, config.generator.hidden_size) == (64, 32)
  assert config.generator.position == config.discriminator.position == "tupe_a"
  assert "position" in params["generator"]  # TUPE's projections are each model's own
  results = json.loads((electra_run / "results.json").read_text())
  assert results["task"] == "electra" and "disc_recall" in results["metrics"]["eval"]


def test_finetuning_from_an_electra_run_starts_from_its_discriminator(electra_run, tmp_path, caplog):
  caplog.set_level(logging.INFO)
  params = train(finetune_config("glue", "task=sst2,runlocal", total_steps=1, learning_rate=0.0, max_len=32,
                                 init=str(electra_run), init_step=2), str(tmp_path / "ft"))
  assert_same_params(params["encoder"], checkpoint.load_params(str(electra_run / "checkpoints"), 2)["encoder"])
  assert "the generator (generator, generator_head) is dropped" in caplog.text
  model = json.loads((tmp_path / "ft" / "model_config.json").read_text())
  discriminator = json.loads((electra_run / "model_config.json").read_text())
  discriminator.pop("generator")
  assert model == {**discriminator, "attention_kernel": "xla", "dtype": "float32"}


def test_an_electra_run_that_died_resumes_to_the_uninterrupted_result(electra_run, tmp_path):
  """The fixture's run, as if it died while saving its last checkpoint (checkpoint 2 its last complete one, its
  lines up to step 4 written, no results), and rerun: the samples, dropout and batches after the resume are the
  uninterrupted run's."""
  died = shutil.copytree(electra_run, tmp_path / "died")
  shutil.rmtree(died / "checkpoints" / "4")
  (died / "results.json").unlink()
  train(electra_config(), str(died))
  assert_same_run(electra_run, died)
  assert json.loads((electra_run / "results.json").read_text()) == json.loads((died / "results.json").read_text())
