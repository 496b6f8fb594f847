"""Fused attention with the position terms computed inside the kernel: :func:`relative_attention`.

A term is its logits per tile (:class:`Term`, :mod:`posjax.kernels.term`): a researcher's own term runs fused on both
Pallas backends, with its gradient derived per tile, and so do the built-in ALiBi, buckets, KERPLE, Sandwich and
forget gate (:mod:`posjax.kernels.terms`).

One op for every method a kernel can compute: ALiBi, T5 buckets (and TUPE-R's bucket term), TUPE's untied
term with its [CLS] reset, Shaw / Method 4 relative vectors, KERPLE, FIRE, Sandwich, the Forgetting Transformer's
gate, PaTH's Householder products (in blocks: a band of dense logits, copies of the keys,
:class:`posjax.kernels.terms.path.PathBlocks`), and the rules on the masked logits (CoPE's term, stick-breaking's
weights: their kernels walk each query tile's key tiles from the diagonal back); RoPE and the absolute methods only
change q and k before the call. The terms (:mod:`posjax.kernels.terms`) are built in each tile from the batch's
positions and segment ids, so packed rows are exact and no ``[B, H, L, L]`` array is stored for the backward pass.

Implementations: ``pallas`` — Triton kernels on GPU (:mod:`posjax.kernels.triton`, their bodies in
:mod:`posjax.kernels.triton_kernels`), Mosaic kernels on TPU (:mod:`posjax.kernels.mosaic`), both built on
:mod:`posjax.kernels.tile`; on a CPU either runs in its Pallas interpreter: slow, for tests and for checking a
model — and ``xla`` (:mod:`posjax.kernels.xla`, dense; the reference).

Grouped-query attention (Ainslie et al. 2023) and multi-query attention: k and v may have G heads dividing q's H;
query head h reads key/value head ``h // (H / G)`` (an index map in the kernels, a grouped product on the ``xla``
path: no repeated k/v), and a shared head's gradients are the sums over its group.

Tiles without an allowed pair are not computed, forward or backward: above the causal diagonal, outside the sliding
window, between different packed documents (the tile ranges come from the segment ids at run time,
:func:`posjax.kernels.tile.tile_ranges`).

Shapes: B batch, L length, H heads, G key/value heads, K head dim, V value head dim, P padded length (a multiple of
the tiles), X any last axis, S any shape.

The package depends on no position method: the formulas the terms stand for are :mod:`posjax.kernels.terms`',
which the position methods import from it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from posjax.kernels import dropout as dropout_lib
from posjax.kernels import capability, decode, exact, fold, mosaic, shard, tile, triton, xla
from posjax.kernels.rules import cope_gpu, cope_tpu, stick_breaking_gpu, stick_breaking_tpu
from posjax.kernels.term import EMBEDDINGS, HEAD, KINDS, ROWS, TABLE, Term, View
from posjax.kernels.decode import decode_attention
from posjax.kernels.exact import fall_back_where
from posjax.kernels.shard import per_shard
from posjax.kernels.fold import UNTIED, fold_untied
from posjax.kernels.terms import path as path_lib
from posjax.kernels.terms import (WEIGHT_RULES, Alibi, Buckets, Cope, Fire, Forget, Kerple, Path, Relative,
                                  Sandwich, Sink, SoftCap, StickBreaking, Terms, Untied, as_terms, bind_open,
                                  check_rows, kv_group, merge)

IMPLEMENTATIONS = ("pallas", "xla")
PLATFORMS = tile.PLATFORMS
__all__ = ["relative_attention", "decode_attention", "Terms", "Term", "View", "HEAD", "ROWS", "TABLE", "EMBEDDINGS",
           "KINDS", "Alibi", "Buckets", "Relative", "Untied", "Kerple", "Fire", "Sandwich", "Forget", "Cope",
           "StickBreaking", "SoftCap", "Sink", "Path", "merge", "fold_untied", "fall_back_where", "default_block_sizes",
           "IMPLEMENTATIONS", "PLATFORMS", "UNTIED"]


RULE_KERNELS = {"cope": (cope_gpu, cope_tpu), "stick_breaking": (stick_breaking_gpu, stick_breaking_tpu)}


def with_rule(terms: Terms, rule) -> Terms:
  """``terms`` with ``rule`` (None: the softmax) in its field; a second rule is an error."""
  if rule is None:
    return terms
  if not isinstance(rule, (Cope, StickBreaking)):
    raise TypeError(f"rule={rule!r}; allowed: None (the softmax), posjax.kernels.Cope(...), "
                    "posjax.kernels.StickBreaking(...)")
  given = [name for name in WEIGHT_RULES if getattr(terms, name) is not None]
  if given:
    raise ValueError(f"rule={type(rule).__name__} given with terms that hold the {given[0]} rule; give one rule")
  return terms.replace(**{rule.FIELD: rule})


def backend_of(terms: Terms, tpu: bool):
  """The module whose ``attention`` and ``default_block_sizes`` compute ``terms``: a rule's own kernels
  (:data:`RULE_KERNELS`), else the softmax kernels (Mosaic on TPU, Triton on GPU)."""
  for name, (gpu, tpu_kernels) in RULE_KERNELS.items():
    if getattr(terms, name) is not None:
      return tpu_kernels if tpu else gpu
  return mosaic if tpu else triton


def default_block_sizes(terms: Terms, length: int, head_dim: int, tpu: bool) -> tuple[int, int]:
  """The Pallas kernels' (query, key) tile for ``terms`` when the caller gives none (:func:`backend_of`'s)."""
  return backend_of(as_terms(terms), tpu).default_block_sizes(as_terms(terms), length, head_dim)


def _per_context_shard(kernels, plan, terms: Terms, q_BxLxHxK, k_BxLxGxK, v_BxLxGxV, positions_BxL, segment_ids_BxL,
                       valid_BxL, salts_BxH, heads_first, head_dim: int, value_dim: int, block_sizes):
  """The fused kernels where the mesh splits the sequence: each device's queries, at their offset, against the keys
  and values gathered from every context shard (:func:`posjax.kernels.shard.per_context_shard`), the tiles of its
  queries only, and of them only those holding an allowed pair. ``heads_first(x, dim)``: ``[B, L, H, X]`` to the
  kernels' ``[B, H, L, dim]``, the head dims padded, not the sequence."""

  def attend(q_BxCxHxK, k_BxLxGxK, v_BxLxGxV, terms, positions_BxL, segment_ids_BxL, valid_BxL, salts_BxH, offset):
    out_BxHxCxV = kernels.attention(plan, jax.tree_util.tree_leaves(terms), heads_first(q_BxCxHxK, head_dim),
                                    heads_first(k_BxLxGxK, head_dim), heads_first(v_BxLxGxV, value_dim),
                                    positions_BxL, segment_ids_BxL, valid_BxL.astype(jnp.int32), salts_BxH,
                                    jnp.asarray(offset, jnp.int32))
    return out_BxHxCxV.transpose(0, 2, 1, 3)[..., :v_BxLxGxV.shape[-1]]

  b, length, h, _ = q_BxLxHxK.shape
  run = shard.per_context_shard(attend, terms, b, h, length, k_BxLxGxK.shape[2])  # checks the split first
  local = length // shard.context_shards()
  if local % plan.block_q or length % plan.block_k:
    raise ValueError(f"each of the {shard.context_shards()} context devices holds {local} of the {length} tokens, "
                     f"which the {plan.block_q}x{plan.block_k} tiles (block_sizes={tuple(block_sizes)}) do not "
                     "divide into whole query tiles and the sequence into whole key tiles; give block_sizes that do")
  return run(q_BxLxHxK, k_BxLxGxK, v_BxLxGxV, positions_BxL, segment_ids_BxL, valid_BxL, salts_BxH)


def relative_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, *, terms: Terms | None = None, positions=None,
                       segment_ids=None, lengths=None, padding=None, scale: float | None = None, rule=None,
                       causal: bool = False, sliding_window: int = 0, implementation: str = "pallas",
                       block_sizes: tuple[int, int] | None = None,
                       interpret: bool | str | None = None, platform: str | None = None,
                       dropout_rate: float = 0.0, dropout_seed=None, untied: str = "tile",
                       batch_axes=None, head_axes=None, query_block: int | None = None):
  """Self-attention ``[B, L, H, K]`` with position ``terms`` added to ``scale q·k`` inside the kernel.

  Args:
    positions: ``[B, L]`` int (default ``0..L-1``); relative distances are ``p_j - p_i``; position 0 is [CLS].
    segment_ids: ``[B, L]`` int; tokens attend only within their segment (packed rows).
    lengths: ``[B]`` int, right padding: keys at or past it are masked. Or ``padding``: ``[B, L]``, True at real
      tokens (any layout). A query with no key to attend to averages all keys, as the ``xla`` path does.
    scale: the factor on ``q·k`` and on the relative-vector terms (default ``1/sqrt(K)``).
    rule: what turns the masked logits into weights: None (the softmax), :class:`Cope` or :class:`StickBreaking`
      (:mod:`posjax.kernels.rules`, each with its own kernels; the same as giving it as the ``Terms`` field of its
      name).
    causal: key j only for queries i >= j (token order).
    sliding_window: key j only for queries ``|i - j| < sliding_window`` (token order; with ``causal``
      ``j <= i < j + sliding_window``, Mistral's window); 0: none. The kernels skip the tiles it rules out, as they
      skip those above the causal diagonal and those between different packed documents (:func:`posjax.kernels.tile.tile_ranges`, at run time).
    implementation: ``pallas`` or ``xla``. block_sizes: the kernel's (query, key) tile, powers of two (default
      per backend and terms: ``triton.default_block_sizes`` / ``mosaic.default_block_sizes``, chosen from what
      compiles and fits on H100 and TPU v5e/v6e); the sequence is padded to a multiple of the tiles (head
      dimensions and table rows to powers of two: Triton's arrays must be).
    interpret: run the kernels in a Pallas interpreter: True (the GPU kernels in the generic one) or ``"tpu"``
      (the TPU kernels in the Mosaic TPU interpreter, ``pltpu.InterpretParams()``); False compiles them for the
      device (Triton on GPU, Mosaic on TPU). Default: interpret on a CPU (the GPU kernels), compile elsewhere.
    platform: the device the program is compiled for, ``gpu`` or ``tpu`` (or ``cpu``); default the default
      backend's. Ahead-of-time compilation on a CPU for a GPU or TPU (:mod:`posjax.aot`) names it, and the
      kernels then compile for it unless ``interpret`` says otherwise.
      The TPU kernels need blocks that are multiples of (8, 128) or the whole padded sequence, and always read
      relative vectors windowed.

    dropout_rate, dropout_seed: dropout on the attention weights (kept weights scaled by ``1/(1 - rate)``), its
      mask a hash of the int ``dropout_seed``, the (batch row, head) and the pair (:mod:`posjax.kernels.dropout`):
      the kernels recompute it per tile and the ``xla`` path builds the same one.

    untied: how TUPE's untied term is computed: ``tile`` (default: from its rank-K factors in each tile, beside
      the K-wide content product) or ``fold`` (folded into q and k first, :func:`posjax.kernels.fold.fold_untied`:
      one ``2K+2``-wide product, which the GPU kernels pad to a power of two; the same logits).

    batch_axes, head_axes: under a mesh (``jax.sharding.use_abstract_mesh``, as posjax's training loop traces its
      step), the kernels run once per shard: rows split over the mesh axes ``batch_axes``, heads over
      ``head_axes``; by default the axes the logical-axis rules in force give ``activation_batch`` and
      ``activation_heads`` (:mod:`posjax.partitioning`: posjax's, or a user's ``nn.logical_axis_rules``). An axis
      the mesh lacks is an error (:func:`per_shard`). Where the mesh splits the sequence (the rules' axes for
      ``activation_length``, posjax's ``context``), each device scores its queries, at their offset in the
      sequence, against the keys and values gathered from every shard
      (:func:`posjax.kernels.shard.per_context_shard`): the ``xla`` implementation, or the Pallas kernels over the
      tiles of its queries that hold an allowed pair (each device's share a whole number of query tiles; not the
      rules' kernels nor windowed relative vectors, which read whole sequences: errors).
    query_block: the ``xla`` implementation's query rows at a time (None: all at once), so no more than
      ``[B, H, query_block, L]`` logits are alive; the blocks are recomputed in the backward pass.

  First-order gradients only (a ``custom_vjp``; differentiating the backward pass again is not supported).
  """
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"unknown implementation {implementation!r}; allowed: {list(IMPLEMENTATIONS)}")
  if lengths is not None and padding is not None:
    raise ValueError("give the key padding as lengths (right padding) or as a padding mask, not both")
  terms = with_rule(as_terms(terms), rule)
  if not isinstance(sliding_window, int) or sliding_window < 0:
    raise ValueError(f"sliding_window={sliding_window!r} must be an int >= 1 (0: none)")
  if q_BxLxHxK.ndim != 4:
    raise ValueError(f"q has shape {q_BxLxHxK.shape}; expected [B, L, H, K] (batch, sequence, heads, head dim)")
  b, length, h, d = q_BxLxHxK.shape
  for name, x_BxL, kind in (("positions", positions, "int"), ("segment_ids", segment_ids, "int"),
                            ("padding", padding, "mask")):
    if x_BxL is not None:
      check_rows(name, x_BxL, b, length, kind)
  if (k_BxLxGxK.ndim != 4 or v_BxLxGxK.ndim != 4 or k_BxLxGxK.shape[:2] != q_BxLxHxK.shape[:2]
      or k_BxLxGxK.shape[3] != d or v_BxLxGxK.shape[:3] != k_BxLxGxK.shape[:3]):
    raise ValueError(f"q {q_BxLxHxK.shape}, k {k_BxLxGxK.shape} and v {v_BxLxGxK.shape} must agree on [B, L], "
                     "k and v on their heads G (dividing q's H: grouped-query attention), q and k on K")
  group = kv_group(h, k_BxLxGxK.shape[2])
  terms.check(b, h, d, length)
  dropout_rate = dropout_lib.check_rate(dropout_rate)
  if dropout_rate and dropout_seed is None:
    raise ValueError(f"dropout_rate={dropout_rate} needs a dropout_seed (an int, e.g. "
                     "posjax.kernels.dropout.seed_from_key(key))")
  salts_BxH = dropout_lib.salts(dropout_seed if dropout_rate else 0, b, h)
  fold.check_untied(untied)
  scale = 1.0 / d ** 0.5 if scale is None else float(scale)
  positions_BxL = (jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length)) if positions is None
                   else jnp.broadcast_to(jnp.asarray(positions, jnp.int32), (b, length)))
  if terms.open and untied == "fold":
    raise ValueError("untied='fold' folds TUPE's term into q·k, which the open terms would then read as the content "
                     "score; use untied='tile' with open terms")
  if query_block is not None and (implementation != "xla" or not isinstance(query_block, int) or query_block < 1):
    raise ValueError(f"query_block={query_block!r}: an int >= 1, for implementation='xla' only (the kernels' "
                     "tiles are block_sizes)")
  split = shard.context_shards() > 1
  if terms.path is not None and not causal:
    raise ValueError("PaTH's products (Terms.path) are a decoder's: they need causal=True")
  if terms.path is not None and (split or query_block is not None):
    raise ValueError("PaTH's products (Terms.path) run over the whole sequence: query_block and a mesh that splits "
                     "the sequence (context) are not supported with it")
  rules = [name for name in WEIGHT_RULES if getattr(terms, name) is not None]
  if split and implementation == "pallas" and rules:
    raise ValueError(f"the mesh splits the sequence over {shard.context_shards()} context devices, and the "
                     f"{rules[0]} rule's Pallas kernels take whole sequences; use implementation='xla'")
  if implementation == "pallas" or split:  # the built-in terms the kernels compute as open terms (and whose
    terms = terms.kernel_form()  # arrays' axes, as open terms, the context split reads)
  terms = bind_open(terms, positions_BxL, b, h, length)
  if untied == "fold" and group > 1:
    raise ValueError(f"untied='fold' folds TUPE's per-head term into k, which has {k_BxLxGxK.shape[2]} heads "
                     f"for q's {h} (grouped-query attention); use untied='tile'")
  if untied == "fold":
    q_BxLxHxK, k_BxLxGxK, terms = fold.fold_untied(q_BxLxHxK, k_BxLxGxK, terms, positions_BxL, scale)
    d = q_BxLxHxK.shape[-1]
  segment_ids_BxL = (jnp.zeros((b, length), jnp.int32) if segment_ids is None
                     else jnp.broadcast_to(jnp.asarray(segment_ids, jnp.int32), (b, length)))
  if lengths is not None:
    if jnp.shape(lengths) != (b,):
      raise ValueError(f"lengths has shape {jnp.shape(lengths)}; expected ({b},): one per row")
    valid_BxL = jnp.arange(length)[None, :] < jnp.asarray(lengths, jnp.int32)[:, None]
  elif padding is not None:
    valid_BxL = jnp.broadcast_to(jnp.asarray(padding, bool), (b, length))
  else:
    valid_BxL = jnp.ones((b, length), bool)
  if implementation == "xla":
    def attend(q_BxQxHxK, k_BxLxGxK, v_BxLxGxV, terms, positions_BxL, segment_ids_BxL, valid_BxL, salts_BxH,
               offset=None):
      return xla.attention(q_BxQxHxK, k_BxLxGxK, v_BxLxGxV, terms, positions_BxL=positions_BxL,
                           segment_ids_BxL=segment_ids_BxL, valid_BxL=valid_BxL, scale=scale, causal=causal,
                           dropout_rate=dropout_rate, salts_BxH=salts_BxH, sliding_window=sliding_window,
                           query_block=query_block, query_offset=offset)
    inputs = (q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, positions_BxL, segment_ids_BxL, valid_BxL, salts_BxH)
    if split:
      return shard.per_context_shard(attend, terms, b, h, length, h // group)(*inputs)
    return attend(*inputs[:3], terms, *inputs[3:])
  tpu, interpret = tile.backend(interpret, platform)
  why = capability.refusal("pallas", terms, dropout=bool(dropout_rate))
  if why:
    raise ValueError(f"{why}; use implementation='xla'")
  kernels = backend_of(terms, tpu)
  rows = length // shard.context_shards() if split else length  # the queries one call scores
  block_sizes = block_sizes or kernels.default_block_sizes(terms, rows, d)
  bq, bk, padded = tile.block_sizes(rows, *block_sizes)  # a context shard's tiles no longer than its share
  padded = length if split else padded  # (the split checks that its tiles divide the shares)
  if tpu and interpret is False and not ((bq % 8 == 0 or bq == padded) and (bk % 128 == 0 or bk == padded)):
    raise ValueError(f"the TPU kernels need a query block that is a multiple of 8 and a key block that is a "
                     f"multiple of 128 (or blocks as long as the padded sequence, {padded}); the tiles are "
                     f"{bq}x{bk} (block_sizes={tuple(block_sizes)})")
  if terms.path is not None:  # PaTH's blocks: whole tiles, the sequence a whole number of them
    size = min(terms.path.band, padded)
    if size % bq or size % bk:
      raise ValueError(f"Path.band={terms.path.band} must be a multiple of the {bq}x{bk} tiles "
                       f"(block_sizes={tuple(block_sizes)})")
    padded = -(-padded // size) * size
  # The sequence padded to the tiles, head dimensions and the tables' rows to powers of two (Triton's arrays must
  # be), with zeros that change no logit (padded keys are masked) and get no gradient.
  pad = lambda x_S, axis, size: jnp.pad(x_S, [(0, size - x_S.shape[a] if a == axis else 0) for a in range(x_S.ndim)])
  pow2 = tile.next_power_of_two
  head_dim, value_dim = pow2(d), pow2(v_BxLxGxK.shape[-1])
  if terms.untied is not None:
    u = terms.untied
    terms = terms.replace(untied=u.replace(u_q=pad(pad(u.u_q, 1, padded), 3, head_dim),
                                           u_k=pad(pad(u.u_k, 1, padded), 3, head_dim)))
  if terms.relative is not None:
    r = terms.relative
    window = r.window if r.window is not None else tpu or (not split and bq == bk and 2 * r.max_distance + 1 > 2 * bq)
    if split and window:
      raise ValueError(f"the mesh splits the sequence over {shard.context_shards()} context devices, and relative "
                       "vectors read windowed (by tile diagonal) take whole sequences"
                       f"{' (on TPU they always are)' if tpu else '; give Relative(window=False)'}, or use "
                       "implementation='xla'")
    if tpu and not window:
      raise ValueError("Relative.window=False (gathered relative vectors) needs gathers, which TPU kernels do not "
                       "have; use window=True or None there")
    if window and bq != bk:
      raise ValueError(f"relative vectors read windowed (Relative.window={r.window}"
                       f"{', as on TPU always' if tpu else ''}) need equal query and key blocks; the tiles are "
                       f"{bq}x{bk} (block_sizes={tuple(block_sizes)} for length {length})")
    terms = terms.replace(relative=r.replace(table=pad(pad(r.table, 0, pow2(r.table.shape[0])), 1, head_dim),
                                             window=bool(window)))
  if terms.cope is not None:  # rows of the padded head dim (zeros: q's padding reads nothing)
    terms = terms.replace(cope=terms.cope.replace(table=pad(terms.cope.table, 0, head_dim)))
  terms = terms.replace(open=tile.pad_open(terms.open, b, padded, tpu))
  keys_first = lambda x_BxLxGxK: pad(x_BxLxGxK, 1, padded).transpose(0, 2, 1, 3)
  if terms.path is not None:  # the kernels' queries and keys: each query at its block's start, the keys' copies
    path = terms.path.replace(w=pad(terms.path.w, 1, padded), beta=pad(terms.path.beta, 1, padded))
    q_BxPxHxK, copies_BxGxNPxK, blocked = path_lib.blocks(path, pad(q_BxLxHxK, 1, padded),
                                                          pad(k_BxLxGxK, 1, padded), size)
    q_BxLxHxK = q_BxPxHxK.astype(q_BxLxHxK.dtype)
    keys_first = lambda _: copies_BxGxNPxK.astype(k_BxLxGxK.dtype)
    terms = terms.replace(path=blocked)
  leaves, treedef = jax.tree_util.tree_flatten(terms)
  plan = tile.Plan(scale=scale, causal=causal, block_q=bq, block_k=bk, length=length,
                   interpret=interpret, treedef=treedef, dropout=dropout_rate, group=group,
                   sliding_window=sliding_window)
  to_heads = lambda x_BxLxHxX, dim: pad(x_BxLxHxX, 3, dim).transpose(0, 2, 1, 3)
  heads_first = lambda x_BxLxHxX, dim: to_heads(pad(x_BxLxHxX, 1, padded), dim)
  if split:
    return _per_context_shard(kernels, plan, terms, q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, positions_BxL, segment_ids_BxL,
                              valid_BxL, salts_BxH, to_heads, head_dim, value_dim, block_sizes)
  backend = functools.partial(kernels.attention, plan)
  if terms.relative is not None and terms.relative.window:
    backend = exact.windowed(plan, backend, functools.partial(exact.dense, plan))
  out_BxHxPxV = per_shard(backend, terms, b, h, batch_axes, head_axes, kv_heads=h // group)(
      leaves, heads_first(q_BxLxHxK, head_dim), pad(keys_first(k_BxLxGxK), 3, head_dim),
      heads_first(v_BxLxGxK, value_dim), pad(positions_BxL, 1, padded), pad(segment_ids_BxL, 1, padded),
      pad(valid_BxL.astype(jnp.int32), 1, padded), salts_BxH)
  return out_BxHxPxV.transpose(0, 2, 1, 3)[:, :length, :, :v_BxLxGxK.shape[-1]]
