"""GLUE fine-tuning for the training loop: classification, and STS-B regression. The head reads an encoder's
[CLS] and a causal model's last real token (``classifier_token``, :func:`posjax.models.heads.classifier_token`).

It builds its model from where the run starts (:mod:`posjax.finetune.init`), reads and encodes its data
before anything is written (a bad file, label or question is an error that names it), and declares its
evaluators from ``config.evals``:

- ``glue`` (``split``: ``validation``, or MNLI's ``validation_matched`` / ``validation_mismatched``): the
  task's GLUE metrics (:func:`posjax.finetune.metrics.glue`), in percent. Where the split's test set is there
  (``test.tsv``, ``test_matched.tsv``, ...; TFDS's ``test``) and ``data.test_predictions``, its predictions are
  written in the GLUE server's format to ``glue_test/<Task>.tsv`` after every evaluation that ``config.select``
  reports, so the file holds the predictions of the reported model.
"""

from __future__ import annotations

import functools
import os

import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from posjax.data import features as features_lib
from posjax.finetune import glue as glue_data
from posjax.finetune import metrics as metrics_lib
from posjax.models import Transformer
from posjax.models.heads import classifier_token
from posjax.tasks import common
from posjax.train.task import Evaluator, Task


def build(config: ml_collections.ConfigDict, local_batch: int) -> Task:
  """A GLUE task (``config.data.glue_task``) from TFDS or the GLUE TSV files (``config.data.source``)."""
  data = config.data
  task = glue_data.get(data.glue_task)
  start, tokenizer, model_config, changed, vocab_file = common.start(config)
  token = classifier_token(model_config, config.get("classifier_token", "auto"))
  model = Transformer(model_config, "classification", task.num_labels, config.get("classifier_input", "pooler"), token)
  use_types = model_config.type_vocab_size > 0
  regression = task.labels is None
  scale = config.get("regression_scale", 1.0)  # ELECTRA trains STS-B on its scores / 5
  both_orders = bool(data.get("both_orders", False)) and task.unordered
  label_dtype = np.float32 if regression else np.int32

  def build(split: str) -> tuple[list[dict], dict]:
    """Encoded examples; a test split's carry their ids (in ``meta``) instead of labels."""
    test = split.startswith("test")
    found = list(glue_data.test_examples(task.name, split, data.source, data.data_dir) if test else
                 ((texts, label) for texts, label in glue_data.examples(task.name, split, data.source, data.data_dir)))
    if not found:
      raise ValueError(f"GLUE {task.name} {split} ({data.source}) holds no examples")
    if split == "train" and both_orders:  # ELECTRA's double_unordered: every pair again, swapped
      found += [(texts[::-1], label) for texts, label in found]
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
    key = {"glue": task.name, "split": split, "max_len": config.max_len, "both_orders": both_orders}
    return common.cached_features(data, key, lambda: build(split), vocab_file=vocab_file, source_file=path,
                                  source=f"{data.source} glue/{task.name}")

  def loss_fn(params, batch, rng):
    logits = common.apply(model, use_types, params, batch, rng).logits
    weight = batch["weight"]
    tokens = jnp.sum(batch["attention_mask"]).astype(jnp.float32)
    if regression:
      squares = jnp.square(logits[:, 0] - batch["label"] * scale)
      return jnp.sum(squares * weight), {"weight": jnp.sum(weight), "tokens": tokens}
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
    correct = (jnp.argmax(logits, -1) == batch["label"]).astype(jnp.float32)
    return jnp.sum(losses * weight), {"correct": jnp.sum(correct * weight), "weight": jnp.sum(weight),
                                      "tokens": tokens}

  def predict(params, batch):
    logits = common.apply(model, use_types, params, batch).logits
    return {"logits": logits / scale if regression else logits, "index": batch["index"]}

  train = encode("train")[0]
  eval_batch = common.eval_batch(config)
  evaluators, predictors, baselines = {}, {}, []
  for name, spec in config.evals.items():
    split = spec.get("split", "validation")
    if split not in task.validation_splits:
      raise ValueError(f"{task.name} has no split {split!r}; allowed: {['train', *task.validation_splits]}")
    rows = encode(split)[0]
    labels = np.asarray([r["label"] for r in rows])
    key = f"mnli_{split.removeprefix('validation_')}" if task.name == "mnli" else task.name

    def glue_metrics(outputs, workdir, key=key, labels=labels):
      del workdir
      logits = common.in_order(outputs)["logits"]
      guesses = logits[:, 0] if regression else np.argmax(logits, -1)
      return metrics_lib.glue(key, guesses, labels)

    eval_batches_of = functools.partial(features_lib.eval_batches, global_batch=eval_batch, max_len=config.max_len,
                                pad_id=tokenizer.pad_id, **common.batching(data))
    evaluators[name] = Evaluator(eval_batches_of(rows), predict, glue_metrics)
    if not regression and len(labels):
      counts = np.bincount(labels, minlength=task.num_labels)
      baselines.append(f"{name}: {len(labels)} examples; always answering the most frequent label "
                       f"({task.labels[int(np.argmax(counts))]}) scores {100 * counts.max() / len(labels):.1f} accuracy")
    if data.get("test_predictions", True) and glue_data.has_test(task.name, split, data.source, data.data_dir):
      test_rows, meta = encode(glue_data.test_split(split))

      def submission(outputs, workdir, key=key, ids=meta["ids"]):
        if workdir is not None:
          logits = common.in_order(outputs)["logits"]
          os.makedirs(os.path.join(workdir, "glue_test"), exist_ok=True)
          glue_data.write_submission(os.path.join(workdir, "glue_test", f"{glue_data.SUBMISSION[key]}.tsv"),
                                     task.name, ids, logits[:, 0] if regression else np.argmax(logits, -1))
        return {}

      predictors[f"{name}_test"] = Evaluator(eval_batches_of(test_rows), predict, submission)
  causal_note = (("a causal model: the classifier reads each row's last real token, the one that has seen the "
                  "whole row (Hugging Face's decoder classifiers'; classifier_token='last')",)
                 if model_config.causal else ())
  batches = features_lib.ExampleBatches(train, global_batch=config.batch_size, max_len=config.max_len,
                                        pad_id=tokenizer.pad_id, seed=config.seed, group_size=data.get("group_size", 50),
                                        **common.batching(data))
  return Task(f"glue/{task.name}", model, model_config, common.init_inputs(config.max_len, use_types), loss_fn, batches,
              evaluators, examples_per_epoch=len(train), load_init=common.load_init(start, changed),
              info=common.info(config, start, model_config), predictors=predictors,
              notes=common.notes(start, model_config, (data.get("data_dir"),)) + tuple(baselines) + causal_note)
