"""The attention kernels under a mesh: each call runs once per shard (``shard_map``), rows split over the batch's mesh
axes and heads over the heads' (:func:`per_shard`), each term's array laid out to match (:func:`term_specs`).

Shapes: B batch, H heads, P padded length, K head dim, X any last axis.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import PartitionSpec as P

from posjax import partitioning
from posjax.kernels import term as term_lib
from posjax.kernels.terms import Terms


def term_specs(terms: Terms, batch, heads) -> Terms:
  """Each term array's ``PartitionSpec`` when rows split over mesh axes ``batch`` and heads over ``heads`` (a
  table shared by the whole batch, such as the relative vectors or a ``[1, ...]`` untied term, is replicated)."""
  specs = {}
  if terms.relative is not None:
    specs["relative"] = terms.relative.replace(table=P())
  if terms.sink is not None:  # a logit per query head: each shard its heads'
    specs["sink"] = terms.sink.replace(logits=P(heads))
  if terms.path is not None:  # PaTH's band (its kernel form): per row and head
    specs["path"] = terms.path.replace(band=P(batch, heads, None, None))
  if terms.cope is not None:  # its table of position embeddings, shared by every head
    specs["cope"] = terms.cope.replace(table=P())
  if terms.untied is not None:
    u = terms.untied
    rows = lambda x_BpxPxHxK: P(batch if x_BpxPxHxK.shape[0] > 1 else None, None, heads, None)
    specs["untied"] = u.replace(u_q=rows(u.u_q), u_k=rows(u.u_k),
                                theta=None if u.theta is None else P(None, heads))
  by_kind = {term_lib.HEAD: P(heads, None), term_lib.TABLE: P(heads, None), term_lib.ROWS: P(batch, heads, None),
             term_lib.EMBEDDINGS: P(batch, heads, None, None)}  # rows and embeddings: broadcast to the batch
  specs["open"] = tuple(bound.replace(arrays={name: by_kind[kind] for name, kind in bound.kinds})
                        for bound in terms.open)
  return terms.replace(**specs)


def check_splits(mesh, checks) -> None:
  """Each ``(what, size, mesh axes)`` of ``checks`` names axes the mesh has, whose devices divide ``size``."""
  for what, size, axes in checks:
    missing = [a for a in axes if a not in mesh.axis_names]
    if missing:
      raise ValueError(f"the attention kernel splits its {what} over mesh axes {list(axes)}, but the mesh has axes "
                       f"{list(mesh.axis_names)}; name axes it has (or none)")
    shards = math.prod(mesh.shape[a] for a in axes)
    if size % shards:
      raise ValueError(f"the attention kernel splits its {what} ({size}) over mesh axes {list(axes)} ({shards} "
                       f"shards), which does not divide it; choose a mesh whose {'/'.join(axes)} size divides {size}")


def per_shard(backend, terms: Terms, batch: int, heads: int, batch_axes=None, head_axes=None, kv_heads=None,
              arg_specs=None):
  """``backend`` (a kernel call on heads-first arrays) as it runs under the mesh that tracing sees
  (``jax.sharding.use_abstract_mesh``, which posjax's training loop sets): once per shard, rows split over the
  mesh axes ``batch_axes`` and heads over ``head_axes`` (None: where the logical-axis rules put
  ``activation_batch`` / ``activation_heads``), through ``shard_map``, so the partitioner neither gathers the batch
  onto every device (a Triton call) nor refuses the call (Mosaic). An axis the mesh lacks is an error. Unchanged
  without a mesh, or inside ``pmap`` / ``shard_map`` (:func:`posjax.partitioning.traced_mesh`). ``arg_specs(b,
  h)``: the specs of the arguments after the terms' leaves (default: the attention kernels' q, k, v ``[B, H, L,
  X]``, positions, segment ids and validity ``[B, L]``, dropout salts ``[B, H]``)."""
  mesh = partitioning.traced_mesh()
  if mesh is None:
    return backend
  batch_axes = partitioning.mesh_axes("activation_batch", mesh) if batch_axes is None else tuple(batch_axes)
  head_axes = partitioning.mesh_axes("activation_heads", mesh) if head_axes is None else tuple(head_axes)
  checks = [("batch", batch, batch_axes), ("heads", heads, head_axes)]
  if kv_heads is not None and kv_heads != heads:
    checks.append(("key/value heads", kv_heads, head_axes))  # each shard: its query heads and their groups' k/v
  check_splits(mesh, checks)
  b, h = batch_axes or None, head_axes or None
  rows_BxHxPxX, line_BxP = P(b, h, None, None), P(b, None)
  leaves = jax.tree.leaves(term_specs(terms, b, h), is_leaf=lambda x: isinstance(x, P))
  args = (arg_specs(b, h) if arg_specs is not None else
          (rows_BxHxPxX, rows_BxHxPxX, rows_BxHxPxX, line_BxP, line_BxP, line_BxP, P(b, h)))
  return jax.shard_map(backend, mesh=mesh, in_specs=(leaves, *args), out_specs=rows_BxHxPxX, check_vma=False)


def context_axes(mesh) -> tuple[str, ...]:
  """The mesh axes that split the sequence (where the rules put ``activation_length``; ``()``: none)."""
  return partitioning.mesh_axes("activation_length", mesh)


def context_shards() -> int:
  """How many devices the mesh that tracing sees splits the sequence over (1: none, or no mesh)."""
  mesh = partitioning.traced_mesh()
  return 1 if mesh is None else math.prod(mesh.shape[a] for a in context_axes(mesh))


def per_context_shard(attend, terms: Terms, batch: int, heads: int, length: int, kv_heads: int):
  """``attend(q, k, v, terms, positions, segment_ids, valid, salts, query_offset)`` (the ``xla`` op on
  ``[B, L, H, X]`` arrays) as it runs where the mesh that tracing sees splits the sequence over context axes
  (:func:`context_axes`): once per shard, each device's queries (``L / context`` rows, at their offset in the
  sequence) against the keys and values gathered from every context shard (MaxText's all-gather context
  parallelism; the gather's transpose reduce-scatters their gradients), rows and heads split as
  :func:`per_shard` splits them; the positions, segment ids, validity and the terms' arrays whole, so every term
  is the one of the unsplit sequence. None where no mesh splits the sequence."""
  mesh = partitioning.traced_mesh()
  axes = () if mesh is None else context_axes(mesh)
  shards = math.prod(mesh.shape[a] for a in axes) if axes else 1
  if shards == 1:
    return None
  batch_axes = partitioning.mesh_axes("activation_batch", mesh)
  head_axes = partitioning.mesh_axes("activation_heads", mesh)
  check_splits(mesh, (("sequence", length, axes), ("batch", batch, batch_axes), ("heads", heads, head_axes),
                      ("key/value heads", kv_heads, head_axes)))
  b, h, c = batch_axes or None, head_axes or None, axes if len(axes) > 1 else axes[0]
  local = length // shards

  def shard(leaves, q_BxCxHxK, k_BxCxGxK, v_BxCxGxV, positions_BxL, segment_ids_BxL, valid_BxL, salts_BxH):
    gather = lambda x_BxCxGxX: jax.lax.all_gather(x_BxCxGxX, axes, axis=1, tiled=True)
    offset = jax.lax.axis_index(axes) * local
    return attend(q_BxCxHxK, gather(k_BxCxGxK), gather(v_BxCxGxV), jax.tree_util.tree_unflatten(treedef, leaves),
                  positions_BxL, segment_ids_BxL, valid_BxL, salts_BxH, offset)

  specs = term_specs(terms, b, h)
  leaves, treedef = jax.tree_util.tree_flatten(terms)
  leaf_specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
  split_BxLxHxX, whole_BxL = P(b, c, h, None), P(b, None)
  return lambda *args: jax.shard_map(
      shard, mesh=mesh, in_specs=(leaf_specs, split_BxLxHxX, split_BxLxHxX, split_BxLxHxX, whole_BxL, whole_BxL,
                                  whole_BxL, P(b, h)),
      out_specs=split_BxLxHxX, check_vma=False)(leaves, *args)
