import os
import pathlib

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# Eight fake CPU devices, for the mesh / pmap tests (set before JAX starts).
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from posjax import attention, config_args, positions  # noqa: E402

# Tests compile many tiny programs: optimisation passes cost more than they save.
jax.config.update("jax_disable_most_optimizations", True)

# Row 0: one sequence at 0..L-1. Row 1: two packed segments, each starting at position 0 ([CLS]).
PACKED_POSITIONS = np.array([[0, 1, 2, 3, 4, 5, 6, 7, 8], [0, 1, 2, 3, 4, 0, 1, 2, 3]], np.int32)
PACKED_SEGMENTS = np.array([[0] * 9, [0] * 5 + [1] * 4], np.int32)


class OneLayer(nn.Module):
  """A method's encoder-level module and one attention layer: the unit the reference loops check."""

  spec: positions.PositionSpec
  kernel: str = "xla"

  @nn.compact
  def __call__(self, x_BxLxD, positions_BxL, mask=None):
    encoder = self.spec.method.encoder
    state = encoder(spec=self.spec, name="pos")(positions_BxL) if encoder else positions.PositionState()
    return attention.SelfAttention(self.spec, self.kernel, name="attn")(x_BxLxD, state, mask)


def randomize(params, seed=0, scale=0.5):
  """Every parameter drawn at random, so no term hides behind a zero or one initialisation."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda p: (rng.normal(size=p.shape) * scale).astype(np.float32), nn.unbox(params))


@pytest.fixture
def rng():
  return np.random.default_rng(0)


ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_config(name: str, arg: str):
  """``get_config(arg)`` of ``configs/<name>.py``, loaded by path as ``--config`` does."""
  return config_args.load_config(f"configs/{name}.py:{arg}" if arg else f"configs/{name}.py")


def override(config, **overrides):
  """``config`` with dotted fields set, as ``--config.a.b=value`` would (``None`` allowed)."""
  for key, value in overrides.items():
    target = config
    *parents, leaf = key.split(".")
    for parent in parents:
      target = target[parent]
    target[leaf] = value
  return config
