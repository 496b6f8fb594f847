"""Ahead-of-time compilation of a run's training step for GPUs and TPUs, on a CPU (after MaxText's
``train_compile.py``): does this config fit, and do its kernels compile, on the devices it is meant for?

``python -m posjax.main --config=<any training config> --target=v5e:4x4 [--config.mesh.fsdp=4 ...]`` builds the
run as training would (model, position method, attention kernel, batch, optimizer, mesh over the target's
devices), compiles its real train step with the target's own compiler (XLA:GPU with Triton and ptxas; libtpu's
XLA:TPU and Mosaic) and prints, per target: whether it compiled (or the compiler's first error line), memory per
device (arguments, outputs, temporaries, code) against the device's HBM, XLA's FLOP estimate, and on a GPU the
shared memory, registers and spills of each Pallas kernel. Nothing runs, so there are no times.

Data: only the batch's shapes matter. By default (``data="synthetic"``) an ``mlm`` run reads the built-in synthetic
corpus through a vocabulary of ``model.vocab_size`` pieces (30,522, BERT's, where the config leaves it 0), so
no corpus or vocabulary is needed; ``data="config"`` builds the batches the config names (other tasks always do).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import sys
import tempfile
import time

import jax
import ml_collections
import numpy as np

from posjax.aot import resources, targets
from posjax.data import synthetic
from posjax.models import TransformerConfig, flops
from posjax.train import sharding, validate
from posjax.train.step import task_step

DATA = ("synthetic", "config")
BERT_VOCAB = 30522  # BERT's uncased WordPiece vocabulary: the size where a config leaves model.vocab_size to the data
PRETRAINING = ("mlm", "electra", "clm")  # tasks whose batches come from a corpus: compiled on the synthetic one
GiB = 1 << 30


def setup() -> None:
  """Before any backend starts: the compile-only plugins on the path (``make aot``'s directory,
  :func:`targets.plugin_dir`), JAX on the CPU platform (a target's devices are compile-only), XLA logging ptxas's
  report, and no compilation cache (a cached program would skip the compile it reports on)."""
  plugins = str(targets.plugin_dir())
  if os.path.isdir(plugins) and plugins not in sys.path:
    sys.path.insert(0, plugins)
  os.environ.update(resources.LOG_ENV)
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compile-only: other processes may hold libtpu too
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_enable_compilation_cache", False)


@dataclasses.dataclass
class Report:
  """One target's compile: memory per device in bytes; ``error`` the compiler's words when it failed."""
  target: str
  kind: str
  devices: int
  processes: int
  mesh: dict
  memory_per_device: int
  seconds: float
  error: str | None = None
  arguments: int = 0
  outputs: int = 0
  aliased: int = 0
  temporaries: int = 0
  code: int = 0
  flops: float | None = None
  model_flops: float | None = None  # per device and step, trip counts included (posjax.models.flops)
  loop_trips: tuple = ()  # the known trip counts of the program's loops (micro-steps, scanned layers)
  kernels: list = dataclasses.field(default_factory=list)
  log: str = ""  # what the compiler wrote to stderr

  @property
  def compiled(self) -> bool:
    return self.error is None

  @property
  def total(self) -> int:
    """Bytes a device holds during the step: its arguments, outputs not donated into them, temporaries, code."""
    return self.arguments + self.outputs - self.aliased + self.temporaries + self.code

  @property
  def fits(self) -> bool:
    return self.compiled and self.total <= self.memory_per_device


def synthetic_data(config: ml_collections.ConfigDict, directory: str) -> ml_collections.ConfigDict:
  """``config`` reading the built-in synthetic corpus through a vocabulary of ``model.vocab_size`` pieces (the
  built-in pieces, then ``[unused<i>]``), written to ``directory``: the batches of an ``mlm`` run, without its
  corpus."""
  config = ml_collections.ConfigDict(config.to_dict())
  size = config.model.get("vocab_size") or BERT_VOCAB
  with open(os.path.join(synthetic.BUILTIN_DIR, "tiny_vocab.txt")) as f:
    pieces = f.read().split()
  if size < len(pieces):
    raise ValueError(f"model.vocab_size={size} is smaller than the synthetic corpus's {len(pieces)} pieces; "
                     "compile with --aot_data=config (the config's own corpus and vocabulary)")
  with open(os.path.join(directory, "vocab.txt"), "w") as f:
    f.write("\n".join(pieces + [f"[unused{i}]" for i in range(size - len(pieces))]) + "\n")
  files = {}
  for split in ("train", "eval"):
    files[split] = os.path.join(directory, f"{split}.txt")
    shutil.copy(os.path.join(synthetic.BUILTIN_DIR, f"tiny_{split}.txt"), files[split])
  config.model.vocab_size = size
  config.data.update(source="text", train_files=files["train"], eval_files=files["eval"],
                     vocab_file=os.path.join(directory, "vocab.txt"), prepared_dir="", num_shards=0)
  return config


def _for_target(config: ml_collections.ConfigDict, target: targets.Target) -> ml_collections.ConfigDict:
  """The run as compiled for ``target``: kernels for its platform, no evaluation, no warm start."""
  if config.get("parallelism", "jit") != "jit":
    raise ValueError(f"ahead-of-time compilation needs parallelism='jit' (one program over the target's mesh); "
                     f"the config has {config.parallelism!r}")
  config = ml_collections.ConfigDict(config.to_dict())
  config.model.kernel_platform = target.platform
  config.eval_every_steps = 0
  config.evals = {}
  config.init_from = ""
  return config


def _first_line(error: BaseException) -> str:
  lines = [line.strip() for line in str(error).splitlines() if line.strip()]
  return f"{type(error).__name__}: {lines[0] if lines else ''}"[:500]


def trace_train_step(prepared: validate.Prepared):
  """``(traced, batch)``: the run's train step traced on abstract arrays laid out over its mesh, and its first
  batch (only the shapes count)."""
  parallel, task = prepared.parallel, prepared.task
  batch = next(iter(task.train_batches))
  if hasattr(task.train_batches, "close"):
    task.train_batches.close()
  config = prepared.config
  step = parallel.compile_step(task_step(task, prepared.optimizer, prepared.schedule, config.grad_accum_steps,
                                         config.get("loss_reduction", "mean")))
  mesh = parallel.mesh
  abstract_batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding.batch_sharding(mesh))
                    for k, v in batch.items()}
  rng = jax.ShapeDtypeStruct(prepared.dropout_rng.shape, prepared.dropout_rng.dtype, sharding=sharding.replicated(mesh))
  return step.trace(parallel.abstract_state, abstract_batch, rng), batch


def step_flops(model_config, batch: dict) -> float | None:
  """Model FLOPs of one step over ``batch`` (None for a model other than one BERT encoder, e.g. ELECTRA's pair)."""
  if not isinstance(model_config, TransformerConfig):
    return None
  rows, length = batch["input_ids"].shape
  head = np.size(batch["masked_positions"]) if "masked_positions" in batch else 0
  if model_config.causal and "masked_positions" not in batch:  # next-token prediction: the head reads every token
    head = rows * length
  return flops.train_step_flops(model_config, rows * length, length, head)


def compile_train_step(config: ml_collections.ConfigDict, target: targets.Target, build_task,
                       data: str = "synthetic", dump: str | None = None) -> Report:
  """Builds ``config``'s run over ``target``'s devices and compiles its train step; a config error raises, a
  compile error is the report's ``error``. ``dump``: keep XLA's dump of a GPU compile there (HLO, PTX, thunks)."""
  if data not in DATA:
    raise ValueError(f"unknown aot data {data!r}; allowed: {list(DATA)}")
  with tempfile.TemporaryDirectory(prefix="posjax-aot-") as directory:
    config = _for_target(config, target)
    if data == "synthetic" and config.get("task", "mlm") in PRETRAINING:
      config = synthetic_data(config, directory)
    prepared = validate.validate(config, os.path.join(directory, "workdir"), build_task, devices=target.devices)
    mesh = prepared.parallel.mesh
    report = Report(target.name, target.kind, len(target.devices), target.processes,
                    dict(zip(mesh.axis_names, mesh.devices.shape)), target.memory_per_device, 0.0)
    dump = dump or os.path.join(directory, "dump")
    options = {"xla_dump_to": dump} if target.platform == "gpu" else {}
    start = time.perf_counter()
    log: list[str] = []
    try:
      with resources.captured_stderr() as log:
        traced, batch = trace_train_step(prepared)
        compiled = traced.lower().compile(compiler_options=options)
      report.model_flops = step_flops(prepared.task.model_config, batch) / len(target.devices)
    except Exception as error:  # noqa: BLE001  (the compiler's error is the answer)
      report.error = _first_line(error)
    report.seconds = time.perf_counter() - start
    report.log = log[0] if log else ""
    if report.error:
      return report
    memory = compiled.memory_analysis()
    report.arguments, report.outputs = memory.argument_size_in_bytes, memory.output_size_in_bytes
    report.aliased, report.temporaries = memory.alias_size_in_bytes, memory.temp_size_in_bytes
    report.code = memory.generated_code_size_in_bytes
    report.flops = (compiled.cost_analysis() or {}).get("flops")
    report.loop_trips = tuple(int(n) for n in re.findall(r'"known_trip_count":\{"n":"(\d+)"\}', compiled.as_text()))
    if target.platform == "gpu":
      kernels = resources.merge(resources.parse_ptxas(report.log), resources.read_dump(dump))
      report.kernels = [k for k in kernels.values() if k.name.endswith("_kernel") or (k.spill_stores or 0) > 0]
    return report


def _bytes(n: int) -> str:
  return f"{n / GiB:.2f} GiB"


def format_report(report: Report) -> str:
  """The report as the lines the command prints."""
  mesh = " ".join(f"{axis}={size}" for axis, size in report.mesh.items())
  head = (f"{report.target}: {report.devices} x {report.kind} ({report.processes} host(s), "
          f"{_bytes(report.memory_per_device)} each), mesh {mesh}")
  if not report.compiled:
    return f"{head}\n  does not compile ({report.seconds:.1f} s): {report.error}"
  share = report.total / report.memory_per_device
  lines = [head, f"  compiled in {report.seconds:.1f} s; per device: arguments {_bytes(report.arguments)}, outputs "
                 f"{_bytes(report.outputs)} (donated {_bytes(report.aliased)}), temporaries {_bytes(report.temporaries)}, "
                 f"code {_bytes(report.code)} -> {_bytes(report.total)} of {_bytes(report.memory_per_device)} "
                 f"({share:.0%}): {'fits' if report.fits else 'DOES NOT FIT'}"]
  if report.model_flops:
    lines.append(f"  model FLOPs per device and step: {report.model_flops:.3g} (posjax.models.flops: the MFU "
                 "numerator)")
  if report.flops:
    trips = ", ".join(map(str, report.loop_trips))
    loops = f"; loop bodies counted once (trip counts {trips})" if trips else ""
    lines.append(f"  XLA's FLOP count per device: {report.flops:.3g} (Pallas kernels not counted{loops})")
  if report.kernels:
    lines.append(f"  {'kernel':<28}{'shared memory':>22}{'registers':>11}{'spill stores':>14}{'grid':>16}")
    for k in report.kernels:
      shared = ("?" if k.shared_memory is None else
                f"{k.shared_memory:,} B ({k.shared_memory / targets.SHARED_MEMORY_OPTIN:.0%})")
      lines.append(f"  {k.name:<28}{shared:>22}{'?' if k.registers is None else k.registers:>11}"
                   f"{'?' if k.spill_stores is None else f'{k.spill_stores:,} B':>14}"
                   f"{'?' if k.grid is None else 'x'.join(map(str, k.grid)):>16}")
  return "\n".join(lines)


def run(config: ml_collections.ConfigDict, target_names: str, build_task, data: str = "synthetic",
        say=print) -> list[Report]:
  """Compiles ``config``'s train step for each comma-separated target and prints the reports; raises (one line)
  when any target does not compile or does not fit."""
  names = [name.strip() for name in target_names.split(",") if name.strip()]
  if not names:
    raise ValueError(f"no target given; allowed: {targets.ALLOWED}")
  reports = []
  for name in names:
    outer: list[str] = []
    report = None
    try:
      with resources.captured_stderr() as outer:
        report = compile_train_step(config, targets.devices(name), build_task, data)
    finally:
      shown = resources.shown(outer[0] if outer else "") + resources.shown(report.log if report else "")
      if shown:
        print(shown, file=sys.stderr)
    reports.append(report)
    say(format_report(report))
  failed = [r.target for r in reports if not r.fits]
  if failed:
    raise ValueError(f"the train step does not compile or fit on {', '.join(failed)} (see above)")
  return reports
