"""What a run reports: every evaluation, the one the protocol selects, and when evaluations happen."""

import ml_collections
import pytest

from posjax import results
from posjax.train import validate
from conftest import load_config, override

NAN = float("nan")


def evaluation(step, accuracy, mismatched=50.0):
  return {"step": step, "metrics": {"mnli_matched": {"accuracy": accuracy},
                                    "mnli_mismatched": {"accuracy": mismatched}}}


def test_best_is_the_highest_selection_number_earliest_on_ties_and_never_nan():
  log = [evaluation(10, 70.0, 1.0), evaluation(20, NAN, 99.0), evaluation(30, 80.0, 2.0), evaluation(40, 80.0, 3.0),
         evaluation(50, 75.0, 4.0)]
  chosen = results.select(log, "best", "mnli_matched/accuracy")
  assert chosen["step"] == 30 and chosen["metrics"]["mnli_mismatched"]["accuracy"] == 2.0  # one evaluation, both
  assert results.select(log, "last")["step"] == 50
  assert results.select([evaluation(10, NAN), evaluation(20, NAN)], "best", "mnli_matched/accuracy")["step"] == 20
  assert results.select([], "best", "mnli_matched/accuracy") is None
  with pytest.raises(ValueError, match=r"select_metric='mnli_matched/acc': evaluator 'mnli_matched' reports no "
                                       r"'acc'; it reports \['accuracy'\]"):
    results.select(log, "best", "mnli_matched/acc")
  written = results.run_results({"task": "glue/mnli"}, log, "best", "mnli_matched/accuracy")
  assert written["selected_step"] == 30 and written["evaluations"] == log and written["metrics"] == log[2]["metrics"]


def test_selection_fields_are_checked_against_the_evaluators():
  results.check_selection("best", "rte/accuracy", {"rte": None})
  results.check_selection("last", "", {"rte": None})
  with pytest.raises(ValueError, match=r"config.select='first'; allowed: \['best', 'last'\]"):
    results.check_selection("first", "", {"rte": None})
  with pytest.raises(ValueError, match=r"select_metric='<evaluator>/<metric>' with an evaluator of config.evals "
                                       r"\['rte'\]; got 'sst2/accuracy'"):
    results.check_selection("best", "sst2/accuracy", {"rte": None})


def test_evaluations_twice_an_epoch_and_at_the_end():
  config = ml_collections.ConfigDict(dict(total_steps=31, eval_every_steps=1000, evals_per_epoch=2,
                                          steps_per_epoch=10.0))
  assert sorted(validate.eval_steps(config)) == [5, 10, 15, 20, 25, 31]  # 30 is a step before the end: the end's
  config.update(evals_per_epoch=0, eval_every_steps=10)
  assert sorted(validate.eval_steps(config)) == [10, 20, 30, 31]
  config.eval_every_steps = 0
  assert validate.eval_steps(config) == frozenset()
  glue = validate.resolve_durations(override(load_config("finetune/glue", "task=rte"), total_epochs=2.0), 320)
  assert sorted(validate.eval_steps(glue)) == [5, 10, 15, 20]  # 320 examples / batch 32: 10 steps an epoch
