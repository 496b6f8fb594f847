"""Orbax checkpoints in the workdir: the train state and the input position, saved together.

Saves are asynchronous and atomic (orbax writes to a temporary directory and renames it when complete),
so a killed run never leaves a half-written latest checkpoint. Kept: the latest ``keep`` plus every step in
``keep_steps`` (e.g. the 100k / 300k / 600k checkpoints of a 1M-step run). Restoring takes the target's
shardings, so a checkpoint restores onto any number of devices or mesh shape; an unreadable latest
checkpoint falls back to the previous one with a warning.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import flax.traverse_util
import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from orbax.checkpoint import checkpoint_managers


def _handlers() -> dict:
  return {"state": ocp.StandardCheckpointHandler(), "data": ocp.JsonCheckpointHandler()}


class Checkpointer:

  def __init__(self, directory: str, *, keep: int = 3, keep_steps: Sequence[int] = (), async_save: bool = True):
    policies = [checkpoint_managers.LatestN(keep)]
    if keep_steps:
      policies.append(checkpoint_managers.CustomSteps(list(keep_steps)))
    options = ocp.CheckpointManagerOptions(
        preservation_policy=checkpoint_managers.AnyPreservationPolicy(policies),
        enable_async_checkpointing=async_save, create=True)
    self.manager = ocp.CheckpointManager(os.path.abspath(directory), options=options, item_handlers=_handlers())

  def save(self, step: int, state: Any, data_state: dict) -> None:
    self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                    data=ocp.args.JsonSave(data_state)), force=True)

  def restore(self, abstract_state: Any) -> tuple[Any, dict] | None:
    """The newest readable checkpoint as ``(state, data_state)``, laid out like ``abstract_state``."""
    for step in sorted(self.manager.all_steps(), reverse=True):
      try:
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
        return restored.state, dict(restored.data)
      except Exception as error:  # noqa: BLE001  (any unreadable checkpoint: try the one before)
        logging.warning("checkpoint at step %d in %s cannot be restored (%s: %s); trying an earlier one", step,
                        self.manager.directory, type(error).__name__, error)
    return None

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()


def load_params(directory: str, step: int | None = None) -> dict:
  """Parameters of another run's checkpoint, as a nested dict of numpy arrays (for warm starts)."""
  manager = ocp.CheckpointManager(os.path.abspath(directory), item_handlers=_handlers())
  step = manager.latest_step() if step is None else step
  if step is None:
    raise FileNotFoundError(f"no checkpoint in {directory}")
  # Restore onto this process's first device, whatever topology the checkpoint was saved from.
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  metadata = manager.item_metadata(step).state
  target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), metadata)
  restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
  manager.close()
  state = restored.state
  return state["params"] if isinstance(state, dict) else state.params


def merge_params(fresh: Any, loaded: dict) -> tuple[Any, list[str], list[str]]:
  """``fresh`` with every parameter that ``loaded`` has at the same path and shape replaced by it.

  Returns the merged tree, the paths kept fresh (new in this model) and the loaded paths left unused.
  """
  fresh_flat = flax.traverse_util.flatten_dict(fresh, sep="/")
  loaded_flat = flax.traverse_util.flatten_dict(loaded, sep="/")
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
