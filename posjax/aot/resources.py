"""What a GPU compile says about each kernel: registers and spills (ptxas ``-v``, which XLA logs when
``TF_CPP_VMODULE=subprocess_compilation=2``) and shared memory, grid and threads (XLA's thunk sequence dump).

The log and the dump are read from a compile in this process: :func:`captured_stderr` holds file descriptor 2
in a file while it runs, since XLA's C++ logging writes there directly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import re
import sys
import tempfile

LOG_ENV = {"TF_CPP_VMODULE": "subprocess_compilation=2", "TF_CPP_MIN_LOG_LEVEL": "0"}
_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")
_THUNK = re.compile(r"kCustomKernel\s+\[[^\]]*\]\s+(\S+) grid: \[([\d, ]+)\] threads: \[([\d, ]+)\]\s+shared_memory: (\d+) bytes")


@dataclasses.dataclass
class Kernel:
  """One GPU kernel of a compiled program (None where the compile did not report it)."""
  name: str
  registers: int | None = None
  spill_stores: int | None = None
  spill_loads: int | None = None
  stack: int | None = None
  shared_memory: int | None = None
  grid: tuple[int, ...] | None = None
  threads: int | None = None


def parse_ptxas(log: str) -> dict[str, Kernel]:
  """Registers and spills per entry function from ptxas ``-v`` output (the largest when compiled twice)."""
  kernels: dict[str, Kernel] = {}
  current = None
  for line in log.splitlines():
    if entry := _ENTRY.search(line):
      current = Kernel(entry.group(1))
    elif current is not None and (spills := _SPILLS.search(line)):
      current.stack, current.spill_stores, current.spill_loads = map(int, spills.groups())
    elif current is not None and (registers := _REGISTERS.search(line)):
      current.registers = int(registers.group(1))
      seen = kernels.get(current.name)
      if seen is None or (current.registers, current.spill_stores or 0) > (seen.registers, seen.spill_stores or 0):
        kernels[current.name] = current
      current = None
  return kernels


def parse_thunks(text: str) -> dict[str, Kernel]:
  """Grid, threads per block and shared memory per kernel from a ``*.thunk_sequence.txt`` dump."""
  kernels = {}
  for name, grid, threads, shared in _THUNK.findall(text):
    threads_ = 1
    for t in threads.split(","):
      threads_ *= int(t)
    kernels[name] = Kernel(name, shared_memory=int(shared), grid=tuple(int(g) for g in grid.split(",")),
                           threads=threads_)
  return kernels


def read_dump(directory: str) -> dict[str, Kernel]:
  """:func:`parse_thunks` over every thunk sequence in an ``xla_dump_to`` directory."""
  kernels = {}
  for path in sorted(glob.glob(os.path.join(directory, "*thunk_sequence.txt"))):
    with open(path) as f:
      kernels.update(parse_thunks(f.read()))
  return kernels


def merge(ptxas: dict[str, Kernel], thunks: dict[str, Kernel]) -> dict[str, Kernel]:
  """One record per kernel name from both sources."""
  merged = {}
  for name in sorted(set(ptxas) | set(thunks)):
    a, b = ptxas.get(name, Kernel(name)), thunks.get(name, Kernel(name))
    merged[name] = Kernel(name, a.registers, a.spill_stores, a.spill_loads, a.stack, b.shared_memory, b.grid,
                          b.threads)
  return merged


# XLA's info lines (the ptxas report among them), and what the compile-only plugins say about the missing devices.
_NOISE = re.compile(r"^(I\d{4} |WARNING: (All log messages|Logging before)|ptxas info|\s+\d+ bytes (stack|gmem)|=== Source Location"
                    r"|.*(TPU_WORKER_HOSTNAMES|TPU_ACCELERATOR_TYPE|libtpu_init_utils|cudart_stub|Could not find cuda))")


def shown(log: str) -> str:
  """The lines of a compile's stderr worth showing: its warnings and errors, not XLA's info log nor the plugins'
  notes that this machine has no GPU or TPU."""
  return "\n".join(line for line in log.splitlines() if line.strip() and not _NOISE.match(line))


@contextlib.contextmanager
def captured_stderr():
  """File descriptor 2 goes to a temporary file while the block runs; yields a list that then holds its text."""
  sys.stderr.flush()
  saved = os.dup(2)
  text: list[str] = []
  with tempfile.TemporaryFile(mode="w+b") as log:
    os.dup2(log.fileno(), 2)
    try:
      yield text
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      log.seek(0)
      text.append(log.read().decode(errors="replace"))
