"""TUPE's untied term folded into q and k (``posjax.kernels.fold``) against the dense ``xla`` path and, for outputs and
gradients, the float64 reference (``tests/reference.py``): the logits, the outputs and the gradients of q, k, v and every position input (u_q, u_k, θ, the bucket table) for each [CLS]
reset, packed and padded rows, shared (Bp=1) and per-row (Bp=B) factors; the Pallas kernels on folded inputs in
the generic interpreter; and the cuDNN path's inputs (q', k', bias) of BERT models with TUPE-A and TUPE-R against
their ``xla`` logits."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posjax import attention, kernels
from posjax.kernels import fold, xla
from posjax.models import TransformerConfig, Transformer
from test_kernels import assert_matches_reference, compiled_grad

B, L, H, K = 3, 13, 2, 8
# Row 0: one sequence; row 1: three packed segments, each with a [CLS] at its first token; row 2: two segments.
POSITIONS = np.array([list(range(13)), [0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4, 5], [*range(7), *range(6)]], np.int32)
SEGMENTS = np.array([[0] * 13, [1] * 4 + [2] * 3 + [3] * 6, [1] * 7 + [2] * 6], np.int32)
LENGTHS = np.array([13, 11, 9])  # rows 1 and 2 right-padded


def make_terms(rng, reset, buckets, shared, alibi=False, relative=False):
  """Random terms: the untied term (Bp=1 when ``shared``), T5 buckets with TUPE-R's [CLS] entries under the
  official reset, and optionally ALiBi and Method 4's relative vectors beside them."""
  f32 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  bp = 1 if shared else B
  fields = dict(untied=kernels.Untied(f32(bp, L, H, K), f32(bp, L, H, K), None if reset == "none" else f32(2, H),
                                      reset=reset))
  if buckets:
    official = reset == "official"
    fields["buckets"] = kernels.Buckets(f32(33, H), num_buckets=32, max_distance=20,
                                        cls_row=16 if official else None, cls_col=32 if official else None)
  if alibi:
    fields["alibi"] = kernels.Alibi(jnp.asarray([0.5, 0.25]))
  if relative:
    fields["relative"] = kernels.Relative(0.5 * f32(7, K), max_distance=3, query=True, key=True)
  return kernels.Terms(**fields)


def assert_close_tree(got, want, rtol=2e-5, atol=2e-5):
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree_util.tree_leaves(got)):
    scale = max(1.0, float(np.abs(x).max()))
    np.testing.assert_allclose(y, x, rtol=rtol, atol=atol * scale, err_msg=jax.tree_util.keystr(path))


CASES = [(reset, buckets, shared) for reset in ("official", "paper", "none") for buckets in (False, True)
         for shared in (True, False)]


@pytest.mark.parametrize("reset,buckets,shared", CASES)
def test_folded_logits_are_the_xla_logits(reset, buckets, shared):
  """``scale q'·k'`` plus the bias of what is left equals every logit of the dense path (masked pairs included)."""
  rng = np.random.default_rng(0)
  terms = make_terms(rng, reset, buckets, shared)
  q, k = (jnp.asarray(rng.normal(size=(B, L, H, K)), jnp.float32) for _ in range(2))
  scale = 0.25
  q_f, k_f, rest = fold.fold_untied(q, k, terms, POSITIONS, scale, multiple=8)
  assert rest.untied is None and q_f.shape == k_f.shape == (B, L, H, 24 if reset != "none" else 16)
  bias = xla.position_bias(rest, POSITIONS, scale)
  got = scale * jnp.einsum("bqhd,bkhd->bhqk", q_f, k_f) + (0.0 if bias is None else bias)
  np.testing.assert_allclose(got, xla.logits(q, k, terms, POSITIONS, scale), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("reset,buckets,shared", CASES)
def test_fold_matches_xla_outputs_and_gradients(reset, buckets, shared):
  """``untied="fold"`` against the in-tile form on the dense path: outputs and the gradients of q, k, v and every
  term array through a random projection, with packed segments and padding; ALiBi and relative vectors ride
  along in half the cases (the fold keeps the content scale, so they are unchanged)."""
  rng = np.random.default_rng(1)
  extra = shared == buckets
  terms = make_terms(rng, reset, buckets, shared, alibi=extra, relative=extra)
  q, k, v, weights = (jnp.asarray(rng.normal(size=(B, L, H, K)), jnp.float32) for _ in range(4))

  def loss(untied, q, k, v, terms):
    out = kernels.relative_attention(q, k, v, terms=terms, positions=POSITIONS, segment_ids=SEGMENTS,
                                     lengths=LENGTHS, implementation="xla", untied=untied)
    return jnp.sum(out * weights), out

  want, got = (compiled_grad(loss, untied)(q, k, v, terms)
               for untied in ("tile", "fold"))
  assert_close_tree(got, want)
  assert_matches_reference(got[1], got[0], q, k, v, terms, weights, positions=POSITIONS, segments=SEGMENTS,
                           lengths=LENGTHS)


@pytest.mark.parametrize("reset,shared", [("official", False), ("paper", True), ("none", False)])
def test_pallas_with_the_fold_matches_xla(reset, shared):
  """The Pallas kernels (the GPU kernels, in the generic interpreter) on folded inputs: no untied term left in the
  tiles, the same outputs and gradients as the dense path. The fold is done before either backend is chosen
  (``posjax.kernels.relative_attention``), so the TPU kernels see only wider q and k with the terms left, which
  their own tests cover."""
  interpreter = True
  rng = np.random.default_rng(2)
  terms = make_terms(rng, reset, buckets=True, shared=shared, alibi=reset == "none")
  q, k, v, weights = (jnp.asarray(rng.normal(size=(B, L, H, K)), jnp.float32) for _ in range(4))

  def loss(implementation, untied, q, k, v, terms):
    out = kernels.relative_attention(q, k, v, terms=terms, positions=POSITIONS, segment_ids=SEGMENTS,
                                     lengths=LENGTHS, implementation=implementation, untied=untied,
                                     block_sizes=(8, 16), interpret=interpreter)
    return jnp.sum(out * weights), out

  want, got = (compiled_grad(functools.partial(loss, impl), untied)(q, k, v, terms)
               for impl, untied in (("xla", "tile"), ("pallas", "fold")))
  assert_close_tree(got, want)
  assert_matches_reference(got[1], got[0], q, k, v, terms, weights, positions=POSITIONS, segments=SEGMENTS,
                           lengths=LENGTHS)


def test_the_fold_lowers_for_gpu():
  """Folded q and k (K=24 -> F=50, padded to 64 there) lower to the three Triton kernels."""
  rng = np.random.default_rng(0)
  f32 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  terms = kernels.Terms(buckets=kernels.Buckets(f32(33, 2), cls_row=16, cls_col=32),
                        untied=kernels.Untied(f32(1, 40, 2, 24), f32(1, 40, 2, 24), f32(2, 2)))
  q, k, v = (f32(2, 40, 2, 24).astype(jnp.bfloat16) for _ in range(3))

  def loss(q, k, v, terms):
    out = kernels.relative_attention(q, k, v, terms=terms, lengths=np.array([40, 31]), interpret=False,
                                     untied="fold", platform="gpu")
    return jnp.sum(out.astype(jnp.float32))

  lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(q, k, v, terms).lower(lowering_platforms=("cuda",))
  assert lowered.as_text().count("xla.gpu.triton") == 3


MODELS = [("tupe_a", {}), ("tupe_a", {"cls_reset": "paper"}), ("tupe_a", {"cls_reset": "none"}),
          ("tupe_r", {}), ("tupe_r", {"cls_reset": "paper"}),
          ("tupe_r", {"cls_reset": "none", "relative_distance": "clip", "max_distance": 4}),
          ("tupe_r", {"share_across_layers": False})]


def cudnn_run(monkeypatch, position, options, packed, dtype="float32"):
  """A 2-layer BERT on the ``cudnn`` path (cuDNN's call swapped for jax's XLA implementation, which takes the
  same inputs): every call's (q, k, v, bias, mask), the sown ``xla`` logits, and the model and its inputs."""
  calls, fused = [], attention.fused_attention

  def recording(q, k, v, bias, mask, scale):
    calls.append(dict(q=q, k=k, v=v, bias=bias, mask=mask, scale=scale))
    return fused(q, k, v, bias, mask, scale, implementation="xla")

  monkeypatch.setattr(attention, "fused_attention", recording)
  monkeypatch.setattr(attention, "FUSED_DTYPES", (jnp.float32, jnp.bfloat16))
  config = TransformerConfig.tiny(position=position, position_options=options, attention_kernel="cudnn", num_layers=2,
                                  dropout_rate=0.0, attention_dropout_rate=0.0, dtype=dtype)
  rng = np.random.default_rng(4)
  batch, length = 2, 12
  ids = jnp.asarray(rng.integers(5, 100, (batch, length)), jnp.int32)
  kwargs = dict(attention_mask=jnp.asarray(np.arange(length)[None] < np.array([[12], [10]])))
  if packed:
    kwargs.update(positions=jnp.asarray([list(range(12)), [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]]),
                  segment_ids=jnp.asarray([[0] * 12, [0] * 5 + [1] * 7]))
  model = Transformer(config)
  params = model.init(jax.random.key(0), ids)["params"]
  params = jax.tree.map(lambda p: p + 0.3 * jnp.asarray(rng.normal(size=p.shape), p.dtype), params)
  calls.clear()
  _, state = model.apply({"params": params}, ids, mutable=["intermediates"], **kwargs)
  return calls, state["intermediates"], model, params, ids, kwargs


def logits_of(layers):
  return [x for name in sorted(layers) if name.startswith("layer_")
          for x in jax.tree.leaves(layers[name]["attention"]["attention_logits"])]


@pytest.mark.parametrize("packed", [False, True], ids=["Bp=1", "packed"])
@pytest.mark.parametrize("position,options", MODELS, ids=[f"{m}-{'-'.join(map(str, o.values()))}" for m, o in MODELS])
def test_cudnn_inputs_give_the_xla_logits(position, options, packed, monkeypatch):
  """What the model gives cuDNN — folded q', k' (width a multiple of 8, v as wide), a bias of only the bucket
  term (none for TUPE-A; segments are added after) — makes ``scale q'·k' + bias`` the ``xla`` logits at every pair in
  the same segment (cross-segment pairs carry the segment mask)."""
  calls, intermediates, *_ = cudnn_run(monkeypatch, position, options, packed)
  want = logits_of(intermediates["encoder"])
  assert len(calls) == len(want) == 2
  width = 16 if options.get("cls_reset") == "none" else 24  # TransformerConfig.tiny: K=8, F=2K(+2) padded to 8s
  for call, logits in zip(calls, want):
    assert call["q"].shape[-1] == call["k"].shape[-1] == call["v"].shape[-1] == width
    assert (call["bias"] is None) == (position == "tupe_a")
    got = call["scale"] * jnp.einsum("bqhd,bkhd->bhqk", call["q"], call["k"])
    if call["bias"] is not None:
      got = got + call["bias"]
    same = np.asarray(call["mask"].pairs(call["q"].shape[1]) if call["mask"].segment_ids is not None else True)
    np.testing.assert_allclose(np.where(same, got, 0.0), np.where(same, logits, 0.0), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("position,options", [MODELS[0], MODELS[4], MODELS[6]],
                         ids=["tupe_a", "tupe_r-paper", "tupe_r-per-layer"])
def test_a_model_on_the_cudnn_path_matches_xla_with_gradients(position, options, monkeypatch):
  """The folded cuDNN path's outputs and parameter gradients (through jax's XLA attention) equal the model's on
  ``xla``, packed and padded."""
  _, _, model, params, ids, kwargs = cudnn_run(monkeypatch, position, options, packed=True)
  reference = Transformer(dataclasses.replace(model.config, attention_kernel="xla"))
  real = kwargs["attention_mask"][..., None]

  def loss(model, params):
    out = model.apply({"params": params}, ids, **kwargs).last_hidden_state
    return jnp.sum(jnp.sin(out) * real), out

  (_, want), want_grads = jax.jit(jax.value_and_grad(functools.partial(loss, reference), has_aux=True))(params)
  (_, got), got_grads = jax.jit(jax.value_and_grad(functools.partial(loss, model), has_aux=True))(params)
  np.testing.assert_allclose(got * real, want * real, rtol=1e-5, atol=1e-5)
  assert_close_tree(got_grads, want_grads, rtol=1e-4, atol=1e-5)


def test_cudnn_keeps_the_dense_bias_where_the_fold_does_not_fit(monkeypatch):
  """Past cuDNN's head-dim limit the layer gets q, k, v as they are and the dense untied bias."""
  monkeypatch.setattr(attention, "cudnn_max_head_dim", lambda: 16)
  calls, *_ = cudnn_run(monkeypatch, "tupe_r", {}, packed=False)
  assert all(c["q"].shape[-1] == 8 and c["bias"] is not None for c in calls)


def test_bf16_cudnn_inputs_are_bf16(monkeypatch):
  calls, *_ = cudnn_run(monkeypatch, "tupe_r", {}, packed=True, dtype="bfloat16")
  assert all(c["q"].dtype == c["k"].dtype == c["v"].dtype == jnp.bfloat16 for c in calls)
  assert all(c["q"].shape[-1] == 24 for c in calls)


def test_what_cannot_fold_is_an_error():
  rng = np.random.default_rng(0)
  terms = make_terms(rng, "official", True, True)
  q = jnp.zeros((B, L, H, K))
  with pytest.raises(ValueError, match="scale must be finite and nonzero"):
    fold.fold_untied(q, q, terms, POSITIONS, 0.0)
  relative = kernels.Terms(relative=kernels.Relative(jnp.zeros((5, K)), 2))
  with pytest.raises(ValueError, match="relative vectors add q_i·a_r and a_r·k_j: give q and k"):
    xla.position_bias(relative, POSITIONS, scale=1.0)
  with pytest.raises(ValueError, match=r"untied='dense'; allowed: \['tile', 'fold'\]"):
    kernels.relative_attention(q, q, q, terms=terms, implementation="xla", untied="dense")
