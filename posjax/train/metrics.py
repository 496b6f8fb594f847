"""Metrics to ``metrics.jsonl`` (one JSON object per logged step) and TensorBoard event files.

Only process 0 writes. A resumed run first drops the lines logged after its checkpoint, so the stream of
an interrupted and resumed run is the stream of an uninterrupted one.
"""

from __future__ import annotations

import json
import os
from typing import Mapping


class MetricWriter:

  def __init__(self, workdir: str, enabled: bool = True, tensorboard: bool = True):
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.enabled = enabled
    self._summary = None
    if enabled and tensorboard:
      import tensorflow as tf  # imported here: slow to load, and only the writer needs it

      self._tf = tf
      self._summary = tf.summary.create_file_writer(os.path.join(workdir, "tensorboard"))

  def truncate_after(self, step: int) -> None:
    """Drops lines logged after ``step`` (by a run that was killed before its next checkpoint)."""
    if not self.enabled or not os.path.exists(self.path):
      return
    with open(self.path) as f:
      lines = [line for line in f if _step_of(line) is not None and _step_of(line) <= step]
    with open(self.path + ".tmp", "w") as f:
      f.writelines(lines)
    os.replace(self.path + ".tmp", self.path)

  def write(self, step: int, metrics: Mapping[str, float]) -> None:
    if not self.enabled:
      return
    values = {k: float(v) for k, v in metrics.items()}
    with open(self.path, "a") as f:
      f.write(json.dumps({"step": int(step), **values}) + "\n")
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
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]
