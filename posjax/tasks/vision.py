"""Image probes as a task of the training loop: a tiny vision transformer (:mod:`posjax.models.vision`) classifies
synthetic images in which where the marked patches lie is the whole difficulty, trained at one grid of patches and
evaluated at larger ones (:mod:`posjax.experiments.resolution` runs every method and tabulates them: the resolution
question of rope-vit, Heo et al. 2024, on images a CPU trains on).

An image is a ``grid x grid`` array of ``patch x patch`` pixel patches with ``channels`` channels, Gaussian noise of
standard deviation ``noise`` everywhere, and marked patches (every pixel of a channel at 1):

- ``orientation``: ``segment`` patches in a line on channel 0, horizontal, vertical, diagonal or anti-diagonal (4
  classes), anywhere it fits. Without positions the marked patches are a bag and the classes are alike.
- ``relation``: one patch on channel 0 and one on channel 1 (``channels >= 2``), anywhere with ``|Δrow| != |Δcol|``;
  the class is where the second lies from the first, right, left, below or above (the larger of the two offsets).

[choice] A larger image shows the same scene at a higher resolution (ImageNet's images read at 384 pixels instead
of 224): ``scale_objects=True`` stretches a segment to ``segment * grid / train_grid`` patches (halves rounded up);
with False it keeps ``segment`` patches, the scene grown around it instead. Relations need nothing stretched.
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from posjax.data import features
from posjax.models import TransformerConfig
from posjax.models import vision
from posjax.tasks.probe import SeededBatches, local_rows
from posjax.train.task import Evaluator, Task, summed_metrics

TASKS = ("orientation", "relation")
CLASSES = 4
# orientation's lines, class by class: (Δrow, Δcol) from one marked patch to the next
DIRECTIONS = ((0, 1), (1, 0), (1, 1), (1, -1))


def segment_length(settings, grid: int) -> int:
  """The orientation segment's patches at ``grid``: ``segment``, stretched with the grid where ``scale_objects``."""
  if not settings.scale_objects:
    return settings.segment
  return max(2, int(np.floor(settings.segment * grid / settings.grid + 0.5)))  # halves up


def check(settings) -> None:
  """One line for a task, grid, segment or channel count the images cannot have."""
  if settings.task not in TASKS:
    raise ValueError(f"unknown image probe task {settings.task!r}; allowed: {list(TASKS)}")
  for field in ("grid", "patch_size", "channels", "segment"):
    if not isinstance(settings[field], int) or settings[field] <= 0:
      raise ValueError(f"vision.{field} must be a positive int, got {settings[field]!r}")
  if settings.task == "relation" and settings.channels < 2:
    raise ValueError(f"image probe task 'relation' marks two patches on channels 0 and 1: it needs channels >= 2, "
                     f"got {settings.channels}")
  if settings.task == "relation" and settings.grid < 2:
    raise ValueError(f"image probe task 'relation' needs a grid of at least 2 x 2 patches, got {settings.grid}")
  if settings.task == "orientation" and not 2 <= settings.segment <= settings.grid:
    raise ValueError(f"vision.segment={settings.segment} must be between 2 and the grid, {settings.grid} patches")
  smaller = [g for g in settings.eval_grids if not isinstance(g, int) or g < settings.grid]
  if smaller:
    raise ValueError(f"vision.eval_grids={tuple(settings.eval_grids)}: each must be an int >= the training grid "
                     f"({settings.grid}); got {smaller}")


def make_images(task: str, rng: np.random.Generator, batch: int, grid: int, patch: int, channels: int,
                segment: int, noise: float):
  """``(pixel_values [batch, grid·patch, grid·patch, channels] float32, labels [batch] int32)``."""
  marks_BxGxGxC = np.zeros((batch, grid, grid, channels), np.float32)
  labels_B = rng.integers(0, CLASSES, size=batch)
  for b in range(batch):
    if task == "orientation":
      dr, dc = DIRECTIONS[labels_B[b]]
      span = segment - 1
      r0 = rng.integers(0, grid - dr * span)
      c0 = rng.integers(-dc * span if dc < 0 else 0, grid - (dc * span if dc > 0 else 0))
      steps = np.arange(segment)
      marks_BxGxGxC[b, r0 + dr * steps, c0 + dc * steps, 0] = 1
    else:  # relation: two patches whose larger offset names the class
      while True:
        (r1, c1), (r2, c2) = rng.integers(0, grid, size=(2, 2))
        if abs(r2 - r1) != abs(c2 - c1):
          break
      marks_BxGxGxC[b, r1, c1, 0] = marks_BxGxGxC[b, r2, c2, 1] = 1
      dr, dc = r2 - r1, c2 - c1
      labels_B[b] = (0 if dc > 0 else 1) if abs(dc) > abs(dr) else (2 if dr > 0 else 3)
  pixels = np.repeat(np.repeat(marks_BxGxGxC, patch, 1), patch, 2)
  pixels = pixels + noise * rng.standard_normal(pixels.shape).astype(np.float32)
  return pixels.astype(np.float32), labels_B.astype(np.int32)


def tokens(settings, grid: int) -> int:
  """The model's tokens for an image of ``grid x grid`` patches: the patches and, with ``pooling="cls"``, the class
  token."""
  return grid ** 2 + (settings.pooling == "cls")


def draw(settings, rng: np.random.Generator, batch: int, grid: int) -> dict:
  """A global batch of ``settings.task``'s images at ``grid``, as the loss reads it."""
  pixels, labels = make_images(settings.task, rng, batch, grid, settings.patch_size, settings.channels,
                               segment_length(settings, grid), settings.noise)
  return {"pixel_values": pixels, "labels": labels}


# model fields the probe sets itself (the method, its options, the grid's tokens) or cannot honour (no dropout: the
# loss runs the model deterministic)
OWN_FIELDS = ("position", "position_options", "max_len", "dropout_rate", "attention_dropout_rate")


def model_config(settings, model: ml_collections.ConfigDict | dict) -> TransformerConfig:
  """The probe's vision transformer (:meth:`TransformerConfig.vit` with ``model``'s fields) for ``settings.method``
  at the training grid: ``max_len`` its tokens, ``absolute_2d``'s table that grid unless the options name one. A
  field of :data:`OWN_FIELDS` in ``model`` is an error."""
  fields = dict(model.to_dict() if hasattr(model, "to_dict") else model)
  own = sorted(set(fields) & set(OWN_FIELDS))
  if own:
    raise ValueError(f"config.model sets {own}, which the image probe sets itself (the method and its options come "
                     f"from vision.method / vision.options, max_len from the grid) or cannot honour (dropout)")
  options = dict(settings.get("options") or {})
  if settings.method == "absolute_2d":
    options.setdefault("grid", (settings.grid, settings.grid))
  return TransformerConfig.vit(**{**dict(max_len=tokens(settings, settings.grid), position=settings.method,
                                         position_options=options), **fields})


def build(config, local_batch: int) -> Task:
  """One (method, task) image probe for the training loop (``config.task = "vision"``; ``config.vision``: method,
  options, task, grid, patch_size, channels, segment, scale_objects, noise, pooling, eval_grids); evaluators of kind
  ``vision`` report accuracy at each grid as ``<name>@<grid>`` (``unsupported`` where the method cannot read it: a
  1-D learned table past its length)."""
  del local_batch
  settings = config.vision
  check(settings)
  vit = model_config(settings, config.model)
  model = vision.ImageClassifier(vit, settings.patch_size, CLASSES, settings.pooling)

  def sums(model, params, batch):
    logits = model.apply({"params": params}, batch["pixel_values"])
    correct = (jnp.argmax(logits, -1) == batch["labels"]).astype(jnp.float32)
    return {"loss": optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]), "correct": correct,
            "weight": jnp.ones_like(correct)}

  def loss_fn(params, batch, rng):
    del rng  # no dropout
    rows = sums(model, params, batch)
    return jnp.sum(rows["loss"]), {"correct": jnp.sum(rows["correct"]), "weight": jnp.sum(rows["weight"])}

  eval_batch = config.get("eval_batch_size") or config.batch_size
  evaluators = {}
  for name in config.evals:
    for grid in settings.eval_grids:
      at_grid, _ = vision.regridded(vit, None, (grid, grid))
      try:
        at_grid.position_spec.check_length(tokens(settings, grid))
      except ValueError as error:
        evaluators[f"{name}@{grid}"] = Evaluator([], None, None, unsupported=str(error), metric_names=("accuracy",))
        continue
      other = vision.ImageClassifier(at_grid, settings.patch_size, CLASSES, settings.pooling)

      def predict(params, batch, other=other, grid=grid):
        return sums(other, vision.regridded(vit, params, (grid, grid))[1], batch)

      # the same images for every seed: the seeds' spread is the training's, not the evaluation's sample
      batch = draw(settings, np.random.default_rng([99, TASKS.index(settings.task), grid]), eval_batch, grid)
      evaluators[f"{name}@{grid}"] = Evaluator([local_rows(batch, features.process_rows(eval_batch))], predict,
                                               summed_metrics)
  side = settings.grid * settings.patch_size
  batches = SeededBatches(lambda rng: draw(settings, rng, config.batch_size, settings.grid), seed=config.seed,
                          key=(TASKS.index(settings.task),), global_batch=config.batch_size)
  return Task(f"vision/{settings.task}", model, vit,
              {"pixel_values": jnp.zeros((1, side, side, settings.channels), jnp.float32)}, loss_fn, batches,
              evaluators, info={"position": vit.position})
