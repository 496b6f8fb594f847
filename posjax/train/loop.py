"""The training loop of every task: data -> sharded jit (or pmap) step -> metrics -> evaluators ->
checkpoints, resumable.

``run(config, workdir)`` trains the task ``config.task`` names (``mlm`` pre-training, ``glue``, ``squad``; see
:mod:`posjax.train.tasks`). It resumes from the newest checkpoint in ``workdir`` when there is one: the train
state and the input position are restored, so the resumed run sees exactly the batches, dropout and metrics
an uninterrupted one would. The evaluators run every ``eval_every_steps`` (or ``evals_per_epoch`` times an
epoch) and at the end; every evaluation, and the one ``config.select`` chooses, goes to ``results.json`` with
what the run was (task, step, seed, learning rate, init, position): see :mod:`posjax.results`.
"""

from __future__ import annotations

import collections
import functools
import json
import math
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, NamedTuple

import flax.linen as nn
import flax.traverse_util
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import tqdm
from absl import logging
from jax.experimental import multihost_utils

from posjax import config_args, probes
from posjax import results as results_lib
from posjax.config_args import FRACTION, NON_NEGATIVE, OPEN_FRACTION, POSITIVE, at_least
from posjax.data import features
from posjax.finetune import tasks as finetune_tasks
from posjax.train import checkpoint as checkpoint_lib
from posjax.train import metrics as metrics_lib
from posjax.train import sharding, tasks
from posjax.train.step import TrainState, make_optimizer, train_step

PARALLELISMS = ("jit", "pmap")
TASKS = {"mlm": tasks.mlm, "glue": finetune_tasks.glue, "squad": finetune_tasks.squad, "probe": probes.task}
DETERMINISTIC_METRICS = ("loss", "accuracy", "grad_norm", "learning_rate")
UNSUPPORTED = results_lib.UNSUPPORTED


# Fields that change how a run reads its input or reports, not what it computes: a resumed run may change them.
RESUMABLE_CHANGES = ("allow_config_change", "progress", "device_prefetch", "data.workers")


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
    changed = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k) and k not in ignore)
    if changed:
      raise ValueError(f"{workdir} holds a run with a different config (changed: {changed}); use another workdir" + (
          " or set --config.allow_config_change=True" if "allow_config_change" in config else ""))
  if write and jax.process_index() == 0:
    with open(path + ".tmp", "w") as f:
      json.dump(current, f, indent=2, sort_keys=True)
    os.replace(path + ".tmp", path)


class JitParallel:
  """One program over a device mesh: parameters sharded by their logical axes, the batch over data/fsdp."""

  def __init__(self, config, abstract_boxed_state):
    self.mesh = sharding.make_mesh(dict(config.mesh))
    self.state_shardings = sharding.logical_shardings(abstract_boxed_state, self.mesh)
    self.abstract_state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                       nn.unbox(abstract_boxed_state), self.state_shardings)

  def init(self, init_fn, rng):
    return jax.jit(init_fn, out_shardings=self.state_shardings)(rng)

  def check_batch(self, local_batch: int, accum_steps: int, field: str = "batch_size") -> None:
    del accum_steps  # micro-batches are split inside the program, whatever their sharding
    shards = math.prod(self.mesh.shape[axis] for axis in sharding.BATCH)
    if (local_batch * jax.process_count()) % shards:
      raise ValueError(f"{field}={local_batch * jax.process_count()} must divide over the mesh's {shards} data x "
                       "fsdp devices")

  def compile_step(self, step_fn):
    batch = sharding.batch_sharding(self.mesh)
    return jax.jit(step_fn, in_shardings=(self.state_shardings, batch, sharding.replicated(self.mesh)),
                   out_shardings=(self.state_shardings, sharding.replicated(self.mesh)), donate_argnums=0)

  def compile_predict(self, predict_fn):
    """``predict_fn(params, batch)`` with every output row of the global batch on every process."""
    return jax.jit(predict_fn, out_shardings=sharding.replicated(self.mesh))

  def put_batch(self, local_batch):
    return sharding.global_batch(local_batch, self.mesh)

  def to_checkpoint(self, state):
    return state

  def from_checkpoint(self, state):
    return state

  def params(self, state):
    return state.params


class PmapParallel:
  """Replicated data parallelism: one copy of the state per local device, gradients summed with psum."""

  def __init__(self, config, abstract_boxed_state):
    self.devices = jax.local_devices()
    self.abstract_state = nn.unbox(abstract_boxed_state)
    self.stacked = jax.sharding.NamedSharding(jax.sharding.Mesh(np.asarray(self.devices), ("batch",)),
                                              jax.sharding.PartitionSpec("batch"))

  def replicate(self, tree):
    n = len(self.devices)
    return jax.device_put(jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + x.shape), tree), self.stacked)

  def init(self, init_fn, rng):
    return self.replicate(jax.jit(init_fn)(rng))

  def check_batch(self, local_batch: int, accum_steps: int, field: str = "batch_size") -> None:
    if local_batch % (len(self.devices) * accum_steps):
      raise ValueError(f"pmap: the per-process {field} {local_batch} must divide over its {len(self.devices)} devices"
                       + (f" times grad_accum_steps={accum_steps}" if accum_steps > 1 else ""))

  def compile_step(self, step_fn):
    return jax.pmap(functools.partial(step_fn, axis_name="batch"), axis_name="batch", in_axes=(0, 0, None),
                    donate_argnums=0)

  def compile_predict(self, predict_fn):
    gathered = jax.pmap(lambda p, b: jax.lax.all_gather(predict_fn(p, b), "batch", tiled=True), axis_name="batch")
    return lambda params, batch: jax.tree.map(lambda x: x[0], gathered(params, batch))

  def put_batch(self, local_batch):
    n = len(self.devices)
    return {k: v.reshape((n, v.shape[0] // n) + v.shape[1:]) for k, v in local_batch.items()}

  def to_checkpoint(self, state):
    return jax.tree.map(lambda x: x[0], state)

  def from_checkpoint(self, state):
    return self.replicate(state)

  def params(self, state):
    return jax.tree.map(lambda x: x[0], state.params)


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


RANGES = {
    "seed": NON_NEGATIVE, "batch_size": POSITIVE, "eval_batch_size": POSITIVE, "total_steps": POSITIVE,
    "total_epochs": POSITIVE, "total_examples": POSITIVE, "warmup_steps": NON_NEGATIVE, "warmup_fraction": FRACTION,
    "learning_rate": NON_NEGATIVE, "max_len": at_least(8), "grad_accum_steps": POSITIVE, "adam_b1": FRACTION,
    "adam_b2": FRACTION, "adam_eps": POSITIVE, "weight_decay": NON_NEGATIVE, "grad_clip_norm": POSITIVE,
    "log_every_steps": POSITIVE, "eval_every_steps": NON_NEGATIVE, "evals_per_epoch": NON_NEGATIVE,
    "checkpoint_every_steps": POSITIVE, "keep_checkpoints": POSITIVE, "device_prefetch": NON_NEGATIVE, "data.workers": NON_NEGATIVE, "profile_steps": POSITIVE, "init_step": NON_NEGATIVE,
    "data.mask_rate": OPEN_FRACTION, "data.num_shards": NON_NEGATIVE, "data.examples_per_epoch": POSITIVE,
    "data.doc_stride": POSITIVE, "data.max_query_len": POSITIVE, "data.group_size": NON_NEGATIVE,
    "model.dropout_rate": FRACTION, "model.attention_dropout_rate": FRACTION,
}


def _check_batch(config) -> tuple[int, int]:
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


def _say(message: str) -> None:
  """A line for the person at the terminal (process 0), printed above the progress bar."""
  if jax.process_index() == 0:
    tqdm.tqdm.write(message, file=sys.stderr)


class Interruptions:
  """SIGTERM (the preemption notice of TPU VMs and Slurm) and Ctrl-C, from the start of a run to its end.

  One process: SIGTERM sets a flag, and the run saves a checkpoint after the current step and stops. The
  first Ctrl-C stops the run after the current step (:class:`Interrupted`); a second one stops it at once.
  Under ``jax.distributed`` the runtime owns SIGTERM and tells every process at the same step that it is time
  to stop (``reached_preemption_sync_point``, which every process calls after every step), so all of them
  save that step; Ctrl-C is handed to the runtime as a SIGTERM, because a process that stopped alone would
  leave the others waiting in their next collective for ever.
  """

  def __enter__(self):
    self.terminated = self.interrupted = False
    self.distributed = jax.process_count() > 1 or getattr(jax.distributed, "is_initialized", lambda: False)()
    self.previous = {}
    if threading.current_thread() is threading.main_thread():
      if not self.distributed:
        self.previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._terminate)
      self.previous[signal.SIGINT] = signal.signal(signal.SIGINT,
                                                   self._to_runtime if self.distributed else self._interrupt)
    return self

  def __exit__(self, *exc):
    for signum, handler in self.previous.items():
      signal.signal(signum, handler)

  def _terminate(self, signum, frame):
    del signum, frame
    self.terminated = True

  def _interrupt(self, signum, frame):
    del signum, frame
    self.interrupted = True
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _say("Ctrl-C: stopping after this step (press it again to stop at once)")

  def _to_runtime(self, signum, frame):
    del signum, frame
    print("Ctrl-C: every process stops, and saves, at the next step they all reach", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)

  def preempted(self, step: int) -> bool:
    if self.distributed:
      return multihost_utils.reached_preemption_sync_point(step)
    return self.terminated


class Interrupted(KeyboardInterrupt):
  """Ctrl-C, with what a rerun of the same command will do."""


def run(config: ml_collections.ConfigDict, workdir: str):
  """Trains ``config`` in ``workdir`` (resuming when it holds checkpoints); returns the final parameters.

  Everything that can be wrong with the config (ranges, parallelism, mesh, tokenizer, the model and its
  position options, the corpora, ``init_from``) fails before the workdir is written, on every process at
  once. SIGTERM saves a checkpoint and returns; Ctrl-C raises :class:`Interrupted`, which names the last
  checkpoint (see :class:`Interruptions`)."""
  with Interruptions() as interruptions:
    try:
      return _run(config, workdir, interruptions)
    except Interrupted:
      raise
    except KeyboardInterrupt:
      raise Interrupted(f"interrupted before training started; rerun the same command to start or resume "
                        f"{workdir}") from None


def _agree(error: Exception | None) -> None:
  """Raises on every process when any process's validation failed (a process alone would leave the others
  waiting in a collective)."""
  failed = np.flatnonzero(sharding.per_process(np.int32(error is not None)))
  if error is None and len(failed):
    raise ValueError(f"process(es) {failed.tolist()} refused the config; their output says why")
  if error is not None:
    raise error


class Prepared(NamedTuple):
  """What validation built, for the run to use."""
  config: ml_collections.ConfigDict  # with total_steps and warmup_steps resolved
  local_batch: int
  task: tasks.Task
  optimizer: Any
  schedule: Any
  init_boxed: Callable
  init_rng: jax.Array
  dropout_rng: jax.Array
  parallel: Any


def _validate(config: ml_collections.ConfigDict, workdir: str) -> Prepared:
  config_args.check_ranges(config, RANGES)
  if config.parallelism not in PARALLELISMS:
    raise ValueError(f"unknown parallelism {config.parallelism!r}; allowed: {list(PARALLELISMS)}")
  name = config.get("task", "mlm")
  if name not in TASKS:
    raise ValueError(f"unknown config.task {name!r}; allowed: {list(TASKS)}")
  tasks.check_evals(config)
  check_workdir_config(config, workdir, write=False)
  local_batch, local_eval_batch = _check_batch(config)
  task = TASKS[name](config, local_batch)
  results_lib.check_selection(config.get("select", "last"), config.get("select_metric", ""), task.evaluators)
  resolved = resolve_durations(config, task.examples_per_epoch)
  optimizer, schedule = make_optimizer(resolved)
  init_rng, dropout_rng = jax.random.split(jax.random.PRNGKey(resolved.seed))

  def init_boxed(rng):
    params = task.model.init(rng, **task.init_inputs)["params"]
    return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params))

  abstract_state = jax.eval_shape(init_boxed, init_rng)  # traces the model: its options are checked here
  parallel = (JitParallel if resolved.parallelism == "jit" else PmapParallel)(resolved, abstract_state)
  parallel.check_batch(local_batch, resolved.grad_accum_steps)
  parallel.check_batch(local_eval_batch, 1, "eval_batch_size")
  if resolved.get("init_from"):
    checkpoint_lib.check_directory(resolved.init_from, "config.init_from")
  return Prepared(resolved, local_batch, task, optimizer, schedule, init_boxed, init_rng, dropout_rng, parallel)


def _run(config: ml_collections.ConfigDict, workdir: str, interruptions: Interruptions):
  validated, error = None, None
  try:
    validated = _validate(config, workdir)
  except (ValueError, OSError) as caught:
    error = caught
  _agree(error)
  original = config
  config, local_batch, task, optimizer, schedule, init_boxed, init_rng, dropout_rng, parallel = validated
  batches = task.train_batches
  is_main = jax.process_index() == 0
  quiet = not config.get("progress", True)  # no progress bar, no status lines (e.g. the probes' many short runs)
  say = (lambda message: None) if quiet else _say
  os.makedirs(workdir, exist_ok=True)
  checkpointer = checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints"), keep=config.keep_checkpoints,
                                             keep_steps=tuple(config.keep_steps))
  writer = metrics_lib.MetricWriter(workdir, enabled=is_main, tensorboard=config.tensorboard)
  restored = checkpointer.restore(parallel.abstract_state)
  if restored is not None:
    state, data_state = parallel.from_checkpoint(restored[0]), restored[1]
    batches.restore(data_state)
    step = int(jax.device_get(parallel.to_checkpoint(state).step))
    writer.truncate_after(step)
    say(f"resumed from step {step} of {workdir}")
  else:
    state = parallel.init(lambda rng: nn.unbox(init_boxed(rng)), init_rng)
    if config.get("init_from"):
      state = _warm_start(state, parallel, config.init_from)
    if task.load_init is not None:
      params = task.load_init(parallel.to_checkpoint(state).params)
      state = parallel.from_checkpoint(parallel.to_checkpoint(state).replace(params=params))
  check_workdir_config(original, workdir)
  if is_main:
    results_lib.write_json(os.path.join(workdir, "model_config.json"), task.model_config.to_dict())

  start = int(jax.device_get(parallel.to_checkpoint(state).step))
  when = eval_steps(config)
  evaluators = task.evaluators if when else {}
  log = results_lib.EvaluationLog(workdir, start, enabled=is_main)
  results_path = os.path.join(workdir, "results.json")
  if start >= config.total_steps:
    if os.path.exists(results_path):
      say(f"{workdir} is already complete at step {start} (total_steps={config.total_steps}); nothing to do")
    else:  # killed between its last checkpoint and its results: evaluate that checkpoint
      say(f"{workdir} has its last step ({start}) but no results.json: evaluating it")
      if evaluators:
        log.append(start, _evaluation(evaluators, parallel, workdir if is_main else None)(state))
        _predict_if_reported(config, log, start, _evaluation(task.predictors, parallel, workdir if is_main else None),
                             task.predictors, state)
      _write_results(results_path, config, task, start, log, is_main, say)
    checkpointer.close()
    writer.close()
    return parallel.params(state)
  say(f"training {task.name} to step {config.total_steps}: metrics in {writer.path}, checkpoints in "
       f"{checkpointer.directory}")
  feed = DeviceFeed(batches, parallel.put_batch, config.get("device_prefetch", 2))
  step_fn = parallel.compile_step(functools.partial(
      train_step, loss_fn=task.loss_fn, optimizer=optimizer, schedule=schedule, accum_steps=config.grad_accum_steps))
  evaluate = _evaluation(evaluators, parallel, workdir if is_main else None)
  predict = _evaluation(task.predictors if evaluators else {}, parallel, workdir if is_main else None)
  progress = tqdm.tqdm(total=config.total_steps, initial=start, disable=quiet or not is_main, unit="step",
                       dynamic_ncols=True)
  logger = DelayedMetrics(writer, progress, config, start, checkpointer.manager.latest_step, say)
  profiling = False
  done = start
  try:
    for step in range(start, config.total_steps):
      if step == config.profile_start_step and is_main:
        jax.profiler.start_trace(os.path.join(workdir, "profile"))
        profiling = True
      batch = next(feed)
      state, metrics = step_fn(state, batch, dropout_rng)
      done = step + 1
      logger.push(done, metrics)
      progress.update(1)
      if profiling and done >= config.profile_start_step + config.profile_steps:
        jax.block_until_ready(state)
        jax.profiler.stop_trace()
        profiling = False
      if interruptions.interrupted:
        raise KeyboardInterrupt
      preempted = interruptions.preempted(done)
      save = done % config.checkpoint_every_steps == 0 or done == config.total_steps or preempted
      run_eval = evaluators and done in when
      if save or run_eval:
        logger.flush()
      if run_eval:
        results = evaluate(state)
        log.append(done, results)
        _predict_if_reported(config, log, done, predict, task.predictors, state)
        logger.write_eval(done, {f"{name}_{k}": v for name, values in results.items() for k, v in values.items()})
      if save:
        checkpointer.save(done, parallel.to_checkpoint(state), _input_position(feed))
      if preempted:
        checkpointer.wait()
        say(f"preempted (SIGTERM) at step {done}: checkpoint saved in {checkpointer.directory}; rerun the same "
             "command to resume")
        break
    logger.flush()
    if done == config.total_steps:
      _write_results(results_path, config, task, done, log, is_main, say)
  except KeyboardInterrupt:
    checkpointer.wait()
    last = checkpointer.manager.latest_step()
    raise Interrupted(f"interrupted at step {done}, last checkpoint: "
                      f"{'none' if last is None else f'step {last}'} in {checkpointer.directory}; rerun the same "
                      "command to resume") from None
  finally:
    if profiling:
      jax.profiler.stop_trace()
    progress.close()
    checkpointer.wait()
    checkpointer.close()
    writer.close()
    if hasattr(batches, "close"):
      batches.close()  # reader processes
  return parallel.params(state)


def _predict_if_reported(config, log: results_lib.EvaluationLog, step: int, predict, predictors: dict,
                         state) -> None:
  """Runs the task's predictors (e.g. test-set files) when this step's evaluation is the one results.json reports
  (so far): for ``select="last"`` the last step, for ``best`` each new best. Process 0 decides (it alone holds the
  evaluations of an earlier attempt when the workdir is not shared), and every process follows it."""
  if not predictors:
    return
  how = config.get("select", "last")
  if how == "last":
    reported = step == config.total_steps
  else:
    reported = results_lib.select(log.evaluations, how, config.get("select_metric", ""))["step"] == step
  if sharding.per_process(np.int32(reported))[0]:
    predict(state)


def _write_results(path: str, config, task, step: int, log: results_lib.EvaluationLog, is_main: bool, say) -> None:
  """``results.json``: what the run was, its evaluations and the one ``config.select`` reports (what sweeps and
  reports read)."""
  if is_main:
    info = {"task": task.name, "step": step, "seed": config.seed, "learning_rate": config.learning_rate, **task.info}
    results_lib.write_json(path, results_lib.run_results(info, log.evaluations, config.get("select", "last"),
                                                          config.get("select_metric", "")))
    say(f"results in {path}")


class DeviceFeed:
  """The training batches, put on the devices ``ahead`` batches before the step that uses them: JAX transfers
  asynchronously, so a batch travels while earlier steps run and the host reads the next. ``state()`` is the
  input position after the batches handed out, not after those read ahead, so checkpoints resume exactly."""

  def __init__(self, batches, put: Callable[[dict], Any], ahead: int):
    self.batches, self.put, self.ahead = batches, put, ahead
    self.queue = collections.deque()
    self.position = batches.state()

  def __iter__(self):
    return self

  def __next__(self):
    while len(self.queue) <= self.ahead:
      self.queue.append((self.put(next(self.batches)), self.batches.state()))
    batch_on_devices, self.position = self.queue.popleft()
    return batch_on_devices

  def state(self) -> dict:
    return self.position


class DelayedMetrics:
  """A step's metrics stay on the device until the next step has been dispatched, so fetching them never
  stalls the accelerator; then the loss is checked (a non-finite one stops the run) and every
  ``log_every_steps`` they are written with the tokens/s since the last write: the real (unpadded) tokens where
  the task counts them (a ``tokens`` sum), else ``batch_size x max_len`` a step."""

  def __init__(self, writer: metrics_lib.MetricWriter, progress, config, start_step: int, last_good, say=None):
    self.writer, self.progress, self.last_good, self.say = writer, progress, last_good, say or _say
    self.postfix = {}
    self.log_every, self.total_steps = config.log_every_steps, config.total_steps
    self.tokens_per_step = config.batch_size * config.max_len  # a task that counts its tokens reports them
    self.tokens = 0.0
    self.pending = None
    self.last_write = (start_step, time.perf_counter())

  def push(self, step: int, metrics) -> None:
    """Fetches the previous step's metrics (the new step is already running), then holds these."""
    self.flush()
    self.pending = (step, metrics)

  def flush(self) -> None:
    if self.pending is None:
      return
    (step, metrics), self.pending = self.pending, None
    metrics = {k: float(np.mean(v)) for k, v in jax.device_get(metrics).items()}
    self.tokens += metrics.pop("tokens", self.tokens_per_step)
    if not math.isfinite(metrics["loss"]):
      last = self.last_good()
      raise FloatingPointError(f"non-finite loss ({metrics['loss']}) at step {step}; stopping. " + (
          "No checkpoint had been saved yet" if last is None else f"The last good checkpoint is step {last}"))
    if step % self.log_every == 0 or step == self.total_steps:
      now = time.perf_counter()
      metrics["tokens_per_second"] = self.tokens / max(now - self.last_write[1], 1e-9)
      self.last_write, self.tokens = (step, now), 0.0
      self.writer.write(step, metrics)
      self.postfix["loss"] = f"{metrics['loss']:.3f}"
      self.progress.set_postfix(self.postfix, refresh=False)

  def write_eval(self, step: int, results: dict) -> None:
    """Evaluation metrics to the files, the progress bar and a line of their own (``unsupported`` ones only
    to the line)."""
    numbers = {k: v for k, v in results.items() if not isinstance(v, str)}
    self.writer.write(step, numbers)
    self.postfix.update({k: f"{v:.3f}" for k, v in numbers.items()})
    self.progress.set_postfix(self.postfix)
    self.say(f"step {step}: " + ", ".join(f"{k} {v}" if isinstance(v, str) else f"{k} {v:.4f}" for k, v in results.items()))


def _warm_start(state, parallel, init_from: str):
  loaded = checkpoint_lib.load_params(init_from)
  params = parallel.to_checkpoint(state).params
  merged, fresh, unused = checkpoint_lib.merge_params(params, loaded)
  logging.warning("warm start from %s: %d parameters loaded; created (fresh): %s; dropped: %s", init_from,
                  len(jax.tree.leaves(merged)) - len(fresh), fresh, unused)
  return parallel.from_checkpoint(parallel.to_checkpoint(state).replace(params=merged))


def _input_position(batches) -> dict:
  """The input position to save. MLM shards' positions are gathered from every process (the checkpoint's JSON
  item is written by process 0 alone); an example stream's is the same on every process."""
  state = batches.state()
  if "shards" not in state:
    return state
  shards = state["shards"]
  ids = sorted(shards, key=int)
  mine = np.asarray([[int(s) for s in ids], [shards[s] for s in ids]], np.int32)
  gathered = sharding.per_process(mine)  # [processes, 2, shards per process]
  return {"shards": {str(int(shard)): int(count) for part in gathered for shard, count in zip(*part)}}


def _evaluation(evaluators: dict[str, tasks.Evaluator], parallel, workdir: str | None):
  """``evaluate(state) -> {name: {metric: value}}`` over every evaluator.

  Every process runs the same number of batches (each batch is a collective): a process with fewer fills in
  padding batches, which weigh nothing. Outputs are gathered to every process, so each computes the metrics
  of all rows; ``workdir`` (process 0's) receives any files an evaluator writes (e.g. SQuAD predictions)."""
  counts = {name: int(sharding.per_process(np.int32(len(ev.batches))).max())
            for name, ev in evaluators.items() if ev.unsupported is None}
  compiled = {name: parallel.compile_predict(ev.predict) for name, ev in evaluators.items() if name in counts}

  def evaluate(state) -> dict:
    results = {}
    for name, ev in evaluators.items():
      if ev.unsupported is not None:
        logging.info("%s: unsupported (%s)", name, ev.unsupported)
        results[name] = {metric: UNSUPPORTED for metric in ev.metric_names}
        continue
      batches = ev.batches + [ev.empty] * (counts[name] - len(ev.batches))
      outputs = [jax.device_get(compiled[name](state.params, parallel.put_batch(b))) for b in batches]
      results[name] = ev.metrics(features.join_outputs(outputs), workdir)
    return results

  return evaluate
