"""Tokenizers through Hugging Face ``tokenizers``: WordPiece (BERT, a ``vocab.txt``) or any ``tokenizers``
JSON file (TUPE's 32,768-entry BPE), with BERT's special tokens resolved whichever naming the vocabulary uses."""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np
import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers

# Each special token under its WordPiece and its RoBERTa/BPE name.
SPECIAL = {"pad": ("[PAD]", "<pad>"), "unk": ("[UNK]", "<unk>"), "cls": ("[CLS]", "<s>"), "sep": ("[SEP]", "</s>"),
           "mask": ("[MASK]", "<mask>")}
WORDPIECE_SPECIAL = [names[0] for names in SPECIAL.values()]


def wordpiece(vocab: dict[str, int] | str, lowercase: bool = True) -> tokenizers.Tokenizer:
  """A BERT WordPiece tokenizer from a ``vocab.txt`` path or a vocabulary dict."""
  model = (models.WordPiece.from_file(str(vocab), unk_token="[UNK]") if isinstance(vocab, str)
           else models.WordPiece(vocab, unk_token="[UNK]"))
  tok = tokenizers.Tokenizer(model)
  tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
  tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
  tok.decoder = decoders.WordPiece()
  return tok


def _check_unique_lines(path: str) -> None:
  """A WordPiece ``vocab.txt`` names each piece once: a piece's id is its line's index, so a repeated line (as
  ``tokenizers`` reads it: without trailing whitespace) would leave an id without a piece."""
  with open(path, encoding="utf-8") as f:
    lines = f.read().split("\n")
  if lines[-1] == "":
    lines.pop()
  first = {}
  for number, line in enumerate(lines, 1):
    piece = line.rstrip()
    if piece in first:
      raise ValueError(f"vocabulary file {path}: line {number} repeats line {first[piece]} ({piece!r}); a WordPiece "
                       "vocab.txt holds each piece once, one a line (the piece's id is its line number - 1)")
    first[piece] = number


@dataclasses.dataclass
class Tokenizer:
  """Text -> ids without special tokens, plus the ids of [CLS], [SEP], [PAD], [MASK], [UNK]."""

  backend: tokenizers.Tokenizer

  def __post_init__(self):
    vocab = self.backend.get_vocab()
    for role, names in SPECIAL.items():
      found = [vocab[n] for n in names if n in vocab]
      if not found:
        raise ValueError(f"the vocabulary has no {role} token (looked for {' or '.join(names)})")
      setattr(self, f"{role}_id", found[0])
    self.special_ids = frozenset(getattr(self, f"{role}_id") for role in SPECIAL)
    self.special_array = np.asarray(sorted(self.special_ids), np.int64)
    self._pieces = [""] * self.backend.get_vocab_size()
    for piece, index in vocab.items():
      self._pieces[index] = piece
    self._byte_level = any(p.startswith("Ġ") for p in vocab)

  @classmethod
  def load(cls, path: str) -> "Tokenizer":
    """A ``tokenizers`` JSON file, or a WordPiece ``vocab.txt`` (one piece per line, lower-cased)."""
    if not pathlib.Path(path).is_file():
      raise FileNotFoundError(f"vocabulary file {path!r} does not exist" if path else
                              "no vocabulary file given (data.vocab_file)")
    kind = "a tokenizers JSON file" if path.endswith(".json") else "a WordPiece vocab.txt (one piece per line)"
    try:
      backend = tokenizers.Tokenizer.from_file(path) if path.endswith(".json") else wordpiece(path)
    except Exception as error:  # noqa: BLE001  (tokenizers raises a bare Exception)
      raise ValueError(f"vocabulary file {path} cannot be read as {kind}: {error}") from None
    if not path.endswith(".json"):
      _check_unique_lines(path)
    try:
      return cls(backend)
    except ValueError as error:
      raise ValueError(f"vocabulary file {path}: {error}") from None

  @property
  def vocab_size(self) -> int:
    return len(self._pieces)  # tokenizers' get_vocab_size() rebuilds the vocabulary: milliseconds per call

  def encode(self, text: str) -> list[int]:
    return self.backend.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]

  def continues_word(self, token_id: int) -> bool:
    """Whether a token continues the previous one's word (for whole-word masking)."""
    piece = self._pieces[token_id]
    if self._byte_level:
      return token_id not in self.special_ids and not piece.startswith("Ġ")
    return piece.startswith("##")
