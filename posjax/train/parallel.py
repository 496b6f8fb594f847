"""How the train step spreads over the devices: one jit program over a mesh (``parallelism="jit"``, parameters
sharded by their logical axis names) or replicated data parallelism (``"pmap"``). Both offer the same methods, so
the loop does not know which it runs."""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from posjax import partitioning
from posjax.train import sharding

PARALLELISMS = ("jit", "pmap")


def make(config, abstract_boxed_state, devices=None):
  """The strategy ``config.parallelism`` names, for a state shaped as ``abstract_boxed_state``, over ``devices``
  (default: all of them; other devices, such as a compile-only target's, only for ``jit``)."""
  if config.parallelism not in PARALLELISMS:
    raise ValueError(f"unknown parallelism {config.parallelism!r}; allowed: {list(PARALLELISMS)}")
  if config.parallelism == "pmap":
    if devices is not None:
      raise ValueError("parallelism='pmap' runs on this machine's devices only; compile for other devices with "
                       "parallelism='jit'")
    return PmapParallel(config, abstract_boxed_state)
  return JitParallel(config, abstract_boxed_state, devices)


class JitParallel:
  """One program over a device mesh: parameters sharded by their logical axes, the batch over data/fsdp."""

  def __init__(self, config, abstract_boxed_state, devices=None):
    self.mesh = sharding.make_mesh(dict(config.mesh), devices)
    self.state_shardings = sharding.logical_shardings(abstract_boxed_state, self.mesh)
    sharding.check_divisible(abstract_boxed_state, self.state_shardings)
    self.abstract_state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                       nn.unbox(abstract_boxed_state), self.state_shardings)

  def init(self, init_fn, rng):
    return jax.jit(init_fn, out_shardings=self.state_shardings)(rng)

  def check_batch(self, local_batch: int, accum_steps: int, field: str = "batch_size") -> None:
    """Every micro-batch spreads over all the data x fsdp devices: the global batch must divide into
    ``accum_steps`` micro-batches of a multiple of their number."""
    shards = math.prod(self.mesh.shape[axis] for axis in sharding.BATCH)
    batch = local_batch * jax.process_count()
    if batch % (shards * accum_steps):
      raise ValueError(f"{field}={batch} must divide over the mesh's {shards} data x fsdp devices"
                       + (f" times grad_accum_steps={accum_steps} (each micro-batch spans every data device)"
                          if accum_steps > 1 else ""))

  def check_length(self, length: int) -> None:
    """Every row splits evenly over the ``context`` devices (``length``: the run's padded sequence length)."""
    shards = self.mesh.shape[partitioning.CONTEXT]
    if length and length % shards:
      raise ValueError(f"max_len={length} must divide over the mesh's {shards} context devices (each holds "
                       f"max_len / context tokens of every row); choose a multiple of {shards} or another mesh")

  def in_mesh(self, fn):
    """``fn`` traced under the mesh (``use_abstract_mesh``), so that the fused attention kernels run per shard."""
    @functools.wraps(fn)
    def traced(*args):
      with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh):
        return fn(*args)
    return traced

  def compile_step(self, step_fn):
    batch = sharding.batch_sharding(self.mesh)
    return jax.jit(self.in_mesh(step_fn), in_shardings=(self.state_shardings, batch, sharding.replicated(self.mesh)),
                   out_shardings=(self.state_shardings, sharding.replicated(self.mesh)), donate_argnums=0)

  def compile_predict(self, predict_fn):
    """``predict_fn(params, batch)`` with every output row of the global batch on every process."""
    return jax.jit(self.in_mesh(predict_fn), out_shardings=sharding.replicated(self.mesh))

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

  def check_length(self, length: int) -> None:
    """pmap keeps every row whole on one device."""

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
