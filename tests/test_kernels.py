"""The fused kernel (Pallas, in the generic and the TPU interpreter on this CPU) against a float64 reference of the
terms' formulas (``tests/reference.py``: outputs, gradients along random directions) and against the dense ``xla``
path (outputs and the gradients of q, k, v and every position input, elementwise), over random shapes, tiles, terms
and packed/padded rows; and BERT models with ``attention_kernel="pallas"`` against the same models on ``xla``."""

import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from posjax import attention, kernels
from posjax.kernels import mosaic
from posjax.models import TransformerConfig, Transformer
import reference


def packed_rows(rng, batch, length):
  """Positions restarting at each segment, segment ids, and lengths (one row fully padded when batch > 2)."""
  positions, segments = np.zeros((batch, length), np.int32), np.zeros((batch, length), np.int32)
  for row in range(batch):
    cuts = np.sort(rng.choice(np.arange(1, length), size=min(rng.integers(0, 3), length - 1), replace=False))
    for segment, (start, stop) in enumerate(zip([0, *cuts], [*cuts, length])):
      positions[row, start:stop] = np.arange(stop - start)
      segments[row, start:stop] = segment + 1
  lengths = rng.integers(1, length + 1, size=batch)
  lengths[0] = length
  if batch > 2:
    lengths[2] = 0
  return positions, segments, lengths


def random_terms(rng, draw, batch, length, heads, head_dim):
  f32 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  fields = {}
  if draw(st.booleans()):
    fields["alibi"] = kernels.Alibi(jnp.asarray(rng.uniform(0.1, 1.0, heads), jnp.float32))
  reset = draw(st.sampled_from(["official", "paper", "none", None]))
  if draw(st.booleans()):
    kind = draw(st.sampled_from(["buckets", "clip"]))
    rows = 32 if kind == "buckets" else 2 * 5 + 1
    cls = reset == "official"
    fields["buckets"] = kernels.Buckets(f32(rows + 2, heads), kind=kind, num_buckets=32,
                                        max_distance=5 if kind == "clip" else 20,
                                        cls_row=rows if cls else None, cls_col=rows + 1 if cls else None)
  if reset is not None:
    shared = draw(st.booleans())
    fields["untied"] = kernels.Untied(f32(1 if shared else batch, length, heads, head_dim),
                                      f32(1 if shared else batch, length, heads, head_dim),
                                      f32(2, heads) if reset != "none" else None, reset=reset)
  if draw(st.booleans()) or not fields:
    k = draw(st.sampled_from([1, 7, length - 1]))
    side = draw(st.sampled_from([(True, False), (False, True), (True, True)]))
    window = draw(st.sampled_from([None, True, False]))  # None: the op chooses (the window for a wide table)
    fields["relative"] = kernels.Relative(0.5 * f32(2 * k + 1, head_dim), max_distance=k, query=side[0], key=side[1],
                                          window=window)
  return kernels.Terms(**fields)


def compiled_grad(loss, implementation, argnums=(0, 1, 2, 3), has_aux=True):
  """The gradient of ``loss(implementation, ...)`` as one compiled program (run op by op, the dense path and the
  interpreters' glue would compile each primitive on its own)."""
  return jax.jit(jax.grad(functools.partial(loss, implementation), argnums=argnums, has_aux=has_aux))


def assert_close_tree(got, want, rtol=2e-5, atol=2e-5):
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree_util.tree_leaves(got)):
    scale = max(1.0, float(np.abs(x).max()))
    np.testing.assert_allclose(y, x, rtol=rtol, atol=atol * scale, err_msg=jax.tree_util.keystr(path))


def assert_matches_reference(out, grads, q, k, v, terms, weights, *, positions=None, segments=None, lengths=None,
                             causal=False, directions=2, sliding_window=0):
  """The op's output and the gradients of ``sum(out * weights)`` (q, k, v and every term input but ALiBi's constant
  slopes) against :class:`reference.FusedAttention` in float64: the output elementwise, each gradient along random
  directions against central differences of the reference, relative to the gradient's norm."""
  b, length, _, head_dim = q.shape
  positions = np.tile(np.arange(length), (b, 1)) if positions is None else np.asarray(positions)
  segments = np.zeros((b, length), int) if segments is None else np.asarray(segments)
  valid = np.ones((b, length), bool) if lengths is None else np.arange(length)[None] < np.asarray(lengths)[:, None]
  terms = terms or kernels.Terms()
  bucket, relative, untied = terms.buckets, terms.relative, terms.untied
  fused = reference.FusedAttention(
      positions, segments, valid, causal, sliding_window=sliding_window, relative_max_distance=None if relative is None else relative.max_distance,
      buckets=None if bucket is None else dict(kind=bucket.kind, num_buckets=bucket.num_buckets,
                                               max_distance=bucket.max_distance, bidirectional=bucket.bidirectional,
                                               cls_row=bucket.cls_row, cls_col=bucket.cls_col))
  inputs, grad_of = {"q": q, "k": k, "v": v}, {"q": grads[0], "k": grads[1], "v": grads[2]}
  if bucket is not None:
    inputs["bucket_table"], grad_of["bucket_table"] = bucket.table, grads[3].buckets.table
  if relative is not None:
    inputs["relative_table"], grad_of["relative_table"] = relative.table, grads[3].relative.table
  if untied is not None:
    for name in ("u_q", "u_k") + (("theta",) if untied.theta is not None else ()):
      inputs[name], grad_of[name] = getattr(untied, name), getattr(grads[3].untied, name)
  if terms.forget is not None:
    inputs["forget_c"], grad_of["forget_c"] = terms.forget.c, grads[3].forget.c
  if terms.cope is not None:
    inputs["cope_table"], grad_of["cope_table"] = terms.cope.table, grads[3].cope.table
  for term, names in (("kerple", ("r1", "r2")), ("fire", ("w1", "b1", "w2", "b2", "c", "threshold"))):
    if getattr(terms, term) is not None:
      for name in names:
        inputs[f"{term}_{name}"] = getattr(getattr(terms, term), name)
        grad_of[f"{term}_{name}"] = getattr(getattr(grads[3], term), name)
  inputs = {name: np.asarray(x, np.float64) for name, x in inputs.items()}
  fixed = dict(scale=1.0 / np.sqrt(head_dim), alibi=None if terms.alibi is None else np.asarray(terms.alibi.slopes),
               relative_query=relative is not None and relative.query, relative_key=relative is not None and relative.key,
               reset="none" if untied is None else untied.reset)
  if terms.kerple is not None:
    fixed["kerple_kind"] = terms.kerple.kind
  if terms.fire is not None:
    fixed["fire_eps"] = terms.fire.eps
  if terms.sandwich is not None:
    sw = terms.sandwich
    fixed["sandwich"] = dict(ratios=np.asarray(sw.ratios), dim=sw.dim, base=sw.base, scale=sw.scale, divide=sw.divide,
                             first=sw.first)
  if terms.stick_breaking is not None:
    fixed["stick_breaking"] = dict(attend_current=terms.stick_breaking.attend_current,
                                   remainder=terms.stick_breaking.remainder)
  weights = np.asarray(weights, np.float64)
  loss = lambda **x: float(np.sum(fused(**fixed, **{**inputs, **x}) * weights))
  np.testing.assert_allclose(out, fused(**fixed, **inputs), rtol=2e-5, atol=2e-5)
  rng, eps = np.random.default_rng(0), 1e-3
  # a gradient that is zero in exact arithmetic (a bias added to every logit of a row: FIRE's b2) is compared
  # relative to the largest gradient's scale
  floor = 1e-2 * max(np.linalg.norm(np.asarray(g, np.float64)) for g in grad_of.values())
  for name, x in inputs.items():
    grad = np.asarray(grad_of[name], np.float64)
    for _ in range(directions):
      d = rng.normal(size=x.shape)
      numeric = (loss(**{name: x + eps * d}) - loss(**{name: x - eps * d})) / (2 * eps)
      scale = max(np.linalg.norm(grad), floor)
      assert abs(np.sum(grad * d) - numeric) <= 1e-4 * scale * np.linalg.norm(d) + 1e-6, (
          f"d{name} along a random direction: {np.sum(grad * d)} (kernel), {numeric} (reference)")


@pytest.mark.slow
@hypothesis.settings(max_examples=3, deadline=None, derandomize=True, phases=[hypothesis.Phase.generate],
                     suppress_health_check=[hypothesis.HealthCheck.too_slow])
@hypothesis.given(st.data())
def test_pallas_matches_xla_outputs_and_gradients(data):
  """Random shapes, tiles and terms on the GPU kernels in the generic interpreter. The TPU kernels (a program costs
  ~10 s to compile in their interpreter) are checked by the fixed cases: every term at once, MQA and a sliding
  window (:func:`test_kerple_fire_and_sandwich_match_xla`), per-row untied factors over two rows
  (:func:`test_dropout_matches_xla_with_the_same_mask`), full 128x128 tiles, skipped tiles and the rules."""
  draw = data.draw
  interpreter = True
  length = draw(st.sampled_from([5, 16, 24, 37]))
  batch, heads, head_dim = draw(st.sampled_from([1, 3])), 2, 8
  blocks = (draw(st.sampled_from([8, 16])), draw(st.sampled_from([8, 16])))
  causal = draw(st.booleans())
  rng = np.random.default_rng(draw(st.integers(0, 1000)))
  positions, segments, lengths = packed_rows(rng, batch, length)
  terms = random_terms(rng, draw, batch, length, heads, head_dim)
  if terms.relative is not None and terms.relative.window:
    blocks = (blocks[0], blocks[0])  # the windowed table needs square tiles
  q, k, v = (jnp.asarray(rng.normal(size=(batch, length, heads, head_dim)), jnp.float32) for _ in range(3))
  weights = jnp.asarray(rng.normal(size=(batch, length, heads, head_dim)), jnp.float32)

  def loss(implementation, q, k, v, terms):
    out = kernels.relative_attention(q, k, v, terms=terms, positions=positions, segment_ids=segments,
                                     lengths=lengths, causal=causal, implementation=implementation,
                                     block_sizes=blocks, interpret=interpreter)
    return jnp.sum(out * weights), out

  grads = {impl: compiled_grad(loss, impl)(q, k, v, terms)
           for impl in ("xla", "pallas")}
  assert_close_tree(grads["pallas"], grads["xla"])
  kernel_grads, out = grads["pallas"]
  assert_matches_reference(out, kernel_grads, q, k, v, terms, weights, positions=positions, segments=segments,
                           lengths=lengths, causal=causal)


@pytest.mark.parametrize("blocks,length", [((8, 16), 21), ((32, 64), 100)])
def test_every_term_at_once_matches_xla(blocks, length):
  """All four terms in one call on the GPU kernels (the random draws above need not cover each gradient): ALiBi, T5
  buckets with [CLS] entries, relative vectors on both sides and TUPE's shared untied term with the official reset.
  At L=100 the bucket and relative tables are wide (clip at 90: 256 padded rows), so the backward scatters them
  in pieces. The TPU kernels take every term at once in :func:`test_kerple_fire_and_sandwich_match_xla`."""
  interpreter = True
  rng = np.random.default_rng(3)
  batch, heads, head_dim = 2, 2, 8
  wide = 90 if length >= 100 else 5
  f32 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  positions, segments, lengths = packed_rows(rng, batch, length)
  terms = kernels.Terms(
      alibi=kernels.Alibi(jnp.asarray([0.5, 0.25])),
      buckets=(kernels.Buckets(f32(34, heads), num_buckets=32, max_distance=20, cls_row=32, cls_col=33)
               if length < 100 else kernels.Buckets(f32(183, heads), kind="clip", max_distance=90, cls_row=181,
                                                    cls_col=182)),
      relative=kernels.Relative(0.5 * f32(2 * wide + 1, head_dim), max_distance=wide, query=True, key=True,
                                window=False if length >= 100 else None),
      untied=kernels.Untied(f32(1, length, heads, head_dim), f32(1, length, heads, head_dim), f32(2, heads)))
  q, k, v, weights = (f32(batch, length, heads, head_dim) for _ in range(4))

  def loss(implementation, q, k, v, terms):
    out = kernels.relative_attention(q, k, v, terms=terms, positions=positions, segment_ids=segments,
                                     lengths=lengths, implementation=implementation, block_sizes=blocks,
                                     interpret=interpreter)
    return jnp.sum(out * weights), out

  want, (got, out) = (compiled_grad(loss, impl)(q, k, v, terms)
                      for impl in ("xla", "pallas"))
  assert_close_tree(got, want[0])
  assert_matches_reference(out, got, q, k, v, terms, weights, positions=positions, segments=segments, lengths=lengths)


def test_grouped_query_attention_matches_the_reference():
  """k and v with fewer heads than q (GQA), in a causal sliding window (Mistral's) over packed and padded rows, with
  ALiBi, T5 buckets, TUPE's untied term and relative vectors on both sides (the key side reads the grouped keys):
  both the ``xla`` path and the GPU kernels against the float64 reference, in which query head h reads k/v head
  h // (H / G); the shared heads' gradients are the sums over their groups. The TPU kernels' grouped heads (MQA, a
  window on both sides, ModernBERT's): :func:`test_kerple_fire_and_sandwich_match_xla`."""
  interpreter, heads, kv_heads, window, sliding, causal = True, 4, 2, False, 6, True
  rng = np.random.default_rng(11)
  batch, length, head_dim = 2, 21, 8
  f32 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  positions, segments, lengths = packed_rows(rng, batch, length)
  terms = kernels.Terms(
      alibi=kernels.Alibi(jnp.asarray(rng.uniform(0.1, 1.0, heads), jnp.float32)),
      buckets=kernels.Buckets(f32(32, heads), num_buckets=32, max_distance=20, bidirectional=False),
      relative=kernels.Relative(0.5 * f32(2 * 5 + 1, head_dim), max_distance=5, query=True, key=True, window=window),
      untied=kernels.Untied(f32(1, length, heads, head_dim), f32(1, length, heads, head_dim), None, reset="none"))
  q, weights = f32(batch, length, heads, head_dim), f32(batch, length, heads, head_dim)
  k, v = f32(batch, length, kv_heads, head_dim), f32(batch, length, kv_heads, head_dim)

  def loss(implementation, q, k, v, terms):
    out = kernels.relative_attention(q, k, v, terms=terms, positions=positions, segment_ids=segments,
                                     lengths=lengths, causal=causal, implementation=implementation,
                                     block_sizes=(8, 8), interpret=interpreter, sliding_window=sliding)
    return jnp.sum(out * weights), out

  for implementation in ("xla", "pallas"):
    grads, out = compiled_grad(loss, implementation)(q, k, v, terms)
    assert grads[1].shape == k.shape and grads[2].shape == v.shape
    assert_matches_reference(out, grads, q, k, v, terms, weights, positions=positions, segments=segments,
                             lengths=lengths, causal=causal, directions=1, sliding_window=sliding)


def test_grouped_heads_that_do_not_divide_are_an_error():
  q, k = jnp.zeros((1, 4, 3, 8)), jnp.zeros((1, 4, 2, 8))
  with pytest.raises(ValueError, match="must divide the 3 query heads"):
    kernels.relative_attention(q, k, k, implementation="xla")


@pytest.mark.parametrize("length,k,causal,packed", [(37, 36, False, True), (16, 5, True, True), (21, 3, False, False)])
def test_windowed_relative_vectors_match_xla(length, k, causal, packed):
  """The GPU kernels' window on both sides, with distances past k (clipped rows: their gradient sums) or without;
  packed, padded and causal rows; or one default segment with a length that is no power of two (the kernel's
  padding rows then share the tokens' segment). The TPU kernels' window: the two tests below."""
  rng = np.random.default_rng(length)
  batch, heads, head_dim = 3, 2, 8
  positions, segments, lengths = packed_rows(rng, batch, length) if packed else (None, None, None)
  f32 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  terms = kernels.Terms(relative=kernels.Relative(0.5 * f32(2 * k + 1, head_dim), max_distance=k, query=True,
                                                  key=True, window=True))
  q, k_, v, weights = (f32(batch, length, heads, head_dim) for _ in range(4))

  def loss(implementation, q, k, v, terms):
    out = kernels.relative_attention(q, k, v, terms=terms, positions=positions, segment_ids=segments,
                                     lengths=lengths, causal=causal, implementation=implementation,
                                     block_sizes=(8, 8), interpret=True)
    return jnp.sum(out * weights), out

  want, (got, out) = (compiled_grad(loss, impl)(q, k_, v, terms)
                      for impl in ("xla", "pallas"))
  assert_close_tree(got, want[0])
  assert_matches_reference(out, got, q, k_, v, terms, weights, positions=positions, segments=segments,
                           lengths=lengths, causal=causal)


def test_tpu_windows_at_full_tiles_match_xla():
  """The TPU kernels at their default 128x128 tiles in the Mosaic TPU interpreter: the key side alone (the reversed
  table's blocks and skew, with no query side beside it), clipped (k < L-1: the clipped rows' gradient sums), on
  packed rows. Both sides at once, at smaller tiles: the TPU cases of :func:`test_kerple_fire_and_sandwich_match_xla`,
  :func:`test_dropout_matches_xla_with_the_same_mask` and
  :func:`test_windowed_relative_vectors_are_exact_where_positions_skip`; the skew at these tiles on every axis and
  sign: :func:`test_the_tpu_skew_rolls_each_line_by_its_own_amount`."""
  length, k = 200, 60
  rng = np.random.default_rng(k)
  batch, heads, head_dim = 1, 1, 8
  positions, segments, lengths = packed_rows(rng, batch, length)
  f32 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  terms = kernels.Terms(relative=kernels.Relative(0.5 * f32(2 * k + 1, head_dim), max_distance=k, query=False,
                                                  key=True))
  q, k_, v, weights = (f32(batch, length, heads, head_dim) for _ in range(4))

  def loss(implementation, q, k, v, terms):
    out = kernels.relative_attention(q, k, v, terms=terms, positions=positions, segment_ids=segments,
                                     lengths=lengths, implementation=implementation, interpret="tpu")
    return jnp.sum(out * weights), out

  want, (got, out) = (compiled_grad(loss, impl)(q, k_, v, terms)
                      for impl in ("xla", "pallas"))
  assert_close_tree(got, want[0])
  assert_matches_reference(out, got, q, k_, v, terms, weights, positions=positions, segments=segments,
                           lengths=lengths)


@pytest.mark.parametrize("shape,axis,shift,sign", [((128, 256), 1, 128, 1), ((128, 256), 1, 128, -1),
                                                   ((256, 128), 0, 129, 1), ((256, 128), 0, 127, -1)])
def test_the_tpu_skew_rolls_each_line_by_its_own_amount(shape, axis, shift, sign):
  """:func:`posjax.kernels.mosaic._skew` (static rolls and selects) in the Mosaic TPU interpreter: line t
  rolled by ``shift + sign·t``, exactly."""
  x = np.random.default_rng(0).normal(size=shape).astype(np.float32)

  def kernel(x_ref, out_ref):
    out_ref[...] = mosaic._skew(x_ref[...], shift, axis, sign)

  got = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(shape, jnp.float32),
                       interpret=pltpu.InterpretParams())(x)
  lines = [np.roll(np.take(x, t, axis=1 - axis), shift + sign * t) for t in range(shape[1 - axis])]
  np.testing.assert_array_equal(got, np.stack(lines, axis=1 - axis))


@pytest.mark.parametrize("interpreter", [True, "tpu"])
def test_windowed_relative_vectors_are_exact_where_positions_skip(interpreter):
  """The window reads index distances; where an attended key's position difference is not its index difference
  the call runs on the dense path instead (the kernel's NaN rows never reach the caller): every row and every
  gradient equals the float64 reference's, as the gathered table (GPU) does."""
  rng = np.random.default_rng(5)
  length, heads, head_dim = 24, 2, 8
  positions = np.concatenate([np.arange(10), np.arange(8), [0, 1, 2, 5, 6, 7]])[None]  # a skip in segment 3
  segments = np.repeat([1, 2, 3], [10, 8, 6])[None]
  q, k, v = (jnp.asarray(rng.normal(size=(1, length, heads, head_dim)), jnp.float32) for _ in range(3))
  table = jnp.asarray(rng.normal(size=(2 * 23 + 1, head_dim)), jnp.float32)
  run = lambda window, implementation="pallas", q=q, k=k, v=v: kernels.relative_attention(
      q, k, v, terms=kernels.Terms(relative=kernels.Relative(table, 23, query=True, key=True, window=window)),
      positions=positions, segment_ids=segments, implementation=implementation, block_sizes=(8, 8),
      interpret=interpreter)
  want = reference.FusedAttention(positions, segments, np.ones((1, length), bool), relative_max_distance=23)(
      q, k, v, scale=1 / np.sqrt(head_dim), relative_table=table, relative_query=True, relative_key=True)
  if interpreter is True:
    np.testing.assert_allclose(run(False), want, rtol=1e-5, atol=1e-5)

  def loss(implementation, q, k, v):
    out = run(True, implementation, q, k, v)
    return jnp.sum(jnp.sin(out)), out

  (want_grads, _), (got_grads, out) = (compiled_grad(loss, impl, argnums=(0, 1, 2))(q, k, v)
                                       for impl in ("xla", "pallas"))
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
  assert_close_tree(got_grads, want_grads)


def test_a_fully_masked_row_averages_every_key_as_the_xla_path_does():
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(2, 12, 1, 4)), jnp.float32) for _ in range(3))
  out = kernels.relative_attention(q, k, v, lengths=np.array([12, 0]), block_sizes=(8, 8))
  np.testing.assert_allclose(out[1], np.broadcast_to(v[1].mean(axis=0), (12, 1, 4)), rtol=1e-5, atol=1e-6)


def learned_terms(rng, heads, kind, width=5, threshold=-6.0):
  """KERPLE (``kind``), FIRE (a ``width``-unit MLP whose units switch inside the sequence, so every parameter has a
  gradient; the threshold below the longest position, so both sides of ``max(p_i, L)`` occur, at -6 a tie) and
  Sandwich in one call."""
  f32 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  return kernels.Terms(
      kerple=kernels.Kerple(jnp.asarray(rng.uniform(0.2, 1.5, heads), jnp.float32),
                            jnp.asarray(rng.uniform(0.2, 1.8, heads), jnp.float32), kind),
      fire=kernels.Fire(2.0 * f32(width), jnp.asarray(rng.uniform(-0.8, 0.2, width), jnp.float32), f32(width, heads),
                        f32(heads), jnp.asarray(0.4, jnp.float32), jnp.asarray(threshold, jnp.float32)),
      sandwich=kernels.Sandwich(jnp.asarray(rng.uniform(1.0, 4.0, heads), jnp.float32), dim=12, scale=0.5))


@pytest.mark.parametrize("interpreter,blocks,kind,causal,others", [
    (True, (8, 16), "log", True, False), (True, (16, 8), "power", False, True), ("tpu", (16, 16), "log", False, True)])
def test_kerple_fire_and_sandwich_match_xla(interpreter, blocks, kind, causal, others):
  """The terms computed per tile (KERPLE, FIRE's MLP a hidden unit at a time, Sandwich's embeddings) and the
  per-tile gradient sums of KERPLE's and FIRE's scalars equal the dense ``xla`` path's autodiff and the float64
  reference's outputs and central differences, on packed and padded rows (positions up to 11, the FIRE threshold at
  6). ``others``: with ALiBi, T5 buckets with [CLS] entries and TUPE's untied term and θ in the same call, whose
  scalar gradients come first in the TPU kernels' columns, Sandwich in NeMo's form and a Forget term (its column
  after θ's) of one row for the batch. The terms' formulas are the backends' shared code (each kind and Sandwich's
  two forms on the GPU kernels); the TPU case, one row (the padded one), checks its layout with every term at
  once: with relative vectors on both sides too (the windowed table, the key side reading the grouped keys), two
  query heads to one k/v head (MQA; the shared head's gradients the sums over its group) and a sliding window on
  both sides (ModernBERT's local layers): the TPU kernels' every-term case (the GPU kernels':
  :func:`test_every_term_at_once_matches_xla` and :func:`test_grouped_query_attention_matches_the_reference`)."""
  rng = np.random.default_rng(5)
  tpu = interpreter == "tpu"
  lengths = np.array([15]) if tpu else np.array([21, 15])
  batch, length, heads, head_dim = len(lengths), 21, 2, 8
  kv_heads, sliding = (1, 5) if tpu else (heads, 0)
  positions = np.tile(np.concatenate([np.arange(12), np.arange(9)]), (batch, 1))
  segments = np.tile(np.array([1] * 12 + [2] * 9), (batch, 1))
  terms = learned_terms(rng, heads, kind, threshold=-6.5 if others else -6.0)  # -6: a tie with a position
  f32 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  if others:
    terms = terms.replace(
        alibi=kernels.Alibi(jnp.asarray([0.5, 0.25])),
        buckets=kernels.Buckets(f32(34, heads), num_buckets=32, max_distance=20, cls_row=32, cls_col=33),
        untied=kernels.Untied(f32(1, length, heads, head_dim), f32(1, length, heads, head_dim), f32(2, heads)),
        sandwich=terms.sandwich.replace(divide="bias", first=1),  # NeMo's form
        forget=kernels.Forget(f32(1, heads, length)))  # one row for the batch; on TPU a column among the others
  if tpu:
    terms = terms.replace(relative=kernels.Relative(0.5 * f32(2 * 5 + 1, head_dim), max_distance=5, query=True,
                                                    key=True))
  q, k, v, weights = (f32(batch, length, h, head_dim) for h in (heads, kv_heads, kv_heads, heads))

  def loss(implementation, q, k, v, terms):
    out = kernels.relative_attention(q, k, v, terms=terms, positions=positions, segment_ids=segments,
                                     lengths=lengths, causal=causal, implementation=implementation,
                                     block_sizes=blocks, interpret=interpreter, sliding_window=sliding)
    return jnp.sum(out * weights), out

  want, (got, out) = (compiled_grad(loss, impl)(q, k, v, terms)
                      for impl in ("xla", "pallas"))
  want = want[0]
  assert got[1].shape == k.shape and got[2].shape == v.shape
  assert_matches_reference(out, got, q, k, v, terms, weights, positions=positions, segments=segments,
                           lengths=lengths, causal=causal, sliding_window=sliding)
  largest = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(want))
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got)):
    np.testing.assert_allclose(y, x, rtol=2e-5, atol=2e-5 * largest, err_msg=jax.tree_util.keystr(path))
  for name in ("r1", "r2"):
    assert float(jnp.max(jnp.abs(getattr(want[3].kerple, name)))) > 1e-2 * largest
  for name in ("w1", "b1", "w2", "c", "threshold"):
    assert float(jnp.max(jnp.abs(getattr(want[3].fire, name)))) > 1e-4 * largest, name


def test_the_forget_term_matches_the_reference_with_its_gradient():
  """The Forgetting Transformer's ``c_i - c_j`` built per tile on the GPU kernels (interpreted; the TPU kernels'
  Forget term is checked among the other terms' columns in :func:`test_kerple_fire_and_sandwich_match_xla`, the
  tile's formula and its gradient's sign being shared), with ``c``'s gradient as the dq kernel's row sums and the
  dkv kernel's column sums: the output and every gradient against the
  float64 reference (central differences), on packed, padded, causal rows with grouped k/v heads and tiles smaller
  than a document; ``c`` of non-increasing sums per document, as the gates give, with ties (gates of 1)."""
  rng = np.random.default_rng(11)
  batch, length, heads, kv_heads, head_dim = 2, 21, 4, 2, 8
  positions = np.tile(np.concatenate([np.arange(12), np.arange(9)]), (batch, 1))
  segments = np.tile(np.array([1] * 12 + [2] * 9), (batch, 1))
  log_f = np.log(rng.uniform(0.3, 0.99, (batch, heads, length)))
  log_f[..., 3:6] = 0.0  # gates of 1: equal sums, where -|c_i - c_j| would take the wrong gradient
  c = jnp.asarray(np.concatenate([np.cumsum(log_f[..., :12], -1), np.cumsum(log_f[..., 12:], -1)], -1), jnp.float32)
  terms = kernels.Terms(forget=kernels.Forget(c))
  q = jnp.asarray(rng.normal(size=(batch, length, heads, head_dim)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(batch, length, kv_heads, head_dim)), jnp.float32) for _ in range(2))
  weights = jnp.asarray(rng.normal(size=(batch, length, heads, head_dim)), jnp.float32)

  def loss(implementation, q, k, v, terms):
    out = kernels.relative_attention(q, k, v, terms=terms, positions=positions, segment_ids=segments,
                                     lengths=np.array([21, 17]), causal=True, implementation=implementation,
                                     block_sizes=(8, 8), interpret=True)
    return jnp.sum(out * weights), out

  got, out = compiled_grad(loss, "pallas")(q, k, v, terms)
  assert_matches_reference(out, got, q, k, v, terms, weights, positions=positions, segments=segments,
                           lengths=np.array([21, 17]), causal=True)
  assert float(jnp.max(jnp.abs(got[3].forget.c))) > 1e-2 * float(jnp.max(jnp.abs(got[0])))


WEIGHT_RULES = {
    "stick_breaking": lambda rng: kernels.Terms(stick_breaking=kernels.StickBreaking()),
    "stick_breaking_current": lambda rng: kernels.Terms(stick_breaking=kernels.StickBreaking(attend_current=True,
                                                                                             remainder=False)),
    "cope": lambda rng: kernels.Terms(cope=kernels.Cope(jnp.asarray(rng.normal(size=(8, 6)), jnp.float32))),
}


@pytest.mark.parametrize("interpreter,rule", [(True, "stick_breaking_current"), ("tpu", "stick_breaking"),
                                              (True, "cope"), ("tpu", "cope")])
def test_weight_rules_match_the_reference_with_their_gradients(interpreter, rule):
  """The rules on the masked logits, each query tile walking its key tiles from the diagonal back and the dq
  kernel's carries read by the dk/dv kernel (interpreted): the output and every gradient against the float64
  reference's loops (central differences), on packed, padded, causal rows with grouped k/v heads, tiles smaller than
  a document, a last key tile past the sequence (which a query tile walking back meets first) and a sliding window,
  on both backends (the TPU's key-major tiles). Stick-breaking with the query's own key left out and the remainder on
  its value (the authors' defaults; TPU) or neither (GPU); CoPE with a table of 6 entries (counts past 5 clamped),
  gathered per pair on GPU and selected per entry on TPU, the backward's two walks. On TPU one row (the padded
  one)."""
  rng = np.random.default_rng(12)
  lengths = np.array([19, 15]) if interpreter is True else np.array([15])
  batch, length, heads, kv_heads, head_dim = len(lengths), 19, 2, 1, 8
  positions = np.tile(np.concatenate([np.arange(12), np.arange(7)]), (batch, 1))
  segments = np.tile(np.array([1] * 12 + [2] * 7), (batch, 1))
  terms = WEIGHT_RULES[rule](rng)
  q = jnp.asarray(rng.normal(size=(batch, length, heads, head_dim)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(batch, length, kv_heads, head_dim)), jnp.float32) for _ in range(2))
  weights = jnp.asarray(rng.normal(size=(batch, length, heads, head_dim)), jnp.float32)

  def loss(implementation, q, k, v, terms):
    out = kernels.relative_attention(q, k, v, terms=terms, positions=positions, segment_ids=segments,
                                     lengths=lengths, causal=True, sliding_window=10,
                                     implementation=implementation, interpret=interpreter,
                                     block_sizes=(8, 4) if interpreter is True else (16, 8))
    return jnp.sum(out * weights), out

  got, out = compiled_grad(loss, "pallas")(q, k, v, terms)
  assert_matches_reference(out, got, q, k, v, terms, weights, positions=positions, segments=segments,
                           lengths=lengths, causal=True, sliding_window=10)


MODELS = [("alibi", {}), ("bert_r", {}), ("tupe_r", {}),
          ("tupe_a", {"cls_reset": "paper", "share_across_layers": False}),
          ("tupe_r", {"relative_distance": "clip", "max_distance": 6, "cls_reset": "none"}),
          ("shaw", {"max_distance": 3}), ("huang_m4", {}), ("rope", {}), ("kerple_log", {}),
          ("fire", {"threshold": 8.0}), ("sandwich", {})]


@pytest.mark.parametrize("position,options", MODELS, ids=[f"{m}-{'-'.join(map(str, o.values()))}" for m, o in MODELS])
def test_a_model_on_pallas_matches_it_on_xla(position, options):
  pallas_matches_xla(dict(position=position, position_options=options, num_layers=1))


def test_a_decoder_of_the_data_dependent_methods_on_pallas_matches_it_on_xla():
  # CoPE and stick-breaking, a layer each (the masked-logit rules on the kernels, through the attention layer)
  pallas_matches_xla(dict(causal=True, num_layers=2, position_schedule="cope,stick_breaking", num_kv_heads=2))


def pallas_matches_xla(fields):
  rng = np.random.default_rng(1)
  batch, length = 2, 20
  ids = jnp.asarray(rng.integers(5, 128, (batch, length)))
  positions = jnp.asarray(np.concatenate([np.arange(12), np.arange(8)])[None].repeat(batch, 0))
  segments = jnp.asarray(np.repeat([[1] * 12 + [2] * 8], batch, 0))
  padding = jnp.asarray(np.arange(length)[None] < np.array([[20], [15]]))
  configs = {kernel: TransformerConfig.tiny(attention_kernel=kernel, dropout_rate=0.0, attention_dropout_rate=0.0,
                                            **fields) for kernel in ("xla", "pallas")}
  params = Transformer(configs["xla"]).init(jax.random.key(0), ids)["params"]

  def loss(kernel, params):
    out = Transformer(configs[kernel]).apply({"params": params}, ids, positions=positions, segment_ids=segments,
                                             attention_mask=padding)
    return jnp.sum(jnp.sin(out.last_hidden_state) * padding[..., None]), out.last_hidden_state

  (_, want), want_grads = jax.jit(jax.value_and_grad(functools.partial(loss, "xla"), has_aux=True))(params)
  (_, got), got_grads = jax.jit(jax.value_and_grad(functools.partial(loss, "pallas"), has_aux=True))(params)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert_close_tree(got_grads, want_grads)


LOWERED = {
    "none": lambda f32: None,
    "alibi+t5": lambda f32: kernels.Terms(alibi=kernels.Alibi(jnp.ones(2)), buckets=kernels.Buckets(f32(32, 2))),
    "tupe_r official": lambda f32: kernels.Terms(
        buckets=kernels.Buckets(f32(33, 2), cls_row=16, cls_col=32),
        untied=kernels.Untied(f32(1, 40, 2, 24), f32(1, 40, 2, 24), f32(2, 2))),
    "huang_m4": lambda f32: kernels.Terms(relative=kernels.Relative(f32(15, 24), 7, query=True, key=True)),
    "huang_m4 window": lambda f32: kernels.Terms(relative=kernels.Relative(f32(79, 24), 39, query=True, key=True,
                                                                                  window=True)),
    "kerple+fire+sandwich+forget": lambda f32: kernels.Terms(
        kerple=kernels.Kerple(jnp.ones(2), jnp.ones(2), "power"),
        fire=kernels.Fire(f32(32), f32(32), f32(32, 2), f32(2), jnp.asarray(0.1), jnp.asarray(512.0)),
        sandwich=kernels.Sandwich(jnp.ones(2)), forget=kernels.Forget(f32(1, 2, 40))),
    # 259 bucket entries and 257 gathered distances: the backward scatters them in pieces (a one-hot of
    # [64, 64, 512] is over Triton's 2^20 elements)
    "stick_breaking": lambda f32: kernels.Terms(stick_breaking=kernels.StickBreaking()),
    "cope": lambda f32: kernels.Terms(cope=kernels.Cope(f32(24, 16))),
    "wide tables": lambda f32: kernels.Terms(
        buckets=kernels.Buckets(f32(259, 2), kind="clip", max_distance=128, cls_row=257, cls_col=258),
        relative=kernels.Relative(f32(257, 24), 128, query=True, key=True, window=False)),
}


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("name", LOWERED)
def test_the_kernels_lower_for_gpu_and_tpu(name, platform, monkeypatch):
  # Lowering (not running) from this CPU machine, for CUDA with Triton and for TPU with Mosaic: each backend's
  # constraints (Triton: power-of-two arrays, no slicing of loaded values, no batched matmul; Mosaic: block
  # shapes, no gathers) are checked here, so an accelerator session starts from kernels that lower.
  if platform == "tpu":
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")  # the op picks its TPU kernels
  rng = np.random.default_rng(0)
  f32 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  q, k, v = (f32(2, 40, 2, 24).astype(jnp.bfloat16) for _ in range(3))  # L=40, d=24: padded to powers of two

  rate = 0.1 if name == "alibi+t5" else 0.0  # one case with attention dropout (its hash: logical shifts)

  def loss(q, k, v, terms):
    out = kernels.relative_attention(q, k, v, terms=terms, lengths=np.array([40, 31]), interpret=False,
                                     dropout_rate=rate, dropout_seed=jnp.int32(7))
    return jnp.sum(out.astype(jnp.float32))

  terms = LOWERED[name](f32)
  if platform == "tpu" and terms is not None and terms.relative is not None:
    terms = terms.replace(relative=terms.relative.replace(window=None))  # always windowed there
  lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(q, k, v, terms).lower(lowering_platforms=(platform,))
  # forward, dq and dk/dv kernels, and the windowed table's gradient kernel (always windowed on TPU)
  relative = terms is not None and terms.relative is not None
  window = relative and (terms.relative.window or platform == "tpu")
  call = "xla.gpu.triton" if platform == "cuda" else "tpu_custom_call"
  assert lowered.as_text().count(call) == 3 + bool(window)


def test_tpu_blocks_mosaic_cannot_tile_are_an_error(monkeypatch):
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  x = jnp.ones((1, 512, 2, 64))
  with pytest.raises(ValueError, match=r"a key block that is a multiple of 128 \(or blocks as long as the padded "
                                       r"sequence, 512\); the tiles are 64x64"):
    kernels.relative_attention(x, x, x, block_sizes=(64, 64), interpret=False)


@pytest.mark.parametrize("config,message", [
    (dict(position="huang_m1"), "attention kernel 'pallas' cannot compute position method 'huang_m1'"),
    (dict(position="shaw", position_options={"value_term": True}), "cannot compute position method 'shaw'"),
    (dict(position="stick_breaking", causal=True), "'pallas' cannot compute position method 'stick_breaking' with "
                                                   r"options .*: the Pallas kernels drop no attention weights under "
                                                   r"the stick_breaking rule \(attention dropout must be 0\)"),
])
def test_methods_the_kernel_cannot_compute_are_errors(config, message):
  with pytest.raises(ValueError, match=message):
    TransformerConfig.tiny(attention_kernel="pallas", **config)


@pytest.mark.parametrize("interpreter,blocks", [(True, (8, 16)), ("tpu", (16, 16))])
def test_dropout_matches_xla_with_the_same_mask(interpreter, blocks):
  """The kernels' tiles rebuild the hashed mask the ``xla`` path builds densely: equal outputs and gradients (2x2
  tiles or more, each row and head its own salt), with TUPE's untied term of a factor per row (Bp=B: on TPU the
  index maps read each row's block) and the paper's [CLS] reset."""
  rng = np.random.default_rng(4)
  batch, length, heads, head_dim = 2, 21, 2, 8
  f32 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  positions, segments, lengths = packed_rows(rng, batch, length)
  terms = kernels.Terms(alibi=kernels.Alibi(jnp.asarray([0.3, 0.1])),
                        relative=kernels.Relative(0.5 * f32(11, head_dim), max_distance=5, query=True, key=True),
                        untied=kernels.Untied(f32(batch, length, heads, head_dim), f32(batch, length, heads, head_dim),
                                              f32(2, heads), reset="paper"))
  q, k, v, weights = (f32(batch, length, heads, head_dim) for _ in range(4))

  def loss(implementation, q, k, v, terms):
    out = kernels.relative_attention(q, k, v, terms=terms, positions=positions, segment_ids=segments,
                                     lengths=lengths, implementation=implementation, block_sizes=blocks,
                                     interpret=interpreter, dropout_rate=0.3, dropout_seed=1234)
    return jnp.sum(out * weights)

  want, got = (compiled_grad(loss, impl, has_aux=False)(q, k, v, terms)
               for impl in ("xla", "pallas"))
  assert_close_tree(got, want)


def test_the_dropout_mask_keeps_the_rate_and_is_unbiased():
  """Properties of the hashed mask and the reference: keep fraction 1 - rate; independent of other heads, rows
  and seeds (agreement p² + (1-p)²); the average over seeds is the output without dropout."""
  rate, length = 0.1, 256
  index = jnp.arange(length, dtype=jnp.int32)
  masks = [kernels.dropout.keep(kernels.dropout.salts(seed, 2, 3)[:, :, None, None], index[:, None],
                                index[None, :], rate) for seed in (0, 1)]
  assert abs(float(jnp.mean(masks[0])) - (1 - rate)) < 0.003
  agree = (1 - rate) ** 2 + rate ** 2
  for a, b in ((masks[0], masks[1]), (masks[0][:, 0], masks[0][:, 1]), (masks[0][0], masks[0][1]),
               (masks[0][..., :-1, :], masks[0][..., 1:, :])):
    assert abs(float(jnp.mean(a == b)) - agree) < 0.005
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(1, 12, 2, 4)), jnp.float32) for _ in range(3))
  run = lambda seed, rate: kernels.relative_attention(q, k, v, implementation="xla", dropout_rate=rate,
                                                      dropout_seed=seed)
  # a seed is taken modulo 2^32, whatever its type
  same = [kernels.dropout.salts(seed, 2, 3) for seed in (5, 5 + 2 ** 32, np.int64(5 + 2 ** 32), jnp.uint32(5))]
  assert all(np.array_equal(same[0], other) for other in same[1:])
  mean = jnp.mean(jax.vmap(lambda seed: run(seed, 0.5))(jnp.arange(4000)), axis=0)
  np.testing.assert_allclose(mean, run(None, 0.0), atol=0.06)


def test_a_model_on_pallas_trains_with_attention_dropout():
  config = TransformerConfig.tiny(position="alibi", attention_kernel="pallas", num_layers=1, dropout_rate=0.0)
  ids = jnp.asarray(np.random.default_rng(0).integers(5, 128, (2, 16)))
  params = Transformer(config).init(jax.random.key(0), ids)["params"]
  apply = lambda params, key: Transformer(config).apply({"params": params}, ids, deterministic=key is None,
                                                        rngs=None if key is None else {"dropout": key}).last_hidden_state
  plain, dropped, again = apply(params, None), apply(params, jax.random.key(1)), apply(params, jax.random.key(1))
  assert float(jnp.abs(dropped - plain).max()) > 1e-4  # the weights were dropped (float noise: ~1e-7)
  np.testing.assert_array_equal(dropped, again)  # the same key, the same mask
  grads = jax.jit(jax.grad(lambda p: jnp.sum(apply(p, jax.random.key(1)) ** 2)))(params)
  assert all(bool(jnp.isfinite(g).all()) for g in jax.tree_util.tree_leaves(grads))


@pytest.mark.parametrize("terms,message", [
    (lambda: kernels.Terms(alibi=kernels.Alibi(jnp.ones(3))), r"ALiBi slopes have shape \(3,\); expected \(2,\)"),
    (lambda: kernels.Terms(relative=kernels.Relative(jnp.ones((5, 4)), max_distance=3)),
     r"relative table has shape \(5, 4\); expected \(7, 4\) for max_distance=3"),
    (lambda: kernels.Terms(buckets=kernels.Buckets(jnp.ones((8, 2)), num_buckets=32)),
     "bucket table has 8 entries; the options need 32"),
    (lambda: kernels.Terms(untied=kernels.Untied(jnp.ones((1, 8, 2, 4)), jnp.ones((1, 8, 2, 4)), None)),
     r"Untied.theta must have shape \(2, 2\)"),
])
def test_bad_terms_are_errors(terms, message):
  x = jnp.ones((1, 8, 2, 4))
  with pytest.raises(ValueError, match=message):
    kernels.relative_attention(x, x, x, terms=terms())


def test_bad_options_are_errors():
  x = jnp.ones((2, 8, 2, 4))
  table = jnp.ones((8, 2))
  cases = [
      (dict(terms=kernels.Terms(buckets=kernels.Buckets(table, num_buckets=8, max_distance=2))),
       r"max_distance=2 must exceed the 2 exact buckets"),
      (dict(terms=kernels.Terms(buckets=kernels.Buckets(table, num_buckets=8, cls_col=-1))),
       r"Buckets.cls_col=-1 is not an entry of the 8-row table"),
      (dict(terms=kernels.Terms(buckets=kernels.Buckets(table, kind="clip", max_distance=0))),
       r"Buckets.max_distance=0 must be >= 1 with kind='clip'"),
      (dict(lengths=np.array([5, 2, 7])), r"lengths has shape \(3,\); expected \(2,\)"),
      (dict(dropout_rate=0.1), r"dropout_rate=0.1 needs a dropout_seed"),
      (dict(dropout_rate=1.0, dropout_seed=0), r"dropout_rate=1.0 must be in \[0, 1\)"),
      (dict(dropout_rate=0.1, dropout_seed=0.5), r"dropout_seed must be one integer .*; got float32 of shape \(\)"),
      (dict(dropout_rate=0.1, dropout_seed=np.arange(2)), r"dropout_seed must be one integer .*of shape \(2,\)"),
      (dict(block_sizes=(48, 64)), r"block_q=48 must be a positive power of two"),
      (dict(terms=kernels.Terms(relative=kernels.Relative(jnp.ones((3, 4)), window=True)), block_sizes=(8, 4)),
       r"relative vectors read windowed \(Relative.window=True\) need equal query and key blocks; the tiles are 8x4"),
      (dict(terms=kernels.Terms(untied=kernels.Untied(jnp.ones((3, 8, 2, 4)), jnp.ones((1, 8, 2, 4)), jnp.ones((2, 2))))),
       r"Untied.u_q has shape \(3, 8, 2, 4\); expected \(2 or 1, 8, 2, 4\)"),
      (dict(terms=kernels.Terms(relative=kernels.Relative(jnp.ones((3, 4)), window=False)), interpret="tpu"),
       r"Relative.window=False \(gathered relative vectors\) needs gathers, which TPU kernels do not have"),
      (dict(terms=kernels.Terms(relative=kernels.Relative(jnp.ones((3, 4)), window="yes"))),
       r"Relative.window='yes'; allowed: None \(choose\), True, False"),
  ]
  for kwargs, message in cases:
    with pytest.raises(ValueError, match=message):
      kernels.relative_attention(x, x, x, **kwargs)


def test_unknown_implementation_or_interpreter_is_an_error():
  x = jnp.ones((1, 8, 2, 4))
  with pytest.raises(ValueError, match=r"unknown implementation 'triton'; allowed: \['pallas', 'xla'\]"):
    kernels.relative_attention(x, x, x, implementation="triton")
  with pytest.raises(ValueError, match=r"interpret='gpu'; allowed: None, True, False, 'tpu'"):
    kernels.relative_attention(x, x, x, interpret="gpu")


@pytest.mark.parametrize("name", ["cope", "stick_breaking"])
def test_cudnn_refuses_a_weight_rule_and_auto_leaves_it_to_xla(name):
  with pytest.raises(ValueError, match=f"attention kernel 'cudnn' cannot compute position method '{name}' with "
                                       f"options .*: cuDNN computes softmax attention; the {name} rule reads the "
                                       "masked logits"):
    TransformerConfig.tiny(position=name, causal=True, attention_kernel="cudnn")
  spec = TransformerConfig.tiny(position=name, causal=True).position_spec
  assert attention.resolve_kernel("auto", spec, dtype=jnp.bfloat16, dropout=False, platform="gpu") == "xla"


def test_stick_breaking_bf16_gradients_err_like_the_dense_path():
  # the rows' totals of the backward come from the weights the kernels recompute, not from the bf16 output: from the
  # output they put that rounding on every key's gradient unnormalised (dq 9x the dense path's error at L=64)
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(2, 64, 2, 8)), jnp.bfloat16) for _ in range(3))
  weights = jnp.asarray(rng.normal(size=(2, 64, 2, 8)), jnp.float32)
  terms = kernels.Terms(stick_breaking=kernels.StickBreaking())

  def grads(implementation, dtype, **options):
    loss = lambda q, k, v: jnp.sum(kernels.relative_attention(
        q, k, v, terms=terms, causal=True, implementation=implementation, **options).astype(jnp.float32) * weights)
    return jax.jit(jax.grad(loss, argnums=(0, 1)))(*(x.astype(dtype) for x in (q, k, v)))

  exact = grads("xla", jnp.float32)
  error = lambda got: max(float(jnp.max(jnp.abs(g - w)) / jnp.max(jnp.abs(w))) for g, w in zip(got, exact))
  kernel_error = error(grads("pallas", jnp.bfloat16, interpret=True, block_sizes=(8, 8)))
  assert kernel_error < 2 * error(grads("xla", jnp.bfloat16))
