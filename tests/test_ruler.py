"""RULER's synthetic tasks (posjax.tasks.ruler): each prompt solved by an independent reader of its text gives the
sample's answers (the needles' values, the chain's variables, the counted words), the templates' wording is RULER's
(singular for one answer), a depth places the needle, the haystack fits a token budget, and the scores follow RULER's
definitions."""

import collections
import re

import numpy as np
import pytest

from posjax.tasks import ruler


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
