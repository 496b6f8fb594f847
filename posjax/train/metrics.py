"""Metrics to ``metrics.jsonl`` (one JSON object per logged step) and TensorBoard event files.

Only process 0 writes. A resumed run first drops the lines logged after its checkpoint, so the stream of
an interrupted and resumed run is the stream of an uninterrupted one.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Mapping

import jax
import numpy as np
import tqdm

from posjax import results as results_lib


class MetricWriter:
  """``metrics.jsonl`` and TensorBoard scalars, written by process 0 (``enabled``)."""

  def __init__(self, workdir: str, enabled: bool = True, tensorboard: bool = True):
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.enabled = enabled
    self._summary = None
    self._events = os.path.join(workdir, "tensorboard")
    if enabled and tensorboard:
      import tensorflow as tf  # imported here: slow to load, and only the writer needs it

      self._tf = tf
      self._summary = tf.summary.create_file_writer(self._events)

  def truncate_after(self, step: int) -> None:
    """Drops lines logged after ``step`` (by a run that was killed before its next checkpoint); TensorBoard's
    events are rewritten from the lines kept (event files cannot be cut), so it shows no step twice either."""
    if not self.enabled or not os.path.exists(self.path):
      return
    with open(self.path) as f:
      lines = [line for line in f if _step_of(line) is not None and _step_of(line) <= step]
    results_lib.write_text(self.path, "".join(lines))
    if self._summary is not None:
      self._summary.close()
      for name in os.listdir(self._events) if os.path.isdir(self._events) else ():
        if name.startswith("events.out.tfevents."):
          os.remove(os.path.join(self._events, name))
      self._summary = self._tf.summary.create_file_writer(self._events)
      for line in lines:
        record = json.loads(line)
        self._scalars(int(record.pop("step")), record)

  def write(self, step: int, metrics: Mapping[str, float]) -> None:
    if not self.enabled:
      return
    values = {k: float(v) for k, v in metrics.items()}
    with open(self.path, "a") as f:
      f.write(json.dumps({"step": int(step), **values}) + "\n")
    self._scalars(step, values)

  def _scalars(self, step: int, values: Mapping[str, float]) -> None:
    if self._summary is not None:
      with self._summary.as_default(step=int(step)):
        for name, value in values.items():
          self._tf.summary.scalar(name, value)

  def close(self) -> None:
    if self._summary is not None:
      self._summary.flush()


def _step_of(line: str) -> int | None:
  """The step of a logged line; ``None`` for a blank line or the partial last line of a killed run."""
  try:
    return int(json.loads(line)["step"])
  except (ValueError, KeyError, TypeError):
    return None


def read(workdir: str) -> list[dict]:
  """Every line of ``workdir/metrics.jsonl``."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


def say(message: str) -> None:
  """A line for the person at the terminal (process 0), printed above the progress bar."""
  if jax.process_index() == 0:
    tqdm.tqdm.write(message, file=sys.stderr)


class DelayedMetrics:
  """A step's metrics stay on the device until the next step has been dispatched, so fetching them never
  stalls the accelerator; then the loss is checked (a non-finite one stops the run) and every
  ``log_every_steps`` they are written with the tokens/s since the last write: the real (unpadded) tokens where
  the task counts them (a ``tokens`` sum), else ``batch_size x max_len`` a step."""

  def __init__(self, writer: MetricWriter, progress, config, start_step: int, last_good, say=say):
    self.writer, self.progress, self.last_good, self.say = writer, progress, last_good, say
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
    numbers = {k: v for k, v in results.items() if not isinstance(v, (str, list, tuple, dict))}
    self.writer.write(step, numbers)  # lists (a loss by position) only in results.json
    show = lambda v, digits: f"{v}" if isinstance(v, (str, int)) else f"{v:.{digits}f}"  # counts as they are
    self.postfix.update({k: show(v, 3) for k, v in numbers.items()})
    self.progress.set_postfix(self.postfix)
    self.say(f"step {step}: " + ", ".join(f"{k} {show(v, 4)}" for k, v in results.items()
                                          if isinstance(v, str) or k in numbers))
