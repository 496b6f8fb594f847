"""The decode step's compiled memory, ahead of time on this CPU: one new token per row against a KV cache of
``--context`` slots for a Llama-family decoder (``configs/lm.py``'s sizes), bf16 parameters and cache, on one device
of each target (``make aot``'s compilers). Prints the cache's size and XLA's memory analysis per target and
attention kernel (``xla``: the dense formulas; ``pallas``: the decode kernels, :func:`posjax.kernels.decode_attention`).

  python benchmarks/decode_memory.py --size=1b --context=32768 --batch=1 --targets=h100,v5e:2x2 --kernels=xla,pallas

``--layouts`` compares hybrid layouts (:mod:`posjax.models.hybrid`, ``,``-separated; ``full``: every layer global),
``--layout-options`` their options as JSON (``{"gemma3": {"window": 1024}}``): a windowed or chunked layer's cache
is a ring of its window or chunk (:func:`posjax.attention.ring_slots`).

  python benchmarks/decode_memory.py --size=1b --context=131072 --targets=h100 --kernels=xla,pallas \
      --layouts=full,gemma3,irope
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time

import jax
import jax.numpy as jnp

from posjax.aot import compile as aot
from posjax.aot import targets
from posjax.models import DECODER_SIZES, TransformerConfig, Transformer


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", default="1b", choices=list(DECODER_SIZES))
  parser.add_argument("--context", type=int, default=32768)
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--vocab", type=int, default=128_256)
  parser.add_argument("--targets", default="h100,v5e:2x2")
  parser.add_argument("--kernels", default="xla,pallas")
  parser.add_argument("--layouts", default="full")
  parser.add_argument("--layout-options", default="{}")
  args = parser.parse_args()
  aot.setup()
  options = json.loads(args.layout_options)
  print("| layout | layers (kinds) | target | kernel | cache | arguments | outputs | temporaries "
        "| total (cache donated) | compile |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for layout in args.layouts.split(","):
    config = TransformerConfig.decoder(**DECODER_SIZES[args.size], vocab_size=args.vocab, max_len=args.context,
                                       dtype="bfloat16", param_dtype="bfloat16",
                                       **({} if layout == "full" else dict(layout=layout,
                                                                           layout_options=options.get(layout, {}))))
    measure(args, config, layout)


def measure(args, config, layout: str):
  module = Transformer(config, head="lm")
  b, t = args.batch, args.context
  shapes = jax.eval_shape(lambda: module.init(jax.random.key(0), jnp.zeros((b, t), jnp.int32), decode=True))
  cache_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes["cache"]))
  kinds = {}
  for kind in config.layer_kinds:
    kinds[kind.describe()] = kinds.get(kind.describe(), 0) + 1
  described = "; ".join(f"{n} x {k}" for k, n in kinds.items())

  def step(module, params, cache, token_Bx1, position_Bx1):
    out, mutated = module.apply({"params": params, "cache": cache}, token_Bx1, positions=position_Bx1, decode=True,
                                mutable=["cache"])
    return jnp.argmax(out.logits[:, -1], axis=-1), mutated["cache"]

  for name in args.targets.split(","):
    target = targets.devices(name)
    device = jax.sharding.SingleDeviceSharding(target.devices[0])
    on = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), tree)
    token = jax.ShapeDtypeStruct((b, 1), jnp.int32, sharding=device)
    for kernel in args.kernels.split(","):
      model = Transformer(dataclasses.replace(config, attention_kernel=kernel, kernel_platform=target.platform),
                          head="lm")
      start = time.perf_counter()
      compiled = jax.jit(functools.partial(step, model), donate_argnums=(1,)).trace(
          on(shapes["params"]), on(shapes["cache"]), token, token).lower().compile()
      seconds = time.perf_counter() - start
      memory = compiled.memory_analysis()
      gib = lambda n: f"{n / 2**30:.2f} GiB"
      total = memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes \
          - memory.alias_size_in_bytes
      print(f"| {layout} | {described} | {name} | {kernel} | {gib(cache_bytes)} | "
            f"{gib(memory.argument_size_in_bytes)} | {gib(memory.output_size_in_bytes)} | "
            f"{gib(memory.temp_size_in_bytes)} | {gib(total)} | {seconds:.1f} s |", flush=True)


if __name__ == "__main__":
  main()
