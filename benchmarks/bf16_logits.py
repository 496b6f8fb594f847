"""How much each position method's attention logits lose in bf16: one layer with random parameters (scale 0.3),
computed in bf16 and in float32 on the same float32 parameters, ``max |bf16 - float32| / max |float32|``, averaged
over seeds, and its ratio to plain attention's (``none``).

  python benchmarks/bf16_logits.py [--length=32] [--seeds=3]
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from posjax import attention, positions

_LENGTH = flags.DEFINE_integer("length", 32, "Sequence length.")
_SEEDS = flags.DEFINE_integer("seeds", 3, "Random draws averaged.")


class Layer(nn.Module):
  spec: positions.PositionSpec

  @nn.compact
  def __call__(self, x_BxLxD, positions_BxL):
    state = self.spec.method.encoder(spec=self.spec, name="pos")(positions_BxL)
    return attention.SelfAttention(self.spec, name="attn")(x_BxLxD, state)


def logit_error(name: str, seed: int, length: int) -> float:
  rng = np.random.default_rng(seed)
  x, pos = rng.normal(size=(2, length, 64)).astype(np.float32), np.arange(length)[None]
  spec = lambda dtype: positions.make(name, num_heads=4, hidden_size=64, max_len=length, dtype=dtype)
  params = Layer(spec(jnp.float32)).init(jax.random.PRNGKey(0), x, pos)["params"]
  params = jax.tree.map(lambda p: (rng.normal(size=p.shape) * 0.3).astype(np.float32), nn.unbox(params))

  def logits(dtype):
    _, inter = Layer(spec(dtype)).apply({"params": params}, x, pos, mutable=["intermediates"])
    return np.asarray(inter["intermediates"]["attn"]["attention_logits"][0], np.float64)

  want = logits(jnp.float32)
  return float(np.max(np.abs(logits(jnp.bfloat16) - want)) / np.max(np.abs(want)))


def main(argv):
  del argv
  errors = {name: np.mean([logit_error(name, seed, _LENGTH.value) for seed in range(_SEEDS.value)])
            for name in positions.encoder_names()}
  print("| method | bf16 logit error | x plain attention's |\n|---|---|---|")
  for name, error in errors.items():
    print(f"| {name} | {error:.2e} | {error / errors['none']:.2f} |")


if __name__ == "__main__":
  app.run(main)
