"""Randomised positions (Ruoss et al. 2023): training rows' positions drawn from a longer range, evaluation's not."""

import numpy as np
import pytest

from posjax.data import random_positions
from posjax.data.tokenizer import Tokenizer
from posjax.tasks import mlm as mlm_task
from conftest import load_config, override


def test_each_run_from_zero_draws_sorted_distinct_positions_below_the_limit():
  # two packed documents (positions restart at 0) and padding; the draw keeps each run's first token at 0
  positions = np.array([[0, 1, 2, 3, 4, 0, 1, 2, 0, 0], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]])
  real = np.array([[1] * 8 + [0] * 2, [1] * 10]).astype(bool)
  drawn = [random_positions.draw(positions, real, 64, np.random.default_rng(seed)) for seed in range(50)]
  for got in drawn:
    for b, runs in ((0, [(0, 5), (5, 8)]), (1, [(0, 10)])):
      for start, end in runs:
        run = got[b, start:end]
        assert run[0] == 0 and np.all(np.diff(run) > 0) and run[-1] < 64, run
    np.testing.assert_array_equal(got[0, 8:], positions[0, 8:])  # padding untouched
  assert max(int(g.max()) for g in drawn) > 32  # the range is used, not only the row's own length
  with pytest.raises(ValueError, match=r"data.random_positions=8: a run of 10 tokens cannot take 10 distinct"):
    random_positions.draw(positions, real, 8, np.random.default_rng(0))


def test_training_batches_draw_positions_and_resume_the_same_draws_and_evaluation_keeps_its_own():
  config = override(load_config("lm", "runlocal"), batch_size=4, max_len=32, **{"data.random_positions": 512})
  config.evals = {"eval": {"kind": "clm", "split": "eval", "batches": 1}}
  tokenizer = Tokenizer.load(config.data.vocab_file)
  batches, evaluations = mlm_task.corpus_batches(config, tokenizer, 4, masked=False)
  next(batches)
  state = batches.state()
  second = next(batches)
  assert second["positions"].max() >= 32 and np.all(second["positions"][:, 0] == 0)
  batches.restore(state)
  np.testing.assert_array_equal(next(batches)["positions"], second["positions"])
  np.testing.assert_array_equal(evaluations["eval"].rows[0]["positions"], np.tile(np.arange(32), (4, 1)))
  for change, message in ((16, r"data.random_positions=16 must be at least max_len=32"),):
    with pytest.raises(ValueError, match=message):
      mlm_task.corpus_batches(override(config, **{"data.random_positions": change}), tokenizer, 4, masked=False)
  table = override(load_config("lm", "runlocal,position=absolute"), max_len=32, **{"data.random_positions": 512})
  with pytest.raises(ValueError, match=r"data.random_positions=512: position method 'absolute' has a learned table "
                                       r"of model.max_len=32 rows"):
    mlm_task.corpus_batches(table, tokenizer, 4, masked=False)
