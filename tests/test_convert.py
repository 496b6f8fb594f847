"""Hugging Face BERT <-> posjax: equal outputs on random-weight models built here (every position type, every
head, with padding and token types), exact round trips, the command line, and clear errors."""

import json
import os
import re
import shutil
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from posjax import config_args, positions  # noqa: E402
from posjax.convert import __main__ as cli  # noqa: E402
from posjax.convert import hf_bert  # noqa: E402
from posjax.data.tokenizer import Tokenizer  # noqa: E402
from posjax.models import TransformerConfig, TransformerStack, Transformer  # noqa: E402
from posjax.main import train  # noqa: E402
from posjax.train import checkpoint  # noqa: E402
from conftest import ROOT, load_config, override, randomize  # noqa: E402
from test_train import assert_same_params, flat_params  # noqa: E402

KINDS = ("absolute", "relative_key", "relative_key_query")
CLASSES = ("BertModel", "BertForMaskedLM", "BertForSequenceClassification", "BertForQuestionAnswering")
VOCAB = str(ROOT / "configs" / "data" / "tiny_vocab.txt")


def hf_model(kind, cls="BertForMaskedLM", seed=0, **config):
  """A Hugging Face model whose every weight is drawn at scale 0.3, so position terms are not negligible."""
  torch.manual_seed(seed)
  fields = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                max_position_embeddings=24, position_embedding_type=kind, num_labels=3, hidden_act="gelu")
  fields.update(config)
  if cls == "BertForQuestionAnswering":
    fields["num_labels"] = 2
  model = getattr(transformers, cls)(transformers.BertConfig(**fields)).eval()
  with torch.no_grad():
    for parameter in model.parameters():
      parameter.normal_(0.0, 0.3)
  return model


def inputs(vocab=99, length=11):
  rng = np.random.default_rng(0)
  ids = rng.integers(0, vocab, (2, length))
  types = rng.integers(0, 2, (2, length))
  mask = np.ones((2, length), np.int64)
  mask[1, 7:] = 0
  return ids, types, mask


def run_hf(model, ids, types, mask):
  with torch.no_grad():
    return model(input_ids=torch.tensor(ids), token_type_ids=torch.tensor(types),
                 attention_mask=torch.tensor(mask), output_hidden_states=True)


def run_posjax(module, variables, ids, types, mask):
  return module.apply(variables, jnp.asarray(ids), token_type_ids=jnp.asarray(types), attention_mask=jnp.asarray(mask))


def assert_same_outputs(hf_out, mine, tolerance=1e-4):
  np.testing.assert_allclose(np.asarray(mine.last_hidden_state), hf_out.hidden_states[-1].numpy(), rtol=0,
                             atol=tolerance)
  for name in ("logits", "start_logits", "end_logits"):
    if hasattr(hf_out, name) and getattr(hf_out, name) is not None:
      np.testing.assert_allclose(np.asarray(getattr(mine, name)), getattr(hf_out, name).numpy(), rtol=0,
                                 atol=tolerance, err_msg=name)


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("kind", KINDS)
def test_hugging_face_models_convert_to_equal_posjax_models(kind, cls):
  model = hf_model(kind, cls, hidden_act="gelu_new" if cls == "BertModel" else "gelu", layer_norm_eps=1e-7)
  ids, types, mask = inputs()
  module, variables = hf_bert.from_hf_bert(model)
  assert module.config.position == {"absolute": "absolute", "relative_key": "shaw",
                                    "relative_key_query": "huang_m4"}[kind]
  assert module.head == {"BertModel": "pooler", "BertForMaskedLM": "mlm", "BertForSequenceClassification":
                         "classification", "BertForQuestionAnswering": "span"}[cls]
  hf_out, mine = run_hf(model, ids, types, mask), run_posjax(module, variables, ids, types, mask)
  assert_same_outputs(hf_out, mine)
  if cls == "BertModel":
    np.testing.assert_allclose(np.asarray(mine.pooler_output), hf_out.pooler_output.numpy(), atol=1e-4)


def test_the_relative_table_is_read_reversed():
  # With the table reversed the wrong way round (or not at all), the outputs differ: the check above can fail.
  model = hf_model("relative_key_query")
  module, variables = hf_bert.from_hf_bert(model)
  flipped = jax.tree_util.tree_map_with_path(
      lambda path, x: x[::-1] if "position" in jax.tree_util.keystr(path) else x, variables)
  ids, types, mask = inputs()
  hf_hidden = run_hf(model, ids, types, mask).hidden_states[-1].numpy()
  assert np.abs(np.asarray(run_posjax(module, flipped, ids, types, mask).last_hidden_state) - hf_hidden).max() > 1e-2


@pytest.mark.parametrize("position", ["absolute", "shaw", "huang_m4"])
def test_posjax_to_hugging_face_and_back_is_exact(position):
  config = TransformerConfig.tiny(position=position, max_len=24, type_vocab_size=0 if position == "shaw" else 2,
                                  activation="gelu_tanh" if position == "absolute" else "gelu")
  module = Transformer(config, head="mlm")
  params = randomize(jax.eval_shape(module.init, jax.random.PRNGKey(0), jnp.ones((1, 8), jnp.int32))["params"], scale=0.3)
  model = hf_bert.to_hf_bert(config, {"params": params})
  ids, _, mask = inputs(vocab=config.vocab_size)
  with torch.no_grad():
    hf_out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), output_hidden_states=True)
  assert_same_outputs(hf_out, module.apply({"params": params}, jnp.asarray(ids), attention_mask=jnp.asarray(mask)))
  again, variables = hf_bert.from_hf_bert(model)
  assert again.config == config
  assert_same_params(variables["params"], params)


@pytest.mark.parametrize("position,scan", [("absolute", False), ("huang_m4", False), ("huang_m4", True)])
def test_an_encoder_as_init_returns_it_converts(position, scan):
  # TransformerStack's variables, boxed with their logical axes (what init returns), become a Hugging Face BertModel;
  # scanned layers (stacked parameters) as Hugging Face's per-layer modules.
  config = TransformerConfig.tiny(position=position, max_len=24, scan_layers=scan)
  boxed = TransformerStack(config).init(jax.random.PRNGKey(0), jnp.ones((1, 8), jnp.int32))
  plain = randomize(boxed["params"], scale=0.3)
  is_box = lambda x: isinstance(x, nn.LogicallyPartitioned)
  leaves, treedef = jax.tree_util.tree_flatten(boxed["params"], is_leaf=is_box)
  variables = {"params": jax.tree_util.tree_unflatten(treedef, [
      box.replace_boxed(value) for box, value in zip(leaves, jax.tree_util.tree_leaves(plain))])}
  assert is_box(jax.tree_util.tree_leaves(variables, is_leaf=is_box)[0])
  model = hf_bert.to_hf_bert(config, variables)
  assert type(model).__name__ == "BertModel"
  ids, types, mask = inputs(vocab=config.vocab_size)
  mine = TransformerStack(config).apply({"params": plain}, jnp.asarray(ids), token_type_ids=jnp.asarray(types),
                                        attention_mask=jnp.asarray(mask))
  hf_hidden = run_hf(model, ids, types, mask).last_hidden_state.numpy()
  np.testing.assert_allclose(np.asarray(mine.last_hidden_state), hf_hidden, atol=1e-4)


def test_variables_of_something_else_are_an_error():
  with pytest.raises(ValueError, match=r"expected the variables of a posjax Transformer.*got keys \['dense'\]"):
    hf_bert.to_hf_bert(TransformerConfig.tiny(), {"params": {"dense": {"kernel": np.zeros((2, 2))}}})


def test_relative_key_is_an_alias_of_shaw():
  assert positions.get("relative_key").name == "shaw" and positions.get("relative_key_query").name == "huang_m4"


@pytest.mark.parametrize("serialization", ["safetensors", "bin"])
def test_a_model_directory_reads_like_the_model_and_safetensors_need_no_torch(tmp_path, serialization):
  model = hf_model("relative_key", "BertForQuestionAnswering")
  model.save_pretrained(tmp_path, safe_serialization=serialization == "safetensors")
  module, variables = hf_bert.from_hf_bert(str(tmp_path))
  ids, types, mask = inputs()
  assert_same_outputs(run_hf(model, ids, types, mask), run_posjax(module, variables, ids, types, mask))
  if serialization == "safetensors":
    script = (f"import sys; from posjax.convert import from_hf_bert; from_hf_bert({str(tmp_path)!r}); "
              "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'imported'")
    subprocess.run([sys.executable, "-c", script], check=True, cwd=ROOT, capture_output=True,
                   env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})


def test_bad_sources_are_clear_errors(tmp_path):
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match=r"empty has no config.json"):
    hf_bert.from_hf_bert(str(tmp_path / "empty"))
  model = hf_model("absolute")
  model.save_pretrained(tmp_path / "noweights")
  os.remove(tmp_path / "noweights" / "model.safetensors")
  with pytest.raises(FileNotFoundError, match=r"has no weights: expected model.safetensors or pytorch_model.bin"):
    hf_bert.from_hf_bert(str(tmp_path / "noweights"))
  with pytest.raises(ValueError, match=r"model_type='gpt2'; the converter reads BERT"):
    hf_bert.config_from_hf(transformers.GPT2Config().to_dict())
  with pytest.raises(ValueError, match=r"position_embedding_type='rotary'; posjax reads \['absolute', "):
    hf_bert.config_from_hf({**model.config.to_dict(), "position_embedding_type": "rotary"})
  with pytest.raises(ValueError, match=r"hidden_act='silu'; posjax reads"):
    hf_bert.config_from_hf({**model.config.to_dict(), "hidden_act": "silu"})
  model.save_pretrained(tmp_path / "wrong")
  config = json.loads((tmp_path / "wrong" / "config.json").read_text())
  (tmp_path / "wrong" / "config.json").write_text(json.dumps({**config, "intermediate_size": 40}))
  with pytest.raises(ValueError, match=r"layer_0/mlp_in/kernel has shape \(32, 37\) but its config implies \(32, 40\)"):
    hf_bert.from_hf_bert(str(tmp_path / "wrong"))


def test_models_hugging_face_cannot_express_are_refused():
  with pytest.raises(ValueError, match=r"cannot express position 'tupe_r'"):
    hf_bert.config_to_hf(TransformerConfig.tiny(position="tupe_r"))
  with pytest.raises(ValueError, match=r"clips at max_position_embeddings - 1 = 63; this model's max_distance is 8"):
    hf_bert.config_to_hf(TransformerConfig.tiny(position="huang_m4", position_options={"max_distance": 8}))
  with pytest.raises(ValueError, match=r"no value term"):
    hf_bert.config_to_hf(TransformerConfig.tiny(position="shaw", position_options={"value_term": True}))
  # fields without weights of their own: an export that dropped them would attend everywhere, silently
  with pytest.raises(ValueError, match=r"Hugging Face BERT cannot express layer_windows='5,0' \(it has BERT's: "
                                       r"layer_windows=''\)"):
    hf_bert.config_to_hf(TransformerConfig.tiny(layer_windows="5,0"))
  with pytest.raises(ValueError, match=r"cannot express query_temperature="):
    hf_bert.config_to_hf(TransformerConfig.tiny(query_temperature={"kind": "llama4"}))


def tiny_hf_directory(directory, kind="absolute"):
  """A Hugging Face MLM directory of posjax's tiny runlocal architecture with the built-in vocabulary."""
  vocab_size = Tokenizer.load(VOCAB).vocab_size
  model = hf_model(kind, vocab_size=vocab_size, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                   max_position_embeddings=64)
  model.save_pretrained(directory)
  shutil.copy(VOCAB, os.path.join(directory, "vocab.txt"))
  return model


def test_command_line_round_trip_and_runs_that_start_from_a_converted_model(tmp_path):
  hf = tiny_hf_directory(tmp_path / "hf")
  assert cli.main(["hf-to-posjax", "--from", str(tmp_path / "hf"), "--workdir", str(tmp_path / "posjax")]) == 0
  assert sorted(os.listdir(tmp_path / "posjax")) == ["checkpoints", "model_config.json", "vocab.txt"]
  assert cli.main(["hf-to-posjax", "--from", str(tmp_path / "hf"), "--workdir", str(tmp_path / "posjax")]) == 2

  # Fine-tuning from it (learning rate 0: the encoder stays the converted one).
  params = train(override(load_config("finetune/glue", "task=sst2,runlocal"), total_steps=1, learning_rate=0.0,
                             init=str(tmp_path / "posjax")), str(tmp_path / "sst2"))
  converted = checkpoint.load_params(str(tmp_path / "posjax"))
  assert_same_params(params["encoder"], converted["encoder"])

  # ... and back out: the Hugging Face model equals the posjax run's.
  assert cli.main(["posjax-to-hf", "--workdir", str(tmp_path / "posjax"), "--out", str(tmp_path / "back")]) == 0
  back = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "back").eval()
  ids, types, mask = inputs(vocab=hf.config.vocab_size)
  np.testing.assert_allclose(run_hf(back, ids, types, mask).logits.numpy(), run_hf(hf, ids, types, mask).logits.numpy(),
                             atol=1e-4)
  tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "back")
  assert tokenizer.convert_tokens_to_ids("[CLS]") == Tokenizer.load(VOCAB).cls_id
  assert cli.main(["posjax-to-hf", "--workdir", str(tmp_path / "posjax"), "--step", "3", "--out",
                   str(tmp_path / "x")]) == 2


def broken_source(tmp_path, case):
  """A Hugging Face directory with one fault (``case``), and the line hf-to-posjax answers it with."""
  from safetensors.numpy import save_file

  source = tmp_path / "hf"
  source.mkdir()
  (source / "config.json").write_text(json.dumps({"model_type": "bert"}))
  if case == "truncated safetensors":
    save_file({"weight": np.zeros((8, 8), np.float32)}, source / "model.safetensors")
    name = "model.safetensors"
  elif case == "truncated bin":
    torch.save({"weight": torch.zeros(8, 8)}, source / "pytorch_model.bin")
    name = "pytorch_model.bin"
  else:
    (source / "config.json").write_text('{"model_type": "bert",')
    return source, rf"{source}/config.json is not valid JSON \(Expecting property name enclosed in double quotes: " \
                   r"line 1 column 23 \(char 22\)\); a Hugging Face config.json is the JSON object of the model's " \
                   r"fields that save_pretrained writes"
  data = (source / name).read_bytes()
  (source / name).write_bytes(data[:len(data) // 2])
  return source, rf"{source}/{name} cannot be read as weights \(.+\); the converters read the whole file " \
                 r"save_pretrained writes \(a truncated copy or an interrupted download: copy or download it again\)"


@pytest.mark.parametrize("case", ["truncated safetensors", "truncated bin", "broken config.json", "workdir is a file",
                                  "workdir under a file", "workdir a dangling link", "no torch", "no safetensors"])
def test_a_broken_source_workdir_or_install_is_one_line_before_anything_is_written(tmp_path, monkeypatch, capsys,
                                                                                  case):
  source, message = broken_source(tmp_path, "truncated safetensors" if case.startswith(("workdir", "no ")) else case)
  target = tmp_path / "out"
  command = ["hf-to-posjax", "--from", str(source), "--workdir", str(target)]
  if case == "workdir a dangling link":
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    command[-1] = str(tmp_path / "link")
    message = rf"--workdir={tmp_path}/link is a link to nothing \({tmp_path}/link -> {tmp_path}/nowhere\); " \
              r"--workdir names a directory: a new one, or one without checkpoints"
  elif case.startswith("workdir"):
    (tmp_path / "file").write_text("mine")
    target = tmp_path / "file" / ("run" if "under" in case else "")
    command[-1] = str(target).rstrip("/")
    where = "is a file" if "under" not in case else f"is under the file {tmp_path}/file"
    message = rf"--workdir={command[-1]} {where}; --workdir names a directory: a new one, or one without checkpoints"
  elif case.startswith("no "):
    module = case.removeprefix("no ")
    monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.delitem(sys.modules, "safetensors.numpy", raising=False)
    if module == "torch":
      command = ["posjax-to-hf", "--workdir", str(tmp_path / "run"), "--out", str(target)]
    message = rf"{command[0]} needs the convert extra \(PyTorch, transformers, safetensors\): no module named " \
              rf"'{module}'; install it with pip install -e '\.\[convert\]'"
  assert cli.main(command) == 2
  lines = capsys.readouterr().err.splitlines()
  assert len(lines) == 1 and re.fullmatch(f"error: {message}", lines[0]), lines
  assert not target.exists() or target.read_text() == "mine"


def test_drop_in_pretraining_switches_a_converted_absolute_bert_to_method_4(tmp_path, caplog):
  tiny_hf_directory(tmp_path / "hf")
  cli.hf_to_posjax(str(tmp_path / "hf"), str(tmp_path / "converted"))
  config = config_args.load_config(f"experiments/huang2020/dropin.py:init={tmp_path / 'converted'},runlocal")
  params = train(override(config, total_steps=1, learning_rate=0.0, eval_every_steps=0), str(tmp_path / "m4"))
  converted = flat_params(checkpoint.load_params(str(tmp_path / "converted")))
  mine = flat_params(params)
  fresh = sorted(k for k in mine if k not in converted)
  assert fresh and all("['position']" in k for k in fresh)  # the relative tables, one per layer
  assert sorted(k for k in converted if k not in mine) == ["['encoder']['position']['table']['embedding']"]
  for key in set(mine) & set(converted):
    np.testing.assert_array_equal(mine[key], converted[key], err_msg=key)
  assert "dropped: ['encoder/position/table/embedding']" in caplog.text
  assert json.loads((tmp_path / "m4" / "model_config.json").read_text())["position"] == "huang_m4"
  # ... then SQuAD from the Method-4 run.
  train(override(load_config("finetune/squad", "runlocal"), total_steps=2, init=str(tmp_path / "m4")),
           str(tmp_path / "squad"))
  results = json.loads((tmp_path / "squad" / "results.json").read_text())
  assert results["position"] == "huang_m4" and results["init"] == str(tmp_path / "m4")
  assert all(isinstance(v, float) for r in results["metrics"].values() for v in r.values())  # 128 too: relative
