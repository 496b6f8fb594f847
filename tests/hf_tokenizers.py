"""Hugging Face tokenizers in each style a decoder ships, built here with the ``tokenizers`` library on a small text
and saved by ``transformers``' own tokenizer classes (``save_pretrained``: ``tokenizer.json`` with its settings files,
as a model hub folder holds them):

- ``sentencepiece_bpe``: Llama 2 / Mistral (SentencePiece BPE with byte fallback, ``▁`` for spaces, bos added);
- ``unigram``: SentencePiece Unigram with byte fallback (T5 / Gemma-style settings: ``<bos>``, ``<eos>``, ``<pad>``,
  bos added through ``add_bos_token``);
- ``byte_level``: GPT-2 / Qwen2 (byte-level BPE, ``<|endoftext|>`` as eos and pad, no bos);
- ``byte_level_bos``: Llama 3 (byte-level BPE whose post-processor puts ``<|begin_of_text|>`` first).
"""

from __future__ import annotations

import json

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

TEXT = ["the grass is green and the sky is blue", "the sun is yellow here we go there and back again",
        "what is the pass key the pass key is 12345", "a key is hidden inside a lot of irrelevant text"] * 20
STYLES = ("sentencepiece_bpe", "unigram", "byte_level", "byte_level_bos")
BYTES = [f"<0x{i:02X}>" for i in range(256)]


def _metaspace(tok: tokenizers.Tokenizer) -> tokenizers.Tokenizer:
  tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
  tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                   decoders.Strip(" ", 1, 0)])
  return tok


def sentencepiece_bpe(size: int = 120) -> tokenizers.Tokenizer:
  """Llama 2's layout: ``<unk>``, ``<s>``, ``</s>``, the 256 byte pieces, then the learned ones."""
  trained = _metaspace(tokenizers.Tokenizer(models.BPE(unk_token="<unk>")))
  trained.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=size, limit_alphabet=40, show_progress=False))
  learned = json.loads(trained.to_str())["model"]
  vocab = {piece: i for i, piece in enumerate(["<unk>", "<s>", "</s>", *BYTES])}
  for piece in sorted(learned["vocab"], key=learned["vocab"].get):
    vocab.setdefault(piece, len(vocab))
  merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
  tok = _metaspace(tokenizers.Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True,
                                                   fuse_unk=True)))
  tok.add_special_tokens(["<unk>", "<s>", "</s>"])
  return tok


def unigram(size: int = 150) -> tokenizers.Tokenizer:
  """A SentencePiece Unigram with byte fallback: ``<pad>``, ``<eos>``, ``<bos>``, ``<unk>``, the byte pieces, the
  learned ones."""
  trained = _metaspace(tokenizers.Tokenizer(models.Unigram()))
  trained.train_from_iterator(TEXT, trainers.UnigramTrainer(vocab_size=size, unk_token="<unk>",
                                                            special_tokens=["<unk>"], show_progress=False))
  learned = json.loads(trained.to_str())["model"]["vocab"]
  specials = [(piece, 0.0) for piece in ["<pad>", "<eos>", "<bos>", "<unk>", *BYTES]]
  vocab = specials + [(piece, score) for piece, score in learned if piece not in dict(specials)]
  tok = _metaspace(tokenizers.Tokenizer(models.Unigram(vocab, unk_id=3, byte_fallback=True)))
  tok.add_special_tokens(["<pad>", "<eos>", "<bos>", "<unk>"])
  return tok


def byte_level(size: int = 400, bos: str | None = None) -> tokenizers.Tokenizer:
  """GPT-2's byte-level BPE with ``<|endoftext|>`` (and ``bos`` first in every encoding, Llama 3's, where given)."""
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  specials = ["<|endoftext|>"] if bos is None else [bos, "<|end_of_text|>"]
  tok.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=size, special_tokens=specials, show_progress=False,
                                                    initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  if bos is not None:
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, tok.token_to_id(bos))])
  return tok


def save(style: str, directory) -> None:
  """The style's tokenizer written to ``directory`` by ``transformers`` (its ``save_pretrained``)."""
  import transformers

  if style == "sentencepiece_bpe":
    hf = transformers.LlamaTokenizerFast(tokenizer_object=sentencepiece_bpe(), bos_token="<s>", eos_token="</s>",
                                         unk_token="<unk>", add_bos_token=True, add_eos_token=False)
  elif style == "unigram":
    hf = transformers.GemmaTokenizerFast(tokenizer_object=unigram(), bos_token="<bos>", eos_token="<eos>",
                                         unk_token="<unk>", pad_token="<pad>", add_bos_token=True)
  elif style == "byte_level":
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=byte_level(), eos_token="<|endoftext|>",
                                              pad_token="<|endoftext|>")
  else:
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=byte_level(bos="<|begin_of_text|>"),
                                              bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>")
  hf.save_pretrained(directory)
