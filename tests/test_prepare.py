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
  metadata = json.loads((out / "metadata.json").read_text())
  blocks = []
  for entry in metadata["files"]:
    blocks.append(records_of(out / entry["file"], metadata))
    assert len(blocks[-1]) == entry["blocks"]
  return metadata, blocks


def records_of(path, metadata):
  from grain.python import ArrayRecordDataSource

  source = ArrayRecordDataSource([str(path)])
  dtype = np.dtype(metadata["record"]["dtype"])
  return [prepare.decode_block(source[i], metadata["max_len"], dtype) for i in range(len(source))]


@pytest.mark.parametrize("packing", mlm.PACKINGS)
def test_prepared_blocks_are_the_streaming_paths_blocks(tmp_path, packing):
  cfg = config(**{"data.packing": packing})
  prepare.prepare(cfg, str(tmp_path), chunks=3, progress=False)
  metadata, files = records(tmp_path)
  tokenizer = Tokenizer.load(cfg.data.vocab_file)
  pack = mlm.packer(packing)
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


def test_several_corpora_in_one_directory_are_read_as_one_pool(tmp_path):
  cfg = config()
  files = [cfg.data.train_files, cfg.data.eval_files]
  both = prepare.prepare(cfg, str(tmp_path / "both"), chunks=2, corpora=[f"text:{f}" for f in files], progress=False)
  alone = [prepare.prepare(cfg, str(tmp_path / f"c{i}"), chunks=2, corpora=[f"text:{f}"], progress=False)
           for i, f in enumerate(files)]
  assert [c["blocks"] for c in both["corpora"]] == [a["blocks"] for a in alone]
  assert [c["train_files"] for c in both["corpora"]] == files
  assert both["blocks"] == sum(a["blocks"] for a in alone) and both["tokens"] == sum(a["tokens"] for a in alone)
  for i in (0, 1):  # corpus 1's files are corpus 1's blocks, prepared alone
    for chunk in (0, 1):
      assert ((tmp_path / "both" / prepare.file_name(chunk, 2, i)).read_bytes() ==
              (tmp_path / f"c{i}" / prepare.file_name(chunk, 2)).read_bytes())
  again = prepare.prepare(cfg, str(tmp_path / "both"), chunks=2, corpora=[f"text:{f}" for f in files],
                          progress=False)  # complete: nothing to redo
  assert again == both
  _, parts = records(tmp_path / "both")
  everything = sorted(tuple(b["input_ids"]) for blocks in parts for b in blocks)
  assert sorted(unmasked(next(prepared_batches(tmp_path / "both", cfg, global_batch=both["blocks"])))) == everything
  with pytest.raises(ValueError, match=r"--corpus='wiki': expected text:GLOB or tfds:NAME\[@SPLIT\]"):
    prepare.prepare(cfg, str(tmp_path / "bad"), corpora=["wiki"], progress=False)
  own_vocab = tmp_path / "vocab.txt"
  own_vocab.write_text(open(cfg.data.vocab_file).read())
  with pytest.raises(FileNotFoundError, match=r"--corpus=text:/nowhere/\*.txt: no text files match"):
    prepare.prepare(config(**{"data.vocab_file": str(own_vocab)}), str(tmp_path / "bad"),
                    corpora=["text:/nowhere/*.txt"], progress=False)


def test_a_tfds_corpus_and_text_files_prepared_together(tmp_path):
  import tensorflow_datasets as tfds

  base = config()
  own = {"data.vocab_file": str(tmp_path / "vocab.txt"), "data.train_files": str(tmp_path / "train.txt")}
  for field, path in own.items():
    (tmp_path / os.path.basename(path)).write_text(open(base.data[field.split(".")[1]]).read())
  cfg = config(**own)
  with tfds.testing.mock_data(num_examples=6):
    metadata = prepare.prepare(cfg, str(tmp_path / "out"), chunks=2, progress=False,
                               corpora=["tfds:lm1b@train", f"text:{tmp_path / 'train.txt'}"])
    wiki = prepare.corpus_config(cfg.data, "tfds:lm1b@train")
    tokenizer = Tokenizer.load(cfg.data.vocab_file)
    for chunk in (0, 1):
      docs = (tokenizer.encode_batch(d) for d in corpus.documents(wiki, "train", chunk, 2))
      want = list(mlm.pack_full_sentences(docs, 32, tokenizer.cls_id, tokenizer.sep_id, tokenizer.pad_id))
      got = records_of(tmp_path / "out" / prepare.file_name(chunk, 2, corpus=0), metadata)
      assert len(got) == len(want) > 0
      for a, b in zip(got, want):
        np.testing.assert_array_equal(a["input_ids"], b["input_ids"])
  assert metadata["corpora"][0]["tfds_name"] == "lm1b" and metadata["corpora"][0]["train_split"] == "train"
  assert all(part["blocks"] > 0 for part in metadata["corpora"])


def test_a_directory_prepared_differently_is_refused(tmp_path):
  prepare.prepare(config(), str(tmp_path), chunks=2, progress=False)
  with pytest.raises(ValueError, match=r"prepared differently \(changed: \['max_len'\]\)"):
    prepare.prepare(config(max_len=64), str(tmp_path), chunks=2, progress=False)
  with pytest.raises(ValueError, match=r"changed: \['chunks'\]"):
    prepare.prepare(config(), str(tmp_path), chunks=3, progress=False)


def prepared_batches(out, cfg, global_batch=4, seed=0, workers=0):
  from posjax.data import prepared

  tokenizer = Tokenizer.load(cfg.data.vocab_file)
  return prepared.PreparedBatches(str(out), tokenizer, vocab_file=cfg.data.vocab_file, max_len=cfg.max_len,
                                  packing=cfg.data.packing, global_batch=global_batch, seed=seed, workers=workers)


def unmasked(batch):
  """The blocks before masking: masked positions get their labels back."""
  ids = batch["input_ids"].copy()
  for row in range(len(ids)):
    keep = batch["masked_weights"][row] > 0
    ids[row, batch["masked_positions"][row][keep]] = batch["masked_labels"][row][keep]
  return [tuple(r) for r in ids]


def test_reading_visits_every_block_once_per_epoch_in_a_new_order_and_restores_in_place(tmp_path):
  cfg = config()
  metadata = prepare.prepare(cfg, str(tmp_path), chunks=2, progress=False)
  _, files = records(tmp_path)
  everything = sorted(tuple(b["input_ids"]) for blocks in files for b in blocks)
  n = metadata["blocks"]
  stream = prepared_batches(tmp_path, cfg, global_batch=n)  # one batch = one epoch
  first, second = next(stream), next(stream)
  assert sorted(unmasked(first)) == everything and sorted(unmasked(second)) == everything
  assert unmasked(first) != unmasked(second)  # reshuffled
  masked = first["masked_weights"].sum() / first["attention_mask"].sum()
  assert 0.10 < masked < 0.20  # 15% of the tokens, specials excluded
  assert unmasked(next(prepared_batches(tmp_path, cfg, global_batch=n))) == unmasked(first)  # the seed decides

  small = prepared_batches(tmp_path, cfg)
  for _ in range(3):
    next(small)
  state = small.state()
  expected = [next(small) for _ in range(3)]
  # Resumed with two grain worker processes (each reads every other batch): the same batches, in order.
  resumed = prepared_batches(tmp_path, cfg, workers=2)
  resumed.restore(json.loads(json.dumps(state)))
  try:
    got = [next(resumed) for _ in range(3)]
  finally:
    resumed.close()
  for want, batch in zip(expected, got):
    for key in want:
      np.testing.assert_array_equal(batch[key], want[key], err_msg=key)


def test_processes_read_their_rows_of_the_same_global_batches(tmp_path, monkeypatch):
  import jax

  cfg = config()
  prepare.prepare(cfg, str(tmp_path), chunks=2, progress=False)
  whole = [next(prepared_batches(tmp_path, cfg, global_batch=8)) for _ in range(1)][0]
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  parts = []
  for index in (0, 1):
    monkeypatch.setattr(jax, "process_index", lambda index=index: index)
    parts.append(next(prepared_batches(tmp_path, cfg, global_batch=8)))
  for key in whole:
    np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), whole[key], err_msg=key)


def test_a_corpus_prepared_for_another_run_or_damaged_is_an_error(tmp_path):
  prepare.prepare(config(), str(tmp_path), chunks=2, progress=False)
  with pytest.raises(ValueError, match=r"was prepared for another run \(max_len: prepared 32, this run 64\)"):
    prepared_batches(tmp_path, config(max_len=64))
  (tmp_path / prepare.file_name(1, 2)).unlink()
  with pytest.raises(FileNotFoundError, match=r"corpus file .*blocks-c00-00001-of-00002.array_record is missing"):
    prepared_batches(tmp_path, config())
  damaged = tmp_path / prepare.file_name(0, 2)
  damaged.write_bytes(damaged.read_bytes()[:len(damaged.read_bytes()) // 2])
  with pytest.raises(ValueError, match=r"file .*blocks-c00-00000-of-00002.array_record holds none readable"):
    prepared_batches(tmp_path, config())
