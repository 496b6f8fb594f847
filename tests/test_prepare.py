"""A prepared corpus: the streaming path's blocks, in ArrayRecord files, the same whatever the number of
workers, resumable, and refused when prepared differently."""

import json
import os

import numpy as np
import pytest

from posjax.data import corpus, mlm, prepare
from posjax.data.tokenizer import Tokenizer
from conftest import load_config, override


def config(**overrides):
  return override(load_config("pretrain", "runlocal"), **{"max_len": 32, **overrides})


def records(out):
  from grain.python import ArrayRecordDataSource

  metadata = json.loads((out / "metadata.json").read_text())
  dtype = np.dtype(metadata["record"]["dtype"])
  blocks = []
  for entry in metadata["files"]:
    source = ArrayRecordDataSource([str(out / entry["file"])])
    assert len(source) == entry["blocks"]
    blocks.append([prepare.decode_block(source[i], metadata["max_len"], dtype) for i in range(len(source))])
  return metadata, blocks


@pytest.mark.parametrize("packing", mlm.PACKINGS)
def test_prepared_blocks_are_the_streaming_paths_blocks(tmp_path, packing):
  cfg = config(**{"data.packing": packing})
  prepare.prepare(cfg, str(tmp_path), chunks=3, progress=False)
  metadata, files = records(tmp_path)
  tokenizer = Tokenizer.load(cfg.data.vocab_file)
  pack = mlm.pack_full_sentences if packing == "full_sentence" else mlm.pack_documents
  for chunk, blocks in enumerate(files):
    docs = (tokenizer.encode_batch(d) for d in corpus.documents(cfg.data, "train", chunk, 3))
    expected = list(pack(docs, 32, tokenizer.cls_id, tokenizer.sep_id, tokenizer.pad_id))
    assert len(blocks) == len(expected) > 0
    for got, want in zip(blocks, expected):
      for key in ("input_ids", "positions", "segment_ids", "attention_mask"):
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
  assert metadata["record"]["dtype"] == "uint16" and metadata["blocks"] == sum(map(len, files))
  assert metadata["tokens"] == sum(int(b["attention_mask"].sum()) for blocks in files for b in blocks)


def test_output_is_byte_identical_whatever_the_workers_and_resumes(tmp_path):
  prepare.prepare(config(), str(tmp_path / "one"), workers=1, chunks=4, progress=False)
  prepare.prepare(config(), str(tmp_path / "two"), workers=2, chunks=4, progress=False)
  names = sorted(os.listdir(tmp_path / "one"))
  assert names == sorted(os.listdir(tmp_path / "two")) and len([n for n in names if n.endswith(".array_record")]) == 4
  for name in names:
    assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name

  # Interrupted after three chunks: only the fourth is redone, and the result is the same.
  done = tmp_path / "one" / prepare.file_name(0, 4)
  before = done.stat().st_mtime_ns
  (tmp_path / "one" / prepare.file_name(3, 4)).unlink()
  (tmp_path / "one" / "metadata.json").unlink()
  prepare.prepare(config(), str(tmp_path / "one"), chunks=4, progress=False)
  assert done.stat().st_mtime_ns == before
  for name in names:
    assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name


def test_a_directory_prepared_differently_is_refused(tmp_path):
  prepare.prepare(config(), str(tmp_path), chunks=2, progress=False)
  with pytest.raises(ValueError, match=r"prepared differently \(changed: \['max_len'\]\)"):
    prepare.prepare(config(max_len=64), str(tmp_path), chunks=2, progress=False)
  with pytest.raises(ValueError, match=r"changed: \['chunks'\]"):
    prepare.prepare(config(), str(tmp_path), chunks=3, progress=False)
