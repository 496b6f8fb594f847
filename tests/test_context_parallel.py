"""Context parallelism: a decoder's sequence split over 8 simulated CPU devices (mesh ``context=8``), against the
same model on one device, in the loss and every gradient, for packed rows whose positions restart; and what each
device holds in the compiled program (its hidden states, its keys and values, its logits)."""

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from posjax import kernels
from posjax.models import Transformer, TransformerConfig
from posjax.train import sharding

B, L, D, HEADS, VOCAB = 2, 64, 32, 4, 128
SPLIT = 8
CASES = {  # one of each kind of term: q and k rotated, a bias shared by the layers, per-token arrays (a cumulative
  # sum over the sequence), a weight rule over the masked logits; grouped-query attention; query blocks
  "rope_gqa": dict(position="rope", num_kv_heads=2),
  "t5_blocks": dict(position="t5", attention_query_block=4),  # each device's 8 queries, 4 at a time
  "fox": dict(position="fox"),
  "stick_breaking": dict(position="stick_breaking"),
  "shaw_values": dict(position="shaw", position_options={"value_term": True}),  # a value term only the dense
  # path computes: XLA's partition of that path
}


def inputs():
  ids_BxL = jax.random.randint(jax.random.PRNGKey(1), (B, L), 0, VOCAB)
  segments_BxL = jnp.asarray(np.repeat([[0] * 40 + [1] * 24], B, 0), jnp.int32)  # a document boundary mid-shard
  positions_BxL = jnp.asarray(np.repeat([list(range(40)) + list(range(24))], B, 0), jnp.int32)
  return ids_BxL, segments_BxL, positions_BxL


@functools.cache
def run(case: str, split: int):
  """``((loss, grads), compiled)`` of a weighted squared error on the logits, on one device (``split=0``, no mesh,
  all queries at once: the dense path) or with the sequence over ``split`` context devices."""
  options = {k: v for k, v in CASES[case].items() if split or k != "attention_query_block"}
  config = TransformerConfig.llama(vocab_size=VOCAB, hidden_size=D, num_layers=2, num_heads=HEADS,
                                   intermediate_size=64, max_len=L, **options)
  model = Transformer(config, head="lm")
  ids_BxL, segments_BxL, positions_BxL = inputs()
  params = nn.unbox(model.init(jax.random.PRNGKey(0), ids_BxL)["params"])
  target_BxLxV = jax.random.normal(jax.random.PRNGKey(2), (B, L, VOCAB))

  def loss(p, ids_BxL, segments_BxL, positions_BxL):  # later tokens weigh more: no gradient is near zero
    logits_BxLxV = model.apply({"params": p}, ids_BxL, segment_ids=segments_BxL, positions=positions_BxL).logits
    return jnp.sum((logits_BxLxV - target_BxLxV) ** 2 * jnp.arange(1, L + 1)[None, :, None])

  args = (params, ids_BxL, segments_BxL, positions_BxL)
  if not split:
    compiled = jax.jit(jax.value_and_grad(loss)).lower(*args).compile()
    return compiled(*args), compiled
  mesh = sharding.make_mesh({"data": 1, "context": split})

  def traced(*a):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return jax.value_and_grad(loss)(*a)

  rows, whole = NamedSharding(mesh, P(sharding.BATCH, "context")), NamedSharding(mesh, P())
  step = jax.jit(traced, in_shardings=(jax.tree.map(lambda _: whole, params), rows, rows, rows))
  compiled = step.lower(*args).compile()
  return compiled(*args), compiled


@pytest.mark.parametrize("case", CASES)
def test_the_sequence_over_eight_devices_gives_one_devices_loss_and_gradients(case):
  (want, want_grads), _ = run(case, 0)
  (got, got_grads), _ = run(case, SPLIT)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  largest = max(float(np.abs(g).max()) for g in jax.tree.leaves(want_grads))
  for path, g in jax.tree_util.tree_leaves_with_path(want_grads):
    h = functools.reduce(lambda t, k: t[k.key], path, got_grads)
    np.testing.assert_allclose(h, g, atol=2e-6 * largest, err_msg=jax.tree_util.keystr(path))


def shapes(program, op: str) -> set[tuple[int, ...]]:
  """The per-device shapes of every ``op`` instruction's output in the compiled HLO."""
  found = re.findall(rf"= [a-z0-9]+\[([\d,]*)\]\S* {op}\(", program.as_text())
  return {tuple(int(d) for d in dims.split(",") if d) for dims in found}


def test_each_device_holds_its_tokens_and_scores_them_against_gathered_keys():
  _, program = run("rope_gqa", SPLIT)
  _, alone = run("rope_gqa", 0)
  text, local = program.as_text(), L // SPLIT
  # No instruction holds a row's whole hidden states [B, L, D] or MLP activations [B, L, 64]; each device its
  # L / 8 tokens.
  assert not re.search(rf"\[{B},{L},({D}|64)\]", text) and re.search(rf"\[{B},{local},{D}\]", text)
  # Keys and values are gathered along the sequence at their 2 grouped heads (never repeated to 4) ...
  assert (B, L, 2, D // HEADS) in shapes(program, "all-gather")
  # ... and each device's logits are its queries' rows against every key: [B, G, (H/G) L/8, L] (a group's two
  # heads' rows in one product), never [.., L, L].
  dots = shapes(program, "dot")
  assert (B, 2, 2 * local, L) in dots and not [s for s in dots if s[-2:] == (L, L)], dots
  assert program.memory_analysis().temp_size_in_bytes < 0.5 * alone.memory_analysis().temp_size_in_bytes


def test_the_fused_kernels_refuse_a_split_sequence_and_a_length_the_split_does_not_divide():
  mesh = sharding.make_mesh({"data": 1, "context": SPLIT})
  q_BxLxHxK = jnp.zeros((B, L, HEADS, 8))
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    with pytest.raises(ValueError, match=r"splits the sequence over 8 context devices, and the Pallas kernels take "
                                         r"whole sequences; use implementation='xla'"):
      kernels.relative_attention(q_BxLxHxK, q_BxLxHxK, q_BxLxHxK, causal=True)
    with pytest.raises(ValueError, match=r"splits its sequence \(60\) over mesh axes \['context'\] \(8 shards\), "
                                         r"which does not divide it"):
      kernels.relative_attention(*[q_BxLxHxK[:, :60]] * 3, causal=True, implementation="xla")
