"""PaTH attention: the op's products against a float64 loop of the paper's formula (outputs and every gradient along
random directions), a whole layer against the official PyTorch reference (fla's ``PaTHAttention`` with its
``naive_path_attn``, transcribed and run in float64 on the same weights), decoding in chunks equal to the full
forward, and what the kernels do not compute refused in one line."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import flax.linen as nn

from posjax import attention, generate, kernels, positions
from posjax.models import Transformer, TransformerConfig
from conftest import randomize
from reference import FusedAttention

HEADS, HIDDEN = 4, 32
# row 0: two packed documents (positions restarting); row 1: one document, right-padded from token 9
POSITIONS = np.array([[0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4], list(range(12))], np.int32)
SEGMENTS = np.array([[0] * 7 + [1] * 5, [0] * 12], np.int32)
VALID = np.array([[True] * 12, [True] * 9 + [False] * 3])


# one row: two packed documents (7 tokens, then 3), then 2 of padding
ROW_POSITIONS = np.array([[0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 0, 0]], np.int32)
ROW_SEGMENTS = np.array([[0] * 7 + [1] * 5], np.int32)
ROW_VALID = np.array([[True] * 10 + [False] * 2])


@pytest.mark.parametrize("implementation,interpret", [("xla", None), ("pallas", None), ("pallas", "tpu")],
                         ids=["xla", "gpu", "tpu"])
def test_the_op_matches_a_float64_loop_with_every_gradient(implementation, interpret):
  """A packed, padded, causal row with 2 query heads on a key head, the forget gate beside, chunks of 5 over 12
  tokens (a padded last chunk): the output and the gradients of q, k, v, w, β and the gate's sums. The Pallas
  kernels (in the GPU's and the TPU's interpreter): 2x2 tiles in three blocks of 4 (a band of two column tiles, two
  copies of the keys; both documents cross a block's boundary)."""
  rng = np.random.default_rng(0)
  b, length, heads, kv_heads, dim = 1, 12, 2, 1, 6
  f32 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  q, k, v = f32(b, length, heads, dim), f32(b, length, kv_heads, dim), f32(b, length, kv_heads, dim)
  w = f32(b, length, kv_heads, dim)
  w = w / jnp.linalg.norm(w, axis=-1, keepdims=True)
  beta = jnp.asarray(rng.uniform(0.0, 2.0, (b, length, kv_heads)), jnp.float32)
  c = jnp.asarray(np.cumsum(-rng.uniform(0.0, 0.3, (b, heads, length)), axis=-1), jnp.float32)
  weights = rng.normal(size=(b, length, heads, dim))

  def attend(q, k, v, w, beta, c):
    terms = kernels.Terms(path=kernels.Path(w, beta, chunk=5, band=4), forget=kernels.Forget(c))
    return kernels.relative_attention(q, k, v, terms=terms, positions=ROW_POSITIONS, segment_ids=ROW_SEGMENTS,
                                      padding=ROW_VALID, causal=True, implementation=implementation,
                                      interpret=interpret, block_sizes=(2, 2) if implementation == "pallas" else None)

  inputs = dict(q=q, k=k, v=v, w=w, beta=beta, c=c)
  out, backward = jax.jit(lambda x: jax.vjp(lambda y: attend(**y), x))(inputs)
  grads, = backward(jnp.asarray(weights, jnp.float32))
  reference = FusedAttention(ROW_POSITIONS, ROW_SEGMENTS, ROW_VALID, causal=True)
  scale = dim ** -0.5
  f64 = {name: np.asarray(x, np.float64) for name, x in inputs.items()}
  run = lambda x: reference(x["q"], x["k"], x["v"], scale=scale, path=dict(w=x["w"], beta=x["beta"]),
                            forget_c=x["c"])
  np.testing.assert_allclose(out, run(f64), rtol=2e-5, atol=2e-5)
  loss = lambda x: float(np.sum(run(x) * weights))
  largest = max(float(np.abs(g).max()) for g in grads.values())
  eps = 1e-4
  for name, x in f64.items():
    d = rng.normal(size=x.shape)
    numeric = (loss({**f64, name: x + eps * d}) - loss({**f64, name: x - eps * d})) / (2 * eps)
    got = float(np.sum(np.asarray(grads[name], np.float64) * d))
    assert abs(got - numeric) <= 2e-4 * largest * np.linalg.norm(d), f"d{name}: {got} (op), {numeric} (reference)"


def naive_path_attn(q, k, v, w, beta, g, scale, chunk):
  """fla's ``naive_path_attn`` (tests/ops/test_path_attn.py), its steps kept: the UT transform per chunk by forward
  substitution, the chunk-local logits, each query walked back over the earlier chunks, the gate's sums, then
  ``softmax(scale A) v``; q ``[B, T, HQ, D]``, k, v, w ``[B, T, H, D]``, beta ``[B, T, H]``, g ``[B, T, HQ]``."""
  hq, h = q.shape[2], k.shape[2]
  q, k, v, w, beta, g = (x.transpose(1, 2) for x in (q, k, v, w, beta, g))
  g_cumsum = g.cumsum(-1)
  k, v, w = (x.unsqueeze(2).expand(-1, -1, hq // h, -1, -1).flatten(1, 2) for x in (k, v, w))
  beta = beta.unsqueeze(2).expand(-1, -1, hq // h, -1).flatten(1, 2)
  b, heads, length, _ = q.shape
  if length % chunk:
    padding = chunk - length % chunk
    q, k, w = (F.pad(x, (0, 0, 0, padding)) for x in (q, k, w))
    beta = F.pad(beta, (0, padding))
  seq_len = q.shape[2]
  w_beta = w * beta[..., None]
  q, k, w, w_beta = (x.reshape(b, heads, seq_len // chunk, chunk, x.shape[-1]) for x in (q, k, w, w_beta))
  mask = torch.triu(torch.ones(chunk, chunk, dtype=torch.bool), diagonal=0)
  t = -(w_beta @ w.transpose(-1, -2)).masked_fill(mask, 0)
  for i in range(1, chunk):
    t[..., i, :i] = t[..., i, :i].clone() + (t[..., i, :, None].clone() * t[..., :, :i].clone()).sum(-2)
  t = t + torch.eye(chunk, dtype=q.dtype)
  twbk = t @ (w_beta @ k.transpose(-1, -2)).masked_fill(mask, 0)
  qw = (q @ w.transpose(-1, -2)).tril()
  twb = t @ w_beta
  a_local = (q @ k.transpose(-1, -2)).tril() - qw @ twbk
  q = q - qw @ twb
  k = k - twbk.transpose(-1, -2) @ w
  chunk_products = w.transpose(-1, -2) @ twb
  a = torch.zeros(b, heads, seq_len, seq_len, dtype=q.dtype)
  q, k = (x.reshape(b, heads, seq_len, x.shape[-1]) for x in (q, k))
  for i in range(0, seq_len, chunk):
    q_i = q[:, :, i:i + chunk].clone()
    for j in range(i - chunk, -chunk, -chunk):
      a[:, :, i:i + chunk, j:j + chunk] = q_i @ k[:, :, j:j + chunk].transpose(-1, -2)
      q_i = q_i - q_i @ chunk_products[:, :, j // chunk]
  for i in range(seq_len // chunk):
    a[:, :, i * chunk:(i + 1) * chunk, i * chunk:(i + 1) * chunk] = a_local[:, :, i]
  a = a.masked_fill(~torch.tril(torch.ones(seq_len, seq_len, dtype=torch.bool)), float("-inf"))[:, :, :length, :length]
  a = a + g_cumsum[..., None] - g_cumsum[..., None, :]
  return ((a * scale).softmax(-1) @ v).transpose(1, 2)


def official_layer(p, x_BxLxD, documents, forget: bool, chunk: int):
  """fla's ``PaTHAttention.forward`` (training: ``cu_seqlens`` over the packed documents), in float64: the q, k, v
  projections, ``w`` through the low-rank or full projection, ``ShortConvolution(kv_dim, 3)`` (a depthwise causal
  convolution restarted per document, SiLU) and ``l2_norm`` (eps 1e-6), ``beta = 2 sigmoid(bt_proj)``, ``g =
  logsigmoid(g_proj)``, the attention per document, the output projection."""
  x = torch.tensor(x_BxLxD, dtype=torch.float64)
  project = lambda name: torch.einsum("bld,dhk->blhk", x, p[name]["kernel"])
  q, k, v = project("query"), project("key"), project("value")
  pos = p["position"]
  if "w_down" in pos:
    w = torch.einsum("blr,rhk->blhk", x @ pos["w_down"]["kernel"], pos["w_up"]["kernel"])
  else:
    w = torch.einsum("bld,dhk->blhk", x, pos["w"]["kernel"])
  b, length, kv_heads, dim = w.shape
  conv_weight = pos["w_conv"].reshape(pos["w_conv"].shape[0], -1).T[:, None]  # nn.Conv1d's [channels, 1, width]
  beta = torch.sigmoid(x @ pos["beta"]["kernel"] + pos["beta"]["bias"]) * 2
  g = (F.logsigmoid(x @ pos["gate"]["kernel"] + pos["gate"]["bias"]) if forget
       else torch.zeros(b, length, q.shape[2], dtype=torch.float64))
  out = torch.zeros_like(q)
  for row, bounds in enumerate(documents):
    for start, end in bounds:
      take = lambda t: t[row:row + 1, start:end]
      w_doc = take(w).reshape(1, end - start, kv_heads * dim).transpose(1, 2)
      w_doc = F.silu(F.conv1d(F.pad(w_doc, (conv_weight.shape[-1] - 1, 0)), conv_weight, groups=conv_weight.shape[0]))
      w_doc = w_doc.transpose(1, 2).reshape(1, end - start, kv_heads, dim)
      w_doc = w_doc / torch.sqrt((w_doc * w_doc).sum(-1, keepdim=True) + 1e-6)
      out[row:row + 1, start:end] = naive_path_attn(take(q), take(k), take(v), w_doc, take(beta), take(g),
                                                    dim ** -0.5, chunk)
  return torch.einsum("blhk,hkd->bld", out, p["out"]["kernel"])


class Layer(nn.Module):
  """The method's encoder-level module and an attention layer without biases (as the official layer)."""

  spec: positions.PositionSpec

  @nn.compact
  def __call__(self, x_BxLxD, positions_BxL, mask=None):
    state = self.spec.method.encoder(spec=self.spec, name="pos")(positions_BxL)
    return attention.SelfAttention(self.spec, use_bias=False, name="attn")(x_BxLxD, state, mask)


@pytest.mark.parametrize("kv_heads,options", [(4, {}), (2, {"forget": True, "w_rank": 0})])
def test_a_path_layer_equals_the_official_layer_in_outputs_and_every_gradient(kv_heads, options):
  """Multi-head attention with the low-rank w projection (the default); grouped k/v heads with the full one and
  PaTH-FoX's gate. Two packed documents in a row, each its own sequence for the official code."""
  forget = options.get("forget", False)
  spec = positions.make("path", {**options, "chunk": 4}, num_heads=HEADS, hidden_size=HIDDEN, max_len=16,
                        causal=True, num_kv_heads=kv_heads)
  rng = np.random.default_rng(0)
  x_BxLxD = rng.normal(size=(2, 12, HIDDEN)).astype(np.float32)
  model = Layer(spec)
  shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), x_BxLxD, POSITIONS)["params"]
  params = randomize(shapes, scale=0.3)
  mask = attention.Mask(segment_ids=SEGMENTS, causal=True)  # row 1 unpadded here: one document of 12
  weights_BxLxD = rng.normal(size=x_BxLxD.shape)
  apply = lambda p: model.apply({"params": p}, x_BxLxD, np.array([POSITIONS[0], range(12)]), mask)
  out, backward = jax.jit(lambda p: jax.vjp(apply, p))(params)
  grads, = backward(jnp.asarray(weights_BxLxD, jnp.float32))
  assert ("w_down" in params["attn"]["position"]) == ("w_rank" not in options)

  torch_params = jax.tree.map(lambda a: torch.tensor(np.asarray(a, np.float64), requires_grad=True), params["attn"])
  want = official_layer(torch_params, x_BxLxD, [[(0, 7), (7, 12)], [(0, 12)]], forget, chunk=3)
  np.testing.assert_allclose(out, want.detach().numpy(), rtol=2e-5, atol=2e-5)
  torch.sum(want * torch.tensor(weights_BxLxD)).backward()
  want_grads = jax.tree.map(lambda t: t.grad.numpy(), torch_params)
  largest = max(float(np.abs(g).max()) for g in jax.tree.leaves(want_grads))
  got_grads = grads["attn"]
  for path, g in jax.tree_util.tree_leaves_with_path(want_grads):
    got = got_grads
    for key in path:
      got = got[key.key]
    np.testing.assert_allclose(got, g, atol=2e-5 * largest, err_msg=jax.tree_util.keystr(path))


def test_decoding_in_chunks_and_generation_equal_the_full_forward():
  """A layer's cache filled by a prompt of 130 (longer than the smallest cache prefix a step may read), a chunk of 3
  (the products among new tokens and over the cached keys), then single tokens (each carrying the cache; the last
  on the Pallas decode kernels, interpreted): every output equals the full forward's, and so does the layer's on
  the Pallas kernels (the method's band option: three blocks); a GQA PaTH-FoX
  decoder's greedy tokens and step logits equal its full forward's, a left-padded prompt's those of the prompt
  alone."""
  spec = positions.make("path", {"chunk": 16, "band": 64}, num_heads=HEADS, hidden_size=HIDDEN, max_len=160,
                        causal=True, num_kv_heads=2)
  layer = attention.SelfAttention(spec, use_bias=False)
  rng = np.random.default_rng(1)
  x_1xLxD = jnp.asarray(rng.normal(size=(1, 135, HIDDEN)), jnp.float32)
  state = lambda start, end: positions.PositionState(positions=jnp.arange(start, end, dtype=jnp.int32)[None])
  params = randomize(jax.eval_shape(layer.init, jax.random.PRNGKey(0), x_1xLxD, state(0, 135),
                                    attention.Mask(causal=True))["params"], scale=0.3)
  full = jax.jit(layer.apply)({"params": params}, x_1xLxD, state(0, 135), attention.Mask(causal=True))
  cache = jax.eval_shape(lambda: layer.init(jax.random.PRNGKey(0), jnp.zeros((1, 140, HIDDEN)), state(0, 140),
                                            attention.Mask(causal=True), decode=True)["cache"])
  cache = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), cache)
  step = jax.jit(lambda cache, x, state: layer.apply({"params": params, "cache": cache}, x, state,
                                                     attention.Mask(causal=True), decode=True, mutable=["cache"]))
  kernel_layer = attention.SelfAttention(spec, use_bias=False, kernel="pallas")  # its steps on the decode kernels
  fused = jax.jit(kernel_layer.apply)({"params": params}, x_1xLxD, state(0, 135), attention.Mask(causal=True))
  np.testing.assert_allclose(fused, full, atol=2e-5 * float(jnp.abs(full).max()), rtol=0)  # three blocks of 64
  kernel_step = jax.jit(lambda cache, x, state: kernel_layer.apply(
      {"params": params, "cache": cache}, x, state, attention.Mask(causal=True), decode=True, mutable=["cache"]))
  outs = []
  for start, end in ((0, 130), (130, 133), (133, 134), (134, 135)):
    out, mutated = (kernel_step if start == 134 else step)(cache, x_1xLxD[:, start:end], state(start, end))
    cache = mutated["cache"]
    outs.append(out)
  np.testing.assert_allclose(jnp.concatenate(outs, axis=1), full, atol=2e-5 * float(jnp.abs(full).max()), rtol=0)

  config = TransformerConfig.decoder(vocab_size=61, hidden_size=HIDDEN, num_layers=2, num_heads=HEADS, num_kv_heads=2,
                                     intermediate_size=48, max_len=32, dtype="float32", position="path",
                                     position_options={"forget": True, "chunk": 4})
  module = Transformer(config, head="lm")
  variables = randomize(jax.jit(module.init)(jax.random.key(1), jnp.zeros((1, 8), jnp.int32)), scale=0.3)
  prompt = rng.integers(0, 61, (2, 5))
  prompt[0, :2] = 0  # row 0: a prompt of 3 left-padded (positions -1 there: its convolution reads no padding)
  mask = np.array([[0, 0, 1, 1, 1], [1] * 5])
  tokens, cached = (np.asarray(x) for x in generate.generate(module, variables, prompt, attention_mask=mask,
                                                              max_new_tokens=7, return_logits=True))
  apply = jax.jit(module.apply)
  for row, start in ((0, 2), (1, 0)):  # each row's full forward over its own tokens
    logits = np.asarray(apply(variables, jnp.asarray(tokens[row:row + 1, start:])).logits)[0]
    np.testing.assert_array_equal(tokens[row, 5:], np.argmax(logits[4 - start:-1], axis=-1))
    np.testing.assert_allclose(cached[row], logits[4 - start:-1], atol=2e-5 * np.abs(logits).max(), rtol=0)


def test_what_the_kernels_do_not_compute_is_refused_in_one_line():
  spec = positions.make("path", num_heads=HEADS, hidden_size=HIDDEN, max_len=16, causal=True)
  with pytest.raises(ValueError, match=r"PaTH's content term is a product of Householder factors"):
    attention.check_kernel("cudnn", spec)
  attention.check_kernel("pallas", spec)
  q = jnp.zeros((1, 8, 2, 4))
  terms = kernels.Terms(path=kernels.Path(jnp.zeros((1, 8, 2, 4)), jnp.zeros((1, 8, 2))))
  with pytest.raises(ValueError, match=r"query_block and a mesh that splits the sequence"):
    kernels.relative_attention(q, q, q, terms=terms, causal=True, implementation="xla", query_block=4)
  with pytest.raises(ValueError, match=r"PaTH's products \(Terms.path\) are a decoder's: they need causal=True"):
    kernels.relative_attention(q, q, q, terms=terms)
  with pytest.raises(ValueError, match=r"do not compute PaTH's content term with the stick_breaking term"):
    kernels.relative_attention(q, q, q, terms=terms, causal=True, rule=kernels.StickBreaking())
  with pytest.raises(ValueError, match=r"Path.band=6 must be a multiple of the 4x4 tiles"):
    kernels.relative_attention(q, q, q, terms=terms.replace(path=terms.path.replace(band=6)), causal=True,
                               block_sizes=(4, 4))
  with pytest.raises(ValueError, match=r"exists in a decoder's form only"):
    positions.make("path", num_heads=HEADS, hidden_size=HIDDEN, max_len=16)
  for beta_max in (0, 2.5):
    with pytest.raises(ValueError, match=rf"beta_max={beta_max} must be in \(0, 2\]"):
      positions.make("path", {"beta_max": beta_max}, num_heads=HEADS, hidden_size=HIDDEN, max_len=16, causal=True)
