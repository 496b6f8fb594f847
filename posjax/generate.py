"""Generation with a KV cache: a prefill of the prompt, then one decode step per new token, each layer attending
over its cache (:func:`posjax.attention.decode_step`: k/v heads only, positions continuing past the prompt).

  tokens = generate(module, variables, prompt_ids, max_new_tokens=32)               # greedy
  tokens = generate(module, variables, prompt_ids, max_new_tokens=32, temperature=0.8, top_p=0.9, seed=1)
  module, variables, tokenizer = load("/tmp/posjax_lm")                             # a run's last checkpoint

  python -m posjax.generate --workdir=RUN --prompt="the history of" --max_new_tokens=20

``module`` is a causal :class:`posjax.models.Transformer` with head ``lm`` (a decoder run's, or
:func:`posjax.convert.from_hf`'s). The result is the prompt followed by the new tokens, ``[B, P + N]`` (Hugging
Face's ``generate`` convention). Prompts of different lengths come left-padded with ``attention_mask`` (0 at the
padding); their positions are then ``cumsum(mask) - 1``, as Hugging Face counts them, unless ``positions`` gives
them (``[B, P]``, or ``[B, P, A]`` for a method of several axes: a Qwen2-VL prompt's M-RoPE ids). Each new token
takes the next position after the prompt's largest, on every axis (Qwen2-VL's ``rope_deltas``: a text token after
an image continues from the image's largest id; VideoRoPE's after the largest time id). After ``eos_id`` a row
repeats it. The whole loop is one compiled program (``lax.fori_loop`` over the steps).
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from posjax.data.tokenizer import Tokenizer
from posjax.models import TransformerConfig, Transformer
from posjax.train import checkpoint


CACHE_MULTIPLE = 256  # the cache's slots under the Pallas kernels: whole key tiles of either backend (64 / 256)


def check_options(module, max_new_tokens: int, temperature: float, top_k: int, top_p: float) -> None:
  """One-line errors for a module that cannot generate and options out of range."""
  config = getattr(module, "config", None)
  if not isinstance(module, Transformer) or module.head != "lm" or not config.causal:
    raise ValueError("generate takes a causal Transformer with head='lm' (a decoder run's model, or "
                     "posjax.convert.from_hf's)")
  if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an int >= 1")
  if not temperature >= 0:
    raise ValueError(f"temperature={temperature!r} must be >= 0 (0: greedy)")
  if not isinstance(top_k, int) or top_k < 0:
    raise ValueError(f"top_k={top_k!r} must be an int >= 0 (0: off)")
  if not 0 < top_p <= 1:
    raise ValueError(f"top_p={top_p!r} must be in (0, 1] (1: off)")


def sample(logits_BxV, key, temperature: float, top_k: int, top_p: float):
  """``[B]`` int32: the argmax at ``temperature=0``, else a draw from ``softmax(logits / temperature)`` restricted to
  the ``top_k`` most likely tokens and to the smallest set whose probability reaches ``top_p`` (nucleus)."""
  if temperature == 0:
    return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
  logits_BxV = logits_BxV.astype(jnp.float32) / temperature
  if top_k:
    kth_Bx1 = jax.lax.top_k(logits_BxV, min(top_k, logits_BxV.shape[-1]))[0][:, -1:]
    logits_BxV = jnp.where(logits_BxV < kth_Bx1, -jnp.inf, logits_BxV)
  if top_p < 1:
    sorted_BxV = jnp.sort(logits_BxV, axis=-1)[:, ::-1]
    cumulative_BxV = jnp.cumsum(jax.nn.softmax(sorted_BxV, axis=-1), axis=-1)
    # the last token kept: the first whose cumulative probability reaches top_p (so one token at least)
    last_B = jnp.sum(cumulative_BxV < top_p, axis=-1)
    cutoff_Bx1 = jnp.take_along_axis(sorted_BxV, last_B[:, None], axis=-1)
    logits_BxV = jnp.where(logits_BxV < cutoff_Bx1, -jnp.inf, logits_BxV)
  return jax.random.categorical(key, logits_BxV, axis=-1).astype(jnp.int32)


def generate(module: Transformer, variables, prompt_ids, *, max_new_tokens: int, attention_mask=None,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             eos_id: int | list[int] | None = None, return_logits: bool = False, positions=None):
  """``[B, P + max_new_tokens]`` int32: the prompts ``[B, P]`` and their continuations (see the module docstring);
  with ``return_logits`` also the float32 logits each new token was drawn from, ``[B, max_new_tokens, V]`` (before
  temperature and filtering; Hugging Face's ``output_logits``). ``eos_id``: one id or several (Hugging Face's
  ``eos_token_id`` list) that end a row. ``positions``: the prompts' own (see the module docstring)."""
  check_options(module, max_new_tokens, temperature, top_k, top_p)
  prompt_ids = jnp.asarray(prompt_ids, jnp.int32)
  if prompt_ids.ndim != 2 or prompt_ids.shape[1] < 1:
    raise ValueError(f"prompt_ids has shape {prompt_ids.shape}; expected [batch, length >= 1]")
  b, p = prompt_ids.shape
  total = p + max_new_tokens
  module.config.position_spec.check_length(total)
  mask_BxP = jnp.ones((b, p), bool) if attention_mask is None else jnp.asarray(attention_mask, bool)
  if mask_BxP.shape != (b, p):
    raise ValueError(f"attention_mask has shape {mask_BxP.shape}; expected the prompt's {(b, p)}")
  if positions is not None:
    positions = jnp.asarray(positions)
    if positions.shape[:2] != (b, p) or positions.ndim not in (2, 3):
      raise ValueError(f"positions has shape {positions.shape}; expected the prompt's {(b, p)}, or {(b, p)} and "
                       "an axis of positions")
  tokens, logits = _generate(module, {"params": variables["params"]}, prompt_ids, mask_BxP, max_new_tokens,
                             float(temperature), top_k, float(top_p), jnp.uint32(seed),
                             eos_ids(eos_id), bool(return_logits), positions)
  return (tokens, logits) if return_logits else tokens


def continued_position(spec, positions, mask_BxP):
  """``[B]`` int32: the position a prompt's continuation follows: the largest of its real tokens' ids on every axis
  (``[B, P]`` or ``[B, P, A]``), or on the axis the method names (:attr:`posjax.positions.Method.continuation_axis`)."""
  b, p = mask_BxP.shape
  ids_BxPxA = positions.reshape(b, p, -1)
  axis = spec.method.continuation_axis(spec.options) if spec.method.continuation_axis else None
  if axis is not None and ids_BxPxA.shape[-1] > 1:
    ids_BxPxA = ids_BxPxA[..., axis:axis + 1]
  real_BxPxA = jnp.broadcast_to(mask_BxP.reshape(b, p, 1), ids_BxPxA.shape)
  return jnp.max(jnp.where(real_BxPxA, ids_BxPxA, 0), axis=(1, 2)).astype(jnp.int32)


def eos_ids(eos_id) -> tuple[int, ...]:
  """``eos_id`` (None, one id or several) as a tuple of ints (a static argument of the compiled loop)."""
  if eos_id is None:
    return ()
  ids = tuple(eos_id) if isinstance(eos_id, (list, tuple)) else (eos_id,)
  if not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) and i >= 0 for i in ids):
    raise ValueError(f"eos_id={eos_id!r} must be a token id >= 0, a list of them, or None")
  return tuple(int(i) for i in ids)


def greedy(module: Transformer, variables, prompt_BxP, steps: int, mask_BxP=None):
  """``[B, P + steps]``: :func:`generate` at temperature 0 (prompts left-padded where ``mask_BxP`` is False; default
  full), without its checks (traceable: what an evaluator calls inside its compiled program)."""
  mask_BxP = jnp.ones(prompt_BxP.shape, bool) if mask_BxP is None else jnp.asarray(mask_BxP, bool)
  return _generate(module, variables, prompt_BxP, mask_BxP, steps, 0.0, 0, 1.0, jnp.uint32(0), (), False)[0]


@functools.partial(jax.jit, static_argnums=(0, 4, 5, 6, 7, 9, 10))
def _generate(module, variables, prompt_BxP, mask_BxP, steps, temperature, top_k, top_p, seed, eos_id, keep_logits,
              positions=None):
  """The loop: the prefill computes the LM head at each prompt's last token only (the prompts are left-padded), and
  the step logits ``[B, N, V]`` are kept only where ``keep_logits`` (else ``[B, 0, V]``)."""
  b, p = prompt_BxP.shape
  slots = p + steps
  if module.config.attention_kernel == "pallas":  # the decode kernels read a cache of whole key tiles in place
    slots = -(-slots // CACHE_MULTIPLE) * CACHE_MULTIPLE
  cache = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(
      lambda: module.init(jax.random.key(0), jnp.zeros((b, slots), jnp.int32), decode=True))["cache"])
  if positions is None:
    positions = jnp.maximum(jnp.cumsum(mask_BxP.astype(jnp.int32), axis=1) - 1, 0)
  out, mutated = module.apply({**variables, "cache": cache}, prompt_BxP, positions=positions,
                              attention_mask=mask_BxP, masked_positions=jnp.full((b, 1), p - 1, jnp.int32),
                              decode=True, mutable=["cache"])
  key = jax.random.key(seed)
  first_BxV = out.logits[:, -1].astype(jnp.float32)
  tokens_BxN = jnp.zeros((b, steps), jnp.int32).at[:, 0].set(
      sample(first_BxV, jax.random.fold_in(key, 0), temperature, top_k, top_p))
  kept = steps if keep_logits else 0
  logits_BxNxV = jnp.zeros((b, kept, first_BxV.shape[-1]), jnp.float32)
  if keep_logits:
    logits_BxNxV = logits_BxNxV.at[:, 0].set(first_BxV)

  def step(t, carry):
    tokens_BxN, logits_BxNxV, cache, position_B, done_B = carry
    token_B = tokens_BxN[:, t - 1]
    out, mutated = module.apply({**variables, "cache": cache}, token_B[:, None], positions=position_B[:, None],
                                decode=True, mutable=["cache"])
    logits_BxV = out.logits[:, -1].astype(jnp.float32)
    next_B = sample(logits_BxV, jax.random.fold_in(key, t), temperature, top_k, top_p)
    done_B = done_B | jnp.isin(token_B, jnp.asarray(eos_id or (-1,), jnp.int32))
    next_B = jnp.where(done_B, token_B, next_B)  # a finished row repeats the eos it ended with
    if keep_logits:
      logits_BxNxV = logits_BxNxV.at[:, t].set(logits_BxV)
    return tokens_BxN.at[:, t].set(next_B), logits_BxNxV, mutated["cache"], position_B + 1, done_B

  last_B = continued_position(module.config.position_spec, positions, mask_BxP)
  tokens_BxN, logits_BxNxV, *_ = jax.lax.fori_loop(1, steps, step, (tokens_BxN, logits_BxNxV, mutated["cache"],
                                                                    last_B + 1, jnp.zeros((b,), bool)))
  return jnp.concatenate([prompt_BxP, tokens_BxN], axis=1), logits_BxNxV


def load(workdir: str, step: int | None = None):
  """``(module, variables, tokenizer)`` of a run (a training run's or ``hf-to-posjax``'s workdir): its model
  (``model_config.json``), the parameters of its last kept checkpoint (or ``step``) and its tokenizer (None where the
  run has none)."""
  values = checkpoint.read_model_config(workdir)
  if "generator" in values or not values.get("causal"):  # before the checkpoint is read
    task = "electra" if "generator" in values else checkpoint.run_config(workdir).get("task") or "mlm"
    raise ValueError(f"{workdir}: this workdir holds an encoder ({task}) run; generate needs a decoder run "
                     "(configs/lm.py)")
  task = checkpoint.run_config(workdir).get("task")
  if task not in (None, *checkpoint.LM_TASKS):
    raise ValueError(f"{workdir}: this workdir holds a decoder fine-tuned for {task} (its head, not a language "
                     "model's); generate needs a decoder run (configs/lm.py), such as the one it started from")
  config = TransformerConfig(**{**values, "attention_kernel": "xla", "kernel_platform": ""})
  params = checkpoint.load_params(workdir, step)
  vocab = checkpoint.vocab_file_of(workdir)
  tokenizer = Tokenizer.load(vocab) if vocab else None
  return Transformer(config, head="lm"), {"params": params}, tokenizer


def main(argv=None) -> int:
  """``python -m posjax.generate``: a run's continuation of ``--prompt``, printed; 2 and one line on a mistake."""
  parser = argparse.ArgumentParser(prog="python -m posjax.generate", description=__doc__.split("\n\n")[0])
  parser.add_argument("--workdir", required=True, help="a decoder run (training or hf-to-posjax)")
  parser.add_argument("--prompt", required=True, help="the text to continue")
  parser.add_argument("--max_new_tokens", type=int, default=32)
  parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
  parser.add_argument("--top_k", type=int, default=0)
  parser.add_argument("--top_p", type=float, default=1.0)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--step", type=int, default=None, help="a kept checkpoint step (default: the last)")
  args = parser.parse_args(argv)
  try:
    module, variables, tokenizer = load(args.workdir, args.step)
    if tokenizer is None:
      raise ValueError(f"--workdir={args.workdir!r} has no tokenizer (vocab.txt or tokenizer.json beside it, or "
                       "data.vocab_file in its config.json)")
    encoded = tokenizer.backend.encode(args.prompt, add_special_tokens=False)
    if not encoded.ids:
      raise ValueError(f"--prompt={args.prompt!r} encodes to no tokens")
    unknown = [args.prompt[a:b] for i, (a, b) in zip(encoded.ids, encoded.offsets) if i == tokenizer.unk_id]
    special = checkpoint.special_token_ids(args.workdir)
    ids = checkpoint.prompt_prefix(args.workdir, special, tokenizer) + encoded.ids  # as its rows began
    if unknown:
      print(f"warning: --prompt has {len(unknown)} piece(s) the run's vocabulary does not hold, each read as "
            f"{tokenizer.backend.id_to_token(tokenizer.unk_id)}: {', '.join(map(repr, unknown))}", file=sys.stderr)
    read = len(ids) + args.max_new_tokens - 1  # the positions the model reads (the last new token is not fed)
    trained = checkpoint.run_config(args.workdir).get("max_len") or module.config.max_len  # the length it trained
    # at (a warm start's model_config.json keeps its base's)
    if read > trained:
      print(f"warning: the prompt's {len(ids)} tokens and --max_new_tokens={args.max_new_tokens} read {read} "
            f"positions, {read / trained:.1f}x the {trained} the run trained at; past them the continuation rests "
            f"on how {module.config.position} extrapolates", file=sys.stderr)
    eos = eos_ids(special["eos_token_id"])  # the run's end of document
    tokens = generate(module, variables, np.asarray([ids]), max_new_tokens=args.max_new_tokens,
                      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed, eos_id=eos)
  except (ValueError, FileNotFoundError) as error:
    print(f"error: {error}", file=sys.stderr)
    return 2
  new = [int(t) for t in np.asarray(tokens)[0, len(ids):]]
  ends = [i for i, t in enumerate(new) if t in eos]
  new = new[:ends[0] + 1] if ends else new  # up to the end-of-document token, where Hugging Face's generate stops
  print(tokenizer.backend.decode(ids + new, skip_special_tokens=False))
  return 0


if __name__ == "__main__":
  sys.exit(main())
