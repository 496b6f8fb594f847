"""What each device computes in the train step on a simulated 8-device mesh (this process's 8 CPU devices): the
compiled program's per-device shapes, collectives, loops and memory, not only its results. Tiny BERT (width 64,
4 heads of 16, MLP 128), batch 96 x 16: the attention logits of ``r`` rows per device are a ``dot`` of shape
``[r, 4, 16, 16]``."""

import functools
import re
import tempfile

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posjax import tasks
from posjax.aot import compile as aot
from posjax.models import TransformerConfig, Transformer, layout
from posjax.train import step as step_lib, validate
from conftest import load_config, override

pytestmark = pytest.mark.xdist_group("pod_program")
BATCH, LENGTH, HEADS = 96, 16, 4
COLLECTIVES = ("all-gather", "all-to-all", "collective-permute")


@functools.cache
def traced(recipe="pretrain", **overrides):
  """The run's train step traced over this process's 8 devices (data=8 unless ``mesh.*`` says otherwise), and its
  model FLOPs per device (``recipe``: ``pretrain``, BERT's, or ``lm``, the decoder's)."""
  config = load_config(recipe, "runlocal,position=absolute" if recipe == "pretrain" else "runlocal,position=rope")
  config.update(batch_size=BATCH, max_len=LENGTH, total_steps=2, warmup_steps=1, eval_every_steps=0)
  config = override(config, **overrides)
  with tempfile.TemporaryDirectory() as workdir:
    prepared = validate.validate(config, workdir, tasks.build)
    step, batch = aot.trace_train_step(prepared)
    return step, aot.step_flops(prepared.task.model_config, batch) / jax.device_count()


@functools.cache
def compiled(recipe="pretrain", **overrides):
  return traced(recipe, **overrides)[0].lower().compile()


def outputs(program, op: str) -> list[tuple[int, ...]]:
  """The per-device shapes of every ``op`` instruction's (array) output in the compiled HLO."""
  found = re.findall(rf"= [a-z0-9]+\[([\d,]*)\]\S* {op}\(", program.as_text())
  return [tuple(int(d) for d in dims.split(",") if d) for dims in found]


def logits_rows(program) -> set[int]:
  """Rows per device of the attention logits ``[rows, heads, L, L]``."""
  return {s[0] for s in outputs(program, "dot") if len(s) == 4 and s[1:] == (HEADS, LENGTH, LENGTH)}


def temporaries(program) -> int:
  return program.memory_analysis().temp_size_in_bytes


def collectives(program) -> list:
  return [(op, s) for op in COLLECTIVES for s in outputs(program, op)]


def test_every_micro_step_runs_on_every_data_device():
  whole, accumulated = compiled(), compiled(grad_accum_steps=4)
  assert logits_rows(whole) == {BATCH // 8}
  # 4 micro-batches of 24 rows, each over the 8 devices: 3 rows per device per micro-step, nothing gathered.
  assert logits_rows(accumulated) == {BATCH // 4 // 8}
  assert collectives(accumulated) == [] and collectives(whole) == []
  assert temporaries(accumulated) <= 0.5 * temporaries(whole)


# Four scanned layers at length 64: the remat test's program and the deep one of the scanned layers' test
DEEP = {"model.scan_layers": True, "model.num_layers": 4, "max_len": 64}


def test_scanned_layers_are_one_layer_compiled_in_a_loop_of_their_number():
  two, four = compiled(**{"model.scan_layers": True}), compiled(**DEEP)
  assert len(outputs(four, "dot")) == len(outputs(two, "dot"))  # one layer's program, whatever the depth and length
  assert re.search(r'while\(.*"known_trip_count":\{"n":"4"\}', four.as_text())
  # the same two layers unrolled (the micro-step test's program): each layer's dots, more than half as many again
  assert len(outputs(compiled(), "dot")) > 1.5 * len(outputs(two, "dot"))


def test_full_remat_at_least_halves_the_temporaries():
  # Scanned layers (the recomputation sits in the backward loop's body, where any scheduler must run it); the
  # unrolled layers' figures on TPU and GPU are compiled ahead of time in docs/benchmarks.md.
  assert temporaries(compiled(**DEEP, **{"model.remat": "full"})) <= 0.5 * temporaries(compiled(**DEEP))


def test_activations_are_sharded_over_data_fsdp_and_tensor():
  program = compiled(**{"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2})
  # Rows over data x fsdp (4 shards), heads over tensor (2): the logits are [24, 2, 16, 16] on each device.
  logits = [s for s in outputs(program, "dot") if len(s) == 4 and s[2:] == (LENGTH, LENGTH)]
  assert set(logits) == {(BATCH // 4, HEADS // 2, LENGTH, LENGTH)}
  # No instruction holds the whole batch's hidden states [96, 16, ...], or half of them.
  text = program.as_text()
  assert not re.search(rf"\[{BATCH},{LENGTH}[,\]]", text) and not re.search(rf"\[{BATCH // 2},{LENGTH}[,\]]", text)
  # fsdp gathers parameters, or an activation along a parameter's embed axis (an embedding lookup), never rows:
  # no all-gather has more rows than one data x fsdp shard's 24.
  gathered = [s for op, s in collectives(program) if op == "all-gather"]
  assert gathered and not [s for s in gathered if s[0] in (BATCH, BATCH // 2)], gathered


def loss_and_gradients(**overrides):
  """A tiny TUPE-R BERT's summed squared error on ids [4, 24] against a random target [4, 24, 128], and its
  gradients, at the plain model's initial parameters (converted to ``overrides``' layout), as one jitted program."""
  ids_BxL = jax.random.randint(jax.random.PRNGKey(1), (4, 24), 0, 128)
  target_BxLxV = jax.random.normal(jax.random.PRNGKey(2), (4, 24, 128))
  plain, model = (Transformer(TransformerConfig.tiny(position="tupe_r", **o), head="mlm") for o in ({}, overrides))
  params = nn.unbox(jax.jit(plain.init)(jax.random.PRNGKey(0), ids_BxL)["params"])
  params = layout.like(params, nn.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(0), ids_BxL)["params"]))
  loss = lambda p: jnp.sum((model.apply({"params": p}, ids_BxL).logits - target_BxLxV) ** 2)
  return jax.jit(jax.value_and_grad(loss))(params)


@functools.cache
def plain_loss_and_gradients():
  """The reference of every case: the plain model's (no scan, no remat), computed once."""
  return loss_and_gradients()


@pytest.mark.parametrize("overrides", [dict(scan_layers=True), dict(remat="full"),
                                       dict(scan_layers=True, remat="dots")], ids=str)
def test_remat_and_scanned_layers_give_the_same_loss_and_gradients(overrides):
  want, want_grads = plain_loss_and_gradients()
  got, got_grads = loss_and_gradients(**overrides)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  got_grads = layout.like(got_grads, want_grads)
  largest = max(float(np.abs(g).max()) for g in jax.tree.leaves(want_grads))
  for path, g in jax.tree_util.tree_leaves_with_path(want_grads):
    h = functools.reduce(lambda t, k: t[k.key], path, got_grads)
    np.testing.assert_allclose(h, g, atol=1e-5 * largest, err_msg=jax.tree_util.keystr(path))


def test_layerwise_decay_scales_scanned_layers_by_their_index():
  ids = jnp.zeros((1, 8), jnp.int32)
  config = TransformerConfig.tiny(num_layers=3)
  per_layer = nn.unbox(jax.eval_shape(Transformer(config, head="mlm").init, jax.random.PRNGKey(0), ids)["params"])
  scanned_model = Transformer(TransformerConfig.tiny(num_layers=3, scan_layers=True), head="mlm")
  scanned = nn.unbox(jax.eval_shape(scanned_model.init, jax.random.PRNGKey(0), ids)["params"])
  kernel = step_lib.layer_scales(scanned, 0.5)["encoder"]["layers"]["mlp_in"]["kernel"]
  np.testing.assert_allclose(np.broadcast_to(kernel, (3, 1, 1))[:, 0, 0], [0.125, 0.25, 0.5])
  assert step_lib.layer_scales(per_layer, 0.5)["encoder"]["layer_0"]["mlp_in"]["kernel"] == 0.125


WIDE = {"model.hidden_size": 256, "model.intermediate_size": 1024, "model.dropout_rate": 0.0,
        "model.attention_dropout_rate": 0.0}


def test_model_flops_are_xlas_count_without_loops_and_the_steps_with_them():
  # Without a loop XLA counts every operation once: the model's matrix products are within 5% of it.
  xla = compiled(**WIDE).cost_analysis()["flops"]
  model = traced(**WIDE)[1]
  assert 0.95 < model / xla < 1.0
  # XLA counts a loop's body once: 4 micro-steps count as one, 4 scanned layers as one; the model's FLOPs do not.
  accumulated = {**WIDE, "grad_accum_steps": 4}
  assert traced(**accumulated)[1] == model
  assert compiled(**accumulated).cost_analysis()["flops"] < 0.3 * model


def test_a_grouped_query_decoders_flops_are_xlas_count_and_its_kv_projections_are_grouped():
  """The Llama-family decoder (2 k/v heads for 4 query heads, SwiGLU, untied head): the model's FLOPs within 5% of
  XLA's count, and every device projects k and v to 2 heads and scores each against its group, never a copy of k
  repeated to 4 heads."""
  wide = {"model.hidden_size": 256, "model.intermediate_size": 704}
  program = compiled("lm", **wide)
  assert 0.95 < traced("lm", **wide)[1] / program.cost_analysis()["flops"] < 1.0
  rows, dots = BATCH // 8, set(outputs(program, "dot"))
  assert (rows * LENGTH, 2 * 64) in dots and (rows * LENGTH, 4 * 64) in dots  # k/v: 2 heads of 64; q: 4
  # the scores: per k/v head, its group's 2 query heads x 16 rows against its 16 keys; never 4 heads of k
  assert (rows, 2, 2 * LENGTH, LENGTH) in dots and (rows, 4, LENGTH, LENGTH) not in dots


def test_a_runs_sequence_splits_over_the_context_axis_and_kernels_that_take_whole_sequences_are_refused():
  """``--config.mesh.context=8``: the decoder's train step scores each device's 2 tokens of a row against the
  row's 16 gathered keys (tests/test_context_parallel.py checks the numbers); a length the axis does not divide,
  or a kernel that takes whole sequences, is a one-line error."""
  program = compiled("lm", **{"mesh.data": 1, "mesh.context": 8})
  dots = set(outputs(program, "dot"))
  assert (BATCH, 2, 2 * LENGTH // 8, LENGTH) in dots and (BATCH, 2, 2 * LENGTH, LENGTH) not in dots
  with pytest.raises(ValueError, match=r"max_len=12 must divide over the mesh's 8 context devices"):
    traced("lm", **{"mesh.data": 1, "mesh.context": 8, "max_len": 12})
  with pytest.raises(ValueError, match=r"kernel 'cudnn' takes whole sequences, but the mesh splits the sequence"):
    traced("lm", **{"mesh.data": 1, "mesh.context": 8, "model.attention_kernel": "cudnn", "model.dtype": "bfloat16"})
