"""SQuAD v1.1 examples, windows and predictions mapped back to text."""

import json
import os

import numpy as np
import pytest

from posjax.data import synthetic
from posjax.data.tokenizer import Tokenizer
from posjax.finetune import metrics, squad


@pytest.fixture(scope="module")
def tokenizer():
  return Tokenizer.load(os.path.join(synthetic.BUILTIN_DIR, "tiny_vocab.txt"))


def official_file(path, context, qas):
  path.write_text(json.dumps({"version": "1.1", "data": [{"title": "t", "paragraphs": [
      {"context": context, "qas": [{"id": i, "question": q, "answers": [{"text": a, "answer_start": context.index(a)}
                                                                         for a in answers]}
                                   for i, q, answers in qas]}]}]}))


def test_official_json_and_errors(tmp_path):
  official_file(tmp_path / "dev.json", "the model sees a river .", [("q1", "what does the model see ?", ["a river"])])
  (example,) = squad.json_examples(str(tmp_path / "dev.json"))
  assert (example.id, example.answers, example.answer_starts) == ("q1", ("a river",), (15,))
  (tmp_path / "bad.json").write_text('{"data": [{"paragraphs": [{"context": "x", "qas": [{"id": "1", "question": "q"}]}]}]}')
  with pytest.raises(ValueError, match=r"SQuAD file .*bad.json is not in the official v1.1 format \(KeyError"):
    list(squad.json_examples(str(tmp_path / "bad.json")))
  with pytest.raises(FileNotFoundError, match=r"SQuAD file .*missing.json does not exist"):
    list(squad.json_examples(str(tmp_path / "missing.json")))


def test_tfds_source():
  import tensorflow_datasets as tfds

  with tfds.testing.mock_data(num_examples=3):
    found = list(squad.tfds_examples("validation"))
  assert len(found) == 3 and all(isinstance(e.context, str) and isinstance(e.answers, tuple) for e in found)


def test_windows_stride_and_an_answer_that_straddles_two_windows(tokenizer):
  candidates = "the model sees a river near city and heads count tokens of every sentence again small red".split()
  whole = [w for w in candidates if len(tokenizer.encode(w)) == 1]  # one token per word
  words = (whole * 3)[:18]
  context = " ".join(words)
  assert len(tokenizer.encode(context)) == 18
  answer = " ".join(words[10:14])
  example = squad.Example("q", "what counts ?", context, (answer,), (len(" ".join(words[:10])) + 1,))
  question = tokenizer.encode(example.question)
  # room for 8 context tokens per window (max_len - question - 3), a new window every 5 tokens:
  features = squad.windows(tokenizer, example, max_len=len(question) + 3 + 8, doc_stride=5)
  first = len(question) + 2
  spans = [[o for o in f.offsets if o is not None] for f in features]
  starts = [context[:s[0][0]].count(" ") for s in spans]
  assert starts == [0, 5, 10] and [len(s) for s in spans] == [8, 8, 8]
  # words 10..13: cut by the window of words 5..12 (-> [CLS]), whole in the window of words 10..17.
  assert [(f.start_position, f.end_position) for f in features] == [(0, 0), (0, 0), (first, first + 3)]
  assert features[2].token_type_ids.tolist() == [0] * first + [1] * 9
  with pytest.raises(ValueError, match="leave no room for context in max_len=4"):
    squad.windows(tokenizer, example, max_len=4)


def test_predictions_map_back_to_the_original_characters(tokenizer):
  context = "Café Müller's menu, naïve!"
  example = squad.Example("q", "the menu ?", context, ("Müller's",), (5,))
  (feature,) = squad.windows(tokenizer, example, max_len=64)
  span = [p for p, o in enumerate(feature.offsets) if o is not None and 5 <= o[0] < 13]
  assert (feature.start_position, feature.end_position) == (span[0], span[-1])
  start, end = np.zeros((1, 64)), np.zeros((1, 64))
  start[0, span[0]], end[0, span[-1]] = 5.0, 5.0
  end[0, span[0] - 1] = 9.0  # a higher end before the start is no answer
  predicted = squad.predictions({"q": example}, [feature], start, end)
  assert predicted == {"q": "Müller's"}
  assert metrics.squad(predicted, {"q": ["Müller's"]}) == {"exact_match": 100.0, "f1": 100.0}
  # at most max_answer_len tokens: with 2, the best valid span is a shorter one
  assert squad.predictions({"q": example}, [feature], start, end, max_answer_len=2)["q"] != "Müller's"


def reference_max_context(spans, index, position, causal=False):
  """BERT's ``_check_is_max_context``, as written in its run_squad.py (spans as (start, length)); ``causal``: the
  context left of the token only, all a causal model reads."""
  best_score, best_index = None, None
  for span_index, (start, length) in enumerate(spans):
    end = start + length - 1
    if position < start or position > end:
      continue
    score = (position - start if causal else min(position - start, end - position)) + 0.01 * length
    if best_score is None or score > best_score:
      best_score, best_index = score, span_index
  return index == best_index


def one_token_words(tokenizer, n):
  candidates = "the model sees a river near city and heads count tokens of every sentence again small red".split()
  whole = [w for w in candidates if len(tokenizer.encode(w)) == 1]
  return (whole * (n // len(whole) + 1))[:n]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("words, room, stride", [(18, 8, 5), (40, 8, 3), (23, 9, 4), (30, 16, 16)])
def test_each_context_token_is_scored_only_in_its_window_of_most_context(tokenizer, words, room, stride, causal):
  context = " ".join(one_token_words(tokenizer, words))
  example = squad.Example("q", "what ?", context, (), ())
  question = tokenizer.encode(example.question)
  features = squad.windows(tokenizer, example, max_len=len(question) + 3 + room, doc_stride=stride, causal=causal)
  first = len(question) + 2
  spans = []
  for f in features:
    offsets = [o for o in f.offsets if o is not None]
    spans.append((context[:offsets[0][0]].count(" "), len(offsets)))
  for index, (f, (start, length)) in enumerate(zip(features, spans)):
    assert f.max_context[:first] == [False] * first
    assert f.max_context[first:first + length] == [reference_max_context(spans, index, start + i, causal)
                                                   for i in range(length)]


def test_a_start_outside_its_window_of_most_context_is_not_an_answer(tokenizer):
  words = one_token_words(tokenizer, 18)
  context = " ".join(words)
  example = squad.Example("q", "what ?", context, (), ())
  question = tokenizer.encode(example.question)
  features = squad.windows(tokenizer, example, max_len=len(question) + 3 + 8, doc_stride=5)  # words 0-7, 5-12, 10-17
  first = len(question) + 2
  starts, ends = np.zeros((3, 64)), np.zeros((3, 64))
  starts[0, first + 7] = ends[0, first + 7] = 10.0  # word 7 at the right edge of window 0: most context in window 1
  starts[1, first + 6] = ends[1, first + 6] = 6.0  # word 11, in the middle of window 1: 12 < 20, > 10
  predicted = squad.predictions({"q": example}, features, starts, ends)
  assert predicted == {"q": words[11]}


def test_the_n_best_starts_are_taken_over_every_token_before_non_context_ones_are_dropped(tokenizer):
  context = "the model sees a river ."
  example = squad.Example("q", "what does the model see ?", context, ("a river",), (15,))
  (feature,) = squad.windows(tokenizer, example, max_len=64)
  first = feature.offsets.index(next(o for o in feature.offsets if o is not None))
  starts, ends = np.zeros((1, 64)), np.zeros((1, 64))
  starts[0, 1:3] = 100.0  # two question tokens hold the highest start logits
  starts[0, first + 3], ends[0, first + 4] = 5.0, 5.0
  # As BERT: with n_best=2 both top starts are question tokens, so no span is left.
  assert squad.predictions({"q": example}, [feature], starts, ends, n_best=2) == {"q": ""}
  assert squad.predictions({"q": example}, [feature], starts, ends, n_best=3) == {"q": "a river"}
  # Logits past the window's tokens (batch padding) are never candidates, whatever their value.
  starts[0, 40:] = ends[0, 40:] = 1e3
  assert squad.predictions({"q": example}, [feature], starts, ends) == {"q": "a river"}


def test_training_examples_whose_answer_is_not_at_its_start_are_skipped_as_bert_skips_them():
  context = "the model  sees a river\tnear the city ."
  at = lambda text, start: squad.Example("q", "?", context, (text,), (start,))
  assert squad.answer_at_start(at("a river", context.index("a river")))
  assert squad.answer_at_start(at("sees  a", context.index("sees")))  # the answer's words, spaces normalised
  assert squad.answer_at_start(at("iver", context.index("iver")))  # inside its word: BERT keeps it
  assert not squad.answer_at_start(at("a river", context.index("city")))  # another place
  assert not squad.answer_at_start(at("a river", len(context) + 3))
  kept, skipped = squad.training_examples([at("a river", 16), at("a river", 2), at("city", context.index("city"))])
  assert [e.answers[0] for e in kept] == ["a river", "city"] and skipped == 1
