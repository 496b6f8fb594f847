"""The devices posjax compiles for ahead of time, on a CPU: NVIDIA H100 / H200 (sm_90) and TPU slices.

A target is named ``h100`` / ``h200`` (one GPU), ``h100:8`` (one host with 8), ``h100:4x8`` (4 hosts with 8 each), or a
TPU topology as libtpu names it, ``<generation>:<chips per axis>`` (``v5e:4x4`` is a v5e-16; ``v4:2x2x2``,
``v5p:4x4x4``, ``v6e:2x2``; a single chip, ``v5e:1x1``, is refused by libtpu). The GPU devices come from a
``GpuTargetConfigProto`` shipped here (the fields XLA's deviceless compiler reads: shared memory, registers, SMs,
memory), the TPU devices from libtpu. Nothing runs on them: :mod:`posjax.aot.compile` compiles for them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pathlib
import re

import jax
from jax.experimental import topologies

# The H100 SXM (80 GB HBM3) as XLA's own GPU tests describe it; 227 KiB (232,448 B) of opt-in shared memory per block.
_SM90 = ("threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152 "
         "shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128 "
         "block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535 "
         "memory_bandwidth: {bandwidth} l2_cache_size: 52428800 clock_rate_ghz: 1.98 device_memory_size: {memory} "
         "shared_memory_per_block_optin: 232448 cuda_compute_capability {{ major: 9 }} "
         "registers_per_core_limit: 65536 registers_per_block_limit: 65536")
GPUS = {
    "h100": dict(name="NVIDIA H100 80GB HBM3", memory=84_978_434_048, bandwidth=3_352_320_000_000),
    # 143,771 MiB (what nvidia-smi reports for the 141 GB part), 4.8 TB/s.
    "h200": dict(name="NVIDIA H200", memory=150_754_820_096, bandwidth=4_800_000_000_000),
}
SHARED_MEMORY_OPTIN = 232_448  # bytes per thread block on sm_90
REGISTERS_PER_THREAD = 255
# High-bandwidth memory per TPU chip, bytes.
TPUS = {"v4": 32 << 30, "v5e": 16 << 30, "v5p": 95 << 30, "v6e": 32 << 30}
_GPU = re.compile(r"^(h100|h200)(?::(?:(\d+)x)?(\d+))?$")
_TPU = re.compile(r"^(v4|v5e|v5p|v6e):(\d+(?:x\d+){1,2})$")
ALLOWED = "h100, h200, h100:8 (GPUs on one host), h100:4x8 (hosts x GPUs), or a TPU slice such as v5e:4x4, v6e:2x2, v4:2x2x2, v5p:4x4x4"


@dataclasses.dataclass(frozen=True)
class Target:
  """A named device set: ``platform`` (``gpu`` / ``tpu``), its compile-only ``devices`` and each one's memory."""
  name: str
  platform: str
  devices: tuple
  memory_per_device: int
  processes: int

  @property
  def kind(self) -> str:
    return self.devices[0].device_kind


def gpu_target_config(kind: str) -> str:
  """The text ``GpuTargetConfigProto`` of an ``h100`` or ``h200``."""
  spec = GPUS[kind]
  info = _SM90.format(bandwidth=spec["bandwidth"], memory=spec["memory"])
  return (f'gpu_device_info {{ {info} }} platform_name: "CUDA" dnn_version_info {{ major: 9 minor: 8 }} '
          f'device_description_str: "{spec["name"]}"')


def parse(name: str) -> tuple[str, str, str]:
  """``(platform, kind, topology)`` of a target name; an unknown name is an error that lists the allowed forms."""
  gpu, tpu = _GPU.match(name), _TPU.match(name)
  if gpu:
    hosts, per_host = int(gpu.group(2) or 1), int(gpu.group(3) or 1)
    if hosts < 1 or per_host < 1:
      raise ValueError(f"target {name!r} has no devices; allowed: {ALLOWED}")
    return "gpu", gpu.group(1), f"1x{hosts}x{per_host}"
  if tpu:
    return "tpu", tpu.group(1), name
  raise ValueError(f"unknown target {name!r}; allowed: {ALLOWED}")


AOT_DIR_ENV = "POSJAX_AOT_DIR"


def plugin_dir() -> pathlib.Path:
  """Where ``make aot`` installs the compile-only plugins: ``$POSJAX_AOT_DIR``, else ``.aot`` beside the posjax
  package (a checkout's root). Only a ``--target`` run puts it on its path; every other process runs without them."""
  return pathlib.Path(os.environ.get(AOT_DIR_ENV) or pathlib.Path(__file__).resolve().parents[2] / ".aot")


def missing_plugin(platform: str) -> str | None:
  """What to install to compile for ``platform`` when it is not installed, else None."""
  if platform == "gpu":
    need = [("jax_plugins.xla_cuda12", "jax-cuda12-plugin"), ("jax_cuda12_plugin", "jax-cuda12-plugin"),
            ("nvidia.cuda_nvcc", "nvidia-cuda-nvcc-cu12")]
  else:
    need = [("libtpu", "libtpu")]
  absent = []
  for module, package in need:
    try:
      found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
      found = False
    if not found and package not in absent:
      absent.append(package)
  if not absent:
    return None
  return (f"compiling for a {platform.upper()} needs {', '.join(absent)} (pinned to jaxlib {jax.lib.__version__}), "
          f"not found in {plugin_dir()}: run `make aot` (or set {AOT_DIR_ENV} to a directory holding the aot extra)")


def devices(name: str) -> Target:
  """The compile-only devices of target ``name`` (JAX must run on the CPU platform: :func:`posjax.aot.compile.setup`)."""
  platform, kind, topology = parse(name)
  missing = missing_plugin(platform)
  if missing:
    raise ValueError(missing)
  if platform == "gpu":
    found = topologies.get_topology_desc(platform="cuda", target_config=gpu_target_config(kind), topology=topology)
    memory = GPUS[kind]["memory"]
  else:
    try:
      found = topologies.get_topology_desc(topology_name=topology, platform="tpu")
    except Exception as error:  # libtpu's message says what is wrong with the shape
      raise ValueError(f"libtpu refuses target {name!r}: {str(error).splitlines()[0]}") from None
    # libtpu's v4 topologies have a device per TensorCore (two per chip), each with half the chip's memory.
    memory = TPUS[kind] // len({d.core_on_chip for d in found.devices})
  devices_ = tuple(found.devices)
  return Target(name, platform, devices_, memory, len({d.process_index for d in devices_}))
