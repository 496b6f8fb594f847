"""ELECTRA pre-training (Clark, Luong, Le, Manning; ICLR 2020) as a task of the training loop.

A small generator learns masked LM on the corpus's masked blocks; its samples at the masked positions replace
the [MASK]s, and the discriminator learns, for every real token, whether it was replaced. The two train
jointly on one loss::

    loss = mean_masked(generator MLM cross-entropy) + discriminator_weight * mean_tokens(sigmoid cross-entropy)

As the official code (``google-research/electra``, ``run_pretraining.py``): samples are drawn by Gumbel-max from
``logits / temperature`` with no gradient through them; a sample equal to the original token counts as
original; the discriminator's loss covers every non-padding token, [CLS] and [SEP] included. The official code
takes both means per TPU core; here they are over the whole step's batch (``Task.loss_totals``), so the loss
does not depend on the device count or on gradient accumulation.

Config (``configs/electra.py``): ``model`` is the discriminator; ``generator`` holds the generator's sizes
(the rest of its fields are the discriminator's); ``electra``: ``discriminator_weight`` (λ, 50),
``temperature`` (1.0), ``disallow_correct`` (False, the official default; True never samples the original token,
so every masked token is replaced), ``tie_embeddings`` (True: one set of embeddings, read by the generator through
its own projection), ``share_position_table`` (True: for TUPE, whose table feeds the layers, the generator reads
the discriminator's table and its LayerNorm, as ELECTRA shares its position embeddings; TUPE does not say; no
effect for other methods, whose input tables go with the embeddings, nor with ``tie_embeddings=False``, where
nothing is shared); masking from ``data`` (ELECTRA: 85% [MASK], 15% kept, no random tokens; positions drawn with
replacement, ``data.mask_selection="electra"``).

Metrics: ``mlm_loss`` / ``mlm_accuracy`` (the generator's, over masked tokens), ``sampled_accuracy`` (samples
equal to the original), ``disc_loss`` / ``disc_accuracy`` (over real tokens), ``disc_precision`` /
``disc_recall`` (of "replaced"), ``replaced_fraction`` (of real tokens), and ``loss``, the joint one. Evaluators
of kind ``electra`` report the same, with samples drawn from a key fixed per row.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from posjax.data.tokenizer import Tokenizer
from posjax.models import TransformerConfig
from posjax.models.electra import Electra, ElectraConfig
from posjax.tasks import mlm as mlm_task
from posjax.train.task import Task

DEFAULTS = dict(discriminator_weight=50.0, temperature=1.0, tie_embeddings=True, share_position_table=True,
                disallow_correct=False)
EVAL_SEED = 1  # the evaluation's sampling key: fixed, so one checkpoint always scores the same


def model_config(config: ml_collections.ConfigDict, vocab_size: int) -> ElectraConfig:
  """The discriminator is ``config.model``; the generator is ``config.model`` with ``config.generator``'s fields
  (its sizes) and the discriminator's embedding width, so that the embeddings can be one set."""
  discriminator = TransformerConfig.from_config(config.model, vocab_size, config.max_len)
  known = {f.name for f in dataclasses.fields(TransformerConfig)}
  unknown = sorted(set(config.generator) - known)
  if unknown:
    raise ValueError(f"config.generator has unknown field(s) {unknown}; TransformerConfig fields: {sorted(known)}")
  fields = {**config.model.to_dict(), "embedding_size": discriminator.embed_width, **config.generator.to_dict()}
  return ElectraConfig(TransformerConfig.from_config(fields, vocab_size, config.max_len), discriminator)


def options(config: ml_collections.ConfigDict) -> dict:
  """``config.electra`` with its defaults; an unknown field is an error."""
  given = config.get("electra", ml_collections.ConfigDict()).to_dict()
  unknown = sorted(set(given) - set(DEFAULTS))
  if unknown:
    raise ValueError(f"config.electra has unknown field(s) {unknown}; allowed: {sorted(DEFAULTS)}")
  values = {**DEFAULTS, **given}
  if values["temperature"] <= 0:
    raise ValueError(f"config.electra.temperature={values['temperature']} must be > 0")
  if values["discriminator_weight"] < 0:
    raise ValueError(f"config.electra.discriminator_weight={values['discriminator_weight']} must be >= 0")
  return values


def sample(keys_B, logits_BxMxV, temperature: float, disallow_BxM=None):
  """One token per masked position, drawn from ``softmax(logits / temperature)`` by Gumbel-max with each row's
  key; no gradient flows through the draw. ``disallow_BxM``: a token per position never drawn (the official
  ``disallow_correct``: its logit lowered by 1000)."""
  logits_BxMxV = jax.lax.stop_gradient(logits_BxMxV).astype(jnp.float32) / temperature
  if disallow_BxM is not None:
    logits_BxMxV = logits_BxMxV - 1000.0 * jax.nn.one_hot(disallow_BxM, logits_BxMxV.shape[-1])
  return jax.vmap(lambda key, logits_MxV: jax.random.categorical(key, logits_MxV))(keys_B, logits_BxMxV)


def replace_tokens(input_ids_BxL, masked_positions_BxM, masked_weights_BxM, sampled_BxM, labels_BxM):
  """The discriminator's input (the samples written at the masked positions) and its targets (``[B, L]``, True
  where the token differs from the original). Padding entries of the masked positions write nowhere. A position
  drawn more than once (``data.mask_selection="electra"``) gets the integer mean of its samples, as the official
  ``scatter_update`` writes it (their sum, floor-divided by their count)."""
  length = input_ids_BxL.shape[1]
  rows_Bx1 = jnp.arange(input_ids_BxL.shape[0])[:, None]
  where_BxM = jnp.where(masked_weights_BxM > 0, masked_positions_BxM, length)
  scatter = lambda x_BxL, values: x_BxL.at[rows_Bx1, where_BxM].add(values, mode="drop")
  zeros_BxL = jnp.zeros_like(input_ids_BxL)
  sums_BxL = scatter(zeros_BxL, sampled_BxM.astype(input_ids_BxL.dtype))
  counts_BxL = scatter(zeros_BxL, jnp.ones_like(sampled_BxM, input_ids_BxL.dtype))
  drawn_BxL = counts_BxL > 0
  original_BxL = input_ids_BxL.at[rows_Bx1, where_BxM].set(labels_BxM.astype(input_ids_BxL.dtype), mode="drop")
  fake_BxL = jnp.where(drawn_BxL, sums_BxL // jnp.maximum(counts_BxL, 1), input_ids_BxL)
  return fake_BxL, drawn_BxL & (fake_BxL != original_BxL)


def row_keys(input_ids_BxL):
  """A sampling key per row from its tokens alone: an evaluation's samples do not depend on the sharding or on
  which batch a row is in."""
  weights_L = jnp.arange(1, input_ids_BxL.shape[1] + 1, dtype=jnp.uint32)
  digest_B = jnp.sum(input_ids_BxL.astype(jnp.uint32) * weights_L * jnp.uint32(2654435761), axis=1)
  return jax.vmap(lambda d: jax.random.fold_in(jax.random.key(EVAL_SEED), d))(digest_B)


def corrupt(model: Electra, params, batch: dict, keys_B, *, temperature: float, use_segments: bool, rngs=None,
            disallow_correct: bool = False):
  """The generator's pass: ``(logits [B, M, V] at the masked positions, its samples [B, M], the discriminator's
  input [B, L], its targets [B, L])``. ``rngs``: dropout (None: deterministic); ``disallow_correct``: never draw
  the original token."""
  logits_BxMxV = model.apply({"params": params}, batch["input_ids"], batch["masked_positions"],
                             method=Electra.generate, deterministic=rngs is None, rngs=rngs,
                             **mlm_task.encoder_inputs(batch, use_segments))
  sampled_BxM = sample(keys_B, logits_BxMxV, temperature, batch["masked_labels"] if disallow_correct else None)
  fake_BxL, replaced_BxL = replace_tokens(batch["input_ids"], batch["masked_positions"], batch["masked_weights"],
                                          sampled_BxM, batch["masked_labels"])
  return logits_BxMxV, sampled_BxM, fake_BxL, replaced_BxL


def row_sums(model: Electra, params, batch: dict, keys_B, *, temperature: float, use_segments: bool,
             dropout_rng=None, disallow_correct: bool = False) -> dict:
  """Per row: the sums every loss and metric is made of (see :func:`metrics`). ``keys_B``: the sampling key of
  each row; ``dropout_rng``: training mode (None: deterministic)."""
  deterministic = dropout_rng is None
  rngs = [None, None] if deterministic else [{"dropout": k} for k in jax.random.split(dropout_rng)]
  logits_BxMxV, sampled_BxM, fake_BxL, replaced_BxL = corrupt(model, params, batch, keys_B, temperature=temperature,
                                                              use_segments=use_segments, rngs=rngs[0],
                                                              disallow_correct=disallow_correct)
  disc_BxL = model.apply({"params": params}, fake_BxL, method=Electra.discriminate, deterministic=deterministic,
                         rngs=rngs[1], **mlm_task.encoder_inputs(batch, use_segments))
  labels_BxM, weights_BxM = batch["masked_labels"], batch["masked_weights"]
  tokens_BxL = batch["attention_mask"].astype(jnp.float32)
  target_BxL = replaced_BxL.astype(jnp.float32)
  predicted_BxL = (disc_BxL > 0).astype(jnp.float32)
  per_row = lambda x: jnp.sum(x, axis=-1)
  return {
      "mlm_loss": per_row(optax.softmax_cross_entropy_with_integer_labels(logits_BxMxV, labels_BxM) * weights_BxM),
      "mlm_correct": per_row((jnp.argmax(logits_BxMxV, -1) == labels_BxM) * weights_BxM),
      "sampled_correct": per_row((sampled_BxM == labels_BxM) * weights_BxM),
      "weight": per_row(weights_BxM),
      "disc_loss": per_row(optax.sigmoid_binary_cross_entropy(disc_BxL, target_BxL) * tokens_BxL),
      "disc_correct": per_row((predicted_BxL == target_BxL) * tokens_BxL),
      "disc_true_positive": per_row(predicted_BxL * target_BxL * tokens_BxL),
      "disc_predicted": per_row(predicted_BxL * tokens_BxL),
      "replaced": per_row(target_BxL * tokens_BxL),
      "tokens": per_row(tokens_BxL),
  }


def training_keys(rng, batch_size: int):
  """The training pass's keys from the micro-batch's: one sampling key per row, and the dropout key."""
  sample_rng, dropout_rng = jax.random.split(rng)
  return jax.random.split(sample_rng, batch_size), dropout_rng


def metrics(sums: dict, discriminator_weight: float) -> dict:
  """The metrics from sums over any set of rows (a step's, an evaluation's)."""
  ratio = lambda a, b: sums[a] / jnp.maximum(sums[b], 1.0)
  mlm_loss, disc_loss = ratio("mlm_loss", "weight"), ratio("disc_loss", "tokens")
  return {"loss": mlm_loss + discriminator_weight * disc_loss, "mlm_loss": mlm_loss,
          "mlm_accuracy": ratio("mlm_correct", "weight"), "sampled_accuracy": ratio("sampled_correct", "weight"),
          "disc_loss": disc_loss, "disc_accuracy": ratio("disc_correct", "tokens"),
          "disc_precision": ratio("disc_true_positive", "disc_predicted"),
          "disc_recall": ratio("disc_true_positive", "replaced"), "replaced_fraction": ratio("replaced", "tokens"),
          "tokens": sums["tokens"]}


def loss_totals(batch: dict) -> dict:
  """What the loss's two means divide by: the step's masked tokens and real tokens."""
  return {"weight": jnp.sum(batch["masked_weights"]),
          "tokens": jnp.sum(batch["attention_mask"]).astype(jnp.float32)}


def electra_loss(model: Electra, *, discriminator_weight: float, temperature: float, use_segments: bool,
                 disallow_correct: bool = False):
  """``(params, batch, rng, totals) -> (summed loss, sums)``: the step divides by the summed ``weight`` (the
  masked tokens), so the discriminator's sum is scaled by masked / real tokens of the whole step."""
  def loss_fn(params, batch, rng, *, totals):
    keys_B, dropout_rng = training_keys(rng, batch["input_ids"].shape[0])
    rows = row_sums(model, params, batch, keys_B, temperature=temperature, use_segments=use_segments,
                    dropout_rng=dropout_rng, disallow_correct=disallow_correct)
    sums = {k: jnp.sum(v) for k, v in rows.items()}
    scale = jnp.maximum(totals["weight"], 1.0) / jnp.maximum(totals["tokens"], 1.0)
    return sums["mlm_loss"] + discriminator_weight * scale * sums["disc_loss"], sums
  return loss_fn


def evaluation_metrics(outputs: dict, workdir: str | None, *, discriminator_weight: float) -> dict:
  """An evaluator's metrics from the rows of every process (no files written)."""
  del workdir
  sums = {k: np.sum(v, dtype=np.float64) for k, v in outputs.items()}
  return {k: float(v) for k, v in metrics(sums, discriminator_weight).items() if k != "tokens"}


def build(config: ml_collections.ConfigDict, local_batch: int) -> Task:
  """ELECTRA pre-training on ``config.data`` (the corpora of :func:`posjax.tasks.mlm.corpus_batches`);
  evaluators of kind ``electra``."""
  tokenizer = Tokenizer.load(config.data.vocab_file)
  tokenizer.need("mask", purpose="ELECTRA pre-training (its generator's masked LM)")
  configs = model_config(config, tokenizer.vocab_size)
  opts = options(config)
  share_table = (opts["share_position_table"] and opts["tie_embeddings"]
                 and configs.discriminator.position_spec.method.table_shareable)
  model = Electra(configs.generator, configs.discriminator, tie_embeddings=opts["tie_embeddings"],
                  share_position_table=bool(share_table))
  use_segments = config.data.packing in mlm_task.mlm_data.SEPARATE_DOCUMENTS
  batches, evaluations = mlm_task.corpus_batches(config, tokenizer, local_batch)
  weight, temperature, disallow = opts["discriminator_weight"], opts["temperature"], opts["disallow_correct"]

  def predict(params, batch):
    return row_sums(model, params, batch, row_keys(batch["input_ids"]), temperature=temperature,
                    use_segments=use_segments, disallow_correct=disallow)

  score = functools.partial(evaluation_metrics, discriminator_weight=weight)
  evaluators = mlm_task.corpus_evaluators(evaluations, configs.discriminator, predict, score, ("loss",))
  return Task("electra", model, configs, {"input_ids_BxL": jnp.ones((1, config.max_len), jnp.int32)},
              electra_loss(model, discriminator_weight=weight, temperature=temperature, use_segments=use_segments,
                           disallow_correct=disallow),
              batches, evaluators, examples_per_epoch=config.data.get("examples_per_epoch"),
              info={"position": configs.position, "generator_position": configs.generator.position},
              loss_totals=loss_totals, step_metrics=functools.partial(metrics, discriminator_weight=weight))
