"""Logical axis names and the rules that map them to mesh axes: one mapping for parameters, activations and the
fused kernels' ``shard_map``.

Parameters carry logical names (``embed``, ``heads``, ``mlp``...; :mod:`posjax.positions.base` names them);
activations are constrained at layer boundaries by ``activation_*`` names (after MaxText's and t5x's: the batch over
``data`` x ``fsdp``, the sequence over ``context``, heads and the MLP over ``tensor``). The rules are flax's context
(``with nn.logical_axis_rules(rules):``, for a user's own mesh axis names) where one is set, else :data:`RULES`,
posjax's for its mesh ``("data", "fsdp", "context", "tensor")``. Under a mesh that tracing sees
(``jax.sharding.use_abstract_mesh``, as posjax's training step is traced), a rule naming a mesh axis the mesh lacks
is an error, except :data:`OPTIONAL_AXES` (a mesh without ``context`` does not split the sequence); without a mesh
nothing is constrained.

Context parallelism (``context`` > 1): every activation ``[B, L, ...]`` holds ``L / context`` tokens per device;
attention gathers its keys and values along the sequence (``activation_kv_length``, replicated) and each device
scores its own queries against all of them (MaxText's all-gather context parallelism), so a position term, which
comes from the positions, is the same on every device as on one.
"""

from __future__ import annotations

import flax.linen as nn
import jax
from jax.sharding import NamedSharding, PartitionSpec as P

BATCH_AXES = ("data", "fsdp")
CONTEXT = "context"
OPTIONAL_AXES = (CONTEXT,)  # axes a mesh may lack: the rules that name them then leave their dimension whole

# Logical axis -> mesh axes (None: replicated). Parameters' names, then activations'.
RULES = (
    ("batch", BATCH_AXES),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("kv", None),
    ("position", None),
    ("relpos", None),
    ("relpos_buckets", None),
    ("layers", None),
    ("activation_batch", BATCH_AXES),
    ("activation_length", CONTEXT),
    ("activation_kv_length", None),  # attention's keys and values: gathered along the sequence
    ("activation_embed", None),
    ("activation_heads", "tensor"),
    ("activation_kv", None),
    ("activation_mlp", "tensor"),
    ("activation_vocab", "tensor"),
)
# The activations' logical axes at the boundaries the model constrains.
BLD = ("activation_batch", "activation_length", "activation_embed")
BLHK = ("activation_batch", "activation_length", "activation_heads", "activation_kv")
BHLK = ("activation_batch", "activation_heads", "activation_length", "activation_kv")  # heads first: a decoding cache
BLHK_WHOLE = ("activation_batch", "activation_kv_length", "activation_heads", "activation_kv")  # keys and values
BHQL = ("activation_batch", "activation_heads", "activation_length", "activation_kv_length")  # attention logits
BLF = ("activation_batch", "activation_length", "activation_mlp")


def rules() -> tuple:
  """The rules in force: flax's ``nn.logical_axis_rules`` context where set, else :data:`RULES`."""
  return tuple(nn.get_logical_axis_rules()) or RULES


def mesh_axes(name: str | None, mesh, rules_=None) -> tuple[str, ...]:
  """The mesh axes logical axis ``name`` maps to under ``rules_`` (default :func:`rules`): a name without a rule,
  or mapped to None, is replicated (``()``); a rule naming an axis ``mesh`` lacks is an error."""
  if name is None:
    return ()
  for logical, target in rules_ or rules():
    if logical != name:
      continue
    axes = () if target is None else (target,) if isinstance(target, str) else tuple(target)
    axes = tuple(a for a in axes if a in mesh.axis_names or a not in OPTIONAL_AXES)
    missing = [a for a in axes if a not in mesh.axis_names]
    if missing:
      raise ValueError(f"logical axis {name!r} maps to mesh axes {list(axes)}, but the mesh has axes "
                       f"{list(mesh.axis_names)}: give rules for its axes (with flax.linen.logical_axis_rules"
                       f"(rules): ...), e.g. ({name!r}, {mesh.axis_names[0]!r}) or ({name!r}, None)")
    return axes
  return ()


def spec(names, mesh, rules_=None) -> P:
  """The ``PartitionSpec`` of an array with logical axes ``names`` (a mesh axis used twice is used once, by the
  first name that maps to it, as flax's rules do)."""
  used, entries = set(), []
  for name in names:
    axes = tuple(a for a in mesh_axes(name, mesh, rules_) if a not in used)
    used.update(axes)
    entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  return P(*entries)


def traced_mesh():
  """The mesh that tracing sees (``jax.sharding.use_abstract_mesh``), or None: none set, or every axis manual
  (inside ``pmap`` or ``shard_map`` the program is already one device's)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or set(mesh.manual_axes) >= set(mesh.axis_names):
    return None
  return mesh


def constrain(x, names):
  """``x`` constrained to the sharding its logical axes ``names`` map to under :func:`traced_mesh`; unchanged
  without one."""
  mesh = traced_mesh()
  if mesh is None:
    return x
  if x.ndim != len(names):
    raise ValueError(f"an array of shape {x.shape} cannot take the {len(names)} logical axes {names}")
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec(names, mesh)))
