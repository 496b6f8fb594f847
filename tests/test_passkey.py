"""Passkey retrieval (``kind="passkey"`` evaluators of the clm task): the prompt's layout, its texts in a vocabulary,
the scoring of greedy decoding (against a loop over the full forward) on a needle grid, the prompts put into
training batches, and the evaluators a clm run builds."""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import load_config

from posjax.data.tokenizer import Tokenizer
from posjax.models import TransformerConfig, Transformer
from posjax.tasks import clm, passkey

# [CLS] = 2, [SEP] = 3; intro 10 11; filler 20 21 22; key line "30 {key} 31 32 {key} 33"; question 40 41.
TEMPLATE = passkey.Template(intro=[10, 11], filler=[20, 21, 22], key_line=[[30], [31, 32], [33]], question=[40, 41],
                            start=[2], sep=[3])


def test_a_prompt_hides_the_key_at_its_depth_between_filler_cut_from_its_start():
  # 19 fixed tokens (1 + 2 + 8 + 2 + 2 + 4) leave 5 of filler in a row of 24.
  assert passkey.fixed_tokens(TEMPLATE, 2) == 19
  assert passkey.prompt(TEMPLATE, [7, 8], depth=2, length=24) == [
      2, 10, 11, 3, 20, 21, 3, 30, 7, 8, 31, 32, 7, 8, 33, 3, 20, 21, 22, 3, 40, 41, 7, 8]
  assert passkey.prompt(TEMPLATE, [7, 8], depth=5, length=24) == [
      2, 10, 11, 3, 20, 21, 22, 20, 21, 3, 30, 7, 8, 31, 32, 7, 8, 33, 3, 3, 40, 41, 7, 8]
  assert passkey.prompt(TEMPLATE, [7, 8], depth=0, length=19) == [
      2, 10, 11, 3, 3, 30, 7, 8, 31, 32, 7, 8, 33, 3, 3, 40, 41, 7, 8]
  with pytest.raises(ValueError, match=r"a passkey row needs at least 19 tokens, got 18"):
    passkey.prompt(TEMPLATE, [7, 8], depth=0, length=18)
  with pytest.raises(ValueError, match=r"passkey depth 6 must be within the row's 5 filler tokens"):
    passkey.prompt(TEMPLATE, [7, 8], depth=6, length=24)


def test_the_texts_become_the_template_and_a_symbol_must_be_one_known_token():
  tokenizer = Tokenizer.load("configs/data/tiny_vocab.txt")
  spec = {**passkey.DEFAULTS, **load_config("length", "runlocal").passkey.to_dict()}
  pieces, symbols = passkey.template(tokenizer, spec)
  assert pieces.key_line == [tokenizer.encode("the token is"), tokenizer.encode(".")]
  assert pieces.question == tokenizer.encode("the token is") and pieces.intro == []
  assert [tokenizer.backend.id_to_token(i) for i in symbols] == spec["symbols"].split()
  with pytest.raises(ValueError, match=r"passkey symbol '0' is \[1\] in this vocabulary; each symbol must be one "
                                       r"known token"):
    passkey.template(tokenizer, {**spec, "symbols": "0 1 2"})  # the tiny vocabulary has no digits
  with pytest.raises(ValueError, match=r"passkey key_line='the token' has no \{key\}"):
    passkey.template(tokenizer, {**spec, "key_line": "the token"})


def test_drawn_rows_score_the_tokens_before_the_final_key_at_every_depth():
  batch = passkey.draw(TEMPLATE, [7, 8, 9], 2, np.random.default_rng(0), 200, 24)
  ids, positions, labels = batch["input_ids"], batch["masked_positions"], batch["masked_labels"]
  assert ids.shape == (200, 24) and positions.tolist() == [[21, 22]] * 200
  assert (np.take_along_axis(ids, positions + 1, axis=1) == labels).all()  # each scored token predicts a key token
  depths = set()
  for row, key in zip(ids.tolist(), labels.tolist()):
    depth = row.index(30) - 5  # the key line starts after [CLS] intro [SEP] filler[:depth] [SEP]
    assert row == passkey.prompt(TEMPLATE, key, depth, 24)
    depths.add(depth)
  assert depths == {0, 1, 2, 3, 4, 5} and set(labels.ravel()) == {7, 8, 9}


class TableDecoder:
  """A fake decoder whose prediction at each position is read from its parameters: ``params["next_BxL"][b, i]``
  is the token it names most likely after position ``i`` of row ``b``."""

  vocab = 50

  def apply(self, variables, input_ids, masked_positions, deterministic):
    assert deterministic
    picked_BxD = jnp.take_along_axis(variables["params"]["next_BxL"], masked_positions, axis=1)
    return types.SimpleNamespace(logits=jax.nn.one_hot(picked_BxD, self.vocab) + 0.1 * jnp.ones(self.vocab))


def score(batch, next_BxL):
  outputs = jax.tree.map(np.asarray, passkey.row_sums(TableDecoder(), {"next_BxL": next_BxL}, batch))
  return passkey.metrics(outputs)


def test_retrieval_counts_rows_whose_whole_key_greedy_decoding_reproduces():
  batch = passkey.draw(TEMPLATE, [7, 8, 9], 2, np.random.default_rng(1), 4, 24)
  truth = np.concatenate([batch["input_ids"][:, 1:], np.zeros((4, 1), np.int32)], axis=1)  # the next tokens
  assert score(batch, truth) == {"accuracy": 1.0, "digit_accuracy": 1.0}
  wrong_elsewhere = np.where(np.arange(24) < 21, 0, truth)  # only the key's predictions count
  assert score(batch, wrong_elsewhere) == {"accuracy": 1.0, "digit_accuracy": 1.0}
  one_wrong = truth.copy()
  one_wrong[0, 22] = 49  # row 0's last key token
  assert score(batch, one_wrong) == {"accuracy": 0.75, "digit_accuracy": 7 / 8}
  echo = batch["input_ids"]  # predicting the token itself, not the next one, retrieves nothing
  assert score(batch, echo)["accuracy"] == 0.0
  padded = {k: np.concatenate([v, np.zeros_like(v)]) for k, v in batch.items()}  # padding rows weigh nothing
  assert score(padded, np.concatenate([one_wrong, one_wrong])) == {"accuracy": 0.75, "digit_accuracy": 7 / 8}


def test_a_clm_run_builds_passkey_evaluators_and_a_learned_table_reports_unsupported():
  config = load_config("clm", "position=absolute,runlocal")
  spec = {**load_config("length", "runlocal").passkey.to_dict(), "kind": "passkey"}
  config.evals = {"eval": config.evals.eval.to_dict(), "passkey": spec,
                  "passkey_x2": {**spec, "length_multiple": 2}}
  task = clm.build(config, 16)
  assert set(task.evaluators) == {"eval", "passkey", "passkey_x2"}
  batches = task.evaluators["passkey"].batches
  assert len(batches) == 2 and batches[0]["input_ids"].shape == (16, 64) and batches[0]["masked_labels"].shape == (16, 3)
  assert task.evaluators["passkey"].unsupported is None
  assert task.evaluators["passkey_x2"].unsupported and not task.evaluators["passkey_x2"].batches  # past the table
  config.evals = {"passkey": {**spec, "digits": 0}}
  with pytest.raises(ValueError, match=r"config.evals.passkey.digits=0 must be a whole number >= 1"):
    clm.build(config, 16)
  config.evals = {"passkey": {**spec, "depth": 3}}
  with pytest.raises(ValueError, match=r"config.evals.passkey: unknown passkey option\(s\) \['depth'\]"):
    clm.build(config, 16)


def test_greedy_and_teacher_forced_scoring_agree_with_a_loop_over_the_full_forward_at_each_grid_depth():
  config = TransformerConfig.decoder(vocab_size=50, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                     intermediate_size=48, max_len=24, dtype="float32", position="rope")
  model = Transformer(config, head="lm")
  params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 24), jnp.int32))["params"]
  batch = passkey.draw(TEMPLATE, [7, 8, 9], 2, np.random.default_rng(2), 4, 24, depths=3)
  assert batch["depth_index"].tolist() == [0, 1, 2, 0]
  assert [row.index(30) - 5 for row in batch["input_ids"].tolist()] == [0, 2, 5, 0]  # depths 0, round(2.5), 5
  ids = batch["input_ids"][:, :-2]  # the reference: rerun the full forward for each new token
  apply = jax.jit(model.apply)
  for _ in range(2):
    logits = apply({"params": params}, jnp.asarray(ids)).logits
    ids = np.concatenate([ids, np.argmax(np.asarray(logits[:, -1]), -1)[:, None]], axis=1)
  labels = ids[:, -2:].copy()
  labels[2:, 1] = (labels[2:, 1] + 1) % 50  # rows 2 and 3: the first key token right, the second wrong
  batch = {**batch, "masked_labels": labels.astype(np.int32),
           "input_ids": np.concatenate([ids[:, :-2], labels], axis=1).astype(np.int32)}
  expected = {"accuracy": 0.5, "digit_accuracy": 0.75, "accuracy@0.00": 0.5, "accuracy@0.50": 1.0,
              "accuracy@1.00": 0.0}
  for scorer in (passkey.greedy_row_sums, passkey.row_sums):
    outputs = jax.tree.map(np.asarray, jax.jit(functools.partial(scorer, model))(params, batch))
    assert passkey.metrics(outputs, depths=3) == expected, scorer


class Batches:
  """A corpus's batches as the loop reads them: numbered rows of zeros, with a resumable position."""

  def __init__(self, length: int = 32):
    self.served, self.length = 0, length

  def __next__(self):
    self.served += 1
    shape = (4, self.length)
    return {"input_ids": np.full(shape, self.served, np.int32), "attention_mask": np.zeros(shape, np.int32),
            "segment_ids": np.zeros(shape, np.int32), "positions": np.zeros(shape, np.int32)}

  def state(self):
    return {"served": self.served}

  def restore(self, state):
    self.served = state["served"]


def test_training_rows_replace_a_fraction_of_each_batch_with_prompts_and_resume_exactly():
  tokenizer = Tokenizer.load("configs/data/tiny_vocab.txt")
  spec = {**passkey.training_defaults().to_dict(), **load_config("length", "runlocal").passkey.to_dict(),
          "fraction": 0.5}
  del spec["batches"], spec["depths"]
  rows = passkey.TrainingRows(Batches(), tokenizer, spec, local_batch=4, length=32, seed=0)
  pieces, _ = passkey.template(tokenizer, {**passkey.DEFAULTS, **spec})
  first = [next(rows) for _ in range(3)]
  for n, batch in enumerate(first, 1):
    for row in batch["input_ids"][:2].tolist():  # rows 0 and 1: prompts, at any depth
      key = row[-3:]
      assert any(row == passkey.prompt(pieces, key, depth, 32) for depth in range(33 - passkey.fixed_tokens(pieces, 3)))
    assert (batch["input_ids"][2:] == n).all() and (batch["attention_mask"][:2] == 1).all()
    assert (batch["segment_ids"][:2] == 1).all() and (batch["positions"][:2] == np.arange(32)).all()
  assert not (first[0]["input_ids"][:2] == first[1]["input_ids"][:2]).all()  # fresh prompts per batch
  resumed = passkey.TrainingRows(Batches(), tokenizer, spec, local_batch=4, length=32, seed=0)
  state = passkey.TrainingRows(Batches(), tokenizer, spec, local_batch=4, length=32, seed=0)
  next(state)
  resumed.restore(state.state())
  np.testing.assert_array_equal(next(resumed)["input_ids"], first[1]["input_ids"])
  with pytest.raises(ValueError, match=r"config.passkey_train.fraction=1.5 must be in \(0, 1\]"):
    passkey.TrainingRows(Batches(), tokenizer, {**spec, "fraction": 1.5}, local_batch=4, length=32, seed=0)
  with pytest.raises(ValueError, match=r"config.passkey_train: unknown passkey option\(s\) \['batches'\]"):
    passkey.TrainingRows(Batches(), tokenizer, {**spec, "batches": 2}, local_batch=4, length=32, seed=0)
