"""Train state, optimizer and the pure MLM train / eval steps."""

from __future__ import annotations

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

ENCODER_INPUTS = ("attention_mask", "positions", "segment_ids")


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any


def learning_rate_schedule(peak: float, warmup_steps: int, total_steps: int) -> optax.Schedule:
  """Linear warm-up to ``peak``, then linear decay to 0 at ``total_steps`` (BERT, TUPE)."""
  warmup = optax.linear_schedule(0.0, peak, max(warmup_steps, 1))
  decay = optax.linear_schedule(peak, 0.0, max(total_steps - warmup_steps, 1))
  return optax.join_schedules([warmup, decay], [warmup_steps])


def decays(params):
  """Weight decay applies to weights, not to biases or LayerNorm scales (BERT's exclusion list)."""
  def keep(path, _):
    name = str(getattr(path[-1], "key", path[-1]))
    return not (name.endswith("bias") or name == "scale")
  return jax.tree_util.tree_map_with_path(keep, params)


# Which parameters weight decay skips: BERT's list (biases, LayerNorm scales), or none (fairseq's AdamW, which
# the official TUPE code trains with, decays every parameter).
WEIGHT_DECAY_EXCLUSIONS = {"bert": decays, "none": None}


def make_optimizer(config) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """AdamW with clipping and the warm-up / linear-decay schedule; ``config.weight_decay_exclusion`` is ``bert``
  (the default) or ``none``."""
  exclusion = config.get("weight_decay_exclusion", "bert")
  if exclusion not in WEIGHT_DECAY_EXCLUSIONS:
    raise ValueError(f"unknown weight_decay_exclusion {exclusion!r}; allowed: {list(WEIGHT_DECAY_EXCLUSIONS)}")
  schedule = learning_rate_schedule(config.learning_rate, config.warmup_steps, config.total_steps)
  optimizer = optax.chain(
      optax.clip_by_global_norm(config.grad_clip_norm),
      optax.adamw(schedule, b1=config.adam_b1, b2=config.adam_b2, eps=config.adam_eps,
                  weight_decay=config.weight_decay, mask=WEIGHT_DECAY_EXCLUSIONS[exclusion]))
  return optimizer, schedule


def encoder_inputs(batch: dict, use_segments: bool) -> dict:
  inputs = {k: batch[k] for k in ENCODER_INPUTS if k in batch}
  if not use_segments:
    inputs.pop("segment_ids", None)
  return inputs


def mlm_sums(model, params, batch, rng, *, use_segments: bool, deterministic: bool):
  """``(summed loss, (summed correct, summed weight))`` over the masked positions of a batch."""
  logits = model.apply({"params": params}, batch["input_ids"], masked_positions=batch["masked_positions"],
                       deterministic=deterministic, rngs=None if deterministic else {"dropout": rng},
                       **encoder_inputs(batch, use_segments))
  weights = batch["masked_weights"]
  # Padding rows of masked_positions point at token 0; their weight is 0 and their logits are finite.
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["masked_labels"])
  correct = (jnp.argmax(logits, -1) == batch["masked_labels"]).astype(jnp.float32)
  return jnp.sum(losses * weights), (jnp.sum(correct * weights), jnp.sum(weights))


def train_step(state: TrainState, batch: dict, rng: jax.Array, *, model, optimizer, schedule,
               accum_steps: int = 1, use_segments: bool = False, axis_name: str | None = None):
  """One optimizer update from ``accum_steps`` micro-batches; dropout RNG is ``fold_in(rng, step)``."""
  rng = jax.random.fold_in(rng, state.step)
  sums = functools.partial(mlm_sums, model, use_segments=use_segments, deterministic=False)
  grad_fn = jax.value_and_grad(sums, has_aux=True)

  def micro(carry, xs):
    grads, loss, correct, weight = carry
    batch_i, index = xs
    (loss_i, (correct_i, weight_i)), grads_i = grad_fn(state.params, batch_i, jax.random.fold_in(rng, index))
    return (jax.tree.map(jnp.add, grads, grads_i), loss + loss_i, correct + correct_i, weight + weight_i), None

  zeros = (jax.tree.map(jnp.zeros_like, state.params), 0.0, 0.0, 0.0)
  if accum_steps == 1:
    (grads, loss, correct, weight), _ = micro(zeros, (batch, 0))
  else:
    split = jax.tree.map(lambda x: x.reshape((accum_steps, x.shape[0] // accum_steps) + x.shape[1:]), batch)
    (grads, loss, correct, weight), _ = jax.lax.scan(micro, zeros, (split, jnp.arange(accum_steps)))
  if axis_name is not None:
    grads, loss, correct, weight = jax.lax.psum((grads, loss, correct, weight), axis_name)
  weight = jnp.maximum(weight, 1.0)
  grads = jax.tree.map(lambda g: g / weight, grads)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  new_state = TrainState(state.step + 1, optax.apply_updates(state.params, updates), opt_state)
  metrics = {"loss": loss / weight, "accuracy": correct / weight, "grad_norm": optax.global_norm(grads),
             "learning_rate": schedule(state.step)}
  return new_state, metrics


def eval_sums(params, batch, *, model, use_segments: bool = False):
  loss, (correct, weight) = mlm_sums(model, params, batch, None, use_segments=use_segments, deterministic=True)
  return {"loss": loss, "correct": correct, "weight": weight}
