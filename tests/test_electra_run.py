"""ELECTRA runs on the one training loop: their metrics (metrics.jsonl and TensorBoard), checkpoints holding both
models, fine-tuning that starts from the discriminator, a run that died resuming to the uninterrupted result, and
``python -m posjax.convert``: the run becomes a Hugging Face generator and discriminator equal to its ``Electra``, and
those directories come back through ``hf-to-posjax`` and out again as ELECTRA."""

import json
import logging
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posjax import tasks
from posjax.convert import __main__ as cli
from posjax.data.tokenizer import Tokenizer
from posjax.main import train
from posjax.models.electra import Electra, ElectraConfig
from posjax.train import checkpoint, metrics, validate
from conftest import load_config, override
from test_finetune_train import assert_same_run, finetune_config
from test_train import assert_same_params, tensorboard_scalars

pytestmark = pytest.mark.xdist_group("electra_run")  # every test reads the module fixture's run: one worker makes it

STEP_METRICS = ("loss", "mlm_loss", "mlm_accuracy", "sampled_accuracy", "disc_loss", "disc_accuracy",
                "disc_precision", "disc_recall", "replaced_fraction")
FIELDS = dict(total_steps=4, warmup_steps=1, log_every_steps=1, eval_every_steps=2, checkpoint_every_steps=2,
              batch_size=8, max_len=32, tensorboard=True)


def electra_config(position="absolute", **overrides):
  """The module's run (absolute positions, ELECTRA's: what a Hugging Face ELECTRA holds)."""
  config = load_config("electra", f"runlocal,position={position}")
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
  assert config.generator.position == config.discriminator.position == "absolute"
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


def test_the_recipes_position_method_is_both_models(tmp_path):
  """``configs/electra.py:position=tupe_a``: the generator and the discriminator both TUPE-A, TUPE's projections each
  model's own (the run's model, initialised abstractly)."""
  prepared = validate.validate(electra_config("tupe_a"), str(tmp_path), tasks.build)
  configs = prepared.task.model_config
  assert configs.generator.position == configs.discriminator.position == "tupe_a"
  params = jax.eval_shape(lambda rng: nn.unbox(prepared.init_boxed(rng)), prepared.init_rng).params
  assert "position" in params["generator"]


@pytest.fixture(scope="module")
def exported(electra_run, tmp_path_factory):
  """The run's ``posjax-to-hf`` export, and Hugging Face's transformers (the test is skipped without it)."""
  pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  out = tmp_path_factory.mktemp("hf")
  assert cli.main(["posjax-to-hf", "--workdir", str(electra_run), "--out", str(out)]) == 0
  return out, transformers


def test_an_electra_run_becomes_a_hugging_face_generator_and_discriminator_equal_to_it(electra_run, exported):
  from test_convert import inputs, run_hf
  out, transformers = exported
  config = ElectraConfig.from_dict(checkpoint.read_model_config(str(electra_run)))
  params = checkpoint.load_params(str(electra_run))
  generator = transformers.ElectraForMaskedLM.from_pretrained(out / "generator").eval()
  discriminator = transformers.ElectraForPreTraining.from_pretrained(out / "discriminator").eval()
  ids, types, mask = inputs(vocab=config.discriminator.vocab_size)
  real = np.tile(np.arange(7), (2, 1))  # the tokens that both rows have (the second is padded after 7)
  module = Electra(config.generator, config.discriminator)
  kwargs = dict(token_type_ids=jnp.asarray(types), attention_mask=jnp.asarray(mask))
  generated = module.apply({"params": params}, jnp.asarray(ids), jnp.asarray(real), method=Electra.generate,
                           **kwargs)
  replaced = module.apply({"params": params}, jnp.asarray(ids), method=Electra.discriminate, **kwargs)
  np.testing.assert_allclose(run_hf(generator, ids, types, mask).logits.numpy()[:, :7], np.asarray(generated),
                             rtol=0, atol=1e-4)
  np.testing.assert_allclose(run_hf(discriminator, ids, types, mask).logits.numpy(), np.asarray(replaced), rtol=0,
                             atol=1e-4)
  cls_id = Tokenizer.load(checkpoint.vocab_file_of(str(electra_run))).cls_id
  for name in ("generator", "discriminator"):
    assert transformers.AutoTokenizer.from_pretrained(out / name).convert_tokens_to_ids("[CLS]") == cls_id


@pytest.mark.parametrize("name, cls", [("generator", "ElectraForMaskedLM"), ("discriminator", "ElectraForPreTraining")])
def test_hugging_face_electra_directories_convert_to_posjax_runs_and_back_as_electra(exported, tmp_path, name, cls):
  from test_convert import inputs, run_hf
  out, transformers = exported
  hf = getattr(transformers, cls).from_pretrained(out / name).eval()
  assert cli.main(["hf-to-posjax", "--from", str(out / name), "--workdir", str(tmp_path / "run")]) == 0
  assert json.loads((tmp_path / "run" / cli.CONVERTED_FROM).read_text())["model_type"] == "electra"
  assert (tmp_path / "run" / "vocab.txt").is_file()
  assert cli.main(["posjax-to-hf", "--workdir", str(tmp_path / "run"), "--out", str(tmp_path / "back")]) == 0
  assert json.loads((tmp_path / "back" / "config.json").read_text())["architectures"] == [cls]
  back = getattr(transformers, cls).from_pretrained(tmp_path / "back").eval()
  ids, types, mask = inputs(vocab=hf.config.vocab_size)
  np.testing.assert_allclose(run_hf(back, ids, types, mask).logits.numpy(), run_hf(hf, ids, types, mask).logits.numpy(),
                             rtol=0, atol=1e-4)


def test_a_run_with_the_rtd_head_goes_out_as_electra_without_its_marker(exported, tmp_path):
  cli.hf_to_posjax(str(exported[0] / "discriminator"), str(tmp_path / "run"))
  (tmp_path / "run" / cli.CONVERTED_FROM).unlink()
  cli.posjax_to_hf(str(tmp_path / "run"), str(tmp_path / "back"))
  assert json.loads((tmp_path / "back" / "config.json").read_text())["architectures"] == ["ElectraForPreTraining"]
