"""The two layouts of an encoder's layers in a parameter tree, and conversion between them.

Per layer (``model.scan_layers=False``): ``{..., "layer_0": P0, "layer_1": P1, ...}``. Scanned (``True``):
``{..., "layers": P}`` with every leaf of ``P`` stacked on a leading axis, layer ``i`` at index ``i``; layers of a
repeating pattern of P kinds (``TransformerConfig.pattern``) scanned as groups, ``{..., "layers": {"kind_0": P0, ...,
"kind_{P-1}": ...}}``, layer ``i`` at index ``i // P`` of ``kind_{i mod P}``. Any tree works (parameters, optimizer
moments, a checkpoint's metadata): every dict holding ``layer_{i}`` keys (or a ``layers`` key) converts, wherever it
sits.
"""

from __future__ import annotations

import re

import jax
import numpy as np

LAYER = re.compile(r"layer_(\d+)")
STACKED = "layers"
KIND = re.compile(r"kind_(\d+)")
PER_LAYER, SCANNED = "per-layer", "scanned"


def _layer_keys(node) -> list[str]:
  return sorted((k for k in node if isinstance(k, str) and LAYER.fullmatch(k)), key=lambda k: int(k[6:]))


def _is_per_layer(node) -> bool:
  return isinstance(node, dict) and bool(_layer_keys(node))


def _is_scanned(node) -> bool:
  return isinstance(node, dict) and isinstance(node.get(STACKED), dict)


def of(tree) -> str | None:
  """``per-layer``, ``scanned``, or None (no encoder layers) for any pytree: parameters, a train state, a
  checkpoint's metadata."""
  names = {str(getattr(k, "key", getattr(k, "name", ""))) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]
           for k in path}
  found = {PER_LAYER for n in names if LAYER.fullmatch(n)} | ({SCANNED} if STACKED in names else set())
  if len(found) > 1:
    raise ValueError("a parameter tree holds layers in both layouts (layer_{i} and stacked 'layers')")
  return found.pop() if found else None


def period(tree) -> int:
  """The kinds in each scanned group of any pytree (1: layers scanned one by one, or not scanned)."""
  key = lambda k: str(getattr(k, "key", getattr(k, "name", "")))
  found = set()
  for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
    names = [key(k) for k in path]
    for i, name in enumerate(names[:-1]):
      if name == STACKED:
        kind = KIND.fullmatch(names[i + 1])
        found.add(int(kind[1]) + 1 if kind else 0)
  groups = max(found) if found else 1
  return max(groups, 1)


def stack(tree, group: int = 1):
  """Every ``layer_{0..n-1}`` group of ``tree`` as one ``layers`` entry of stacked leaves; ``group`` > 1: as
  ``layers/kind_{j}`` entries, layer ``i`` at index ``i // group`` of ``kind_{i mod group}``."""
  def convert(node):
    if _is_per_layer(node):
      keys = _layer_keys(node)
      if [int(k[6:]) for k in keys] != list(range(len(keys))):
        raise ValueError(f"layers {keys} are not numbered 0..{len(keys) - 1}")
      if len(keys) % group:
        raise ValueError(f"{len(keys)} layers do not split into scanned groups of {group}")
      rest = {k: convert(v) for k, v in node.items() if k not in keys}
      stacked = lambda ks: jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *(node[k] for k in ks))
      if group == 1:
        return {**rest, STACKED: stacked(keys)}
      return {**rest, STACKED: {f"kind_{j}": stacked(keys[j::group]) for j in range(group)}}
    return {k: convert(v) for k, v in node.items()} if isinstance(node, dict) else node
  return convert(_plain(tree))


def unstack(tree):
  """Every stacked ``layers`` entry of ``tree`` as ``layer_{i}`` entries, one per index of the leading axis (of each
  ``kind_{j}`` in turn where the layers are scanned in groups)."""
  def convert(node):
    if _is_scanned(node):
      stacked = node[STACKED]
      kinds = sorted((k for k in stacked if isinstance(k, str) and KIND.fullmatch(k)), key=lambda k: int(k[5:]))
      parts = [stacked[k] for k in kinds] if kinds else [stacked]
      n = {np.shape(x)[0] for x in jax.tree.leaves(parts)}
      if len(n) != 1:
        raise ValueError(f"the stacked layers' leaves disagree on the number of layers: {sorted(n)}")
      count = n.pop()
      rest = {k: convert(v) for k, v in node.items() if k != STACKED}
      return {**rest, **{f"layer_{g * len(parts) + j}": jax.tree.map(lambda x, g=g: np.asarray(x)[g], part)
                         for g in range(count) for j, part in enumerate(parts)}}
    return {k: convert(v) for k, v in node.items()} if isinstance(node, dict) else node
  return convert(_plain(tree))


def like(tree, reference):
  """``tree`` in the layout of ``reference`` (unchanged where they agree or either has no layers)."""
  have, want = of(tree), of(reference)
  if have is None or want is None or (have == want and (have == PER_LAYER or period(tree) == period(reference))):
    return tree
  return stack(unstack(tree), period(reference)) if want == SCANNED else unstack(tree)


def _plain(tree):
  """Nested dicts (a FrozenDict thawed); leaves untouched."""
  if hasattr(tree, "items"):
    return {k: _plain(v) for k, v in tree.items()}
  return tree
