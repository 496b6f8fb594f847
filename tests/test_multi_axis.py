"""Positions over several axes. The rotations against their reference code, run here on the same inputs, with
gradients: M-RoPE against Hugging Face's Qwen2-VL (``apply_multimodal_rotary_pos_emb``) and Qwen3-VL (its rotary
embedding's ``apply_interleaved_mrope``), VideoRoPE's allocation against its
``apply_m_modify_multimodal_rotary_pos_emb``
(transcribed below on Hugging Face's cosines), 2-D axial RoPE and RoPE-Mixed against rope-vit's ``compute_axial_cis``,
``compute_mixed_cis`` and ``apply_rotary_emb`` (transcribed below: the repository is not a package). Then a model:
multi-axis positions through packed rows, the Pallas kernels, the decoding cache and generation; the refusals."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posjax import generate, positions
from posjax.convert import hf_decoder
from posjax.train import step
from posjax.models import Transformer, TransformerConfig

torch = pytest.importorskip("torch")

HEADS, HEAD_DIM = 2, 16
rng0 = np.random.default_rng(0)


def rotated(name, options, positions_BxLxA, q_BxLxHxK, k_BxLxHxK, params=None):
  """posjax's rotated q and k: the method's encoder, then its layer (``params``: the layer's, where it has any)."""
  spec = positions.make(name, options, num_heads=q_BxLxHxK.shape[2], hidden_size=HEADS * HEAD_DIM, max_len=64,
                        head_dim=HEAD_DIM)
  state = spec.method.encoder(spec=spec).apply({}, positions_BxLxA)
  terms = spec.method.layer(spec=spec).apply({"params": params or {}}, q_BxLxHxK, k_BxLxHxK, state, 1.0)
  return terms.q, terms.k


def torch_rotated(apply, q_BxLxHxK, k_BxLxHxK, w_q, w_k, *extra):
  """``(q, k, dq, dk, *dextra)`` of the reference ``apply(q [B, H, L, K], k, *extra)``, through the loss
  ``Σ q' w_q + Σ k' w_k``."""
  q, k = (torch.tensor(np.asarray(x).transpose(0, 2, 1, 3), requires_grad=True) for x in (q_BxLxHxK, k_BxLxHxK))
  extra = [torch.tensor(np.asarray(x), requires_grad=True) for x in extra]
  q_out, k_out = apply(q, k, *extra)
  w_q, w_k = (torch.tensor(w.transpose(0, 2, 1, 3)) for w in (w_q, w_k))
  loss = (q_out * w_q).sum() + (k_out * w_k).sum()
  loss.backward()
  t = lambda x: x.detach().numpy().transpose(0, 2, 1, 3)
  return (t(q_out), t(k_out), t(q.grad), t(k.grad), *[x.grad.numpy() for x in extra])


def check(name, options, positions_BxLxA, reference, params=None, extra=()):
  """posjax's rotation and its gradients (through the same loss) equal the reference's."""
  b, l, _ = positions_BxLxA.shape
  q, k, w_q, w_k = (rng0.normal(size=(b, l, HEADS, HEAD_DIM)).astype(np.float32) for _ in range(4))
  want = torch_rotated(reference, q, k, w_q, w_k, *extra)

  def loss(q, k, params):
    q_out, k_out = rotated(name, options, positions_BxLxA, q, k, params)
    return jnp.sum(q_out * w_q) + jnp.sum(k_out * w_k), (q_out, k_out)

  grads, outs = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, params or {})
  np.testing.assert_allclose(outs[0], want[0], rtol=0, atol=2e-5)
  np.testing.assert_allclose(outs[1], want[1], rtol=0, atol=2e-5)
  for got, expected in zip(grads[:2], want[2:4]):
    np.testing.assert_allclose(got, expected, rtol=0, atol=2e-5 * np.abs(expected).max())
  return grads[2], want[4:]


def vl_positions(b=2, l=9):
  """``[B, L, 3]`` ids of distinct values on each axis (a video's time, height and width)."""
  return rng0.integers(0, 40, (b, l, 3)).astype(np.int32)


def test_mrope_equals_qwen2_vl_and_qwen3_vl_and_videorope():
  from transformers.models.qwen2_vl import modeling_qwen2_vl as qwen2
  from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig
  from transformers.models.qwen3_vl import modeling_qwen3_vl as qwen3
  from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig
  p_BxLx3 = vl_positions()
  ids_3xBxL = torch.tensor(p_BxLx3.transpose(2, 0, 1).astype(np.int64))
  x = torch.zeros(1, dtype=torch.float32)
  qwen2_config = Qwen2VLTextConfig(hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, rope_theta=1e4,
                                   rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
  cos, sin = qwen2.Qwen2VLRotaryEmbedding(qwen2_config)(x, ids_3xBxL)
  check("mrope", {"sections": (2, 3, 3)}, p_BxLx3,
        lambda q, k: qwen2.apply_multimodal_rotary_pos_emb(q, k, cos, sin, [2, 3, 3]))

  def videorope(q, k):  # VideoRoPE's apply_m_modify_multimodal_rotary_pos_emb, transcribed
    sections = [2, 6] * 2
    index, cos_parts, sin_parts = 0, [], []
    for i, section in enumerate(sections[::-1]):
      if i % 2 == 0:
        for j in range(section):
          row = 1 if j % 2 == 0 else 2
          cos_parts.append(cos[row, ..., index:index + 1])
          sin_parts.append(sin[row, ..., index:index + 1])
          index += 1
      else:
        cos_parts.append(cos[0, ..., index:index + section])
        sin_parts.append(sin[0, ..., index:index + section])
        index += section
    c, s = torch.cat(cos_parts, -1)[:, None], torch.cat(sin_parts, -1)[:, None]
    return q * c + qwen2.rotate_half(q) * s, k * c + qwen2.rotate_half(k) * s

  check("mrope", {"sections": (2, 3, 3), "allocation": "videorope"}, p_BxLx3, videorope)

  qwen3_config = Qwen3VLTextConfig(hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, head_dim=HEAD_DIM,
                                   rope_theta=5e5, rope_scaling={"rope_type": "default", "mrope_section": [4, 2, 2],
                                                                 "mrope_interleaved": True})
  cos3, sin3 = qwen3.Qwen3VLTextRotaryEmbedding(qwen3_config)(x, ids_3xBxL)
  check("mrope", {"sections": (4, 2, 2), "allocation": "interleaved", "max_timescale": 5e5}, p_BxLx3,
        lambda q, k: qwen3.apply_rotary_pos_emb(q, k, cos3, sin3))
  # text ids ([B, L], the same on every axis) are RoPE's
  text_BxL = p_BxLx3[..., 0]
  ones = jnp.ones((2, 9, 2, 16))
  got = rotated("mrope", {"sections": (4, 2, 2), "allocation": "interleaved"}, text_BxL, ones, ones)
  want = rotated("rope", {}, text_BxL, ones, ones)
  np.testing.assert_array_equal(got[0], want[0])


def vit_grid(rows, cols):
  """rope-vit's ``init_t_xy`` on a ``rows x cols`` grid: ``(t_x, t_y)`` float32, the column and the row."""
  t = torch.arange(rows * cols, dtype=torch.float32)
  return t % cols, torch.div(t, cols, rounding_mode="floor")


def vit_apply(x, cis):
  """rope-vit's ``apply_rotary_emb`` on one of q, k (``[B, H, N, K]``; ``cis`` ``[N, K/2]`` or ``[H, N, K/2]``)."""
  x_ = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
  return torch.view_as_real(x_ * cis).flatten(3)


def grid_positions(rows, cols, b=2):
  """``[B, 1 + rows·cols, 2]``: a class token at (0, 0), then the patches' (row, column) in raster order."""
  r, c = np.divmod(np.arange(rows * cols), cols)
  return np.repeat(np.concatenate([[[0, 0]], np.stack([r, c], -1)])[None], b, 0).astype(np.int32)


def with_class_token(rotate):
  """rope-vit's attention: the class token (first) not rotated, the patches rotated."""
  return lambda q, k, *extra: tuple(torch.cat([x[:, :, :1], rotate(x[:, :, 1:], *extra)], 2) for x in (q, k))


def test_axial_rope_equals_rope_vit():
  rows, cols, theta = 3, 4, 100.0
  freqs = 1.0 / (theta ** (torch.arange(0, HEAD_DIM, 4)[:HEAD_DIM // 4].float() / HEAD_DIM))
  t_x, t_y = vit_grid(rows, cols)
  fx, fy = torch.outer(t_x, freqs), torch.outer(t_y, freqs)
  cis = torch.cat([torch.polar(torch.ones_like(fx), fx), torch.polar(torch.ones_like(fy), fy)], -1)  # compute_axial_cis
  check("rope_2d", {}, grid_positions(rows, cols), with_class_token(lambda x: vit_apply(x, cis)))


def test_rope_mixed_equals_rope_vit_with_the_frequencies_gradient():
  rows, cols = 3, 4
  t_x, t_y = vit_grid(rows, cols)
  spec = positions.make("rope_mixed", {}, num_heads=HEADS, hidden_size=HEADS * HEAD_DIM, max_len=64)
  layer = spec.method.layer(spec=spec)
  p = grid_positions(rows, cols)
  state = spec.method.encoder(spec=spec).apply({}, p)
  q = jnp.zeros((2, p.shape[1], HEADS, HEAD_DIM))
  frequencies_2xHxF = np.asarray(layer.init(jax.random.key(3), q, q, state, 1.0)["params"]["frequencies"].value)
  # rope-vit's init_random_2d_freqs: per head, the row's frequencies m sin(α), m sin(α + π/2), the column's cosines
  magnitude = 10.0 ** -(np.arange(0, HEAD_DIM, 4) / HEAD_DIM)
  alpha_H = np.arctan2(frequencies_2xHxF[0, :, 0], frequencies_2xHxF[1, :, 0])
  np.testing.assert_allclose(frequencies_2xHxF[1], np.concatenate(
      [magnitude * np.cos(alpha_H[:, None]), magnitude * np.cos(alpha_H[:, None] + np.pi / 2)], -1), atol=1e-6)
  frequencies_2xHxF = frequencies_2xHxF + rng0.normal(size=frequencies_2xHxF.shape).astype(np.float32) * 0.1

  def mixed(x, freqs_2xHF):  # compute_mixed_cis of one layer (rope-vit's freqs: the column's first), then apply
    fx = (t_x[:, None] @ freqs_2xHF[0][None]).view(-1, HEADS, HEAD_DIM // 2).permute(1, 0, 2)
    fy = (t_y[:, None] @ freqs_2xHF[1][None]).view(-1, HEADS, HEAD_DIM // 2).permute(1, 0, 2)
    return vit_apply(x, torch.polar(torch.ones_like(fx), fx + fy))

  theirs = frequencies_2xHxF[::-1].reshape(2, HEADS * HEAD_DIM // 2).copy()
  got, (want,) = check("rope_mixed", {}, p, with_class_token(mixed), {"frequencies": frequencies_2xHxF}, [theirs])
  want = want.reshape(2, HEADS, HEAD_DIM // 2)[::-1]
  np.testing.assert_allclose(got["frequencies"], want, rtol=0, atol=2e-5 * np.abs(want).max())
  assert step.decays({"frequencies": 0, "kernel": 0}) == {"frequencies": False, "kernel": True}  # rope-vit's


def decoder(position="mrope", **fields):
  return TransformerConfig.decoder(vocab_size=61, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                   intermediate_size=48, max_len=64, dtype="float32", position=position,
                                   position_options={"sections": (1, 1, 2)} if position == "mrope" else {}, **fields)


def document(text, grid, rng):
  """A Qwen2-VL document's M-RoPE ids (``get_rope_index``): ``text`` tokens, an image of ``grid = (t, h, w)``
  patches (its ids the text's next plus its time, row and column), then ``text`` tokens from the largest id + 1."""
  head = np.repeat(np.arange(text)[:, None], 3, 1)
  t, h, w = np.meshgrid(*(np.arange(n) for n in grid), indexing="ij")
  image = np.stack([t.ravel(), h.ravel(), w.ravel()], -1) + text
  tail = np.repeat((image.max() + 1 + np.arange(text))[:, None], 3, 1)
  ids = np.concatenate([head, image, tail]).astype(np.int32)
  return ids, rng.integers(0, 61, len(ids))


def test_packed_multi_axis_rows_equal_each_document_alone_on_xla_and_pallas():
  """Two documents packed in a row (each its own ids), in one order and in the other, give each document's logits
  alone, on the xla path and on the Pallas kernels (interpreted), gradients included."""
  rng = np.random.default_rng(2)
  (p1, t1), (p2, t2) = document(2, (1, 2, 3), rng), document(3, (2, 2, 1), rng)
  positions_2xLx3 = np.stack([np.concatenate([p1, p2]), np.concatenate([p2, p1])])
  tokens_2xL = np.stack([np.concatenate([t1, t2]), np.concatenate([t2, t1])])
  segments_2xL = np.stack([np.repeat([1, 2], [len(t1), len(t2)]), np.repeat([1, 2], [len(t2), len(t1)])])
  module = Transformer(decoder(), head="lm")
  variables = jax.jit(module.init)(jax.random.key(0), tokens_2xL)
  alone = [jax.jit(module.apply)(variables, t[None], positions=p[None]).logits[0] for p, t in ((p1, t1), (p2, t2))]
  fused = Transformer(decoder(attention_kernel="pallas"), head="lm")

  def loss(params, module):
    logits = module.apply({"params": params}, tokens_2xL, positions=positions_2xLx3, segment_ids=segments_2xL).logits
    return jnp.sum(jnp.sin(logits)), logits

  (_, packed), grads = jax.jit(jax.value_and_grad(lambda p: loss(p, module), has_aux=True))(variables["params"])
  np.testing.assert_allclose(packed, np.stack([np.concatenate(alone), np.concatenate(alone[::-1])]), rtol=0,
                             atol=2e-5)
  (_, on_pallas), pallas_grads = jax.jit(jax.value_and_grad(lambda p: loss(p, fused), has_aux=True))(
      variables["params"])
  np.testing.assert_allclose(on_pallas, packed, rtol=0, atol=2e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-4 * np.abs(b).max()), pallas_grads, grads)


def test_decoding_and_generation_follow_the_multi_axis_ids():
  """A prompt's M-RoPE ids (text, an image, text) prefilled, then tokens one at a time: every step's logits equal
  the full forward's; generation continues each row from its prompt's largest id + 1 on every axis (Qwen2-VL's
  ``rope_deltas``), its tokens and logits those of the full forward over the same ids."""
  rng = np.random.default_rng(3)
  p_Lx3, tokens_L = document(2, (1, 2, 2), rng)
  module = Transformer(decoder(), head="lm")
  variables = jax.jit(module.init)(jax.random.key(1), tokens_L[None])
  prompt = 6
  steps = 4
  out, logits = generate.generate(module, variables, tokens_L[None, :prompt], positions=p_Lx3[None, :prompt],
                                  max_new_tokens=steps, return_logits=True)
  # the full forward over the prompt and the generated tokens, the new ones at the prompt's largest id + 1, + 2, ...
  new_ids = p_Lx3[:prompt].max() + 1 + np.arange(steps - 1)
  full_ids = np.concatenate([p_Lx3[:prompt], np.repeat(new_ids[:, None], 3, 1)])[None]
  full = jax.jit(module.apply)(variables, out[:, :prompt + steps - 1], positions=full_ids).logits
  np.testing.assert_allclose(logits[0], full[0, prompt - 1:], rtol=0, atol=2e-5)
  np.testing.assert_array_equal(out[0, prompt:], np.argmax(full[0, prompt - 1:], -1))


def test_a_continuation_follows_the_largest_id_or_videoropes_largest_time_id():
  """Qwen2-VL's ``get_rope_index`` continues from ``positions.max() + 1`` over the real tokens, VideoRoPE's
  ``get_t_scale_rope_index`` from ``positions[0].max() + 1`` (its height and width ids run ahead of time)."""
  ids_BxPx3 = np.array([[[0, 0, 0], [1, 1, 1], [2, 5, 7], [2, 6, 8]], [[9, 9, 9], [0, 0, 0], [1, 4, 3], [1, 2, 2]]])
  mask_BxP = np.array([[1, 1, 1, 1], [0, 1, 1, 1]], bool)  # row 1 left-padded: its pad's ids are not read
  for allocation, want in (("sections", [8, 4]), ("videorope", [2, 1])):
    spec = positions.make("mrope", {"sections": (2, 1, 1), "allocation": allocation}, num_heads=2, hidden_size=16,
                          max_len=64, causal=True)
    np.testing.assert_array_equal(generate.continued_position(spec, jnp.asarray(ids_BxPx3), mask_BxP), want)


def test_positions_of_other_axes_are_refused_in_one_line():
  module = Transformer(decoder("rope"), head="lm")
  ids = jnp.zeros((1, 4), jnp.int32)
  variables = jax.eval_shape(module.init, jax.random.key(0), ids)
  with pytest.raises(ValueError, match=r"^position method 'rope' reads one position axis; these positions have 3 "
                                       r"\(shape \(1, 4, 3\)\); the methods of several axes: mrope, rope_2d"):
    jax.eval_shape(module.apply, variables, ids, positions=jnp.zeros((1, 4, 3), jnp.int32))
  vit = Transformer(decoder("rope_2d"), head="lm")
  with pytest.raises(ValueError, match=r"'rope_2d' reads 2 position axes; positions must be \[B, L, 2\], got shape "
                                       r"\(1, 4\)"):
    jax.eval_shape(vit.init, jax.random.key(0), ids)
  odd = Transformer(dataclasses.replace(decoder(), position_options={"sections": (1, 1, 1)}), head="lm")
  with pytest.raises(ValueError, match=r"mrope's sections \[1, 1, 1\] must sum to head_dim / 2 = 4"):
    jax.eval_shape(odd.init, jax.random.key(0), ids)
  wide = Transformer(dataclasses.replace(decoder(), position_options={"sections": (1, 1, 2),
                                                                      "allocation": "interleaved"}), head="lm")
  with pytest.raises(ValueError, match=r"sections \[1, 1, 2\] need 3h <= 5 and 3w <= 4"):
    jax.eval_shape(wide.init, jax.random.key(0), ids)
  text = {**VL_TEXT, "model_type": "qwen3_vl_text"}
  for rope, message in (({"mrope_section": [2, 1, 1], "mrope_interleaved": False},
                         r"mrope_interleaved=False; Hugging Face's qwen3_vl ignores it and runs M-RoPE's interleaved"),
                        ({"mrope_section": [2, 1, 2]}, r"mrope_section=\[2, 1, 2\]; it must sum to head_dim / 2 = 4")):
    with pytest.raises(ValueError, match=message):
      hf_decoder.config_from_hf({"model_type": "qwen3_vl", "text_config": {**text, "rope_scaling": rope}})


VL_TEXT = dict(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=48, max_position_embeddings=64, rope_theta=1e4)
VL_CASES = {  # config class, model class, the text config's fields, a small vision tower's
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration",
                 {"rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]}},
                 {"depth": 1, "embed_dim": 16, "num_heads": 2, "hidden_size": 32}),
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration",
                   {"rope_scaling": {"type": "mrope", "mrope_section": [2, 1, 1]}},
                   {"depth": 1, "hidden_size": 16, "num_heads": 2, "intermediate_size": 16, "out_hidden_size": 32}),
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration",
                 {"head_dim": 8, "rope_scaling": {"rope_type": "default", "mrope_section": [2, 1, 1],
                                                  "mrope_interleaved": True}},
                 {"depth": 1, "hidden_size": 16, "num_heads": 2, "intermediate_size": 16, "out_hidden_size": 32}),
}


@pytest.mark.parametrize("name", VL_CASES)
def test_qwen_vl_text_decoders_convert_with_their_logits_for_text_and_for_multi_axis_ids(name, tmp_path,
                                                                                        monkeypatch):
  """A vision-language checkpoint saved by ``save_pretrained`` (random weights, every one moved from its initial
  value) comes in as its text decoder with M-RoPE: posjax's logits equal Hugging Face's for text (its
  ``get_rope_index`` without images: equal ids on the three axes) and for given ``[3, B, L]`` ids; the decoder,
  its weights moved, goes back out into that checkpoint (in memory, or from a converted run on the command line),
  with the same logits and the vision tower as it was."""
  import transformers
  from posjax import convert
  config_class, model_class, text, vision = VL_CASES[name]
  torch.manual_seed(0)
  config = getattr(transformers, config_class)(text_config={**VL_TEXT, **text}, vision_config=vision)
  model = getattr(transformers, model_class)(config).eval()
  with torch.no_grad():
    for parameter in model.parameters():
      parameter.add_(0.2 * torch.randn_like(parameter))
  model.save_pretrained(tmp_path / "hf", safe_serialization=True)
  module, variables = convert.from_hf(tmp_path / "hf")
  assert module.config.position == "mrope"
  rng = np.random.default_rng(4)
  ids_BxL = rng.integers(0, 50, (2, 10))
  p_BxLx3 = rng.integers(0, 30, (2, 10, 3))
  apply = jax.jit(module.apply)
  with torch.no_grad():
    want_text = model(input_ids=torch.tensor(ids_BxL)).logits.numpy()
    want_ids = model(input_ids=torch.tensor(ids_BxL), position_ids=torch.tensor(p_BxLx3.transpose(2, 0, 1))).logits
  for want, given in ((want_text, None), (want_ids.numpy(), jnp.asarray(p_BxLx3, jnp.int32))):
    got = apply(variables, jnp.asarray(ids_BxL, jnp.int32), positions=given).logits
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
  # out: the decoder, its weights moved, into the checkpoint it came from, whose vision tower stays
  with pytest.raises(ValueError, match=r"^an M-RoPE decoder goes out as the text decoder of a vision-language "
                                       r"checkpoint of \['qwen2_vl', 'qwen2_5_vl', 'qwen3_vl'\].*give vision_from="):
    convert.to_hf(module.config, variables)
  moved = jax.tree.map(lambda w: w * 1.1, variables)
  if name == "qwen2_vl":  # the command line: the run converted from the checkpoint goes back into it
    from posjax.convert import __main__ as cli
    monkeypatch.setattr(hf_decoder, "from_hf_decoder", lambda source: (module, moved))  # a run trained after it
    cli.hf_to_posjax(str(tmp_path / "hf"), str(tmp_path / "run"))
    cli.posjax_to_hf(str(tmp_path / "run"), str(tmp_path / "out"))
    exported = getattr(transformers, model_class).from_pretrained(tmp_path / "out").eval()
  else:  # the checkpoint's directory, or the model in memory (which stays as it was)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    exported = convert.to_hf(module.config, moved, vision_from=model if name == "qwen2_5_vl" else tmp_path / "hf")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
  with torch.no_grad():
    got = exported(input_ids=torch.tensor(ids_BxL), position_ids=torch.tensor(p_BxLx3.transpose(2, 0, 1))).logits
  want = apply(moved, jnp.asarray(ids_BxL, jnp.int32), positions=jnp.asarray(p_BxLx3, jnp.int32)).logits
  np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-4 * np.abs(want).max())
  vision = {k: v for k, v in model.state_dict().items() if "visual." in k}
  assert vision and all(torch.equal(exported.state_dict()[k], v) for k, v in vision.items())


def mae_2d_sincos(width, size):
  """MAE's ``get_2d_sincos_pos_embed(width, size)`` (models/pos_embed.py), transcribed in float64: ``[size², width]``
  in raster order."""
  grid = np.stack(np.meshgrid(np.arange(size, dtype=np.float64), np.arange(size, dtype=np.float64)))  # w first

  def one_axis_embed(dim, pos):
    omega = 1.0 / 10000 ** (np.arange(dim // 2, dtype=np.float64) / (dim / 2.0))
    out = np.einsum("m,d->md", pos.reshape(-1), omega)
    return np.concatenate([np.sin(out), np.cos(out)], axis=1)

  return np.concatenate([one_axis_embed(width // 2, grid[0]), one_axis_embed(width // 2, grid[1])], axis=1)


def test_grid_embeddings_equal_mae_and_a_learned_table_read_at_each_row_and_column():
  """``sinusoidal_2d`` equals MAE's 2-D sin-cos embedding on a raster grid; ``absolute_2d`` reads its table at each
  ``(row, column)``, NaN outside it, and its table resized to its own grid is itself."""
  from posjax.positions import grid
  size, width = 4, 16
  p = grid_positions(size, size)[:, 1:]  # the patches, raster order
  spec = positions.make("sinusoidal_2d", num_heads=2, hidden_size=width, max_len=64)
  state = spec.method.encoder(spec=spec).apply({}, p)
  np.testing.assert_allclose(state.embedding[0], mae_2d_sincos(width, size), rtol=0, atol=1e-5)
  spec = positions.make("absolute_2d", {"grid": (3, 5)}, num_heads=2, hidden_size=width, max_len=64)
  encoder = spec.method.encoder(spec=spec)
  ids = np.array([[[0, 0], [2, 4], [1, 3], [3, 0], [0, 5], [-1, 2]]], np.int32)
  variables = encoder.init(jax.random.key(0), ids)
  table = np.asarray(variables["params"]["embedding"].value)
  got = np.asarray(encoder.apply(variables, ids).embedding[0])
  np.testing.assert_array_equal(got[:3], table[[0, 2, 1], [0, 4, 3]])
  assert np.isnan(got[3:]).all()  # a row, a column and a negative row outside the 3 x 5 grid
  np.testing.assert_allclose(grid.resized_table(table, 3, 5), table, rtol=0, atol=1e-6)
  assert grid.resized_table(table, 6, 10).shape == (6, 10, width)
