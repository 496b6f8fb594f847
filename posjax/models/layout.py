"""The two layouts of an encoder's layers in a parameter tree, and conversion between them.

Per layer (``model.scan_layers=False``): ``{..., "layer_0": P0, "layer_1": P1, ...}``. Scanned (``True``):
``{..., "layers": P}`` with every leaf of ``P`` stacked on a leading axis, layer ``i`` at index ``i``. Any tree works
(parameters, optimizer moments, a checkpoint's metadata): every dict holding ``layer_{i}`` keys (or a ``layers``
key) converts, wherever it sits.
"""

from __future__ import annotations

import re

import jax
import numpy as np

LAYER = re.compile(r"layer_(\d+)")
STACKED = "layers"
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


def stack(tree):
  """Every ``layer_{0..n-1}`` group of ``tree`` as one ``layers`` entry of stacked leaves."""
  def convert(node):
    if _is_per_layer(node):
      keys = _layer_keys(node)
      if [int(k[6:]) for k in keys] != list(range(len(keys))):
        raise ValueError(f"layers {keys} are not numbered 0..{len(keys) - 1}")
      rest = {k: convert(v) for k, v in node.items() if k not in keys}
      return {**rest, STACKED: jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]),
                                            *(node[k] for k in keys))}
    return {k: convert(v) for k, v in node.items()} if isinstance(node, dict) else node
  return convert(_plain(tree))


def unstack(tree):
  """Every stacked ``layers`` entry of ``tree`` as ``layer_{i}`` entries, one per index of the leading axis."""
  def convert(node):
    if _is_scanned(node):
      stacked = node[STACKED]
      n = {np.shape(x)[0] for x in jax.tree.leaves(stacked)}
      if len(n) != 1:
        raise ValueError(f"the stacked layers' leaves disagree on the number of layers: {sorted(n)}")
      rest = {k: convert(v) for k, v in node.items() if k != STACKED}
      return {**rest, **{f"layer_{i}": jax.tree.map(lambda x, i=i: np.asarray(x)[i], stacked) for i in range(n.pop())}}
    return {k: convert(v) for k, v in node.items()} if isinstance(node, dict) else node
  return convert(_plain(tree))


def like(tree, reference):
  """``tree`` in the layout of ``reference`` (unchanged where they agree or either has no layers)."""
  have, want = of(tree), of(reference)
  if have is None or want is None or have == want:
    return tree
  return stack(tree) if want == SCANNED else unstack(tree)


def _plain(tree):
  """Nested dicts (a FrozenDict thawed); leaves untouched."""
  if hasattr(tree, "items"):
    return {k: _plain(v) for k, v in tree.items()}
  return tree
