"""Flash attention in Pallas with the position terms built inside each tile: the GPU (Triton) kernels of the op's
``pallas`` implementation and their ``custom_vjp`` (TPU: :mod:`posjax.kernels.mosaic`; shared by both:
:mod:`posjax.kernels.tile`).

Grouped-query attention: k and v (and ``ke``) have a head per ``plan.group`` query heads; program (b, h) reads
head ``h // group`` through its BlockSpec's index map (no repeated copy), the ``dk/dv`` kernel writes each query
head's share, and the shares of a group are summed after it (a ``[B, H, L, K]`` float32 buffer in the backward).

Shapes: B batch, H heads, L padded length, K head dim, V value head dim, Q/T query/key tile rows, W window
rows (``2·block``), D relative-table rows (``2k+1``), N bucket entries, P tile diagonals, X any last axis.

Three Triton-style kernels over a ``(batch, head, tile)`` grid, each reading its (batch, head) rows and looping
over the other side's tiles that hold an allowed pair (:func:`posjax.kernels.tile.tile_ranges`, from the segment
ids at run time, computed once in the forward: none above the causal diagonal, outside the sliding window or in
another packed document): the forward (online softmax; saves each row's maximum and sum), the ``dq`` kernel
(one query tile against every key tile) and the ``dk/dv`` kernel (one key tile against every query tile). Every tile
recomputes its logits from the tile's positions, segment ids and the terms' small inputs
(:mod:`posjax.kernels.terms`), so no ``[B, H, L, L]`` array exists, forward or backward. This module holds the
``pallas_call`` plumbing and the ``custom_vjp``; the kernels' bodies are :mod:`posjax.kernels.triton_kernels`.

Gradients of the position inputs, all without atomics (deterministic):

- the open terms' inputs (:mod:`posjax.kernels.term`: ALiBi's slopes, the bucket table, KERPLE's ``r1, r2``, the
  forget gate's ``c``, a user's own), by kind, from the per-tile gradient derived by ``jax.vjp`` of the term's logits:
  a head's scalars and a table's entries as per-(batch, head, query tile) partial sums of the ``dq`` kernel (a
  lookup's entries scattered as below), the query and key sides of rows and embeddings as rows of the ``dq`` and
  ``dk/dv`` kernels (FIRE's MLP, ``c`` and threshold by its hand-written gradient); θ: per-tile
  partial sums too, by hand;
- TUPE's ``u_q`` / ``u_k``: rows of the ``dq`` / ``dk`` kernel, like ``dq`` / ``dk`` themselves;
- relative vectors, gathered (``Relative.window=False``): ``qe = scale q·a_r`` and ``ke = scale k·a_r``
  (``[B, H, L, 2k+1]``) are computed outside the kernel and gathered per tile; their gradients are rows of the
  ``dq`` / ``dk`` kernels, and ``dq += scale dqe·a``, ``da = scale (dqeᵀq + dkeᵀk)`` outside. ``O(L·k)`` memory:
  small for a clipped ``k``, ``O(L²)`` at ``k = max_len - 1``;
- relative vectors, windowed (``window=True``; ``O(L)`` for any ``k``): the table is laid out by distance
  (``[2L, K]``, clipped rows repeated), a tile (i0, j0) reads the ``2·block`` rows from ``j0 - i0 - block``
  and skews ``q_tile·windowᵀ`` (and ``k_tile·windowᵀ``) into its logits; ``dq`` / ``dk`` take the unskewed
  ``ds`` times the window inside their kernels, and a fourth kernel, one program per tile diagonal (whose
  tiles share a window), sums the window's gradient along the diagonal: per-(batch, head, diagonal) partials
  added by halves into the ``[2L, K]`` layout and folded back into the table (clipped ends summed).

Per-pair lookups (``qe``, ``ke``, an open term's table, the window's skew through a per-program scratch block) are
gather loads from refs (Triton lowers integer-array indexers to pointer gathers); the backward's scatter of a
pair's gradient to its distance or table entry adds into the program's own output block (``dqe`` / ``dke`` rows, the
table's partial sum) a chunk of entries at a time, looping only over the chunks the tile's entries reach:
a ``[bq, bk, chunk]`` one-hot summed per step (deterministic, exact for any positions; no batched matmul or
atomics), so registers, PTX and compile time do not grow with the table.

A context shard (``query_offset``, :func:`posjax.kernels.shard.per_context_shard`): q holds ``Q`` of the sequence's
rows from the offset, the keys the whole sequence; the query side's positions, segment ids, indices (``q_slots``,
for the causal mask, windows and dropout) and open-term rows come as arrays of their own
(:func:`posjax.kernels.tile.query_side`, as decoding's), the tile ranges are the share's
(:func:`posjax.kernels.tile.query_share`), and the query side's gradient rows are placed back at the offset.

Attention dropout: each tile rebuilds its mask from a hash of the (batch row, head) salt and the pair's indices
(:mod:`posjax.kernels.dropout`), in the forward and again in the backward; nothing is stored.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from posjax.kernels import path_blocks, term as term_lib
from posjax.kernels.terms import Terms, sink as sink_lib
from posjax.kernels.tile import (Plan, fold_window_table, group_sum, kv_head, overlap_add,
                                 place_rows, query_share, query_side, row_delta, tile_ranges, untied_grads,
                                 window_table)
from posjax.kernels.triton_kernels import decode_kernel, dkv_kernel, dq_kernel, forward_kernel, window_grad_kernel


# ----------------------------------------------------------------------------------------------------------
# pallas_call plumbing.

GROUPED = ("k", "v", "ke")  # inputs with a head per key/value head: query head h reads head h // plan.group


def row_spec(array_BxHxLxX, block: int | None = None, group: int = 1):
  """A ``[B, H, L, X]`` array: the program's (batch, head) rows, all of them or its tile of ``block``; ``group``:
  the array has a head per ``group`` query heads (grouped k/v), and query head h reads head ``h // group``."""
  if block is None:
    return pl.BlockSpec((1, 1, *array_BxHxLxX.shape[2:]), lambda b, h, i: (b, kv_head(h, group), 0, 0))
  return pl.BlockSpec((1, 1, block, *array_BxHxLxX.shape[3:]),
                      lambda b, h, i: (b, h, i, *[0] * (array_BxHxLxX.ndim - 3)))


def range_spec():
  """A ``[B, N, 2]`` tile range (:func:`posjax.kernels.tile.tile_ranges`): the program's tile's ``[lo, hi)``."""
  return pl.BlockSpec((1, 1, 2), lambda b, h, i: (b, i, 0))


def _batch_spec(array_BxL):
  return pl.BlockSpec((1, array_BxL.shape[1]), lambda b, h, i: (b, 0))


def _head_spec(array_HxX):
  return pl.BlockSpec((1, array_HxX.shape[1]), lambda b, h, i: (h, 0))


def kernel_inputs(plan: Plan, terms: Terms, q_BxHxLxK, k_BxHxLxK, v_BxHxLxV, positions_BxL, segment_ids_BxL, valid_BxL,
            salts_BxH, extra: dict):
  """Names, arrays and block specs of a kernel's inputs (whole rows; per-head parameter rows)."""
  inputs = {"q": q_BxHxLxK, "k": k_BxHxLxK, "v": v_BxHxLxV, **extra}
  specs = {name: row_spec(x_BxHxLxX, group=plan.group if name in GROUPED else 1)
           for name, x_BxHxLxX in inputs.items()}
  if plan.dropout:
    inputs["salts"], specs["salts"] = salts_BxH, pl.BlockSpec((1, 1), lambda b, h, i: (b, h))
  for name, x_BxL in (("positions", positions_BxL), ("segment_ids", segment_ids_BxL), ("valid", valid_BxL)):
    inputs[name], specs[name] = x_BxL, _batch_spec(x_BxL)
  if terms.untied is not None and terms.untied.reset != "none":
    inputs["theta_row"], inputs["theta_col"] = terms.untied.theta[0][:, None], terms.untied.theta[1][:, None]
  if terms.relative is not None and terms.relative.window:
    inputs["window_table"] = window_table(terms.relative, q_BxHxLxK.shape[2]).astype(q_BxHxLxK.dtype)
    specs["window_table"] = pl.BlockSpec(inputs["window_table"].shape, lambda b, h, i: (0, 0))
  for name in ("theta_row", "theta_col"):
    if name in inputs:
      specs[name] = _head_spec(inputs[name])
  if terms.path is not None:  # PaTH's band of dense logits (the copies of the keys come as k)
    inputs["band"], specs["band"] = terms.path.band, row_spec(terms.path.band)
  for key, (kind, x) in term_lib.kernel_arrays(terms.open).items():  # by kind: a head's row, or whole rows
    inputs[key] = x
    specs[key] = (_head_spec(x) if kind in (term_lib.HEAD, term_lib.TABLE) else row_spec(x) if x.ndim == 4
                  else pl.BlockSpec((1, 1, x.shape[2]), lambda b, h, i: (b, h, 0)))
  return inputs, specs


def add_query_inputs(inputs: dict, specs: dict, arrays: dict):
  """The queries' own arrays (a context shard's or a decoding step's, :func:`posjax.kernels.tile.query_side`):
  ``[B, Q]`` positions, segment ids and slots, and the open terms' query rows, whole for the program's (batch,
  head)."""
  for name, x in arrays.items():
    inputs[name] = x
    specs[name] = (_batch_spec(x) if x.ndim == 2 else
                   pl.BlockSpec((1, 1, *x.shape[2:]), lambda b, h, i, n=x.ndim: (b, h) + (0,) * (n - 2)))


def _pad_columns(x_HxX, size: int):
  return jnp.pad(x_HxX, ((0, 0), (0, size - x_HxX.shape[1])))


def call(kernel, plan: Plan, terms: Terms, inputs: dict, specs: dict, outputs: dict, out_specs: dict, tiles: int):
  """``{name: array}`` of ``outputs`` (name → ShapeDtypeStruct, ``out_specs`` their BlockSpecs) from ``kernel``
  over a ``(batch, head, tiles)`` grid, its inputs ``inputs`` read through ``specs`` (the windowed relative term's
  scratch block added)."""
  b, h = inputs["q"].shape[:2]
  if terms.relative is not None and terms.relative.window:
    block = plan.block_q
    outputs = {**outputs, "scratch": jax.ShapeDtypeStruct((b, h, tiles, block, 2 * block), jnp.float32)}
    out_specs = {**out_specs, "scratch": pl.BlockSpec((1, 1, 1, block, 2 * block),
                                                      lambda b, h, i: (b, h, i, 0, 0))}
  names = list(inputs) + list(outputs)
  results = pl.pallas_call(
      functools.partial(kernel, plan, terms, names),
      # Pallas's Triton backend (the default GPU backend of this jax is Mosaic GPU, which these kernels are not
      # written for)
      compiler_params=pltriton.CompilerParams(**compiler_params(plan, terms)),
      grid=(b, h, tiles),
      in_specs=[specs[n] for n in inputs],
      out_specs=[out_specs[n] for n in outputs],
      out_shape=[outputs[n] for n in outputs],
      interpret=plan.interpret,
      name=kernel.__name__.strip("_"),
  )(*inputs.values())
  return dict(zip(outputs, results))


def compiler_params(plan: Plan, terms: Terms) -> dict:
  """Triton's ``num_warps`` and ``num_stages`` (measured with ptxas for H100, bf16, K=64): 8 warps when the
  tile builds position terms or is larger than 64x64 (at 4 their ``[bq, bk]`` index and value tensors spill),
  4 otherwise. Windowed relative vectors take one stage: their tiles gather this program's scratch block right
  after storing it, which a software-pipelined (prefetched) load would read stale, and two stages of the
  window's operands fill 85-100% of the shared memory; so do two stages of float32 embeddings (an open term's
  :data:`~posjax.kernels.term.EMBEDDINGS`: Sandwich's, 88-92% at 64x64, ``dim=128``)."""
  plain = terms.empty() and plan.block_q * plan.block_k <= 64 * 64
  window = terms.relative is not None and bool(terms.relative.window)
  return {"num_warps": 4 if plain else 8,
          "num_stages": 1 if window or term_lib.embedding_width(terms.open) else 2}


def _per_head_rows(terms: Terms, q_BxHxQxK, k_BxHxLxK, scale: float, batch: int, query_offset=None) -> dict:
  """The ``[B, H, L, X]`` inputs computed outside the kernel: ``qe``/``ke`` and the broadcast ``u_q``/``u_k`` (a
  context shard's queries: ``u_q``'s rows of its share)."""
  extra = {}
  if terms.relative is not None and not terms.relative.window:
    table_DxK = terms.relative.table
    if terms.relative.query:
      extra["qe"] = scale * jnp.einsum("bhlk,rk->bhlr", q_BxHxQxK, table_DxK.astype(q_BxHxQxK.dtype),
                                       preferred_element_type=jnp.float32)
    if terms.relative.key:
      extra["ke"] = scale * jnp.einsum("bhlk,rk->bhlr", k_BxHxLxK, table_DxK.astype(k_BxHxLxK.dtype),
                                       preferred_element_type=jnp.float32)
  if terms.untied is not None:
    for name in ("u_q", "u_k"):
      u_BpxHxLxK = getattr(terms.untied, name).transpose(0, 2, 1, 3)
      if name == "u_q" and query_offset is not None:
        u_BpxHxLxK = jax.lax.dynamic_slice_in_dim(u_BpxHxLxK, query_offset, q_BxHxQxK.shape[2], axis=2)
      extra[name] = jnp.broadcast_to(u_BpxHxLxK, (batch, *u_BpxHxLxK.shape[1:]))
  return extra


def _forward(plan: Plan, leaves, q_BxHxLxK, k_BxHxLxK, v_BxHxLxV, positions_BxL, segment_ids_BxL, valid_BxL,
             salts_BxH, query_offset=None):
  terms = plan.terms(leaves)
  b, h, l, _ = q_BxHxLxK.shape  # l: the queries (a context shard's, from query_offset; else the sequence)
  extra = _per_head_rows(terms, q_BxHxLxK, k_BxHxLxK, plan.scale, b, query_offset)
  inputs, specs = kernel_inputs(plan, terms, q_BxHxLxK, k_BxHxLxK, v_BxHxLxV, positions_BxL, segment_ids_BxL,
                          valid_BxL, salts_BxH, extra)
  ranges = tile_ranges(plan, segment_ids_BxL, valid_BxL)  # the backward's too
  if query_offset is not None:
    add_query_inputs(inputs, specs, query_side(terms.open, positions_BxL, segment_ids_BxL, query_offset, l))
    ranges = query_share(ranges, query_offset, l, plan.block_q)
  inputs["tiles"], specs["tiles"] = ranges[0], range_spec()
  out = call(forward_kernel, plan, terms, inputs, specs,
              {"out": jax.ShapeDtypeStruct((b, h, l, v_BxHxLxV.shape[-1]), v_BxHxLxV.dtype),
               "row_max": jax.ShapeDtypeStruct((b, h, l), jnp.float32),
               "row_sum": jax.ShapeDtypeStruct((b, h, l), jnp.float32)},
              {"out": row_spec(v_BxHxLxV, plan.block_q),
               "row_max": pl.BlockSpec((1, 1, plan.block_q), lambda b, h, i: (b, h, i)),
               "row_sum": pl.BlockSpec((1, 1, plan.block_q), lambda b, h, i: (b, h, i))},
              l // plan.block_q)
  out_BxHxLxV, row_max_BxHxL, row_sum_BxHxL = out["out"], out["row_max"], out["row_sum"]
  if terms.sink is not None:  # the rows' statistics take the sink; the backward recomputes its weights from them
    out_BxHxLxV, row_max_BxHxL, row_sum_BxHxL = sink_lib.rescale(terms.sink, out_BxHxLxV, row_max_BxHxL,
                                                                 row_sum_BxHxL)
  return out_BxHxLxV, ((row_max_BxHxL, row_sum_BxHxL), extra, ranges)


def default_block_sizes(terms: Terms, length: int, head_dim: int) -> tuple[int, int]:
  """The (query, key) tile when the caller gives none, from ptxas for H100 (bf16, K=64, L=512 and 2048): 128x64
  without position terms (no spills, at most 43% of the shared memory), 64x64 with any (at 128x64 ALiBi + T5's
  dq spills; at 128x128 the window's kernels spill 3-5 KB at 78-85% of the shared memory). Embeddings (an open
  term's: Sandwich's) wider than 128 take smaller tiles: their float32 operands pass the shared memory at 64x64.
  The rules that replace the softmax choose their own (:mod:`posjax.kernels.rules`)."""
  del head_dim
  width = term_lib.embedding_width(terms.kernel_form().open, length)
  if width > 128:
    return (32, 32) if width <= 256 else (16, 16)
  return (128, 64) if terms.empty() else (64, 64)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def attention(plan: Plan, leaves, q_BxHxLxK, k_BxHxLxK, v_BxHxLxV, positions_BxL, segment_ids_BxL, valid_BxL,
              salts_BxH, query_offset=None):
  """``[B, H, L, V]`` attention of ``[B, H, L, K]`` inputs (L a multiple of both blocks) on GPU; ``leaves``: the
  Terms' arrays (``plan.treedef``); ``salts``: ``[B, H]`` int32, the dropout masks' (unread without dropout).
  ``query_offset`` (an int32 scalar, a multiple of ``plan.block_q``): q holds a context shard's ``Q`` queries, the
  sequence's rows from the offset, against the whole sequence's ``L`` keys; ``[B, H, Q, V]``."""
  return _forward(plan, leaves, q_BxHxLxK, k_BxHxLxK, v_BxHxLxV, positions_BxL, segment_ids_BxL, valid_BxL,
                  salts_BxH, query_offset)[0]


def _attention_fwd(plan, leaves, q_BxHxLxK, k_BxHxLxK, v_BxHxLxV, positions_BxL, segment_ids_BxL, valid_BxL,
                   salts_BxH, query_offset=None):
  out_BxHxLxV, (stats, extra, ranges) = _forward(plan, leaves, q_BxHxLxK, k_BxHxLxK, v_BxHxLxV, positions_BxL,
                                                 segment_ids_BxL, valid_BxL, salts_BxH, query_offset)
  return out_BxHxLxV, (leaves, q_BxHxLxK, k_BxHxLxK, v_BxHxLxV, positions_BxL, segment_ids_BxL, valid_BxL,
                       salts_BxH, query_offset, out_BxHxLxV, stats, extra, ranges)


def _attention_bwd(plan, residuals, d_out_BxHxLxV):
  (leaves, q_BxHxLxK, k_BxHxLxK, v_BxHxLxV, positions_BxL, segment_ids_BxL, valid_BxL, salts_BxH, query_offset,
   out_BxHxLxV, (row_max_BxHxL, row_sum_BxHxL), extra, (key_tiles_BxNx2, query_tiles_BxMx2)) = residuals
  terms = plan.terms(leaves)
  b, h, l, d = q_BxHxLxK.shape  # l: the queries; keys: v's length (k: PaTH's copies, n of them)
  t = v_BxHxLxV.shape[2]
  n_q, n_k = l // plan.block_q, t // plan.block_k
  delta_BxHxL = row_delta(d_out_BxHxLxV, out_BxHxLxV)
  inputs, specs = kernel_inputs(plan, terms, q_BxHxLxK, k_BxHxLxK, v_BxHxLxV, positions_BxL, segment_ids_BxL,
                          valid_BxL, salts_BxH, {**extra, "d_out": d_out_BxHxLxV})
  if query_offset is not None:
    add_query_inputs(inputs, specs, query_side(terms.open, positions_BxL, segment_ids_BxL, query_offset, l))
  inputs.update(row_max=row_max_BxHxL, row_sum=row_sum_BxHxL, delta=delta_BxHxL)
  for name in ("row_max", "row_sum", "delta"):
    specs[name] = pl.BlockSpec((1, 1, l), lambda b, h, i: (b, h, 0))
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  partial_spec = lambda n: pl.BlockSpec((1, 1, 1, n), lambda b, h, i: (b, h, i, 0))

  dq_out, dq_specs = {"dq": f32(b, h, l, d)}, {"dq": row_spec(q_BxHxLxK, plan.block_q)}
  if "qe" in extra:
    dq_out["dqe"], dq_specs["dqe"] = f32(*extra["qe"].shape), row_spec(extra["qe"], plan.block_q)
  if terms.untied is not None:
    dq_out["du_q"], dq_specs["du_q"] = f32(b, h, l, d), row_spec(q_BxHxLxK, plan.block_q)
    if terms.untied.reset != "none":
      for name in ("dtheta_row", "dtheta_col"):
        dq_out[name], dq_specs[name] = f32(b, h, n_q, 1), partial_spec(1)
  rows_spec = lambda block: pl.BlockSpec((1, 1, block), lambda b, h, i: (b, h, i))
  for key, (kind, x) in term_lib.kernel_arrays(terms.open, trainable=True).items():
    if kind in (term_lib.HEAD, term_lib.TABLE):  # partial sums per query tile
      dq_out["d" + key], dq_specs["d" + key] = f32(b, h, n_q, x.shape[-1]), partial_spec(x.shape[-1])
    elif kind == term_lib.ROWS:
      dq_out["d" + key + "@q"], dq_specs["d" + key + "@q"] = f32(b, h, l), rows_spec(plan.block_q)
    else:
      dq_out["d" + key + "@q"], dq_specs["d" + key + "@q"] = f32(b, h, l, x.shape[-1]), row_spec(x, plan.block_q)
  if terms.path is not None:
    dq_out["dband"], dq_specs["dband"] = f32(*terms.path.band.shape), row_spec(terms.path.band, plan.block_q)
  dq_res = call(dq_kernel, plan, terms, {**inputs, "tiles": key_tiles_BxNx2}, {**specs, "tiles": range_spec()},
                 dq_out, dq_specs, n_q)

  dkv_out = {"dk": f32(b, h, t, d), "dv": f32(b, h, t, v_BxHxLxV.shape[-1])}
  dkv_specs = {"dk": row_spec(k_BxHxLxK, plan.block_k), "dv": row_spec(v_BxHxLxV, plan.block_k)}
  if terms.path is not None:  # each copy's rows of the key tile
    copies = k_BxHxLxK.shape[2] // t
    dkv_out["dk"] = f32(b, h, copies, t, d)
    dkv_specs["dk"] = pl.BlockSpec((1, 1, copies, plan.block_k, d), lambda b, h, j: (b, h, 0, j, 0))
  if "ke" in extra:
    dkv_out["dke"] = f32(b, h, t, extra["ke"].shape[-1])
    dkv_specs["dke"] = row_spec(dkv_out["dke"], plan.block_k)
  if terms.untied is not None:
    dkv_out["du_k"], dkv_specs["du_k"] = f32(b, h, t, d), row_spec(k_BxHxLxK, plan.block_k)
  for key, (kind, x) in term_lib.kernel_arrays(terms.open, trainable=True).items():
    if kind == term_lib.ROWS:
      dkv_out["d" + key + "@k"], dkv_specs["d" + key + "@k"] = f32(b, h, t), rows_spec(plan.block_k)
    elif kind == term_lib.EMBEDDINGS:
      dkv_out["d" + key + "@k"], dkv_specs["d" + key + "@k"] = f32(*x.shape), row_spec(x, plan.block_k)
  dkv_res = call(dkv_kernel, plan, terms, {**inputs, "tiles": query_tiles_BxMx2}, {**specs, "tiles": range_spec()},
                  dkv_out, dkv_specs, n_k)

  if terms.path is not None:
    dq_res["dband"], dkv_res["dk"] = path_blocks.visited_grads(plan, terms.path.size, dq_res["dband"], dkv_res["dk"],
                                                               key_tiles_BxNx2, query_tiles_BxMx2)
  # written per query head; a shared key/value head's gradient is the sum over its group
  dkv_res.update({name: group_sum(dkv_res[name], plan.group) for name in ("dk", "dv", "dke") if name in dkv_res})
  dq_BxHxLxK, dk_BxHxLxK, dv_BxHxLxV = dq_res["dq"], dkv_res["dk"], dkv_res["dv"]
  d_terms = jax.tree.map(jnp.zeros_like, terms)
  if terms.relative is not None and terms.relative.window:
    d_window_BxHxPxWxK = call(
        window_grad_kernel, plan, terms, inputs, specs,
        {"d_window": f32(b, h, n_q + n_k - 1, 2 * plan.block_q, d)},
        {"d_window": pl.BlockSpec((1, 1, 1, 2 * plan.block_q, d), lambda b, h, i: (b, h, i, 0, 0))},
        n_q + n_k - 1)["d_window"]
    d_table_DxK = fold_window_table(overlap_add(jnp.sum(d_window_BxHxPxWxK, axis=(0, 1)), plan.block_q),
                                    terms.relative, l)
    d_terms = d_terms.replace(relative=d_terms.relative.replace(
        table=d_table_DxK.astype(terms.relative.table.dtype)))
  elif terms.relative is not None:
    table_DxK = terms.relative.table.astype(jnp.float32)
    d_table_DxK = jnp.zeros_like(table_DxK)
    if "dqe" in dq_res:
      dqe_BxHxLxD = dq_res["dqe"]
      dq_BxHxLxK = dq_BxHxLxK + plan.scale * jnp.einsum("bhlr,rk->bhlk", dqe_BxHxLxD, table_DxK)
      d_table_DxK = d_table_DxK + plan.scale * jnp.einsum("bhlr,bhlk->rk", dqe_BxHxLxD,
                                                          q_BxHxLxK.astype(jnp.float32))
    if "dke" in dkv_res:
      dke_BxHxLxD = dkv_res["dke"]
      dk_BxHxLxK = dk_BxHxLxK + plan.scale * jnp.einsum("bhlr,rk->bhlk", dke_BxHxLxD, table_DxK)
      d_table_DxK = d_table_DxK + plan.scale * jnp.einsum("bhlr,bhlk->rk", dke_BxHxLxD,
                                                          k_BxHxLxK.astype(jnp.float32))
    d_terms = d_terms.replace(relative=d_terms.relative.replace(
        table=d_table_DxK.astype(terms.relative.table.dtype)))
  if query_offset is not None:  # the share's query rows of the whole sequence's inputs
    dq_res.update({name: place_rows(x, query_offset, t) for name, x in dq_res.items()
                   if name == "du_q" or name.endswith("@q")})
  if terms.untied is not None:
    untied = untied_grads(terms.untied, dq_res["du_q"], dkv_res["du_k"])
    if "dtheta_row" in dq_res:
      d_theta_2xH = jnp.stack([jnp.sum(dq_res[name], axis=(0, 2, 3)) for name in ("dtheta_row", "dtheta_col")])
      untied = untied.replace(theta=d_theta_2xH.astype(terms.untied.theta.dtype))
    d_terms = d_terms.replace(untied=untied)
  d_terms = d_terms.replace(open=term_lib.gradients(terms.open, {**dq_res, **dkv_res}))
  if terms.sink is not None:
    d_terms = d_terms.replace(sink=sink_lib.gradient(terms.sink, row_max_BxHxL, row_sum_BxHxL, delta_BxHxL))
  if terms.path is not None:
    d_terms = d_terms.replace(path=terms.path.replace(band=dq_res["dband"]))
  d_leaves = jax.tree_util.tree_leaves(d_terms)
  return (d_leaves, dq_BxHxLxK.astype(q_BxHxLxK.dtype), dk_BxHxLxK.astype(k_BxHxLxK.dtype),
          dv_BxHxLxV.astype(v_BxHxLxV.dtype), None, None, None, None, None)


attention.defvjp(_attention_fwd, _attention_bwd)


def decode(plan: Plan, leaves, q_BxHxQxK, k_BxGxTxK, v_BxGxTxV, q_positions_BxQ, q_slots_BxQ, positions_BxT, valid_BxT,
           ranges_BxNx2):
  """Decoding on GPU (:func:`posjax.kernels.decode.decode_attention`): ``[B, H, Q, V]`` float32 for ``Q`` queries
  (a multiple of ``plan.block_q``) at cache slots ``q_slots`` against a cache of ``T`` slots (a multiple of
  ``plan.block_k``); ``ranges``: each query tile's key tiles. ``plan.splits`` programs share a query tile's key
  tiles (flash decoding), each writing unnormalised rows with their maximum and sum, combined here."""
  terms = plan.terms(leaves)
  b, h, q, _ = q_BxHxQxK.shape
  n_q, splits = q // plan.block_q, plan.splits
  inputs, specs = kernel_inputs(plan, terms, q_BxHxQxK, k_BxGxTxK, v_BxGxTxV, positions_BxT,
                                jnp.zeros_like(positions_BxT), valid_BxT, None, {})
  add_query_inputs(inputs, specs, {"q_positions": q_positions_BxQ, "q_slots": q_slots_BxQ,  # one document
                                   **term_lib.query_rows(terms.open, q_slots_BxQ)})
  inputs["tiles"], specs["tiles"] = ranges_BxNx2, pl.BlockSpec((1, 1, 2), lambda b, h, x: (b, x // splits, 0))
  value_dim = v_BxGxTxV.shape[-1]
  stats = lambda: (jax.ShapeDtypeStruct((b, h, splits, q), jnp.float32),
                   pl.BlockSpec((1, 1, 1, plan.block_q), lambda b, h, x: (b, h, x % splits, x // splits)))
  (out, out_spec), (row_max, max_spec), (row_sum, sum_spec) = (
      (jax.ShapeDtypeStruct((b, h, splits, q, value_dim), jnp.float32),
       pl.BlockSpec((1, 1, 1, plan.block_q, value_dim), lambda b, h, x: (b, h, x % splits, x // splits, 0))),
      stats(), stats())
  res = call(decode_kernel, plan, terms, inputs, specs, {"out": out, "row_max": row_max, "row_sum": row_sum},
              {"out": out_spec, "row_max": max_spec, "row_sum": sum_spec}, n_q * splits)
  # the splits combined: each split's rows rescaled to the overall maximum (a split without tiles weighs 0)
  overall_BxHx1xQ = jnp.max(res["row_max"], axis=2, keepdims=True)
  if terms.sink is not None:  # the sink in every row's denominator, once
    sink_1xHx1x1 = terms.sink.logits.astype(jnp.float32)[None, :, None, None]
    overall_BxHx1xQ = jnp.maximum(overall_BxHx1xQ, sink_1xHx1x1)
  weight_BxHxSxQ = jnp.exp(res["row_max"] - overall_BxHx1xQ)
  total_BxHxQ = jnp.sum(weight_BxHxSxQ * res["row_sum"], axis=2)
  if terms.sink is not None:
    total_BxHxQ = total_BxHxQ + jnp.exp(sink_1xHx1x1 - overall_BxHx1xQ)[:, :, 0]
  return jnp.sum(weight_BxHxSxQ[..., None] * res["out"], axis=2) / total_BxHxQ[..., None]
