"""Hugging Face decoders in and out: Llama (GQA, rope_scaling), Mistral (a sliding window shorter than the input),
Qwen2 (q/k/v biases, tied embeddings), Qwen3 (QK-norm, its own head_dim), GPT-NeoX (partial rotary, parallel and
sequential residuals), Llama with LongRoPE (past its original length), Phi-3, OLMo 2, Gemma 1-3 (Gemma 3's local
layers with their own RoPE base) and GPT-2 (learned positions, Conv1D weights) on random weights saved with
``save_pretrained``: posjax's logits equal Hugging Face's, and the model exported back gives them again."""

import json
import os

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posjax import convert, models
from posjax.convert import hf_decoder

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

SMALL = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=64)
CASES = {
    "llama-gqa-llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_key_value_heads=2, rope_theta=500_000.0,
        rope_scaling=dict(rope_type="llama3", factor=4.0, original_max_position_embeddings=16, low_freq_factor=1.0,
                          high_freq_factor=4.0))),
    "llama-mqa-yarn": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_key_value_heads=1, rope_scaling=dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=32))),
    "llama-attention-bias": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2, attention_bias=True)),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=2, sliding_window=5)),
    "qwen2-bias-tied": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3-qknorm": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_key_value_heads=2, head_dim=16)),
    "gpt-neox-parallel": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(rotary_pct=0.25, rope_theta=1000.0)),
    "gpt-neox-sequential": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(rotary_pct=0.5, use_parallel_residual=False,
                                                                        hidden_act="gelu_new")),
    "llama-longrope": ("LlamaConfig", "LlamaForCausalLM", dict(original_max_position_embeddings=8, rope_scaling=dict(
        rope_type="longrope", short_factor=[1.0, 1.5, 2.0, 4.0], long_factor=[2.0, 3.0, 6.0, 9.0], factor=4.0))),
    "phi3-longrope-window": ("Phi3Config", "Phi3ForCausalLM", dict(
        num_key_value_heads=2, partial_rotary_factor=0.5, sliding_window=5, original_max_position_embeddings=8, pad_token_id=0,
        rope_scaling=dict(type="longrope", short_factor=[1.0, 2.0], long_factor=[3.0, 5.0]))),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(num_key_value_heads=2, pad_token_id=0)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(num_key_value_heads=1, head_dim=16, pad_token_id=0)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        num_key_value_heads=2, head_dim=16, pad_token_id=0, sliding_window=5, query_pre_attn_scalar=24,
        attn_logit_softcapping=3.0, final_logit_softcapping=4.0)),
    "gemma3-local-global": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        num_key_value_heads=2, head_dim=16, pad_token_id=0, sliding_window=5, query_pre_attn_scalar=24,
        rope_theta=10_000.0, rope_local_base_freq=100.0, rope_scaling=dict(rope_type="linear", factor=2.0),
        attn_logit_softcapping=3.0, final_logit_softcapping=4.0)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, n_inner=48,
                                                   vocab_size=97)),
}


def random_model(name):
  config_class, model_class, fields = CASES[name]
  fields = fields if name == "gpt2" else {**SMALL, **fields}
  torch.manual_seed(0)
  model = getattr(transformers, model_class)(getattr(transformers, config_class)(**fields, attn_implementation="eager"))
  with torch.no_grad():  # every weight away from its initial value (norm scales from 1, biases from 0)
    for parameter in model.parameters():
      parameter.add_(0.2 * torch.randn_like(parameter))
  return model.eval()


def hf_logits(model, ids):
  with torch.no_grad():
    return model(torch.from_numpy(ids)).logits.numpy()


@pytest.mark.parametrize("name", CASES)
def test_hugging_face_decoders_convert_both_ways(name, tmp_path):
  model = random_model(name)
  model.save_pretrained(tmp_path / "hf", safe_serialization=True)
  ids = np.random.default_rng(0).integers(0, 97, (2, 12)).astype(np.int64)
  want = hf_logits(model, ids)
  module, variables = convert.from_hf(tmp_path / "hf")
  got = np.asarray(module.apply(variables, jnp.asarray(ids, jnp.int32)).logits)
  np.testing.assert_allclose(got, want, atol=2e-4 * np.abs(want).max(), rtol=0)
  back = convert.to_hf(module.config, variables)
  assert type(back).__name__ == type(model).__name__
  np.testing.assert_allclose(hf_logits(back, ids), want, atol=2e-4 * np.abs(want).max(), rtol=0)


def test_a_window_given_by_sliding_window_a_short_pattern_or_a_layout_exports_as_gemma_2_or_3():
  fields = dict(vocab_size=97, hidden_size=32, num_layers=4, num_heads=4, intermediate_size=48, max_len=64)
  for windows in (dict(layer_windows="8,0"), dict(layer_windows="8,0,8,0")):
    config = hf_decoder.config_from_hf(hf_decoder.config_to_hf(
        models.TransformerConfig.gemma(norm="peri", query_scale=0.25, **windows, **fields)))
    assert config.windows == (8, 0, 8, 0)
  # the gemma3 layout is Gemma 3's text model: its layer types, each kind back as it was
  config = models.TransformerConfig.gemma(norm="peri", qk_norm=True, query_scale=8 ** -0.5, layout="gemma3",
                                          layout_options={"window": 8, "every": 2}, **fields)
  hf = hf_decoder.config_to_hf(config)
  assert hf["layer_types"] == ["sliding_attention", "full_attention"] * 2 and hf["sliding_window"] == 8
  assert hf_decoder.config_from_hf(hf).layer_kinds == config.layer_kinds
  with pytest.raises(ValueError, match=r"qwen3 cannot express this model: qk_norm_scale=False"):
    hf_decoder.config_to_hf(models.TransformerConfig.llama(qk_norm=True, qk_norm_scale=False, **fields))


def test_a_converted_gemma_3_generates_what_hugging_face_generates(tmp_path):
  """Greedy decoding of left-padded prompts past the local window, through the cache of each layer kind (local
  layers at their own RoPE base, the soft caps): posjax's tokens are Hugging Face ``generate``'s."""
  from posjax import generate

  model = random_model("gemma3-local-global")
  model.generation_config.update(eos_token_id=None, pad_token_id=0)
  ids = np.random.default_rng(1).integers(3, 97, (2, 6)).astype(np.int64)
  mask = np.ones_like(ids)
  mask[1, :2] = 0  # left padding, as Hugging Face pads a batch for generation
  with torch.no_grad():
    want = model.generate(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), max_new_tokens=8,
                          do_sample=False).numpy()
  module, variables = convert.from_hf(model)
  got = generate.generate(module, variables, ids, max_new_tokens=8, attention_mask=mask)
  np.testing.assert_array_equal(np.asarray(got)[:, 6:], want[:, 6:])


@pytest.mark.parametrize("fields,message", [
    (dict(model_type="llama", mlp_bias=True), "mlp_bias=True"),
    (dict(model_type="llama", rope_scaling={"rope_type": "mrope", "factor": 2.0}), "rope_type='mrope'"),
    (dict(model_type="qwen2", use_sliding_window=True), "use_sliding_window=True"),
    (dict(model_type="gpt_neox", attention_bias=False), "attention_bias=False"),
    (dict(model_type="falcon"), "model_type='falcon'"),
    (dict(model_type="llama", max_position_embeddings=32, rope_scaling={  # Hugging Face switches at 32, not 8
        "rope_type": "longrope", "original_max_position_embeddings": 8, "short_factor": [1.0] * 4,
        "long_factor": [2.0] * 4}), "original_max_position_embeddings=8 for longrope, which Hugging Face's"),
])
def test_what_posjax_cannot_represent_is_an_error(fields, message):
  hf = {"vocab_size": 97, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
        "intermediate_size": 48, **fields}
  with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
    hf_decoder.config_from_hf(hf)


def saved_run(run, packing: str, config, adjust=lambda module, variables: variables):
  """A causal run's workdir as training leaves it, without the training: a WordPiece vocab.txt (BERT's specials, 59
  words w0..w58), config.json's packing, the model's parameters (every one moved from its initial value, then
  ``adjust``-ed)."""
  from posjax.convert import __main__ as cli
  from posjax.models import Transformer

  run.mkdir()
  pieces = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(59)]
  (run / "vocab.txt").write_text("\n".join(pieces) + "\n")
  (run / "config.json").write_text(json.dumps({"data": {"packing": packing}}))
  module = Transformer(config, head="lm")
  variables = flax.core.meta.unbox(module.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))
  leaves, tree = jax.tree.flatten(variables)
  variables = adjust(module, tree.unflatten([x + 0.5 * jax.random.normal(jax.random.key(i), x.shape)
                                             for i, x in enumerate(leaves)]))
  cli.write_run(module, variables, str(run), "test")
  return module, variables


def test_an_exported_decoder_names_its_runs_special_tokens_and_hugging_faces_generate_stops_where_posjaxs_does(
    tmp_path, capsys):
  """A decoder run on a WordPiece vocabulary with stream packing (no [CLS]; [SEP] ends a document): the export's
  config and generation config say eos [SEP], pad [PAD], no bos; its tokenizer encodes a prompt without specials,
  as the run did; AutoTokenizer + generate on the export give posjax's tokens and stop at the same [SEP]. An --out
  that is the run, or that holds other files, is refused before anything is written; an earlier export is not."""
  from posjax import generate
  from posjax.convert import __main__ as cli
  from posjax.data.tokenizer import Tokenizer
  from posjax.models import TransformerConfig, Transformer

  run = tmp_path / "run"
  prompt = [8, 12, 6]  # w3 w7 w1

  def stop_early(module, variables):  # [SEP] wins where the 4th new token would have
    free = np.asarray(generate.generate(module, variables, np.asarray([prompt]), max_new_tokens=8))[0, 3:]
    kernel = variables["params"]["encoder"]["lm_head"]["kernel"]
    variables["params"]["encoder"]["lm_head"]["kernel"] = kernel.at[:, 3].set(2.0 * kernel[:, free[3]])
    return variables

  module, variables = saved_run(run, "stream", TransformerConfig.decoder(
      vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48, max_len=64),
      stop_early)
  tokenizer = Tokenizer.load(str(run / "vocab.txt"))
  assert tokenizer.encode("w3 w7 w1") == prompt and tokenizer.sep_id == 3
  config_bytes = (run / "config.json").read_bytes()

  assert cli.main(["posjax-to-hf", "--workdir", str(run), "--out", str(run)]) == 2
  (tmp_path / "other").mkdir()
  (tmp_path / "other" / "notes.txt").write_text("mine")
  (tmp_path / "linked").mkdir()
  (tmp_path / "linked" / "config.json").symlink_to(run / "config.json")
  hf_model = random_model("qwen3-qknorm")
  hf_model.save_pretrained(tmp_path / "hf_model")  # a Hugging Face model posjax did not write
  before = {p: p.read_bytes() for p in (tmp_path / "hf_model").iterdir()}
  for out, message in (("other", "holds notes.txt, which no export writes"),
                       ("linked", "holds config.json (a link), which no export writes"),
                       ("hf_model", "holds (no posjax_export.json) a model posjax did not export")):
    assert cli.main(["posjax-to-hf", "--workdir", str(run), "--out", str(tmp_path / out)]) == 2
    assert message in capsys.readouterr().err
  assert (run / "config.json").read_bytes() == config_bytes and os.listdir(tmp_path / "other") == ["notes.txt"]
  assert {p: p.read_bytes() for p in (tmp_path / "hf_model").iterdir()} == before
  (tmp_path / "hf").mkdir()
  (tmp_path / "hf" / "posjax_export.json").write_text("{}")
  (tmp_path / "hf" / "added_tokens.json").write_text("{}")  # an earlier export's file this one does not write
  assert cli.main(["posjax-to-hf", "--workdir", str(run), "--out", str(tmp_path / "hf")]) == 0
  assert not (tmp_path / "hf" / "added_tokens.json").exists()

  ids = {"bos_token_id": None, "eos_token_id": tokenizer.sep_id, "pad_token_id": tokenizer.pad_id}
  hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
  assert {k: getattr(hf.config, k) for k in ids} == ids == {k: getattr(hf.generation_config, k) for k in ids}
  hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
  assert hf_tokenizer("w3 w7 w1").input_ids == prompt
  with torch.no_grad():
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0].tolist()
  got = np.asarray(generate.generate(module, variables, np.asarray([prompt]), max_new_tokens=8,
                                     eos_id=tokenizer.sep_id))[0].tolist()
  assert want[-1] == tokenizer.sep_id and len(want) < len(prompt) + 8  # it stopped at [SEP]
  assert got[:len(want)] == want and set(got[len(want):]) <= {tokenizer.sep_id}
  capsys.readouterr()
  assert generate.main(["--workdir", str(run), "--prompt", "w3 w7 w1", "--max_new_tokens", "8"]) == 0
  assert capsys.readouterr().out.split() == hf_tokenizer.convert_ids_to_tokens(want)


def test_a_causal_bert_exports_as_bert_lm_head_model_with_its_rows_first_token_and_no_eos(tmp_path):
  """A causal BERT (configs/clm.py: full_sentence packing, rows [CLS] s1 [SEP] s2 [SEP] ...): Hugging Face's
  BertLMHeadModel (is_decoder) with posjax's logits, bos [CLS] and no eos ([SEP] ends a sentence), a tokenizer that
  puts [CLS] first and nothing last; posjax's generate starts its prompt with the same [CLS]."""
  from posjax.convert import __main__ as cli
  from posjax.models import TransformerConfig
  from posjax.train import checkpoint

  module, variables = saved_run(tmp_path / "run", "full_sentence", TransformerConfig(
      vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=48, max_len=32, causal=True,
      type_vocab_size=0, position="absolute", dtype="float32"))
  assert cli.main(["posjax-to-hf", "--workdir", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
  hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
  assert type(hf).__name__ == "BertLMHeadModel" and hf.config.is_decoder
  assert (hf.config.bos_token_id, hf.config.eos_token_id, hf.generation_config.bos_token_id) == (2, None, 2)
  tokens = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")("w3 w7").input_ids
  assert tokens == [2, 8, 12] == checkpoint.prompt_prefix(str(tmp_path / "run"),
                                                          checkpoint.special_token_ids(str(tmp_path / "run"))) + [8, 12]
  ids = np.asarray([tokens + [20, 30, 40]])
  want = np.asarray(module.apply(variables, jnp.asarray(ids)).logits)
  np.testing.assert_allclose(hf_logits(hf, ids), want, atol=2e-4 * np.abs(want).max(), rtol=0)
