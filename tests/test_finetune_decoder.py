"""Fine-tuning from a decoder: a causal model is never read at its first token, which has seen only itself. GLUE's
head reads each row's last real token (Hugging Face's ``LlamaForSequenceClassification``), SQuAD's span head gives
per-token logits (``LlamaForQuestionAnswering``): both against Hugging Face on random weights, through the tasks
that ``configs/finetune`` builds from a converted decoder."""

import os

import flax.linen as nn
import jax
import numpy as np
import pytest

from conftest import load_config, override
from posjax import tasks
from posjax.data import synthetic
from posjax.data.tokenizer import Tokenizer
from posjax.models import TransformerConfig, TransformerStack, Transformer
from posjax.models.heads import classifier_token


def test_a_causal_classifier_reads_each_rows_last_real_token_and_refuses_its_first():
  # an encoder's reads [CLS]: test_electra_official's classifier test
  lengths = np.array([10, 6, 1])
  ids = np.random.default_rng(0).integers(5, 60, (3, 10)).astype(np.int32)
  mask = (np.arange(10)[None] < lengths[:, None]).astype(np.int32)
  rng = np.random.default_rng(1)
  head = {"kernel": rng.normal(size=(32, 3)).astype(np.float32), "bias": rng.normal(size=3).astype(np.float32)}
  causal = TransformerConfig.tiny(causal=True, position="rope", vocab_size=60, max_len=16)
  assert classifier_token(causal) == "last" and classifier_token(TransformerConfig.tiny()) == "first"
  model = Transformer(causal, "classification", 3, "cls")
  params = {**nn.unbox(jax.jit(model.init)(jax.random.PRNGKey(0), ids)["params"]), "classifier": head}
  h = np.asarray(jax.jit(TransformerStack(causal).apply)({"params": params["encoder"]}, ids, attention_mask=mask)
                 .last_hidden_state, np.float64)
  want = h[np.arange(3), lengths - 1] @ np.float64(head["kernel"]) + head["bias"]
  got = jax.jit(model.apply)({"params": params}, ids, attention_mask=mask).logits
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match=r"^classifier_token='first' reads a causal model at its first token, which "
                                       r"has seen only itself; use 'last' \(or 'auto'\)$"):
    classifier_token(causal, "first")
  with pytest.raises(ValueError, match=r"^classifier_token='first' reads a causal model"):
    Transformer(causal, "classification", 3, "cls", "first").init(jax.random.PRNGKey(0), ids)
  with pytest.raises(ValueError, match=r"classifier_token='middle' is not allowed; choose one of \['auto', 'first', "
                                       r"'last'\]"):
    Transformer(causal, "classification", 3, "cls", "middle").init(jax.random.PRNGKey(0), ids)
  with pytest.raises(ValueError, match=r"rows of packed documents \(segment_ids\) would be read at their last"):
    model.apply({"params": params}, ids, attention_mask=mask, segment_ids=np.ones_like(ids))


def test_glue_and_squad_from_a_converted_llama_give_hugging_faces_classifier_and_question_answering_logits(tmp_path):
  transformers = pytest.importorskip("transformers")
  torch = pytest.importorskip("torch")
  from posjax.convert import __main__ as cli

  vocab = os.path.join(synthetic.BUILTIN_DIR, "tiny_vocab.txt")
  tokenizer = Tokenizer.load(vocab)
  hf_config = transformers.LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=48,
                                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                       max_position_embeddings=64, pad_token_id=tokenizer.pad_id,
                                       attn_implementation="eager")
  torch.manual_seed(0)
  lm, classifier, qa = (getattr(transformers, f"LlamaFor{kind}")(hf_config)
                        for kind in ("CausalLM", "SequenceClassification", "QuestionAnswering"))
  with torch.no_grad():  # every weight away from its initial value (norm scales from 1), the heads random
    for parameter in lm.parameters():
      parameter.add_(0.2 * torch.randn_like(parameter))
    for parameter in (classifier.score.weight, *qa.qa_outputs.parameters()):
      parameter.copy_(torch.randn_like(parameter))
  classifier.model.load_state_dict(lm.model.state_dict())
  qa.transformer.load_state_dict(lm.model.state_dict())
  lm.save_pretrained(tmp_path / "hf", safe_serialization=True)
  assert cli.main(["hf-to-posjax", "--from", str(tmp_path / "hf"), "--workdir", str(tmp_path / "llama")]) == 0
  heads = {"glue": {"classifier": {"kernel": classifier.score.weight.detach().numpy().T,
                                   "bias": np.zeros(2, np.float32)}},
           "squad": {"span": {"kernel": qa.qa_outputs.weight.detach().numpy().T,
                              "bias": qa.qa_outputs.bias.detach().numpy()}}}

  for name, arg in (("glue", "task=rte,runlocal"), ("squad", "runlocal")):
    config = override(load_config(f"finetune/{name}", arg), init=str(tmp_path / "llama"),
                      **{"data.vocab_file": vocab})
    if name == "glue":
      assert tasks.build(config, config.batch_size).model.classifier_token == "last"  # TUPE's recipe: the pooler
      config.classifier_input = "cls"  # the state itself, into one dense layer: Hugging Face's score
    task = tasks.build(config, config.batch_size)
    assert task.model_config.causal and any(note.startswith("a causal model: ") for note in task.notes)
    shapes = jax.eval_shape(task.model.init, jax.random.PRNGKey(0), **task.init_inputs)["params"]
    params = task.load_init(nn.unbox(shapes))  # the encoder as the run loads it; the head Hugging Face's
    params = {**params, **heads[name]}
    evaluator = next(iter(task.evaluators.values()))
    batch = next(iter(evaluator.batches))
    real, mask = batch["index"] >= 0, batch["attention_mask"].astype(bool)
    assert len(set(mask[real].sum(1))) > 1  # rows of several lengths, padded on the right
    got = jax.jit(evaluator.predict)(params, batch)
    with torch.no_grad():
      inputs = dict(input_ids=torch.from_numpy(np.asarray(batch["input_ids"][real], np.int64)),
                    attention_mask=torch.from_numpy(np.asarray(mask[real], np.int64)))
      if name == "glue":
        want = classifier(**inputs).logits.numpy()
        np.testing.assert_allclose(np.asarray(got["logits"])[real], want, atol=2e-4 * np.abs(want).max(), rtol=0)
        continue
      out = qa(**inputs)
    for key, want in (("start", out.start_logits.numpy()), ("end", out.end_logits.numpy())):
      np.testing.assert_allclose(np.asarray(got[key])[real][mask[real]], want[mask[real]],
                                 atol=2e-4 * np.abs(want).max(), rtol=0)
