"""Time per decoded token against the cache's size at a fixed filled length, on this machine's default device: one
new token per row after a prompt of ``--filled`` tokens (``--steps`` of them, the filled length within one prefix
size), in caches of ``--slots`` slots (``configs/lm.py``'s sizes, the
dense decoding path unless ``--kernel=pallas``). ``filled prefix``: the step reads the smallest cache prefix that
holds its slots (:func:`posjax.kernels.decode.filled_sizes`); ``whole cache``: every slot, as before it.

  python benchmarks/decode_fill.py --size=125m --filled=100 --slots=128,512,2048,8192
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from posjax import kernels
from posjax.models import DECODER_SIZES, Transformer, TransformerConfig


def per_token(module, params, filled: int, slots: int, steps: int) -> float:
  """Milliseconds per decode step after a prompt of ``filled`` tokens in a cache of ``slots`` (the cache donated to
  each step, as :mod:`posjax.generate`'s loop updates it in place), the median of 5 runs of ``steps`` steps."""
  cache = jax.tree.map(jnp.zeros_like, jax.eval_shape(
      lambda: module.init(jax.random.key(0), jnp.zeros((1, slots), jnp.int32), decode=True))["cache"])
  prompt = jnp.asarray(np.random.default_rng(0).integers(0, module.config.vocab_size, (1, filled)), jnp.int32)
  prefill = jax.jit(lambda c: module.apply({"params": params, "cache": c}, prompt, decode=True,
                                           positions=jnp.arange(filled)[None], mutable=["cache"])[1]["cache"])

  @functools.partial(jax.jit, donate_argnums=(0,))
  def step(c, token, position):
    out, mutated = module.apply({"params": params, "cache": c}, token, positions=position, decode=True,
                                mutable=["cache"])
    return mutated["cache"], out.logits[:, -1].argmax(-1)[:, None]

  runs = []
  for run in range(6):  # the first compiles
    c, token = prefill(cache), prompt[:, -1:]
    jax.block_until_ready(c)
    start = time.perf_counter()
    for i in range(steps):
      c, token = step(c, token, jnp.full((1, 1), filled + i))
    jax.block_until_ready(token)
    if run:
      runs.append((time.perf_counter() - start) / steps * 1e3)
  return float(np.median(runs))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", default="125m", choices=list(DECODER_SIZES))
  parser.add_argument("--filled", type=int, default=100)
  parser.add_argument("--slots", default="128,512,2048,8192")
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--kernel", default="xla", choices=["xla", "pallas"])
  args = parser.parse_args()
  slots = [int(s) for s in args.slots.split(",")]
  config = TransformerConfig.decoder(**DECODER_SIZES[args.size], vocab_size=32_000, max_len=max(slots),
                                     attention_kernel=args.kernel)
  module = Transformer(config, head="lm")
  params = jax.jit(module.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
  print(f"{args.size} decoder, batch 1, {args.filled} tokens filled, {jax.devices()[0].device_kind}, "
        f"{args.kernel}: ms per token\n")
  print("| cache slots | " + " | ".join(str(s) for s in slots) + " | largest / smallest |")
  print("|---|" + "---|" * (len(slots) + 1))
  filled_sizes = kernels.decode.filled_sizes
  for name, sizes in (("whole cache", lambda t: (t,)), ("filled prefix", filled_sizes)):
    kernels.decode.filled_sizes = sizes
    times = [per_token(module, params, args.filled, s, args.steps) for s in slots]
    print(f"| {name} | " + " | ".join(f"{t:.2f}" for t in times) + f" | x{max(times) / min(times):.2f} |",
          flush=True)
  kernels.decode.filled_sizes = filled_sizes


if __name__ == "__main__":
  main()
