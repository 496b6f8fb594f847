"""Hugging Face ELECTRA <-> posjax: equal outputs on random-weight models built here (ElectraModel, the
discriminator and the generator; every position type; embeddings narrower than the layers; padding and token
types), round trips, a posjax Electra as a Hugging Face generator and discriminator, and clear errors."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from posjax.convert import electra_to_hf, hf_electra, to_hf_electra  # noqa: E402
from posjax.models import TransformerConfig, Transformer  # noqa: E402
from posjax.models.electra import Electra  # noqa: E402
from conftest import randomize  # noqa: E402
from test_convert import KINDS, assert_same_outputs, inputs, run_hf, run_posjax  # noqa: E402

CLASSES = ("ElectraModel", "ElectraForPreTraining", "ElectraForMaskedLM")
# The generator head is GELU on Hugging Face's side whatever hidden_act says; the others read it.
ACTIVATIONS = {"ElectraModel": "relu", "ElectraForPreTraining": "gelu_new", "ElectraForMaskedLM": "gelu"}


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


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("embedding_size", [16, 32])
def test_hugging_face_to_posjax_and_back_gives_the_same_outputs(kind, cls, embedding_size):
  model = electra(kind, cls, embedding_size, hidden_act=ACTIVATIONS[cls], layer_norm_eps=1e-7)
  module, variables = hf_electra.from_hf_electra(model)
  back = to_hf_electra(module.config, variables)
  assert type(back).__name__ == cls
  for field in ("embedding_size", "hidden_act", "layer_norm_eps", "position_embedding_type", "type_vocab_size"):
    assert getattr(back.config, field) == getattr(model.config, field), field
  ids, types, mask = inputs()
  hf_out, again = run_hf(model, ids, types, mask), run_hf(back, ids, types, mask)
  for name in ("last_hidden_state", "logits"):
    if hasattr(hf_out, name):
      np.testing.assert_allclose(getattr(again, name).numpy(), getattr(hf_out, name).numpy(), rtol=0, atol=1e-4,
                                 err_msg=name)


def box_like(boxed, plain):
  """``plain``'s values in ``boxed``'s boxes (logical axes), as ``init`` returns parameters."""
  return jax.tree.map(lambda box, value: box.replace_boxed(value), boxed, plain,
                      is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))


# (discriminator position, its embedding_size, generator hidden size): ELECTRA-Base's shape (the generator reads
# the discriminator's full-width embeddings through its embeddings_project) and ELECTRA-Small's (the
# discriminator's own embeddings are narrower, both project).
JOINT = [("absolute", 0, 16), ("shaw", 16, 24), ("huang_m4", 16, 24)]


@pytest.mark.parametrize("position,embedding_size,generator_width", JOINT)
def test_a_posjax_electra_becomes_an_equal_hugging_face_generator_and_discriminator(position, embedding_size,
                                                                                    generator_width):
  discriminator_config = TransformerConfig.tiny(position=position, max_len=24, embedding_size=embedding_size)
  generator_config = TransformerConfig.tiny(position=position, max_len=24, hidden_size=generator_width, num_heads=2,
                                            intermediate_size=48, embedding_size=discriminator_config.embed_width)
  module = Electra(generator_config, discriminator_config)
  boxed = module.init(jax.random.PRNGKey(0), jnp.ones((1, 8), jnp.int32))
  params = randomize(boxed["params"], scale=0.3)
  generator, discriminator = electra_to_hf(generator_config, discriminator_config,
                                           {"params": box_like(boxed["params"], params)})
  assert (type(generator).__name__, type(discriminator).__name__) == ("ElectraForMaskedLM", "ElectraForPreTraining")
  assert hasattr(generator.electra, "embeddings_project") and (
      hasattr(discriminator.electra, "embeddings_project") == bool(embedding_size))

  ids, types, mask = inputs(vocab=discriminator_config.vocab_size)
  masked = np.array([[1, 4, 6], [0, 3, 5]])
  kwargs = dict(token_type_ids=jnp.asarray(types), attention_mask=jnp.asarray(mask))
  mine_generated = module.apply({"params": params}, jnp.asarray(ids), jnp.asarray(masked), method=Electra.generate,
                                **kwargs)
  mine_replaced = module.apply({"params": params}, jnp.asarray(ids), method=Electra.discriminate, **kwargs)
  generated = run_hf(generator, ids, types, mask).logits.numpy()
  np.testing.assert_allclose(np.asarray(mine_generated), np.take_along_axis(generated, masked[..., None], axis=1),
                             rtol=0, atol=1e-4)
  np.testing.assert_allclose(np.asarray(mine_replaced), run_hf(discriminator, ids, types, mask).logits.numpy(),
                             rtol=0, atol=1e-4)


def test_a_posjax_generator_and_discriminator_come_back_as_they_were():
  # posjax -> Hugging Face -> posjax is exact: each model's encoder, the generator's the shared embeddings.
  discriminator_config = TransformerConfig.tiny(position="absolute", max_len=24)
  generator_config = TransformerConfig.tiny(position="absolute", max_len=24, hidden_size=16, num_heads=2,
                                            intermediate_size=48, embedding_size=32)
  module = Electra(generator_config, discriminator_config)
  params = randomize(module.init(jax.random.PRNGKey(0), jnp.ones((1, 8), jnp.int32))["params"], scale=0.3)
  generator, discriminator = hf_electra.split_electra({"params": params})
  for config, mine, hf in zip((generator_config, discriminator_config), (generator, discriminator),
                              electra_to_hf(generator_config, discriminator_config, {"params": params})):
    again, variables = hf_electra.from_hf_electra(hf)
    assert again.config == config
    jax.tree.map(np.testing.assert_array_equal, variables["params"], mine)


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


def test_a_generator_head_other_than_gelu_is_an_error_both_ways():
  with pytest.raises(ValueError, match=r"generator head is always exact GELU; this model's activation is "
                                       r"'gelu_tanh'"):
    hf_electra.from_hf_electra(electra("absolute", "ElectraForMaskedLM", hidden_act="gelu_new"))
  config = TransformerConfig.tiny(activation="relu")
  params = Transformer(config, head="mlm").init(jax.random.PRNGKey(0), jnp.ones((1, 4), jnp.int32))
  with pytest.raises(ValueError, match=r"always exact GELU; this model's activation is 'relu'"):
    to_hf_electra(config, params)


def test_models_hugging_face_electra_cannot_express_are_refused():
  def variables(config, head="rtd"):
    return Transformer(config, head=head).init(jax.random.PRNGKey(0), jnp.ones((1, 4), jnp.int32))

  with pytest.raises(ValueError, match=r"ELECTRA's encoder is BERT's: Hugging Face BERT cannot express position "
                                       r"'tupe_r'; it has \['absolute', 'huang_m4', 'shaw'\]"):
    to_hf_electra(TransformerConfig.tiny(position="tupe_r"), variables(TransformerConfig.tiny(position="tupe_r")))
  with pytest.raises(ValueError, match=r"ELECTRA's encoder is BERT's: Hugging Face BERT is Post-LN; this model "
                                       r"has norm='pre'"):
    to_hf_electra(TransformerConfig.tiny(norm="pre"), variables(TransformerConfig.tiny(norm="pre")))
  with pytest.raises(ValueError, match=r"no model for posjax's 'span' head; it converts heads none -> ElectraModel, "
                                       r"rtd -> ElectraForPreTraining, mlm -> ElectraForMaskedLM"):
    to_hf_electra(TransformerConfig.tiny(), variables(TransformerConfig.tiny(), "span"))
  with pytest.raises(ValueError, match=r"posjax -> ElectraForPreTraining: encoder/embedding_norm/bias has shape "
                                       r"\(16,\) but its config implies \(8,\)"):
    to_hf_electra(TransformerConfig.tiny(embedding_size=8), variables(TransformerConfig.tiny(embedding_size=16)))


def test_variables_of_something_else_are_an_error():
  encoder = Transformer(TransformerConfig.tiny(), head="rtd").init(jax.random.PRNGKey(0), jnp.ones((1, 4), jnp.int32))
  with pytest.raises(ValueError, match=r"expected the variables of a posjax Electra .* \['generator', "
                                       r"'generator_head'\] missing, got keys \['encoder', 'rtd', 'rtd_output'\]"):
    electra_to_hf(TransformerConfig.tiny(), TransformerConfig.tiny(), encoder)
