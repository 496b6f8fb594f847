"""Tokens/s and model FLOP utilisation of the BERT-Base MLM train step, for each position method.

Model FLOPs per step (the usual MFU convention, forward + backward = 3 × forward, no rematerialisation):
``6 · N · T + 12 · layers · L · d · T + 6 · d · V · M`` with N the parameters outside the embedding tables,
T = batch · L tokens, and the MLM output layer on the M masked tokens. MFU divides by the device's peak
(bf16 dense): a known accelerator's from the table below, or ``--peak_tflops``; on a CPU it is left out.

  python benchmarks/train_step.py --lengths=128,512 --batch=32 --dtype=bfloat16 --kernel=auto
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
from absl import app, flags

import common
from posjax import attention, positions
from posjax.models.bert import DTYPES

_METHODS = flags.DEFINE_list("methods", None, "Methods to run (default: all registered).")
_LENGTHS = flags.DEFINE_list("lengths", ["128", "512"], "Sequence lengths.")
_BATCH = flags.DEFINE_integer("batch", 32, "Sequences per step.")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", list(DTYPES), "Compute dtype (parameters stay float32).")
_KERNEL = flags.DEFINE_enum("kernel", "auto", list(attention.KERNELS), "Attention kernel.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed steps (median reported).")
_PEAK = flags.DEFINE_float("peak_tflops", None, "Peak dense TFLOP/s of the device (default: known devices).")

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "TPU v4": 275.0, "TPU v5p": 459.0}


def peak_tflops() -> float | None:
  if _PEAK.value:
    return _PEAK.value
  kind = jax.devices()[0].device_kind
  return next((peak for name, peak in PEAK_BF16_TFLOPS.items() if name in kind), None)


def model_flops(config, params, length: int, batch: int, masked: int) -> float:
  leaves = jax.tree_util.tree_leaves_with_path(nn.unbox(params))
  embeddings = sum(math.prod(v.shape) for p, v in leaves if "embedding" in jax.tree_util.keystr(p))
  n = sum(math.prod(v.shape) for _, v in leaves) - embeddings
  tokens = batch * length
  return (6 * n * tokens + 12 * config.num_layers * length * config.hidden_size * tokens
          + 6 * config.hidden_size * config.vocab_size * batch * masked)


def main(argv):
  del argv
  peak = peak_tflops()
  print(f"device: {common.describe_device()}; batch {_BATCH.value}, dtype {_DTYPE.value}, kernel "
        f"{_KERNEL.value}, BERT-Base, dropout off, peak {peak or '—'} TFLOP/s\n")
  print("| method | L | step ms | tokens/s | model TFLOP/s | MFU |\n|---|---|---|---|---|---|", flush=True)
  for length in map(int, _LENGTHS.value):
    for name in _METHODS.value or positions.names():
      step, args, config, masked = common.bert_train_step(name, length, _BATCH.value, _DTYPE.value, _KERNEL.value)
      seconds, _, _ = common.compile_and_time(step, args, True, _REPEATS.value)
      flops = model_flops(config, args[0][0], length, _BATCH.value, masked) / seconds
      mfu = f"{100 * flops / (peak * 1e12):.1f}%" if peak else "—"
      print(f"| `{name}` | {length} | {seconds * 1e3:.0f} | {_BATCH.value * length / seconds:,.0f} | "
            f"{flops / 1e12:.3f} | {mfu} |", flush=True)


if __name__ == "__main__":
  app.run(main)
