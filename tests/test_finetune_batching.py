"""Fine-tuning batches that cost what their examples cost: padded to a bucket of their longest example, or grouped
by length, with the same examples, the same losses and the same evaluation as batches padded to max_len."""

import jax
import numpy as np
import pytest

from posjax.data import features
from posjax import tasks
from posjax.tasks import common
from posjax.tasks import glue as glue_task
from posjax.main import train
from posjax.train import metrics
from conftest import load_config, override


def varied_rows(n=40, seed=0):
  lengths = np.random.default_rng(seed).integers(2, 60, n)
  return [{"input_ids": np.arange(1, 1 + l, dtype=np.int32), "label": np.int32(i)} for i, l in enumerate(lengths)]


def unpadded(batch):
  return [tuple(ids[:n]) for ids, n in zip(batch["input_ids"], batch["attention_mask"].sum(1))]


def test_the_bucket_ladder_bounds_the_rounding_and_always_ends_at_max_len():
  ladder = features.length_buckets(512)
  assert ladder[:9] == (8, 16, 24, 32, 40, 48, 56, 64, 80) and ladder[-3:] == (384, 448, 512) and len(ladder) == 20
  assert all(b - a <= max(8, b / 5) for a, b in zip(ladder, ladder[1:]))
  assert features.length_buckets(100)[-2:] == (96, 100)
  assert features.padded_length(65, ladder) == 80 and features.padded_length(8, ladder) == 8
  with pytest.raises(ValueError, match=r"data.length_buckets=\(0, 32\) must be whole numbers in \[1, max_len=64\]"):
    features.ExampleBatches(varied_rows(), global_batch=4, max_len=64, pad_id=0, seed=0, batching="dynamic",
                            buckets=(0, 32))
  with pytest.raises(ValueError, match=r"data.batching='sorted'; allowed: \['fixed', 'dynamic', 'grouped'\]"):
    features.eval_batches(varied_rows(), global_batch=4, max_len=64, pad_id=0, batching="sorted")


def test_dynamic_batches_hold_the_fixed_batches_examples_padded_to_their_bucket():
  rows = varied_rows()
  fixed = features.ExampleBatches(rows, global_batch=8, max_len=64, pad_id=0, seed=3)
  dynamic = features.ExampleBatches(rows, global_batch=8, max_len=64, pad_id=0, seed=3, batching="dynamic",
                                    buckets=(16, 32, 48))
  for _ in range(12):  # two epochs and a half
    a, b = next(fixed), next(dynamic)
    longest = int(b["attention_mask"].sum(1).max())
    assert a["input_ids"].shape[1] == 64 and b["input_ids"].shape[1] == min(n for n in (16, 32, 48, 64) if n >= longest)
    assert unpadded(a) == unpadded(b) and np.array_equal(a["label"], b["label"])


def test_grouped_batches_visit_every_example_once_an_epoch_with_less_padding():
  rows = varied_rows(64)
  padded = {}
  for batching in ("dynamic", "grouped"):
    stream = features.ExampleBatches(rows, global_batch=4, max_len=64, pad_id=0, seed=1, batching=batching,
                                     group_size=4)
    batches = [next(stream) for _ in range(32)]  # two epochs
    labels = np.concatenate([b["label"] for b in batches])
    assert sorted(labels[:64]) == list(range(64)) and sorted(labels[64:]) == list(range(64))
    padded[batching] = sum(b["attention_mask"].size - b["attention_mask"].sum() for b in batches)
    if batching == "grouped":  # a mega-batch of 4 batches: each batch a run of its examples sorted by length
      lengths = [sorted(b["attention_mask"].sum(1), reverse=True) for b in batches[:4]]
      joined = sum(sorted(lengths, key=lambda run: -run[0]), [])
      assert joined == sorted(joined, reverse=True) and lengths != sorted(lengths, key=lambda run: -run[0])
  assert padded["grouped"] < padded["dynamic"] / 2


def test_grouping_cuts_where_the_stream_cuts_in_every_epoch():
  # 66 examples, batches of 4: epoch 1 starts 2 examples into a batch. Sorted whole epochs (group_size=0) keep
  # each batch within one length run, in later epochs too.
  rows = varied_rows(66, seed=2)
  stream = features.ExampleBatches(rows, global_batch=4, max_len=64, pad_id=0, seed=0, batching="grouped",
                                   group_size=0, buckets=tuple(range(1, 65)))
  epoch_of = lambda b: b // 16.5  # noqa: E731
  spread = {}
  for b in range(48):
    batch = next(stream)
    if epoch_of(4 * b) == epoch_of(4 * b + 3):  # not straddling two epochs
      lengths = batch["attention_mask"].sum(1)
      spread.setdefault(int(epoch_of(4 * b)), []).append(int(lengths.max() - lengths.min()))
  assert all(max(s) <= 6 for s in spread.values()), spread


def predictions(config, batching, eval_batch):
  config = override(config, **{"data.batching": batching, "eval_batch_size": eval_batch})
  task = tasks.TASKS[config.task].build(config, eval_batch)
  params = task.model.init(jax.random.PRNGKey(0), **task.init_inputs)["params"]
  out = {}
  for name, ev in task.evaluators.items():
    if ev.unsupported is None:
      outputs = features.join_outputs([jax.device_get(ev.predict(params, b)) for b in ev.batches])
      out[name] = (common.in_order(outputs), ev.metrics(outputs, None))
  return out


@pytest.mark.parametrize("arg", ["task=stsb,runlocal", "squad"])
def test_evaluation_does_not_depend_on_batching_or_batch_size(arg):
  name, _, options = arg.partition(",") if arg != "squad" else ("squad", "", "runlocal")
  config = load_config(f"finetune/{'glue' if name != 'squad' else 'squad'}", arg if name != "squad" else options)
  reference = predictions(config, "fixed", 16)
  for batching, eval_batch in (("dynamic", 16), ("grouped", 7)):
    found = predictions(config, batching, eval_batch)
    assert set(found) == set(reference)
    for key, (ordered, scores) in found.items():
      expected, expected_scores = reference[key]
      for field, value in ordered.items():
        width = value.shape[1] if value.ndim > 1 else None
        want = expected[field][:, :width] if width else expected[field]
        if field in ("start", "end"):  # per token: only the windows' own tokens are read
          mask = np.arange(width)[None] < np.asarray([int(w) for w in (value != 0).sum(1)])[:, None]
          want, value = want[mask], value[mask]
        np.testing.assert_allclose(value, want, rtol=1e-4, atol=1e-5)
      assert scores == pytest.approx(expected_scores, rel=1e-4, abs=1e-3)  # percent, within float noise


def test_dynamic_padding_trains_like_padding_to_max_len(tmp_path):
  losses = {}
  for batching in ("fixed", "dynamic"):
    config = load_config("finetune/glue", "task=sst2,runlocal")
    # Without dropout: its masks are drawn per padded shape, so with it the two runs differ by their random draws.
    override(config, total_steps=8, log_every_steps=1, evals_per_epoch=0, eval_every_steps=8,
             **{"data.batching": batching, "model.dropout_rate": 0.0, "model.attention_dropout_rate": 0.0})
    train(config, str(tmp_path / batching))
    losses[batching] = [line["loss"] for line in metrics.read(str(tmp_path / batching)) if "loss" in line]
  np.testing.assert_allclose(losses["dynamic"], losses["fixed"], rtol=1e-4)
  assert losses["fixed"][0] != losses["fixed"][-1]


def test_encoded_features_are_cached_by_their_inputs_and_read_back_the_same(tmp_path):
  import shutil

  from posjax.data import feature_cache, synthetic

  def train_rows(**changes):
    config = override(load_config("finetune/glue", "task=mrpc,runlocal"), **{"data.cache_dir": str(tmp_path / "c"),
                                                                             **changes})
    return glue_task.build(config, 16).train_batches.features

  built = train_rows()
  read = train_rows()
  assert isinstance(read, feature_cache.Table) and len(read) == len(built) == 120
  assert all(np.array_equal(read[i][k], built[i][k]) for i in (0, 57, 119) for k in built[i])
  assert len(list((tmp_path / "c").iterdir())) == 2  # train and validation
  vocab = tmp_path / "vocab.txt"  # the same pieces with one more: another key, never the stale cache
  shutil.copy(f"{synthetic.BUILTIN_DIR}/tiny_vocab.txt", vocab)
  with open(vocab, "a") as f:
    f.write("zzzextra\n")
  train_rows(**{"data.scratch_vocab_file": str(vocab)})
  train_rows(max_len=32)
  assert len(list((tmp_path / "c").iterdir())) == 6


def test_explicit_buckets_serve_evaluation_lengths_below_max_len():
  import ml_collections

  data = ml_collections.ConfigDict(dict(batching="dynamic", length_buckets=(128, 256, 384), buckets_per_doubling=4))
  options = common.batching(data, 200)
  assert options == {"batching": "dynamic", "buckets": (128, 200)}
  batches = features.eval_batches(varied_rows(), global_batch=8, max_len=200, pad_id=0, **options)
  assert {b["input_ids"].shape[1] for b in batches} == {128}
  assert common.batching(data) == {"batching": "dynamic", "buckets": (128, 256, 384)}
