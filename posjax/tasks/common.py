"""What the fine-tuning tasks (:mod:`posjax.tasks.glue`, :mod:`posjax.tasks.squad`) share: where a run starts
(:mod:`posjax.finetune.init`), the encoder's inputs, the padding options and the cache of encoded features."""

from __future__ import annotations

import functools
import os

import jax.numpy as jnp
import ml_collections
import numpy as np

from posjax.data import feature_cache, synthetic
from posjax.data import tokenizer as tokenizer_lib
from posjax.data.tokenizer import Tokenizer
from posjax.finetune import init as init_lib
from posjax.models import TransformerConfig


def start(config: ml_collections.ConfigDict):
  """The init run (or None), the tokenizer, the TransformerConfig, whether the position method changed, the
  vocabulary."""
  start = init_lib.find(config)
  data = config.data
  vocab_file = data.get("vocab_file") or (start.vocab_file if start else data.get("scratch_vocab_file"))
  if not vocab_file:
    raise ValueError("no vocabulary: set config.data.vocab_file, or config.init to a run that has one")
  tokenizer = Tokenizer.load(vocab_file)
  tokenizer.need("cls", "sep", purpose=f"fine-tuning (task={config.get('task')!r}: [CLS] first, [SEP] after each "
                                       "segment)")
  fields, changed = init_lib.model_fields(config, start, tokenizer.vocab_size)
  model_config = TransformerConfig.from_config(fields, tokenizer.vocab_size, config.max_len)
  model_config.position_spec.check_length(config.max_len)
  return start, tokenizer, model_config, changed, vocab_file


def info(config, start, model_config) -> dict:
  """What results.json says about the run's start: the init run and step, the position method, ``max_len``."""
  return {"init": start.workdir if start else None, "init_step": start.step if start else None,
          "position": model_config.position, "max_len": config.max_len}


def notes(start, model_config, data_files) -> tuple[str, ...]:
  """What a fine-tuning run says before it trains: where its encoder comes from, and, when its data are runlocal's
  made-up files (any of ``data_files`` in ``configs/data``), that its numbers say nothing about the method."""
  found = [f"fine-tuning from {start.workdir} (step {start.step}): its encoder ({model_config.position}) and "
           "vocabulary" if start else
           f"fine-tuning from scratch: no config.init, so the encoder ({model_config.position}) starts from random "
           "weights; --config.init=PRETRAIN_WORKDIR starts it from a pre-training run"]
  if any(path and os.path.abspath(path).startswith(synthetic.BUILTIN_DIR + os.sep) for path in data_files):
    found.append(f"made-up data ({synthetic.BUILTIN_DIR}): a tiny run on them shows that the pipeline runs, not what "
                 "a position method does")
  return tuple(found)


def inputs(batch: dict, use_types: bool) -> dict:
  """The encoder's keyword inputs from a batch (token types only for a model that has them)."""
  inputs = {"attention_mask": batch["attention_mask"]}
  if use_types:
    inputs["token_type_ids"] = batch["token_type_ids"]
  return inputs


def apply(model, use_types: bool, params, batch, rng=None):
  """The model's outputs on a batch; with ``rng``, in training mode (dropout drawn from it)."""
  return model.apply({"params": params}, batch["input_ids"], deterministic=rng is None,
                     rngs=None if rng is None else {"dropout": rng}, **inputs(batch, use_types))


def init_inputs(max_len: int, use_types: bool) -> dict:
  """One row of inputs for ``model.init``."""
  inputs = {"input_ids": jnp.ones((1, max_len), jnp.int32)}
  if use_types:
    inputs["token_type_ids"] = jnp.zeros((1, max_len), jnp.int32)
  return inputs


def load_init(start, changed):
  """The loop's ``load_init``: fresh parameters -> those of the run it starts from (None: from scratch)."""
  return None if start is None else functools.partial(init_lib.load, start, position_changed=changed)


def in_order(outputs: dict) -> dict:
  """Rows of real examples (``index >= 0``), sorted by index."""
  keep = outputs["index"] >= 0
  order = np.argsort(outputs["index"][keep], kind="stable")
  return {k: v[keep][order] for k, v in outputs.items()}


def batching(data, length: int | None = None) -> dict:
  """The padding options of :mod:`posjax.data.features`: explicit ``length_buckets``, else a ladder with
  ``buckets_per_doubling`` steps. ``length``: an evaluation length other than ``max_len``, which keeps the
  buckets up to it."""
  buckets = tuple(data.get("length_buckets") or ())
  if buckets and length is not None:
    buckets = tuple(b for b in buckets if b < length) + (length,)
  return dict(batching=data.get("batching", "fixed"), buckets=buckets or data.get("buckets_per_doubling") or None)


def eval_batch(config) -> int:
  """The global evaluation batch: ``eval_batch_size``, else the training batch."""
  return config.get("eval_batch_size") or config.batch_size


def cached_features(data, key: dict, build, *, vocab_file: str, source_file: str, source: str):
  """``build()``'s encoded features, kept in ``data.cache_dir`` when it is set, under ``key`` plus what the
  features are made of: the source file's contents (its digest; else ``source`` and ``data.data_dir``) and the
  vocabulary's."""
  cache_dir = data.get("cache_dir", "")
  if cache_dir:
    origin = (feature_cache.file_digest(source_file) if source_file and os.path.isfile(source_file)
              else f"{source} {os.path.abspath(data.data_dir) if data.get('data_dir') else ''}")
    key = {**key, "source": origin, "vocab": tokenizer_lib.digest(vocab_file)}
  return feature_cache.cached(cache_dir, key, build)
