"""Prepare a pre-training corpus once: tokenized, packed blocks in ArrayRecord files (the random-access format
grain reads), so training reads by index instead of tokenizing in its loop.

  python -m posjax.data.prepare --config=configs/pretrain.py:... --out=DIR [--workers=N] [--chunks=64]
      [--corpus=tfds:wikipedia/20190301.en@train --corpus='text:/data/books/*.txt' ...]

The corpus is the config's (``config.data``: TFDS or text files, the ``train`` split) or the ``--corpus`` flags'
(several corpora in one prepared directory, e.g. Wikipedia and a book corpus: training reads their blocks as one
pool, shuffled together). Each corpus is cut into ``chunks`` document shards (every ``chunks``-th document); each
shard is tokenized with the run's tokenizer and packed with its packing mode and ``max_len``
(:mod:`posjax.data.mlm`) by one of ``workers`` processes, and written to
``blocks-c<corpus>-<chunk>-of-<chunks>.array_record``: one record per block, its input ids, positions and segment
ids (``uint16`` when the vocabulary fits, else ``int32``; the attention mask is ``segment_ids > 0``). Masking is
not baked in: it is drawn when the blocks are read, so every epoch masks anew. ``metadata.json`` holds the
tokenizer's hash, packing, ``max_len``, the record layout, the corpora and the blocks and tokens of every file.

Deterministic: the files depend on the corpus, tokenizer, packing, ``max_len`` and ``chunks``, not on
``workers`` (byte-identical). Resumable: each file is written under a temporary name and renamed when complete,
with its counts beside it, so an interrupted prepare redoes only the unfinished chunks.
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import sys
from typing import Sequence

import numpy as np
import tqdm

from posjax import cli
from posjax import results as results_lib
from posjax.data import corpus, feature_cache, mlm
from posjax.data import tokenizer as tokenizer_lib
from posjax.data.tokenizer import Tokenizer

FORMAT = 2
FIELDS = ("input_ids", "positions", "segment_ids")
CORPUS_SPEC = "text:GLOB or tfds:NAME[@SPLIT]"


def file_name(chunk: int, chunks: int, corpus: int = 0) -> str:
  """The record file of one chunk of one corpus (zero-padded numbers: the files sort by corpus, then chunk)."""
  return f"blocks-c{corpus:02d}-{chunk:05d}-of-{chunks:05d}.array_record"


def corpus_config(data, spec: str = ""):
  """``data`` with its corpus replaced by ``spec`` (``text:GLOB`` or ``tfds:NAME[@SPLIT]``, the split
  defaulting to ``data.train_split``; TFDS's ``data_dir`` and ``text_key`` stay ``data``'s); no spec: ``data``."""
  if not spec:
    return data
  kind, _, rest = spec.partition(":")
  if kind == "text" and rest:
    return _with(data, source="text", train_files=rest)
  if kind == "tfds" and rest:
    name, _, split = rest.partition("@")
    return _with(data, source="tfds", tfds_name=name, train_split=split or data.train_split)
  raise ValueError(f"--corpus={spec!r}: expected {CORPUS_SPEC}")


def _with(data, **fields):
  import ml_collections

  copy = ml_collections.ConfigDict(data.to_dict())
  copy.update(fields)
  return copy


def describe(data) -> dict:
  """What ``metadata.json`` records of one corpus (its files, or its TFDS name and split), so preparing into
  the same directory from another corpus is caught."""
  if data.source == "text":
    return {"source": "text", "train_files": data.train_files}
  return {"source": data.source, "tfds_name": data.get("tfds_name", ""), "train_split": data.get("train_split", "")}


sha256 = feature_cache.file_digest


def record_dtype(vocab_size: int, max_len: int):
  """``uint16`` when every token id and position fits in it (half the disk of ``int32``), else ``int32``."""
  return np.uint16 if max(vocab_size, max_len) <= np.iinfo(np.uint16).max else np.int32


def encode_block(block: dict, dtype) -> bytes:
  """One block as a record: its ``FIELDS`` stacked (``[3, max_len]``) in ``dtype``, as raw bytes; read back by
  :func:`decode_block`."""
  return np.stack([block[k] for k in FIELDS]).astype(dtype).tobytes()


def decode_block(record: bytes, max_len: int, dtype) -> dict:
  """A record as ``input_ids``, ``positions``, ``segment_ids`` and ``attention_mask`` (``[max_len]`` int32)."""
  rows = np.frombuffer(record, dtype=dtype).reshape(len(FIELDS), max_len).astype(np.int32)
  block = dict(zip(FIELDS, rows))
  block["attention_mask"] = (block["segment_ids"] > 0).astype(np.int32)
  return block


def _prepare_chunk(job: tuple[int, int], *, corpora: list, chunks: int, max_len: int, packing: str,
                   out: str) -> dict:
  """Tokenizes, packs and writes one chunk of one corpus; returns its counts (also written beside the file)."""
  from array_record.python.array_record_module import ArrayRecordWriter  # imported here: worker processes

  corpus_index, chunk = job
  data = corpora[corpus_index]
  name = file_name(chunk, chunks, corpus_index)
  path, counts_path = os.path.join(out, name), os.path.join(out, name + ".json")
  if os.path.exists(path) and os.path.exists(counts_path):
    with open(counts_path) as f:
      return json.load(f)
  tokenizer = Tokenizer.load(data.vocab_file)
  dtype = record_dtype(tokenizer.vocab_size, max_len)
  documents = (tokenizer.encode_document(document) for document in corpus.documents(data, "train", chunk, chunks))
  blocks = tokens = 0
  writer = ArrayRecordWriter(path + ".tmp", "group_size:1")
  try:
    for block in mlm.pack_tokens(packing, documents, max_len, tokenizer):
      writer.write(encode_block(block, dtype))
      blocks += 1
      tokens += int(block["attention_mask"].sum())
  finally:
    writer.close()
  os.replace(path + ".tmp", path)
  counts = {"file": name, "corpus": corpus_index, "blocks": blocks, "tokens": tokens}
  results_lib.write_json(counts_path, counts, indent=None, sort_keys=False)
  return counts


def prepare(config, out: str, *, workers: int = 1, chunks: int = 64, corpora: Sequence[str] = (),
            progress: bool = True) -> dict:
  """Writes the prepared corpus to ``out`` (see the module docstring); returns its metadata. ``corpora``:
  specs (``text:GLOB``, ``tfds:NAME[@SPLIT]``) that replace the config's corpus."""
  data = config.data
  if data.packing not in mlm.PACKINGS:
    raise ValueError(f"unknown packing {data.packing!r}; allowed: {list(mlm.PACKINGS)}")
  if chunks < 1 or workers < 1:
    raise ValueError(f"chunks={chunks} and workers={workers} must be >= 1")
  tokenizer = Tokenizer.load(data.vocab_file)
  datas = [corpus_config(data, spec) for spec in corpora] or [data]
  for part, spec in zip(datas, corpora or [""]):
    try:
      corpus.check(part, ("train",))
    except (ValueError, FileNotFoundError) as error:
      raise type(error)(f"--corpus={spec}: {error}" if spec else str(error)) from None
  metadata = {"format": FORMAT, "tokenizer_sha256": tokenizer_lib.digest(data.vocab_file),
              "vocab_size": tokenizer.vocab_size,
              "packing": data.packing, "max_len": int(config.max_len), "chunks": chunks,
              "record": {"fields": list(FIELDS), "dtype": np.dtype(record_dtype(tokenizer.vocab_size,
                                                                                config.max_len)).name},
              "corpora": [describe(part) for part in datas]}
  path = os.path.join(out, "metadata.json")
  if os.path.exists(path):
    with open(path) as f:
      previous = json.load(f)
    previous["corpora"] = [{k: v for k, v in part.items() if k not in ("blocks", "tokens")}
                           for part in previous.get("corpora", [])]
    different = sorted(k for k in metadata if previous.get(k) != metadata[k])
    if different:
      raise ValueError(f"{out} holds a corpus prepared differently (changed: {different}); use another --out")
  os.makedirs(out, exist_ok=True)
  job = functools.partial(_prepare_chunk, corpora=datas, chunks=chunks, max_len=int(config.max_len),
                          packing=data.packing, out=out)
  jobs = [(corpus_index, chunk) for corpus_index in range(len(datas)) for chunk in range(chunks)]
  bar = tqdm.tqdm(total=len(jobs), unit="chunk", disable=not progress, file=sys.stderr)
  files = []
  if workers == 1:
    for each in jobs:
      files.append(job(each))
      bar.update(1)
  else:
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
      for counts in pool.imap(job, jobs):
        files.append(counts)
        bar.update(1)
  bar.close()
  for index, part in enumerate(metadata["corpora"]):
    part.update(blocks=sum(f["blocks"] for f in files if f["corpus"] == index),
                tokens=sum(f["tokens"] for f in files if f["corpus"] == index))
  metadata.update(files=files, blocks=sum(f["blocks"] for f in files), tokens=sum(f["tokens"] for f in files))
  results_lib.write_json(path, metadata, sort_keys=False)
  return metadata


def main(argv):
  """Prepares the corpus the flags describe (see :func:`entry`) and prints its blocks, tokens and files."""
  from absl import flags
  from ml_collections import config_flags  # noqa: F401  (the --config flag is defined in entry())

  del argv
  f = flags.FLAGS
  if not f.out:
    raise ValueError("--out is required")
  metadata = prepare(f.config, f.out, workers=f.workers, chunks=f.chunks, corpora=f.corpus)
  print(f"{metadata['blocks']} blocks, {metadata['tokens']} tokens in {len(metadata['files'])} files: {f.out}")


def entry():
  """``python -m posjax.data.prepare``: its flags, and its mistakes as one line."""
  from absl import app, flags
  from ml_collections import config_flags

  config_flags.DEFINE_config_file("config", None, "The pre-training config (its data, tokenizer, packing, max_len).",
                                  lock_config=True)
  flags.DEFINE_string("out", None, "Directory for the prepared corpus.")
  flags.DEFINE_integer("workers", 1, "Worker processes that tokenize and pack.")
  flags.DEFINE_integer("chunks", 64, "Document shards of each corpus (the files); the output depends on it.")
  flags.DEFINE_multi_string("corpus", [], f"A corpus ({CORPUS_SPEC}) instead of the config's; repeat for several.")
  app.run(lambda argv: cli.run_user_errors(main, argv))


if __name__ == "__main__":
  entry()
