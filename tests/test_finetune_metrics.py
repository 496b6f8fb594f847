"""GLUE and SQuAD v1.1 metrics against values computed by hand."""

import pytest

from posjax.finetune import metrics


def test_glue_metrics_by_hand():
  # labels 1 1 0 0, predictions 1 0 0 0: TP 1, FN 1, TN 2, FP 0.
  labels, predictions = [1, 1, 0, 0], [1, 0, 0, 0]
  assert metrics.glue("cola", predictions, labels) == {"matthews": pytest.approx(100 * 2 / 12 ** 0.5)}
  assert metrics.glue("mrpc", predictions, labels) == {"accuracy": 75.0, "f1": pytest.approx(100 * 2 / 3)}
  assert metrics.glue("rte", predictions, labels) == {"accuracy": 75.0}
  # STS-B: x = 1 2 3 4, y = 1 2 3 5: Pearson = Sxy / sqrt(Sxx Syy) = 6.5 / sqrt(5 * 8.75); Spearman 1 (monotone).
  stsb = metrics.glue("stsb", [1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 5.0])
  assert stsb == {"pearson": pytest.approx(100 * 6.5 / (5 * 8.75) ** 0.5), "spearman": pytest.approx(100.0)}


def test_glue_errors():
  with pytest.raises(ValueError, match=r"unknown GLUE task 'sts'; allowed: \['cola', "):
    metrics.glue("sts", [1], [1])
  with pytest.raises(ValueError, match=r"rte: \(2,\) predictions for \(3,\) labels"):
    metrics.glue("rte", [1, 0], [1, 0, 1])


def test_glue_score_is_the_mean_of_the_nine_paper_numbers():
  # TUPE Table 1, row TUPE-R: Avg 85.04.
  row = {"mnli_matched": 86.21, "mnli_mismatched": 86.19, "qnli": 92.17, "qqp": 91.30, "sst2": 93.26, "cola": 63.56,
         "mrpc": 89.89, "rte": 73.56, "stsb": 89.23}
  results = {task: {metrics.PAPER_METRIC[task]: value, "f1": 0.0, "spearman": 0.0} for task, value in row.items()}
  assert metrics.glue_score(results) == pytest.approx(85.04, abs=0.005)
  del results["rte"]
  with pytest.raises(ValueError, match=r"missing: \['rte'\]"):
    metrics.glue_score(results)


def test_squad_exact_match_and_f1_by_hand():
  answers = {"q1": ["the Eiffel Tower", "Eiffel Tower"], "q2": ["1889"], "q3": ["Gustave Eiffel's company"],
             "q4": ["Paris"]}
  predictions = {"q1": "Eiffel tower!",  # normalises to a gold answer: EM 1, F1 1
                 "q2": "in 1889",  # 1 of 2 predicted tokens right, 1 of 1 gold: F1 2/3
                 "q3": "Gustave Eiffel",  # "gustave eiffel" vs "gustave eiffels company": P 1/2, R 1/3, F1 0.4
                 }  # q4 unanswered: 0
  scores = metrics.squad(predictions, answers)
  assert scores == {"exact_match": pytest.approx(25.0), "f1": pytest.approx(100 * (1 + 2 / 3 + 0.4) / 4)}
  assert metrics.normalize_answer("  The  cat, an   Apple!") == "cat apple"
