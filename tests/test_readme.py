"""The README as a new user meets it: each Python example runs on its own, ``make`` alone lists the targets."""

import pathlib
import re
import subprocess

import flax
import jax
import numpy as np

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_examples_run_each_on_its_own():
  blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
  assert len(blocks) == 4
  previous = flax.config.flax_always_shard_variable
  namespaces = [{} for _ in blocks]
  try:
    for block, namespace in zip(blocks, namespaces):
      exec(compile(block, str(README), "exec"), namespace)
  finally:
    flax.config.update("flax_always_shard_variable", previous)
  linen, bridged, bert, fused = namespaces
  assert linen["y"].shape == (2, 16, 64) and np.isfinite(linen["y"]).all()
  assert bridged["y"].shape == (2, 16, 64) and np.isfinite(bridged["y"]).all()
  assert bert["out"].last_hidden_state.shape == (2, 16, 32)
  assert bert["state"]["intermediates"]["position_bias"][0].shape == (1, 4, 16, 16)
  np.testing.assert_allclose(fused["out"], fused["reference"], rtol=1e-5, atol=1e-5)
  assert fused["dq"].shape == (2, 48, 4, 16) and np.isfinite(fused["dq"]).all()
  namespace = bridged
  # The NNX block trains: gradients reach the bridged linen parameters.
  from flax import nnx
  import jax.numpy as jnp
  grads = nnx.grad(lambda block: jnp.sum(block(namespace["x"], namespace["pos"]) ** 2))(namespace["block"])
  leaves = [np.asarray(g) for g in jax.tree.leaves(grads)]
  assert len(leaves) > 8 and all(np.isfinite(g).all() for g in leaves) and any(np.abs(g).max() > 0 for g in leaves)


def test_make_alone_lists_the_targets():
  result = subprocess.run(["make", "--no-print-directory"], cwd=README.parent, capture_output=True, text=True,
                          check=True)
  targets = [line.split()[1] for line in result.stdout.splitlines() if line.startswith("make ")]
  assert {"demo", "test"} <= set(targets)
