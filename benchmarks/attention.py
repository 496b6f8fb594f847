"""Time and memory of every position method: one attention layer and a BERT-Base MLM train step.

For each method and sequence length it compiles (a) forward+backward of one self-attention layer at
BERT-Base width (768, 12 heads) including the method's encoder-level part, and (b) a full train step
(forward, backward, AdamW update) of a BERT-Base MLM model, and reports the median wall time and XLA's
compiled temporary memory (``memory_analysis().temp_size_in_bytes``). Prints a markdown table.

  python benchmarks/attention.py --lengths=128,512,2048 --batch=8 --dtype=bfloat16 --kernels=auto
  python benchmarks/attention.py --methods=absolute,tupe_r,huang_m4 --kernels=cudnn,pallas,xla --lengths=512,2048
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import common
from posjax import attention, positions
from posjax.models.transformer import DTYPES

_METHODS = flags.DEFINE_list("methods", None, "Methods to run (default: all registered).")
_LENGTHS = flags.DEFINE_list("lengths", ["128", "512", "2048"], "Sequence lengths.")
_BATCH = flags.DEFINE_integer("batch", 8, "Sequences per step.")
_LAYERS = flags.DEFINE_integer("layers", 12, "Layers of the model step (12 = BERT-Base).")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", list(DTYPES), "Compute dtype (parameters stay float32).")
_KERNELS = flags.DEFINE_list("kernels", ["auto"], f"Attention kernels ({', '.join(attention.KERNELS)}); ratios are "
                             "to absolute on the first.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed runs per measurement (median reported).")
_MODEL_TIME_MAX_LEN = flags.DEFINE_integer(
    "model_time_max_len", 1 << 30, "Longer model steps are compiled for memory but not timed (slow CPUs).")
_LAYER_TIME_MAX_LEN = flags.DEFINE_integer(
    "layer_time_max_len", 1 << 30, "Longer layers are compiled for memory but not timed (e.g. Pallas interpret mode).")
_SKIP_MODEL = flags.DEFINE_bool("skip_model", False, "Only the single-layer measurements.")
_CAUSAL = flags.DEFINE_bool("causal", False, "Decoder layers (a causal mask, the methods' decoder forms; the "
                            "decoder-only methods need it); single-layer measurements only.")

HIDDEN, HEADS, FFN = 768, 12, 3072


def layer_measurement(name: str, length: int, batch: int, dtype, kernel: str, repeats: int, run: bool = True):
  spec = positions.make(name, num_heads=HEADS, hidden_size=HIDDEN, max_len=max(512, length), dtype=dtype,
                        causal=_CAUSAL.value)
  kernel = common.kernel_for(name, kernel)

  class Layer(nn.Module):
    @nn.compact
    def __call__(self, x, pos):
      state = spec.method.encoder(spec=spec, name="pos")(pos)
      return attention.SelfAttention(spec, kernel, name="attn")(x, state, attention.Mask(causal=_CAUSAL.value))

  x = jnp.asarray(np.random.default_rng(0).normal(size=(batch, length, HIDDEN)), dtype)
  pos = jnp.arange(length)[None]
  params = Layer().init(jax.random.PRNGKey(0), x, pos)["params"]
  loss = lambda p, x: jnp.sum(Layer().apply({"params": p}, x, pos).astype(jnp.float32) ** 2)
  return common.compile_and_time(jax.grad(loss, argnums=(0, 1)), (params, x), run, repeats)[:2]


def model_measurement(name: str, length: int, batch: int, dtype_name: str, kernel: str, layers: int, run: bool,
                      repeats: int):
  step, args, _, _ = common.bert_train_step(name, length, batch, dtype_name, kernel, layers)
  return common.compile_and_time(step, args, run, repeats)[:2]


def fmt(seconds=None, nbytes=None):
  if seconds is not None:
    return f"{seconds * 1e3:.1f}"
  return "—" if nbytes is None else f"{nbytes / 2**20:.0f}"


def main(argv):
  del argv
  if _CAUSAL.value and not _SKIP_MODEL.value:
    raise app.UsageError("--causal measures single layers: add --skip_model (the model step is BERT's, an encoder)")
  methods = _METHODS.value or (positions.names() if _CAUSAL.value else positions.encoder_names())
  dtype = DTYPES[_DTYPE.value]
  print(f"device: {common.describe_device()}; batch {_BATCH.value}, dtype {_DTYPE.value}, kernels "
        f"{','.join(_KERNELS.value)}, model {_LAYERS.value}×{HIDDEN}, dropout off\n")
  header = ("| method | L | kernel | layer fwd+bwd ms | layer temp MiB | model step ms | model temp MiB | "
            f"step / absolute on {_KERNELS.value[0]} |")
  print(header + "\n|" + "---|" * 8, flush=True)
  reference = {}
  for length in map(int, _LENGTHS.value):
    for name in methods:
      for kernel, shown in common.kernel_rows(name, _KERNELS.value):
        layer_time, layer_temp = layer_measurement(name, length, _BATCH.value, dtype, kernel, _REPEATS.value,
                                                   length <= _LAYER_TIME_MAX_LEN.value)
        step_time = step_temp = None
        if not _SKIP_MODEL.value:
          step_time, step_temp = model_measurement(name, length, _BATCH.value, _DTYPE.value, kernel,
                                                   _LAYERS.value, length <= _MODEL_TIME_MAX_LEN.value,
                                                   _REPEATS.value)
        if name == "absolute" and kernel == _KERNELS.value[0]:
          reference[length] = step_time
        ratio = f"{step_time / reference[length]:.2f}×" if step_time and reference.get(length) else "—"
        print(f"| `{name}` | {length} | {shown} | {fmt(layer_time)} | {fmt(nbytes=layer_temp)} | "
              f"{fmt(step_time) if step_time else '—'} | {fmt(nbytes=step_temp)} | {ratio} |", flush=True)


if __name__ == "__main__":
  app.run(main)
