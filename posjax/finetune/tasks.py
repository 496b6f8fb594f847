"""Fine-tuning tasks for the training loop: GLUE (classification; STS-B regression) and SQuAD 1.1 (spans).

Each builds its model from where the run starts (:mod:`posjax.finetune.init`), reads and encodes its data
before anything is written (a bad file, label or question is an error that names it), and declares its
evaluators from ``config.evals``:

- ``glue`` (``split``: ``validation``, or MNLI's ``validation_matched`` / ``validation_mismatched``): the
  task's GLUE metrics (:func:`posjax.finetune.metrics.glue`), in percent. Where the split's test set is there
  (``test.tsv``, ``test_matched.tsv``, ...; TFDS's ``test``) and ``data.test_predictions``, its predictions are
  written in the GLUE server's format to ``glue_test/<Task>.tsv`` after every evaluation that ``config.select``
  reports, so the file holds the predictions of the reported model.
- ``squad`` (``split``: ``validation``; ``max_lens``: evaluation lengths, default ``(max_len,)``): exact match
  and F1 of the official v1.1 script at each length, as ``<name>@<length>``; the predictions of each go to
  ``predictions_<name>@<length>.json`` in the workdir (the official script's format), the n-best answers with
  their probabilities to ``nbest_predictions_<name>@<length>.json`` (BERT's). A length longer than a
  learned position table is reported ``unsupported``, never clamped.
"""

from __future__ import annotations

import functools
import json
import os

import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging

from posjax.data import feature_cache
from posjax.data import features as features_lib
from posjax.data.tokenizer import Tokenizer
from posjax.finetune import glue as glue_data
from posjax.finetune import init as init_lib
from posjax.finetune import metrics as metrics_lib
from posjax.finetune import squad as squad_data
from posjax.models import BertForQuestionAnswering, BertForSequenceClassification
from posjax.train.tasks import Evaluator, Task, bert_config

SQUAD_SOURCES = ("json", "tfds")


def _start(config: ml_collections.ConfigDict):
  """The init run (or None), the tokenizer, the BertConfig, whether the position method changed, the vocabulary."""
  start = init_lib.find(config)
  data = config.data
  vocab_file = data.get("vocab_file") or (start.vocab_file if start else data.get("scratch_vocab_file"))
  if not vocab_file:
    raise ValueError("no vocabulary: set config.data.vocab_file, or config.init to a run that has one")
  tokenizer = Tokenizer.load(vocab_file)
  fields, changed = init_lib.model_fields(config, start, tokenizer.vocab_size)
  model_config = bert_config(fields, tokenizer.vocab_size, config.max_len)
  model_config.position_spec.check_length(config.max_len)
  return start, tokenizer, model_config, changed, vocab_file


def _info(config, start, model_config) -> dict:
  return {"init": start.workdir if start else None, "init_step": start.step if start else None,
          "position": model_config.position, "max_len": config.max_len}


def _inputs(batch: dict, use_types: bool) -> dict:
  inputs = {"attention_mask": batch["attention_mask"]}
  if use_types:
    inputs["token_type_ids"] = batch["token_type_ids"]
  return inputs


def _apply(model, use_types: bool, params, batch, rng=None):
  return model.apply({"params": params}, batch["input_ids"], deterministic=rng is None,
                     rngs=None if rng is None else {"dropout": rng}, **_inputs(batch, use_types))


def _init_inputs(max_len: int, use_types: bool) -> dict:
  inputs = {"input_ids": jnp.ones((1, max_len), jnp.int32)}
  if use_types:
    inputs["token_type_ids"] = jnp.zeros((1, max_len), jnp.int32)
  return inputs


def _load_init(start, changed):
  return None if start is None else functools.partial(init_lib.load, start, position_changed=changed)


def _in_order(outputs: dict) -> dict:
  """Rows of real examples (``index >= 0``), sorted by index."""
  keep = outputs["index"] >= 0
  order = np.argsort(outputs["index"][keep], kind="stable")
  return {k: v[keep][order] for k, v in outputs.items()}


def _batching(data, length: int | None = None) -> dict:
  """The padding options of :mod:`posjax.data.features`: explicit ``length_buckets``, else a ladder with
  ``buckets_per_doubling`` steps. ``length``: an evaluation length other than ``max_len``, which keeps the
  buckets up to it."""
  buckets = tuple(data.get("length_buckets") or ())
  if buckets and length is not None:
    buckets = tuple(b for b in buckets if b < length) + (length,)
  return dict(batching=data.get("batching", "fixed"), buckets=buckets or data.get("buckets_per_doubling") or None)


def _eval_batch(config) -> int:
  """The global evaluation batch: ``eval_batch_size``, else the training batch."""
  return config.get("eval_batch_size") or config.batch_size


def glue(config: ml_collections.ConfigDict, local_batch: int) -> Task:
  """A GLUE task (``config.data.glue_task``) from TFDS or the GLUE TSV files (``config.data.source``)."""
  data = config.data
  task = glue_data.get(data.glue_task)
  start, tokenizer, model_config, changed, vocab_file = _start(config)
  vocab_digest = feature_cache.file_digest(vocab_file) if data.get("cache_dir") else ""
  model = BertForSequenceClassification(model_config, task.num_labels)
  use_types = model_config.type_vocab_size > 0
  regression = task.labels is None
  label_dtype = np.float32 if regression else np.int32

  def build(split: str) -> tuple[list[dict], dict]:
    """Encoded examples; a test split's carry their ids (in ``meta``) instead of labels."""
    test = split.startswith("test")
    found = list(glue_data.test_examples(task.name, split, data.source, data.data_dir) if test else
                 ((texts, label) for texts, label in glue_data.examples(task.name, split, data.source, data.data_dir)))
    if not found:
      raise ValueError(f"GLUE {task.name} {split} ({data.source}) holds no examples")
    texts = [t for _, t in found] if test else [t for t, _ in found]
    columns = [tokenizer.encode_batch([t[i] for t in texts]) for i in range(len(task.tfds_keys))]
    rows = []
    for n, (first, second) in enumerate(found):
      ids, types = glue_data.pair(tokenizer, [column[n] for column in columns], config.max_len)
      rows.append({"input_ids": np.asarray(ids, np.int32), "token_type_ids": np.asarray(types, np.int32),
                   "label": label_dtype(0 if test else second)})
    return rows, {"ids": [str(first) for first, _ in found]} if test else {}

  def encode(split: str):
    path = glue_data.tsv_file(task, split, data.data_dir) if data.source == "tsv" else ""
    source = (feature_cache.file_digest(path) if os.path.isfile(path)
              else f"{data.source} glue/{task.name} {os.path.abspath(data.data_dir) if data.data_dir else ''}")
    key = {"glue": task.name, "split": split, "source": source, "vocab": vocab_digest, "max_len": config.max_len}
    return feature_cache.cached(data.get("cache_dir", ""), key, lambda: build(split))

  def loss_fn(params, batch, rng):
    logits = _apply(model, use_types, params, batch, rng)
    weight = batch["weight"]
    tokens = jnp.sum(batch["attention_mask"]).astype(jnp.float32)
    if regression:
      squares = jnp.square(logits[:, 0] - batch["label"])
      return jnp.sum(squares * weight), {"weight": jnp.sum(weight), "tokens": tokens}
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
    correct = (jnp.argmax(logits, -1) == batch["label"]).astype(jnp.float32)
    return jnp.sum(losses * weight), {"correct": jnp.sum(correct * weight), "weight": jnp.sum(weight),
                                      "tokens": tokens}

  def predict(params, batch):
    return {"logits": _apply(model, use_types, params, batch), "index": batch["index"]}

  train = encode("train")[0]
  eval_batch = _eval_batch(config)
  evaluators, predictors = {}, {}
  for name, spec in config.evals.items():
    split = spec.get("split", "validation")
    if split not in task.validation_splits:
      raise ValueError(f"{task.name} has no split {split!r}; allowed: {['train', *task.validation_splits]}")
    rows = encode(split)[0]
    labels = np.asarray([r["label"] for r in rows])
    key = f"mnli_{split.removeprefix('validation_')}" if task.name == "mnli" else task.name

    def glue_metrics(outputs, workdir, key=key, labels=labels):
      del workdir
      logits = _in_order(outputs)["logits"]
      guesses = logits[:, 0] if regression else np.argmax(logits, -1)
      return metrics_lib.glue(key, guesses, labels)

    eval_batches_of = functools.partial(features_lib.eval_batches, global_batch=eval_batch, max_len=config.max_len,
                                pad_id=tokenizer.pad_id, **_batching(data))
    evaluators[name] = Evaluator(eval_batches_of(rows), predict, glue_metrics)
    if data.get("test_predictions", True) and glue_data.has_test(task.name, split, data.source, data.data_dir):
      test_rows, meta = encode(glue_data.test_split(split))

      def submission(outputs, workdir, key=key, ids=meta["ids"]):
        if workdir is not None:
          logits = _in_order(outputs)["logits"]
          os.makedirs(os.path.join(workdir, "glue_test"), exist_ok=True)
          glue_data.write_submission(os.path.join(workdir, "glue_test", f"{glue_data.SUBMISSION[key]}.tsv"),
                                     task.name, ids, logits[:, 0] if regression else np.argmax(logits, -1))
        return {}

      predictors[f"{name}_test"] = Evaluator(eval_batches_of(test_rows), predict, submission)
  batches = features_lib.ExampleBatches(train, global_batch=config.batch_size, max_len=config.max_len,
                                        pad_id=tokenizer.pad_id, seed=config.seed, group_size=data.get("group_size", 50),
                                        **_batching(data))
  return Task(f"glue/{task.name}", model, model_config, _init_inputs(config.max_len, use_types), loss_fn, batches,
              evaluators, examples_per_epoch=len(train), load_init=_load_init(start, changed),
              info=_info(config, start, model_config), predictors=predictors)


def squad_examples(data: ml_collections.ConfigDict, split: str) -> list[squad_data.Example]:
  if data.source not in SQUAD_SOURCES:
    raise ValueError(f"unknown SQuAD source {data.source!r}; allowed: {list(SQUAD_SOURCES)}")
  if data.source == "json":
    where = data.train_file if split == "train" else data.dev_file
    examples = list(squad_data.json_examples(where))
  else:
    where = f"tfds squad/v1.1 {split}"
    examples = list(squad_data.tfds_examples(split, data.data_dir))
  if not examples:
    raise ValueError(f"SQuAD {split}: {where} holds no questions")
  return examples


def squad(config: ml_collections.ConfigDict, local_batch: int) -> Task:
  """SQuAD 1.1 from the official JSON files (``data.train_file`` / ``data.dev_file``) or TFDS ``squad/v1.1``."""
  data = config.data
  start, tokenizer, model_config, changed, vocab_file = _start(config)
  model = BertForQuestionAnswering(model_config)
  use_types = model_config.type_vocab_size > 0
  window = functools.partial(squad_data.windows, tokenizer, doc_stride=data.doc_stride,
                             max_query_len=data.max_query_len)

  def feature(w: squad_data.Window, **labels) -> dict:
    n = int(w.attention_mask.sum())
    return {"input_ids": w.input_ids[:n], "token_type_ids": w.token_type_ids[:n], **labels}

  def build() -> tuple[list[dict], dict]:
    examples, skipped = squad_examples(data, "train"), 0
    if data.get("skip_misplaced_answers", True):
      examples, skipped = squad_data.training_examples(examples)
      if not examples:
        raise ValueError(f"SQuAD train: none of its {skipped} questions has its answer text at its answer_start "
                         "(set data.skip_misplaced_answers=False to train on them anyway)")
    rows = [feature(w, start_position=np.int32(w.start_position), end_position=np.int32(w.end_position))
            for example in examples for w in window(example, max_len=config.max_len)]
    return rows, {"skipped": skipped}

  source = (feature_cache.file_digest(data.train_file) if data.source == "json" and os.path.isfile(data.train_file)
            else f"{data.source} {data.train_file} {os.path.abspath(data.data_dir) if data.data_dir else ''}")
  key = {"squad": "train", "source": source, "max_len": config.max_len, "doc_stride": data.doc_stride,
         "max_query_len": data.max_query_len, "skip": data.get("skip_misplaced_answers", True),
         "vocab": feature_cache.file_digest(vocab_file) if data.get("cache_dir") else ""}
  train, meta = feature_cache.cached(data.get("cache_dir", ""), key, build)
  if meta.get("skipped"):
    logging.warning("SQuAD train: skipped %d question(s) whose answer text is not at its answer_start (as BERT does)",
                    meta["skipped"])

  def loss_fn(params, batch, rng):
    start_logits, end_logits = _apply(model, use_types, params, batch, rng)
    weight = batch["weight"]
    losses = 0.5 * (optax.softmax_cross_entropy_with_integer_labels(start_logits, batch["start_position"])
                    + optax.softmax_cross_entropy_with_integer_labels(end_logits, batch["end_position"]))
    correct = ((jnp.argmax(start_logits, -1) == batch["start_position"])
               & (jnp.argmax(end_logits, -1) == batch["end_position"])).astype(jnp.float32)
    return jnp.sum(losses * weight), {"correct": jnp.sum(correct * weight), "weight": jnp.sum(weight),
                                      "tokens": jnp.sum(batch["attention_mask"]).astype(jnp.float32)}

  def predict(params, batch):
    start_logits, end_logits = _apply(model, use_types, params, batch)
    return {"start": start_logits, "end": end_logits, "index": batch["index"]}

  eval_batch = _eval_batch(config)
  evaluators = {}
  for name, spec in config.evals.items():
    examples = squad_examples(data, spec.get("split", "validation"))
    by_id = {e.id: e for e in examples}
    answers = {e.id: list(e.answers) for e in examples}
    for length in tuple(spec.get("max_lens") or ()) or (config.max_len,):
      key = f"{name}@{length}"
      try:
        model_config.position_spec.check_length(length)
      except ValueError as error:
        evaluators[key] = Evaluator([], predict, None, unsupported=str(error), metric_names=("exact_match", "f1"))
        continue
      windows = [w for example in examples for w in window(example, max_len=length)]

      def squad_metrics(outputs, workdir, key=key, windows=windows):
        ordered = _in_order(outputs)
        nbest = squad_data.n_best_answers(by_id, windows, ordered["start"], ordered["end"], n_best=data.n_best,
                                          max_answer_len=data.max_answer_len)
        found = {example_id: candidates[0]["text"] for example_id, candidates in nbest.items()}
        if workdir is not None:
          for name, value in ((f"predictions_{key}.json", found), (f"nbest_predictions_{key}.json", nbest)):
            with open(os.path.join(workdir, name), "w") as f:
              json.dump(value, f, indent=1, ensure_ascii=False)
        return metrics_lib.squad(found, answers)

      evaluators[key] = Evaluator(
          features_lib.eval_batches([feature(w) for w in windows], global_batch=eval_batch, max_len=length,
                                    pad_id=tokenizer.pad_id, **_batching(data, length)), predict, squad_metrics)
  batches = features_lib.ExampleBatches(train, global_batch=config.batch_size, max_len=config.max_len,
                                        pad_id=tokenizer.pad_id, seed=config.seed, group_size=data.get("group_size", 50),
                                        **_batching(data))
  return Task("squad", model, model_config, _init_inputs(config.max_len, use_types), loss_fn, batches, evaluators,
              examples_per_epoch=len(train), load_init=_load_init(start, changed),
              info=_info(config, start, model_config))
