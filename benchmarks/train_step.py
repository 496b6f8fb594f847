"""Tokens/s and model FLOP utilisation of the BERT-Base MLM train step, for each position method.

Model FLOPs per step: :func:`posjax.models.flops.train_step_flops` (the usual MFU convention, forward + backward =
3 × forward, no rematerialisation; what ``--target`` reports per device). MFU divides by the device's peak
(bf16 dense): a known accelerator's from the table below, or ``--peak_tflops``; on a CPU it is left out.

  python benchmarks/train_step.py --lengths=128,512 --batch=32 --dtype=bfloat16 --kernels=auto
"""

from __future__ import annotations


import jax
from absl import app, flags

import common
from posjax import attention, positions
from posjax.models.transformer import DTYPES
from posjax.models.flops import train_step_flops

_METHODS = flags.DEFINE_list("methods", None, "Methods to run (default: all registered).")
_LENGTHS = flags.DEFINE_list("lengths", ["128", "512"], "Sequence lengths.")
_BATCH = flags.DEFINE_integer("batch", 32, "Sequences per step.")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", list(DTYPES), "Compute dtype (parameters stay float32).")
_KERNELS = flags.DEFINE_list("kernels", ["auto"], f"Attention kernels ({', '.join(attention.KERNELS)}); ratios are "
                             "to absolute on the first.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed steps (median reported).")
_PEAK = flags.DEFINE_float("peak_tflops", None, "Peak dense TFLOP/s of the device (default: known devices).")

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "TPU v4": 275.0, "TPU v5p": 459.0}


def peak_tflops() -> float | None:
  if _PEAK.value:
    return _PEAK.value
  kind = jax.devices()[0].device_kind
  return next((peak for name, peak in PEAK_BF16_TFLOPS.items() if name in kind), None)


def main(argv):
  del argv
  peak = peak_tflops()
  print(f"device: {common.describe_device()}; batch {_BATCH.value}, dtype {_DTYPE.value}, kernels "
        f"{','.join(_KERNELS.value)}, BERT-Base, dropout off, peak {peak or '—'} TFLOP/s\n")
  print(f"| method | L | kernel | step ms | tokens/s | model TFLOP/s | MFU | step / absolute on {_KERNELS.value[0]} |"
        "\n|---|---|---|---|---|---|---|---|", flush=True)
  for length in map(int, _LENGTHS.value):
    reference = None
    for name in _METHODS.value or positions.encoder_names():
      for kernel, shown in common.kernel_rows(name, _KERNELS.value):
        step, args, config, masked = common.bert_train_step(name, length, _BATCH.value, _DTYPE.value, kernel)
        seconds, _, _ = common.compile_and_time(step, args, True, _REPEATS.value)
        if name == "absolute" and kernel == _KERNELS.value[0]:
          reference = seconds
        flops = train_step_flops(config, _BATCH.value * length, length, _BATCH.value * masked) / seconds
        mfu = f"{100 * flops / (peak * 1e12):.1f}%" if peak else "—"
        ratio = f"{seconds / reference:.2f}×" if reference else "—"
        print(f"| `{name}` | {length} | {shown} | {seconds * 1e3:.0f} | {_BATCH.value * length / seconds:,.0f} | "
              f"{flops / 1e12:.3f} | {mfu} | {ratio} |", flush=True)


if __name__ == "__main__":
  app.run(main)
