"""Open position terms: a term written once, as its logits per tile, that every kernel computes fused.

A :class:`Term` is a ``flax.struct.dataclass`` that declares its inputs by kind (:data:`KINDS`) and gives its logits
as a function of a *view* (:class:`View`): the pairs' positions and indices, and accessors for its inputs. The same
function runs on a kernel's ``[Q, T]`` tile (both Pallas backends, training and decoding) and on the dense ``xla``
path's ``[B, H, Q, L]`` logits, so a term is written elementwise over the last two axes (queries, keys)::

    @flax.struct.dataclass
    class Temperature(kernels.Term):
      beta: jax.Array  # [H]
      KINDS = {"beta": kernels.HEAD}

      def logits(self, tile, s):
        return s * (1.0 + tile.head("beta") * jnp.log1p(tile.q_positions.astype(jnp.float32)))

A term receives the score so far (``scale q·k`` for the first, then each term's result in turn) and returns the new
one: it may add to it (a bias) or modify it (a temperature, a soft cap). Its gradient per tile is derived inside the
kernels (``jax.vjp`` of the same function on the tile's values; its author writes none), and each input kind
accumulates its own share without atomics, so the result is deterministic:

- :data:`HEAD`, ``[H]`` or ``[H, X]``: ``head(name, x)``, this head's scalar; its gradient partial sums per query
  tile;
- :data:`ROWS`, ``[B or 1, H, L]``: ``rows_q(name)`` ``[Q, 1]`` and ``rows_k(name)`` ``[1, T]``; its gradient rows
  of the dq and the dk/dv kernel;
- :data:`TABLE`, ``[H, N]``: ``lookup(name, index)``, ``table[h, index]``; its gradient partial sums per entry (the
  lookup's own transpose on each backend);
- :data:`EMBEDDINGS`, ``[B or 1, H, L, E]``: ``embed_q(name)`` ``[Q, E]``, ``embed_k(name)`` ``[T, E]`` and
  ``inner(a, b)``; its gradient rows, like dq and dk.

``rows`` and ``embeddings`` of a decoding cache span its slots: the queries read theirs at their own slots.
A table index outside ``[0, N)`` is clamped into it (as XLA's gather clamps; ``lookup(..., clamp=False)`` spares a
term whose index is in range by construction the clamp: the T5 buckets' dq kernel on H100 takes 230 registers and
11% of the shared memory without it, 247 and 18% with it). A term may compute its kernel
inputs from its fields (:meth:`Term.kernel_inputs`: Sandwich's embeddings from its ratios); their gradients reach
the fields by JAX's own autodiff outside the kernels.

Shapes: B batch, H heads, L length, Q/T query/key rows, X a head's scalars, N table entries, E embedding width.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import flax.struct

HEAD, ROWS, TABLE, EMBEDDINGS = "head", "rows", "table", "embeddings"
KINDS = (HEAD, ROWS, TABLE, EMBEDDINGS)


class Term:
  """The base of an open term (subclasses are ``flax.struct.dataclass``\\ es): ``KINDS`` maps each kernel input's
  name to its kind, :meth:`logits` gives the new score from the view and the score so far."""

  KINDS: ClassVar[dict] = {}
  CONSTANTS: ClassVar[frozenset] = frozenset()  # inputs that take no gradient (the kernels accumulate none)

  def logits(self, tile: "View", s):
    """The score after this term, elementwise over the last two axes (queries, keys) of ``s``."""
    raise NotImplementedError(f"{type(self).__name__} defines no logits(tile, s)")

  def check(self, batch: int, num_heads: int, head_dim: int, length: int) -> None:
    """Raises, in one line, on options or arrays the term cannot take (default: nothing beyond :func:`bind`'s
    shapes per kind)."""
    del batch, num_heads, head_dim, length

  def kernel_inputs(self, positions_BxL) -> dict:
    """``{name: array}`` of every input in ``KINDS`` (default: the fields of those names), float32."""
    del positions_BxL
    return {name: getattr(self, name) for name in self.KINDS}

  # A hand-written gradient per tile, where it is measurably better than the derived one (FIRE's MLP: one hidden unit
  # at a time, no [W, Q, T] residuals): ``hand_grads(tile, s, ds, acc, add) -> (d s, acc)``, ``s`` the score the
  # term was given, ``ds`` the gradient of the one it gave, ``add(acc, name, column, part_QxT) -> acc`` adding the
  # sum of ``part`` to a HEAD input's column (traced or not); ``add`` None: skip them. None: derived by jax.vjp.
  hand_grads = None

  def decode_state(self, slots: int):
    """``(shape, dtype)`` of what a decoding cache of ``slots`` keeps for this term beside k and v (the Forgetting
    Transformer's cumulative gates), or None: nothing."""
    del slots

  def continued(self, cache, positions_BxQ, index):
    """``(term over every slot, new cache)``: this step's term (its new tokens only) continued from the cache
    :meth:`decode_state` describes, written at slot ``index``."""
    raise NotImplementedError(f"{type(self).__name__} keeps a decoding state but gives no continued()")


def input_shapes(kind: str, batch: int, heads: int, length: int) -> str:
  """The shape a kind's array must have, in words."""
  return {HEAD: f"({heads},) or ({heads}, X)", ROWS: f"({batch} or 1, {heads}, {length})",
          TABLE: f"({heads}, N)", EMBEDDINGS: f"({batch} or 1, {heads}, {length}, E)"}[kind]


def _fits(kind: str, shape, batch: int, heads: int, length: int) -> bool:
  if kind == HEAD:
    return len(shape) in (1, 2) and shape[0] == heads
  if kind == TABLE:
    return len(shape) == 2 and shape[0] == heads and shape[1] >= 1
  if kind == ROWS:
    return len(shape) == 3 and shape[0] in (1, batch) and shape[1:] == (heads, length)
  return len(shape) == 4 and shape[0] in (1, batch) and shape[1:3] == (heads, length) and shape[3] >= 1


@flax.struct.dataclass
class Bound:
  """An open term bound to its kernel inputs: ``arrays`` (float32, in :data:`KINDS` layouts) and the term's static
  part (``term``: its arrays removed, so the pair is hashable inside a kernel's static plan)."""

  term: Any = flax.struct.field(pytree_node=False)
  kinds: tuple = flax.struct.field(pytree_node=False)  # ((name, kind), ...)
  arrays: dict
  constants: tuple = flax.struct.field(pytree_node=False, default=())  # names that take no gradient
  columns: tuple = flax.struct.field(pytree_node=False, default=())  # ((name, X), ...) of the HEAD inputs
  widths: tuple = flax.struct.field(pytree_node=False, default=())  # ((name, E), ...) of the EMBEDDINGS inputs


def skeleton(term: Term):
  """The term with its arrays set to None: its static options and its logits, hashable."""
  return jax.tree.map(lambda _: None, term)


def bind(term, positions_BxL, batch: int, heads: int, length: int) -> Bound:
  """A :class:`Bound` of ``term`` (a :class:`Term`; a :class:`Bound` passes through), its inputs checked: a kind
  outside :data:`KINDS` or an array of another shape is a one-line error that names the term and the input."""
  if isinstance(term, Bound):
    return term
  if not isinstance(term, Term):
    raise TypeError(f"{term!r} is not a posjax.kernels.Term (a flax.struct.dataclass with KINDS and logits)")
  name_of = type(term).__name__
  if not dataclasses.is_dataclass(term):
    raise TypeError(f"{name_of} must be a flax.struct.dataclass (its arrays pytree nodes, its options "
                    "pytree_node=False)")
  term.check(batch, heads, None, length)
  arrays = term.kernel_inputs(positions_BxL)
  if set(arrays) != set(term.KINDS):
    raise ValueError(f"{name_of}.kernel_inputs gave {sorted(arrays)}; its KINDS declare {sorted(term.KINDS)}")
  for name, kind in term.KINDS.items():
    if kind not in KINDS:
      raise ValueError(f"{name_of}.KINDS[{name!r}]={kind!r}; allowed: {list(KINDS)}")
    shape = tuple(jnp.shape(arrays[name]))
    if not _fits(kind, shape, batch, heads, length):
      raise ValueError(f"{name_of}.{name} ({kind}) has shape {shape}; expected "
                       f"{input_shapes(kind, batch, heads, length)}")
  arrays = {name: jnp.asarray(x, jnp.float32) for name, x in arrays.items()}
  arrays = {name: x[:, None] if term.KINDS[name] == HEAD and x.ndim == 1 else x for name, x in arrays.items()}
  fields = {f.name for f in dataclasses.fields(term) if f.metadata.get("pytree_node", True)}
  undeclared = sorted(name for name in fields if getattr(term, name) is not None and name not in term.KINDS
                      and type(term).kernel_inputs is Term.kernel_inputs)
  if undeclared:
    raise ValueError(f"{name_of}'s field(s) {undeclared} are pytree nodes its KINDS do not declare: the kernels "
                     "would read them as None; declare them in KINDS or mark them flax.struct.field(pytree_node=False)")
  unknown = sorted(set(term.CONSTANTS) - set(term.KINDS))
  if unknown:
    raise ValueError(f"{name_of}.CONSTANTS names {unknown}, which its KINDS do not declare")
  arrays = {name: jax.lax.stop_gradient(x) if name in term.CONSTANTS else x for name, x in arrays.items()}
  columns = tuple((name, arrays[name].shape[1]) for name in sorted(arrays) if term.KINDS[name] == HEAD)
  widths = tuple((name, arrays[name].shape[-1]) for name in sorted(arrays) if term.KINDS[name] == EMBEDDINGS)
  return Bound(skeleton(term), tuple(sorted(term.KINDS.items())), arrays, tuple(sorted(term.CONSTANTS)), columns,
               widths)


class View:
  """What a term's :meth:`Term.logits` reads: ``q_positions`` / ``k_positions`` (int32, the pairs' positions),
  ``q_index`` / ``k_index`` (their sequence indices, or cache slots in decoding), each broadcastable to the
  score's last two axes; and its inputs by name: ``head``, ``rows_q``, ``rows_k``, ``lookup``, ``embed_q``,
  ``embed_k``, with ``inner(a_q, b_k)`` the per-pair inner product of two embeddings."""

  q_positions: Any
  k_positions: Any
  q_index: Any
  k_index: Any

  def head(self, name: str, column=0):
    """This head's scalar at ``column`` of a :data:`HEAD` input (a traced column only in a term whose gradient is
    written by hand: a derived gradient needs static ones)."""
    raise NotImplementedError

  def head_columns(self, name: str) -> int:
    """``X``: the columns of a :data:`HEAD` input (static)."""
    raise NotImplementedError

  def embedding_width(self, name: str) -> int:
    """``E``: the width of an :data:`EMBEDDINGS` input as given (static). The GPU kernels read it zero-padded to a
    power of two of at least 16 (Triton's arrays are powers of two): write a term that zero columns leave
    unchanged (inner products, sums), or read this width rather than the array's."""
    raise NotImplementedError

  def rows_q(self, name: str):
    raise NotImplementedError

  def rows_k(self, name: str):
    raise NotImplementedError

  def lookup(self, name: str, index, clamp: bool = True):
    """``table[h, index]`` of this head; ``clamp=False`` where the index is in the table by construction for every
    pair of a tile, masked pairs included (it saves the kernels a clamp; an index outside it is then undefined
    there)."""
    raise NotImplementedError

  def embed_q(self, name: str):
    raise NotImplementedError

  def embed_k(self, name: str):
    raise NotImplementedError

  def inner(self, a_QxE, b_TxE):
    raise NotImplementedError


def apply(bounds, view_of: Callable[[int], View], s):
  """The score after every open term in order (``view_of(i)``: term ``i``'s view)."""
  for i, bound in enumerate(bounds):
    s = bound.term.logits(view_of(i), s)
  return s


# ----------------------------------------------------------------------------------------------------------
# The dense view (the ``xla`` path: ``[B, H, Q, L]`` logits).


@dataclasses.dataclass
class DenseView(View):
  """A term's view over ``[B, H, Q, L]`` logits (query rows ``rows_Q`` of ``L`` keys)."""

  bound: Bound
  positions_BxL: Any
  rows_Q: Any

  def __post_init__(self):
    length = self.positions_BxL.shape[1]
    rows_Q = jnp.arange(length) if self.rows_Q is None else self.rows_Q
    self._rows_Q = rows_Q
    self.q_positions = jnp.take(self.positions_BxL, rows_Q, axis=1)[:, None, :, None]
    self.k_positions = self.positions_BxL[:, None, None, :]
    self.q_index = rows_Q.astype(jnp.int32)[None, None, :, None]
    self.k_index = jnp.arange(length, dtype=jnp.int32)[None, None, None, :]

  def _array(self, name: str, kind: str):
    kinds = dict(self.bound.kinds)
    if kinds.get(name) != kind:
      raise ValueError(f"{type(self.bound.term).__name__} reads {name!r} as {kind}; its KINDS say "
                       f"{kinds.get(name, 'nothing')}")
    return self.bound.arrays[name]

  def head(self, name: str, column=0):
    return self._array(name, HEAD)[:, column][None, :, None, None]

  def head_columns(self, name: str) -> int:
    return dict(self.bound.columns)[name]

  def embedding_width(self, name: str) -> int:
    return dict(self.bound.widths)[name]

  def rows_q(self, name: str):
    return jnp.take(self._array(name, ROWS), self._rows_Q, axis=2)[..., None]

  def rows_k(self, name: str):
    return self._array(name, ROWS)[:, :, None, :]

  def lookup(self, name: str, index, clamp: bool = True):
    del clamp  # the gather below clamps either way
    table_HxN = self._array(name, TABLE)
    heads, entries = table_HxN.shape
    head_1xHx1x1 = jnp.arange(heads, dtype=jnp.int32)[None, :, None, None]
    return jnp.take(table_HxN.reshape(-1), head_1xHx1x1 * entries + jnp.clip(index, 0, entries - 1))

  def embed_q(self, name: str):
    return jnp.take(self._array(name, EMBEDDINGS), self._rows_Q, axis=2)

  def embed_k(self, name: str):
    return self._array(name, EMBEDDINGS)

  def inner(self, a_QxE, b_TxE):
    return jnp.einsum("...qe,...ke->...qk", a_QxE, b_TxE, precision=jax.lax.Precision.HIGHEST)


def dense_logits(bounds, positions_BxL, s_BxHxQxL, rows_Q=None):
  """``s`` after the open terms on the dense path (``rows_Q``: the query rows, default all)."""
  positions_BxL = jnp.asarray(positions_BxL, jnp.int32)
  return apply(bounds, lambda i: DenseView(bounds[i], positions_BxL, rows_Q), s_BxHxQxL)


# ----------------------------------------------------------------------------------------------------------
# The tile view (the kernels': one (query tile, key tile) pair of one (batch, head)).


class TileView(View):
  """A term's view of one tile. The backend's tile gives the pairs (``q_positions`` ``[Q, 1]`` or ``[Q, T]``,
  ``k_positions`` ``[1, T]``, indices likewise) and loads inputs by kind (``load(key, kind, side)``,
  ``gather(key, index)``, ``inner``); the values read are kept (``values``: the primal of the derived gradient) and
  the lookups recorded (``lookups``: ``(key, index, value)``), or, replaying, read back from ``replay``."""

  def __init__(self, tile, prefix: str, bound: Bound, values: dict, lookups: list, replay=None):
    self.tile, self.prefix, self.kinds, self.columns = tile, prefix, dict(bound.kinds), dict(bound.columns)
    self.name_of, self.widths = type(bound.term).__name__, dict(bound.widths)
    self.values, self.lookups, self.replay = values, lookups, replay
    self.q_positions, self.k_positions = tile.open_q_positions, tile.open_k_positions
    self.q_index, self.k_index = tile.open_q_index, tile.open_k_index

  def _key(self, name: str, kind: str) -> str:
    if self.kinds.get(name) != kind:
      raise ValueError(f"{self.name_of} reads {name!r} as {kind}; its KINDS say {self.kinds.get(name, 'nothing')}")
    return self.prefix + name

  def _value(self, key: str, kind: str, side):
    slot = (key, side)
    if slot not in self.values:
      self.values[slot] = self.tile.open_load(key, kind, side)
    return self.values[slot]

  def head(self, name: str, column=0):
    key = self._key(name, HEAD)
    if isinstance(column, np.integer):
      column = int(column)
    if not isinstance(column, int):  # a traced column: read, not kept (only a hand-written gradient reaches it)
      self.tile.open_dynamic.add(self.prefix)
      return self.tile.open_load(key, HEAD, column)
    return self._value(key, HEAD, column)

  def head_columns(self, name: str) -> int:
    return self.columns[name]

  def embedding_width(self, name: str) -> int:
    return self.widths[name]

  def rows_q(self, name: str):
    return self._value(self._key(name, ROWS), ROWS, "q")

  def rows_k(self, name: str):
    return self._value(self._key(name, ROWS), ROWS, "k")

  def embed_q(self, name: str):
    return self._value(self._key(name, EMBEDDINGS), EMBEDDINGS, "q")

  def embed_k(self, name: str):
    return self._value(self._key(name, EMBEDDINGS), EMBEDDINGS, "k")

  def lookup(self, name: str, index, clamp: bool = True):
    key = self._key(name, TABLE)
    index = jnp.broadcast_to(index, self.tile.open_shape).astype(jnp.int32)
    if clamp:
      index = jnp.clip(index, 0, self.tile.open_entries(key) - 1)
    if self.replay is not None:  # the k-th lookup of the replayed logits reads the k-th recorded value
      self.lookups.append(None)
      return self.replay[len(self.lookups) - 1]
    value = self.tile.open_gather(key, index)
    self.lookups.append((key, index, value))
    return value

  def inner(self, a_QxE, b_TxE):
    return self.tile.open_inner(a_QxE, b_TxE)


def prefix(i: int) -> str:
  """Term ``i``'s namespace among a call's kernel inputs."""
  return f"open{i}_"


def kernel_arrays(bounds, trainable: bool = False) -> dict:
  """``{key: (kind, array)}`` of every bound term's inputs, namespaced by :func:`prefix` (``trainable``: only those
  that take a gradient)."""
  return {prefix(i) + name: (kind, bound.arrays[name]) for i, bound in enumerate(bounds)
          for name, kind in bound.kinds if not (trainable and name in bound.constants)}


def constant_keys(bounds) -> set:
  """The keys of the inputs that take no gradient."""
  return {prefix(i) + name for i, bound in enumerate(bounds) for name in bound.constants}


def tile_logits(tile, bounds, s_QxT):
  """A tile's score after the open terms, keeping what :func:`tile_grads` differentiates: each term's input score,
  the values it read and its lookups."""
  tile.open_values, tile.open_lookups, tile.open_inputs, tile.open_dynamic = {}, [], [], set()
  for i, bound in enumerate(bounds):
    tile.open_inputs.append(s_QxT)
    s_QxT = bound.term.logits(TileView(tile, prefix(i), bound, tile.open_values, tile.open_lookups), s_QxT)
  return s_QxT


def tile_grads(tile, bounds, ds_QxT, acc=None, add=None):
  """``(d content, {(key, side): d value}, [(key, index, d value)], acc)``: the open terms' gradient on one tile from
  the final score's ``ds``, term by term from the last: a term's hand-written one (``term.hand_grads``, which adds
  its heads' shares to ``acc`` through the backend's ``add(acc, key, column, part_QxT)``; None: it skips them), or
  ``jax.vjp`` of its logits with its values and its lookups' values as primals (each backend transposes a lookup its
  own way)."""
  constants = constant_keys(bounds)
  d_values, d_lookups = {}, []
  for i in reversed(range(len(bounds))):
    term, mine = bounds[i].term, prefix(i)
    if term.hand_grads is not None:
      term_add = None if add is None else lambda acc, name, column, part, mine=mine: add(acc, mine + name, column, part)
      ds_QxT, acc = term.hand_grads(TileView(tile, mine, bounds[i], {}, []), tile.open_inputs[i], ds_QxT, acc,
                                    term_add)
      continue
    if mine in tile.open_dynamic:
      raise ValueError(f"{type(term).__name__} reads a head's column at a traced index, which a derived gradient "
                       "cannot reach; read static columns, or give the term hand_grads")
    slots = [slot for slot in tile.open_values if slot[0].startswith(mine) and slot[0] not in constants]
    fixed = {slot: value for slot, value in tile.open_values.items()
             if slot[0].startswith(mine) and slot[0] in constants}
    lookups = [lookup for lookup in tile.open_lookups if lookup[0].startswith(mine)]

    def replayed(values, looked_values, s_QxT, i=i, slots=slots, fixed=fixed):
      store, read = {**fixed, **dict(zip(slots, values))}, []
      view = TileView(tile, prefix(i), bounds[i], store, read, replay=looked_values)
      return bounds[i].term.logits(view, s_QxT)

    _, pullback = jax.vjp(replayed, [tile.open_values[slot] for slot in slots], [v for _, _, v in lookups],
                          tile.open_inputs[i])
    d_mine, d_looked, ds_QxT = pullback(ds_QxT)
    d_values.update(zip(slots, d_mine))
    d_lookups += [(key, index, d) for (key, index, _), d in zip(lookups, d_looked) if key not in constants]
  return ds_QxT, d_values, d_lookups, acc


def gradients(bounds, d: dict) -> tuple:
  """The bound terms' gradients from a backend's sums, one layout for both: ``d<key>`` ``[B, H, N, X]`` partial sums
  of a :data:`HEAD` or :data:`TABLE` input (over the batch and the query tiles or rows), ``d<key>@q`` and
  ``d<key>@k``, the query and the key side of :data:`ROWS` and :data:`EMBEDDINGS` inputs."""
  out = []
  for i, bound in enumerate(bounds):
    arrays = {}
    for name, kind in bound.kinds:
      key = "d" + prefix(i) + name
      if name in bound.constants:
        grad = jnp.zeros_like(bound.arrays[name])
      else:
        grad = jnp.sum(d[key], axis=(0, 2)) if kind in (HEAD, TABLE) else d[key + "@q"] + d[key + "@k"]
      arrays[name] = grad.astype(bound.arrays[name].dtype)
    out.append(bound.replace(arrays=arrays))
  return tuple(out)


def query_rows(bounds, q_slots_BxQ) -> dict:
  """Decoding: ``{key@q: rows}`` of each :data:`ROWS` (``[B, H, Q]``) and :data:`EMBEDDINGS` (``[B, H, Q, E]``) input
  at the queries' cache slots."""
  out = {}
  for key, (kind, x) in kernel_arrays(bounds).items():
    if kind in (ROWS, EMBEDDINGS):
      slots = q_slots_BxQ[:, None, :] if kind == ROWS else q_slots_BxQ[:, None, :, None]
      out[key + "@q"] = jnp.take_along_axis(x, jnp.broadcast_to(slots, (*x.shape[:2], q_slots_BxQ.shape[1],
                                                                         *x.shape[3:])), axis=2)
  return out


def embedding_width(terms_open, length: int = 1) -> int:
  """The widest :data:`EMBEDDINGS` input of ``terms_open`` (bound or not: an unbound term's from the shapes its
  :meth:`Term.kernel_inputs` would give), 0 without one: the tiles' float32 operands that bound the GPU's tiles."""
  widths = [0]
  for t in terms_open:
    if isinstance(t, Bound):
      widths += [t.arrays[name].shape[-1] for name, kind in t.kinds if kind == EMBEDDINGS]
    elif any(kind == EMBEDDINGS for kind in t.KINDS.values()):
      shapes = jax.eval_shape(lambda: t.kernel_inputs(jnp.zeros((1, length), jnp.int32)))
      widths += [shapes[name].shape[-1] for name, kind in t.KINDS.items() if kind == EMBEDDINGS]
  return max(widths)
