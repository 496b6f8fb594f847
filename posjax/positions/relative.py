"""Shaw et al. (2018) relative embeddings and Huang et al. (2020) Methods 1-4.

Logit of each method, before the ``1/sqrt(d_h)`` that scales the whole sum (Huang et al. 2020, §3;
Shaw et al. 2018, §3); ``r = clip(j - i, -k, k)`` is the clipped relative distance (key minus query):

| method     | logit                                   | table                      | init |
|------------|-----------------------------------------|----------------------------|------|
| shaw       | q_i·k_j + q_i·w_r  (+ value term)        | ``key``  [2k+1, d_h]       | N(0, 0.02) |
| huang_m1   | (q_i·k_j) · w_{|r|, h}                  | ``scalar`` [k+1, H]        | 1    |
| huang_m2   | (q_i·k_j) · w_{r, h}                    | ``scalar`` [2k+1, H]       | 1    |
| huang_m3   | Σ_l (q_i)_l (k_j)_l (w_r)_l             | ``vector`` [2k+1, d_h]     | 1    |
| huang_m4   | q_i·k_j + q_i·w_r + w_r·k_j             | ``key`` [2k+1, d_h]        | N(0, 0.02) |

Shaw's value term adds ``Σ_j α_ij w^V_r`` to the output (``value`` table). Vector tables are shared by
all heads and used on both the query and key side (as Hugging Face's ``relative_key_query``); the scalar
tables of Methods 1-2 hold one scalar per head, and the multiplicative tables start at 1 so an untrained
model is plain dot-product attention (both details are [unconfirmed] in the paper). One table per layer by
default, ``share_across_layers=True`` for one for the whole encoder. Hugging Face indexes its table by
``i - j``: reverse the rows when converting its checkpoints.

Two exact implementations of the vector terms, never a ``[B, H, L, L, d_h]`` tensor:

- ``table``: gather the ``[Bp, L, L, d_h]`` table of relative vectors, contract it with q (or k);
- ``skew``: contract q with the ``2k+1`` distinct vectors (``[B, H, L, 2k+1]``), then move each row
  from relative to absolute key positions with a gather along the distance axis (exact for any positions,
  packed ones included).

``impl='auto'`` picks the one whose intermediate is smaller: ``table`` at BERT-Base training shapes,
``skew`` for long sequences with few heads·batch.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from posjax import kernels
from posjax.kernels.terms import choose_impl, clipped_index, contract_table
from posjax.positions import base


@dataclasses.dataclass(frozen=True)
class RelativeOptions:
  """max_distance: k, the clipping distance (None: max_len - 1); longer distances share the last row.
  share_across_layers: one table for the whole encoder instead of one per layer (default False).
  """

  max_distance: int | None = None
  share_across_layers: bool = False

  def __post_init__(self):
    if self.max_distance is not None and self.max_distance < 1:
      raise ValueError(f"max_distance={self.max_distance} must be >= 1 (or None for max_len - 1)")


@dataclasses.dataclass(frozen=True)
class VectorOptions(RelativeOptions):
  """impl: ``auto`` (by shape) | ``table`` | ``skew`` — how the vector terms are computed."""

  impl: str = "auto"

  def __post_init__(self):
    super().__post_init__()
    base.check_choice("impl", self.impl, ("auto", "table", "skew"))


@dataclasses.dataclass(frozen=True)
class ShawOptions(VectorOptions):
  """value_term: also add ``Σ_j α_ij w^V_r`` to the output (Shaw's second table; default False)."""

  value_term: bool = False


def max_distance(spec: base.PositionSpec) -> int:
  """k, the clipping distance: the option, or ``max_len - 1`` (no clipping within the model's length)."""
  k = spec.options.max_distance
  return spec.max_len - 1 if k is None else k


def _vector(k, spec):
  return (2 * k + 1, spec.head_dim)


TABLES: dict[str, Callable[[base.PositionSpec, int], dict]] = {
    "shaw": lambda spec, k: {
        "key": (_vector(k, spec), base.normal_init((base.RELATIVE, base.KV))),
        **({"value": (_vector(k, spec), base.normal_init((base.RELATIVE, base.KV)))}
           if spec.options.value_term else {})},
    "huang_m1": lambda spec, k: {"scalar": ((k + 1, spec.num_heads), base.ones_init((base.RELATIVE, base.HEADS)))},
    "huang_m2": lambda spec, k: {"scalar": ((2 * k + 1, spec.num_heads), base.ones_init((base.RELATIVE, base.HEADS)))},
    "huang_m3": lambda spec, k: {"vector": (_vector(k, spec), base.ones_init((base.RELATIVE, base.KV)))},
    "huang_m4": lambda spec, k: {"key": (_vector(k, spec), base.normal_init((base.RELATIVE, base.KV)))},
}


def make_tables(module: nn.Module, spec: base.PositionSpec) -> dict[str, jax.Array]:
  """The method's learned tables (:data:`TABLES`) as parameters of ``module``, cast to the compute dtype."""
  k = max_distance(spec)
  return {name: module.param(name, init, shape, spec.param_dtype).astype(spec.dtype)
          for name, (shape, init) in TABLES[spec.name](spec, k).items()}


# ----------------------------------------------------------------------------------------------------------
# The vector terms: Σ_d x_{b,i,h,d} · w_{r(b,i,j), d} for x = q (query side) or x = k (key side):
# query_term and key_term (with choose_impl) are posjax.kernels.terms'; the value term is Shaw's alone.


def value_term(weights_BxHxLxL, w_RxK, index_BpxLxL, impl: str):
  """``[B, L, H, K]``: ``Σ_j α_ij w_{r(i,j)}``."""
  b, h, l, _ = weights_BxHxLxL.shape
  w_RxK = w_RxK.astype(weights_BxHxLxL.dtype)
  if choose_impl(impl, b * h, w_RxK.shape[-1], index_BpxLxL) == "table":
    return contract_table(weights_BxHxLxL, jnp.take(w_RxK, index_BpxLxL, axis=0), "bhqk,bqkd->bqhd")
  index = jnp.broadcast_to(index_BpxLxL[:, None], weights_BxHxLxL.shape)
  bi, hi, qi, _ = jnp.indices(weights_BxHxLxL.shape, sparse=True)
  per_distance = jnp.zeros((b, h, l, w_RxK.shape[0]), weights_BxHxLxL.dtype)
  per_distance = per_distance.at[bi, hi, qi, index].add(weights_BxHxLxL)
  return jnp.einsum("bhqr,rd->bqhd", per_distance, w_RxK)


def triple_product(q_BxLxHxK, k_BxLxHxK, a_BpxLxLxK):
  """``Σ_d q_{i,d} k_{j,d} a_{i,j,d}`` float32, accumulated one feature at a time (no 5-D intermediate; each step
  is rematerialised in the backward pass so the per-feature products are not stored either); the products and
  the sum in float32 whatever the inputs' dtype."""

  @jax.checkpoint
  def step(acc, qka):
    q_BxLxH, k_BxLxH, a_BpxLxL = qka
    qk_BxHxLxL = jnp.einsum("bqh,bkh->bhqk", q_BxLxH, k_BxLxH, preferred_element_type=jnp.float32)
    return acc + qk_BxHxLxL * a_BpxLxL[:, None].astype(jnp.float32), None

  b, l, h, _ = q_BxLxHxK.shape
  acc = jnp.zeros((b, h, l, k_BxLxHxK.shape[1]), jnp.float32)
  feature_first = lambda x: jnp.moveaxis(x, -1, 0)
  acc, _ = jax.lax.scan(step, acc, (feature_first(q_BxLxHxK), feature_first(k_BxLxHxK),
                                    feature_first(a_BpxLxLxK)))
  return acc


# ----------------------------------------------------------------------------------------------------------
# Each method's terms, in one place.


def _per_head(table_RxH, index_BpxLxL):
  return jnp.take(table_RxH, index_BpxLxL, axis=0).transpose(0, 3, 1, 2)


def shaw(spec, q, k, positions, tables, scale):
  """Shaw et al.: the ``q_i·w_r`` term (a kernel term), and optionally the value term (the ``xla`` path alone)."""
  kk, impl = max_distance(spec), spec.options.impl
  terms = kernels.Terms(relative=kernels.Relative(tables["key"], kk, query=True, impl=impl))
  if not spec.options.value_term:
    return base.LayerTerms(q, k, terms=terms)
  index = clipped_index(base.relative_positions(positions), kk)
  return base.DenseLayerTerms(q, k, terms=terms, value_fn=lambda weights: value_term(weights, tables["value"], index,
                                                                                       impl))


def huang_m1(spec, q, k, positions, tables, scale):
  """Method 1: ``(q·k) · w_{|r|, h}`` replaces the logits (multiplicative: dense, the ``xla`` path alone)."""
  index = jnp.minimum(jnp.abs(base.relative_positions(positions)), max_distance(spec))
  return base.DenseLayerTerms(q, k, logits=scale * base.dot_heads(q, k) * _per_head(tables["scalar"], index))


def huang_m2(spec, q, k, positions, tables, scale):
  """Method 2: ``(q·k) · w_{r, h}`` replaces the logits (multiplicative: dense, the ``xla`` path alone)."""
  index = clipped_index(base.relative_positions(positions), max_distance(spec))
  return base.DenseLayerTerms(q, k, logits=scale * base.dot_heads(q, k) * _per_head(tables["scalar"], index))


def huang_m3(spec, q, k, positions, tables, scale):
  """Method 3: ``Σ_l q_l k_l (w_r)_l`` replaces the logits (dense, the ``xla`` path alone)."""
  a = jnp.take(tables["vector"], clipped_index(base.relative_positions(positions), max_distance(spec)), axis=0)
  k = jnp.repeat(k, q.shape[2] // k.shape[2], axis=2)  # grouped keys: the dense path's triple product, per query head
  return base.DenseLayerTerms(q, k, logits=scale * triple_product(q, k, a))


def huang_m4(spec, q, k, positions, tables, scale):
  """Method 4: ``q·w_r + w_r·k`` added to the content logits (:class:`posjax.kernels.Relative`, both sides)."""
  relative = kernels.Relative(tables["key"], max_distance(spec), query=True, key=True, impl=spec.options.impl)
  return base.LayerTerms(q, k, terms=kernels.Terms(relative=relative))


TERMS = {"shaw": shaw, "huang_m1": huang_m1, "huang_m2": huang_m2, "huang_m3": huang_m3, "huang_m4": huang_m4}


@flax.struct.dataclass(kw_only=True)
class RelativeState(base.PositionState):
  """The relative methods' state: the positions, and the tables when one set serves every layer
  (``share_across_layers=True``; else None)."""

  tables: dict | None = None


class RelativeTables(nn.Module):
  """Encoder-level part: the tables, when shared by every layer."""

  spec: base.PositionSpec

  @nn.compact
  def __call__(self, positions_BxL):
    base.check_rows("positions", positions_BxL)
    shared = make_tables(self, self.spec) if self.spec.options.share_across_layers else None
    return RelativeState(positions=positions_BxL, tables=shared)


class RelativeLayer(nn.Module):
  """Per-layer part: the method's terms from this layer's q, k and its (or the shared) tables."""

  spec: base.PositionSpec

  @nn.compact
  def __call__(self, q, k, state: RelativeState, scale):
    tables = state.tables if self.spec.options.share_across_layers else make_tables(self, self.spec)
    return TERMS[self.spec.name](self.spec, q, k, state.positions, tables, scale)


def _register(name, options, summary, *aliases):
  base.register(base.Method(name, options, encoder=RelativeTables, layer=RelativeLayer, summary=summary), *aliases)


_register("shaw", ShawOptions, "Shaw et al. 2018: q_i·w_{j-i} key term (value term optional)", "relative_key")
_register("huang_m1", RelativeOptions, "Huang et al. 2020 Method 1: (q·k) · w_|j-i|")
_register("huang_m2", RelativeOptions, "Huang et al. 2020 Method 2: (q·k) · w_{j-i}")
_register("huang_m3", RelativeOptions, "Huang et al. 2020 Method 3: Σ_l q_l k_l (w_{j-i})_l")
_register("huang_m4", VectorOptions, "Huang et al. 2020 Method 4: q·k + q·w_{j-i} + w_{j-i}·k", "relative_key_query")
