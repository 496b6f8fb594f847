"""Masked-LM pre-training as a task of the training loop: a corpus streamed from TFDS or text files (or prepared
once and read by index), packed and masked as BERT / RoBERTa do, and evaluators of kind ``mlm``."""

from __future__ import annotations

import functools
import itertools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from posjax.data import corpus, prepared, random_positions
from posjax.data import mlm as mlm_data
from posjax.data.tokenizer import Tokenizer
from posjax.models import TransformerConfig, Transformer
from posjax.positions import rotary
from posjax.train.task import Evaluator, Task, counted_metrics


def make_batches(config, tokenizer: Tokenizer, split: str, local_batch: int,
                 masked: bool = True) -> mlm_data.ShardedBatches:
  """This process's rows of every global MLM batch: ``data.num_shards`` document shards (0: one per process),
  of which each process owns a contiguous range (``masked=False``: the packed blocks unmasked, a causal LM's)."""
  index, count = jax.process_index(), jax.process_count()
  data = config.data
  num_shards = data.num_shards or count
  if num_shards % count:
    raise ValueError(f"data.num_shards={num_shards} must be a multiple of the {count} processes")
  per_process = num_shards // count
  if local_batch % per_process:
    raise ValueError(f"the per-process batch {local_batch} must divide over its {per_process} data shards")
  shards = range(index * per_process, (index + 1) * per_process)
  return mlm_data.ShardedBatches([
      mlm_data.MlmBatches(functools.partial(corpus.documents, data, split, shard, num_shards), tokenizer,
                     max_len=config.max_len, batch_size=local_batch // per_process,
                     seed=config.seed + (0 if split == "train" else 1), packing=data.packing,
                     masking=mlm_data.Masking.from_config(data) if masked else None, repeat=split == "train",
                     shard=shard)
      for shard in shards], num_shards=num_shards)


def encoder_inputs(batch: dict, use_segments: bool) -> dict:
  """The encoder's keyword inputs from an MLM batch (segment ids only for ``documents`` packing)."""
  inputs = {k: batch[k] for k in ("attention_mask", "positions", "segment_ids") if k in batch}
  if not use_segments:
    inputs.pop("segment_ids", None)
  return inputs


def mlm_row_sums(model, params, batch, rng, *, use_segments: bool, deterministic: bool):
  """Per row: summed loss, correct predictions and weight over the masked positions."""
  logits = model.apply({"params": params}, batch["input_ids"], masked_positions=batch["masked_positions"],
                       deterministic=deterministic, rngs=None if deterministic else {"dropout": rng},
                       **encoder_inputs(batch, use_segments)).logits
  weights = batch["masked_weights"]
  # Padding rows of masked_positions point at token 0; their weight is 0 and their logits are finite.
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["masked_labels"])
  correct = (jnp.argmax(logits, -1) == batch["masked_labels"]).astype(jnp.float32)
  return {"loss": jnp.sum(losses * weights, -1), "correct": jnp.sum(correct * weights, -1),
          "weight": jnp.sum(weights, -1)}


def summed_loss(row_sums: Callable) -> Callable:
  """A train loss ``(params, batch, rng) -> (summed loss, {correct, weight})`` from a function of per-row sums
  (``(params, batch, rng) -> {loss, correct, weight}``, each ``[B]``)."""
  def loss_fn(params, batch, rng):
    rows = row_sums(params, batch, rng)
    return jnp.sum(rows["loss"]), {"correct": jnp.sum(rows["correct"]), "weight": jnp.sum(rows["weight"])}
  return loss_fn


def mlm_loss(model, *, use_segments: bool = False) -> Callable:
  """The MLM train loss: ``(params, batch, rng) -> (summed loss, {correct, weight})`` over masked tokens."""
  return summed_loss(functools.partial(mlm_row_sums, model, use_segments=use_segments, deterministic=False))


class Evaluation(NamedTuple):
  """One corpus evaluator's batches (this process's rows), a padding batch, and the length they are packed to."""
  rows: list
  empty: dict
  length: int


def check_random_positions(config: ml_collections.ConfigDict, tokenizer: Tokenizer) -> tuple[int, str]:
  """``data.random_positions`` and ``data.random_positions_first``, checked: at least ``max_len``, within a learned
  position table's rows (of any method the model's layers use), and the first token kept at 0 for a method that
  reads position 0 as [CLS] (TUPE's ``cls_reset``: a drawn first position would untie no token or another one).
  Returns ``(limit, first)``."""
  limit = int(config.data.random_positions)
  first = random_positions.check_first(config.data.get("random_positions_first", "drawn"))
  if limit < config.max_len:
    raise ValueError(f"data.random_positions={limit} must be at least max_len={config.max_len}, the most positions a "
                     "row draws (0: off)")
  model = TransformerConfig.from_config(config.model, tokenizer.vocab_size, config.max_len)
  bound = [name for name, spec in model.method_specs.items() if spec.method.max_len_bound]
  if bound and limit > model.max_len:
    raise ValueError(f"data.random_positions={limit}: position method {bound[0]!r} has a learned table of "
                     f"model.max_len={model.max_len} rows; draw from at most {model.max_len} positions or raise "
                     "model.max_len")
  reset = [(name, spec.options.cls_reset) for name, spec in model.method_specs.items()
           if getattr(spec.options, "cls_reset", "none") != "none"]
  if reset and first == "drawn":
    raise ValueError(f"data.random_positions_first='drawn': position method {reset[0][0]!r} resets the [CLS] at "
                     f"position 0 (cls_reset={reset[0][1]!r}); set data.random_positions_first='zero' or "
                     "model.position_options.cls_reset='none'")
  by_length = [(name, spec.options.scaling) for name, spec in model.method_specs.items()
               if getattr(spec.options, "scaling", "none") in rotary.LENGTH_DEPENDENT]
  if by_length and first == "drawn" and config.data.get("packing") in ("documents", "stream_documents"):
    raise ValueError(f"data.random_positions_first='drawn' with data.packing={config.data.packing!r}: "
                     f"{by_length[0][0]}'s {by_length[0][1]} scaling reads each packed document's length from its "
                     "run of positions, which starts at position 0; set data.random_positions_first='zero' or "
                     "data.packing='stream'")
  return limit, first


def corpus_batches(config: ml_collections.ConfigDict, tokenizer: Tokenizer, local_batch: int, masked: bool = True,
                   kinds: tuple[str, ...] | None = None):
  """The training batches of ``config.data`` (streamed from TFDS or text files, or ``source="prepared"``: a corpus
  prepared by ``python -m posjax.data.prepare``, read by index) and, per evaluator, an :class:`Evaluation`
  (``split``: ``eval``; ``batches``: how many global batches of that split, streamed; with a prepared corpus from
  ``data.eval_source``; or ``tokens``: as many batches as hold that many tokens at the evaluator's length, rounded
  up, so that evaluators of every length read the same text where the packing is a stream (``stream``: rows are
  consecutive pieces of one token stream; other packings pad and regroup sentences per length); ``max_len``: the
  length its rows are packed to, or ``length_multiple``: that many times ``config.max_len`` (default 1): another
  length measures the model at lengths it was not trained at; ``stride``: sliding windows, :func:`strided`;
  ``same_text``: a masked-LM evaluation of the same masked text at every length, :func:`same_text`). What the
  pre-training tasks (``mlm``, ``electra``; ``clm`` unmasked) read. ``kinds``: only the evaluators of these kinds
  read the corpus (default all). ``data.random_positions=N``: the training batches' positions drawn from ``[0, N)``
  (:mod:`posjax.data.random_positions`; ``data.random_positions_first``: the first token's drawn or 0); evaluation
  keeps the ordinary ones."""
  data = config.data
  masking = mlm_data.Masking.from_config(data) if masked else None
  random_positions.check_first(data.get("random_positions_first", "drawn"))  # named even where the draw is off
  evals = dict(config.evals) if config.eval_every_steps > 0 else {}
  evals = {name: spec for name, spec in evals.items() if kinds is None or spec.get("kind") in kinds}
  eval_splits = tuple({spec.get("split", "eval") for spec in evals.values()})
  if data.source == "prepared":
    batches = prepared.PreparedBatches(
        data.prepared_dir, tokenizer, vocab_file=data.vocab_file, max_len=config.max_len, packing=data.packing,
        global_batch=config.batch_size, seed=config.seed, masking=masking, workers=data.get("workers", 0))
    if evals:  # evaluation streams its split from data.eval_source
      if data.get("eval_source", "") not in corpus.SOURCES:
        raise ValueError(f"data.source='prepared' evaluates on a streaming source: set data.eval_source to one of "
                         f"{list(corpus.SOURCES)} (or --config.eval_every_steps=0)")
      config = ml_collections.ConfigDict(config.to_dict())
      config.data.source = data.eval_source
      corpus.check(config.data, eval_splits)
  else:
    batches = make_batches(config, tokenizer, "train", local_batch, masked)
    corpus.check(data, ("train", *eval_splits), train_shards=[s.shard for s in batches.streams],
                 num_shards=data.num_shards or jax.process_count())
  if data.get("random_positions", 0):
    limit, first = check_random_positions(config, tokenizer)
    batches = random_positions.RandomPositions(batches, limit, config.seed, first)
  evaluations = {}
  for name, spec in evals.items():
    length = spec.get("max_len", 0) or config.max_len * spec.get("length_multiple", 1)
    at_length = ml_collections.ConfigDict({**config.to_dict(), "max_len": length})
    count = spec.get("batches", 50)
    if spec.get("tokens"):
      if "batches" in spec or int(spec["tokens"]) < 1:
        raise ValueError(f"config.evals.{name}: give batches or tokens (a positive count), not both; got "
                         f"batches={spec.get('batches')}, tokens={spec['tokens']}")
      count = -(-int(spec["tokens"]) // (length * config.batch_size))
    if spec.get("stride"):
      evaluations[name] = strided(config, tokenizer, spec, name, length, count * local_batch * length, local_batch)
      continue
    if spec.get("same_text"):
      evaluations[name] = same_text(config, tokenizer, spec, name, length, count * local_batch * length, local_batch)
      continue
    stream = make_batches(at_length, tokenizer, spec.get("split", "eval"), local_batch, masked)
    evaluations[name] = Evaluation(list(itertools.islice(stream, count)), stream.empty(), length)
  return batches, evaluations


def batched(rows: list[dict], local_batch: int, length: int) -> Evaluation:
  """Rows of one evaluation in batches of ``local_batch`` (the last filled with all-zero rows, weight 0)."""
  empty = {k: np.zeros_like(v) for k, v in rows[0].items()}
  batches = [{k: np.stack([row[k] for row in rows[i:i + local_batch]]
                          + [empty[k]] * (local_batch - len(rows[i:i + local_batch]))) for k in empty}
             for i in range(0, len(rows), local_batch)]
  return Evaluation(batches, {k: np.stack([v] * local_batch) for k, v in empty.items()}, length)


def text_stream(config, tokenizer: Tokenizer, split: str, text_tokens: int, local_batch: int, chunk: int) -> np.ndarray:
  """The first ``text_tokens`` tokens of ``split`` as one stream (the ``stream`` packing's: each document followed by
  [SEP]), read ``chunk`` tokens a row; in one process (the text must be one stream)."""
  streaming = ml_collections.ConfigDict({**config.to_dict(), "max_len": chunk})
  streaming.data.packing = "stream"
  stream = make_batches(streaming, tokenizer, split, local_batch, masked=False)
  chunks = list(itertools.islice(stream, -(-text_tokens // (chunk * local_batch))))
  return np.concatenate([batch["input_ids"][batch["attention_mask"] > 0] for batch in chunks])[:text_tokens]


def strided(config, tokenizer: Tokenizer, spec, name: str, length: int, text_tokens: int, local_batch: int):
  """Sliding-window evaluation (Press et al. 2022's): windows of ``length`` tokens every ``stride`` tokens of the
  evaluation text (the same text as without a stride: the stream's first ``text_tokens`` tokens), each
  scoring only its last ``stride`` predictions (the first windows, shorter, start at the text's first token), so
  every token is predicted once, after up to ``length - stride`` tokens of context. Rows carry ``scored`` (1 at the
  tokens whose prediction counts). A stream packing in one process (the text must be one stream)."""
  stride = int(spec["stride"])
  if spec.get("kind") != "clm" or stride < 1:
    raise ValueError(f"config.evals.{name}: stride={stride} is next-token (kind='clm') evaluation with a positive "
                     f"stride; got kind={spec.get('kind')!r}")
  if length % stride or config.data.packing != "stream" or jax.process_count() > 1:
    raise ValueError(f"config.evals.{name}: stride={stride} evaluates one token stream in one process: it must "
                     f"divide the length {length}, with data.packing='stream' (got {config.data.packing!r}) and "
                     f"{jax.process_count()} process(es)")
  text = text_stream(config, tokenizer, spec.get("split", "eval"), text_tokens, local_batch, stride)
  rows = []
  for new_from in range(0, len(text), stride):  # the window whose new tokens start at new_from
    end = min(new_from + stride, len(text))
    start = max(0, end - length)
    ids = np.full(length, tokenizer.pad_id, np.int32)
    ids[:end - start] = text[start:end]
    index = np.arange(length)
    real = (index < end - start).astype(np.int32)
    scored = real * (index >= new_from - start)
    rows.append({"input_ids": ids, "attention_mask": real, "segment_ids": np.zeros(length, np.int32),
                 "positions": np.arange(length, dtype=np.int32), "scored": scored.astype(np.int32)})
  return batched(rows, local_batch, length)


def same_text(config, tokenizer: Tokenizer, spec, name: str, length: int, text_tokens: int, local_batch: int):
  """Masked-LM evaluation of the same text at every length: the evaluation text (the stream's first ``text_tokens``
  tokens, documents each followed by [SEP]) masked once as one block (:func:`posjax.data.mlm.mask_block`, its rng
  from the seed alone), then cut into rows of ``length``: a [CLS] first where the training packing puts one
  (``full_sentence``, ``documents``), then the next ``length - 1`` tokens. Every length predicts the same masked
  tokens from the same masked text; only the context around them changes. In one process."""
  if spec.get("kind") != "mlm" or jax.process_count() > 1:
    raise ValueError(f"config.evals.{name}: same_text is masked-LM (kind='mlm') evaluation of one token stream in one "
                     f"process; got kind={spec.get('kind')!r} in {jax.process_count()} process(es)")
  text = text_stream(config, tokenizer, spec.get("split", "eval"), text_tokens, local_batch, length)
  masking = mlm_data.Masking.from_config(config.data)
  whole = mlm_data.mask_block({"input_ids": text, "attention_mask": np.ones_like(text)},
                              np.random.default_rng([config.seed, 1]), tokenizer, len(text), masking)
  chosen = whole["masked_positions"][whole["masked_weights"] > 0]
  cls = int(config.data.packing in ("full_sentence", "documents"))
  span = length - cls
  rows = []
  for start in range(0, len(text), span):
    ids = [tokenizer.cls_id] * cls + whole["input_ids"][start:start + span].tolist()
    real = np.arange(length) < len(ids)
    row = {"input_ids": np.asarray(ids + [tokenizer.pad_id] * (length - len(ids)), np.int32),
           "attention_mask": real.astype(np.int32), "segment_ids": real.astype(np.int32),
           "positions": np.where(real, np.arange(length), 0).astype(np.int32)}
    inside = chosen[(chosen >= start) & (chosen < start + span)]
    rows.append({**row, "masked_positions": inside - start + cls, "masked_labels": text[inside]})
  width = max(1, max(len(row["masked_positions"]) for row in rows))
  for row in rows:
    pad = width - len(row["masked_positions"])
    row["masked_weights"] = np.concatenate([np.ones(len(row["masked_positions"])), np.zeros(pad)]).astype(np.float32)
    for key in ("masked_positions", "masked_labels"):
      row[key] = np.concatenate([row[key], np.zeros(pad, np.int64)]).astype(np.int32)
  return batched(rows, local_batch, length)


def corpus_evaluators(evaluations: dict, model_config: TransformerConfig, predict: Callable, metrics: Callable,
                      metric_names: tuple[str, ...] = ("loss", "accuracy")) -> dict[str, Evaluator]:
  """An :class:`Evaluator` per :class:`Evaluation`; one at a length the model's learned position table cannot
  encode is reported ``unsupported`` (never clamped)."""
  evaluators = {}
  for name, evaluation in evaluations.items():
    try:
      model_config.position_spec.check_length(evaluation.length)
    except ValueError as error:
      evaluators[name] = Evaluator([], predict, None, unsupported=str(error), metric_names=metric_names)
      continue
    evaluators[name] = Evaluator(evaluation.rows, predict, metrics, empty=evaluation.empty)
  return evaluators


def build(config: ml_collections.ConfigDict, local_batch: int) -> Task:
  """Masked-LM pre-training on ``config.data`` (see :func:`corpus_batches`); evaluators of kind ``mlm``."""
  tokenizer = Tokenizer.load(config.data.vocab_file)
  tokenizer.need("mask", purpose="masked-LM pre-training (task='mlm')")
  model_config = TransformerConfig.from_config(config.model, tokenizer.vocab_size, config.max_len)
  model = Transformer(model_config, head="mlm")
  use_segments = config.data.packing in mlm_data.SEPARATE_DOCUMENTS
  batches, evaluations = corpus_batches(config, tokenizer, local_batch)
  predict = functools.partial(mlm_row_sums, model, rng=None, use_segments=use_segments, deterministic=True)
  evaluators = corpus_evaluators(evaluations, model_config, predict, counted_metrics, ("loss", "accuracy", "tokens"))
  return Task("mlm", model, model_config, {"input_ids": jnp.ones((1, config.max_len), jnp.int32)},
              mlm_loss(model, use_segments=use_segments), batches, evaluators,
              examples_per_epoch=config.data.get("examples_per_epoch"),
              info={"position": model_config.position})
