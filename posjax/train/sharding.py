"""The device mesh, and shardings by the logical-axis rules of :mod:`posjax.partitioning`.

Mesh axes: ``data`` (batch), ``fsdp`` (batch and parameter shards), ``context`` (the sequence: each device holds
``L / context`` tokens of every row, and attention gathers keys and values) and ``tensor`` (heads / MLP / vocab).
A size of -1 takes the devices the other axes leave.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from posjax import partitioning

MESH_AXES = ("data", "fsdp", partitioning.CONTEXT, "tensor")
BATCH = partitioning.BATCH_AXES


def mesh_shape(sizes: dict[str, int], num_devices: int) -> tuple[int, ...]:
  """The ``MESH_AXES`` sizes for ``num_devices``: a missing axis is 1 and a -1 takes what the others leave;
  sizes that do not use every device are an error."""
  shape = [int(sizes.get(axis, 1)) for axis in MESH_AXES]
  if shape.count(-1) > 1:
    raise ValueError(f"at most one mesh axis may be -1, got {dict(zip(MESH_AXES, shape))}")
  known = math.prod(s for s in shape if s != -1)
  if -1 in shape:
    if num_devices % known:
      raise ValueError(f"mesh {dict(zip(MESH_AXES, shape))} does not divide {num_devices} devices")
    shape[shape.index(-1)] = num_devices // known
  if math.prod(shape) != num_devices:
    raise ValueError(f"mesh {dict(zip(MESH_AXES, shape))} needs {math.prod(shape)} devices; there are {num_devices}")
  return tuple(shape)


def make_mesh(sizes: dict[str, int], devices=None) -> Mesh:
  """The device mesh of ``sizes`` (see :func:`mesh_shape`) over ``devices`` (default: all of them)."""
  devices = jax.devices() if devices is None else devices
  shape = mesh_shape(sizes, len(devices))
  return Mesh(np.asarray(devices).reshape(shape), MESH_AXES)


def logical_shardings(abstract_tree, mesh: Mesh):
  """NamedShardings for a tree whose leaves carry logical axis names (boxed parameters), by the rules in force
  (:func:`posjax.partitioning.rules`)."""
  return nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract_tree), mesh, partitioning.rules())


def check_divisible(abstract_tree, shardings) -> None:
  """Raises, naming the first array and dimension, where a sharded dimension does not divide over its mesh axes
  (before any program is traced: jit would refuse it, and the fused kernels split heads the same way)."""
  logical = jax.tree.leaves(nn.get_partition_spec(abstract_tree), is_leaf=lambda x: isinstance(x, P))
  leaves = jax.tree_util.tree_leaves_with_path(nn.unbox(abstract_tree))
  for (path, x), names, s in zip(leaves, logical, jax.tree.leaves(shardings)):
    for dim, (size, axes) in enumerate(zip(x.shape, s.spec)):
      axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
      devices = math.prod(s.mesh.shape[a] for a in axes)
      if size % devices:
        name = names[dim] if dim < len(names) else None
        raise ValueError(f"{jax.tree_util.keystr(path)} has {size} along its axis {name!r}, which does not divide "
                         f"over mesh axes {list(axes)} ({devices} devices); choose mesh sizes that divide it")


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Arrays split on their first (batch) axis over the ``data`` and ``fsdp`` mesh axes."""
  return NamedSharding(mesh, P(BATCH))


def replicated(mesh: Mesh) -> NamedSharding:
  """A whole copy on every device of the mesh: for a step's rng and metrics, and predictions every process reads."""
  return NamedSharding(mesh, P())


def global_batch(local_batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
  """Each process's rows of the global batch -> global arrays sharded over the batch axes."""
  sharding = batch_sharding(mesh)
  return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local_batch.items()}


def per_process(value) -> np.ndarray:
  """``value`` (a number or array, the same shape on every process) from every process, stacked in process
  order: a collective that every process must reach; with one process, no communication."""
  value = np.asarray(value)
  if jax.process_count() == 1:
    return value[None]
  return np.asarray(multihost_utils.process_allgather(value))
