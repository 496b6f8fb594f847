"""Tokenizers through Hugging Face ``tokenizers``: WordPiece (BERT, a ``vocab.txt``), a ``tokenizers`` JSON file
with BERT's / RoBERTa's special tokens (TUPE's 32,768-entry BPE), or any Hugging Face model's ``tokenizer.json``
(byte-level BPE as GPT-2's, Qwen's and Llama 3's; SentencePiece-style BPE or Unigram with byte fallback as Llama 2's,
Mistral's and Gemma's) with the special tokens its ``tokenizer_config.json`` / ``special_tokens_map.json`` name.

Each special token has a role: ``cls``, ``sep``, ``pad``, ``mask``, ``unk`` (an encoder's) and ``bos``, ``eos`` (a
decoder's); a tokenizer holds whichever its files name, and a use that needs a role it lacks says so in one line
(:meth:`Tokenizer.need`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
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


ROLES = ("cls", "sep", "pad", "mask", "unk", "bos", "eos")
# The tokenizer classes whose add_bos_token (default True) rebuilds their post-processor in Hugging Face; every other
# class (PreTrainedTokenizerFast: Llama 3's, Qwen's) encodes with its tokenizer.json's post-processor as it is
ADDS_BOS_BY_SETTING = ("LlamaTokenizer", "LlamaTokenizerFast", "CodeLlamaTokenizer", "CodeLlamaTokenizerFast",
                       "GemmaTokenizer", "GemmaTokenizerFast")
SETTINGS = ("tokenizer_config.json", "special_tokens_map.json")  # a Hugging Face tokenizer's, beside its JSON


def _content(value) -> str | None:
  """A special token in a Hugging Face settings file: a string, an ``AddedToken`` dict or null."""
  return value.get("content") if isinstance(value, dict) else value


def hf_settings(path: str) -> dict | None:
  """The special tokens (``<role>_token``) and ``add_bos_token`` / ``add_eos_token`` that the Hugging Face settings
  files beside a tokenizer JSON name (``tokenizer_config.json`` over ``special_tokens_map.json``); None where there
  are none (a tokenizer of BERT's / RoBERTa's naming)."""
  found, folder = {}, pathlib.Path(path).parent
  for name in reversed(SETTINGS):
    file = folder / name
    if not file.is_file():
      continue
    try:
      settings = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
      raise ValueError(f"tokenizer settings {file} cannot be read as JSON: {error}") from None
    if not isinstance(settings, dict):
      raise ValueError(f"tokenizer settings {file} hold a {type(settings).__name__}; expected a JSON object")
    found.update({k: settings[k] for k in (*(f"{role}_token" for role in ROLES), "add_bos_token", "add_eos_token",
                                           "tokenizer_class") if k in settings})
  return found or None


def digest(path: str) -> str:
  """The SHA-256 (hex) of a tokenizer: its file's, with its Hugging Face settings files' where it has some (they
  change its special tokens), so caches and prepared corpora follow what it encodes."""
  files = [pathlib.Path(path)]
  if path.endswith(".json"):
    files += [pathlib.Path(path).parent / name for name in SETTINGS if (pathlib.Path(path).parent / name).is_file()]
  if len(files) == 1:
    return hashlib.sha256(files[0].read_bytes()).hexdigest()
  return hashlib.sha256(b"".join(hashlib.sha256(f.read_bytes()).digest() for f in files)).hexdigest()


@dataclasses.dataclass
class Tokenizer:
  """Text -> ids without special tokens, and the ids of the special tokens by role (``<role>_id``, None where the
  tokenizer has none).

  Two namings. A tokenizer with Hugging Face settings files (``settings``: :func:`hf_settings`) has the roles they
  name and nothing else; where they name no ``cls`` / ``sep`` the ``bos`` / ``eos`` take those roles (a row's first
  token, a document's last), and ``pad_id`` is the pad token's, else the eos token's, else 0 (padding is masked:
  any id serves; Hugging Face's decoders pad with eos). A decoder's (no mask token: ``reads_text``) reads a document
  as text, its lines joined by line breaks (:meth:`encode_document`), and documents and prompts begin with the
  special ids its own encoding adds (``start_ids``: Llama's and Gemma's bos, none for GPT-2's or Qwen's), as its
  model was trained; an encoder's (BERT's, ELECTRA's) packs sentences as BERT's naming does. A tokenizer without
  settings files (a ``vocab.txt``, TUPE's BPE) has BERT's five special tokens, found under their WordPiece or
  RoBERTa names, each required; its documents start with nothing added.
  """

  backend: tokenizers.Tokenizer
  settings: dict | None = None
  path: str = "the tokenizer"

  def __post_init__(self):
    vocab = self.backend.get_vocab()
    if self.settings is None:
      for role, names in SPECIAL.items():
        found = [vocab[n] for n in names if n in vocab]
        if not found:
          raise ValueError(f"the vocabulary has no {role} token (looked for {' or '.join(names)}); a Hugging Face "
                           f"tokenizer.json reads its special tokens from the {' / '.join(SETTINGS)} beside it")
        setattr(self, f"{role}_id", found[0])
      self.bos_id = self.eos_id = None
      self.start_ids, self.reads_text = [], False
    else:
      for role in ROLES:
        piece = _content(self.settings.get(f"{role}_token"))
        if piece is not None and piece not in vocab:
          raise ValueError(f"{self.path}: its settings name {role}_token={piece!r}, which its vocabulary does not hold")
        setattr(self, f"{role}_id", None if piece is None else vocab[piece])
      self.cls_id = self.bos_id if self.cls_id is None else self.cls_id
      self.sep_id = self.eos_id if self.sep_id is None else self.sep_id
      self.pad_id = next((i for i in (self.pad_id, self.eos_id) if i is not None), 0)
      # a decoder's tokenizer (no mask token) frames text as its model reads it; an encoder's (BERT's, ELECTRA's,
      # in Hugging Face's files) packs sentences as BERT's naming does
      self.reads_text = self.mask_id is None
      by_setting = self.settings.get("tokenizer_class") in ADDS_BOS_BY_SETTING
      self.start_ids = self._first_ids(self.settings.get("add_bos_token", True) if by_setting else None
                                       ) if self.reads_text else []
    self.special_ids = frozenset(i for i in (getattr(self, f"{role}_id") for role in ROLES) if i is not None)
    if self.settings is not None:  # and every token its file marks special (chat markers, ...)
      self.special_ids |= frozenset(vocab[t.content] for t in self.backend.get_added_tokens_decoder().values()
                                    if t.special and t.content in vocab)
    self.special_array = np.asarray(sorted(self.special_ids), np.int64)
    self._pieces = [""] * self.backend.get_vocab_size()
    for piece, index in vocab.items():
      self._pieces[index] = piece
    self._byte_level = any(p.startswith("Ġ") for p in vocab)
    self._metaspace = not self._byte_level and any(p.startswith("▁") for p in vocab)

  def _first_ids(self, asked) -> list[int]:
    """The ids the tokenizer's own encoding puts before a text: its bos where ``asked`` (``add_bos_token``, for the
    classes that read it, :data:`ADDS_BOS_BY_SETTING`, as Hugging Face's Llama and Gemma tokenizers), else (``asked``
    None) what its post-processor adds before the text."""
    if asked is not None:
      return [self.bos_id] if asked and self.bos_id is not None else []
    plain = self.backend.encode("a", add_special_tokens=False).ids
    added = self.backend.encode("a", add_special_tokens=True).ids
    return list(added[:next((i for i in range(len(added) - len(plain) + 1) if added[i:i + len(plain)] == plain), 0)])

  @classmethod
  def load(cls, path: str) -> "Tokenizer":
    """A ``tokenizers`` JSON file (with the Hugging Face settings files beside it, where there are some), or a
    WordPiece ``vocab.txt`` (one piece per line, lower-cased)."""
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
      return cls(backend, hf_settings(path) if path.endswith(".json") else None, path)
    except ValueError as error:
      raise ValueError(f"vocabulary file {path}: {error}") from None

  def need(self, *roles: str, purpose: str) -> None:
    """Raises, naming the roles the tokenizer lacks, unless it has every one of ``roles`` (``purpose``: what needs
    them, for the message)."""
    missing = [role for role in roles if getattr(self, f"{role}_id") is None]
    if missing:
      raise ValueError(f"{self.path}: {purpose} needs a {' and a '.join(missing)} token, which the tokenizer does not "
                       f"name (its {' / '.join(SETTINGS)}: {', '.join(r + '_token' for r in missing)})")

  @property
  def vocab_size(self) -> int:
    return len(self._pieces)  # tokenizers' get_vocab_size() rebuilds the vocabulary: milliseconds per call

  @property
  def separator_ids(self) -> list[int]:
    """What separates the pieces of a prompt the harness writes (:mod:`posjax.tasks.passkey`): a line break's tokens
    for a tokenizer that reads text (:attr:`reads_text`; its eos would end the document), else [SEP] (its corpus
    ends sentences with it)."""
    return (self.encode("\n") or [self.sep_id]) if self.reads_text else [self.sep_id]

  def encode(self, text: str) -> list[int]:
    return self.backend.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]

  def encode_document(self, lines: list[str]) -> list[list[int]]:
    """A corpus document (its lines) as the packings take it, a list of sentences: each line its own sentence with
    BERT's naming (the packings end sentences with [SEP]); with a Hugging Face tokenizer the lines joined by line
    breaks and encoded once, one sentence (its model reads text, line breaks and all)."""
    return [self.encode("\n".join(lines))] if self.reads_text else self.encode_batch(lines)

  def continues_word(self, token_id: int) -> bool:
    """Whether a token continues the previous one's word (for whole-word masking)."""
    piece = self._pieces[token_id]
    if self._byte_level:
      return token_id not in self.special_ids and not piece.startswith("Ġ")
    if self._metaspace:
      return token_id not in self.special_ids and not piece.startswith("▁")
    return piece.startswith("##")
