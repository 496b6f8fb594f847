import os
import pathlib
import shutil
import tempfile

# What every process of the session reads, the test processes and every child they start (set before JAX starts):
# one persistent compilation cache (a program compiled once is read back by every later run of it, in any process;
# without a size limit, whose eviction would scan the thousands of entries at every write; an entry read while
# another process writes it fails to parse and is compiled again), no optimisation passes and XLA:CPU's older
# elemental emitters instead of its fusion emitters (the tests compile many tiny programs: the passes and the
# fusion emitters' MLIR pipeline cost more than they save; each halves the compile of a tiny model's train step).
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:  # the first process of the session (pytest-xdist's controller); its workers inherit the directory
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="posjax-tests-jax-cache-")
os.environ.update(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_DISABLE_MOST_OPTIMIZATIONS="1")
FAST_COMPILE_FLAG = "--xla_cpu_use_fusion_emitters=false"
if FAST_COMPILE_FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE_FLAG}".strip()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("USE_TF", "0")  # transformers without its TensorFlow classes (none is used): 6-10 s an import

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from posjax import attention, config_args, positions  # noqa: E402

# Eight CPU devices in the test processes, for the mesh / pmap tests. Through JAX's config rather than XLA_FLAGS, so
# that a child process runs on one device unless its test gives it a layout (XLA_FLAGS) of its own.
jax.config.update("jax_num_cpu_devices", 8)
jax.jit(lambda x: x + 1)(0)  # starts the backend and the cache here, before a test could point JAX elsewhere


def pytest_collection_modifyitems(items):
  """The longest tests (marked slow) first, so that pytest-xdist's workers finish together."""
  items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_unconfigure(config):
  """The session's compilation cache goes with it (unless it was given: JAX_COMPILATION_CACHE_DIR)."""
  if _OWN_CACHE and not hasattr(config, "workerinput"):
    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


def devices_env(devices: int) -> dict:
  """The environment of a child process with ``devices`` CPU devices (a layout its test needs)."""
  flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                   if not f.startswith("--xla_force_host_platform_device_count"))
  return {**os.environ, "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={devices}".strip()}


# Row 0: one sequence at 0..L-1. Row 1: two packed segments, each starting at position 0 ([CLS]).
PACKED_POSITIONS = np.array([[0, 1, 2, 3, 4, 5, 6, 7, 8], [0, 1, 2, 3, 4, 0, 1, 2, 3]], np.int32)
PACKED_SEGMENTS = np.array([[0] * 9, [0] * 5 + [1] * 4], np.int32)


class OneLayer(nn.Module):
  """A method's encoder-level module and one attention layer: the unit the reference loops check."""

  spec: positions.PositionSpec
  kernel: str = "xla"

  @nn.compact
  def __call__(self, x_BxLxD, positions_BxL, mask=None):
    state = self.spec.method.encoder(spec=self.spec, name="pos")(positions_BxL)
    return attention.SelfAttention(self.spec, self.kernel, name="attn")(x_BxLxD, state, mask)


def one_axis(names):
  """The methods of ``names`` that read the plain ``[B, L]`` positions these tests give (the multi-axis ones:
  tests/test_multi_axis.py, where M-RoPE's text positions are shown to be RoPE's)."""
  return [name for name in names if positions.get(name).axes <= 1]


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
