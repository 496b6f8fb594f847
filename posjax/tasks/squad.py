"""SQuAD 1.1 fine-tuning for the training loop: span extraction.

It builds its model from where the run starts (:mod:`posjax.finetune.init`), reads and encodes its data
before anything is written (a bad file, label or question is an error that names it), and declares its
evaluators from ``config.evals``:

- ``squad`` (``split``: ``validation``; ``max_lens``: evaluation lengths, default ``(max_len,)``): exact match
  and F1 of the official v1.1 script at each length, as ``<name>@<length>``; the predictions of each go to
  ``predictions_<name>@<length>.json`` in the workdir (the official script's format), the n-best answers with
  their probabilities to ``nbest_predictions_<name>@<length>.json`` (BERT's). A length longer than a
  learned position table is reported ``unsupported``, never clamped.

From a causal model (a decoder run) it works as Hugging Face's ``LlamaForQuestionAnswering``: the span head's start
and end logits per token, each token's seeing the question and the context up to it; a window without the answer
is labelled at its first token, whose logits are then the same in every window (docs/finetune.md).
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

from posjax.data import features as features_lib
from posjax.finetune import metrics as metrics_lib
from posjax.finetune import squad as squad_data
from posjax.models import Transformer
from posjax.tasks import common
from posjax.train.task import Evaluator, Task

SOURCES = ("json", "tfds")


def squad_examples(data: ml_collections.ConfigDict, split: str) -> list[squad_data.Example]:
  """The questions of ``split`` from ``data.source`` (JSON files or TFDS); none is an error naming the source."""
  if data.source not in SOURCES:
    raise ValueError(f"unknown SQuAD source {data.source!r}; allowed: {list(SOURCES)}")
  if data.source == "json":
    where = data.train_file if split == "train" else data.dev_file
    examples = list(squad_data.json_examples(where))
  else:
    where = f"tfds squad/v1.1 {split}"
    examples = list(squad_data.tfds_examples(split, data.data_dir))
  if not examples:
    raise ValueError(f"SQuAD {split}: {where} holds no questions")
  return examples


def build(config: ml_collections.ConfigDict, local_batch: int) -> Task:
  """SQuAD 1.1 from the official JSON files (``data.train_file`` / ``data.dev_file``) or TFDS ``squad/v1.1``."""
  data = config.data
  start, tokenizer, model_config, changed, vocab_file = common.start(config)
  model = Transformer(model_config, head="span")
  use_types = model_config.type_vocab_size > 0
  window = functools.partial(squad_data.windows, tokenizer, doc_stride=data.doc_stride,
                             max_query_len=data.max_query_len, causal=model_config.causal)

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

  key = {"squad": "train", "max_len": config.max_len, "doc_stride": data.doc_stride,
         "max_query_len": data.max_query_len, "skip": data.get("skip_misplaced_answers", True)}
  train, meta = common.cached_features(data, key, build, vocab_file=vocab_file,
                                       source_file=data.train_file if data.source == "json" else "",
                                       source=f"{data.source} {data.train_file}")
  if meta.get("skipped"):
    logging.warning("SQuAD train: skipped %d question(s) whose answer text is not at its answer_start (as BERT does)",
                    meta["skipped"])

  def loss_fn(params, batch, rng):
    outputs = common.apply(model, use_types, params, batch, rng)
    start_logits, end_logits = outputs.start_logits, outputs.end_logits
    weight = batch["weight"]
    losses = 0.5 * (optax.softmax_cross_entropy_with_integer_labels(start_logits, batch["start_position"])
                    + optax.softmax_cross_entropy_with_integer_labels(end_logits, batch["end_position"]))
    correct = ((jnp.argmax(start_logits, -1) == batch["start_position"])
               & (jnp.argmax(end_logits, -1) == batch["end_position"])).astype(jnp.float32)
    return jnp.sum(losses * weight), {"correct": jnp.sum(correct * weight), "weight": jnp.sum(weight),
                                      "tokens": jnp.sum(batch["attention_mask"]).astype(jnp.float32)}

  def predict(params, batch):
    outputs = common.apply(model, use_types, params, batch)
    start_logits, end_logits = outputs.start_logits, outputs.end_logits
    return {"start": start_logits, "end": end_logits, "index": batch["index"]}

  eval_batch = common.eval_batch(config)
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
        ordered = common.in_order(outputs)
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
                                    pad_id=tokenizer.pad_id, **common.batching(data, length)), predict, squad_metrics)
  causal_note = (("a causal model: start and end logits per token, each seeing the question and the context up to "
                  "it (Hugging Face's LlamaForQuestionAnswering)",) if model_config.causal else ())
  batches = features_lib.ExampleBatches(train, global_batch=config.batch_size, max_len=config.max_len,
                                        pad_id=tokenizer.pad_id, seed=config.seed, group_size=data.get("group_size", 50),
                                        **common.batching(data))
  return Task("squad", model, model_config, common.init_inputs(config.max_len, use_types), loss_fn, batches, evaluators,
              examples_per_epoch=len(train), load_init=common.load_init(start, changed),
              info=common.info(config, start, model_config),
              notes=common.notes(start, model_config, (data.get("train_file"), data.get("dev_file"))) + causal_note)
