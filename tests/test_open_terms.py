"""Open kernel terms as a researcher writes them, outside posjax: each term is its logits per tile only, with no kernel
or gradient code, and runs fused on both Pallas backends (the generic and the Mosaic TPU interpreter on this CPU) and
in the decode kernels. Checked against a float64 loop written here from the formulas: outputs elementwise, every
gradient (q, k, v and the terms' parameters) along random directions against central differences."""

import functools
import math

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posjax import attention, kernels, positions

HALF = 4  # log buckets per direction: distances 0, 1, 2-3, 4+


@flax.struct.dataclass
class LogBucketTable(kernels.Term):
  """A learned per-head table read at a log-bucketed distance: ``table[h, bucket(p_j - p_i)]``, bucket the bit length
  of ``|r|`` (capped), keys after the query in the upper half."""

  table: jax.Array  # [H, 2 HALF]
  KINDS = {"table": kernels.TABLE}

  def logits(self, tile, s):
    distance = jnp.abs(tile.k_positions - tile.q_positions)
    bits = sum((distance >= 2 ** t).astype(jnp.int32) for t in range(HALF - 1))
    return s + tile.lookup("table", bits + jnp.where(tile.k_positions > tile.q_positions, HALF, 0))


@flax.struct.dataclass
class QueryTemperature(kernels.Term):
  """The content score scaled per query: ``s (1 + beta_h log(1 + p_i))``."""

  beta: jax.Array  # [H]
  KINDS = {"beta": kernels.HEAD}

  def logits(self, tile, s):
    return s * (1.0 + tile.head("beta") * jnp.log1p(tile.q_positions.astype(jnp.float32)))


@flax.struct.dataclass
class GatedEmbeddings(kernels.Term):
  """Per-token rows and embeddings: ``s + w_i g_j + e_i·e_j``, softly capped at ``cap`` (``cap tanh(x / cap)``)."""

  w: jax.Array  # [B, H, L]
  g: jax.Array  # [B, H, L]
  e: jax.Array  # [1, H, L, E]
  cap: float = flax.struct.field(pytree_node=False, default=5.0)
  KINDS = {"w": kernels.ROWS, "g": kernels.ROWS, "e": kernels.EMBEDDINGS}

  def logits(self, tile, s):
    x = s + tile.rows_q("w") * tile.rows_k("g") + tile.inner(tile.embed_q("e"), tile.embed_k("e"))
    return self.cap * jnp.tanh(x / self.cap)


def reference(q, k, v, params, *, positions, segments, valid, causal, cap=5.0):
  """``[B, L, H, V]`` float64, a loop over (b, h, i) from the formulas above; a query with no allowed key averages
  every key (as the op documents)."""
  b_, length, heads, head_dim = q.shape
  group = heads // k.shape[2]
  out = np.zeros((b_, length, heads, v.shape[-1]))
  for b in range(b_):
    for h in range(heads):
      for i in range(length):
        logits = np.full(length, -np.inf)
        for j in range(length):
          if not (valid[b, j] and segments[b, i] == segments[b, j] and (not causal or j <= i)):
            continue
          s = q[b, i, h] @ k[b, j, h // group] / math.sqrt(head_dim)
          if "beta" in params:
            s *= 1.0 + params["beta"][h] * math.log1p(positions[b, i])
          if "table" in params:
            r = positions[b, j] - positions[b, i]
            s += params["table"][h, min(int(abs(r)).bit_length(), HALF - 1) + (HALF if r > 0 else 0)]
          if "w" in params:
            x = s + params["w"][b, h, i] * params["g"][b, h, j] + params["e"][0, h, i] @ params["e"][0, h, j]
            s = cap * math.tanh(x / cap)
          logits[j] = s
        if np.all(np.isinf(logits)):
          logits = np.zeros(length)
        weights = np.exp(logits - logits.max())
        out[b, i, h] = (weights / weights.sum()) @ v[b, :, h // group]
  return out


def make_terms(rng, which, batch, heads, length):
  f32 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  terms = []
  if "temperature" in which:
    terms.append(QueryTemperature(0.3 * f32(heads)))
  if "table" in which:
    terms.append(LogBucketTable(f32(heads, 2 * HALF)))
  if "gated" in which:
    terms.append(GatedEmbeddings(0.5 * f32(batch, heads, length), 0.5 * f32(batch, heads, length),
                                 0.5 * f32(1, heads, length, 3)))
  return terms


def params_of(terms):
  out = {}
  for term in terms:
    out.update({name: getattr(term, name) for name in type(term).KINDS})
  return out


def with_params(terms, params):
  return [term.replace(**{name: params[name] for name in type(term).KINDS}) for term in terms]


def check_against_reference(out, grads, q, k, v, terms, weights, rows):
  """The output and the gradients of ``sum(out * weights)`` (q, k, v, every term parameter) against
  :func:`reference` in float64, each gradient along random directions, relative to the largest gradient."""
  f64 = lambda x: np.asarray(x, np.float64)
  inputs = {"q": f64(q), "k": f64(k), "v": f64(v), **{n: f64(x) for n, x in params_of(terms).items()}}
  grad_of = {"q": grads[0], "k": grads[1], "v": grads[2], **params_of(grads[3])}
  loss = lambda x: float(np.sum(reference(x["q"], x["k"], x["v"], x, **rows) * weights))
  np.testing.assert_allclose(out, reference(inputs["q"], inputs["k"], inputs["v"], inputs, **rows), rtol=2e-5,
                             atol=2e-5)
  largest = max(np.abs(f64(g)).max() for g in grad_of.values())
  rng, eps = np.random.default_rng(1), 1e-4
  for name, x in inputs.items():
    grad = f64(grad_of[name])
    assert grad.shape == x.shape, name
    d = rng.normal(size=x.shape)
    numeric = (loss({**inputs, name: x + eps * d}) - loss({**inputs, name: x - eps * d})) / (2 * eps)
    assert abs(np.sum(grad * d) - numeric) <= 2e-4 * largest * np.linalg.norm(d), (
        f"d{name} along a random direction: {np.sum(grad * d)} (kernel), {numeric} (float64 reference)")


def packed_padded_rows(batch, length):
  """Row 0: two packed documents (positions restarting); row 1: one document right-padded to ``length - 4``."""
  positions = np.stack([np.r_[np.arange(8), np.arange(length - 8)], np.arange(length)])
  segments = np.stack([np.r_[np.zeros(8, int), np.ones(length - 8, int)], np.zeros(length, int)])
  lengths = np.array([length, length - 4])
  return positions[:batch], segments[:batch], lengths[:batch]


@pytest.mark.parametrize("interpreter,causal,kv_heads", [(True, True, 2), ("tpu", False, 1)])
def test_user_terms_match_a_float64_loop_with_every_gradient(interpreter, causal, kv_heads):
  """The three terms at once (applied in order: the temperature, the table, the gated embeddings with their cap); two
  query heads to each k/v head (two over one on TPU, whose interpreter's cost is per head)."""
  rng = np.random.default_rng(0)
  batch, length, heads, head_dim = 2, 21, 2 * kv_heads, 8
  q = jnp.asarray(rng.normal(size=(batch, length, heads, head_dim)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(batch, length, kv_heads, head_dim)), jnp.float32) for _ in range(2))
  terms = make_terms(rng, ("temperature", "table", "gated"), batch, heads, length)
  positions, segments, lengths = packed_padded_rows(batch, length)
  weights = jnp.asarray(rng.normal(size=(batch, length, heads, head_dim)), jnp.float32)
  weights = weights * (np.arange(length)[None, :] < lengths[:, None])[:, :, None, None]

  @functools.partial(jax.jit, static_argnums=0)
  def loss(implementation, q, k, v, terms):
    out = kernels.relative_attention(q, k, v, terms=terms, positions=positions, segment_ids=segments,
                                     lengths=lengths, causal=causal, implementation=implementation,
                                     block_sizes=(8, 8) if interpreter is True else (16, 128), interpret=interpreter)
    return jnp.sum(out * weights), out

  (_, out), grads = jax.value_and_grad(functools.partial(loss, "pallas"), argnums=(0, 1, 2, 3), has_aux=True)(
      q, k, v, terms)
  rows = dict(positions=positions, segments=segments,
              valid=np.arange(length)[None, :] < lengths[:, None], causal=causal)
  check_against_reference(np.asarray(out), grads, q, k, v, terms, np.asarray(weights, np.float64), rows)


@pytest.mark.parametrize("interpreter", [True, "tpu"])
def test_user_terms_decode_as_the_float64_loop(interpreter):
  """Generation: new queries at their cache slots over a cache whose rows and embeddings span the slots, on the
  decode kernels, against the float64 loop's rows at those slots."""
  rng = np.random.default_rng(2)
  batch, slots, heads, kv_heads, head_dim, start, new = 2, 24, 4, 2, 8, 17, 3
  terms = make_terms(rng, ("temperature", "table", "gated"), batch, heads, slots)
  q_full = np.zeros((batch, slots, heads, head_dim), np.float32)
  q_full[:, start:start + new] = rng.normal(size=(batch, new, heads, head_dim))
  k, v = (rng.normal(size=(batch, slots, kv_heads, head_dim)).astype(np.float32) for _ in range(2))
  positions = np.tile(np.arange(slots) + 3, (batch, 1))  # a prompt that started at position 3
  valid = np.arange(slots)[None, :] < np.array([[start + new], [start + new]])
  valid[1, :2] = False  # left padding
  out = kernels.decode_attention(jnp.asarray(q_full[:, start:start + new]), jnp.asarray(k.swapaxes(1, 2)),
                                 jnp.asarray(v.swapaxes(1, 2)), start=start, key_positions=positions, key_valid=valid,
                                 terms=terms, implementation="pallas", interpret=interpreter,
                                 block_sizes=(8, 8) if interpreter is True else (8, 128))
  f64 = lambda x: np.asarray(x, np.float64)
  want = reference(f64(q_full), f64(k), f64(v), {n: f64(x) for n, x in params_of(terms).items()},
                   positions=positions, segments=np.zeros((batch, slots), int), valid=valid, causal=True)
  np.testing.assert_allclose(np.asarray(out), want[:, start:start + new], rtol=2e-5, atol=2e-5)


def test_a_term_whose_input_does_not_fit_its_kind_is_a_one_line_error():
  q = jnp.zeros((1, 4, 2, 8))
  with pytest.raises(ValueError, match=r"LogBucketTable.table \(table\) has shape \(3, 8\); expected \(2, N\)"):
    kernels.relative_attention(q, q, q, terms=LogBucketTable(jnp.zeros((3, 8))), implementation="xla")


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_user_terms_lower_for_gpu_and_tpu(platform, monkeypatch):
  """Forward and backward lower from this CPU for CUDA (Triton) and TPU (Mosaic) with every input kind and a
  modified content score: the derived per-tile gradients use only what both compilers take."""
  if platform == "tpu":
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(2, 40, 2, 24)), jnp.bfloat16) for _ in range(3))
  terms = make_terms(rng, ("temperature", "table", "gated"), 2, 2, 40)

  def loss(q, k, v, terms):
    out = kernels.relative_attention(q, k, v, terms=terms, lengths=np.array([40, 31]), causal=True, interpret=False)
    return jnp.sum(out.astype(jnp.float32))

  call = "xla.gpu.triton" if platform == "cuda" else "tpu_custom_call"
  lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(q, k, v, terms).lower(lowering_platforms=(platform,))
  assert lowered.as_text().count(call) == 3  # forward, dq, dk/dv

  def step(q_BxQxHxK, cache_BxGxTxK):
    return kernels.decode_attention(q_BxQxHxK, cache_BxGxTxK, cache_BxGxTxK, start=jnp.int32(30), terms=terms,
                                    key_positions=np.tile(np.arange(40), (2, 1)), key_valid=np.ones((2, 40), bool),
                                    interpret=False)

  decode = jax.jit(step).trace(q[:, :1], k.swapaxes(1, 2)).lower(lowering_platforms=(platform,))
  assert decode.as_text().count(call) == 1


def test_a_rule_is_its_own_argument():
  """``rule=`` gives the same call as the ``Terms`` field of the rule's name; a second rule is an error."""
  rng = np.random.default_rng(3)
  q, k, v = (jnp.asarray(rng.normal(size=(1, 12, 2, 8)), jnp.float32) for _ in range(3))
  rule = kernels.StickBreaking()
  attend = functools.partial(kernels.relative_attention, q, k, v, causal=True, block_sizes=(8, 8), interpret=True)
  np.testing.assert_array_equal(attend(rule=rule), attend(terms=kernels.Terms(stick_breaking=rule)))
  with pytest.raises(ValueError, match="rule=StickBreaking given with terms that hold the cope rule; give one rule"):
    attend(rule=rule, terms=kernels.Terms(cope=kernels.Cope(jnp.zeros((8, 4)))))


@pytest.mark.parametrize("kernel,terms,dropout,why", [
    ("xla", kernels.Terms(cope=kernels.Cope(jnp.zeros((8, 4)))), True, None),
    ("cudnn", kernels.Terms(stick_breaking=kernels.StickBreaking()), False, "the stick_breaking rule reads the masked"),
    ("cudnn", kernels.Terms(open=(QueryTemperature(jnp.zeros(2)),)), False, "an open term may modify the score"),
    ("cudnn", kernels.Terms(alibi=kernels.Alibi(jnp.zeros(2))), False, None),
    ("pallas", kernels.Terms(stick_breaking=kernels.StickBreaking(), alibi=kernels.Alibi(jnp.zeros(2))), False,
     "do not compute stick_breaking with the alibi term"),
    ("pallas", kernels.Terms(cope=kernels.Cope(jnp.zeros((8, 4)))), True, "drop no attention weights under the cope"),
    ("cudnn", kernels.Terms(alibi=kernels.Alibi(jnp.zeros(2))), True, "dropout on attention weights is on"),
    ("pallas", kernels.Terms(open=(QueryTemperature(jnp.zeros(2)),)), True, None),
    ("decode", kernels.Terms(relative=kernels.Relative(jnp.zeros((5, 8)), 2, query=True)), False,
     "do not build the relative term"),
    ("decode", kernels.Terms(fire=kernels.Fire(*(jnp.zeros(s) for s in ((3,), (3,), (3, 2), (2,), (), ())))), False,
     None),
])
def test_one_table_says_which_kernel_computes_what(kernel, terms, dropout, why):
  got = kernels.capability.refusal(kernel, terms, dropout=dropout)
  assert (got is None) if why is None else (why in got), got


class TemperatureLayer(nn.Module):
  """A user's position method: its layer returns an open term, and its record declares nothing about kernels."""

  spec: positions.PositionSpec

  @nn.compact
  def __call__(self, q, k, state, scale):
    beta = self.param("beta", nn.initializers.zeros, (self.spec.num_heads,))
    return positions.LayerTerms(q, k, terms=kernels.Terms(open=(QueryTemperature(beta),)))


def test_which_kernel_computes_a_method_is_read_from_the_terms_its_modules_return():
  temperature = positions.Method("query_temperature", positions.get("none").options, layer=TemperatureLayer)
  spec = positions.PositionSpec(temperature, temperature.options(), num_heads=2, head_dim=8, max_len=16)
  assert spec.refusal("pallas") is None and spec.refusal("decode") is None
  with pytest.raises(ValueError, match=r"attention kernel 'cudnn' cannot compute position method 'query_temperature' "
                                       r"with options .*: cuDNN adds a bias; an open term may modify the score"):
    attention.check_kernel("cudnn", spec)
  assert attention.resolve_kernel("auto", spec, dtype=jnp.bfloat16, dropout=False, platform="gpu") == "xla"
  multiplicative = positions.make("huang_m2", num_heads=2, hidden_size=16, max_len=16)
  assert "do not compute dense logits" in multiplicative.refusal("pallas")


@flax.struct.dataclass
class Cap(kernels.Term):
  """A soft cap on the score so far: ``5 tanh(s / 5)``."""

  KINDS = {}

  def logits(self, tile, s):
    return 5.0 * jnp.tanh(s / 5.0)


@flax.struct.dataclass
class FixedTable(kernels.Term):
  """A constant per-head table (no gradient) read at the distance."""

  t: jax.Array  # [H, 4]
  KINDS = {"t": kernels.TABLE}
  CONSTANTS = frozenset({"t"})

  def logits(self, tile, s):
    return s + tile.lookup("t", jnp.abs(tile.k_positions - tile.q_positions))


@pytest.mark.parametrize("interpreter", [True, "tpu"])
def test_a_sequence_applies_in_its_order_and_a_constant_table_takes_no_gradient(interpreter):
  """``(Terms(alibi=...), Cap())`` caps the ALiBi-biased score, as the float64 formula says; a TABLE among a term's
  CONSTANTS gets no gradient and breaks nothing."""
  rng = np.random.default_rng(5)
  q, k, v = (jnp.asarray(rng.normal(size=(2, 13, 2, 8)), jnp.float32) for _ in range(3))
  slopes = jnp.asarray([0.5, 0.25])
  attend = lambda q, terms: kernels.relative_attention(q, k, v, terms=terms, causal=True, interpret=interpreter,
                                                       block_sizes=(8, 8) if interpreter is True else (8, 128))
  out = attend(q, (kernels.Terms(alibi=kernels.Alibi(slopes)), Cap()))
  f64 = lambda x: np.asarray(x, np.float64)
  s = np.einsum("bqhd,bkhd->bhqk", f64(q), f64(k)) / np.sqrt(8) - f64(slopes)[None, :, None, None] * np.abs(
      np.arange(13)[None, :] - np.arange(13)[:, None])
  s = np.where(np.tril(np.ones((13, 13), bool)), 5 * np.tanh(s / 5), -np.inf)
  weights = np.exp(s - s.max(-1, keepdims=True))
  want = np.einsum("bhqk,bkhd->bqhd", weights / weights.sum(-1, keepdims=True), f64(v))
  np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
  d_terms = jax.grad(lambda terms: jnp.sum(attend(q, terms) ** 2))((FixedTable(jnp.ones((2, 4))), Cap()))
  assert not np.asarray(d_terms[0].t).any()


def test_an_undeclared_array_field_is_a_one_line_error():
  @flax.struct.dataclass
  class Forgot(kernels.Term):
    scale: float = 2.0  # meant as an option, but a pytree node
    KINDS = {}

    def logits(self, tile, s):
      return s * self.scale

  q = jnp.zeros((1, 4, 2, 8))
  with pytest.raises(ValueError, match=r"Forgot's field\(s\) \['scale'\] are pytree nodes its KINDS do not declare"):
    kernels.relative_attention(q, q, q, terms=Forgot(), implementation="xla")


def test_a_soft_cap_after_alibi_matches_a_float64_loop_on_every_kernel():
  """``kernels.SoftCap`` (Gemma 2's logit cap) after ALiBi, in the sequence's order: ``c tanh((s - m|r|) / c)``."""
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(2, 16, 2, 8)) * 3, jnp.float32) for _ in range(3))
  slopes, cap, p = np.array([0.5, 0.25]), 2.0, np.arange(16)
  s = np.einsum("bqhk,blhk->bhql", *(np.float64(x) for x in (q, k))) / np.sqrt(8)
  s = cap * np.tanh((s - slopes[None, :, None, None] * np.abs(p[None, :] - p[:, None])) / cap)
  s = np.where(p[None, :] <= p[:, None], s, -np.inf)
  w = np.exp(s - s.max(-1, keepdims=True))
  want = np.einsum("bhql,blhk->bqhk", w / w.sum(-1, keepdims=True), np.float64(v))
  terms = (kernels.Terms(alibi=kernels.Alibi(jnp.asarray(slopes, jnp.float32))), kernels.SoftCap(cap))
  for implementation, interpret in (("xla", None), ("pallas", True), ("pallas", "tpu")):
    got = kernels.relative_attention(q, k, v, terms=terms, causal=True, implementation=implementation,
                                     interpret=interpret, block_sizes=None if interpret is None else (8, 8))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, err_msg=f"{implementation} {interpret}")
