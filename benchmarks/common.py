"""Shared pieces of the benchmark scripts: timing compiled functions, the BERT-Base MLM train step, children that
compile."""

from __future__ import annotations

import os
import platform
import signal
import statistics
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from posjax import positions
from posjax.models import TransformerConfig, Transformer


def compile_and_time(fn, args, run: bool = True, repeats: int = 5):
  """``(median seconds or None, temp bytes, compiled)`` of a jitted function."""
  compiled = jax.jit(fn).lower(*args).compile()
  memory = compiled.memory_analysis()
  temp = getattr(memory, "temp_size_in_bytes", None) if memory is not None else None
  if not run:
    return None, temp, compiled
  jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times), temp, compiled


def describe_device() -> str:
  device = jax.devices()[0]
  if device.platform == "cpu":
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores), jax {jax.__version__}"
  return f"{device.device_kind} ({device.platform}), jax {jax.__version__}"


def kernel_for(name: str, kernel: str) -> str:
  """The kernel a method runs on when ``kernel`` is asked for: ``xla`` where a fused kernel cannot compute it
  (:meth:`posjax.positions.PositionSpec.refusal`)."""
  spec = TransformerConfig(position=name, causal=positions.get(name).decoder_only).position_spec
  return kernel if kernel in ("xla", "auto") or spec.refusal(kernel) is None else "xla"


def kernel_rows(name: str, kernels: list[str]) -> list[tuple[str, str]]:
  """``(kernel to ask for, what the table shows)`` per measured row of a method: a kernel that cannot compute the
  method runs ``xla`` and is shown so, and is left out when ``xla`` is measured anyway (unless it is the first,
  the ratios' reference)."""
  rows = []
  for kernel in kernels:
    runs_on = kernel_for(name, kernel)
    if runs_on != kernel and kernel != kernels[0] and "xla" in kernels:
      continue
    rows.append((kernel, runs_on if runs_on == kernel else f"{runs_on} (no {kernel})"))
  return rows


def bert_train_step(name: str, length: int, batch: int, dtype: str, kernel: str, layers: int = 12):
  """``(step_fn, args, config, masked)``: one BERT-Base MLM step (forward, backward, AdamW), dropout off,
  the MLM head on 15% of the positions."""
  config = TransformerConfig.base(position=name, max_len=max(512, length), num_layers=layers, dtype=dtype,
                                  attention_kernel=kernel_for(name, kernel),
                                  dropout_rate=0.0, attention_dropout_rate=0.0)
  model = Transformer(config, head="mlm")
  rng = np.random.default_rng(0)
  ids = jnp.asarray(rng.integers(0, config.vocab_size, (batch, length)), jnp.int32)
  masked_count = length * 15 // 100
  masked = jnp.asarray(np.sort(rng.permuted(np.tile(np.arange(length), (batch, 1)), axis=1)[:, :masked_count]))
  labels = jnp.take_along_axis(ids, masked, axis=1)
  params = jax.jit(model.init)(jax.random.PRNGKey(0), ids[:1, :8])["params"]
  optimizer = optax.adamw(1e-4, b1=0.9, b2=0.999, eps=1e-6, weight_decay=0.01)

  def step(state, ids, masked, labels):
    params, opt_state = state

    def loss(p):
      logits = model.apply({"params": p}, ids, masked_positions=masked).logits
      return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    grads = jax.grad(loss)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return step, ((params, optimizer.init(params)), ids, masked, labels), config, masked_count


def run_in_group(command: list[str], timeout: float, **popen) -> tuple[str, str, int] | None:
  """``command``'s ``(stdout, stderr, status)``, run in its own process group and killed whole past ``timeout``
  seconds (None): a compiler's children (ptxas) die with it."""
  child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                           **popen)
  try:
    out, err = child.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    os.killpg(child.pid, signal.SIGKILL)
    child.communicate()
    return None
  return out, err, child.returncode
