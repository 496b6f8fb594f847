"""Hugging Face ModernBERT in and out: a random ``ModernBertForMaskedLM`` saved with ``save_pretrained`` (global and
local layers with their own RoPE bases, a local window shorter than the input, a padded row), converted: posjax's
MLM logits equal Hugging Face's at the real tokens, and the model exported back gives them again."""

import jax.numpy as jnp
import numpy as np
import pytest

from posjax import convert
from posjax.convert import hf_modernbert

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")


def test_modernbert_converts_both_ways(tmp_path):
  config = transformers.ModernBertConfig(
      vocab_size=97, hidden_size=32, intermediate_size=40, num_hidden_layers=4, num_attention_heads=4,
      max_position_embeddings=64, global_attn_every_n_layers=3, local_attention=8, global_rope_theta=1000.0,
      local_rope_theta=37.0, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2,
      attn_implementation="eager", reference_compile=False)
  torch.manual_seed(0)
  model = transformers.ModernBertForMaskedLM(config)
  with torch.no_grad():  # every weight away from its initial value (norm scales from 1, biases from 0)
    for parameter in model.parameters():
      parameter.add_(0.2 * torch.randn_like(parameter))
  model.eval().save_pretrained(tmp_path / "hf", safe_serialization=True)
  ids = np.random.default_rng(0).integers(3, 97, (2, 14)).astype(np.int64)
  mask = np.ones_like(ids)
  mask[1, 10:] = 0  # a padded row: its real tokens must not see the padding

  def hf_logits(hf):
    with torch.no_grad():
      return hf(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits.numpy()

  want = hf_logits(model)
  module, variables = convert.from_hf(tmp_path / "hf")
  assert module.config.windows == (0, 5, 5, 0) and module.config.layer_positions == (
      "rope", "rope@local", "rope@local", "rope")
  got = np.asarray(module.apply(variables, jnp.asarray(ids, jnp.int32), attention_mask=jnp.asarray(mask)).logits)
  real = mask.astype(bool)
  np.testing.assert_allclose(got[real], want[real], atol=1e-4 * np.abs(want).max(), rtol=0)
  back = convert.to_hf(module.config, variables)
  assert type(back).__name__ == "ModernBertForMaskedLM"
  np.testing.assert_allclose(hf_logits(back)[real], want[real], atol=1e-4 * np.abs(want).max(), rtol=0)


def test_the_modernbert_preset_is_modernbert_bases_layout():
  from posjax.models import TransformerConfig

  converted = hf_modernbert.config_from_hf(transformers.ModernBertConfig().to_dict())
  preset = TransformerConfig.modernbert(vocab_size=converted.vocab_size)
  layers = lambda c: (c.windows, [(c.method_specs[n].method.name, c.method_specs[n].options)
                                  for n in c.layer_positions])
  assert layers(preset) == layers(converted)
  drop = ("layer_windows", "position_schedule", "schedule_options")
  assert {k: v for k, v in preset.to_dict().items() if k not in drop} == {
      k: v for k, v in converted.to_dict().items() if k not in drop}


@pytest.mark.parametrize("fields,message", [
    (dict(norm_bias=True), "norm_bias=True"),
    (dict(attention_bias=True), "posjax represents both False"),
    (dict(classifier_activation="silu"), "classifier_activation='silu'"),
])
def test_what_posjax_cannot_represent_is_an_error(fields, message):
  hf = {"model_type": "modernbert", "vocab_size": 97, "hidden_size": 32, "num_hidden_layers": 3,
        "num_attention_heads": 4, "intermediate_size": 48, **fields}
  with pytest.raises(ValueError, match=message):
    hf_modernbert.config_from_hf(hf)


def test_a_model_with_a_task_head_is_refused_for_export():
  import jax
  import jax.numpy as jnp

  from posjax.models import Transformer, TransformerConfig

  config = TransformerConfig.modernbert(vocab_size=64, hidden_size=32, num_layers=3, num_heads=4, intermediate_size=40,
                                        max_len=32)
  variables = jax.eval_shape(Transformer(config, head="classification").init, jax.random.key(0),
                             jnp.zeros((1, 8), jnp.int32))
  with pytest.raises(ValueError, match=r"a task head \(classifier, pooler\): export the pre-training run"):
    hf_modernbert.to_hf_modernbert(config, jax.tree.map(np.zeros_like, variables))
