"""The training loop of every task: data -> sharded jit (or pmap) step -> metrics -> evaluators -> checkpoints,
resumable.

``run(config, workdir, build_task)`` trains the task ``build_task(config, local_batch)`` returns (the contract is
:mod:`posjax.train.task`; :mod:`posjax.main` hands over :func:`posjax.tasks.build`). It resumes from the newest
checkpoint in ``workdir`` when there is one: the train state and the input position are restored, so the resumed
run sees exactly the batches, dropout and metrics an uninterrupted one would. The evaluators run every
``eval_every_steps`` (or ``evals_per_epoch`` times an epoch) and at the end; every evaluation, and the one
``config.select`` chooses, goes to ``results.json`` (see :mod:`posjax.results`). One run per workdir: process 0 holds
``WORKDIR/run.lock`` for all (:mod:`posjax.train.lock`); a second run on it is refused at once, naming the first.
"""

from __future__ import annotations

import os
from typing import Callable

import flax.linen as nn
import jax
import ml_collections
import tqdm

from posjax import results as results_lib
from posjax.train import checkpoint as checkpoint_lib
from posjax.train import evaluate, feed, preemption, validate
from posjax.train import lock as lock_lib
from posjax.train import metrics as metrics_lib
from posjax.train.preemption import Interrupted
from posjax.train.step import task_step
from posjax.train.task import Task

BuildTask = Callable[[ml_collections.ConfigDict, int], Task]


def run(config: ml_collections.ConfigDict, workdir: str, build_task: BuildTask):
  """Trains ``config`` in ``workdir`` (resuming when it holds checkpoints); returns the final parameters.

  Everything that can be wrong with the config (ranges, parallelism, mesh, tokenizer, the model and its
  position options, the corpora, ``init_from``) fails before the workdir is written, on every process at
  once. SIGTERM saves a checkpoint and returns; Ctrl-C raises :class:`Interrupted`, which names the last
  checkpoint (see :class:`posjax.train.preemption.Interruptions`)."""
  with preemption.Interruptions() as interruptions:
    try:
      return _run(config, workdir, build_task, interruptions)
    except Interrupted:
      raise
    except KeyboardInterrupt:
      raise Interrupted(f"interrupted before training started; rerun the same command to start or resume "
                        f"{workdir}") from None


def _start_state(run: validate.Prepared, workdir: str, checkpointer, writer, say):
  """:func:`_start_state_here` on every process; an error in any one (restoring the state or the input position,
  initialising, warm-starting) stops every process with it, before the first step."""
  return validate.everywhere(_start_state_here, run, workdir, checkpointer, writer, say)


def _start_state_here(run: validate.Prepared, workdir: str, checkpointer, writer, say):
  """The restored state (and input position) of a resumed run, else the initial one, warm-started from
  ``init_from`` or the task's ``load_init`` where given."""
  parallel, config, task = run.parallel, run.config, run.task
  restored = checkpointer.restore(parallel.abstract_state)
  if restored is not None:
    state = parallel.from_checkpoint(restored[0])
    task.train_batches.restore(restored[1])
    step = int(jax.device_get(parallel.to_checkpoint(state).step))
    writer.truncate_after(step)
    say(f"resumed from step {step} of {workdir}")
    return state
  state = parallel.init(lambda rng: nn.unbox(run.init_boxed(rng)), run.init_rng)
  fresh = parallel.to_checkpoint(state)
  params = fresh.params
  if config.get("init_from"):
    params = checkpoint_lib.warm_start(params, config.init_from)
  if task.load_init is not None:
    params = task.load_init(params)
  return state if params is fresh.params else parallel.from_checkpoint(fresh.replace(params=params))


def _run(config: ml_collections.ConfigDict, workdir: str, build_task: BuildTask, interruptions):
  prepared = validate.validate_everywhere(config, workdir, build_task)
  lock = lock_lib.WorkdirLock(workdir, enabled=jax.process_index() == 0)
  with checkpoint_lib.quiet_abandoned_io():  # from the first checkpoint I/O on (validation does none)
    validate.everywhere(lock.acquire)  # process 0 holds the workdir for every process, or every process stops
    try:
      return _train(config, prepared, workdir, interruptions)
    finally:
      lock.release()


def _train(original: ml_collections.ConfigDict, prepared: validate.Prepared, workdir: str, interruptions):
  config, task, parallel = prepared.config, prepared.task, prepared.parallel
  is_main = jax.process_index() == 0
  quiet = not config.get("progress", True)  # no progress bar, no status lines (e.g. the probes' many short runs)
  say = (lambda message: None) if quiet else metrics_lib.say
  os.makedirs(workdir, exist_ok=True)
  checkpointer = checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints"), keep=config.keep_checkpoints,
                                             keep_steps=tuple(config.keep_steps))
  writer = metrics_lib.MetricWriter(workdir, enabled=is_main, tensorboard=config.tensorboard)
  state = _start_state(prepared, workdir, checkpointer, writer, say)
  validate.check_workdir_config(original, workdir)
  if is_main:
    results_lib.write_json(os.path.join(workdir, "model_config.json"), task.model_config.to_dict())

  start = int(jax.device_get(parallel.to_checkpoint(state).step))
  when = validate.eval_steps(config)
  evaluators = task.evaluators if when else {}
  files = workdir if is_main else None
  evaluate_fn = evaluate.evaluation(evaluators, parallel, files)
  predict_fn = evaluate.evaluation(task.predictors if evaluators else {}, parallel, files)
  log = results_lib.EvaluationLog(workdir, start, enabled=is_main)
  results_path = os.path.join(workdir, "results.json")

  def evaluate_at(step: int) -> dict:
    results = evaluate_fn(state)
    log.append(step, results)
    evaluate.predict_if_reported(config, log, step, predict_fn, task.predictors, state)
    return results

  if start >= config.total_steps:
    if os.path.exists(results_path):
      say(f"{workdir} is already complete at step {start} (total_steps={config.total_steps}); nothing to do")
    else:  # killed between its last checkpoint and its results: evaluate that checkpoint
      say(f"{workdir} has its last step ({start}) but no results.json: evaluating it")
      if evaluators:
        evaluate_at(start)
      evaluate.write_results(results_path, config, task, start, log, is_main, say)
    checkpointer.close()
    writer.close()
    return parallel.params(state)

  say(f"training {task.name} to step {config.total_steps}: metrics in {writer.path}, checkpoints in "
      f"{checkpointer.directory}")
  for note in task.notes:
    say(note)
  for name, evaluator in evaluators.items():
    if evaluator.unsupported:
      say(f"{name}: unsupported ({evaluator.unsupported})")
  batches = feed.DeviceFeed(task.train_batches, parallel.put_batch, config.get("device_prefetch", 2))
  step_fn = parallel.compile_step(task_step(task, prepared.optimizer, prepared.schedule, config.grad_accum_steps,
                                            config.get("loss_reduction", "mean")))
  progress = tqdm.tqdm(total=config.total_steps, initial=start, disable=quiet or not is_main, unit="step",
                       dynamic_ncols=True)
  logger = metrics_lib.DelayedMetrics(writer, progress, config, start, checkpointer.manager.latest_step, say)
  profiling = False
  done = start
  stranded = False  # this process failed and others wait for it in a collective: no save of its can finish
  try:
    for step in range(start, config.total_steps):
      if step == config.profile_start_step and is_main:
        jax.profiler.start_trace(os.path.join(workdir, "profile"))
        profiling = True
      state, metrics = step_fn(state, next(batches), prepared.dropout_rng)
      done = step + 1
      logger.push(done, metrics)
      if done < config.total_steps:
        progress.update(1)
      else:  # the bar's last line once, with the final loss and the average rate, before the closing lines
        logger.flush()
        progress.n = done
        progress.close()
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
        results = evaluate_at(done)
        logger.write_eval(done, {f"{name}_{k}": v for name, values in results.items() for k, v in values.items()})
      if save:
        checkpointer.save(done, parallel.to_checkpoint(state), feed.input_position(batches))
      if preempted:
        checkpointer.wait()
        say(f"preempted (SIGTERM) at step {done}: checkpoint saved in {checkpointer.directory}; rerun the same "
            "command to resume")
        break
    logger.flush()
    if done == config.total_steps:
      evaluate.write_results(results_path, config, task, done, log, is_main, say)
  except KeyboardInterrupt:
    checkpointer.wait()
    last = checkpointer.manager.latest_step()
    raise Interrupted(f"interrupted at step {done}, last checkpoint: "
                      f"{'none' if last is None else f'step {last}'} in {checkpointer.directory}; rerun the same "
                      "command to resume") from None
  except Exception:
    stranded = jax.process_count() > 1  # its error stops every process (posjax.train.peers), collectives none
    raise
  finally:
    if profiling:
      jax.profiler.stop_trace()
    progress.close()
    if not stranded:
      checkpointer.wait()
      checkpointer.close()
    writer.close()
    if hasattr(task.train_batches, "close"):
      task.train_batches.close()  # reader processes
  return parallel.params(state)
