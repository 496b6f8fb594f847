"""Ahead-of-time compilation for GPUs and TPUs on this CPU (posjax.aot): target names, the parsing of what the
compilers report, and a real compile of a small run's train step for an H100 and a TPU v5e slice, with the
compilers the ``aot`` extra installs (``make test`` puts them in ``.aot/``)."""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from posjax.aot import compile as aot
from posjax.aot import resources, targets
from conftest import FAST_COMPILE_FLAG

ROOT = pathlib.Path(__file__).resolve().parent.parent
PLUGINS = ROOT / ".aot"
needs_plugins = pytest.mark.skipif(not (PLUGINS / "libtpu").is_dir(), reason="make test installs the aot compilers")


@pytest.mark.parametrize("name,parsed", [
    ("h100", ("gpu", "h100", "1x1x1")), ("h200:8", ("gpu", "h200", "1x1x8")), ("h100:4x8", ("gpu", "h100", "1x4x8")),
    ("v5e:4x4", ("tpu", "v5e", "v5e:4x4")), ("v4:2x2x2", ("tpu", "v4", "v4:2x2x2")), ("v6e:2x2", ("tpu", "v6e", "v6e:2x2"))])
def test_target_names(name, parsed):
  assert targets.parse(name) == parsed


@pytest.mark.parametrize("name", ["a100", "h100:", "h100:0", "v5e", "v5e-16", "v7:2x2", "h100:2x2x2"])
def test_an_unknown_target_is_an_error_that_lists_the_forms(name):
  with pytest.raises(ValueError, match=r"target .* allowed: h100, h200, h100:8"):
    targets.parse(name)


def test_the_gpu_description_carries_the_device():
  text = targets.gpu_target_config("h200")
  assert "shared_memory_per_block_optin: 232448" in text and "device_memory_size: 150754820096" in text
  assert 'device_description_str: "NVIDIA H200"' in text and "cuda_compute_capability { major: 9 }" in text


PTXAS = """I1201 subprocess_compilation.cc:356] ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'dq_kernel' for 'sm_90a'
ptxas info    : Function properties for dq_kernel
    24 bytes stack frame, 7940 bytes spill stores, 7808 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers
ptxas info    : Compiling entry function 'forward_kernel' for 'sm_90a'
ptxas info    : Function properties for forward_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 172 registers, used 1 barriers
"""
THUNKS = """008: kCustomKernel [prev=006 (2) | next=009 (1)] forward_kernel grid: [2, 4, 8] threads: [128, 1, 1]  shared_memory: 41472 bytes
168: kCustomKernel  [prev=167 (1)  | next=170 (2)  ] dq_kernel grid: [16, 2, 1] threads: [128, 1, 1]  shared_memory: 20480 bytes
"""


def test_kernel_resources_are_read_from_ptxas_and_the_thunk_dump():
  merged = resources.merge(resources.parse_ptxas(PTXAS), resources.parse_thunks(THUNKS))
  assert merged["dq_kernel"] == resources.Kernel("dq_kernel", 255, 7940, 7808, 24, 20480, (16, 2, 1), 128)
  assert merged["forward_kernel"] == resources.Kernel("forward_kernel", 172, 0, 0, 0, 41472, (2, 4, 8), 128)


def test_the_shown_stderr_keeps_errors_and_drops_the_info_log():
  log = PTXAS + "I0000 00:00:1.0 cudart_stub.cc:31] Could not find cuda drivers\nE1201 something failed\n"
  assert resources.shown(log) == "E1201 something failed"


def test_a_report_fits_only_within_the_device_memory():
  report = aot.Report("h100", "H100", 1, 1, {"data": 1}, memory_per_device=100, seconds=1.0, arguments=40,
                      outputs=40, aliased=40, temporaries=50, code=5)
  assert report.total == 95 and report.fits
  assert "(95%): fits" in aot.format_report(report)
  report.temporaries = 70
  assert not report.fits and "DOES NOT FIT" in aot.format_report(report)
  failed = aot.Report("v5e:2x2", "TPU v5 lite", 4, 1, {"data": 4}, 100, 2.0, error="ValueError: no")
  assert not failed.fits and "does not compile (2.0 s): ValueError: no" in aot.format_report(failed)


def compiler_env(plugins=True):
  """A child's environment with the aot compilers on its path, compiling with every optimisation (what a user's
  run gets: the suite's JAX_DISABLE_MOST_OPTIMIZATIONS would change the kernels' registers and spills; its XLA:CPU
  flag goes too)."""
  env = {k: v for k, v in os.environ.items() if k != "JAX_DISABLE_MOST_OPTIMIZATIONS"}
  flags = " ".join(f for f in env.get("XLA_FLAGS", "").split() if f != FAST_COMPILE_FLAG)
  # No PYTHONPATH: --target finds .aot/ by itself (posjax.aot.targets.plugin_dir); without plugins, a directory that
  # is not there.
  return {**env, "XLA_FLAGS": flags, "PYTHONPATH": "", "POSJAX_AOT_DIR": str(PLUGINS if plugins else ROOT / "absent")}


def command(*args, plugins=True):
  env = compiler_env(plugins)
  return subprocess.run([sys.executable, "-m", "posjax.main", "--config=configs/pretrain.py:position=tupe_r,runlocal",
                         *args], cwd=ROOT, capture_output=True, text=True, env=env, timeout=1200)


def test_a_missing_compiler_names_the_extra():
  result = command("--target=h100", plugins=False)
  assert result.returncode == 2, result.stderr
  assert re.fullmatch(r"error: compiling for a GPU needs jax-cuda12-plugin(, nvidia-cuda-nvcc-cu12)? \(pinned to "
                      r"jaxlib [\d.]+\), not found in \S+absent: run `make aot` \(or set POSJAX_AOT_DIR to a "
                      r"directory holding the aot extra\)", result.stderr.strip().splitlines()[-1])


@pytest.mark.slow
@needs_plugins
def test_a_run_compiles_for_an_h100_and_a_tpu_slice():
  # TUPE-R on the fused kernels, bf16, heads split over a tensor axis of 2: Triton for the H100 pair, Mosaic for
  # the v5e slice, each kernel under shard_map. One layer: a second compiles the same kernels again.
  result = command("--target=h100:2,v5e:2x2", "--config.model.attention_kernel=pallas",
                   "--config.model.dtype=bfloat16", "--config.mesh.tensor=2", "--config.model.num_layers=1")
  assert result.returncode == 0, result.stderr[-3000:]
  out = result.stdout
  assert "h100:2: 2 x NVIDIA H100 80GB HBM3 (1 host(s), 79.14 GiB each), mesh data=1 fsdp=1 context=1 tensor=2" in out
  assert "v5e:2x2: 4 x TPU v5 lite (1 host(s), 16.00 GiB each), mesh data=2 fsdp=1 context=1 tensor=2" in out
  assert len(re.findall(r"of (79.14|16.00) GiB \(\d+%\): fits", out)) == 2
  for kernel in ("forward_kernel", "dq_kernel", "dkv_kernel"):  # registers and shared memory from the compiler
    assert re.search(rf"{kernel}\s+[\d,]+ B \(\d+%\)\s+\d+\s+[\d,]+ B\s+\d+x\d+x\d+", out), out
  assert re.search(r"model FLOPs per device and step: [\d.e+]+", out) and re.search(r"XLA's FLOP count per device: [\d.e+]+", out)


# One child for the two tests below (each start loads the compilers): method 4's kernels, then the targets' devices.
KERNELS_AND_DEVICES = """
import json, sys
import jax, jax.numpy as jnp
from posjax import kernels
from posjax.aot import compile as aot, resources, targets
aot.setup()
out = {}
for name in sys.argv[1:]:
  target = targets.devices(name)
  device = jax.sharding.SingleDeviceSharding(target.devices[0])
  spec = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=device)
  terms = kernels.Terms(relative=kernels.Relative(spec(511, 64, dtype=jnp.float32), 255, query=True, key=True),
                        alibi=kernels.Alibi(spec(2, dtype=jnp.float32)))
  loss = lambda q, k, v, t: jnp.sum(kernels.relative_attention(q, k, v, terms=t, platform=target.platform,
                                                               interpret=False).astype(jnp.float32))
  x = spec(2, 256, 2, 64)
  with resources.captured_stderr() as log:
    jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(x, x, x, terms).lower().compile(
        compiler_options={"xla_dump_to": "DUMP"} if target.platform == "gpu" else {})
  found = resources.merge(resources.parse_ptxas(log[0]), resources.read_dump("DUMP")) if target.platform == "gpu" else {}
  out[name] = {k: vars(v) for k, v in found.items() if k.endswith("_kernel")}
devices = []
for name in ('h200:2x4', 'v4:2x2x1', 'v5e:4x4', 'v5p:2x2x1'):
  t = targets.devices(name)
  devices.append(f"{name} {len(t.devices)} {t.processes} {t.memory_per_device} {t.kind}")
print(json.dumps({"kernels": out, "devices": devices}))
"""


@pytest.fixture(scope="module")
def kernels_and_devices(tmp_path_factory):
  """What the child printed: ``{"kernels": {target: {kernel: resources}}, "devices": [line per target]}``."""
  code = KERNELS_AND_DEVICES.replace("DUMP", str(tmp_path_factory.mktemp("aot") / "dump"))
  result = subprocess.run([sys.executable, "-c", code, "h100", "v5e:2x2"], cwd=ROOT, capture_output=True, text=True,
                          env=compiler_env(), timeout=1200)
  assert result.returncode == 0, result.stderr[-3000:]
  return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@needs_plugins
@pytest.mark.xdist_group("aot_kernels")
def test_method_4_compiles_for_an_h100_and_a_tpu_within_the_limits(kernels_and_devices):
  # Method 4's relative vectors (both sides, read windowed) and ALiBi, forward and backward: Mosaic could not
  # compile their skew before, and on the H100 the windowed kernels used 99% of the shared memory and spilled.
  found = kernels_and_devices["kernels"]
  gpu = found["h100"]
  assert set(gpu) == {"forward_kernel", "dq_kernel", "dkv_kernel", "window_grad_kernel"}
  for name, kernel in gpu.items():
    assert kernel["shared_memory"] < 0.75 * targets.SHARED_MEMORY_OPTIN, (name, kernel)
    assert kernel["spill_stores"] < 1024, (name, kernel)
  assert found["v5e:2x2"] == {}  # compiled (Mosaic's kernels report nothing here)


@pytest.mark.slow  # beside the test above (the slow tests run first): one child for both
@needs_plugins
@pytest.mark.xdist_group("aot_kernels")
def test_target_devices_and_their_memory(kernels_and_devices):
  assert kernels_and_devices["devices"] == [
      "h200:2x4 8 2 150754820096 NVIDIA H200",
      f"v4:2x2x1 8 1 {16 << 30} TPU v4",  # a device per TensorCore, two per chip, each with half its 32 GiB
      f"v5e:4x4 16 4 {16 << 30} TPU v5 lite",
      f"v5p:2x2x1 4 1 {95 << 30} TPU v5"]
