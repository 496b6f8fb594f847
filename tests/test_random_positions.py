"""Randomised positions (Ruoss et al. 2023): training rows' positions drawn from a longer range, evaluation's not."""

import math

import numpy as np
import pytest

from posjax.data import random_positions
from posjax.data.tokenizer import Tokenizer
from posjax.tasks import mlm as mlm_task
from conftest import load_config, override


def changed(config, **overrides):
  """A copy of ``config`` with dotted fields set (``override`` changes the one it is given)."""
  return override(config.copy_and_resolve_references(), **overrides)

@pytest.mark.parametrize("first", random_positions.FIRSTS)
def test_each_run_from_zero_draws_sorted_distinct_positions_below_the_limit(first):
  # two packed documents (positions restart at 0) and padding; "zero" keeps each run's first token at 0
  positions = np.array([[0, 1, 2, 3, 4, 0, 1, 2, 0, 0], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]])
  real = np.array([[1] * 8 + [0] * 2, [1] * 10]).astype(bool)
  drawn = [random_positions.draw(positions, real, 64, np.random.default_rng(seed), first) for seed in range(50)]
  firsts = []
  for got in drawn:
    for b, runs in ((0, [(0, 5), (5, 8)]), (1, [(0, 10)])):
      for start, end in runs:
        run = got[b, start:end]
        assert run[0] >= 0 and np.all(np.diff(run) > 0) and run[-1] < 64, run
        firsts.append(run[0])
    np.testing.assert_array_equal(got[0, 8:], positions[0, 8:])  # padding untouched
  assert max(int(g.max()) for g in drawn) > 32  # the range is used, not only the row's own length
  assert (max(firsts) > 0) == (first == "drawn") and min(firsts) == 0
  with pytest.raises(ValueError, match=r"data.random_positions=8: a run of 10 tokens cannot take 10 distinct"):
    random_positions.draw(positions, real, 8, np.random.default_rng(0), first)
  with pytest.raises(ValueError, match=r"^data.random_positions_first='first' is not one of \['drawn', 'zero'\]$"):
    random_positions.draw(positions, real, 64, np.random.default_rng(0), "first")


def official_distances(limit: int) -> np.ndarray:
  """``[limit]`` float64: the probability of each distance between two of the official draw's positions (the
  google-deepmind/randomized_positional_encodings ``noisy_fixed_positional_encodings``: n sorted distinct positions
  from ``[0, limit)``, every n-subset alike). Any two of the n are then a uniform 2-subset: counted over all of
  them, exactly."""
  low_P, high_P = np.triu_indices(limit, 1)
  return np.bincount(high_P - low_P, minlength=limit) / math.comb(limit, 2)


def pair_distances(positions_BxL: np.ndarray) -> np.ndarray:
  """Every distance between two positions of a row, all rows."""
  i, j = np.triu_indices(positions_BxL.shape[1], 1)
  return (positions_BxL[:, j] - positions_BxL[:, i]).ravel()


def binned_tv(distances: np.ndarray, reference_D: np.ndarray, bins: int = 16) -> float:
  """Total variation between the distances' histogram and the reference distribution, over ``bins`` equal bins."""
  edges = np.linspace(0, len(reference_D), bins + 1).astype(int)
  reference = np.add.reduceat(reference_D, edges[:-1])
  counts = np.add.reduceat(np.bincount(distances, minlength=len(reference_D)), edges[:-1])
  return 0.5 * float(np.abs(counts / counts.sum() - reference).sum())


def test_the_default_draw_has_the_official_functions_distances_and_first_at_zero_does_not():
  limit = 512
  reference_D = official_distances(limit)
  assert abs(float(reference_D @ np.arange(limit)) - (limit + 1) / 3) < 1e-9  # 171 at n = 2
  rng = np.random.default_rng(0)
  measured = {}
  for n, rows in ((2, 20000), (8, 1000)):
    positions_BxL, real_BxL = np.tile(np.arange(n), (rows, 1)), np.ones((rows, n), bool)
    for first in random_positions.FIRSTS:
      distances = pair_distances(random_positions.draw(positions_BxL, real_BxL, limit, rng, first))
      measured[n, first] = distances.mean(), binned_tv(distances, reference_D)
  mean, tv = measured[2, "drawn"]
  assert abs(mean - 171) < 3 and tv < 0.03, measured
  assert measured[8, "drawn"][1] < 0.03, measured
  mean, tv = measured[2, "zero"]  # uniform on [1, N): mean N / 2, total variation 0.25 from the paper's
  assert abs(mean - 256) < 3 and tv > 0.2, measured
  assert measured[8, "zero"][1] > 0.04, measured


def test_training_batches_draw_positions_and_resume_the_same_draws_and_evaluation_keeps_its_own():
  config = override(load_config("lm", "runlocal"), batch_size=4, max_len=32, **{"data.random_positions": 512})
  config.evals = {"eval": {"kind": "clm", "split": "eval", "batches": 1}}
  tokenizer = Tokenizer.load(config.data.vocab_file)
  batches, evaluations = mlm_task.corpus_batches(config, tokenizer, 4, masked=False)
  next(batches)
  state = batches.state()
  second = next(batches)
  assert second["positions"].max() >= 32 and np.any(second["positions"][:, 0] > 0)  # the paper's: first drawn too
  batches.restore(state)
  np.testing.assert_array_equal(next(batches)["positions"], second["positions"])
  np.testing.assert_array_equal(evaluations["eval"].rows[0]["positions"], np.tile(np.arange(32), (4, 1)))
  zero, _ = mlm_task.corpus_batches(changed(config, **{"data.random_positions_first": "zero"}), tokenizer, 4,
                                    masked=False)
  assert np.all(next(zero)["positions"][:, 0] == 0)
  for change, message in (({"data.random_positions": 16}, r"data.random_positions=16 must be at least max_len=32"),
                          ({"data.random_positions": 0, "data.random_positions_first": "one"},
                           r"^data.random_positions_first='one' is not one of \['drawn', 'zero'\]$")):
    with pytest.raises(ValueError, match=message):
      mlm_task.corpus_batches(changed(config, **change), tokenizer, 4, masked=False)
  table = override(load_config("lm", "runlocal,position=absolute"), max_len=32, **{"data.random_positions": 512})
  with pytest.raises(ValueError, match=r"data.random_positions=512: position method 'absolute' has a learned table "
                                       r"of model.max_len=32 rows"):
    mlm_task.corpus_batches(table, tokenizer, 4, masked=False)


def test_tupes_cls_reset_takes_the_first_position_kept_at_zero_and_refuses_the_drawn_one():
  tokenizer = Tokenizer.load(load_config("pretrain", "runlocal").data.vocab_file)
  config = override(load_config("pretrain", "runlocal,position=tupe_r"), batch_size=4, max_len=32,
                    **{"data.random_positions": 64, "model.max_len": 64})
  config.eval_every_steps = 0
  with pytest.raises(ValueError, match=r"^data.random_positions_first='drawn': position method 'tupe_r' resets the "
                                       r"\[CLS\] at position 0 \(cls_reset='official'\); set "
                                       r"data.random_positions_first='zero' or model.position_options.cls_reset="
                                       r"'none'$"):
    mlm_task.corpus_batches(config, tokenizer, 4)
  batches, _ = mlm_task.corpus_batches(changed(config, **{"data.random_positions_first": "zero"}), tokenizer, 4)
  assert np.all(next(batches)["positions"][:, 0] == 0)
  untied = changed(config, **{"model.position_options.cls_reset": "none"})
  batches, _ = mlm_task.corpus_batches(untied, tokenizer, 4)  # no [CLS] reset: the paper's draw
  next(batches)
  # LongRoPE reads a packed document's length from its run of positions, which starts at position 0
  longrope = override(load_config("lm", "runlocal"), batch_size=4, max_len=32, **{
      "data.random_positions": 64, "data.packing": "stream_documents", "model.position_options.scaling": "longrope",
      "model.position_options.short_factor": (1.0,) * 4, "model.position_options.long_factor": (2.0,) * 4})
  with pytest.raises(ValueError, match=r"^data.random_positions_first='drawn' with data.packing='stream_documents': "
                                       r"rope's longrope scaling reads each packed document's length"):
    mlm_task.corpus_batches(longrope, tokenizer, 4, masked=False)
