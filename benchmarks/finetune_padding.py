"""What fine-tuning pays for padding: per GLUE task, the padded share of the token slots and the steps of TUPE's
recipe (batch 32, max length 512) under each batching of :mod:`posjax.data.features`, and the wall time of a
runlocal fine-tuning side by side.

  python benchmarks/finetune_padding.py [--glue_dir=GLUE_DIR --vocab=vocab.txt] [--per_doubling=4,8] [--wall]
      [--max_lens=64,512]

Lengths: with ``--glue_dir`` (the GLUE download) and ``--vocab``, every training example of the real files is
encoded as posjax encodes it. Without them, each task's lengths are drawn from a log-normal with the mean and
95th percentile in ``LENGTHS`` (BERT WordPiece tokens with [CLS]/[SEP]; approximate figures for the GLUE
training sets, not measured here): the fractions are then estimates. Columns: ``data.batching`` (``grouped``
with mega-batches of 50 batches, and of the whole epoch: ``data.group_size=0``); shapes: the padded lengths a run
compiles. ``--wall`` times
``configs/finetune/glue.py:task=sst2,runlocal`` at each ``--max_lens`` for ``fixed`` and ``dynamic`` batching,
with an empty and then a filled persistent compilation cache, on the default bucket ladder (runlocal's own is
coarser, for fewer compiles).
Prints markdown tables (record them in docs/benchmarks.md with the machine).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import describe_device  # noqa: E402

from posjax.data import features  # noqa: E402

_GLUE_DIR = flags.DEFINE_string("glue_dir", "", "The GLUE download's directory (real lengths); needs --vocab.")
_VOCAB = flags.DEFINE_string("vocab", "", "The vocabulary to encode --glue_dir with.")
_WALL = flags.DEFINE_bool("wall", False, "Also time runlocal SST-2 fine-tuning at each --max_lens.")
_MAX_LENS = flags.DEFINE_list("max_lens", ["64", "512"], "max_len of the timed runlocal runs.")
_PER_DOUBLING = flags.DEFINE_list("per_doubling", ["4", "8"], "Bucket ladders (data.buckets_per_doubling) to compare.")

# task: (training examples, TUPE's epochs, mean tokens, 95th percentile tokens)
LENGTHS = {"mnli": (392_702, 5, 39, 72), "qqp": (363_846, 5, 30, 62), "qnli": (104_743, 5, 50, 96),
           "sst2": (67_349, 10, 13, 34), "cola": (8_551, 10, 11, 20), "mrpc": (3_668, 10, 53, 80),
           "stsb": (5_749, 10, 31, 56), "rte": (2_490, 10, 73, 160)}
BATCH, MAX_LEN = 32, 512


def modelled_lengths(n: int, mean: float, p95: float, seed: int = 0) -> np.ndarray:
  """A log-normal with this mean and 95th percentile, rounded and cut to [3, MAX_LEN]."""
  sigma = 1.645 - math.sqrt(1.645 ** 2 - 2 * math.log(p95 / mean))
  mu = math.log(mean) - sigma ** 2 / 2
  draws = np.random.default_rng(seed).lognormal(mu, sigma, n)
  return np.clip(np.rint(draws), 3, MAX_LEN).astype(np.int64)


def real_lengths(task: str) -> np.ndarray:
  from posjax.data.tokenizer import Tokenizer
  from posjax.finetune import glue

  tokenizer = Tokenizer.load(_VOCAB.value)
  spec = glue.get(task)
  examples = list(glue.examples(task, "train", "tsv", _GLUE_DIR.value))
  columns = [tokenizer.encode_batch([texts[i] for texts, _ in examples]) for i in range(len(spec.tfds_keys))]
  return np.asarray([len(glue.pair(tokenizer, [c[n] for c in columns], MAX_LEN)[0]) for n in range(len(examples))])


MODES = {"fixed": ("fixed", 50), "dynamic": ("dynamic", 50), "grouped": ("grouped", 50),
         "grouped, epoch": ("grouped", 0)}  # column: (data.batching, data.group_size)


def padding(lengths: np.ndarray, epochs: int, mode: str, per_doubling: int) -> tuple[float, int, int]:
  """(padded share of the token slots, steps, distinct padded lengths) over one run of the recipe."""

  class Lengths(list):
    pass

  table = Lengths([{"input_ids": np.zeros(n, np.int32)} for n in lengths])
  table.lengths = lengths
  batching, group_size = MODES[mode]
  stream = features.ExampleBatches(table, global_batch=BATCH, max_len=MAX_LEN, pad_id=0, seed=0, batching=batching,
                                   buckets=per_doubling, group_size=group_size)
  steps = -(-len(lengths) * epochs // BATCH)
  real = slots = 0
  shapes = set()
  for step in range(steps):
    chosen = stream.global_indices(step * BATCH, BATCH)
    length = stream.length(chosen)
    shapes.add(length)
    real += int(lengths[chosen].sum())
    slots += BATCH * length
  return 1 - real / slots, steps, len(shapes)


def wall_time(max_len: int, batching: str) -> tuple[float, float]:
  """Seconds of one runlocal SST-2 fine-tuning, cold and then warm (the same run again with JAX's persistent
  compilation cache filled by the first: what every later run of a sweep pays)."""
  times = []
  with tempfile.TemporaryDirectory() as cache:
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": cache, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    for _ in range(2):
      with tempfile.TemporaryDirectory() as workdir:
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "posjax.main", "--config=configs/finetune/glue.py:task=sst2,runlocal",
                        f"--workdir={workdir}", f"--config.max_len={max_len}", f"--config.data.batching={batching}",
                        "--config.data.buckets_per_doubling=4", "--config.progress=False"], check=True,
                       capture_output=True, env=env,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        times.append(time.perf_counter() - start)
  return times[0], times[1]


def main(argv):
  del argv
  source = "real files" if _GLUE_DIR.value else "modelled lengths (LENGTHS)"
  lengths = {task: real_lengths(task) if _GLUE_DIR.value else modelled_lengths(n, mean, p95)
             for task, (n, _, mean, p95) in LENGTHS.items()}
  for per_doubling in map(int, _PER_DOUBLING.value):
    ladder = features.length_buckets(MAX_LEN, per_doubling)
    print(f"{describe_device()}; batch {BATCH}, max_len {MAX_LEN}, {source}; buckets_per_doubling={per_doubling} "
          f"({len(ladder)} lengths)\n")
    print("| task | examples x epochs | mean tokens | steps | padded: " + " | ".join(MODES) + " | shapes: "
          + " | ".join(m for m in MODES if m != "fixed") + " |")
    print("|---|---|---|---|" + "---|" * (2 * len(MODES) - 1))
    totals = {m: [0, 0] for m in MODES}
    for task, (_, epochs, _, _) in LENGTHS.items():
      found = {m: padding(lengths[task], epochs, m, per_doubling) for m in MODES}
      real = int(lengths[task].sum()) * epochs
      for m, (share, _, _) in found.items():
        totals[m][0] += real
        totals[m][1] += real / (1 - share)
      print(f"| {task} | {len(lengths[task]):,} x {epochs} | {lengths[task].mean():.1f} | {found['fixed'][1]:,} | "
            + " | ".join(f"{100 * found[m][0]:.1f}%" for m in MODES) + " | "
            + " | ".join(str(found[m][2]) for m in MODES if m != "fixed") + " |")
    print("| all eight, by token slots | | | | " + " | ".join(
        f"{100 * (1 - real / slots):.1f}%" for real, slots in totals.values()) + " |" + " |" * (len(MODES) - 1))
    print()
  if _WALL.value:
    print("| runlocal SST-2: cold / warm compilation cache | " + " | ".join(f"max_len {n}" for n in _MAX_LENS.value)
          + " |")
    print("|---|" + "---|" * len(_MAX_LENS.value))
    for batching in ("fixed", "dynamic"):
      times = [wall_time(int(n), batching) for n in _MAX_LENS.value]
      print(f"| {batching} | " + " | ".join(f"{cold:.0f} s / {warm:.0f} s" for cold, warm in times) + " |")


if __name__ == "__main__":
  app.run(main)
