"""Tasks: what the training loop trains. A task is a model, this process's training batches, a loss and
evaluators; ``posjax.train.loop`` runs every task the same way (sharded step, accumulation, checkpoints,
exact resume, metrics, preemption).

``config.task`` names the builder, ``build(config, local_batch) -> Task``:

- ``mlm``: masked-LM pre-training on a corpus (here);
- ``glue``: GLUE classification and STS-B regression (:mod:`posjax.finetune.tasks`);
- ``squad``: SQuAD 1.1 span extraction (:mod:`posjax.finetune.tasks`);
- ``probe``: one position probe (:mod:`posjax.probes`).

A new task is such a function, registered in ``posjax.train.loop.TASKS`` with its evaluator kinds in
``EVAL_KINDS``.

Evaluators are declared in ``config.evals`` (``{name: {kind, ...options}}``, after big_vision's
``config.evals``); their metrics are logged as ``<name>_<metric>``. A loss function returns the summed loss
and sums (``weight`` counts the examples or tokens; ``correct`` becomes ``accuracy``), so padding rows of
weight 0 change nothing and accumulation equals one big batch.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from posjax.data import corpus, prepared
from posjax.data import mlm as mlm_data
from posjax.data.tokenizer import Tokenizer
from posjax.models import BertConfig, BertForMaskedLM


@dataclasses.dataclass
class Evaluator:
  """One evaluation: this process's rows of every global batch, a pure per-row ``predict(params, batch)``, and
  ``metrics(outputs, workdir)`` over the outputs of all processes' rows (concatenated in global order)."""
  batches: list[dict]
  predict: Callable[[Any, dict], dict]
  metrics: Callable[[dict, str | None], dict]
  empty: dict | None = None  # a padding batch, for processes with fewer batches than others
  unsupported: str | None = None  # why it cannot run (e.g. longer than a learned position table)
  metric_names: tuple[str, ...] = ()  # reported as "unsupported" when it cannot run


@dataclasses.dataclass
class Task:
  """What the loop needs to train and evaluate one job."""
  name: str
  model: nn.Module
  model_config: BertConfig
  init_inputs: dict  # one row of the model's inputs: ``model.init(rng, **init_inputs)``
  loss_fn: Callable  # (params, batch, rng) -> (summed loss, {"weight": ..., other sums})
  train_batches: Any  # an endless iterator of this process's rows, with state() / restore(state)
  evaluators: dict[str, Evaluator]
  examples_per_epoch: int | None = None
  load_init: Callable | None = None  # fresh params -> params taken from the run it starts from
  info: dict = dataclasses.field(default_factory=dict)  # written to results.json
  # Run after an evaluation that config.select reports (e.g. test-set predictions, written to the workdir).
  predictors: dict[str, Evaluator] = dataclasses.field(default_factory=dict)


EVAL_KINDS = {"mlm": ("mlm",), "glue": ("glue",), "squad": ("squad",), "probe": ("probe",)}


def check_evals(config: ml_collections.ConfigDict) -> None:
  allowed = EVAL_KINDS[config.task]
  for name, spec in config.get("evals", {}).items():
    if spec.get("kind") not in allowed:
      raise ValueError(f"config.evals.{name}.kind={spec.get('kind')!r} does not fit task {config.task!r}; "
                       f"allowed: {list(allowed)}")


def bert_config(model: ml_collections.ConfigDict | dict, vocab_size: int, max_len: int) -> BertConfig:
  """``config.model`` as a BertConfig; ``vocab_size=0`` / ``max_len=0`` take the tokenizer's / the data's."""
  values = dict(model.to_dict() if isinstance(model, ml_collections.ConfigDict) else model)
  fields = {f.name for f in dataclasses.fields(BertConfig)}
  unknown = sorted(set(values) - fields)
  if unknown:
    raise ValueError(f"config.model has unknown field(s) {unknown}; BertConfig fields: {sorted(fields)}")
  values["vocab_size"] = values.get("vocab_size") or vocab_size
  values["max_len"] = values.get("max_len") or max_len
  if values["vocab_size"] != vocab_size:
    raise ValueError(f"model.vocab_size={values['vocab_size']} but the tokenizer has {vocab_size} pieces")
  return BertConfig(**values)


def make_batches(config, tokenizer: Tokenizer, split: str, local_batch: int) -> mlm_data.ShardedBatches:
  """This process's rows of every global MLM batch: ``data.num_shards`` document shards (0: one per process),
  of which each process owns a contiguous range."""
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
                     mask_rate=data.mask_rate, whole_word=data.whole_word_masking, repeat=split == "train",
                     shard=shard)
      for shard in shards])


def encoder_inputs(batch: dict, use_segments: bool) -> dict:
  inputs = {k: batch[k] for k in ("attention_mask", "positions", "segment_ids") if k in batch}
  if not use_segments:
    inputs.pop("segment_ids", None)
  return inputs


def mlm_row_sums(model, params, batch, rng, *, use_segments: bool, deterministic: bool):
  """Per row: summed loss, correct predictions and weight over the masked positions."""
  logits = model.apply({"params": params}, batch["input_ids"], masked_positions=batch["masked_positions"],
                       deterministic=deterministic, rngs=None if deterministic else {"dropout": rng},
                       **encoder_inputs(batch, use_segments))
  weights = batch["masked_weights"]
  # Padding rows of masked_positions point at token 0; their weight is 0 and their logits are finite.
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["masked_labels"])
  correct = (jnp.argmax(logits, -1) == batch["masked_labels"]).astype(jnp.float32)
  return {"loss": jnp.sum(losses * weights, -1), "correct": jnp.sum(correct * weights, -1),
          "weight": jnp.sum(weights, -1)}


def mlm_loss(model, *, use_segments: bool = False) -> Callable:
  """The MLM train loss: ``(params, batch, rng) -> (summed loss, {correct, weight})`` over masked tokens."""
  def loss_fn(params, batch, rng):
    rows = mlm_row_sums(model, params, batch, rng, use_segments=use_segments, deterministic=False)
    return jnp.sum(rows["loss"]), {"correct": jnp.sum(rows["correct"]), "weight": jnp.sum(rows["weight"])}
  return loss_fn


def summed_metrics(outputs: dict, workdir: str | None = None) -> dict:
  """``loss`` and ``accuracy`` from per-row sums."""
  del workdir
  weight = max(float(np.sum(outputs["weight"], dtype=np.float64)), 1.0)
  return {"loss": float(np.sum(outputs["loss"], dtype=np.float64)) / weight,
          "accuracy": float(np.sum(outputs["correct"], dtype=np.float64)) / weight}


def mlm(config: ml_collections.ConfigDict, local_batch: int) -> Task:
  """Masked-LM pre-training on ``config.data`` (streamed from TFDS or text files, or ``source="prepared"``: a
  corpus prepared by ``python -m posjax.data.prepare``, read by index); evaluators of kind ``mlm`` (``split``:
  ``eval``; ``batches``: how many global batches of that split, streamed; with a prepared corpus from
  ``data.eval_source``)."""
  tokenizer = Tokenizer.load(config.data.vocab_file)
  model_config = bert_config(config.model, tokenizer.vocab_size, config.max_len)
  model = BertForMaskedLM(model_config)
  data = config.data
  use_segments = data.packing == "documents"
  evals = dict(config.evals) if config.eval_every_steps > 0 else {}
  eval_splits = tuple({spec.get("split", "eval") for spec in evals.values()})
  if data.source == "prepared":
    batches = prepared.PreparedBatches(
        data.prepared_dir, tokenizer, vocab_file=data.vocab_file, max_len=config.max_len, packing=data.packing,
        global_batch=config.batch_size, seed=config.seed, mask_rate=data.mask_rate, whole_word=data.whole_word_masking,
        workers=data.get("workers", 0))
    if evals:  # evaluation streams its split from data.eval_source
      if data.get("eval_source", "") not in corpus.SOURCES:
        raise ValueError(f"data.source='prepared' evaluates on a streaming source: set data.eval_source to one of "
                         f"{list(corpus.SOURCES)} (or --config.eval_every_steps=0)")
      config = ml_collections.ConfigDict(config.to_dict())
      config.data.source = data.eval_source
      corpus.check(config.data, eval_splits)
  else:
    batches = make_batches(config, tokenizer, "train", local_batch)
    corpus.check(data, ("train", *eval_splits), train_shards=[s.shard for s in batches.streams],
                 num_shards=data.num_shards or jax.process_count())
  predict = functools.partial(mlm_row_sums, model, rng=None, use_segments=use_segments, deterministic=True)
  evaluators = {}
  for name, spec in evals.items():
    stream = make_batches(config, tokenizer, spec.get("split", "eval"), local_batch)
    evaluators[name] = Evaluator(list(itertools.islice(stream, spec.get("batches", 50))), predict, summed_metrics,
                                 empty=stream.empty())
  return Task("mlm", model, model_config, {"input_ids": jnp.ones((1, config.max_len), jnp.int32)},
              mlm_loss(model, use_segments=use_segments), batches, evaluators,
              examples_per_epoch=config.data.get("examples_per_epoch"),
              info={"position": model_config.position})
