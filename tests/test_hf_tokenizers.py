"""Any Hugging Face tokenizer (``tests/hf_tokenizers.py``: SentencePiece BPE and Unigram with byte fallback,
byte-level BPE with and without a bos) encodes a prompt as ``transformers.AutoTokenizer`` does, with its own special
tokens and none of BERT's; a converted decoder with its own tokenizer is prompted with text as Hugging Face's
``generate`` is, continues pre-training on a text file (its architecture and every weight taken) and goes out with its
tokenizer files unchanged."""

import json
import os

import jax
import numpy as np
import pytest

import hf_tokenizers
from posjax.data import mlm
from posjax.data.tokenizer import Tokenizer
from posjax.tasks import passkey

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

TEXTS = ["the pass key is 12345", "Grüße, 東京 🙂 the sky", "  two  spaces\nand a line"]
ROLES = {  # (bos, eos, pad) as each style's settings name them; pad falls back to eos
    "sentencepiece_bpe": ("<s>", "</s>", "</s>"), "unigram": ("<bos>", "<eos>", "<pad>"),
    "byte_level": (None, "<|endoftext|>", "<|endoftext|>"),
    "byte_level_bos": ("<|begin_of_text|>", "<|end_of_text|>", "<|end_of_text|>")}


@pytest.mark.parametrize("style", hf_tokenizers.STYLES)
def test_each_style_encodes_prompts_and_frames_documents_as_its_model_reads_them(style, tmp_path):
  hf_tokenizers.save(style, tmp_path)
  hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
  tokenizer = Tokenizer.load(str(tmp_path / "tokenizer.json"))
  piece = lambda i: None if i is None else hf.convert_ids_to_tokens(i)
  assert (piece(tokenizer.bos_id), piece(tokenizer.eos_id), piece(tokenizer.pad_id)) == ROLES[style]
  assert tokenizer.mask_id is None and tokenizer.vocab_size == len(hf)
  for text in TEXTS:  # bytes outside the learned pieces included (byte fallback, or byte-level)
    ids = tokenizer.start_ids + tokenizer.encode(text)
    assert ids == hf(text).input_ids
    assert tokenizer.backend.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True) == text
  # the stream packing: each document (a corpus's lines) read as text, line breaks and all, after its first ids (a
  # bos where the tokenizer adds one), then its eos
  documents = [["the sky", "  is blue"], ["green"]]
  rows = list(mlm.pack_tokens("stream", map(tokenizer.encode_document, documents), 64, tokenizer))
  first, second = (hf("\n".join(lines)).input_ids + [tokenizer.eos_id] for lines in documents)
  assert rows[0]["input_ids"][:len(first) + len(second)].tolist() == first + second
  # a passkey row: the start ids, then its pieces between line breaks' tokens
  template, symbols = passkey.template(tokenizer, {**passkey.DEFAULTS, "symbols": "1 2 3"})
  assert hf.convert_ids_to_tokens(symbols) == ["1", "2", "3"]
  assert template.start == hf("x").input_ids[:len(tokenizer.start_ids)] and template.sep == tokenizer.encode("\n")


def test_what_a_tokenizer_lacks_is_named_in_one_line(tmp_path):
  hf_tokenizers.save("byte_level", tmp_path)
  tokenizer = Tokenizer.load(str(tmp_path / "tokenizer.json"))
  with pytest.raises(ValueError, match=r"tokenizer.json: packing='documents' \(a row's first token and a sentence's "
                                       r"last: \[CLS\] / bos and \[SEP\] / eos\) needs a cls token, which the "
                                       r"tokenizer does not name \(its tokenizer_config.json / special_tokens_map.json: "
                                       r"cls_token\)"):
    list(mlm.pack_tokens("documents", [[[5, 6]]], 16, tokenizer))
  settings = json.loads((tmp_path / "tokenizer_config.json").read_text())
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({**settings, "bos_token": "<|nowhere|>"}))
  with pytest.raises(ValueError, match=r"its settings name bos_token='<\|nowhere\|>', which its vocabulary does not "
                                       "hold"):
    Tokenizer.load(str(tmp_path / "tokenizer.json"))


def test_a_converted_llama_with_its_own_tokenizer_is_prompted_trained_and_exported(tmp_path, capsys):
  """A random Llama with a SentencePiece tokenizer, saved as a hub folder holds it: ``python -m posjax.generate
  --prompt`` prints the text Hugging Face's tokenizer + ``generate`` give; ``configs/lm.py:init_from`` continues it
  on a text file in its own tokenizer; the export reloads in Hugging Face with the tokenizer files unchanged."""
  from conftest import load_config, override
  from posjax import generate
  from posjax.convert import __main__ as cli
  from posjax.experiments import length
  from posjax.main import evaluate_checkpoint, train
  from posjax.train import checkpoint

  hf_tokenizers.save("sentencepiece_bpe", tmp_path / "hf")
  hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
      vocab_size=len(hf_tokenizer), hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=2, max_position_embeddings=64, bos_token_id=hf_tokenizer.bos_token_id,
      eos_token_id=[hf_tokenizer.eos_token_id, 7])).eval()  # a list of eos ids, as Llama 3's
  model.save_pretrained(tmp_path / "hf", safe_serialization=True)
  assert cli.main(["hf-to-posjax", "--from", str(tmp_path / "hf"), "--workdir", str(tmp_path / "converted")]) == 0

  prompt = "the pass key is"
  with torch.no_grad():
    want = model.generate(**hf_tokenizer(prompt, return_tensors="pt"), max_new_tokens=6, do_sample=False)[0]
  capsys.readouterr()
  assert generate.main(["--workdir", str(tmp_path / "converted"), "--prompt", prompt, "--max_new_tokens", "6"]) == 0
  assert capsys.readouterr().out.rstrip("\n") == hf_tokenizer.decode(want, skip_special_tokens=False)

  (tmp_path / "corpus.txt").write_text("\n\n".join(hf_tokenizers.TEXT[:8]) + "\n")
  # at learning rate 0 the run's checkpoint holds Hugging Face's weights (a fresh or dropped parameter would differ)
  config = override(load_config("lm", f"runlocal,init_from={tmp_path / 'converted'}"), total_steps=2,
                    learning_rate=0.0, warmup_steps=0, eval_every_steps=2, checkpoint_every_steps=2, batch_size=8,
                    max_len=32,
                    **{"data.train_files": str(tmp_path / "corpus.txt"), "data.eval_files": str(tmp_path / "corpus.txt"),
                       "passkey_train.fraction": 0.0})
  assert config.data.vocab_file == str(tmp_path / "converted" / "tokenizer.json")
  assert config.model.num_kv_heads == 2
  train(config, str(tmp_path / "run"))
  want = checkpoint.load_params(str(tmp_path / "converted"))
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(
      checkpoint.load_params(str(tmp_path / "run")))):
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x), err_msg=jax.tree_util.keystr(path))
  results = json.loads((tmp_path / "run" / "results.json").read_text())
  assert np.isfinite(results["metrics"]["eval"]["loss"]) and results["metrics"]["eval"]["tokens"] > 0

  # the length harness reads the run with its own tokenizer: perplexity and passkey prompts in its pieces
  harness = load_config("length", "methods=,runlocal,control=")
  harness.update(runs=(str(tmp_path / "run"),), eval_multiples=(2,), eval_batches=1, probes=())
  harness.passkey.update(batches=1, digits=2, symbols="1 2 3 4 5", filler="the sky is blue .",
                         key_line="the pass key is {key} .", question="the pass key is", depths=0)
  (row,) = length.run(harness, str(tmp_path / "harness"), train, evaluate=evaluate_checkpoint).values()
  assert set(row["passkey"]) == {"64"} and np.isfinite(row["perplexity"]["64"])

  assert cli.main(["posjax-to-hf", "--workdir", str(tmp_path / "run"), "--out", str(tmp_path / "back")]) == 0
  for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
    assert (tmp_path / "back" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes(), name
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
  assert type(back).__name__ == "LlamaForCausalLM"
  # the continued run keeps its source's special tokens (the list of eos ids too), its tokenizer being the same
  assert (back.config.bos_token_id, back.config.eos_token_id) == (hf_tokenizer.bos_token_id,
                                                                  [hf_tokenizer.eos_token_id, 7])
  ids = torch.from_numpy(np.random.default_rng(1).integers(0, len(hf_tokenizer), (1, 9)))
  with torch.no_grad():  # the weights taken at learning rate 0 come back as they went in
    want = model(ids).logits.numpy()
    np.testing.assert_allclose(back(ids).logits.numpy(), want, atol=2e-4 * np.abs(want).max(), rtol=0)
  assert transformers.AutoTokenizer.from_pretrained(tmp_path / "back")(prompt).input_ids == hf_tokenizer(
      prompt).input_ids
  assert os.path.isfile(tmp_path / "back" / "model.safetensors")


@pytest.mark.parametrize("style,add_bos", [("byte_level_bos", False), ("sentencepiece_bpe", None)])
def test_add_bos_token_counts_where_hugging_faces_class_reads_it(style, add_bos, tmp_path):
  """PreTrainedTokenizerFast (Llama 3's class) encodes with its post-processor whatever add_bos_token says; Llama's
  and Gemma's classes add a bos unless add_bos_token is false (absent: true)."""
  hf_tokenizers.save(style, tmp_path)
  settings = json.loads((tmp_path / "tokenizer_config.json").read_text())
  settings.pop("add_bos_token", None)
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(
      settings if add_bos is None else {**settings, "add_bos_token": add_bos}))
  ids = transformers.AutoTokenizer.from_pretrained(tmp_path)("the sky").input_ids
  tokenizer = Tokenizer.load(str(tmp_path / "tokenizer.json"))
  assert tokenizer.start_ids + tokenizer.encode("the sky") == ids and tokenizer.start_ids == [tokenizer.bos_id]


def test_a_run_resumed_with_other_tokenizer_settings_is_refused(tmp_path):
  """The tokenizer a run records covers its settings files (they name its special tokens and whether a bos is
  added); a run recorded by its tokenizer.json alone (before the settings counted) still resumes."""
  import ml_collections

  from posjax.train import validate

  hf_tokenizers.save("sentencepiece_bpe", tmp_path / "tok")
  config = ml_collections.ConfigDict({"data": {"vocab_file": str(tmp_path / "tok" / "tokenizer.json")}})
  (tmp_path / "run").mkdir()
  validate.check_vocabulary(config, str(tmp_path / "run"))
  validate.check_vocabulary(config, str(tmp_path / "run"))  # the same files: resumes
  settings = tmp_path / "tok" / "tokenizer_config.json"
  settings.write_text(json.dumps({**json.loads(settings.read_text()), "add_bos_token": False}))
  with pytest.raises(ValueError, match=r"was trained with the tokenizer \S+tokenizer.json \(sha256 \w{12}\); this "
                                       r"config's \S+tokenizer.json is another"):
    validate.check_vocabulary(config, str(tmp_path / "run"))
  legacy = {"file": config.data.vocab_file, "sha256": validate._sha256(config.data.vocab_file, settings=False)}
  (tmp_path / "run" / validate.VOCABULARY).write_text(json.dumps(legacy))
  validate.check_vocabulary(config, str(tmp_path / "run"))
