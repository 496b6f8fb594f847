"""The fused kernel under a device mesh (8 CPU devices): it runs once per shard (rows over data x fsdp, heads over
tensor) and gives the outputs and gradients of the unsharded call, tables' gradients summed over the shards."""

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from posjax import kernels
from posjax.train import sharding


def every_term(rng, batch, length, heads, head_dim):
  f32 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  return kernels.Terms(
      alibi=kernels.Alibi(jnp.asarray(rng.uniform(0.1, 1.0, heads), jnp.float32)),
      buckets=kernels.Buckets(f32(34, heads), num_buckets=32, max_distance=20, cls_row=32, cls_col=33),
      relative=kernels.Relative(0.5 * f32(11, head_dim), max_distance=5, query=True, key=True),
      untied=kernels.Untied(f32(batch, length, heads, head_dim), f32(batch, length, heads, head_dim), f32(2, heads)))


def learned_biases(rng, batch, length, heads, head_dim):
  """KERPLE (per-head scalars), FIRE (an MLP shared by the heads but its last layer), Sandwich (fixed) and a sink
  per head (each shard its heads')."""
  f32 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  return kernels.Terms(
      kerple=kernels.Kerple(jnp.asarray(rng.uniform(0.2, 1.5, heads), jnp.float32),
                            jnp.asarray(rng.uniform(0.2, 1.0, heads), jnp.float32)),
      fire=kernels.Fire(f32(4), f32(4), f32(4, heads), f32(heads), jnp.asarray(0.3), jnp.asarray(5.0)),
      sandwich=kernels.Sandwich(jnp.asarray(rng.uniform(1.0, 4.0, heads), jnp.float32), dim=8),
      sink=kernels.Sink(f32(heads)))


@pytest.mark.parametrize("make_terms,kv_heads", [(every_term, 4), (learned_biases, 2)])
def test_the_kernel_on_a_mesh_matches_it_unsharded(make_terms, kv_heads):
  # The GPU kernels in the generic interpreter; the TPU kernels' shard_map is the same, compiled for a v5e slice in
  # tests/test_aot.py (Mosaic refuses a kernel outside one). kv_heads=2: grouped k/v, each tensor shard holding its
  # two query heads and their one key/value head.
  rng = np.random.default_rng(0)
  batch, length, heads, head_dim = 4, 16, 4, 8
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  q, weights = (jnp.asarray(rng.normal(size=(batch, length, heads, head_dim)), jnp.float32) for _ in range(2))
  k, v = (jnp.asarray(rng.normal(size=(batch, length, kv_heads, head_dim)), jnp.float32) for _ in range(2))
  terms = make_terms(rng, batch, length, heads, head_dim)
  positions = np.tile(np.arange(length, dtype=np.int32), (batch, 1))
  lengths = np.array([16, 11, 16, 3])
  seen = []

  def loss(q, k, v, terms):
    seen.append(jax.sharding.get_abstract_mesh().empty)
    out = kernels.relative_attention(q, k, v, terms=terms, positions=positions, lengths=lengths,
                                     block_sizes=(8, 8), interpret=True, dropout_rate=0.2,
                                     dropout_seed=jnp.int32(3))
    return jnp.sum(out * weights)

  grad = jax.grad(loss, argnums=(0, 1, 2, 3))
  want = jax.jit(grad)(q, k, v, terms)

  def in_mesh(*args):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return grad(*args)

  rows = NamedSharding(mesh, P(sharding.BATCH, None, "tensor", None))
  sharded = jax.jit(in_mesh, in_shardings=(rows, rows, rows, None))
  assert "sdy.manual_computation" in sharded.lower(q, k, v, terms).as_text()  # per shard, not partitioned by XLA
  got = sharded(q, k, v, terms)
  assert seen[0] and len(seen) >= 2 and not any(seen[1:])  # traced without the mesh, then (once or twice) in it
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree_util.tree_leaves(got)):
    np.testing.assert_allclose(y, x, rtol=2e-5, atol=2e-5 * max(1.0, float(np.abs(x).max())),
                               err_msg=jax.tree_util.keystr(path))


def test_a_batch_the_mesh_does_not_divide_is_an_error():
  mesh = sharding.make_mesh({"data": 4, "tensor": 2})
  x = jnp.ones((2, 8, 2, 8))

  @functools.partial(jax.jit)
  def call(x):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return kernels.relative_attention(x, x, x, interpret=True)

  with pytest.raises(ValueError, match=r"splits its batch \(2\) over mesh axes \['data', 'fsdp'\] \(4 shards\)"):
    call(x)


def lowered_on(mesh, x_BxLxHxK, **kwargs) -> str:
  """The kernel call's lowered text under ``mesh`` (``kwargs`` to ``relative_attention``)."""
  def call(x):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return kernels.relative_attention(x, x, x, interpret=True, **kwargs)
  return jax.jit(call).lower(x_BxLxHxK).as_text()


USER_MESH_RULES = (("activation_batch", "dp"), ("activation_heads", "mp"))


def test_a_users_mesh_axes_map_through_the_logical_rules():
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()).reshape(4, 2), ("dp", "mp"))
  x = jnp.ones((4, 8, 2, 8))
  with nn.logical_axis_rules(USER_MESH_RULES):
    text = lowered_on(mesh, x)
  # Rows over dp and heads over mp, per shard: [4 / 4, 2 / 2, 8, 8] in each.
  assert "sdy.manual_computation" in text and re.search(r'\[\{"dp"\}, \{"mp"\}, \{\}, \{\}\]', text), text[-3000:]
  assert "tensor<1x1x8x8xf32>" in text


def test_a_mesh_the_rules_cannot_map_is_a_one_line_error():
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()).reshape(4, 2), ("dp", "mp"))
  x = jnp.ones((4, 8, 2, 8))
  with pytest.raises(ValueError, match=r"^logical axis 'activation_batch' maps to mesh axes \['data', 'fsdp'\], but "
                                       r"the mesh has axes \['dp', 'mp'\]: give rules for its axes"):
    lowered_on(mesh, x)
  with pytest.raises(ValueError, match=r"^the attention kernel splits its heads over mesh axes \['tensor'\], but the "
                                       r"mesh has axes \['dp', 'mp'\]; name axes it has \(or none\)"):
    lowered_on(mesh, x, batch_axes=("dp",), head_axes=("tensor",))
