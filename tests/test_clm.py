"""The causal language-model task: unmasked packed batches, the next-token loss against numpy, and a run of
``configs/clm.py`` through the training loop."""

import functools
import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from posjax.data import corpus, mlm, synthetic
from posjax.data.tokenizer import Tokenizer
from posjax.main import train
from posjax.models import TransformerConfig, Transformer
from posjax.tasks import clm
from posjax.tasks import mlm as mlm_task
from conftest import load_config, override


def tokenizer():
  return Tokenizer.load(os.path.join(synthetic.BUILTIN_DIR, "tiny_vocab.txt"))


def text_corpus():
  return ml_collections.ConfigDict(dict(source="text",
                                        train_files=os.path.join(synthetic.BUILTIN_DIR, "tiny_train.txt")))


def unmasked_batch(packing="full_sentence"):
  return next(mlm.MlmBatches(functools.partial(corpus.documents, text_corpus(), "train"), tokenizer(), max_len=24,
                             batch_size=3, seed=0, packing=packing, masking=None))


def test_unmasked_batches_hold_the_packed_tokens_and_no_masked_fields():
  batch = unmasked_batch()
  assert set(batch) == {"input_ids", "attention_mask", "segment_ids", "positions"}
  assert tokenizer().mask_id not in batch["input_ids"]
  masked = next(mlm.MlmBatches(functools.partial(corpus.documents, text_corpus(), "train"), tokenizer(), max_len=24,
                               batch_size=3, seed=0))
  restored = masked["input_ids"].copy()
  for row, (at, labels, weights) in enumerate(zip(masked["masked_positions"], masked["masked_labels"],
                                                  masked["masked_weights"])):
    restored[row, at[weights > 0]] = labels[weights > 0]
  np.testing.assert_array_equal(restored, batch["input_ids"])  # the same blocks, before masking


@pytest.mark.parametrize("packing,chunk,z_loss", [("full_sentence", 0, 0.0), ("documents", 5, 1e-2)])
def test_the_next_token_loss_is_numpys(packing, chunk, z_loss):
  """Token i predicts token i + 1 where both are real (and, packing documents, of one segment), with the logits
  of a sequence computed whole or in chunks of 5 positions (24 = 5 x 5 - 1: the last chunk padded), and the z-loss
  ``z logsumexp²`` added."""
  batch = unmasked_batch(packing)
  batch["attention_mask"][1, 20:] = 0  # a padded tail
  if packing == "documents":  # a second document from token 12 of row 0
    batch["segment_ids"][0, 12:], batch["positions"][0, 12:] = batch["segment_ids"][0, 0] + 1, np.arange(12)
  model = Transformer(TransformerConfig.tiny(position="alibi", causal=True, vocab_size=tokenizer().vocab_size,
                                             max_len=24), head="lm")
  params = model.init(jax.random.PRNGKey(0), jnp.asarray(batch["input_ids"]))["params"]
  use_segments = packing == "documents"
  got = clm.next_token_row_sums(model, params, batch, None, use_segments=use_segments, deterministic=True,
                                by_position=True, loss_chunk=chunk, z_loss=z_loss)
  inputs = {k: batch[k] for k in ("attention_mask", "positions")} | (
      {"segment_ids": batch["segment_ids"]} if use_segments else {})
  logits = np.asarray(model.apply({"params": params}, jnp.asarray(batch["input_ids"]), **inputs).logits, np.float64)
  ids, real, segments = batch["input_ids"], batch["attention_mask"], batch["segment_ids"]
  at_position = np.zeros((2, ids.shape[1] - 1))  # summed loss and weight at each token index, over the rows
  for b in range(len(ids)):
    loss = correct = weight = 0.0
    for i in range(ids.shape[1] - 1):
      if real[b, i] and real[b, i + 1] and (not use_segments or segments[b, i] == segments[b, i + 1]):
        z = logits[b, i] - logits[b, i].max()
        token = np.log(np.exp(z).sum()) - z[ids[b, i + 1]] + z_loss * (np.log(np.exp(z).sum()) + logits[b, i].max()) ** 2
        loss += token
        at_position[:, i] += (token, 1.0)
        correct += float(np.argmax(logits[b, i]) == ids[b, i + 1])
        weight += 1
    np.testing.assert_allclose([got["loss"][b], got["correct"][b], got["weight"][b]], [loss, correct, weight],
                               rtol=1e-4)
  by_position = clm.clm_metrics(jax.tree.map(np.asarray, got))["loss_by_position"]
  want = [t / w if w else None for t, w in at_position.T]
  assert [v is None for v in by_position] == [v is None for v in want]
  np.testing.assert_allclose([v for v in by_position if v is not None], [v for v in want if v is not None],
                             rtol=1e-4)
  if use_segments:
    assert float(np.sum(got["weight"])) < float(np.sum(real[:, 1:] * real[:, :-1]))  # boundaries are not predicted


def test_the_chunked_loss_has_the_full_logits_gradient():
  """The loss in chunks of 5 positions (the backward recomputing each chunk's logits) has the gradient of optax's
  cross-entropy on the whole ``[B, L, V]`` logits, for every parameter, relative to the largest."""
  import optax

  batch = unmasked_batch("full_sentence")
  model = Transformer(TransformerConfig.llama(vocab_size=tokenizer().vocab_size, hidden_size=32, num_layers=2,
                                              num_heads=4, num_kv_heads=2, intermediate_size=48, max_len=24,
                                              dtype="float32"), head="lm")
  ids = jnp.asarray(batch["input_ids"])
  params = jax.jit(model.init)(jax.random.PRNGKey(0), ids)["params"]

  def chunked(params):
    return jnp.sum(clm.next_token_row_sums(model, params, batch, None, use_segments=False, deterministic=True,
                                           loss_chunk=5)["loss"])

  def whole(params):
    logits = model.apply({"params": params}, ids).logits[:, :-1]
    return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]) * (
        jnp.asarray(batch["attention_mask"])[:, 1:] * jnp.asarray(batch["attention_mask"])[:, :-1]))

  got, want = jax.jit(jax.grad(chunked))(params), jax.jit(jax.grad(whole))(params)
  largest = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(want))
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, atol=1e-5 * largest, rtol=0, err_msg=jax.tree_util.keystr(path))


def test_a_decoder_run_learns_and_reports_perplexity(tmp_path):
  """configs/lm.py's Llama-family decoder (GQA, SwiGLU, RMSNorm, untied head) on the token stream, through the
  loop: it learns, reports perplexity, and evaluates at twice its length."""
  config = override(load_config("lm", "runlocal,position=t5"), total_steps=40, eval_every_steps=40,
                    checkpoint_every_steps=40, batch_size=8, max_len=32)
  config.evals.eval_x2 = {**config.evals.eval.to_dict(), "length_multiple": 2}
  train(config, str(tmp_path))
  lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  losses = [line["loss"] for line in lines if "loss" in line]
  assert losses[-1] < losses[0] - 0.5
  evaluated = [line for line in lines if "eval_perplexity" in line][-1]
  assert evaluated["eval_perplexity"] == pytest.approx(np.exp(evaluated["eval_loss"]), rel=1e-6)
  assert np.isfinite(evaluated["eval_x2_loss"])  # rows of 64 tokens, twice the training length
  model = json.loads((tmp_path / "config.json").read_text())["model"]
  assert (model["causal"], model["num_kv_heads"], model["mlp"], model["lm_head"]) == (True, 2, "gated", "linear")


def test_clm_needs_a_causal_model(tmp_path):
  config = override(load_config("clm", "runlocal"), **{"model.causal": False})
  with pytest.raises(ValueError, match=r"task='clm' trains a decoder: set model.causal=True"):
    train(config, str(tmp_path))


def test_an_evaluation_past_a_learned_table_is_unsupported():
  evaluations = {"eval": mlm_task.Evaluation([{}], {}, 32), "eval_x2": mlm_task.Evaluation([{}], {}, 64)}
  for position, unsupported in (("absolute", True), ("alibi", False)):
    model_config = TransformerConfig.tiny(position=position, max_len=32, causal=True)
    evaluators = mlm_task.corpus_evaluators(evaluations, model_config, None, clm.clm_metrics)
    assert evaluators["eval"].unsupported is None
    assert (evaluators["eval_x2"].unsupported is not None) == unsupported
    if unsupported:
      assert "learned table of max_len=32 positions" in evaluators["eval_x2"].unsupported


def test_evaluators_given_tokens_read_the_same_text_at_every_length():
  # the decoder recipe's stream packing: rows of 32 and of 128 tokens are the same 1,024 tokens of the held-out text,
  # cut differently (Press et al. 2022's protocol: only the context changes)
  config = override(load_config("lm", "runlocal"), batch_size=8, max_len=32)
  config.evals = ml_collections.ConfigDict({
      f"x{m}": {"kind": "clm", "split": "eval", "tokens": 1024, "max_len": 32 * m} for m in (1, 4)})
  _, evaluations = mlm_task.corpus_batches(config, Tokenizer.load(config.data.vocab_file), 8, masked=False)
  text = {name: np.concatenate([batch["input_ids"].reshape(-1) for batch in e.rows]) for name, e in
          evaluations.items()}
  assert [len(evaluations[n].rows) for n in ("x1", "x4")] == [4, 1] and text["x1"].shape == (1024,)
  np.testing.assert_array_equal(text["x1"], text["x4"])
  assert clm.clm_metrics({"loss": np.ones(3), "correct": np.ones(3), "weight": np.full(3, 31.0)})["tokens"] == 93
  config.evals.x1.batches = 2
  with pytest.raises(ValueError, match=r"config.evals.x1: give batches or tokens \(a positive count\), not both"):
    mlm_task.corpus_batches(config, Tokenizer.load(config.data.vocab_file), 8, masked=False)


def test_sliding_window_evaluation_predicts_each_token_once_after_its_windows_context():
  # windows of 64 tokens every 16 over the first 256 tokens of the held-out stream: token t is new in the window
  # ending at the next multiple of 16 after it, which starts 64 tokens earlier (or at the text's start); the reference
  # reruns the model on each token's own window
  config = override(load_config("lm", "runlocal,position=alibi"), batch_size=4, max_len=64)
  tokenizer = Tokenizer.load(config.data.vocab_file)
  config.evals = ml_collections.ConfigDict({"sw": {"kind": "clm", "split": "eval", "tokens": 256, "max_len": 64,
                                                   "stride": 16},
                                            "flat": {"kind": "clm", "split": "eval", "tokens": 256, "max_len": 16}})
  _, evaluations = mlm_task.corpus_batches(config, tokenizer, 4, masked=False)
  text = np.concatenate([b["input_ids"].reshape(-1) for b in evaluations["flat"].rows])[:256]
  model = Transformer(TransformerConfig.from_config(config.model, tokenizer.vocab_size, 64), head="lm")
  params = jax.jit(model.init)(jax.random.PRNGKey(0), jnp.zeros((1, 64), jnp.int32))["params"]
  sums = [clm.next_token_row_sums(model, params, b, None, use_segments=False, deterministic=True)
          for b in evaluations["sw"].rows]
  got = clm.clm_metrics({k: np.concatenate([np.asarray(s[k]) for s in sums]) for k in sums[0]})
  apply = jax.jit(model.apply)
  losses = []
  for t in range(1, 256):
    end = min(-(-(t + 1) // 16) * 16, 256)
    start = max(0, end - 64)
    logits = np.asarray(apply({"params": params}, jnp.asarray(text[None, start:end])).logits[0, t - start - 1],
                        np.float64)
    losses.append(np.log(np.exp(logits - logits.max()).sum()) + logits.max() - logits[text[t]])
  assert got["tokens"] == 255
  np.testing.assert_allclose(got["loss"], np.mean(losses), rtol=1e-5)
  config.evals.sw.stride = 24
  with pytest.raises(ValueError, match=r"config.evals.sw: stride=24 evaluates one token stream in one process: it must "
                                       r"divide the length 64"):
    mlm_task.corpus_batches(config, tokenizer, 4, masked=False)


def test_an_encoders_evaluators_mask_the_same_text_once_at_every_length():
  # model=mlm in the length harness: the held-out stream (documents joined by [SEP], rebuilt here from the corpus's
  # documents and the tokenizer) masked once, cut into [CLS] + 31 and [CLS] + 127 tokens: the same masked tokens,
  # with the same labels, at both lengths
  config = override(load_config("pretrain", "runlocal"), batch_size=4, max_len=32)
  config.evals = ml_collections.ConfigDict({
      f"x{m}": {"kind": "mlm", "split": "eval", "tokens": 512, "max_len": 32 * m, "same_text": True} for m in (1, 4)})
  tok = Tokenizer.load(config.data.vocab_file)
  _, evaluations = mlm_task.corpus_batches(config, tok, 4)
  documents = corpus.documents(config.data, "eval", 0, 1)
  stream = np.asarray([t for d in documents for t in [*sum(tok.encode_batch(d), []), tok.sep_id]][:512])
  masked, shown = {}, []
  for name, evaluation in evaluations.items():
    span = evaluation.length - 1
    rows = [{k: b[k][i] for k in b} for b in evaluation.rows for i in range(4)]
    assert all(r["input_ids"][0] == tok.cls_id for r in rows if r["attention_mask"].any())
    text = np.concatenate([r["input_ids"][1:r["attention_mask"].sum()] for r in rows])
    for n, r in enumerate(rows):  # the labels put back: the held-out stream itself
      at = r["masked_positions"][r["masked_weights"] > 0]
      shown.extend(r["input_ids"][at] == tok.mask_id)
      text[n * span + at - 1] = r["masked_labels"][r["masked_weights"] > 0]
      masked.setdefault(name, []).extend((n * span + at - 1).tolist())
    np.testing.assert_array_equal(text, stream)
  assert masked["x1"] == masked["x4"] and 0.1 < len(masked["x1"]) / 512 < 0.2
  assert 0.6 < np.mean(shown) < 0.95  # BERT's 80% of the masked tokens shown as [MASK]
