"""Made-up GLUE and SQuAD files in the real formats (GLUE TSV directories, SQuAD v1.1 JSON), built from the
synthetic grammar of :mod:`posjax.data.synthetic`, each with a signal a tiny model can learn: local runs and
tests of the fine-tuning pipelines without a download.

  python -m posjax.finetune.synthetic --out=configs/data   # writes glue/<TASK>/*.tsv and squad/*-v1.1.json

- CoLA: acceptable (1) when the verb agrees with the subject; SST-2: positive (1) when the subject's adjective
  is one of ``POSITIVE``. MRPC / QQP / WNLI: the same sentence with its adverb toggled (1) or another sentence (0).
  STS-B: 5 × the share of words the two sentences have in common. MNLI / RTE: the premise's bare subject, verb
  and object (entailment), the same with another verb (contradiction), or another sentence (neutral; RTE folds
  it and contradiction into not_entailment). QNLI: does the sentence answer "what does <subject> <verb> ?".
- SQuAD: a paragraph of sentences; the question asks for one sentence's object, which is the answer span.
"""

from __future__ import annotations

import json
import os

import numpy as np
from absl import app, flags

from posjax.data import synthetic as grammar
from posjax.finetune import glue

POSITIVE = ("bright", "gentle", "new", "early", "quiet")


def clause(rng: np.random.Generator, adjective: str | None = None) -> dict:
  """The parts of one made-up sentence (subject, its number, verb index, object, adverb), for :func:`text`
  to vary; ``adjective``: put on the subject, in place of any adjective it drew."""
  subject, number = grammar.noun_phrase(rng)
  if adjective is not None:
    subject = [subject[0], adjective] + [w for w in subject[1:] if w not in grammar.ADJ]
  verb = int(rng.integers(len(grammar.VERB[number])))
  obj, _ = grammar.noun_phrase(rng)
  adverb = [str(rng.choice(grammar.ADV))] if rng.random() < 0.5 else []
  return dict(subject=subject, number=number, verb=verb, object=obj, adverb=adverb)


def text(c: dict, *, agree: bool = True, verb: int | None = None, adverb: bool = True, bare: bool = False) -> str:
  """A clause as a sentence, varied: ``agree=False`` breaks subject-verb agreement, ``verb`` swaps the verb,
  ``adverb=False`` drops the adverb, ``bare`` keeps only the determiner and noun of subject and object."""
  number = c["number"] if agree else ("pl" if c["number"] == "sg" else "sg")
  subject, obj = c["subject"], c["object"]
  if bare:  # determiner + noun only
    subject, obj = [subject[0], next(w for w in subject[1:] if w not in grammar.ADJ)], [obj[0], obj[-1]]
  words = subject + [grammar.VERB[number][c["verb"] if verb is None else verb]] + obj
  return " ".join(words + (c["adverb"] if adverb else [])) + " ."


def pair(task: str, rng: np.random.Generator) -> tuple[list[str], str]:
  """One made-up example: ``(texts, label)`` with the label as the TSV writes it."""
  c = clause(rng)
  if task == "cola":
    agree = rng.random() < 0.5
    return [text(c, agree=agree)], str(int(agree))
  if task == "sst2":
    adjective = str(rng.choice(grammar.ADJ))
    return [text(clause(rng, adjective))], str(int(adjective in POSITIVE))
  other = text(clause(rng))
  if task in ("mrpc", "qqp", "wnli"):
    same = rng.random() < 0.5
    return [text(c), text(c, adverb=not c["adverb"]) if same else other], str(int(same))
  if task == "stsb":
    b = text(c, adverb=False) if rng.random() < 0.5 else other
    a = text(c)
    shared = len(set(a.split()) & set(b.split())) / max(len(a.split()), len(b.split()))
    return [a, b], f"{5 * shared:.3f}"
  if task in ("mnli", "rte"):
    kind = str(rng.choice(["entailment", "contradiction", "neutral"]))
    other_verb = (c["verb"] + 1 + int(rng.integers(len(grammar.VERB["sg"]) - 1))) % len(grammar.VERB["sg"])
    hypothesis = {"entailment": text(c, bare=True, adverb=False),
                  "contradiction": text(c, bare=True, adverb=False, verb=other_verb), "neutral": other}[kind]
    if task == "rte" and kind != "entailment":
      kind = "not_entailment"
    return [text(c), hypothesis], kind
  if task == "qnli":
    answers = rng.random() < 0.5
    question = f"what does {' '.join(c['subject'])} {grammar.VERB['pl'][c['verb']]} ?"
    return [question, text(c) if answers else other], "entailment" if answers else "not_entailment"
  raise ValueError(f"unknown GLUE task {task!r}; allowed: {list(glue.TASKS)}")


# The real files' headers, for the tasks whose first columns are not an index.
HEADERS = {"mrpc": ["Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"],
           "qqp": ["id", "qid1", "qid2", "question1", "question2", "is_duplicate"]}


def _row(task: glue.Task, n: int, texts: list[str], label: str) -> list[str]:
  if task.name == "cola":  # no header: source, label, original judgement, sentence
    return ["syn", label, "" if label == "1" else "*", texts[0]]
  if task.name == "mrpc":
    return [label, str(2 * n), str(2 * n + 1), *texts]
  if task.name == "qqp":
    return [str(n), str(2 * n), str(2 * n + 1), *texts, label]
  return [str(n), *texts, label]


def write_glue(root: str, num_train: int = 120, num_dev: int = 40, seed: int = 0) -> None:
  """Every GLUE task's ``train.tsv`` and ``dev.tsv`` (MNLI: ``dev_matched`` and ``dev_mismatched``) under
  ``root``, in the directories and columns of the GLUE download."""
  for index, task in enumerate(glue.TASKS.values()):
    rng = np.random.default_rng([seed, index])
    directory = os.path.join(root, task.tsv_dir)
    os.makedirs(directory, exist_ok=True)
    files = {"train.tsv": num_train, **({"dev_matched.tsv": num_dev, "dev_mismatched.tsv": num_dev}
                                        if task.name == "mnli" else {"dev.tsv": num_dev})}
    for name, count in files.items():
      header = None if task.name == "cola" else HEADERS.get(task.name, ["index", *task.tsv_columns])
      rows = [header] if header else []
      rows += [_row(task, n, *pair(task.name, rng)) for n in range(count)]
      with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
        f.writelines("\t".join(row) + "\n" for row in rows)


def squad_data(num_paragraphs: int, seed: int) -> dict:
  """A SQuAD v1.1 JSON value of ``num_paragraphs`` made-up paragraphs, one question per sentence asking for
  its object (the answer, with its character offset)."""
  rng = np.random.default_rng(seed)
  paragraphs = []
  for p in range(num_paragraphs):
    clauses = [clause(rng) for _ in range(int(rng.integers(3, 6)))]
    sentences = [text(c) for c in clauses]
    context = " ".join(sentences)
    qas = []
    for k, c in enumerate(clauses):
      answer = " ".join(c["object"])
      before_object = " ".join(c["subject"] + [grammar.VERB[c["number"]][c["verb"]]]) + " "
      start = len(" ".join(sentences[:k])) + (1 if k else 0) + len(before_object)
      question = f"what does {' '.join(c['subject'])} {grammar.VERB['pl'][c['verb']]} ?"
      qas.append({"id": f"p{p}q{k}", "question": question, "answers": [{"text": answer, "answer_start": start}]})
    paragraphs.append({"context": context, "qas": qas})
  return {"version": "1.1", "data": [{"title": "synthetic", "paragraphs": paragraphs}]}


def write_squad(root: str, num_train: int = 40, num_dev: int = 10, seed: int = 0) -> None:
  """``train-v1.1.json`` and ``dev-v1.1.json`` (drawn with the next seed) under ``root``."""
  os.makedirs(root, exist_ok=True)
  for name, count, offset in (("train-v1.1.json", num_train, 0), ("dev-v1.1.json", num_dev, 1)):
    with open(os.path.join(root, name), "w", encoding="utf-8") as f:
      json.dump(squad_data(count, seed + offset), f)


def main(argv):
  """Writes the made-up GLUE and SQuAD files into ``--out``'s ``glue/`` and ``squad/``."""
  del argv
  out = flags.FLAGS.out
  write_glue(os.path.join(out, "glue"))
  write_squad(os.path.join(out, "squad"))


if __name__ == "__main__":
  flags.DEFINE_string("out", "configs/data", "Directory for glue/ and squad/.")
  app.run(main)
