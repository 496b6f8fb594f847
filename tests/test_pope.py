"""PoPE against x-transformers' ``PolarEmbedding`` and ``apply_polar_pos_emb`` (lucidrains/x-transformers,
``polar_pos_emb=True``), transcribed in PyTorch and run in float64 on the same weights: a causal attention layer's
output and the gradient of every parameter (the projections and the phase bias, some of it past the clamp), on packed
rows, on the ``xla`` path and the fused kernels."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from posjax import attention, positions
from conftest import PACKED_POSITIONS, PACKED_SEGMENTS, OneLayer, randomize

HEADS, HIDDEN, MAX_LEN = 4, 32, 16


def polar_embedding(t_BxL, dim: int, learned_bias_Hx1xK, base: float = 10000.0):
  """x-transformers' ``PolarEmbedding.forward``: ``(freqs [B, L, K], the bias clamped to [-2π, 0])``."""
  inv_freq = 1.0 / (base ** (torch.arange(0, dim, dtype=torch.float64) / dim))
  freqs = torch.einsum("b i , j -> b i j", t_BxL.to(torch.float64), inv_freq)
  return freqs, learned_bias_Hx1xK.clamp(-2.0 * math.pi, 0.0)


def apply_polar_pos_emb(t, freqs):
  """x-transformers' ``apply_polar_pos_emb``: softplus magnitudes, their cos and sin parts side by side."""
  t = F.softplus(t)
  return torch.cat((t * freqs.cos(), t * freqs.sin()), dim=-1)


def x_transformers_layer(p, x_BxLxD, positions_BxL, segments_BxL):
  """The layer in x-transformers' order (``Attention.forward`` with ``polar_pos_emb``): q, k, v, PoPE on q and on k
  with the bias, ``q·k`` at ``dim_head ** -0.5``, the causal and document mask, softmax, v, the output projection."""
  x = torch.tensor(x_BxLxD, dtype=torch.float64)
  project = lambda name: torch.einsum("bld,dhk->bhlk", x, p[name]["kernel"]) + (
      p[name]["bias"][None, :, None, :] if "bias" in p[name] else 0.0)
  q, k, v = project("query"), project("key"), project("value")
  dim = q.shape[-1]
  freqs, bias = polar_embedding(torch.tensor(positions_BxL), dim, p["position"]["phase_bias"][:, None, :])
  freqs = freqs[:, None]  # b 1 n d, as its Attention rearranges them
  q, k = apply_polar_pos_emb(q, freqs), apply_polar_pos_emb(k, freqs + bias)
  dots = torch.einsum("bhid,bhjd->bhij", q, k) * dim ** -0.5
  n = x.shape[1]
  allowed = (torch.tensor(segments_BxL)[:, :, None] == torch.tensor(segments_BxL)[:, None, :]) & torch.ones(
      n, n, dtype=torch.bool).tril()
  attn = dots.masked_fill(~allowed[:, None], -torch.finfo(torch.float64).max).softmax(dim=-1)
  out = torch.einsum("bhij,bhjd->bhid", attn, v)
  out = torch.einsum("bhlk,hkd->bld", out, p["out"]["kernel"])
  return out + p["out"]["bias"] if "bias" in p["out"] else out


@pytest.mark.parametrize("kernel", ["xla", "pallas"])
def test_a_pope_layer_equals_x_transformers_polar_embedding_in_outputs_and_every_gradient(kernel):
  spec = positions.make("pope", {"bias_init": "uniform"}, num_heads=HEADS, hidden_size=HIDDEN, max_len=MAX_LEN,
                        causal=True)
  rng = np.random.default_rng(0)
  x_BxLxD = rng.normal(size=(*PACKED_POSITIONS.shape, HIDDEN)).astype(np.float32)
  model = OneLayer(spec, kernel)
  params = randomize(jax.eval_shape(model.init, jax.random.PRNGKey(0), x_BxLxD, PACKED_POSITIONS)["params"])
  # the bias mostly in [-2π, 0], some of it past either end, where the clamp holds it and its gradient is 0
  bias = params["attn"]["position"]["phase_bias"] = rng.uniform(-7.0, 0.5, (HEADS, HIDDEN // HEADS)).astype(np.float32)
  mask = attention.Mask(segment_ids=PACKED_SEGMENTS, causal=True)
  weights_BxLxD = rng.normal(size=x_BxLxD.shape).astype(np.float32)
  loss = lambda p: jnp.sum(model.apply({"params": p}, x_BxLxD, PACKED_POSITIONS, mask) * weights_BxLxD)
  out = model.apply({"params": params}, x_BxLxD, PACKED_POSITIONS, mask)
  grads = jax.jit(jax.grad(loss))(params)

  torch_params = jax.tree.map(lambda a: torch.tensor(np.asarray(a, np.float64), requires_grad=True), params["attn"])
  want = x_transformers_layer(torch_params, x_BxLxD, PACKED_POSITIONS, PACKED_SEGMENTS)
  np.testing.assert_allclose(out, want.detach().numpy(), rtol=2e-5, atol=2e-5)
  torch.sum(want * torch.tensor(weights_BxLxD, dtype=torch.float64)).backward()
  want_grads = jax.tree.map(lambda t: t.grad.numpy(), torch_params)
  largest = max(float(np.abs(g).max()) for g in jax.tree.leaves(want_grads))
  for path, g in jax.tree_util.tree_leaves_with_path(want_grads):
    got = grads["attn"]
    for key in path:
      got = got[key.key]
    np.testing.assert_allclose(got, g, atol=2e-5 * largest, err_msg=jax.tree_util.keystr(path))
  bias_grad = want_grads["position"]["phase_bias"]
  clamped = (bias < -2 * math.pi) | (bias > 0)
  assert clamped.any() and np.all(bias_grad[clamped] == 0) and np.abs(bias_grad[~clamped]).max() > 1e-3 * largest
