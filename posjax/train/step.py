"""Train state, optimizer and the pure train step every task shares."""

from __future__ import annotations

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from posjax import partitioning
from posjax.models import layout

@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any


LR_SCHEDULES = ("linear", "electra", "cosine")
LOSS_REDUCTIONS = ("mean", "sum")


def learning_rate_schedule(peak: float, warmup_steps: int, total_steps: int, kind: str = "linear",
                           end_fraction: float = 0.1) -> optax.Schedule:
  """``linear``: linear warm-up to ``peak``, then linear decay to 0 at ``total_steps`` (BERT, TUPE). ``electra``:
  the official ELECTRA ``create_optimizer``'s, a linear decay from ``peak`` over the whole run multiplied by the
  warm-up ramp ``min(1, step / warmup_steps)`` (its peak is below ``peak``: 0.9 of it at 10% warm-up). ``cosine``:
  linear warm-up, then a cosine decay to ``end_fraction * peak`` at ``total_steps`` (the decoders' recipe: Llama's
  0.1)."""
  if kind == "cosine":
    if not 0.0 <= end_fraction <= 1.0:
      raise ValueError(f"config.lr_end_fraction={end_fraction} must be in [0, 1]")
    warmup = max(warmup_steps, 1)
    return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, max(total_steps, warmup + 1),
                                              end_value=end_fraction * peak)
  if kind == "electra":
    def schedule(step):
      step = jnp.asarray(step, jnp.float32)
      ramp = jnp.minimum(1.0, step / warmup_steps) if warmup_steps > 0 else 1.0
      return peak * jnp.clip(1.0 - step / total_steps, 0.0, 1.0) * ramp
    return schedule
  warmup = optax.linear_schedule(0.0, peak, max(warmup_steps, 1))
  decay = optax.linear_schedule(peak, 0.0, max(total_steps - warmup_steps, 1))
  return optax.join_schedules([warmup, decay], [warmup_steps])


def decays(params):
  """Weight decay applies to weights, not to biases or LayerNorm scales (BERT's exclusion list), nor to RoPE-Mixed's
  learned frequencies (rope-vit's ``no_weight_decay``)."""
  def keep(path, _):
    name = str(getattr(path[-1], "key", path[-1]))
    return not (name.endswith("bias") or name in ("scale", "frequencies"))
  return jax.tree_util.tree_map_with_path(keep, params)


# Which parameters weight decay skips: BERT's list (biases, LayerNorm scales), or none (fairseq's AdamW, which
# the official TUPE code trains with, decays every parameter).
WEIGHT_DECAY_EXCLUSIONS = {"bert": decays, "none": None}




# Where layer-wise decay counts a layer's depth from (``config.layerwise_lr_decay_depth``): as Clark intended
# (google-research/electra issue #51), or as the released ``model/optimization.py`` computes it, which gives every
# encoder parameter one more factor of the decay (its ``n_layers + 2 - depth`` with the head at ``n_layers + 2``).
LAYER_DEPTHS = {"intended": 0, "released": 1}


def layer_scales(params, decay: float, depth: str = "intended"):
  """Each parameter's factor on its updates under layer-wise learning-rate decay (ELECTRA's; see
  :mod:`posjax.finetune.recipe`): under ``encoder/layer_{i}`` of ``n`` layers ``decay ** (n - i)`` (scanned layers,
  ``encoder/layers``: the same per index of the leading axis), the encoder's other parameters (embeddings, their
  norm and projection, its position module, the final norm) ``decay ** (n + 1)``, the rest (heads) 1.
  ``depth="released"``: every encoder factor times ``decay`` once more (``decay ** (n + 1 - i)``, embeddings
  ``decay ** (n + 2)``), the released code's."""
  encoder = params.get("encoder") if hasattr(params, "get") else None
  if not encoder:
    raise ValueError("layerwise_lr_decay needs a model whose parameters hold an 'encoder'")
  stacked = encoder.get(layout.STACKED)
  group = layout.period(params)  # scanned in groups of a pattern's kinds: layer i at i // group of kind_{i mod group}
  n = (jax.tree.leaves(stacked)[0].shape[0] * group if stacked is not None
       else sum(1 for name in encoder if layout.LAYER.fullmatch(name)))
  extra = LAYER_DEPTHS[depth]

  def scale(path, leaf):
    if path[0].key != "encoder":
      return 1.0
    if path[1].key == layout.STACKED:
      kind = layout.KIND.fullmatch(str(path[2].key)) if group > 1 else None
      index = jnp.arange(n // group, dtype=jnp.float32) * group + (int(kind[1]) if kind else 0)
      exponents = n + extra - index
      return (decay ** exponents).reshape((n // group,) + (1,) * (jnp.ndim(leaf) - 1))
    layer = layout.LAYER.fullmatch(str(path[1].key))
    return decay ** (n + extra - int(layer[1])) if layer else decay ** (n + 1 + extra)
  return jax.tree_util.tree_map_with_path(scale, params)


def scale_by_layer(decay: float, depth: str = "intended") -> optax.GradientTransformation:
  """Multiplies every update by its :func:`layer_scales` factor: after AdamW, so its weight decay is scaled too,
  as in ELECTRA's optimizer (each layer's learning rate times the Adam step plus decay)."""
  def init(params):
    layer_scales(params, decay, depth)  # a model without an encoder is refused here, at validation
    return optax.EmptyState()

  def update(updates, state, params=None):
    return jax.tree.map(lambda u, s: u * s, updates, layer_scales(updates, decay, depth)), state
  return optax.GradientTransformation(init, update)


def scale_by_adam_uncorrected(b1: float, b2: float, eps: float) -> optax.GradientTransformation:
  """Adam's step without bias correction, ``m / (sqrt(v) + eps)`` with ``m``, ``v`` the moments' running averages
  from zero: the official ELECTRA (and BERT) ``AdamWeightDecayOptimizer``. Its state is optax's Adam state, so a
  checkpoint's layout does not depend on the choice."""
  def init(params):
    zeros = lambda: jax.tree.map(jnp.zeros_like, params)
    return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32), mu=zeros(), nu=zeros())

  def update(updates, state, params=None):
    del params
    mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, updates)
    nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * jnp.square(g), state.nu, updates)
    steps = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu, nu)
    return steps, optax.ScaleByAdamState(count=optax.safe_int32_increment(state.count), mu=mu, nu=nu)
  return optax.GradientTransformation(init, update)


def make_optimizer(config) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """AdamW with clipping and the warm-up / linear-decay schedule; ``config.weight_decay_exclusion`` is ``bert``
  (the default) or ``none``; ``config.adam_bias_correction`` (default True; False: ELECTRA's and BERT's released
  optimizer, :func:`scale_by_adam_uncorrected`); ``config.layerwise_lr_decay`` below 1 (default 1: off) scales the
  updates by layer (:func:`scale_by_layer`, counted by ``config.layerwise_lr_decay_depth``; the schedule is then
  the heads' learning rate)."""
  exclusion = config.get("weight_decay_exclusion", "bert")
  if exclusion not in WEIGHT_DECAY_EXCLUSIONS:
    raise ValueError(f"unknown weight_decay_exclusion {exclusion!r}; allowed: {list(WEIGHT_DECAY_EXCLUSIONS)}")
  decay = config.get("layerwise_lr_decay", 1.0)
  if not 0 < decay <= 1:
    raise ValueError(f"config.layerwise_lr_decay={decay!r} must be in (0, 1] (1: off)")
  depth = config.get("layerwise_lr_decay_depth", "intended")
  kind = config.get("lr_schedule", "linear")
  reduction = config.get("loss_reduction", "mean")  # the step's (train_step), checked with the optimizer's fields
  for field, value, allowed in (("layerwise_lr_decay_depth", depth, tuple(LAYER_DEPTHS)),
                                ("lr_schedule", kind, LR_SCHEDULES), ("loss_reduction", reduction, LOSS_REDUCTIONS)):
    if value not in allowed:
      raise ValueError(f"config.{field}={value!r} is not one of {list(allowed)}")
  schedule = learning_rate_schedule(config.learning_rate, config.warmup_steps, config.total_steps, kind,
                                    config.get("lr_end_fraction", 0.1))
  mask = WEIGHT_DECAY_EXCLUSIONS[exclusion]
  if config.get("adam_bias_correction", True):
    adamw = optax.adamw(schedule, b1=config.adam_b1, b2=config.adam_b2, eps=config.adam_eps,
                        weight_decay=config.weight_decay, mask=mask)
  else:
    adamw = optax.chain(scale_by_adam_uncorrected(config.adam_b1, config.adam_b2, config.adam_eps),
                        optax.add_decayed_weights(config.weight_decay, mask), optax.scale_by_learning_rate(schedule))
  optimizer = optax.chain(optax.clip_by_global_norm(config.grad_clip_norm), adamw)
  if decay != 1:
    optimizer = optax.chain(optimizer, scale_by_layer(decay, depth))
  return optimizer, schedule


def step_rng(rng: jax.Array, step, axis_name: str | None = None) -> jax.Array:
  """The step's dropout key: ``fold_in(rng, step)``, and under ``pmap`` the device's index too (every device
  gets the same ``rng`` but holds other examples; without it their masks would repeat)."""
  rng = jax.random.fold_in(rng, step)
  return rng if axis_name is None else jax.random.fold_in(rng, jax.lax.axis_index(axis_name))


def train_step(state: TrainState, batch: dict, rng: jax.Array, *, loss_fn, optimizer, schedule,
               accum_steps: int = 1, axis_name: str | None = None, loss_totals=None, step_metrics=None,
               loss_reduction: str = "mean"):
  """One optimizer update from ``accum_steps`` micro-batches of any task.

  ``loss_fn(params, batch, rng) -> (summed loss, sums)`` sums over the examples (or tokens) of a batch;
  ``sums["weight"]`` counts them and every other sum (e.g. ``correct``) becomes a metric divided by it
  (``correct`` is reported as ``accuracy``), except ``tokens``, the step's real tokens, reported whole. Gradients
  are the summed loss's over the summed weight of all micro-batches (and devices), so accumulation and data
  parallelism give the same update as one big batch (``loss_reduction="sum"``: the summed loss's gradient, as
  ELECTRA's fine-tuning takes it, ``tf.reduce_sum`` over the batch; metrics stay per example). Dropout RNG:
  :func:`step_rng`, then the micro-batch index.

  A loss with more than one denominator (ELECTRA's: masked tokens and all tokens) takes ``loss_totals(batch)``,
  sums over the whole step's batch (every micro-batch and device), as ``loss_fn(..., totals=)``; and
  ``step_metrics(sums)`` then gives the metrics from the step's summed sums in place of the division by weight.
  """
  rng = step_rng(rng, state.step, axis_name)
  if loss_totals is not None:
    totals = loss_totals(batch)
    if axis_name is not None:
      totals = jax.lax.psum(totals, axis_name)
    loss_fn = functools.partial(loss_fn, totals=totals)
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def micro(carry, xs):
    grads, loss, sums = carry
    batch_i, index = xs
    (loss_i, sums_i), grads_i = grad_fn(state.params, batch_i, jax.random.fold_in(rng, index))
    return (jax.tree.map(jnp.add, grads, grads_i), loss + loss_i, jax.tree.map(jnp.add, sums, sums_i)), None

  if accum_steps == 1:
    (loss, sums), grads = grad_fn(state.params, batch, jax.random.fold_in(rng, 0))
  else:
    split = jax.tree.map(functools.partial(micro_batches, accum_steps=accum_steps), batch)
    abstract_sums = jax.eval_shape(loss_fn, state.params, jax.tree.map(lambda x: x[0], split), rng)[1]
    zeros = (jax.tree.map(jnp.zeros_like, state.params), 0.0,
             jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract_sums))
    (grads, loss, sums), _ = jax.lax.scan(micro, zeros, (split, jnp.arange(accum_steps)))
  if axis_name is not None:
    grads, loss, sums = jax.lax.psum((grads, loss, sums), axis_name)
  weight = jnp.maximum(sums["weight"], 1.0)
  if loss_reduction == "mean":
    grads = jax.tree.map(lambda g: g / weight, grads)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  new_state = TrainState(state.step + 1, optax.apply_updates(state.params, updates), opt_state)
  if step_metrics is not None:
    metrics = dict(step_metrics(sums))
  else:
    metrics = {METRIC_NAMES.get(k, k): v if k in TOTALS else v / weight
               for k, v in sums.items() if k != "weight"}
  metrics.update(loss=loss / weight, grad_norm=optax.global_norm(grads), learning_rate=schedule(state.step))
  return new_state, metrics


def micro_batches(x_BxS, accum_steps: int):
  """``[B, ...] -> [accum_steps, B / accum_steps, ...]``, micro-batch ``i`` the rows ``i, i + accum_steps, ...``:
  under a mesh each device's rows split evenly over the micro-batches, so every micro-step runs on every data
  device (a split into row-contiguous blocks would gather each micro-batch onto a fraction of them; MaxText's
  ``gradient_accumulation.py`` splits the same way). The sum over all micro-batches is the batch's."""
  rows = x_BxS.shape[0] // accum_steps
  x_AxRxS = x_BxS.reshape((rows, accum_steps) + x_BxS.shape[1:]).swapaxes(0, 1)
  return partitioning.constrain(x_AxRxS, (None, "activation_batch") + (None,) * (x_BxS.ndim - 1))


def task_step(task, optimizer, schedule, accum_steps: int = 1, loss_reduction: str = "mean"):
  """:func:`train_step` of a :class:`posjax.train.task.Task`: its loss, its totals and its metrics."""
  return functools.partial(train_step, loss_fn=task.loss_fn, optimizer=optimizer, schedule=schedule,
                           accum_steps=accum_steps, loss_totals=task.loss_totals, step_metrics=task.step_metrics,
                           loss_reduction=loss_reduction)


METRIC_NAMES = {"correct": "accuracy"}
TOTALS = ("tokens",)  # sums reported as they are (the real tokens of the step), not per example
