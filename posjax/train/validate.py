"""Everything about a run that can be wrong, checked before the workdir is written, on every process at once: the
config's ranges, its durations, the batch against processes and devices, the task (its data and model), the
workdir's earlier config and ``init_from``."""

from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Any, Callable, NamedTuple

from absl import logging
import flax.traverse_util
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from posjax import config_args
from posjax import results as results_lib
from posjax.data import tokenizer as tokenizer_lib
from posjax.config_args import FRACTION, NON_NEGATIVE, POSITIVE, at_least
from posjax.train import checkpoint as checkpoint_lib
from posjax.train import lock as lock_lib
from posjax.train import parallel as parallel_lib
from posjax.train import peers
from posjax.train import sharding
from posjax.train.step import TrainState, make_optimizer
from posjax.train.task import Task


# Fields that change how a run reads its input or reports, not what it computes: a resumed run may change them.
RESUMABLE_CHANGES = ("allow_config_change", "progress", "device_prefetch", "data.workers", "peer_timeout_seconds",
                     "shutdown_timeout_seconds", "model.kernel_platform", "loss_chunk")


# Fields added since runs began recording their config: what a run that has none of them did (given its flattened
# config, and the one resuming it, where the field changed nothing). A missing field is that value, not a change.
ADDED_FIELDS = {
    "data.random_positions_first": lambda before, now: (
        "zero" if before.get("data.random_positions") else now["data.random_positions_first"]),
    "classifier_token": lambda before, now: "first" if before.get("model.causal") else "auto",
    "z_loss": lambda before, now: 0.0,
    "model.qk_norm_axes": lambda before, now: "head",
    "model.embedding_scale": lambda before, now: False,
    "model.query_scale": lambda before, now: 0.0,
    "model.attention_softcap": lambda before, now: 0.0,
    "model.attention_query_block": lambda before, now: 0,
    "mesh.context": lambda before, now: 1,
    "model.final_logit_softcap": lambda before, now: 0.0,
    "model.layer_windows": lambda before, now: "",
    "model.layer_chunks": lambda before, now: "",
    "model.first_attention_norm": lambda before, now: True,
    "model.head_bias": lambda before, now: True,
    "model.attention_sinks": lambda before, now: False,
    "model.temperature_layers": lambda before, now: "",
    "model.layout": lambda before, now: "",
    "model.qk_norm_scale": lambda before, now: True,
    "ruler_train.fraction": lambda before, now: 0.0,
    "ruler_train.tokens": lambda before, now: 16,
}


def check_workdir_config(config: ml_collections.ConfigDict, workdir: str, ignore: tuple[str, ...] = (),
                         write: bool = True) -> None:
  """Compares the config with ``workdir/config.json`` and (``write``) writes it there; a restart with a different
  one (fields in ``ignore`` and ``RESUMABLE_CHANGES`` aside) is an error unless ``config.allow_config_change``."""
  ignore = tuple(ignore) + RESUMABLE_CHANGES
  path = os.path.join(workdir, "config.json")
  current = json.loads(config.to_json_best_effort(sort_keys=True))
  if os.path.exists(path) and not config.get("allow_config_change", False):
    with open(path) as f:
      previous = json.load(f)
    before = flax.traverse_util.flatten_dict(previous, sep=".")
    now = flax.traverse_util.flatten_dict(current, sep=".")
    before = {**{k: implied(before, now) for k, implied in ADDED_FIELDS.items() if k in now and k not in before},
              **before}
    changed = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k) and k not in ignore)
    if changed:
      if "task" in changed:  # the change that explains the others comes first
        raise ValueError(f"{workdir} holds a {before.get('task')!r} run and this config is a {now.get('task')!r} "
                         f"run ({len(changed)} fields differ: {changed}); use another workdir")
      raise ValueError(f"{workdir} holds a run with a different config (changed: {changed}); use another workdir" + (
          " or set --config.allow_config_change=True" if "allow_config_change" in config else ""))
  check_vocabulary(config, workdir, write)
  if write and jax.process_index() == 0:
    results_lib.write_json(path, current, indent=2)


VOCABULARY = "vocabulary.json"  # a run's tokenizer file and its sha256 (_sha256), recorded when it starts


def vocabulary_file(config: ml_collections.ConfigDict) -> str:
  """The tokenizer file a run reads: ``data.vocab_file``, else (fine-tuning) its ``init`` run's ("" for none)."""
  data = config.get("data") or {}
  vocab = data.get("vocab_file", "") if hasattr(data, "get") else ""
  if not vocab and config.get("init"):
    vocab = checkpoint_lib.vocab_file_of(checkpoint_lib.run_directory(config.init))
  return vocab


def recorded_vocabulary(run: str) -> dict | None:
  """``{"file", "sha256"}`` of the tokenizer ``run`` trained with: its :data:`VOCABULARY` record, else (a run from
  before records) its config.json's ``data.vocab_file`` where that file is still there; None when neither."""
  path = os.path.join(run, VOCABULARY)
  if os.path.isfile(path):
    with open(path) as f:
      return json.load(f)
  vocab = (checkpoint_lib.run_config(run).get("data") or {}).get("vocab_file", "")
  return {"file": os.path.abspath(vocab), "sha256": _sha256(vocab)} if vocab and os.path.isfile(vocab) else None


def _sha256(path: str, settings: bool = True) -> str:
  """The sha256 of a tokenizer file as its reader sees it: a WordPiece vocab.txt by its pieces, one a line without
  trailing whitespace (a copy with CRLF line ends is the same vocabulary), any other file by its bytes and, where it
  has them, those of its Hugging Face settings files beside it (``settings``; they name its special tokens:
  :func:`posjax.data.tokenizer.digest`, the caches' and prepared corpora's key too)."""
  if path.endswith(".txt"):
    with open(path, "rb") as f:
      data = f.read()
    return hashlib.sha256(b"\n".join(line.rstrip() for line in data.rstrip(b"\r\n").split(b"\n"))).hexdigest()
  if settings:
    return tokenizer_lib.digest(path)
  with open(path, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()


def check_vocabulary(config: ml_collections.ConfigDict, workdir: str, write: bool = True,
                     sources: tuple[str, ...] = ()) -> None:
  """A run records its tokenizer (:data:`VOCABULARY`: the file and its sha256). Resuming it with another one is an
  error naming both, ``allow_config_change`` or not, and so is starting from a run (``init``, ``init_from``, an
  evaluated run in ``sources``) that trained with another: the same ids would name other pieces."""
  vocab = vocabulary_file(config)
  if not vocab or not os.path.isfile(vocab):
    return
  digest = _sha256(vocab)
  # what runs recorded before the settings files counted: the file's bytes alone (accepted for them only)
  legacy = _sha256(vocab, settings=False)
  runs = [(workdir, "")] + [(checkpoint_lib.run_directory(config[f]), f" (config.{f})") for f in ("init", "init_from")
                            if config.get(f)]
  for run, role in runs + [(source, " (the evaluated run)") for source in sources]:
    recorded = recorded_vocabulary(run) if os.path.isdir(run) else None
    if recorded and recorded["sha256"] not in (digest, legacy if recorded.get("settings") is None else digest):
      raise ValueError(f"{run}{role} was trained with the tokenizer {recorded['file']} (sha256 "
                       f"{recorded['sha256'][:12]}); this config's {vocab} is another (sha256 {digest[:12]}), whose "
                       "ids name other pieces: use that run's tokenizer" + ("" if role else ", or another workdir"))
  if write and jax.process_index() == 0 and not os.path.isfile(os.path.join(workdir, VOCABULARY)):
    results_lib.write_json(os.path.join(workdir, VOCABULARY), {"file": os.path.abspath(vocab), "sha256": digest,
                                                               "settings": True}, indent=1)


def resolve_durations(config: ml_collections.ConfigDict, examples_per_epoch: int | None = None
                      ) -> ml_collections.ConfigDict:
  """``total_steps`` from whichever of ``total_steps`` / ``total_epochs`` / ``total_examples`` is set (an epoch
  is ``examples_per_epoch``: the task's training examples, or for MLM ``data.examples_per_epoch`` packed
  sequences), and ``warmup_steps`` from ``warmup_fraction`` of the run when that is set (it replaces
  ``warmup_steps``, as epochs replace ``total_steps``)."""
  values = config.to_dict()
  if any(values.get(f"total_{unit}") is not None for unit in ("epochs", "examples")):
    values["total_steps"] = None
    values["total_steps"] = config_args.steps("total", values, examples_per_step=config.batch_size,
                                              examples_per_epoch=examples_per_epoch)
  fraction = values.get("warmup_fraction")
  if fraction is not None:
    values["warmup_steps"] = int(round(fraction * values["total_steps"]))
  elif values.get("warmup_steps") is None:
    raise ValueError("give config.warmup_steps or config.warmup_fraction (of the run's steps)")
  if values.get("evals_per_epoch"):
    if not examples_per_epoch:
      raise ValueError("config.evals_per_epoch needs a task with a known epoch (fine-tuning, or "
                       "data.examples_per_epoch)")
    values["steps_per_epoch"] = examples_per_epoch / config.batch_size
  return ml_collections.ConfigDict(values)


def eval_steps(config: ml_collections.ConfigDict) -> frozenset[int]:
  """The steps after which the evaluators run: every ``eval_every_steps``, or ``evals_per_epoch`` times per
  epoch (TUPE's fine-tuning: fairseq's ``--validate-interval-updates 2``, in the middle and at the end of each
  epoch), and always the last step; none when both are 0."""
  total = config.total_steps
  if config.get("evals_per_epoch"):
    every = config.steps_per_epoch / config.evals_per_epoch
    steps = {max(1, math.floor(k * every + 0.5)) for k in range(1, math.ceil(total / every) + 1)}
  elif config.eval_every_steps > 0:
    every = 0
    steps = set(range(config.eval_every_steps, total + 1, config.eval_every_steps))
  else:
    return frozenset()
  # An evaluation less than half an interval before the last step (a rounded-up final epoch) is the last one's.
  return frozenset(s for s in steps if s < total - every / 2) | {total}


# The config's numeric fields and their ranges (a rule a library class already enforces, as ``TransformerConfig``'s
# dropout or ``Masking``'s rates, lives there alone).
RANGES = {
    "seed": NON_NEGATIVE, "batch_size": POSITIVE, "eval_batch_size": POSITIVE, "total_steps": POSITIVE,
    "total_epochs": POSITIVE, "total_examples": POSITIVE, "warmup_steps": NON_NEGATIVE, "warmup_fraction": FRACTION,
    "learning_rate": NON_NEGATIVE, "max_len": at_least(8), "grad_accum_steps": POSITIVE, "adam_b1": FRACTION,
    "adam_b2": FRACTION, "adam_eps": POSITIVE, "weight_decay": NON_NEGATIVE, "grad_clip_norm": POSITIVE,
    "log_every_steps": POSITIVE, "eval_every_steps": NON_NEGATIVE, "evals_per_epoch": NON_NEGATIVE,
    "checkpoint_every_steps": POSITIVE, "peer_timeout_seconds": POSITIVE, "shutdown_timeout_seconds": POSITIVE,
    "keep_checkpoints": POSITIVE, "device_prefetch": NON_NEGATIVE, "data.workers": NON_NEGATIVE,
    "profile_steps": POSITIVE, "loss_chunk": NON_NEGATIVE, "z_loss": NON_NEGATIVE, "init_step": NON_NEGATIVE, "data.num_shards": NON_NEGATIVE,
    "data.examples_per_epoch": POSITIVE, "data.doc_stride": POSITIVE, "data.max_query_len": POSITIVE,
    "data.group_size": NON_NEGATIVE, "regression_scale": POSITIVE, "data.random_positions": NON_NEGATIVE,
}


def check_batch(config) -> tuple[int, int]:
  """The per-process training and evaluation batches (``eval_batch_size``, where a task has one)."""
  processes = jax.process_count()
  eval_batch = config.get("eval_batch_size") or config.batch_size
  for field, value in (("batch_size", config.batch_size), ("eval_batch_size", eval_batch)):
    if value % processes:
      raise ValueError(f"{field}={value} must divide evenly over {processes} processes")
  local = config.batch_size // processes
  if local % config.grad_accum_steps:
    raise ValueError(f"the per-process batch {local} must divide into grad_accum_steps={config.grad_accum_steps}")
  return local, eval_batch // processes


MESSAGE_BYTES = 512  # of a process's error, shared with the others


def agree(error: Exception | None) -> None:
  """Raises on every process when any process failed (a process alone would leave the others waiting in a
  collective): the failed process its own error, the others one that names the first failed process and quotes
  its message."""
  text = "" if error is None else peers.describe(error)
  encoded = np.zeros(MESSAGE_BYTES + 1, np.uint8)
  raw = text.encode()[:MESSAGE_BYTES]
  encoded[0], encoded[1:1 + len(raw)] = error is not None, np.frombuffer(raw, np.uint8)
  gathered = sharding.per_process(encoded)
  failed = np.flatnonzero(gathered[:, 0])
  if error is not None:
    raise error
  if len(failed):
    first = int(failed[0])
    message = bytes(gathered[first, 1:]).rstrip(b"\0").decode(errors="replace")
    others = f" (and process(es) {failed[1:].tolist()})" if len(failed) > 1 else ""
    raise peers.Stopped(f"process {first} stopped{others}: {message}")


class Prepared(NamedTuple):
  """What validation built, for the run to use."""
  config: ml_collections.ConfigDict  # with total_steps and warmup_steps resolved
  task: Task
  optimizer: Any
  schedule: Any
  init_boxed: Callable
  init_rng: jax.Array
  dropout_rng: jax.Array
  parallel: Any


def carry_training_length(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """A warm start (``init_from``) at a longer ``max_len`` than its run's, with a position method whose
  ``original_max_len`` the user left None: the length that run trained at (its config.json's ``max_len``; a converted
  model's ``model_config.json``'s) becomes it, so a
  YaRN / PI / LongRoPE fine-tune extends from the base run's length rather than from the new one, and FIRE keeps the
  threshold it was trained with. A value the user gives stays; RoPE without a scaling or with ``dynamic`` takes none
  (``dynamic`` grows from the model's ``max_len``, as Hugging Face's)."""
  options = config.get("model", {}).get("position_options", {})
  if (not config.get("init_from") or "original_max_len" not in options or options.original_max_len is not None
      or options.get("scaling") in ("none", "dynamic")):
    return config
  try:
    trained = checkpoint_lib.read_model_config(config.init_from, "config.init_from").get("max_len") or 0
  except FileNotFoundError:
    return config  # not a posjax run: the checkpoint check below says so
  # the length it trained at (a warm start's own model_config.json keeps its base's max_len)
  trained = checkpoint_lib.run_config(config.init_from).get("max_len") or trained
  length = config.get("max_len") or config.model.get("max_len") or 0  # this run's training length (init_from sets
  # model.max_len to the base run's)
  if trained and length > trained:
    config = config.copy_and_resolve_references()
    with config.unlocked():
      config.model.position_options.original_max_len = int(trained)
    logging.info("model.position_options.original_max_len=%d: the length config.init_from=%s was trained at "
                 "(this run's max_len is %d)", trained, config.init_from, length)
  return config


def validate(config: ml_collections.ConfigDict, workdir: str, build_task: Callable[..., Task],
             devices=None) -> Prepared:
  """Checks ``config`` and builds what the run needs, writing nothing (see :func:`validate_everywhere`);
  ``devices``: the mesh's (default all; ahead-of-time compilation passes a target's)."""
  config = carry_training_length(config)
  config_args.check_ranges(config, RANGES)
  lock_lib.check(workdir)
  check_workdir_config(config, workdir, write=False)
  local_batch, local_eval_batch = check_batch(config)
  task = build_task(config, local_batch)
  results_lib.check_selection(config.get("select", "last"), config.get("select_metric", ""), task.evaluators)
  resolved = resolve_durations(config, task.examples_per_epoch)
  optimizer, schedule = make_optimizer(resolved)
  init_rng, dropout_rng = jax.random.split(jax.random.PRNGKey(resolved.seed))

  def init_boxed(rng):
    params = task.model.init(rng, **task.init_inputs)["params"]
    return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params))

  abstract_state = jax.eval_shape(init_boxed, init_rng)  # traces the model: its options are checked here
  parallel = parallel_lib.make(resolved, abstract_state, devices)
  parallel.check_batch(local_batch, resolved.grad_accum_steps)
  parallel.check_batch(local_eval_batch, 1, "eval_batch_size")
  parallel.check_length(resolved.get("max_len") or resolved.model.get("max_len") or 0)
  if resolved.get("init_from"):
    checkpoint_lib.check_directory(resolved.init_from, "config.init_from")
  return Prepared(resolved, task, optimizer, schedule, init_boxed, init_rng, dropout_rng, parallel)


def everywhere(fn, *args):
  """``fn(*args)`` on every process; when it fails (a mistake: ``ValueError`` / ``OSError``) on any process, every
  process raises (:func:`agree`), so none is left waiting in a collective."""
  result, error = None, None
  try:
    result = fn(*args)
  except (ValueError, OSError) as caught:
    error = caught
  agree(error)
  return result


def validate_everywhere(config: ml_collections.ConfigDict, workdir: str, build_task) -> Prepared:
  """:func:`validate` on every process; when any process refuses the config, every process raises."""
  return everywhere(validate, config, workdir, build_task)
