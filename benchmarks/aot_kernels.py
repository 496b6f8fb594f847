"""Every fused-kernel case compiled ahead of time for its devices, on this CPU: per position method, target and
length, whether forward + backward compile, how long the compile takes, and on a GPU each kernel's registers,
spill stores and shared memory (against the 232,448 B an sm_90 block may opt into).

  python benchmarks/aot_kernels.py --targets=h100,v5e:2x2,v6e:2x2 --lengths=512,2048
  python benchmarks/aot_kernels.py --cases=none,alibi --mask=window:512 --lengths=4096   # causal, windowed

``--mask``: ``full`` (default), ``causal``, ``window:W`` (causal in a sliding window of W: the kernels skip the
tiles it rules out, their loops bounded by run-time tile ranges) or ``chunk:C`` (causal in aligned chunks of C, given
as segments as the model gives them); ``decode``, ``decode:W`` or ``decode_chunk:C``: the decode kernel
(:func:`posjax.kernels.decode_attention`, forward only) of one new query per row against a cache of L slots (in a
window of W), 12 query heads reading 4 k/v heads, its cell in the forward column.

Each case compiles in its own process (ptxas runs single-threaded in child processes; a case past ``--timeout``
is killed with its children and shown as such). Shapes: batch 2, 12 heads, head dim 64, bf16, the op's default
tiles; the ``wide`` case is the tests' wide tables (259 bucket entries, 257 gathered distances) at L=40.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

import flax.struct
import jax
import jax.numpy as jnp

import common
from posjax import kernels
from posjax.aot import compile as aot
from posjax.aot import resources, targets

CASES = ("none", "alibi", "t5", "alibi+t5", "tupe_a", "tupe_r", "shaw", "m4", "m4_gathered", "wide", "kerple_log",
         "kerple_power", "fire", "sandwich", "sandwich_256", "sandwich_512", "forget", "stick_breaking", "cope", "open",
         "sink")
KERNELS = ("forward_kernel", "dq_kernel", "dkv_kernel", "window_grad_kernel")
FOUND = KERNELS + ("decode_kernel",) + tuple(f"{rule}_{name}" for rule in ("stick", "cope")
                                             for name in ("forward_kernel", "dq_kernel", "dkv_kernel"))


@flax.struct.dataclass
class TableTemperature(kernels.Term):
  """An open term as a user writes it (:mod:`posjax.kernels.term`): the content score scaled per query by ``1 + b_h
  log(1 + p_i)``, plus a per-head table read at the bit length of the distance (4 per direction)."""

  b: jax.Array  # [H]
  table: jax.Array  # [H, 8]
  KINDS = {"b": kernels.HEAD, "table": kernels.TABLE}

  def logits(self, tile, s):
    r = tile.k_positions - tile.q_positions
    bits = sum((jnp.abs(r) >= 2 ** t).astype(jnp.int32) for t in range(3))
    scaled = s * (1.0 + tile.head("b") * jnp.log1p(tile.q_positions.astype(jnp.float32)))
    return scaled + tile.lookup("table", bits + 4 * (r > 0))


def terms_for(case: str, length: int, heads: int, head_dim: int):
  """``(Terms, length, heads, head_dim)`` of a case: each method's terms as its position module builds them."""
  f32 = lambda *shape: jnp.full(shape, 0.01, jnp.float32)
  bf16 = lambda *shape: f32(*shape).astype(jnp.bfloat16)  # TUPE's projections, in the model's compute dtype
  untied = kernels.Untied(bf16(1, length, heads, head_dim), bf16(1, length, heads, head_dim), f32(2, heads))
  k = length - 1
  return {
      "none": lambda: kernels.Terms(),
      "alibi": lambda: kernels.Terms(alibi=kernels.Alibi(f32(heads))),
      "t5": lambda: kernels.Terms(buckets=kernels.Buckets(f32(32, heads))),
      "alibi+t5": lambda: kernels.Terms(alibi=kernels.Alibi(f32(heads)), buckets=kernels.Buckets(f32(32, heads))),
      "tupe_a": lambda: kernels.Terms(untied=untied),
      "tupe_r": lambda: kernels.Terms(untied=untied, buckets=kernels.Buckets(f32(33, heads), cls_row=16, cls_col=32)),
      "shaw": lambda: kernels.Terms(relative=kernels.Relative(f32(2 * k + 1, head_dim), k, query=True)),
      "m4": lambda: kernels.Terms(relative=kernels.Relative(f32(2 * k + 1, head_dim), k, query=True, key=True)),
      "m4_gathered": lambda: kernels.Terms(relative=kernels.Relative(f32(2 * k + 1, head_dim), k, query=True,
                                                                     key=True, window=False)),
      "kerple_log": lambda: kernels.Terms(kerple=kernels.Kerple(f32(heads), f32(heads), "log")),
      "kerple_power": lambda: kernels.Terms(kerple=kernels.Kerple(f32(heads), f32(heads), "power")),
      "fire": lambda: kernels.Terms(fire=kernels.Fire(f32(32), f32(32), f32(32, heads), f32(heads), f32(),
                                                      jnp.full((), 512.0))),
      "sandwich": lambda: kernels.Terms(sandwich=kernels.Sandwich(f32(heads) + 1.0)),
      "sandwich_256": lambda: kernels.Terms(sandwich=kernels.Sandwich(f32(heads) + 1.0, dim=256)),
      "sandwich_512": lambda: kernels.Terms(sandwich=kernels.Sandwich(f32(heads) + 1.0, dim=512)),
      "forget": lambda: kernels.Terms(forget=kernels.Forget(f32(1, heads, length))),
      "stick_breaking": lambda: kernels.Terms(stick_breaking=kernels.StickBreaking()),
      "cope": lambda: kernels.Terms(cope=kernels.Cope(f32(head_dim, 64))),
      "open": lambda: kernels.Terms(open=(TableTemperature(f32(heads), f32(heads, 8)),)),
      "sink": lambda: kernels.Terms(sink=kernels.Sink(f32(heads))),
      "wide": lambda: kernels.Terms(buckets=kernels.Buckets(f32(259, heads), kind="clip", max_distance=128,
                                                            cls_row=257, cls_col=258),
                                    relative=kernels.Relative(f32(257, head_dim), 128, query=True, key=True,
                                                              window=False)),
  }[case]()


def mask_options(mask: str, length: int = 1) -> dict:
  """``relative_attention``'s (or the decode kernel's) mask arguments of a ``--mask`` value."""
  if mask == "full":
    return {}
  if mask == "causal":
    return {"causal": True}
  if mask.startswith("window:") and mask[7:].isdigit():
    return {"causal": True, "sliding_window": int(mask[7:])}
  if mask.startswith("chunk:") and mask[6:].isdigit():  # training: chunks as segments (attention.Mask.chunked)
    return {"causal": True, "segment_ids": (jnp.arange(length, dtype=jnp.int32) // int(mask[6:]))[None]}
  if mask == "decode" or (mask.startswith("decode:") and mask[7:].isdigit()):
    return {"sliding_window": int(mask[7:] or 0)}
  if mask.startswith("decode_chunk:") and mask[13:].isdigit():
    return {"chunk": int(mask[13:])}
  raise ValueError(f"--mask={mask!r}; allowed: full, causal, window:W, chunk:C, decode, decode:W, decode_chunk:C")


def decode_step(terms, target, batch: int, length: int, heads: int, head_dim: int, mask: str):
  """The traced decode kernel of one query per row at the last of ``length`` cache slots (``heads // 3`` k/v heads),
  or None where it does not build the case's terms."""
  if kernels.decode.kernel_refusal(terms):
    return None
  device = jax.sharding.SingleDeviceSharding(target.devices[0])
  on = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=device)
  cache = on((batch, heads // 3, length, head_dim), jnp.bfloat16)
  abstract_terms = jax.tree.map(lambda a: on(a.shape, a.dtype), terms)
  step = lambda q, k, v, positions, valid, terms: kernels.decode_attention(
      q, k, v, start=length - 1, key_positions=positions, key_valid=valid, terms=terms, platform=target.platform,
      interpret=False, **mask_options(mask, length))
  return jax.jit(step).trace(on((batch, 1, heads, head_dim), jnp.bfloat16), cache, cache,
                             on((batch, length), jnp.int32), on((batch, length), jnp.bool_), abstract_terms)


def worker(case: str, target_name: str, length: int, blocks: tuple[int, int] | None = None,
           mask: str = "full") -> dict:
  """Compiles one case (in this process) and returns what the compiler reported."""
  aot.setup()
  target = targets.devices(target_name)
  batch, heads, head_dim = (2, 2, 24) if case == "wide" else (2, 12, 64)
  length = 40 if case == "wide" else length
  terms = terms_for(case, length, heads, head_dim)
  if target.platform == "tpu" and terms.relative is not None and terms.relative.window is False:
    return {"result": "n/a (the TPU kernels read relative vectors windowed)"}
  device = jax.sharding.SingleDeviceSharding(target.devices[0])
  x = jax.ShapeDtypeStruct((batch, length, heads, head_dim), jnp.bfloat16, sharding=device)
  abstract_terms = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), terms)

  def loss(q, k, v, terms):
    out = kernels.relative_attention(q, k, v, terms=terms, platform=target.platform, interpret=False,
                                     block_sizes=blocks, **mask_options(mask, length))
    return jnp.sum(out.astype(jnp.float32))

  if mask.startswith("decode"):
    traced = decode_step(terms, target, batch, length, heads, head_dim, mask)
    if traced is None:
      return {"result": f"n/a ({kernels.decode.kernel_refusal(terms)}: decoded on the xla formulas)"}
  else:
    try:
      traced = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(x, x, x, abstract_terms)
    except ValueError as refused:  # a case the op refuses on this target (its own one-line error)
      return {"result": f"n/a ({str(refused).split(';')[0]})"}
  dump = tempfile.mkdtemp(prefix="aot-kernels-")
  start = time.perf_counter()
  with resources.captured_stderr() as log:
    try:
      traced.lower().compile(compiler_options={"xla_dump_to": dump} if target.platform == "gpu" else {})
      error = None
    except Exception as caught:  # noqa: BLE001  (the compiler's error is the result)
      error = f"{type(caught).__name__}: {str(caught).strip().splitlines()[0][:160]}"
  seconds = time.perf_counter() - start
  found = resources.merge(resources.parse_ptxas(log[0]), resources.read_dump(dump)) if not error else {}
  tiles = blocks or (kernels.decode.default_block_sizes(terms, 1, head_dim, target.platform == "tpu")
                     if mask.startswith("decode") else
                     kernels.default_block_sizes(terms, length, head_dim, target.platform == "tpu"))
  return {"result": error or "compiles", "seconds": seconds, "tiles": "x".join(map(str, tiles)),
          "kernels": {name: vars(found[name]) for name in FOUND if name in found}}


def run_case(case: str, target: str, length: int, blocks: str, timeout: float, mask: str = "full") -> dict:
  """:func:`worker` in a child process group, killed whole past ``timeout`` seconds."""
  command = [sys.executable, __file__, f"--worker={case},{target},{length},{blocks},{mask}"]
  start = time.perf_counter()
  finished = common.run_in_group(command, timeout)
  if finished is None:
    return {"result": f"not done after {timeout:.0f} s (killed)", "seconds": time.perf_counter() - start}
  out, _, status = finished
  lines = [line for line in out.splitlines() if line.startswith("{")]
  return json.loads(lines[-1]) if lines else {"result": f"worker failed (status {status})"}


def cell(kernel: dict | None) -> str:
  if not kernel:
    return ""
  shared = kernel.get("shared_memory")
  share = "?" if shared is None else f"{shared / 232_448:.0%}"
  return f"{kernel.get('registers', '?')} / {kernel.get('spill_stores', '?')} B / {share}"


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--targets", default="h100,v5e:2x2,v6e:2x2")
  parser.add_argument("--lengths", default="512,2048")
  parser.add_argument("--cases", default=",".join(CASES))
  parser.add_argument("--blocks", default="default", help="tiles, e.g. default,128x128,256x256")
  parser.add_argument("--timeout", type=float, default=600.0, help="seconds per case")
  parser.add_argument("--mask", default="full",
                      help="full, causal, window:W, chunk:C, decode, decode:W or decode_chunk:C")
  parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.worker:
    case, target, length, blocks, mask = args.worker.split(",")
    tiles = None if blocks == "default" else tuple(int(n) for n in blocks.split("x"))
    print(json.dumps(worker(case, target, int(length), tiles, mask)))
    return
  mask_options(args.mask)
  cases = args.cases.split(",")
  unknown = sorted(set(cases) - set(CASES))
  if unknown:
    parser.error(f"unknown case(s) {unknown}; allowed: {list(CASES)}")
  print("| case | L | target | tiles | result | compile s | forward | dq | dkv | window grad |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for case in cases:
    for length in ([40] if case == "wide" else [int(n) for n in args.lengths.split(",")]):
      for target, blocks in ((t, b) for t in args.targets.split(",") for b in args.blocks.split(",")):
        r = run_case(case, target, length, blocks, args.timeout, args.mask)
        k = r.get("kernels", {})
        seconds = f"{r['seconds']:.0f}" if "seconds" in r else ""
        for name in ("forward_kernel", "dq_kernel", "dkv_kernel"):  # the weight rules' own kernels, same columns
          k.setdefault(name, k.get(f"stick_{name}") or k.get(f"cope_{name}"))
        k["forward_kernel"] = k["forward_kernel"] or k.get("decode_kernel")
        print(f"| {case} | {length} | {target} | {r.get('tiles', blocks)} | {r['result']} | {seconds} | "
              + " | ".join(cell(k.get(name)) for name in KERNELS) + " |", flush=True)
  print("\nKernel cells: registers / spill stores per thread / shared memory of the 232,448 B opt-in limit.")


if __name__ == "__main__":
  main()
