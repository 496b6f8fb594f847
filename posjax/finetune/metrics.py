"""Downstream metrics as the papers report them.

GLUE (Wang et al. 2019), from scikit-learn and SciPy: Matthews correlation (CoLA), Pearson and Spearman
(STS-B), accuracy and F1 (MRPC, QQP), accuracy (the rest). :func:`glue_score` is TUPE's average (Ke et al.
2021, Table 1): the mean of nine numbers — CoLA's Matthews correlation, STS-B's Pearson, accuracy for every
other task including MRPC and QQP, MNLI matched and mismatched counted separately; WNLI left out.

SQuAD v1.1 (Rajpurkar et al. 2016): exact match and token F1 as the official ``evaluate-v1.1.py`` computes
them: answers lower-cased, punctuation and the articles a/an/the removed, whitespace collapsed; the best over
the gold answers; an unanswered question scores 0; both in percent.
"""

from __future__ import annotations

import collections
import re
import string
from typing import Mapping, Sequence

import numpy as np

GLUE_METRICS = {
    "cola": ("matthews",), "sst2": ("accuracy",), "mrpc": ("accuracy", "f1"), "stsb": ("pearson", "spearman"),
    "qqp": ("accuracy", "f1"), "mnli_matched": ("accuracy",), "mnli_mismatched": ("accuracy",),
    "qnli": ("accuracy",), "rte": ("accuracy",), "wnli": ("accuracy",),
}
# The number of each task that enters TUPE's GLUE average.
PAPER_METRIC = {"cola": "matthews", "sst2": "accuracy", "mrpc": "accuracy", "stsb": "pearson", "qqp": "accuracy",
                "mnli_matched": "accuracy", "mnli_mismatched": "accuracy", "qnli": "accuracy", "rte": "accuracy"}


def glue(task: str, predictions: Sequence, labels: Sequence) -> dict[str, float]:
  """The task's metrics in percent; ``predictions`` are class ids (a score for STS-B)."""
  from scipy import stats
  from sklearn import metrics

  if task not in GLUE_METRICS:
    raise ValueError(f"unknown GLUE task {task!r}; allowed: {sorted(GLUE_METRICS)}")
  predictions, labels = np.asarray(predictions), np.asarray(labels)
  if predictions.shape != labels.shape or not len(labels):
    raise ValueError(f"{task}: {predictions.shape} predictions for {labels.shape} labels")
  compute = {
      "matthews": lambda: metrics.matthews_corrcoef(labels, predictions),
      "accuracy": lambda: metrics.accuracy_score(labels, predictions),
      "f1": lambda: metrics.f1_score(labels, predictions),
      "pearson": lambda: stats.pearsonr(predictions, labels)[0],
      "spearman": lambda: stats.spearmanr(predictions, labels)[0],
  }
  return {name: 100.0 * float(compute[name]()) for name in GLUE_METRICS[task]}


def glue_score(results: Mapping[str, Mapping[str, float]]) -> float:
  """TUPE's GLUE average over ``results[task][metric]`` (percent); every one of the nine tasks is needed."""
  missing = sorted(set(PAPER_METRIC) - set(results))
  if missing:
    raise ValueError(f"the GLUE average needs all nine numbers; missing: {missing}")
  return float(np.mean([results[task][metric] for task, metric in PAPER_METRIC.items()]))


def normalize_answer(text: str) -> str:
  """SQuAD v1.1's normalisation: lower case, no punctuation, no articles, single spaces."""
  text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
  text = re.sub(r"\b(a|an|the)\b", " ", text)
  return " ".join(text.split())


def _f1(prediction: str, gold: str) -> float:
  predicted, wanted = normalize_answer(prediction).split(), normalize_answer(gold).split()
  common = sum((collections.Counter(predicted) & collections.Counter(wanted)).values())
  if common == 0:
    return 0.0
  precision, recall = common / len(predicted), common / len(wanted)
  return 2 * precision * recall / (precision + recall)


def squad(predictions: Mapping[str, str], answers: Mapping[str, Sequence[str]]) -> dict[str, float]:
  """``exact_match`` and ``f1`` in percent over every question of ``answers`` (id -> gold answer texts)."""
  if not answers:
    raise ValueError("no questions to score")
  exact = f1 = 0.0
  for question, golds in answers.items():
    if question not in predictions:
      continue
    prediction = predictions[question]
    exact += max(float(normalize_answer(prediction) == normalize_answer(g)) for g in golds)
    f1 += max(_f1(prediction, g) for g in golds)
  return {"exact_match": 100.0 * exact / len(answers), "f1": 100.0 * f1 / len(answers)}
