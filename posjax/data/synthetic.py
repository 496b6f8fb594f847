"""A small synthetic English-like grammar: a corpus that needs no download, for local runs and tests.

  python -m posjax.data.synthetic --out=configs/data   # writes tiny_train.txt, tiny_eval.txt, tiny_vocab.txt

Sentences follow ``S -> NP VP``, ``NP -> Det (Adj) N (PP)``, ``VP -> V NP (Adv)``, ``PP -> P NP`` with number
agreement between subject and verb, so masked tokens are predictable from their neighbours and from
positions further away.
"""

from __future__ import annotations

import os

import numpy as np
from absl import app, flags

from posjax.data import vocab

# Where this checkout keeps the corpus written by this module (the data of ``runlocal`` configs).
BUILTIN_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                           "configs", "data")

DET = {"sg": ["the", "a", "this", "every"], "pl": ["the", "some", "these", "many"]}
ADJ = ["small", "large", "old", "new", "red", "quiet", "bright", "early", "strange", "gentle"]
NOUN = {"sg": ["model", "token", "sentence", "layer", "head", "student", "river", "city", "machine", "garden"],
        "pl": ["models", "tokens", "sentences", "layers", "heads", "students", "rivers", "cities", "machines",
               "gardens"]}
VERB = {"sg": ["sees", "follows", "reads", "builds", "moves", "finds", "likes", "counts"],
        "pl": ["see", "follow", "read", "build", "move", "find", "like", "count"]}
PREP = ["near", "behind", "under", "with", "after"]
ADV = ["quickly", "slowly", "again", "today", "twice"]


def noun_phrase(rng: np.random.Generator, depth: int = 0) -> tuple[list[str], str]:
  """``Det (Adj) N (PP)`` as words, with its number (``sg`` or ``pl``) for a verb to agree with; a PP's own
  noun phrase has no PP."""
  number = "sg" if rng.random() < 0.5 else "pl"
  words = [rng.choice(DET[number])]
  if rng.random() < 0.5:
    words.append(rng.choice(ADJ))
  words.append(rng.choice(NOUN[number]))
  if depth < 1 and rng.random() < 0.3:
    words += [rng.choice(PREP)] + noun_phrase(rng, depth + 1)[0]
  return [str(w) for w in words], number


def sentence(rng: np.random.Generator) -> str:
  """One sentence ``NP V NP (Adv) .``, the verb agreeing with the subject's number."""
  subject, number = noun_phrase(rng)
  words = subject + [str(rng.choice(VERB[number]))] + noun_phrase(rng)[0]
  if rng.random() < 0.3:
    words.append(str(rng.choice(ADV)))
  return " ".join(words) + " ."


def documents(num_documents: int, seed: int) -> list[list[str]]:
  """``num_documents`` documents of 2 to 7 sentences each; the same ``seed`` gives the same documents."""
  rng = np.random.default_rng(seed)
  return [[sentence(rng) for _ in range(int(rng.integers(2, 8)))] for _ in range(num_documents)]


def write_corpus(path: str, num_documents: int, seed: int) -> None:
  """:func:`documents` as a text corpus (:mod:`posjax.data.corpus`'s format): a sentence a line, a blank line
  between documents."""
  with open(path, "w") as f:
    f.write("\n\n".join("\n".join(doc) for doc in documents(num_documents, seed)) + "\n")


def main(argv):
  """Writes the train and eval corpora and a 256-piece WordPiece vocabulary (trained on the train corpus)
  into ``--out``."""
  del argv
  out = flags.FLAGS.out
  os.makedirs(out, exist_ok=True)
  train, evaluation = os.path.join(out, "tiny_train.txt"), os.path.join(out, "tiny_eval.txt")
  write_corpus(train, 400, seed=0)
  write_corpus(evaluation, 40, seed=1)
  vocab.write(vocab.train_wordpiece([train], 256), os.path.join(out, "tiny_vocab.txt"))


if __name__ == "__main__":
  flags.DEFINE_string("out", "configs/data", "Directory for tiny_train.txt, tiny_eval.txt, tiny_vocab.txt.")
  app.run(main)
