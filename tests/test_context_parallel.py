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
from test_kernels import assert_matches_reference, learned_terms

B, L, D, HEADS, VOCAB = 2, 64, 32, 4, 128
SPLIT = 8
CASES = {  # one of each kind of term: q and k rotated, a bias shared by the layers, per-token arrays (a cumulative
  # sum over the sequence), a weight rule over the masked logits; grouped-query attention; query blocks
  "rope_gqa": dict(position="rope", num_kv_heads=2),
  "t5_blocks": dict(position="t5", attention_query_block=4),  # each device's 8 queries, 4 at a time
  "fox": dict(position="fox"),
  "fox_pallas": dict(position="fox", num_kv_heads=2, attention_kernel="pallas"),  # the fused kernels (interpreted),
  # each device's query tile from its offset against the gathered keys
  "stick_breaking": dict(position="stick_breaking"),
  "shaw_values": dict(position="shaw", position_options={"value_term": True}),  # a value term only the dense
  # path computes: XLA's partition of that path
}


def inputs():
  ids_BxL = jax.random.randint(jax.random.PRNGKey(1), (B, L), 0, VOCAB)
  segments_BxL = jnp.asarray(np.repeat([[0] * 37 + [1] * 27], B, 0), jnp.int32)  # a document boundary mid-shard
  positions_BxL = jnp.asarray(np.repeat([list(range(37)) + list(range(27))], B, 0), jnp.int32)
  return ids_BxL, segments_BxL, positions_BxL


@functools.cache
def run(case: str, split: int):
  """``((loss, grads), compiled)`` of a weighted squared error on the logits, on one device (``split=0``, no mesh,
  all queries at once: the dense path) or with the sequence over ``split`` context devices."""
  options = {k: v for k, v in CASES[case].items() if split or k not in ("attention_query_block", "attention_kernel")}
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


def test_what_reads_whole_sequences_is_refused_under_a_split_as_is_a_length_the_split_does_not_divide():
  mesh = sharding.make_mesh({"data": 1, "context": SPLIT})
  q_BxLxHxK = jnp.zeros((B, L, HEADS, 8))
  relative = kernels.Relative(jnp.zeros((3, 8)), max_distance=1, window=True)
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    with pytest.raises(ValueError, match=r"splits the sequence over 8 context devices, and the stick_breaking rule's "
                                         r"Pallas kernels take whole sequences; use implementation='xla'"):
      kernels.relative_attention(q_BxLxHxK, q_BxLxHxK, q_BxLxHxK, rule=kernels.StickBreaking(), causal=True)
    with pytest.raises(ValueError, match=r"relative vectors read windowed \(by tile diagonal\) take whole "
                                         r"sequences; give Relative\(window=False\)"):
      kernels.relative_attention(q_BxLxHxK, q_BxLxHxK, q_BxLxHxK, terms=kernels.Terms(relative=relative))
    with pytest.raises(ValueError, match=r"each of the 8 context devices holds 6 of the 48 tokens, which the 8x8 "
                                         r"tiles \(block_sizes=\(16, 16\)\) do not divide"):
      kernels.relative_attention(*[q_BxLxHxK[:, :48]] * 3, causal=True, block_sizes=(16, 16))
    with pytest.raises(ValueError, match=r"splits its sequence \(60\) over mesh axes \['context'\] \(8 shards\), "
                                         r"which does not divide it"):
      kernels.relative_attention(*[q_BxLxHxK[:, :60]] * 3, causal=True, implementation="xla")


@pytest.mark.slow
@pytest.mark.parametrize("interpreter,shards", [(True, 4), ("tpu", 2)])  # the GPU and the TPU kernels, interpreted
def test_the_fused_kernels_score_each_devices_queries_against_the_gathered_keys(interpreter, shards):
  """The Pallas op over 4 context devices (the TPU interpreter, whose cost is per call: 2): each device's 8 or 16
  queries (tiles of 8) from their offset against the 32 gathered keys, over the 16-key tiles they need, equals the
  float64 reference in its output and the gradients of q, k, v and every term input: a packed row whose positions
  restart mid-shard and whose last 5 tokens are padding (masked queries read every key), a k/v head shared by both
  query heads; on the GPU
  kernels ALiBi, T5 buckets with [CLS] entries, TUPE's untied term (its query factors read at the share's rows) and
  gathered relative vectors; on the TPU kernels KERPLE (a head's scalars), Sandwich (a query side's embeddings) and
  the forget gate (a query side's rows)."""
  rng = np.random.default_rng(7)
  f32 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  length, heads, head_dim, lengths = 32, 2, 8, np.array([27])
  if interpreter is True:
    terms = kernels.Terms(
        alibi=kernels.Alibi(jnp.asarray(rng.uniform(0.1, 1.0, heads), jnp.float32)),
        buckets=kernels.Buckets(f32(34, heads), num_buckets=32, max_distance=20, cls_row=32, cls_col=33),
        untied=kernels.Untied(f32(1, length, heads, head_dim), f32(1, length, heads, head_dim), f32(2, heads)),
        relative=kernels.Relative(0.5 * f32(15, head_dim), max_distance=7, window=False))
  else:
    terms = learned_terms(rng, heads, "power").replace(fire=None, forget=kernels.Forget(f32(1, heads, length)))
  q_BxLxHxK, weights_BxLxHxK = f32(1, length, heads, head_dim), f32(1, length, heads, head_dim)
  k_BxLxGxK, v_BxLxGxK = f32(1, length, 1, head_dim), f32(1, length, 1, head_dim)
  segments_BxL = np.asarray([[0] * 19 + [1] * 13], np.int32)  # a document boundary inside the third tile
  positions_BxL = np.asarray([list(range(19)) + list(range(13))], np.int32)
  mesh = sharding.make_mesh({"data": 1, "context": shards}, jax.devices()[:shards])

  def loss(q, k, v, terms):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      out = kernels.relative_attention(q, k, v, terms=terms, positions=positions_BxL, segment_ids=segments_BxL,
                                       lengths=lengths, causal=True, block_sizes=(8, 16), interpret=interpreter)
    return jnp.sum(out * weights_BxLxHxK), out

  split, whole = NamedSharding(mesh, P(None, "context")), NamedSharding(mesh, P())
  step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True),
                 in_shardings=(split, split, split, jax.tree.map(lambda _: whole, terms)))
  grads, out = step(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, terms)
  assert_matches_reference(out, grads, q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, terms, weights_BxLxHxK,
                           positions=positions_BxL, segments=segments_BxL, lengths=lengths, causal=True)
