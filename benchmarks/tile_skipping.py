"""What skipping masked tiles saves: forward + backward of :func:`posjax.kernels.relative_attention` under full
attention, the causal mask, a sliding window (looking back, and on both sides: an encoder's), chunks (Llama 4's
chunked attention, which reaches the kernels as segments) and packed documents, with the tiles each visits (from
:func:`posjax.kernels.tile.tile_ranges`) and the wall time, each as a ratio to full attention. On a CPU the
kernels run in a Pallas interpreter (``--interpret=gpu``: the Triton kernels in the generic one; ``tpu``: the
Mosaic kernels in the TPU interpreter), whose time follows the tiles computed; on a GPU or TPU they compile.

  python benchmarks/tile_skipping.py --length=4096 --window=512 --documents=4 --chunk=1024
  python benchmarks/tile_skipping.py --interpret=tpu --length=2048 --window=256
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import common
from posjax import attention, kernels
from posjax.kernels import tile

_LENGTH = flags.DEFINE_integer("length", 4096, "Sequence length.")
_WINDOW = flags.DEFINE_integer("window", 512, "The sliding window's keys.")
_DOCUMENTS = flags.DEFINE_integer("documents", 4, "Packed documents of equal length in the row (causal).")
_CHUNK = flags.DEFINE_integer("chunk", 1024, "Chunked attention's block of tokens (causal).")
_HEADS = flags.DEFINE_integer("heads", 1, "Query heads (k/v: the same).")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 64, "Head dimension.")
_INTERPRET = flags.DEFINE_enum("interpret", "gpu", ["gpu", "tpu", "none"],
                               "The interpreter on a CPU (none: compile for the device).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed runs (median).")


def main(argv):
  del argv
  length, heads, dim = _LENGTH.value, _HEADS.value, _HEAD_DIM.value
  interpret = {"gpu": True, "tpu": "tpu", "none": False}[_INTERPRET.value]
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(1, length, heads, dim)), jnp.float32) for _ in range(3))
  documents = np.repeat(np.arange(_DOCUMENTS.value), -(-length // _DOCUMENTS.value))[None, :length]
  positions = np.concatenate([np.arange(np.sum(documents[0] == d)) for d in range(_DOCUMENTS.value)])[None]
  cases = {"full": dict(), "causal": dict(causal=True),
           f"causal, window {_WINDOW.value}": dict(causal=True, sliding_window=_WINDOW.value),
           f"window {_WINDOW.value}, both sides": dict(sliding_window=_WINDOW.value),
           f"causal, chunks of {_CHUNK.value}": dict(causal=True, segment_ids=np.asarray(attention.Mask(
               causal=True, chunk=_CHUNK.value).chunked(1, length).segment_ids)),
           f"causal, {_DOCUMENTS.value} documents": dict(causal=True, segment_ids=documents, positions=positions)}
  print(f"{common.describe_device()}; L={length}, {heads} head(s), K={dim}, interpreter: {_INTERPRET.value}\n")
  print("| mask | tiles computed (forward) | time, forward + backward | ratio to full |")
  print("|---|---|---|---|")
  reference = None
  for name, options in cases.items():
    def loss(q, k, v, options=options):
      out = kernels.relative_attention(q, k, v, interpret=interpret, platform="gpu" if interpret is True else None,
                                       **options)
      return jnp.sum(out * out)

    seconds, _, _ = common.compile_and_time(jax.grad(loss, argnums=(0, 1, 2)), (q, k, v), repeats=_REPEATS.value)
    blocks = (kernels.mosaic if interpret == "tpu" else kernels.triton).default_block_sizes(kernels.Terms(), length,
                                                                                            dim)
    bq, bk, padded = tile.block_sizes(length, *blocks)
    plan = tile.Plan(scale=1.0, causal=options.get("causal", False), block_q=bq, block_k=bk, length=length,
                     interpret=interpret, treedef=jax.tree_util.tree_structure(kernels.Terms()),
                     sliding_window=options.get("sliding_window", 0))
    segments = jnp.asarray(options.get("segment_ids", np.zeros((1, length), np.int32)))
    keys = np.asarray(tile.tile_ranges(plan, segments, jnp.ones((1, padded), jnp.int32))[0])
    computed = int(np.sum(keys[0, :, 1] - keys[0, :, 0]))
    reference = reference or seconds
    print(f"| {name} | {computed} of {(padded // bq) * (padded // bk)} ({bq}x{bk}) | {seconds:.2f} s | "
          f"{seconds / reference:.2f} |", flush=True)


if __name__ == "__main__":
  app.run(main)
