"""``python -m posjax.convert`` on ELECTRA: a posjax ELECTRA pre-training run becomes a Hugging Face generator and
discriminator equal to its ``Electra``, and those directories come back through ``hf-to-posjax`` and out again as
ELECTRA."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from posjax.convert import __main__ as cli  # noqa: E402
from posjax.data.tokenizer import Tokenizer  # noqa: E402
from posjax.main import train  # noqa: E402
from posjax.models.electra import Electra, ElectraConfig  # noqa: E402
from posjax.train import checkpoint  # noqa: E402
from conftest import load_config, override  # noqa: E402
from test_convert import inputs, run_hf  # noqa: E402


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  """A two-step ELECTRA pre-training run and its ``posjax-to-hf`` export."""
  root = tmp_path_factory.mktemp("electra")
  run, out = root / "run", root / "hf"
  train(override(load_config("electra", "runlocal"), total_steps=2, eval_every_steps=0, checkpoint_every_steps=2,
                 progress=False), str(run))
  assert cli.main(["posjax-to-hf", "--workdir", str(run), "--out", str(out)]) == 0
  return run, out


@pytest.mark.xdist_group("electra_export")
def test_an_electra_run_becomes_a_hugging_face_generator_and_discriminator_equal_to_it(exported):
  run, out = exported
  config = ElectraConfig.from_dict(checkpoint.read_model_config(str(run)))
  params = checkpoint.load_params(str(run))
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
  cls_id = Tokenizer.load(checkpoint.vocab_file_of(str(run))).cls_id
  for name in ("generator", "discriminator"):
    assert transformers.AutoTokenizer.from_pretrained(out / name).convert_tokens_to_ids("[CLS]") == cls_id


@pytest.mark.xdist_group("electra_export")
@pytest.mark.parametrize("name, cls", [("generator", "ElectraForMaskedLM"), ("discriminator", "ElectraForPreTraining")])
def test_hugging_face_electra_directories_convert_to_posjax_runs_and_back_as_electra(exported, tmp_path, name, cls):
  hf = getattr(transformers, cls).from_pretrained(exported[1] / name).eval()
  assert cli.main(["hf-to-posjax", "--from", str(exported[1] / name), "--workdir", str(tmp_path / "run")]) == 0
  assert json.loads((tmp_path / "run" / cli.CONVERTED_FROM).read_text())["model_type"] == "electra"
  assert (tmp_path / "run" / "vocab.txt").is_file()
  assert cli.main(["posjax-to-hf", "--workdir", str(tmp_path / "run"), "--out", str(tmp_path / "back")]) == 0
  assert json.loads((tmp_path / "back" / "config.json").read_text())["architectures"] == [cls]
  back = getattr(transformers, cls).from_pretrained(tmp_path / "back").eval()
  ids, types, mask = inputs(vocab=hf.config.vocab_size)
  np.testing.assert_allclose(run_hf(back, ids, types, mask).logits.numpy(), run_hf(hf, ids, types, mask).logits.numpy(),
                             rtol=0, atol=1e-4)


@pytest.mark.xdist_group("electra_export")
def test_a_run_with_the_rtd_head_goes_out_as_electra_without_its_marker(exported, tmp_path):
  cli.hf_to_posjax(str(exported[1] / "discriminator"), str(tmp_path / "run"))
  (tmp_path / "run" / cli.CONVERTED_FROM).unlink()
  cli.posjax_to_hf(str(tmp_path / "run"), str(tmp_path / "back"))
  assert json.loads((tmp_path / "back" / "config.json").read_text())["architectures"] == ["ElectraForPreTraining"]


def test_hf_to_posjax_refuses_a_model_type_it_does_not_convert(tmp_path, capsys):
  (tmp_path / "hf").mkdir()
  (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "roberta"}))
  assert cli.main(["hf-to-posjax", "--from", str(tmp_path / "hf"), "--workdir", str(tmp_path / "run")]) == 2
  error = capsys.readouterr().err
  assert ("has model_type='roberta'; hf-to-posjax converts BERT ('bert'), ModernBERT ('modernbert'), ELECTRA ('electra') "
          "and the decoders") in error
