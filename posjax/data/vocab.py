"""Train a WordPiece (BERT) or byte-level BPE (TUPE) vocabulary from text files.

  python -m posjax.data.vocab --files='corpus/*.txt' --size=30522 --out=vocab.txt
  python -m posjax.data.vocab --files='corpus/*.txt' --size=32768 --model=bpe --out=bpe.json

``--out`` ending in ``.json`` writes the whole ``tokenizers`` file instead of a ``vocab.txt``.
"""

from __future__ import annotations

import sys

import tokenizers
from absl import app, flags
from tokenizers import models, trainers

from posjax.data import tokenizer as tokenizer_lib
from posjax.data.files import check_utf8, text_files

def train_wordpiece(files: list[str], size: int, lowercase: bool = True) -> tokenizers.Tokenizer:
  """A BERT WordPiece vocabulary of ``size`` pieces (BERT's special tokens included) trained on ``files``;
  ``lowercase``: lower-cased and accent-stripped (uncased)."""
  if not files:
    raise ValueError("no text files to train a vocabulary on")
  tok = tokenizer_lib.wordpiece({"[UNK]": 0}, lowercase)
  tok.model = models.WordPiece(unk_token="[UNK]")
  trainer = trainers.WordPieceTrainer(vocab_size=size, special_tokens=tokenizer_lib.WORDPIECE_SPECIAL,
                                      show_progress=False)
  tok.train(files, trainer)
  return tok


def train_bpe(files: list[str], size: int) -> tokenizers.Tokenizer:
  """A byte-level BPE (RoBERTa / TUPE style) with <s>, </s>, <pad>, <mask>, <unk>."""
  if not files:
    raise ValueError("no text files to train a vocabulary on")
  tok = tokenizers.ByteLevelBPETokenizer()
  tok.train(files, vocab_size=size, special_tokens=[names[1] for names in tokenizer_lib.SPECIAL.values()],
            show_progress=False)
  return tok._tokenizer


def write(tok: tokenizers.Tokenizer, out: str) -> None:
  """Saves a vocabulary: the whole ``tokenizers`` file when ``out`` ends in ``.json``, else a ``vocab.txt`` of
  one piece a line, in id order."""
  if out.endswith(".json"):
    tok.save(out)
    return
  pieces = sorted(tok.get_vocab().items(), key=lambda item: item[1])
  with open(out, "w") as f:
    f.writelines(piece + "\n" for piece, _ in pieces)


def train(pattern: str, size: int, model: str = "wordpiece", lowercase: bool = True) -> tokenizers.Tokenizer:
  """A vocabulary of at most ``size`` pieces (fewer where the corpus holds fewer) trained on the files ``pattern``
  matches; a size that leaves no room beside the special tokens, an empty glob, a directory or a corpus with no
  text is an error."""
  special = len(tokenizer_lib.SPECIAL)
  if size <= special:
    raise ValueError(f"--size={size}: a vocabulary holds its {special} special tokens and the pieces learned beside "
                     f"them; allowed: an integer above {special} (BERT's is 30522)")
  if model not in ("wordpiece", "bpe"):
    raise ValueError(f"unknown --model={model!r}; allowed: wordpiece, bpe")
  files = text_files(pattern, "--files")
  try:
    tok = train_bpe(files, size) if model == "bpe" else train_wordpiece(files, size, lowercase)
  except Exception as error:  # tokenizers raises a bare Exception, "stream did not contain valid UTF-8", naming no file
    if "UTF-8" not in str(error):
      raise
    for path in files:
      check_utf8(path, "--files")
    raise
  if tok.get_vocab_size() <= len(tokenizer_lib.SPECIAL):
    raise ValueError(f"the files matching {pattern!r} ({len(files)}) hold no text to learn pieces from: the "
                     f"vocabulary would be the {tok.get_vocab_size()} special tokens alone")
  return tok


def main(argv):
  """``python -m posjax.data.vocab``: trains the vocabulary the flags describe and writes it; no files, or no
  text in them, is one line on stderr and exit status 2."""
  del argv
  FLAGS = flags.FLAGS
  try:
    if FLAGS.model == "bpe" and not FLAGS.out.endswith(".json"):
      raise ValueError(f"--out={FLAGS.out}: a BPE vocabulary is a tokenizers file; give --out=FILE.json")
    tok = train(FLAGS.files, FLAGS.size, FLAGS.model, FLAGS.lowercase)
  except (ValueError, OSError) as error:
    print(f"error: {error}", file=sys.stderr)
    sys.exit(2)
  write(tok, FLAGS.out)
  pieces = tok.get_vocab_size()
  capped = (f" (of the {FLAGS.size:,} asked: the corpus holds no more; a larger corpus gives more)"
            if pieces < FLAGS.size else "")
  print(f"wrote {pieces:,} pieces{capped} from the files matching {FLAGS.files!r} to {FLAGS.out}")


if __name__ == "__main__":
  flags.DEFINE_string("files", None, "Glob of text files.", required=True)
  flags.DEFINE_integer("size", 30522, "Vocabulary size.")
  flags.DEFINE_string("out", None, "Output vocab.txt (or .json).", required=True)
  flags.DEFINE_bool("lowercase", True, "Lower-case and strip accents (BERT uncased; WordPiece only).")
  flags.DEFINE_enum("model", "wordpiece", ["wordpiece", "bpe"], "WordPiece (BERT) or byte-level BPE (TUPE).")
  app.run(main)
