"""RULER's synthetic tasks (posjax.tasks.ruler): each prompt solved by an independent reader of its text gives the
sample's answers (the needles' values, the chain's variables, the counted words), the templates' wording is RULER's
(singular for one answer), a depth places the needle, the haystack fits a token budget, and the scores follow RULER's
definitions."""

import collections
import re

import numpy as np
import pytest

from configs import pretrain as ruler_config
from conftest import load_config
from posjax.data.tokenizer import Tokenizer
from posjax.tasks import clm, ruler, ruler_eval
from test_passkey import Batches


def test_the_scores_are_rulers_string_matches():
  predictions = ["The numbers are 123 and 456.", "nothing here", "ALPHA-beta"]
  references = [["123", "456", "789"], ["1"], ["alpha-beta"]]
  assert ruler.string_match_all(predictions, references) == round(100 * (2 / 3 + 0 + 1) / 3, 2) == 55.56
  assert ruler.string_match_part(predictions, references) == round(100 * 2 / 3, 2)
  with pytest.raises(ValueError, match="2 predictions for 1 references"):
    ruler.string_match_all(["a", "b"], [["a"]])


def needles(prompt):
  return re.findall(r"One of the special magic \w+ for ([\w-]+) is: ([\w-]+)\.", prompt)


@pytest.mark.parametrize("fields", [
    dict(), dict(keys=4), dict(keys=1, values=4), dict(keys=4, queries=2), dict(haystack="needle", keys=2),
    dict(type_k="numbers", type_v="words"),
])
def test_a_needle_in_a_haystack_is_answered_by_reading_its_needles(fields):
  sample = ruler.niah(np.random.default_rng(0), 40, **fields)
  asked = re.search(r"What (?:is|are all) the special magic \w+ for (.+?) mentioned", sample.prompt)[1]
  keys = re.split(r", and |, ", asked)
  found = needles(sample.prompt)
  values = [v for k in keys for key, v in found if key == k]
  assert sorted(values) == sorted(sample.answers) and len(keys) == fields.get("queries", 1)
  assert len(found) == fields.get("keys", 1) * fields.get("values", 1) + (40 if fields.get("haystack") else 0)
  lines = sample.prompt.split("\n")
  assert len(sample.positions) == len(found) - (40 if fields.get("haystack") else 0)
  assert all(lines[1 + p].startswith("One of the special magic") for p in sample.positions)
  if len(sample.answers) == 1:  # RULER's singular wording
    assert sample.prompt.startswith("A special magic number is hidden within the following text." if "type_v" not in
                                    fields else "A special magic word is hidden")
    assert sample.prompt.endswith("mentioned in the provided text is")
  else:
    assert sample.prompt.startswith("Some special magic numbers are hidden") and sample.prompt.endswith("text are")


def test_a_depth_places_the_single_needle():
  for depth, index in ((0.0, 0), (0.5, 10), (1.0, 20)):
    sample = ruler.niah(np.random.default_rng(1), 20, depth=depth)
    lines = sample.prompt.split("\n")[1:-1]
    assert sample.positions == (index,) and lines[index].startswith("One of the special magic numbers for")
    assert sum(line == ruler.REPEAT for line in lines) == 20
  with pytest.raises(ValueError, match=r"depth=0.5 places one needle .* here 2 needles"):
    ruler.niah(np.random.default_rng(1), 20, keys=2, depth=0.5)


def test_variable_tracking_is_answered_by_following_the_chain():
  sample = ruler.variable_tracking(np.random.default_rng(2), 30, chains=3, hops=4)
  value = re.search(r"assigned the value (\d+) in the text", sample.prompt)[1]
  held = {}
  for name, source in re.findall(r"VAR (\w+) = (VAR \w+|\d+)\.", sample.prompt):
    held[name] = held[source[4:]] if source.startswith("VAR ") else source
  assert sorted(n for n, v in held.items() if v == value) == sorted(sample.answers) and len(sample.answers) == 5
  assert len(sample.positions) == 15 and "5 variables are assigned the value" in sample.prompt


def test_the_word_tasks_are_answered_by_counting():
  sample = ruler.common_words(np.random.default_rng(3), 100)
  words = re.findall(r"\b\d+\. ([\w-]+)", sample.prompt)
  counts = collections.Counter(words)
  assert {w for w, _ in counts.most_common(10)} == set(sample.answers) and len(counts) == 100
  assert len(words) == 10 * 30 + 90 * 3
  sample = ruler.frequent_words(np.random.default_rng(4), 400)
  codes = re.findall(r"\b[a-z]{6}\b", sample.prompt.split("coded words. ")[1].split("\nQuestion")[0])
  assert [w for w, _ in collections.Counter(codes).most_common(3)] == list(sample.answers) and len(codes) == 400


def test_fit_finds_the_largest_haystack_within_a_token_budget():
  count = lambda text: len(text.split())
  make = lambda size: ruler.niah(np.random.default_rng(5), size)
  size, sample = ruler.fit(make, count, 500)
  assert count(sample.prompt) <= 500 < count(make(size + 1).prompt)
  with pytest.raises(ValueError, match="no haystack fits 10 tokens"):
    ruler.fit(make, count, 10)


def test_a_clm_run_builds_ruler_evaluators_whose_answers_score_by_rulers_match():
  config = load_config("clm", "position=rope,runlocal")
  options = dict(ruler_config.RULER_RUNLOCAL, keys=2, queries=2)
  config.evals = {"niah": {"kind": "ruler", "task": "niah", "options": options, "tokens": 6, "max_len": 64},
                  "grid": {"kind": "ruler", "task": "niah", "options": ruler_config.RULER_RUNLOCAL, "tokens": 6,
                           "depths": 3, "max_len": 64}}
  task = clm.build(config, 16)
  tokenizer = Tokenizer.load(config.data.vocab_file)
  evaluator = task.evaluators["niah"]
  batch = evaluator.batches[0]
  assert batch["input_ids"].shape == (16, 58) and (batch["attention_mask"][:, -1] == 1).all()
  # a prompt read back: its two asked keys' values are the row's answers; ours, written out, score 1
  answers = evaluator.metrics.args[1]
  prompt = tokenizer.backend.decode([int(i) for i in batch["input_ids"][0] if i != tokenizer.pad_id])
  assert all(value in prompt for value in answers[0]) and len(answers[0]) == 2
  right = np.asarray([(tokenizer.encode(" ".join(a)) + [0] * 6)[:6] for a in answers], np.int32)
  outputs = {"generated": right, "row_id": batch["row_id"], "depth_index": batch["depth_index"]}
  assert evaluator.metrics(outputs) == {"accuracy": 1.0}
  half = np.asarray([(tokenizer.encode(a[0]) + [0] * 6)[:6] for a in answers], np.int32)
  assert evaluator.metrics({**outputs, "generated": half}) == {"accuracy": 0.5}
  grid = task.evaluators["grid"]
  assert grid.metric_names == ("accuracy", "accuracy@0.00", "accuracy@0.50", "accuracy@1.00")
  assert grid.batches[0]["depth_index"].tolist()[:4] == [0, 1, 2, 0]
  config.evals = {"niah": {"kind": "ruler", "task": "qa"}}
  with pytest.raises(ValueError, match=r"config.evals.niah.task='qa'; allowed: \['niah', 'variable_tracking'"):
    clm.build(config, 16)


def test_training_rows_put_prompts_and_their_answers_into_the_last_rows_and_resume_exactly():
  tokenizer = Tokenizer.load("configs/data/tiny_vocab.txt")
  spec = {"fraction": 0.5, "tasks": {"niah": {"task": "niah", "options": ruler_config.RULER_RUNLOCAL}}, "tokens": 4}
  rows = ruler_eval.TrainingRows(Batches(64), tokenizer, spec, local_batch=4, length=64, seed=0)
  first = [next(rows) for _ in range(2)]
  for n, batch in enumerate(first, 1):
    assert (batch["input_ids"][:2] == n).all()  # the first rows: the corpus's
    for r in (2, 3):
      real = batch["attention_mask"][r].astype(bool)
      text = tokenizer.backend.decode([int(i) for i in batch["input_ids"][r][real]])
      asked = re.search(r"the (\w+) (\w+)$", text)  # the question, then the answer
      assert asked and f"the {asked[1]} {asked[2]}." in text  # the answer is the asked key's needle's value
  resumed = ruler_eval.TrainingRows(Batches(64), tokenizer, spec, local_batch=4, length=64, seed=0)
  state = ruler_eval.TrainingRows(Batches(64), tokenizer, spec, local_batch=4, length=64, seed=0)
  next(state)
  resumed.restore(state.state())
  np.testing.assert_array_equal(next(resumed)["input_ids"], first[1]["input_ids"])
