"""ELECTRA's official choices (google-research/electra), each an option, against its formula written out in numpy:
the masking of ``pretrain_helpers.mask`` and ``scatter_update``, ``disallow_correct``, the classifier of
``finetune/classification/classification_tasks.py``; and the recipes that use them (``configs/electra.py``,
``recipe=electra``, TUPE's Table 4). The optimizer's (Adam without bias correction, ``_get_layer_lrs``):
``test_layerwise_decay.py``."""

import itertools
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from conftest import load_config
from posjax import config_args, tasks
from posjax.data import corpus, mlm, synthetic
from posjax.data.tokenizer import Tokenizer
from posjax.experiments import protocol, sweep
from posjax.models import TransformerConfig, TransformerStack, Transformer
from posjax.tasks import electra

TOKENIZER = Tokenizer.load(os.path.join(synthetic.BUILTIN_DIR, "tiny_vocab.txt"))
ELECTRA_MASKING = mlm.Masking(0.15, False, 0.85, 0.0, "electra")


def corpus_blocks(max_len=48, n=40):
  data = ml_collections.ConfigDict(dict(source="text", train_files=os.path.join(synthetic.BUILTIN_DIR,
                                                                                "tiny_train.txt")))
  docs = (TOKENIZER.encode_batch(d) for d in corpus.documents(data, "train"))
  return list(itertools.islice(mlm.pack_full_sentences(docs, max_len, TOKENIZER.cls_id, TOKENIZER.sep_id,
                                                       TOKENIZER.pad_id), n))


def official_mask(block, rng, max_predictions, rate=0.15, mask_token=0.85):
  """``pretrain_helpers.mask`` for one row, as loops: N = max_predictions draws of which the first
  ``max(1, min(N, round(sum(input_mask) * rate)))`` are weighted, each position drawn uniformly over the candidates
  (real tokens but [CLS], [SEP], [MASK]) with replacement; ``scatter_update`` then writes [MASK] at every weighted
  draw whose uniform is below ``mask_token``, never at the first token. Draw order as ``mask_block``'s rng use."""
  ids, input_mask = block["input_ids"], block["attention_mask"]
  never = {TOKENIZER.cls_id, TOKENIZER.sep_id, TOKENIZER.mask_id}
  candidates = [i for i in range(len(ids)) if input_mask[i] and int(ids[i]) not in never]
  num_tokens = np.float32(input_mask.sum())  # tf.cast(tf.reduce_sum(input_mask, -1), tf.float32)
  num_to_predict = max(1, min(max_predictions, int(np.round(num_tokens * np.float32(rate)))))  # tf.round: to even
  positions = [candidates[k] for k in rng.integers(0, len(candidates), num_to_predict)]
  uniform = rng.random(num_to_predict)
  rng.integers(0, TOKENIZER.vocab_size, num_to_predict)  # the random tokens mask_block draws (none used at 0.0)
  out = ids.copy()
  for position, u in zip(positions, uniform):
    if u < mask_token and position != 0:
      out[position] = TOKENIZER.mask_id
  pad = max_predictions - num_to_predict
  return {"input_ids": out, "masked_positions": np.asarray(positions + [0] * pad),
          "masked_labels": np.asarray([ids[p] for p in positions] + [0] * pad),
          "masked_weights": np.asarray([1.0] * num_to_predict + [0.0] * pad)}


def test_electra_masking_equals_the_official_formula_draw_for_draw():
  max_predictions = mlm.default_max_predictions(48, ELECTRA_MASKING)
  assert max_predictions == int((0.15 + 0.005) * 48) == 7
  duplicates = 0
  for k, block in enumerate(corpus_blocks()):
    got = mlm.mask_block(block, np.random.default_rng([k, 3]), TOKENIZER, max_predictions, ELECTRA_MASKING)
    want = official_mask(block, np.random.default_rng([k, 3]), max_predictions)
    for key, value in want.items():
      np.testing.assert_array_equal(got[key], value, err_msg=f"block {k}, {key}")
    chosen = got["masked_positions"][got["masked_weights"] > 0]
    duplicates += len(chosen) - len(set(chosen.tolist()))
  assert duplicates > 0  # with replacement: the official draws repeat positions
  assert mlm.default_max_predictions(512, ELECTRA_MASKING) == 79
  assert mlm.default_max_predictions(512, mlm.Masking(0.25, selection="electra")) == 130


def test_electra_masking_counts_every_real_token_and_may_mask_unk():
  """A block of 40 real tokens, 10 of them [SEP] and 5 [UNK]: the official count is round(0.15 x 40) = 6 draws
  (BERT's permutation: round(0.15 x 25) = 4 of the 25 others); [UNK] is a candidate there."""
  ids = np.full(48, TOKENIZER.pad_id, np.int32)
  ids[0] = TOKENIZER.cls_id
  ids[1:40] = 50
  ids[4:40:4] = TOKENIZER.sep_id
  ids[39] = TOKENIZER.sep_id
  ids[[2, 6, 10, 14, 18]] = TOKENIZER.unk_id
  block = {"input_ids": ids, "attention_mask": (np.arange(48) < 40).astype(np.int32)}
  assert (ids[:40] == TOKENIZER.sep_id).sum() == 10
  drawn = set()
  for seed in range(200):
    out = mlm.mask_block(block, np.random.default_rng(seed), TOKENIZER, 7, ELECTRA_MASKING)
    assert out["masked_weights"].sum() == 6
    drawn |= set(out["masked_positions"][:6].tolist())
    bert = mlm.mask_block(block, np.random.default_rng(seed), TOKENIZER, 7, mlm.Masking(0.15, False, 0.85, 0.0))
    assert bert["masked_weights"].sum() == 4
  assert drawn == {i for i in range(1, 40) if ids[i] != TOKENIZER.sep_id}  # [UNK] included, [CLS]/[SEP] never
  # float32 as the official count: 190 x 0.15 is 28.500001 there (29 draws), 28.499999 in float64.
  long = {"input_ids": np.full(256, 50, np.int32), "attention_mask": (np.arange(256) < 190).astype(np.int32)}
  assert mlm.mask_block(long, np.random.default_rng(0), TOKENIZER, 39, ELECTRA_MASKING)["masked_weights"].sum() == 29
  with pytest.raises(ValueError, match=r"data.mask_selection='nope' is not one of \['permutation', 'electra'\]"):
    mlm.Masking(selection="nope")


def official_scatter_update(sequence, updates, positions):
  """``pretrain_helpers.scatter_update`` for int ids, one row at a time: duplicate positions get the floor of
  their updates' mean; the first token is never updated. Returns the sequence and the updated mask."""
  out, updated = sequence.copy(), np.zeros(sequence.shape, bool)
  for row in range(sequence.shape[0]):
    sums, counts = {}, {}
    for position, update in zip(positions[row], updates[row]):
      sums[position] = sums.get(position, 0) + int(update)
      counts[position] = counts.get(position, 0) + 1
    for position in sums:
      if position != 0:
        out[row, position] = sums[position] // counts[position]
        updated[row, position] = True
  return out, updated


def test_replaced_tokens_follow_the_official_scatter_update_with_repeated_positions():
  """``_get_fake_data``: the samples written by ``scatter_update`` over the unmasked ids; a position is replaced
  where it was written and differs from the original. Padding draws (weight 0) point at position 0 officially."""
  rng = np.random.default_rng(0)
  rows, length, draws = 6, 16, 8
  original = rng.integers(5, 60, (rows, length)).astype(np.int32)
  positions = rng.integers(1, 6, (rows, draws)).astype(np.int32)  # few positions: many repeats
  weights = (np.arange(draws) < rng.integers(3, draws + 1, (rows, 1))).astype(np.float32)
  positions = (positions * weights).astype(np.int32)
  labels = np.take_along_axis(original, positions, 1)
  masked = original.copy()
  for r in range(rows):
    masked[r, positions[r][weights[r] > 0]] = 4
  sampled = rng.integers(5, 60, (rows, draws)).astype(np.int32)
  sampled[:, 0] = labels[:, 0]  # a sample equal to its original
  fake, replaced = electra.replace_tokens(jnp.asarray(masked), jnp.asarray(positions), jnp.asarray(weights),
                                          jnp.asarray(sampled), jnp.asarray(labels))
  want_fake, written = official_scatter_update(original, sampled, positions)
  want_fake = np.where(written, want_fake, masked)  # unwritten positions keep the generator's input
  np.testing.assert_array_equal(fake, want_fake)
  np.testing.assert_array_equal(replaced, written & (want_fake != original))
  assert (np.asarray(replaced).sum(1) < (weights > 0).sum(1)).all()  # repeats and equal samples replace fewer


def test_disallow_correct_never_samples_the_original_and_keeps_the_other_tokens_odds():
  """The official ``sample_from_softmax(logits / temperature, disallow=one_hot(label))``: the label's logit minus
  1000, so the draws follow the softmax over the other tokens."""
  logits = jnp.asarray([[[4.0, 0.5, -1.0, 0.0, 1.0]]])  # the label, 0, is by far the likeliest
  labels = jnp.asarray([[0]])
  keys = jax.random.split(jax.random.PRNGKey(0), 40_000)
  draws = np.asarray(jax.vmap(lambda k: electra.sample(k[None], logits, 2.0, labels))(keys))[:, 0, 0]
  frequencies = np.bincount(draws, minlength=5) / len(draws)
  p = np.exp(np.asarray(logits[0, 0]) / 2.0)
  p[0] = 0.0
  np.testing.assert_allclose(frequencies, p / p.sum(), atol=0.01)
  assert frequencies[0] == 0.0
  assert electra.options(ml_collections.ConfigDict({"electra": {}}))["disallow_correct"] is False


def test_electras_classifier_is_one_dense_layer_on_the_cls_state():
  """``ClassificationTask.get_prediction_module``: ``dense(dropout(sequence_output[:, 0]))``, no pooler (ELECTRA's
  ``get_pooled_output`` is the first token's state); posjax's default keeps BERT's pooler."""
  config = TransformerConfig.tiny(vocab_size=60, max_len=16)
  ids = jnp.asarray(np.random.default_rng(0).integers(5, 60, (3, 10)), jnp.int32)
  model = Transformer(config, "classification", 3, "cls")
  params = nn.unbox(model.init(jax.random.PRNGKey(0), ids)["params"])
  assert set(params) == {"encoder", "classifier"}
  rng = np.random.default_rng(1)
  params["classifier"] = {"kernel": rng.normal(size=(config.hidden_size, 3)).astype(np.float32),
                          "bias": rng.normal(size=3).astype(np.float32)}
  h = np.asarray(TransformerStack(config).apply({"params": params["encoder"]}, ids).last_hidden_state, np.float64)
  want = h[:, 0] @ np.float64(params["classifier"]["kernel"]) + params["classifier"]["bias"]
  np.testing.assert_allclose(model.apply({"params": params}, ids).logits, want, rtol=1e-5, atol=1e-5)
  pooled = Transformer(config, "classification", 3)
  assert "pooler" in nn.unbox(pooled.init(jax.random.PRNGKey(0), ids)["params"])
  with pytest.raises(ValueError, match=r"classifier_input='mean' is not allowed; choose one of \['pooler', 'cls'\]"):
    Transformer(config, "classification", 3, "mean").init(jax.random.PRNGKey(0), ids)


def test_glue_under_recipe_electra_fine_tunes_electras_model_and_reports_its_final_evaluation():
  """The task a run builds: no pooler parameters, STS-B's loss on scores / 5 (``RegressionTask``), predictions
  back on GLUE's 0-5 scale; the final evaluation reported. TUPE's recipe keeps the pooler and the best."""
  config = load_config("finetune/glue", "task=stsb,recipe=electra,runlocal")
  assert (config.classifier_input, config.select, config.select_metric, config.evals_per_epoch,
          config.regression_scale, config.adam_bias_correction, config.loss_reduction, config.lr_schedule,
          config.data.both_orders) == ("cls", "last", "", 1, 0.2, False, "sum", "electra", True)
  task = tasks.build(config, config.batch_size)
  params = nn.unbox(task.model.init(jax.random.PRNGKey(0), **task.init_inputs)["params"])
  assert set(params) == {"encoder", "classifier"}
  batch = next(iter(task.train_batches))
  apply = lambda b: np.asarray(task.model.apply({"params": params}, b["input_ids"], token_type_ids=b["token_type_ids"],
                                                attention_mask=b["attention_mask"]).logits[:, 0], np.float64)
  loss, _ = task.loss_fn(params, batch, None)
  want = np.sum((apply(batch) - 0.2 * batch["label"]) ** 2 * batch["weight"])
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)
  evaluator = next(iter(task.evaluators.values()))
  eval_batch = next(iter(evaluator.batches))
  np.testing.assert_allclose(np.asarray(evaluator.predict(params, eval_batch)["logits"])[:, 0], apply(eval_batch) / 0.2,
                             rtol=1e-5, atol=1e-6)
  tupe = load_config("finetune/glue", "task=stsb,runlocal")
  assert (tupe.classifier_input, tupe.select, tupe.select_metric, tupe.evals_per_epoch, tupe.regression_scale,
          tupe.adam_bias_correction, tupe.loss_reduction, tupe.data.both_orders) == (
              "pooler", "best", "stsb/pearson", 2, 1.0, True, "mean", False)
  tupe_task = tasks.build(tupe, tupe.batch_size)
  assert "pooler" in nn.unbox(tupe_task.model.init(jax.random.PRNGKey(0), **task.init_inputs)["params"])
  # double_unordered: every STS-B training pair again in the other order
  assert task.examples_per_epoch == 2 * tupe_task.examples_per_epoch
  once, both = tupe_task.train_batches.features, task.train_batches.features
  sep = int(TOKENIZER.sep_id)
  for original, swapped in zip(once, both[len(once):]):
    first, second = np.split(original["input_ids"][1:-1], np.flatnonzero(original["input_ids"][1:-1] == sep)[:1])
    np.testing.assert_array_equal(swapped["input_ids"], np.concatenate([[TOKENIZER.cls_id], second[1:], [sep],
                                                                         first, [sep]]))
    assert swapped["label"] == original["label"]
  assert load_config("finetune/glue", "task=rte,recipe=electra,runlocal").data.both_orders  # only MRPC, STS-B act


def test_electra_large_is_electra_larges_recipe():
  base, large = load_config("electra", ""), load_config("electra", "size=large")
  assert (base.batch_size, base.total_steps, base.learning_rate, base.data.mask_rate) == (256, 766_000, 2e-4, 0.15)
  assert (large.batch_size, large.total_steps, large.learning_rate, large.data.mask_rate) == (2048, 400_000, 2e-4, 0.25)
  assert (large.model.hidden_size, large.model.num_layers, large.generator.hidden_size, large.generator.num_heads,
          large.generator.intermediate_size) == (1024, 24, 256, 4, 1024)
  for config in (base, large):
    assert (config.data.mask_selection, config.adam_bias_correction, config.electra.disallow_correct,
            config.data.mask_token_rate, config.data.random_token_rate) == ("electra", False, False, 0.85, 0.0)


def test_table4_pretrains_a_million_steps_with_tupe_r_and_the_mid_row_starts_from_600k(tmp_path):
  runs = {r.name: r for r in sweep.plan("experiments/tupe/table4.py", str(tmp_path))}
  pretrain = {name: protocol.build(run) for name, run in runs.items() if run.kind == "pretrain"}
  assert set(pretrain) == {"ELECTRA/pretrain", "ELECTRA-TUPE/pretrain"}
  for name, config in pretrain.items():
    assert (config.task, config.total_steps) == ("electra", 1_000_000), name
    assert 600_000 in config.keep_steps
  assert pretrain["ELECTRA-TUPE/pretrain"].model.position == "tupe_r"
  assert pretrain["ELECTRA/pretrain"].model.position == "absolute"
  mid = [r for r in runs.values() if r.row == "ELECTRA-TUPE (mid)"]
  assert mid and all(r.overrides["init_step"] == 600_000 and r.depends_on == ["ELECTRA-TUPE/pretrain"] for r in mid)
  finetune = [r for r in runs.values() if r.kind == "finetune"]
  assert {(r.lr, r.seed) for r in finetune} == {(lr, s) for lr in (2e-5, 3e-5, 4e-5, 5e-5) for s in range(1, 6)}
  electra_runs = [r for r in sweep.plan("experiments/tupe/table4.py:recipe=electra", str(tmp_path / "e"))
                  if r.kind == "finetune"]
  assert {(r.lr, r.seed) for r in electra_runs} == {(1e-4, s) for s in range(1, 11)}
  built = protocol.build(next(r for r in electra_runs if r.task == "rte"))
  assert (built.classifier_input, built.select, built.layerwise_lr_decay) == ("cls", "last", 0.8)
  assert config_args.load_config("experiments/tupe/table4.py:recipe=electra").protocol.startswith("Fine-tuning, every column: ELECTRA's")
