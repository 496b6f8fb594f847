"""Orbax checkpoints in the workdir: the train state and the input position, saved together.

Saves are asynchronous and atomic (orbax writes to a temporary directory and renames it when complete),
so a killed run never leaves a half-written latest checkpoint. Kept: the latest ``keep`` plus every step in
``keep_steps`` (e.g. the 100k / 300k / 600k checkpoints of a 1M-step run). Restoring takes the target's
shardings, so a checkpoint restores onto any number of devices or mesh shape.

A read that fails with an I/O error (the storage's, not the checkpoint's: ``is_transient``) is retried with
backoff, and still failing it stops the run with the checkpoint left in place. A checkpoint that fails to parse
(a truncated or corrupted file) is moved aside to ``<directory>.unreadable/<step>``
(kept for inspection, never deleted) with a one-line warning, and the run restores the newest readable one;
when checkpoints exist but none can be read, restoring is an error that names them.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import logging as std_logging
import os
import sys
import time
from typing import Any, Sequence

import flax.traverse_util
import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils
from orbax.checkpoint import checkpoint_managers
from orbax.checkpoint._src.metadata import array_metadata_store
from orbax.checkpoint._src.serialization import type_handler_registry

from posjax import results as results_lib
from posjax.data.tokenizer import Tokenizer
from posjax.models import layout
from posjax.train import sharding


# Orbax's replica-parallel save splits each replicated array among the devices that hold it, each writing its slice;
# every slice is a program compiled per shape and device, which for a small array costs far more than the parallel
# write saves (a tiny model's first save in a process: 2 s of compiles). Arrays whose slices would be smaller than
# this are written whole by one replica; larger ones keep orbax's replica-parallel write.
MIN_REPLICA_SLICE_BYTES = 1 << 20


def _handlers() -> dict:
  # Replaces orbax's own jax.Array handler in its global registry, on purpose: without its warning per checkpointer.
  type_handler_registry.GLOBAL_TYPE_HANDLER_REGISTRY.add(jax.Array, ocp.type_handlers.ArrayHandler(
      array_metadata_store=array_metadata_store.Store(), min_slice_bytes_for_replica_parallel=MIN_REPLICA_SLICE_BYTES),
      override=True, ignore_warnings=True)
  return {"state": ocp.StandardCheckpointHandler(), "data": ocp.JsonCheckpointHandler()}


class Checkpointer:
  """A run's checkpoint directory (see the module docstring): saves a step's train state with its input
  position, keeps the latest ``keep`` and every step of ``keep_steps``, and restores the newest readable one."""

  def __init__(self, directory: str, *, keep: int = 3, keep_steps: Sequence[int] = (), async_save: bool = True,
               attempts: int = 4, backoff: float = 2.0):
    self.attempts, self.backoff = max(int(attempts), 1), float(backoff)
    policies = [checkpoint_managers.LatestN(keep)]
    if keep_steps:
      policies.append(checkpoint_managers.CustomSteps(list(keep_steps)))
    options = ocp.CheckpointManagerOptions(
        preservation_policy=checkpoint_managers.AnyPreservationPolicy(policies),
        enable_async_checkpointing=async_save, create=True)
    self.manager = ocp.CheckpointManager(os.path.abspath(directory), options=options, item_handlers=_handlers())
    self._saving = None  # the step of the save in flight
    self._failed = False  # a failed save has been raised: later waits (on the way out) stay quiet

  @property
  def directory(self) -> str:
    return os.fspath(self.manager.directory)

  def save(self, step: int, state: Any, data_state: dict) -> None:
    """Starts saving ``step`` (it completes in the background); a failed save, this one's or the previous
    one's, is an ``OSError`` naming the last complete checkpoint, which stays."""
    try:
      self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                      data=ocp.args.JsonSave(data_state)), force=True)
      self._saving = step
    except Exception as error:  # noqa: BLE001
      raise self._save_failed(self._saving or step, error) from None

  def wait(self) -> None:
    """Waits for the save in flight; its failure is the ``OSError`` of :meth:`save`."""
    try:
      self.manager.wait_until_finished()
    except Exception as error:  # noqa: BLE001
      if not self._failed:
        raise self._save_failed(self._saving, error) from None
    self._saving = None

  def _save_failed(self, step: int | None, error: Exception) -> OSError:
    self._saving, self._failed = None, True
    complete = sorted(int(p) for p in os.listdir(self.directory) if p.isdigit())
    last = f"step {complete[-1]}" if complete else "none"
    return OSError(f"saving checkpoint {step} in {self.directory} failed ({_os_reason(error)}); the last complete "
                   f"checkpoint ({last}) is kept: fix the storage (free space, permissions) and rerun the same command "
                   "to resume from it")

  def restore(self, abstract_state: Any) -> tuple[Any, dict] | None:
    """The newest readable checkpoint as ``(state, data_state)``, laid out like ``abstract_state``; ``None``
    when there is no checkpoint. Newer unreadable ones are moved aside; none readable is an error."""
    failed = {}
    steps = sorted(self.manager.all_steps(), reverse=True)
    if steps:
      self._check_layout(steps[0], abstract_state)
    for step in steps:
      restored, reason, transient = self._restore_step(step, abstract_state)
      outcome = READ if reason is None else TRANSIENT if transient else UNREADABLE
      outcomes = sharding.per_process(np.int32(outcome))  # every process must settle on the same step
      if (outcomes == TRANSIENT).any():
        where = np.flatnonzero(outcomes == TRANSIENT).tolist()
        raise OSError(f"checkpoint {step} in {self.manager.directory} could not be read after {self.attempts} "
                      f"attempts on process(es) {where} ({reason or 'see their output'}), an I/O error rather than "
                      "a damaged checkpoint: it is left in place; rerun when the storage answers")
      if (outcomes == UNREADABLE).any():
        elsewhere = [int(p) for p in np.flatnonzero(outcomes) if p != jax.process_index()]
        failed[step] = reason or f"unreadable on process(es) {elsewhere}"
        continue
      if failed:
        self._move_aside(failed)
      return restored.state, dict(restored.data)
    if failed:
      reasons = "; ".join(f"step {step}: {reason}" for step, reason in failed.items())
      raise ValueError(f"no checkpoint in {self.manager.directory} can be restored ({reasons}). They are left in "
                       "place; move them away to start this run afresh, or use another workdir")
    return None

  def _check_layout(self, step: int, abstract_state: Any) -> None:
    """A checkpoint's layers in the other layout than the run's (``model.scan_layers`` changed), or parameters of
    other shapes, are an error that says how to go on, not an unreadable checkpoint."""
    try:
      metadata = self.manager.item_metadata(step).state
      saved = layout.of(metadata)
    except Exception:  # noqa: BLE001  (unreadable metadata: the restore below says why)
      return
    wanted = layout.of(abstract_state)
    if saved == wanted == layout.SCANNED and layout.period(metadata) != layout.period(abstract_state):
      raise ValueError(f"checkpoint {step} in {self.manager.directory} scans its layers in groups of "
                       f"{layout.period(metadata)} kinds, this run's model in groups of {layout.period(abstract_state)} "
                       "(its layers' kinds changed): start another workdir from it with init_from="
                       f"{self.manager.directory} (parameters convert; the optimizer state starts afresh)")
    if saved and wanted and saved != wanted:
      raise ValueError(f"checkpoint {step} in {self.manager.directory} holds its layers {saved}, this run's model "
                       f"{wanted} (model.scan_layers={wanted == layout.SCANNED}): resume with "
                       f"model.scan_layers={saved == layout.SCANNED}, or start another workdir from it with "
                       f"init_from={self.manager.directory} (parameters convert; the optimizer state starts afresh)")
    self._check_shapes(step, metadata, abstract_state)

  def _check_shapes(self, step: int, saved: Any, abstract_state: Any) -> None:
    """Parameters of other shapes than the checkpoint's (a changed vocabulary or architecture, allowed by
    ``allow_config_change``) are an error that names the change, not an unreadable checkpoint."""
    before, now = _param_shapes(saved), _param_shapes(abstract_state)
    changed = [(path, before[path], now[path]) for path in now if path in before and before[path] != now[path]]
    if not changed:
      return
    workdir = os.path.dirname(os.path.normpath(str(self.manager.directory)))
    restart = f"or start another workdir from it with init_from={workdir}"
    vocabulary = [(old, new) for path, old, new in changed if "word_embeddings" in path]
    if vocabulary:
      (old, *_), (new, *_) = vocabulary[0]
      raise ValueError(f"checkpoint {step} in {self.manager.directory} was trained with a vocabulary of {old:,} "
                       f"pieces, this run's has {new:,} (data.vocab_file): a run resumes only with its own "
                       f"vocabulary; give it back, {restart} (the embeddings then start fresh)")
    path, old, new = changed[0]
    raise ValueError(f"checkpoint {step} in {self.manager.directory} holds parameters of other shapes than this "
                     f"run's model ({path}: {old} in the checkpoint, {new} now; {len(changed)} changed in all): "
                     f"resume with the model it was trained with, {restart} (parameters of a new shape start fresh)")

  def _restore_step(self, step: int, abstract_state: Any):
    """``(restored, reason, transient)`` of one step: I/O errors are retried with backoff (``attempts`` in all),
    a checkpoint that fails to parse is not."""
    for attempt in range(self.attempts):
      try:
        return self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore())), None, False
      except Exception as error:  # noqa: BLE001  (any unreadable checkpoint: try the one before)
        reason = _summary(error)
        if not is_transient(error):
          return None, reason, False
        if attempt + 1 < self.attempts:
          logging.warning("reading checkpoint %d failed (%s); attempt %d of %d in %.0f s", step, reason,
                          attempt + 2, self.attempts, self.backoff * 2 ** attempt)
          time.sleep(self.backoff * 2 ** attempt)
    return None, reason, True

  def _move_aside(self, failed: dict[int, str]) -> None:
    """Renames unreadable steps to ``<directory>.unreadable/<step>`` (process 0; every process waits)."""
    directory = self.directory
    aside = directory.rstrip("/") + ".unreadable"
    _sync("posjax_checkpoint_move_aside_start")
    for step, reason in failed.items() if jax.process_index() == 0 else ():
      target, n = os.path.join(aside, str(step)), 1
      while os.path.exists(target):
        target, n = os.path.join(aside, f"{step}.{n}"), n + 1
      os.makedirs(aside, exist_ok=True)
      os.rename(os.path.join(directory, str(step)), target)
      logging.warning("checkpoint %d cannot be restored (%s); moved to %s, resuming from an earlier one", step,
                      reason, target)
    _sync("posjax_checkpoint_move_aside_done")
    self.manager.reload()

  def close(self) -> None:
    self.manager.close()


READ, UNREADABLE, TRANSIENT = 0, 1, 2
# Errors of the storage rather than of the checkpoint (gRPC / TensorStore status names, errno texts): worth a retry.
_TRANSIENT = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "ABORTED", "Input/output error",
              "Connection reset", "Connection refused", "timed out", "Temporary failure", "Stale file handle")


def _causes(error: BaseException) -> list[BaseException]:
  """``error`` and what caused it (``__cause__``, else ``__context__``), innermost last; at most 21, no cycle."""
  chain = [error]
  while len(chain) <= 20:
    cause = chain[-1].__cause__ or chain[-1].__context__
    if cause is None or any(cause is e for e in chain):
      break
    chain.append(cause)
  return chain


def is_transient(error: Exception) -> bool:
  """Whether a failed read looks like the storage's passing trouble (an ``OSError`` other than a missing or
  malformed file, or a status that says so), not a damaged checkpoint."""
  chain = _causes(error)
  for e in chain:
    if isinstance(e, (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)):
      return False
    if isinstance(e, (TimeoutError, ConnectionError)) or (isinstance(e, OSError) and e.errno is not None):
      return True
  text = " ".join(str(e) for e in chain)
  return any(marker in text for marker in _TRANSIENT)


_STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO, errno.ENOENT)


def _os_reason(error: Exception) -> str:
  """The operating system's words where an ``OSError`` with an errno caused ``error`` (``[Errno 28] No space
  left on device``), else its summary."""
  chain = _causes(error)
  found = [e for e in chain if isinstance(e, OSError) and e.errno is not None]
  if found:
    return f"[Errno {found[0].errno}] {found[0].strerror}"
  text = " ".join(str(e) for e in chain)
  for code in _STORAGE_ERRNOS:  # TensorStore words them in several ways; the system's text is in each
    if os.strerror(code) in text:
      return f"[Errno {code}] {os.strerror(code)}"
  return _summary(error)


def _summary(error: Exception, limit: int = 200) -> str:
  """The first line of an error, without TensorStore's spec dump."""
  text = str(error).split("\n")[0].split(" See full TensorStore details")[0]
  text = f"{type(error).__name__}: {text}"
  return text if len(text) <= limit else text[:limit - 3] + "..."


def resolve_directory(directory: str) -> str:
  """A run's checkpoint directory: ``directory`` itself, or its ``checkpoints`` folder when given a workdir."""
  inner = os.path.join(directory, "checkpoints")
  return inner if os.path.isdir(inner) else directory


def check_directory(directory: str, field: str) -> None:
  """A workdir or a directory holding this project's checkpoints (step folders), or an error naming ``field``."""
  resolved = resolve_directory(directory)
  steps = [p for p in os.listdir(resolved) if p.isdigit()] if os.path.isdir(resolved) else []
  if not steps:
    raise FileNotFoundError(f"{field}={directory!r} holds no checkpoint (step folders)")


def _sync(name: str) -> None:
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def silence_abandoned_io():
  """After a failed restore or save, the reads and writes orbax abandoned still finish, each reporting "Event loop
  is closed" or its own error (through ``sys.unraisablehook``), or a never-retrieved future (asyncio's logger, when
  the task is collected), and orbax's threads log the error they hand to the caller with its traceback - thousands
  of lines that say nothing the one-line error does not. Drops exactly those (``-v 0`` keeps orbax's log); returns
  the function that puts the hook and the loggers' filters back. The command line (``posjax.main``) keeps them for
  its process (what a run abandoned may report at exit); a run in a library's process restores them
  (:func:`quiet_abandoned_io`)."""
  previous = sys.unraisablehook

  def abandoned(unraisable) -> bool:
    code = getattr(unraisable.object, "cr_code", None)
    return (("Event loop is closed" in str(unraisable.exc_value) and isinstance(unraisable.exc_value, RuntimeError))
            or (code is not None and "orbax" in code.co_filename))

  def hook(unraisable):
    if not abandoned(unraisable):
      previous(unraisable)

  def retrieved(record) -> bool:
    return "exception was never retrieved" not in record.getMessage()

  loggers = ((std_logging.getLogger("asyncio"), retrieved), (logging.get_absl_logger(), _orbax_thread_failures))
  sys.unraisablehook = hook
  for logger, keep in loggers:
    logger.addFilter(keep)

  def undo(collect: bool = True):
    if collect:  # what the run abandoned and nothing holds reports now, while its noise is still dropped
      gc.collect()
    sys.unraisablehook = previous
    for logger, keep in loggers:
      logger.removeFilter(keep)
  return undo


@contextlib.contextmanager
def quiet_abandoned_io():
  """:func:`silence_abandoned_io` while the context is entered (a run); the hook and the filters as before after. A
  run that ended by an exception may have abandoned I/O: a full collection reports it first, while it is dropped (one
  that returned waited for all of its I/O, and a full collection in a large process takes seconds)."""
  undo = silence_abandoned_io()
  try:
    yield
  except BaseException:
    undo(collect=True)
    raise
  undo(collect=False)


def _orbax_thread_failures(record) -> bool:
  """False for orbax's own error records of a failed background operation (it raises them in the caller too),
  unless the log is verbose."""
  if logging.get_verbosity() >= logging.INFO or record.levelno < std_logging.ERROR:
    return True
  return os.sep + "orbax" + os.sep not in record.pathname

TOKENIZER_FILES = ("vocab.txt", "tokenizer.json")  # a run's vocabulary, when kept beside its checkpoints


def _param_shapes(tree: Any) -> dict[str, tuple]:
  """``{"a/b/kernel": shape}`` of the ``params`` of a train state, or of a checkpoint's metadata."""
  shapes = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    names = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
    if names and names[0] == "params" and getattr(leaf, "shape", None) is not None:
      shapes["/".join(names[1:])] = tuple(leaf.shape)
  return shapes


def read_model_config(workdir: str, field: str = "workdir") -> dict:
  """A run's ``model_config.json`` (its TransformerConfig fields), or an error naming ``field``."""
  path = os.path.join(workdir, "model_config.json")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{field}={workdir!r} has no model_config.json (every posjax run writes one beside its "
                            "checkpoints)")
  with open(path) as f:
    return json.load(f)


def run_config(workdir: str) -> dict:
  """A run's ``config.json`` (the config it trained with); ``{}`` for a converted model, which has none."""
  return results_lib.read_json(os.path.join(workdir, "config.json")) or {}


def run_directory(path: str) -> str:
  """A run's workdir from ``path``, the workdir or its ``checkpoints`` directory (``config.init`` takes both)."""
  path = os.path.normpath(path)
  if not os.path.isdir(os.path.join(path, "checkpoints")) and os.path.basename(path) == "checkpoints":
    return os.path.dirname(path)
  return path


def vocab_file_of(workdir: str) -> str:
  """A run's vocabulary: ``vocab.txt`` or ``tokenizer.json`` beside it, else its config's ``data.vocab_file``
  ("" when neither)."""
  for name in TOKENIZER_FILES:
    if os.path.isfile(os.path.join(workdir, name)):
      return os.path.join(workdir, name)
  return (run_config(workdir).get("data") or {}).get("vocab_file", "")


SPECIAL_TOKENS = "special_tokens.json"  # a converted decoder's bos / eos / pad ids (its source's), when it has them
CLS_PACKINGS = ("full_sentence", "documents")  # the packings whose rows start with [CLS]


LM_TASKS = ("mlm", "clm", "electra")  # the pre-training tasks: a run of any other is a fine-tune with its own head


def recorded_special_tokens(workdir: str, seen: frozenset = frozenset()) -> dict | None:
  """A converted model's recorded ids (:data:`SPECIAL_TOKENS`): its own, else those of the run it started from
  (``init_from`` / ``init``, followed back) where both read the same tokenizer file, byte for byte (a run that
  continues a converted model keeps its source's list of eos ids); None where no run of the chain recorded any."""
  recorded = os.path.join(workdir, SPECIAL_TOKENS)
  if os.path.isfile(recorded):
    with open(recorded) as f:
      return json.load(f)
  config, vocab = run_config(workdir), vocab_file_of(workdir)
  for field in ("init_from", "init"):
    source = run_directory(config[field]) if config.get(field) else ""
    if not source or source in seen or not os.path.isdir(source):
      continue
    theirs = vocab_file_of(source)
    if vocab and theirs and os.path.isfile(vocab) and os.path.isfile(theirs) and _same_bytes(vocab, theirs):
      return recorded_special_tokens(source, seen | {workdir})
  return None


def _same_bytes(a: str, b: str) -> bool:
  with open(a, "rb") as x, open(b, "rb") as y:
    return x.read() == y.read()


def special_token_ids(workdir: str) -> dict:
  """A causal run's ``bos_token_id``, ``eos_token_id`` and ``pad_token_id`` (Hugging Face's names; None where it
  has none): a converted model's own (:data:`SPECIAL_TOKENS`, recorded from its source), else what its packing put in
  its rows with its tokenizer (:func:`vocab_file_of`): [PAD] as pad; under the decoders' ``stream`` packings [SEP]
  (each document's last token) as eos and no bos; under ``full_sentence`` / ``documents`` [CLS] (each row's first
  token) as bos and no eos (there [SEP] ends a sentence, not the text)."""
  recorded = recorded_special_tokens(workdir)
  if recorded is not None:
    return recorded
  vocab = vocab_file_of(workdir)
  if not vocab:
    return {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
  tokenizer = Tokenizer.load(vocab)
  starts = (run_config(workdir).get("data") or {}).get("packing", "stream") in CLS_PACKINGS
  if tokenizer.reads_text:  # a Hugging Face decoder tokenizer's own
    return {"bos_token_id": tokenizer.cls_id if starts else tokenizer.bos_id, "eos_token_id": tokenizer.sep_id,
            "pad_token_id": tokenizer.pad_id if tokenizer.settings.get("pad_token") else None}
  return {"bos_token_id": tokenizer.cls_id if starts else None, "eos_token_id": None if starts else tokenizer.sep_id,
          "pad_token_id": tokenizer.pad_id}


def prompt_prefix(workdir: str, special_ids: dict, tokenizer: Tokenizer | None = None) -> list[int]:
  """The ids a prompt to a causal run starts with, as its training rows did (``special_ids``: its
  :func:`special_token_ids`): [CLS] under a packing that starts rows with it; with a Hugging Face tokenizer
  (``tokenizer``, settings files beside it: a converted model's, or a run trained with one) what its own encoding
  puts first (Llama's bos), as under the stream packings and in Hugging Face's ``tokenizer(prompt)``."""
  if tokenizer is not None and tokenizer.reads_text:
    starts = (run_config(workdir).get("data") or {}).get("packing", "stream") in CLS_PACKINGS
    return [tokenizer.cls_id] if starts and recorded_special_tokens(workdir) is None else list(tokenizer.start_ids)
  if recorded_special_tokens(workdir) is not None or special_ids["bos_token_id"] is None:
    return []
  return [special_ids["bos_token_id"]]


def latest_step(directory: str) -> int:
  """The last step kept in a run's checkpoints (its workdir or checkpoint directory)."""
  check_directory(directory, "checkpoint directory")
  manager = ocp.CheckpointManager(os.path.abspath(resolve_directory(directory)), item_handlers=_handlers())
  kept = sorted(manager.all_steps())
  manager.close()
  if not kept:
    raise FileNotFoundError(f"{directory} holds no checkpoint")
  return kept[-1]


def load_params(directory: str, step: int | None = None) -> dict:
  """Parameters of another run's checkpoint (its workdir or checkpoint directory; ``step`` default: the latest),
  as a nested dict of arrays (for warm starts)."""
  check_directory(directory, "checkpoint directory")
  directory = resolve_directory(directory)
  manager = ocp.CheckpointManager(os.path.abspath(directory), item_handlers=_handlers())
  kept = sorted(manager.all_steps())
  if step is not None and step not in kept:
    manager.close()
    raise ValueError(f"step {step} was not kept in {directory}; kept steps: {kept}")
  step = kept[-1] if step is None else step
  # Restore onto this process's first device, whatever topology the checkpoint was saved from.
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  metadata = manager.item_metadata(step).state
  target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), metadata)
  restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
  manager.close()
  state = restored.state
  return state["params"] if isinstance(state, dict) else state.params


def merge_params(fresh: Any, loaded: dict) -> tuple[Any, list[str], list[str]]:
  """``fresh`` with every parameter that ``loaded`` has at the same path and shape replaced by it (``loaded``'s
  layers converted to ``fresh``'s layout first: per layer or scanned, :mod:`posjax.models.layout`).

  Returns the merged tree, the paths kept fresh (new in this model) and the loaded paths left unused.
  """
  fresh_flat = flax.traverse_util.flatten_dict(fresh, sep="/")
  loaded_flat = flax.traverse_util.flatten_dict(layout.like(loaded, fresh), sep="/")
  merged, kept_fresh = {}, []
  for path, value in fresh_flat.items():
    other = loaded_flat.get(path)
    if other is not None and tuple(np.shape(other)) == tuple(value.shape):
      merged[path] = jax.device_put(np.asarray(other, value.dtype), value.sharding)
    else:
      merged[path] = value
      kept_fresh.append(path)
  unused = sorted(set(loaded_flat) - {p for p in fresh_flat if p not in kept_fresh})
  return flax.traverse_util.unflatten_dict(merged, sep="/"), kept_fresh, unused


def warm_start(params, init_from: str):
  """``params`` with every parameter ``init_from``'s latest checkpoint has at the same path and shape; the rest
  stay fresh, and the log names what was created and what was dropped."""
  merged, fresh, unused = merge_params(params, load_params(init_from))
  logging.warning("warm start from %s: %d parameters loaded; created (fresh): %s; dropped: %s", init_from,
                  len(jax.tree.leaves(merged)) - len(fresh), fresh, unused)
  return merged
