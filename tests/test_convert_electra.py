"""Hugging Face ELECTRA -> posjax: equal outputs on random-weight models built here (ElectraModel, the
discriminator and the generator; every position type; embeddings narrower than the layers; padding and token
types), and clear errors."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from posjax.convert import hf_electra  # noqa: E402
from test_convert import KINDS, assert_same_outputs, inputs, run_hf, run_posjax  # noqa: E402

CLASSES = ("ElectraModel", "ElectraForPreTraining", "ElectraForMaskedLM")


def electra(kind, cls, embedding_size=16, seed=0, **config):
  """A Hugging Face ELECTRA whose every weight is drawn at scale 0.3, so position terms are not negligible."""
  torch.manual_seed(seed)
  fields = dict(vocab_size=99, embedding_size=embedding_size, hidden_size=32, num_hidden_layers=2,
                num_attention_heads=4, intermediate_size=37, max_position_embeddings=24, position_embedding_type=kind,
                hidden_act="gelu")
  fields.update(config)
  model = getattr(transformers, cls)(transformers.ElectraConfig(**fields)).eval()
  with torch.no_grad():
    for parameter in model.parameters():
      parameter.normal_(0.0, 0.3)
    if cls == "ElectraForMaskedLM":  # re-tie the LM head (drawn separately above)
      model.generator_lm_head.weight = model.electra.embeddings.word_embeddings.weight
  return model


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("embedding_size", [16, 32])
def test_hugging_face_electra_models_convert_to_equal_posjax_models(kind, cls, embedding_size):
  model = electra(kind, cls, embedding_size)
  ids, types, mask = inputs()
  module, variables = hf_electra.from_hf_electra(model)
  assert module.head == {"ElectraModel": "none", "ElectraForPreTraining": "rtd", "ElectraForMaskedLM": "mlm"}[cls]
  assert module.config.embed_width == embedding_size
  assert ("embeddings_project" in variables["params"]["encoder"]) == (embedding_size != 32)
  hf_out, mine = run_hf(model, ids, types, mask), run_posjax(module, variables, ids, types, mask)
  assert_same_outputs(hf_out, mine)


def test_a_bert_config_is_refused_with_the_converter_to_use():
  with pytest.raises(ValueError, match=r"model_type='bert'; this converter reads ELECTRA \('electra'\); BERT: "
                                       r"posjax.convert.from_hf_bert"):
    hf_electra.config_from_hf({"model_type": "bert"})


def test_an_untied_generator_head_is_an_error():
  model = electra("absolute", "ElectraForMaskedLM")
  with torch.no_grad():
    model.generator_lm_head.weight = torch.nn.Parameter(model.generator_lm_head.weight.detach().clone() + 1)
  with pytest.raises(ValueError, match="not tied to the word embeddings"):
    hf_electra.from_hf_electra(model)
