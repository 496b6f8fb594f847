"""The training batches on their way to the devices, and the input position a checkpoint saves."""

from __future__ import annotations

import collections
from typing import Any, Callable

import numpy as np

from posjax.train import sharding


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


def input_position(batches) -> dict:
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
