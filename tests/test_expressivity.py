"""The expressivity probes (MQAR, flip-flop, the S5 / A5 word problems: posjax.tasks.probe), each row read back by an
independent solver: a labelled query's value is its key's in the context (Zoology's layout), a read returns the last
write, a word problem's label is the product of permutation matrices so far."""

import itertools

import numpy as np
import pytest

from conftest import load_config
from posjax.experiments import probes
from posjax.tasks import probe


@pytest.mark.parametrize("length, pairs", [(65, 64 // 8), (16, 2)])  # at least 2 pairs: one is a copy, not recall
def test_mqar_labels_each_repeated_key_with_its_value(length, pairs):
  x, y, w = probe.make_batch("mqar", np.random.default_rng(0), 16, length, symbols=32, shift=1, index=1, causal=True)
  for b in range(16):
    keys, values = x[b, 1:2 * pairs + 1:2], x[b, 2:2 * pairs + 2:2]
    assert len(set(keys)) == pairs and (keys < 16).all() and (values >= 16).all()
    at = np.flatnonzero(w[b])
    assert len(at) == pairs and ((at - 1 - 2 * pairs) % 2 == 0).all() and (at > 2 * pairs).all()
    for t in at:
      assert y[b, t] == dict(zip(keys, values))[x[b, t]]
  assert x[:, 0].tolist() == [32] * 16


def test_flip_flop_reads_return_the_last_write():
  x, y, w = probe.make_batch("flip_flop", np.random.default_rng(1), 32, 41, symbols=8, shift=1, index=1)
  write, read = probe.FLIP_FLOP["write"], probe.FLIP_FLOP["read"]
  reads = 0
  for b in range(32):
    assert x[b, 1] == write
    last = None
    for t in range(1, 40, 2):
      if x[b, t] == write:
        last = x[b, t + 1]
      if x[b, t] == read:
        assert x[b, t + 1] == y[b, t] == last and w[b, t] == 1
        reads += 1
    assert w[b].sum() == np.sum(x[b, 1:40:2] == read)
  assert 0.05 < reads / (32 * 20) < 0.15  # about one instruction in ten


@pytest.mark.parametrize("task,size", [("s5", 120), ("a5", 60)])
def test_a_word_problems_label_is_the_product_so_far(task, size):
  elements = probe.group(task)
  assert len(elements) == size and probe.vocab_size(task, 16) == size + 1 and probe.classes(task, 16) == size
  matrices = np.eye(5, dtype=int)[elements]  # row i of P_g is e_{g(i)}: (P_g x)[i] = x[g(i)]
  x, y, w = probe.make_batch(task, np.random.default_rng(2), 8, 30, symbols=16, shift=1, index=1, causal=True)
  lookup = {tuple(p): i for i, p in enumerate(elements)}
  for b in range(8):
    product = np.eye(5, dtype=int)
    for t in range(1, 30):
      product = product @ matrices[x[b, t]]  # the state after g_t: g_t composed after the ones before
      assert y[b, t] == lookup[tuple(product @ np.arange(5))]
  assert (w[:, 0] == 0).all() and (w[:, 1:] == 1).all()
  if task == "a5":  # closed under composition
    assert all(tuple(p[q]) in lookup for p, q in itertools.product(elements[:10], elements[:10]))


def test_layouts_are_rows_of_the_probes_beside_the_methods():
  config = load_config("probes", "decoder,methods=rope,tasks=mqar+s5,layouts=irope+gemma3,layout_method=alibi")
  rows = probes.rows(config)
  assert list(rows) == ["rope", "irope (alibi)", "gemma3 (alibi)"]
  method, fields = rows["irope (alibi)"]
  run = probes.run_config(config, method, "mqar", fields)
  # a quarter of the probes' length 16 per chunk, the tiny model's 2 layers as one local and one global
  assert (run.probe.method, run.model.layout, run.model.layout_options.to_dict()) == (
      "alibi", "irope", {"chunk": 4, "floor_scale": 4.0, "every": 2})
  probes.validate(config)  # every row's model builds, for each task's vocabulary
