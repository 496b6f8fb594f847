"""Causal language modelling as a task of the training loop: a decoder-only model (``model.causal=True``: the
Llama-family preset of ``configs/lm.py`` or a causal BERT, ``configs/clm.py``) predicts each next token of the
packed corpus the MLM task reads (TFDS, text files or a prepared corpus; unmasked; ``stream`` packing cuts it into
full rows as GPT-style training does), with the
same loop, checkpoints, resume and sweeps, and evaluators of kind ``clm`` (loss, accuracy, perplexity) and
``passkey`` (retrieval of a key hidden in filler text, :mod:`posjax.tasks.passkey`) and ``ruler`` (RULER's tasks,
:mod:`posjax.tasks.ruler_eval`). ``config.passkey_train`` (``fraction`` > 0 and the passkey texts) puts passkey prompts
into the training batches (:class:`posjax.tasks.passkey.TrainingRows`), ``config.ruler_train`` RULER's prompts with
their answers (:class:`posjax.tasks.ruler_eval.TrainingRows`)."""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax.numpy as jnp
import ml_collections
import numpy as np

from posjax.data.tokenizer import Tokenizer
from posjax.models import TransformerConfig, Transformer
from posjax.tasks import mlm as mlm_task
from posjax.tasks import passkey, ruler_eval
from posjax.train.task import Task, counted_metrics


def next_token_row_sums(model, params, batch, rng, *, use_segments: bool, deterministic: bool,
                        by_position: bool = False, loss_chunk: int = 0, z_loss: float = 0.0):
  """Per row: summed next-token loss, correct predictions and weight: token i predicts token i + 1 where both are
  real and (``documents`` packing) of one segment. ``by_position``: also each prediction's loss and weight
  (``position_loss``, ``position_weight``, ``[B, L - 1]``: index i predicts token i + 1 from i + 1 tokens of context),
  for the loss by position. No ``[B, L, V]`` logits: ``loss_chunk`` positions at a time
  (:func:`posjax.models.lm_loss.token_losses`; ``z_loss``: its auxiliary term, in the loss, not in ``correct``)."""
  labels_BxL = batch["input_ids"][:, 1:]
  out = model.apply({"params": params}, batch["input_ids"], deterministic=deterministic,
                    labels=jnp.pad(labels_BxL, ((0, 0), (0, 1))), loss_chunk=loss_chunk, z_loss=z_loss,
                    rngs=None if deterministic else {"dropout": rng}, **mlm_task.encoder_inputs(batch, use_segments))
  losses_BxL, correct_BxL = out.token_loss[:, :-1], out.token_correct[:, :-1]
  real_BxL = batch["attention_mask"].astype(jnp.float32)
  weights_BxL = real_BxL[:, 1:] * real_BxL[:, :-1]
  if use_segments:
    weights_BxL = weights_BxL * (batch["segment_ids"][:, 1:] == batch["segment_ids"][:, :-1])
  if "scored" in batch:  # sliding-window rows (posjax.tasks.mlm.strided): only the window's new tokens count
    weights_BxL = weights_BxL * batch["scored"][:, 1:]
  sums = {"loss": jnp.sum(losses_BxL * weights_BxL, -1), "correct": jnp.sum(correct_BxL * weights_BxL, -1),
          "weight": jnp.sum(weights_BxL, -1)}
  if by_position:
    sums.update(position_loss=losses_BxL * weights_BxL, position_weight=weights_BxL)
  return sums


LOSS_CHUNK = 512  # sequence positions of [B, C, V] logits at a time (config.loss_chunk; 0: the whole sequence)


def loss_defaults(config: ml_collections.ConfigDict) -> None:
  """A decoder recipe's loss fields: ``loss_chunk`` (:data:`LOSS_CHUNK`; how the loss is computed, not what: a
  resumed run may change it) and ``z_loss`` (0: none)."""
  config.loss_chunk = LOSS_CHUNK
  config.z_loss = 0.0


def clm_loss(model, *, use_segments: bool = False, loss_chunk: int = LOSS_CHUNK, z_loss: float = 0.0) -> Callable:
  """The train loss: ``(params, batch, rng) -> (summed loss, {correct, weight})`` over every predicted token."""
  return mlm_task.summed_loss(functools.partial(next_token_row_sums, model, use_segments=use_segments,
                                                deterministic=False, loss_chunk=loss_chunk, z_loss=z_loss))


def clm_metrics(outputs: dict, workdir: str | None = None) -> dict:
  """``loss``, ``accuracy``, ``perplexity`` (``exp`` of the mean next-token loss), ``tokens`` (how many
  predictions they average) and, from outputs by position, ``loss_by_position`` (the mean loss at each token
  index of the rows)."""
  metrics = counted_metrics(outputs, workdir)
  metrics["perplexity"] = math.exp(min(metrics["loss"], 700.0))
  if "position_loss" in outputs:  # the mean loss at each token index of the rows (none scored: null)
    total_P = np.sum(outputs["position_loss"], axis=0, dtype=np.float64)
    weight_P = np.sum(outputs["position_weight"], axis=0, dtype=np.float64)
    metrics["loss_by_position"] = [round(float(t / w), 5) if w else None for t, w in zip(total_P, weight_P)]
  return metrics


def build(config: ml_collections.ConfigDict, local_batch: int) -> Task:
  """Next-token prediction on ``config.data`` (:func:`posjax.tasks.mlm.corpus_batches`, unmasked) with a causal
  model; evaluators of kind ``clm`` (on the corpus), ``passkey`` and ``ruler``."""
  tokenizer = Tokenizer.load(config.data.vocab_file)
  model_config = TransformerConfig.from_config(config.model, tokenizer.vocab_size, config.max_len)
  if not model_config.causal:
    raise ValueError("task='clm' trains a decoder: set model.causal=True (configs/clm.py does)")
  model = Transformer(model_config, head="lm")  # model.lm_head: BERT's MLM head (the default) or a decoder's linear one
  use_segments = config.data.packing in mlm_task.mlm_data.SEPARATE_DOCUMENTS
  batches, evaluations = mlm_task.corpus_batches(config, tokenizer, local_batch, masked=False, kinds=("clm",))
  chunk = int(config.get("loss_chunk", LOSS_CHUNK))
  predict = functools.partial(next_token_row_sums, model, rng=None, use_segments=use_segments, deterministic=True,
                              by_position=True, loss_chunk=chunk)
  evaluators = mlm_task.corpus_evaluators(evaluations, model_config, predict, clm_metrics,
                                          ("loss", "accuracy", "perplexity", "tokens"))
  if config.eval_every_steps > 0:
    evaluators.update(passkey.evaluators(config, tokenizer, model_config, model))
    evaluators.update(ruler_eval.evaluators(config, tokenizer, model_config, model))
  train_passkey = dict(config.get("passkey_train") or {})
  if train_passkey.get("fraction", 0.0):
    batches = passkey.TrainingRows(batches, tokenizer, train_passkey, local_batch, config.max_len, config.seed)
  train_ruler = (config.get("ruler_train") or {})
  if train_ruler.get("fraction", 0.0):
    train_ruler = train_ruler.to_dict() if hasattr(train_ruler, "to_dict") else dict(train_ruler)
    batches = ruler_eval.TrainingRows(batches, tokenizer, train_ruler, local_batch, config.max_len, config.seed)
  return Task("clm", model, model_config, {"input_ids": jnp.ones((1, config.max_len), jnp.int32)},
              clm_loss(model, use_segments=use_segments, loss_chunk=chunk, z_loss=float(config.get("z_loss", 0.0))),
              batches, evaluators,
              examples_per_epoch=config.data.get("examples_per_epoch"), info={"position": model_config.position})
