"""The pre-training step compiled ahead of time for a pod slice or a GPU host, on this CPU: per model size, gradient
accumulation, rematerialisation and layer scan, the compile time, the temporaries and the total memory per device,
and the FLOPs per device and step (the model's, :mod:`posjax.models.flops`, and XLA's count, which takes a loop's body
once).

  python benchmarks/pod_step.py --targets=v5e:2x4,h100:8 --sizes=base,large --batch=256 --length=512

Each case is ``python -m posjax.main --config=configs/pretrain.py:size=<size>,position=<method> --target=<target>``
with the case's fields, in its own process (killed with its children past ``--timeout``). ``--grid`` picks the cases:
``full`` every combination of accumulation 1/4, remat none/full and scan off/on; ``scan`` (default) the layers
scanned with every accumulation and remat, and unrolled once per remat (their compile time); ``depth`` unrolled and
scanned at each of ``--layers`` (compile time against depth).
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import sys

import common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATTERNS = {
    "seconds": r"compiled in ([\d.]+) s",
    "temporaries": r"temporaries ([\d.]+) GiB",
    "total": r"-> ([\d.]+) GiB of",
    "fits": r"\): (fits|DOES NOT FIT)",
    "model_flops": r"model FLOPs per device and step: ([\d.e+]+)",
    "xla_flops": r"XLA's FLOP count per device: ([\d.e+]+)",
    "failed": r"does not compile \(([\d.]+) s\): (.*)",
}


def cases(grid: str):
  """``(accum, remat, scan)`` per case."""
  full = list(itertools.product((1, 4), ("none", "full"), (False, True)))
  if grid == "full":
    return full
  if grid == "depth":
    return [(1, "none", False), (1, "none", True)]
  return [c for c in full if c[2]] + [(1, remat, False) for remat in ("none", "full")]


def compile_case(target: str, size: str, method: str, batch: int, length: int, accum: int, remat: str, scan: bool,
                 timeout: float, layers: int = 0, kernel: str = "xla") -> dict:
  """One compile's figures (or its error), parsed from the command's report (``layers``: 0 for the size's)."""
  command = [sys.executable, "-m", "posjax.main", f"--config=configs/pretrain.py:size={size},position={method}",
             f"--target={target}", f"--config.batch_size={batch}", f"--config.max_len={length}",
             f"--config.grad_accum_steps={accum}", f"--config.model.remat={remat}",
             f"--config.model.scan_layers={scan}", f"--config.model.attention_kernel={kernel}"]
  command += [f"--config.model.num_layers={layers}"] if layers else []
  finished = common.run_in_group(command, timeout, cwd=ROOT)
  if finished is None:
    return {"error": f"not compiled within {timeout:.0f} s"}
  out, err, status = finished
  found = {name: m.group(1) for name, pattern in PATTERNS.items() if (m := re.search(pattern, out))}
  if "failed" in found:  # the compiler's words, e.g. XLA:TPU's "Ran out of memory in memory space hbm"
    failed = re.search(PATTERNS["failed"], out)
    found["error"] = f"does not compile ({float(failed.group(1)):.0f} s): {failed.group(2)[:300]}"
  elif "seconds" not in found:
    lines = [line for line in (out + err).splitlines() if line.strip()]
    found["error"] = (lines[-1] if lines else f"exit {status}")[:160]
  return found


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--targets", default="v5e:2x4,h100:8")
  parser.add_argument("--sizes", default="base,large")
  parser.add_argument("--method", default="absolute")
  parser.add_argument("--batch", type=int, default=256)
  parser.add_argument("--length", type=int, default=512)
  parser.add_argument("--grid", choices=("scan", "full", "depth"), default="scan",
                      help="depth: accumulation 1, no remat, scan off/on, at each of --layers")
  parser.add_argument("--layers", default="", help="comma-separated layer counts (default: the size's)")
  parser.add_argument("--kernel", default="xla", help="attention kernel (auto picks cuDNN on a GPU, which needs the "
                      "cuDNN library to compile)")
  parser.add_argument("--timeout", type=float, default=3600)
  args = parser.parse_args()
  print(f"{args.method}, batch {args.batch} x {args.length}, bf16, dropout 0.1, kernel {args.kernel}; per device\n")
  print("| target | model | accum | remat | scan | compile s | temporaries GiB | total GiB | model TFLOP | XLA TFLOP |"
        "\n|---|---|---|---|---|---|---|---|---|---|", flush=True)
  depths = [int(n) for n in args.layers.split(",") if n] or [0]
  for target, size, layers in itertools.product(args.targets.split(","), args.sizes.split(","), depths):
    for accum, remat, scan in cases(args.grid):
      r = compile_case(target, size, args.method, args.batch, args.length, accum, remat, scan, args.timeout, layers,
                       args.kernel)
      tflop = lambda key: f"{float(r[key]) / 1e12:.2f}" if key in r else "—"
      fits = "" if r.get("fits") == "fits" else " (does not fit)"
      figures = (f"{r['error']} | | | | |" if "error" in r else
                 f"{float(r['seconds']):.0f} | {r['temporaries']} | {r['total']}{fits} | {tflop('model_flops')} | "
                 f"{tflop('xla_flops')} |")
      model = f"{size} x{layers}" if layers else size
      print(f"| {target} | {model} | {accum} | {remat} | {'on' if scan else 'off'} | {figures}", flush=True)


if __name__ == "__main__":
  main()
