"""The position terms a fused attention kernel computes inside its tiles, and the formulas that define them.

Shapes: B batch, Bp batch of the positions (1 or B), L length, H heads, K head dim, Q/T query/key rows, D
relative distances (``2k+1`` table rows), N table entries, S any (broadcast) shape.

A term never carries an ``[H, L, L]`` tensor: only what each tile needs to build its part of the logits from
the batch's positions (so packed rows are exact):

| term           | inputs                                    | logit contribution at (i, j), r = p_j - p_i       |
|----------------|-------------------------------------------|----------------------------------------------------|
| ``Alibi``      | slopes ``[H]`` (constant)                 | ``-m_h |r|``                                       |
| ``Buckets``    | table ``[N, H]``                          | ``table[entry(r), h]`` (T5 log buckets or clipping)|
| ``Relative``   | table ``[2k+1, K]``                       | ``scale (q_i·a_r + a_r·k_j)`` (Shaw, Method 4)     |
| ``Untied``     | ``u_q, u_k [Bp, L, H, K]``, θ ``[2, H]``  | ``u_q,i·u_k,j`` with the [CLS] reset (TUPE)        |
| ``Kerple``     | ``r1, r2 [H]`` (positive)                 | ``-r1 log(1 + r2 |r|)`` or ``-r1 |r|^r2`` (KERPLE) |
| ``Fire``       | an MLP ``1 -> W -> H``, ``c``, ``L``      | ``f(ψ(|r|) / ψ(max(|L|, p_i)))``, ``ψ = log(|c| x + 1)`` |
| ``Sandwich``   | ratios ``ρ [H]`` (constant)               | ``λ (Σ_f cos(r ω_f / ρ_h) - F)`` (Sandwich)        |
| ``Forget``     | ``c [B, H, L]`` (per token, float32)      | ``c_i - c_j``, ``j <= i`` (the Forgetting Transformer) |

The dense ``xla`` path and the Pallas kernels compute these terms. ALiBi, the buckets, KERPLE, FIRE, Sandwich and
the forget gate are open terms (:mod:`posjax.kernels.term`), each in its own file here (``alibi.py``,
``buckets.py``, ``kerple.py``, ``fire.py``, ``sandwich.py``, ``forget.py``): its formula, dense form and logits per
tile, whose gradient the kernels derive (FIRE's written by hand, one hidden unit at a time);
:meth:`Terms.kernel_form` hands them to the kernels as open terms, after the call's own. The untied term (its
[CLS] reset) and the relative vectors (the windowed table's skew and gradient kernel) keep their own kernel code;
the two rules below have theirs (:mod:`posjax.kernels.rules`).

``Sink`` (GPT-OSS's attention sinks, ``terms/sink.py``) is a logit per head in each row's softmax denominator, which
the kernels add to their rows' statistics, not to their tiles. ``Path`` (PaTH attention, ``terms/path.py``) changes
the content term itself, ``q_i^T H_i ... H_{j+1} k_j`` with data-dependent Householder factors: the ``xla`` path
computes it chunkwise, the Pallas kernels in blocks (its ``PathBlocks`` form: a band of dense logits, copies of the
keys).
Two terms read the *masked* logits, so the op applies them after the mask (:data:`WEIGHT_RULES`): ``Cope``
(Contextual Position Encoding: positions counted by gates over the allowed keys, a term interpolated from a learned
table) and ``StickBreaking`` (the weights themselves: stick-breaking instead of the softmax); ``xla`` and both Pallas
backends compute each (the kernels: alone in a call).

``scale`` is the op's content scale (the factor on ``q·k``); the other terms come scaled as the model adds
them. [CLS] tokens are those at position 0 (the first token of each packed segment), as in TUPE's position
method.

The formulas the terms stand for live here too (:func:`bucket`, :func:`relative_positions`,
:func:`query_term`, :func:`key_term`, :func:`untie_cls`, ...): the kernels, their dense ``xla`` reference and
the position methods (which import them from here) all compute the same functions, so this package depends on
nothing of the position methods.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from posjax.kernels import term
from posjax.kernels.rules.cope import Cope
from posjax.kernels.rules.stick_breaking import StickBreaking
from posjax.kernels.terms.alibi import Alibi
from posjax.kernels.terms.fire import Fire
from posjax.kernels.terms.buckets import Buckets, bucket, check_buckets, clipped_index
from posjax.kernels.terms.forget import Forget, forget_sums
from posjax.kernels.terms.kerple import KERPLES, Kerple
from posjax.kernels.terms.path import Path
from posjax.kernels.terms.relative import Relative
from posjax.kernels.terms.untied import RESETS, Untied
from posjax.kernels.terms.sandwich import Sandwich
from posjax.kernels.terms.sink import Sink
from posjax.kernels.terms.softcap import SoftCap

NAMES = ("alibi", "buckets", "relative", "untied", "kerple", "fire", "sandwich", "forget", "cope",
         "stick_breaking", "sink", "path")  # every field of Terms
OPEN_BUILTINS = ("buckets", "alibi", "kerple", "fire", "sandwich", "forget")  # open terms, in this order
WEIGHT_RULES = ("cope", "stick_breaking")  # the terms applied after the mask (the kernels: each alone in a call)


# ----------------------------------------------------------------------------------------------------------
# The formulas (pure functions).


def check_rows(name: str, x_BxL, batch: int | None = None, length: int | None = None, kind: str = "int") -> None:
  """Raises unless ``x`` is ``[batch or 1, length]`` (either unchecked where None) of integers (``kind="int"``:
  positions, segment ids) or of bools / integers (``kind="mask"``: padding, True or 1 at real tokens), saying what
  was given and what is allowed: a float (an additive mask, fractional positions) is never cast silently."""
  shape, dtype = jnp.shape(x_BxL), jnp.result_type(x_BxL)
  rows = "B" if batch is None else f"{batch} or 1"
  expected = f"[{rows}, {'L' if length is None else length}]"
  if (len(shape) != 2 or (length is not None and shape[1] != length)
      or (batch is not None and shape[0] not in (1, batch))):
    raise ValueError(f"{name} has shape {tuple(shape)}; expected {expected} (batch rows, sequence)")
  allowed = (jnp.integer, jnp.bool_) if kind == "mask" else (jnp.integer,)
  if not any(jnp.issubdtype(dtype, t) for t in allowed):
    what = "bool or 0/1 integers, True at real tokens (not an additive 0/-inf mask)" if kind == "mask" else "integers"
    raise ValueError(f"{name} has dtype {dtype}; it must hold {what}")


def relative_positions(positions_BxL):
  """``rel[b, i, j] = positions[b, j] - positions[b, i]`` (key minus query), ``[B, L, L]`` int32: every
  relative term is a function of it, so packed rows (positions restarting per segment) are exact."""
  check_rows("positions", positions_BxL)
  positions_BxL = positions_BxL.astype(jnp.int32)
  return positions_BxL[:, None, :] - positions_BxL[:, :, None]


def kv_group(heads: int, kv_heads: int) -> int:
  """How many query heads share one key/value head (grouped-query attention, Ainslie et al. 2023; 1: multi-head,
  ``heads``: multi-query): query head h reads key/value head ``h // group``. Raises unless ``kv_heads`` divides
  ``heads``."""
  if kv_heads <= 0 or heads % kv_heads:
    raise ValueError(f"k/v have {kv_heads} heads, which must divide the {heads} query heads (grouped-query "
                     "attention: query head h reads key/value head h // (H / KV))")
  return heads // kv_heads


def dot_heads(a_BxQxHxK, b_BxTxGxK):
  """``[B|1, Q, H, K] x [B|1, T, G, K] -> [B|1, H, Q, T]`` float32: per-head dot products (the content term's
  layout; TUPE's untied term), accumulated in float32 whatever the inputs' dtype. ``G`` dividing ``H`` (grouped
  keys): query head h meets key head ``h // (H / G)``, with no repeated copy of the keys."""
  heads, kv_heads = a_BxQxHxK.shape[2], b_BxTxGxK.shape[2]
  if kv_heads == heads:
    return jnp.einsum("bqhd,bkhd->bhqk", a_BxQxHxK, b_BxTxGxK, preferred_element_type=jnp.float32)
  group = kv_group(heads, kv_heads)
  a_BxQxGxNxK = a_BxQxHxK.reshape(*a_BxQxHxK.shape[:2], kv_heads, group, a_BxQxHxK.shape[3])
  s_BxGxNxQxT = jnp.einsum("bqgnd,bkgd->bgnqk", a_BxQxGxNxK, b_BxTxGxK, preferred_element_type=jnp.float32)
  return s_BxGxNxQxT.reshape(s_BxGxNxQxT.shape[0], heads, *s_BxGxNxQxT.shape[3:])


def expand_heads(x_BxGxQxT, heads: int):
  """``[B, G, Q, T] -> [B, H, Q, T]``: a per-key-head term read by each of its group's query heads."""
  return jnp.repeat(x_BxGxQxT, kv_group(heads, x_BxGxQxT.shape[1]), axis=1)


def choose_impl(impl: str, batch_heads: int, head_dim: int, index_BpxLxL) -> str:
  """How a relative-vector term is computed (:func:`query_term`): ``table`` unless the ``[B, H, L, 2k+1]``
  skew intermediate is smaller than the ``[Bp, L, L, K]`` gathered table."""
  if impl != "auto":
    return impl
  bp, l, _ = index_BpxLxL.shape
  return "table" if bp * l * head_dim <= batch_heads * (2 * l - 1) else "skew"


def contract_table(x_BxLxHxK, a_BpxLxLxK, spec_in: str):
  """``einsum(spec_in)`` with a gathered table whose batch may be 1 (then it is shared by the whole batch,
  and contracted without broadcasting it), accumulated in float32."""
  if a_BpxLxLxK.shape[0] == 1:
    return jnp.einsum(spec_in.replace(",bqk", ",qk"), x_BxLxHxK, a_BpxLxLxK[0], preferred_element_type=jnp.float32)
  return jnp.einsum(spec_in, x_BxLxHxK, a_BpxLxLxK, preferred_element_type=jnp.float32)


def rel_to_abs(x_BxHxLxD, index_BpxLxL):
  """``out[b, h, i, j] = x[b, h, i, index[b, i, j]]``: relative-distance columns to key positions (a gather
  along the distance axis; exact for any positions)."""
  b, h, l, _ = x_BxHxLxD.shape
  index_BxHxLxL = jnp.broadcast_to(index_BpxLxL[:, None], (b, h, l, index_BpxLxL.shape[-1]))
  return jnp.take_along_axis(x_BxHxLxD, index_BxHxLxL, axis=-1)


def query_term(q_BxLxHxK, w_DxK, index_BpxLxL, impl: str):
  """``[B, H, L, L]`` float32: ``q_i · w_{r(i,j)}`` (Shaw's key term, Method 4's query side), by the gathered
  ``table`` or the ``skew`` (:func:`choose_impl`); never a ``[B, H, L, L, K]`` tensor."""
  b, _, h, d = q_BxLxHxK.shape
  if choose_impl(impl, b * h, d, index_BpxLxL) == "table":
    return contract_table(q_BxLxHxK, jnp.take(w_DxK, index_BpxLxL, axis=0), "bqhd,bqkd->bhqk")
  return rel_to_abs(jnp.einsum("bqhd,rd->bhqr", q_BxLxHxK, w_DxK, preferred_element_type=jnp.float32),
                    index_BpxLxL)


def key_term(k_BxLxHxK, w_DxK, index_BpxLxL, impl: str):
  """``[B, H, L, L]``: ``w_{r(i,j)} · k_j`` (Method 4's key side), as :func:`query_term`."""
  b, _, h, d = k_BxLxHxK.shape
  if choose_impl(impl, b * h, d, index_BpxLxL) == "table":
    return contract_table(k_BxLxHxK, jnp.take(w_DxK, index_BpxLxL, axis=0), "bkhd,bqkd->bhqk")
  index_BpxLxL_T = index_BpxLxL.swapaxes(-1, -2)
  return rel_to_abs(jnp.einsum("bkhd,rd->bhkr", k_BxLxHxK, w_DxK, preferred_element_type=jnp.float32),
                    index_BpxLxL_T).swapaxes(-1, -2)


def untie_cls(corr_BxHxQxL, is_cls_BxL, theta_row_H, theta_col_H, is_cls_i_BxQ=None):
  """TUPE's [CLS] untying: [CLS] column := θ2, then [CLS] row := θ1 (so [CLS]->[CLS] is θ1), so the [CLS]
  token's positional correlation is learned apart from the others'. θ may be ``[B, H]`` or ``[H]``;
  ``is_cls_i_BxQ``: the query rows' flags where they are not all the keys' (default ``is_cls_BxL``)."""
  is_cls_i_BxQ = is_cls_BxL if is_cls_i_BxQ is None else is_cls_i_BxQ
  theta_row_BxHx1x1 = jnp.broadcast_to(theta_row_H, corr_BxHxQxL.shape[:2])[:, :, None, None]
  theta_col_BxHx1x1 = jnp.broadcast_to(theta_col_H, corr_BxHxQxL.shape[:2])[:, :, None, None]
  corr_BxHxQxL = jnp.where(is_cls_BxL[:, None, None, :], theta_col_BxHx1x1, corr_BxHxQxL)
  return jnp.where(is_cls_i_BxQ[:, None, :, None], theta_row_BxHx1x1, corr_BxHxQxL)


# ----------------------------------------------------------------------------------------------------------
# The terms (what a kernel call is given).


@flax.struct.dataclass
class Terms:
  """All position terms of one attention call (each None when absent)."""

  alibi: Alibi | None = None
  buckets: Buckets | None = None
  relative: Relative | None = None
  untied: Untied | None = None
  kerple: Kerple | None = None
  fire: Fire | None = None
  sandwich: Sandwich | None = None
  forget: Forget | None = None
  cope: Cope | None = None
  stick_breaking: StickBreaking | None = None
  sink: Sink | None = None  # a logit per head in each row's denominator (terms/sink.py): not a term of the tiles
  path: Path | None = None  # PaTH's Householder products in place of q·k (terms/path.py; the kernels: PathBlocks)
  open: tuple = ()  # open terms (posjax.kernels.term.Term, or bound to their inputs: term.Bound), applied in order

  def kernel_form(self) -> "Terms":
    """The terms as the kernels take them: the built-in terms that are open terms (:data:`OPEN_BUILTINS`) moved into
    ``open``, after the given ones (each adds to the score: their order among themselves changes no logit, only the
    compiled kernels: with the buckets before ALiBi, ALiBi + T5's dq kernel spills nothing on H100, 76 B after)."""
    terms = self
    if self.buckets is not None and self.untied is not None and self.untied.reset == "paper":
      # θ replaces the bucket term too on the [CLS] rows and columns: they read two appended zero entries
      table_NxH = self.buckets.table
      entries = table_NxH.shape[0]
      terms = terms.replace(buckets=self.buckets.replace(
          table=jnp.concatenate([table_NxH, jnp.zeros((2, table_NxH.shape[1]), table_NxH.dtype)]),
          cls_row=entries, cls_col=entries + 1))
    moved = tuple(getattr(terms, name) for name in OPEN_BUILTINS if getattr(terms, name) is not None)
    return terms.replace(**{name: None for name in OPEN_BUILTINS}, open=tuple(self.open) + moved)

  def empty(self) -> bool:
    """Whether no term is given."""
    return self.builtin_empty() and not self.open

  def builtin_empty(self) -> bool:
    """Whether no built-in term (a field of :data:`NAMES`) is given."""
    return all(getattr(self, name) is None for name in NAMES)

  def check(self, batch: int, num_heads: int, head_dim: int, length: int) -> None:
    """Shapes and options, with errors that say what was given and what is allowed."""
    for name in OPEN_BUILTINS:  # each checks itself (its own file)
      if getattr(self, name) is not None:
        getattr(self, name).check(batch, num_heads, head_dim, length)
    for t in self.open:
      if isinstance(t, term.Term):
        t.check(batch, num_heads, head_dim, length)
    if self.relative is not None:
      r = self.relative
      if r.max_distance < 1:
        raise ValueError(f"Relative.max_distance={r.max_distance} must be >= 1")
      if r.table.shape != (2 * r.max_distance + 1, head_dim):
        raise ValueError(f"relative table has shape {r.table.shape}; expected ({2 * r.max_distance + 1}, "
                         f"{head_dim}) for max_distance={r.max_distance}")
      if not (r.query or r.key):
        raise ValueError("Relative term with neither the query nor the key side")
      if r.window not in (None, True, False):
        raise ValueError(f"Relative.window={r.window!r}; allowed: None (choose), True, False")
      if r.impl not in ("table", "skew", "auto"):
        raise ValueError(f"Relative.impl={r.impl!r}; allowed: 'table', 'skew', 'auto'")
    if self.sink is not None:
      self.sink.check(num_heads)
    if self.path is not None:
      self.path.check(batch, num_heads, head_dim, length)
    if self.cope is not None and (jnp.ndim(self.cope.table) != 2 or jnp.shape(self.cope.table)[0] != head_dim):
      raise ValueError(f"Cope.table has shape {jnp.shape(self.cope.table)}; expected ({head_dim}, npos_max)")
    if self.stick_breaking is not None and not all(isinstance(getattr(self.stick_breaking, name), bool)
                                                   for name in ("attend_current", "remainder")):
      raise ValueError(f"StickBreaking's attend_current and remainder must be bools, got {self.stick_breaking}")
    if self.untied is not None:
      u = self.untied
      if u.reset not in RESETS:
        raise ValueError(f"Untied.reset={u.reset!r}; allowed: {list(RESETS)}")
      for name, x in (("u_q", u.u_q), ("u_k", u.u_k)):
        if x.ndim != 4 or x.shape[0] not in (1, batch) or x.shape[1:] != (length, num_heads, head_dim):
          raise ValueError(f"Untied.{name} has shape {x.shape}; expected ({batch} or 1, {length}, {num_heads}, "
                           f"{head_dim})")
      if u.reset != "none" and (u.theta is None or u.theta.shape != (2, num_heads)):
        raise ValueError(f"Untied.theta must have shape (2, {num_heads}) with reset={u.reset!r}")


def merge(*parts: Terms | None) -> Terms:
  """One :class:`Terms` from an encoder's and a layer's (each built-in term may come from one of them only; the open
  terms of each, in order)."""
  fields, open_terms = {}, ()
  for part in parts:
    if part is None:
      continue
    open_terms = open_terms + tuple(part.open)
    for name in NAMES:
      value = getattr(part, name)
      if value is not None:
        if name in fields:
          raise ValueError(f"two {name} terms given to one attention call")
        fields[name] = value
  return Terms(**fields, open=open_terms)


def bind_open(terms: Terms, positions_BxL, batch: int, heads: int, length: int) -> Terms:
  """``terms`` with each open term bound to its kernel inputs (:func:`posjax.kernels.term.bind`, checked)."""
  return terms.replace(open=tuple(term.bind(t, positions_BxL, batch, heads, length) for t in terms.open))


def as_terms(terms) -> Terms:
  """A call's :class:`Terms` from ``terms``: Terms, an open term (:class:`posjax.kernels.term.Term`), a sequence of
  either, or None. A sequence applies in its order: a ``Terms`` element's built-in terms that are open ones
  (:data:`OPEN_BUILTINS`) at its place (its own open terms first); the relative vectors, the untied term and a rule
  (one each) after every open term. Within one ``Terms``, its open terms come first, then its built-in ones."""
  if terms is None:
    return Terms()
  if isinstance(terms, Terms):
    return terms
  if isinstance(terms, (term.Term, term.Bound)):
    return Terms(open=(terms,))
  if isinstance(terms, (tuple, list)):
    parts = [as_terms(t) for t in terms]
    if len(parts) > 1:  # each element's built-in open terms at its place
      parts = [part.kernel_form() for part in parts]
    return merge(*parts)
  raise TypeError(f"terms={terms!r}; expected posjax.kernels.Terms, a posjax.kernels.Term, a sequence of them, or None")
