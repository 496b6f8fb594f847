"""The vision transformer preset (:mod:`posjax.models.vision`) against Hugging Face's ViT on random weights, its
grid positions, its loud errors, and the resolution probe (:mod:`posjax.experiments.resolution`) end to end."""

import dataclasses
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posjax import convert
from posjax import main as posjax_main
from posjax.convert import hf_vit
from posjax.experiments import resolution
from posjax.models import TransformerConfig, TransformerStack
from posjax.models import vision
from posjax.tasks import vision as vision_task

from conftest import load_config, randomize


def test_a_hugging_face_vit_converts_to_the_vit_preset_with_its_logits_and_gradients(tmp_path):
  """``ViTForImageClassification`` on random weights (every weight off its initial value), saved with
  ``save_pretrained`` and read back by the converter: the same logits, and gradients with respect to the pixels,
  the position table and the patch kernel."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  layers, heads, patch, classes = 2, 4, 2, 3
  hf_config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=layers, num_attention_heads=heads,
                                     intermediate_size=64, image_size=8, patch_size=patch, num_channels=3,
                                     num_labels=classes, layer_norm_eps=1e-6, hidden_act="gelu", qkv_bias=True,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
  torch.manual_seed(0)
  hf = transformers.ViTForImageClassification(hf_config).eval()
  with torch.no_grad():  # every weight off its initial value: biases, norms, the class token
    for p in hf.parameters():
      p.add_(0.2 * torch.randn_like(p))
  hf.save_pretrained(tmp_path)
  model, variables = convert.from_hf(str(tmp_path))
  params = variables["params"]
  # ViT's flattened table: a 4 x 4 table and a class row, resized by PyTorch's kernel
  assert (model.config.position, model.patch_size, model.num_classes) == ("absolute_2d", 2, 3)
  assert (model.config.position_spec.options.grid, model.config.position_spec.options.resize) == ((4, 4), "torch")
  pixels = np.random.default_rng(0).normal(size=(2, 8, 8, 3)).astype(np.float32)
  weights = np.random.default_rng(1).normal(size=(2, classes)).astype(np.float32)

  @jax.jit
  def logits_and_grads(p, x):  # one program: the logits, and the gradients of their weighted sum
    logits, pullback = jax.vjp(lambda p, x: model.apply({"params": p}, x), p, x)
    return logits, pullback(jnp.asarray(weights))

  logits, (grads, d_pixels) = logits_and_grads(params, pixels)
  x = torch.tensor(pixels).permute(0, 3, 1, 2).requires_grad_(True)
  hf_logits = hf(pixel_values=x).logits
  (hf_logits * torch.tensor(weights)).sum().backward()
  np.testing.assert_allclose(logits, hf_logits.detach().numpy(), atol=1e-4, rtol=1e-4)
  relative = lambda a, b: np.abs(np.asarray(a) - b).max() / np.abs(b).max()
  assert relative(d_pixels, x.grad.permute(0, 2, 3, 1).numpy()) < 1e-4
  table_grad = hf.vit.embeddings.position_embeddings.grad[0].numpy()
  position = grads["encoder"]["position"]
  assert relative(np.concatenate([position["class_embedding"], position["embedding"].reshape(16, 32)]),
                  table_grad) < 1e-4
  conv_grad = hf.vit.embeddings.patch_embeddings.projection.weight.grad.numpy()
  assert relative(grads["patch_embedding"]["kernel"], conv_grad.transpose(2, 3, 1, 0).reshape(-1, 32)) < 1e-4

  # back out, its weights moved: Hugging Face's logits are posjax's
  moved = jax.tree.map(lambda w: w * 1.1, params)
  with torch.no_grad():
    back = convert.to_hf_vit(model, {"params": moved})(pixel_values=x.detach()).logits.numpy()
  np.testing.assert_allclose(back, logits_and_grads(moved, pixels)[0], atol=1e-4, rtol=1e-4)

  # What the converter cannot represent is a one-line error
  vit = hf_config.to_dict()
  for change, message in [(dict(qkv_bias=False), "qkv_bias=False"), (dict(patch_size=[2, 4]), "square patch_size"),
                          (dict(image_size=9), "does not divide"), (dict(hidden_act="mish"), "hidden_act='mish'"),
                          (dict(model_type="deit"), "model_type='deit'")]:
    with pytest.raises(ValueError, match=message):
      hf_vit.config_from_hf_vit({**vit, **change})
  with pytest.raises(ValueError, match=r"^ViTModel holds no ViTForImageClassification weights"):
    convert.from_hf_vit(transformers.ViTModel(hf_config))
  with pytest.raises(ValueError, match=r"^model_type='deit'; posjax converts \['bert', .*'vit'"):
    convert.from_hf(transformers.DeiTForImageClassification(transformers.DeiTConfig(
        hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8, image_size=4, patch_size=2)))
  # Another size reads the table resized, as Hugging Face's interpolate_pos_encoding: 12 x 8 pixels, 6 x 4 patches
  larger = np.random.default_rng(5).normal(size=(2, 12, 8, 3)).astype(np.float32)
  with pytest.raises(ValueError, match=r"holds a table of grid=\(4, 4\) patches and this image has 6 x 4"):
    jax.eval_shape(model.apply, {"params": params}, larger)
  config_6x4, params_6x4 = vision.regridded(model.config, params, (6, 4))
  with torch.no_grad():
    want = hf(pixel_values=torch.tensor(larger).permute(0, 3, 1, 2), interpolate_pos_encoding=True).logits.numpy()
  got = jax.jit(vision.ImageClassifier(config_6x4, 2, 3).apply)({"params": params_6x4}, larger)
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_a_vit_goes_out_to_hugging_face_with_its_logits():
  """A classifier with ``absolute_2d`` on a 2 x 3 grid (every weight drawn at random) becomes a
  ``ViTForImageClassification`` that gives its logits on 4 x 6 images: the table flattened in raster order, the class
  token's row the table's ``(0, 0)``; what ViT cannot express is refused."""
  torch = pytest.importorskip("torch")
  config = TransformerConfig.vit(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
                                 position_options={"grid": (2, 3)})
  model = vision.ImageClassifier(config, 2, 3)
  pixels = np.random.default_rng(2).normal(size=(2, 4, 6, 3)).astype(np.float32)
  params = randomize(jax.eval_shape(model.init, jax.random.PRNGKey(0), pixels)["params"], seed=3)
  hf = convert.to_hf_vit(model, {"params": params})
  with torch.no_grad():
    want = hf(pixel_values=torch.tensor(pixels).permute(0, 3, 1, 2)).logits.numpy()
  np.testing.assert_allclose(jax.jit(model.apply)({"params": params}, pixels), want, rtol=1e-4, atol=1e-4)
  rotary = dataclasses.replace(config, position="rope_2d", position_options={})
  for bad, message in [(vision.ImageClassifier(config, 2, 3, "mean"), "pooling='mean'"),
                       (vision.ImageClassifier(rotary, 2, 3), "position='rope_2d' acts inside attention"),
                       (vision.ImageClassifier(dataclasses.replace(config, norm="post"), 2, 3), r"\['norm'\]")]:
    with pytest.raises(ValueError, match=message):
      convert.to_hf_vit(bad, {"params": params})
  with pytest.raises(ValueError, match=r"^grid=\(0, 3\) must be two positive counts"):
    convert.to_hf_vit(vision.ImageClassifier(dataclasses.replace(config, position="none", position_options={}), 2, 3),
                      {"params": params}, grid=(0, 3))


def test_a_class_row_is_the_class_tokens_alone():
  """``absolute_2d``'s class row: refused without a class token or beside a schedule's methods (which would read its
  position); what reads the state's positions (a query temperature) finds the class token at 0, not -1."""
  options = {"grid": (2, 2), "class_row": True}
  config = TransformerConfig.vit(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32,
                                 position_options=options,
                                 query_temperature={"kind": "ministral", "original_max_len": 4, "beta": 0.5})
  pixels = np.random.default_rng(0).normal(size=(1, 4, 4, 3)).astype(np.float32)
  model = vision.ImageClassifier(config, 2, 3)
  params = randomize(jax.eval_shape(model.init, jax.random.PRNGKey(0), pixels)["params"])
  assert np.isfinite(jax.jit(model.apply)({"params": params}, pixels)).all()
  for bad in (vision.ImageClassifier(config, 2, 3, "mean"),
              vision.ImageClassifier(dataclasses.replace(config, position_schedule="rope_2d"), 2, 3)):
    with pytest.raises(ValueError, match=r"^absolute_2d's class_row is read by a class token at \(-1, -1\)"):
      jax.eval_shape(bad.init, jax.random.PRNGKey(0), pixels)


def test_grid_positions_the_regridded_table_and_the_errors():
  assert vision.grid_positions(1, 2, 3, True).tolist() == [[0, 1, 2, 3, 4, 5, 6]]
  assert vision.grid_positions(2, 2, 3, False).tolist() == [[[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]]]
  assert vision.grid_positions(3, 1, 2, True).tolist() == [[[0, 0, 0], [0, 0, 0], [0, 0, 1]]]
  config = TransformerConfig.vit(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, max_len=5,
                                 position="absolute_2d", position_options={"grid": (2, 2)})
  model = vision.ImageClassifier(config, 2, 4, "mean")
  params = nn.unbox(jax.jit(model.init)(jax.random.PRNGKey(0), jnp.zeros((1, 4, 4, 3))))["params"]
  larger = jnp.ones((1, 6, 6, 3))
  with pytest.raises(ValueError, match=r"^position method 'absolute_2d' holds a table of grid=\(2, 2\) patches and "
                                       r"this image has 3 x 3: read it through posjax.models.vision.regridded"):
    jax.eval_shape(model.apply, {"params": params}, larger)  # never a NaN or a corner of the table
  at_3, params_3 = vision.regridded(config, params, (3, 3))
  assert at_3.position_options["grid"] == (3, 3)
  assert params_3["encoder"]["position"]["embedding"].shape == (3, 3, 16)
  assert np.isfinite(jax.jit(vision.ImageClassifier(at_3, 2, 4, "mean").apply)({"params": params_3}, larger)).all()
  with pytest.raises(ValueError, match=r"^an image of 5 x 4 pixels does not divide into 2 x 2 patches"):
    jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, 5, 4, 3)))
  with pytest.raises(ValueError, match=r"^option pooling='max' is not allowed"):
    jax.eval_shape(vision.ImageClassifier(config, 2, 4, "max").init, jax.random.PRNGKey(0), jnp.zeros((1, 4, 4, 3)))
  with pytest.raises(ValueError, match="one of them"):
    jax.eval_shape(TransformerStack(config).init, jax.random.PRNGKey(0))


def test_the_images_mark_what_their_labels_say():
  rng = np.random.default_rng(0)
  pixels, labels = vision_task.make_images("orientation", rng, 64, 5, 2, 3, 3, 0.0)
  for image, label in zip(pixels, labels):
    marked = np.argwhere(image[::2, ::2, 0] == 1)
    steps = np.diff(marked[np.lexsort((marked[:, 1], marked[:, 0]))], axis=0)
    assert len(marked) == 3 and (steps == vision_task.DIRECTIONS[label]).all()
  pixels, labels = vision_task.make_images("relation", rng, 64, 5, 1, 2, 3, 0.0)
  for image, label in zip(pixels, labels):
    (r1, c1), (r2, c2) = np.argwhere(image[..., 0] == 1)[0], np.argwhere(image[..., 1] == 1)[0]
    expected = ("right" if c2 > c1 else "left") if abs(c2 - c1) > abs(r2 - r1) else ("below" if r2 > r1 else "above")
    assert ("right", "left", "below", "above")[label] == expected


def test_the_resolution_probe_tables_each_method_at_larger_grids_and_skips_finished_ones(tmp_path):
  config = load_config("resolution", "methods=absolute_2d,tasks=relation,steps=3")
  config.warmup_steps, config.grid, config.eval_grids, config.batch_size, config.eval_batch_size = 1, 3, (3, 4), 8, 16
  config.model.update(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
  results = posjax_main.JOBS["resolution"](config, str(tmp_path))
  accuracy = results["absolute_2d"]["relation"]
  assert set(accuracy) == {"3", "4"} and len(accuracy["4"]) == 1  # the table resized to the larger grid: one seed
  assert json.loads((tmp_path / "results.json").read_text()) == results
  assert "| `absolute_2d` |" in (tmp_path / "results.md").read_text()
  again = posjax_main.JOBS["resolution"].func(config, str(tmp_path), train=lambda *a: pytest.fail("trained again"))
  assert again == results
  # a 1-D learned table past its length cannot run there: unsupported, nothing compiled
  task = vision_task.build(resolution.run_config(config, "absolute", "relation", 0), 8)
  assert task.evaluators["vision@4"].unsupported.startswith("position method 'absolute' has a learned table of "
                                                            "max_len=10 positions")
  assert task.evaluators["vision@3"].unsupported is None
  assert [resolution.cell(v) for v in ("unsupported", [0.5], [0.5, 0.7])] == ["unsupported", "50.0", "60.0 ± 10.0"]
  with pytest.raises(ValueError, match=r"^config.model sets \['dropout_rate', 'position'\], which the image probe"):
    vision_task.model_config(resolution.settings(config, "rope_2d", "relation"), {"position": "rope",
                                                                                 "dropout_rate": 0.1})
