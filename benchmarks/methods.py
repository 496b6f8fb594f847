"""Every registered position method, measured on a tiny BERT encoder: what it contributes, how many
parameters it adds to BERT-Base, whether a fused kernel can run it, whether its outputs are invariant to
shifting a sequence behind padding, and whether it runs at twice the trained max_len.

  python benchmarks/methods.py [--out=FILE.md]
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from posjax import positions
from posjax.models import TransformerConfig, TransformerStack

FLAGS = flags.DEFINE_string("out", None, "Also write the table to this markdown file.")


def parameter_count(config: TransformerConfig) -> int:
  """The encoder's parameter count, from shapes alone."""
  shapes = jax.eval_shape(TransformerStack(config).init, jax.random.PRNGKey(0), jnp.ones((1, 8), jnp.int32))
  return sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))


def contributions(name: str) -> str:
  """Where the method contributes: input embedding, shared bias, per-layer q/k terms."""
  config = TransformerConfig.tiny(position=name)
  spec = config.position_spec
  parts = []
  state = jax.eval_shape(lambda p: spec.method.encoder(spec=spec).init_with_output(jax.random.PRNGKey(0), p)[0],
                         jnp.zeros((1, 8), jnp.int32))
  parts += ["input embedding"] * (state.embedding is not None) + ["shared bias"] * (state.bias is not None)
  if spec.method.layer is not None and "shared bias" not in parts:
    parts.append("per-layer q/k terms")
  return ", ".join(parts) or "nothing"


def shift_invariant(name: str, rng) -> bool:
  """Whether the same tokens give the same outputs at another offset (random, larger-scale parameters)."""
  model = TransformerStack(TransformerConfig.tiny(position=name))
  content = rng.integers(1, 128, size=6)
  ids, mask = np.zeros((2, 10), np.int32), np.zeros((2, 10), np.int32)
  ids[0, :6], ids[1, 4:], mask[0, :6], mask[1, 4:] = content, content, 1, 1
  params = model.init(jax.random.PRNGKey(0), ids)["params"]
  # Parameters drawn at a larger scale than the 0.02 initialisation, so that small terms are visible.
  params = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape) * 0.3, p.dtype), nn.unbox(params))
  h = model.apply({"params": params}, ids, attention_mask=mask).last_hidden_state
  return bool(np.allclose(h[0, :6], h[1, 4:], atol=1e-4))


def runs_at_twice_max_len(name: str) -> str:
  """What the method does on a sequence twice its ``max_len``: runs, NaN, or a clear error."""
  config = TransformerConfig.tiny(position=name, max_len=16)
  model = TransformerStack(config)
  try:
    variables = model.init(jax.random.PRNGKey(0), jnp.ones((1, 16), jnp.int32))
    out = model.apply(variables, jnp.ones((1, 32), jnp.int32)).last_hidden_state
  except ValueError:
    return "unsupported (error)"
  return "yes" if np.isfinite(out).all() else "NaN"


def main(argv):
  """Prints (and with ``--out`` writes) the table of every registered method."""
  del argv
  rng = np.random.default_rng(0)
  base = parameter_count(TransformerConfig.base(position="none"))
  rows = ["| method | contributes | + params at BERT-Base | fused kernel | shift-invariant | runs at 2× max_len |",
          "|---|---|---|---|---|---|"]
  for name in positions.encoder_names():
    spec = TransformerConfig.tiny(position=name).position_spec
    added = parameter_count(TransformerConfig.base(position=name)) - base
    rows.append(f"| `{name}` | {contributions(name)} | {added:,} | {'no' if spec.refusal('pallas') else 'yes'} | "
                f"{'yes' if shift_invariant(name, rng) else 'no'} | {runs_at_twice_max_len(name)} |")
    print(rows[-1], flush=True)
  table = "\n".join(rows)
  print("\n" + table)
  if FLAGS.value:
    with open(FLAGS.value, "w") as f:
      f.write(table + "\n")


if __name__ == "__main__":
  app.run(main)
