"""Corpora, tokenizers, packing and masking."""

import functools
import itertools
import os
import re
import subprocess
import sys

import ml_collections
import numpy as np
import pytest

from posjax.data import corpus, mlm, synthetic, vocab
from posjax.data.tokenizer import Tokenizer

DATA = os.path.join(os.path.dirname(__file__), "..", "configs", "data")


@pytest.fixture(scope="module")
def tokenizer():
  return Tokenizer.load(os.path.join(DATA, "tiny_vocab.txt"))


def test_text_documents_are_separated_by_blank_lines(tmp_path):
  (tmp_path / "a.txt").write_text("one .\ntwo .\n\n\nthree .\n")
  (tmp_path / "b.txt").write_text("four .")
  assert list(corpus.text_documents(str(tmp_path / "*.txt"))) == [["one .", "two ."], ["three ."], ["four ."]]
  with pytest.raises(FileNotFoundError, match="no text files match"):
    list(corpus.text_documents(str(tmp_path / "*.md")))


def test_tfds_source_reads_documents_and_shards_them():
  import ml_collections
  import tensorflow_datasets as tfds

  config = ml_collections.ConfigDict(dict(source="tfds", tfds_name="lm1b", train_split="train", eval_split="test",
                                          data_dir=None, text_key="text"))
  with tfds.testing.mock_data(num_examples=6):
    docs = list(corpus.documents(config, "train"))
    shard0, shard1 = list(corpus.documents(config, "train", 0, 2)), list(corpus.documents(config, "train", 1, 2))
  assert len(docs) == 6 and all(isinstance(s, str) for d in docs for s in d)
  assert shard0 + shard1 != [] and sorted(map(str, shard0 + shard1)) == sorted(map(str, docs))
  assert not set(map(str, shard0)) & set(map(str, shard1))


def test_vocab_command_trains_a_wordpiece_vocabulary(tmp_path):
  out = tmp_path / "vocab.txt"
  subprocess.run([sys.executable, "-m", "posjax.data.vocab", f"--files={DATA}/tiny_train.txt", "--size=120",
                  f"--out={out}"], check=True, capture_output=True)
  tok = Tokenizer.load(str(out))
  assert 60 < tok.vocab_size <= 120 and tok.pad_id == 0
  assert tok.encode("the model sees a river .") and tok.unk_id not in tok.encode("the model sees a river .")


def test_vocab_command_trains_a_bpe_vocabulary(tmp_path):
  out = tmp_path / "bpe.json"
  subprocess.run([sys.executable, "-m", "posjax.data.vocab", f"--files={DATA}/tiny_train.txt", "--size=400",
                  "--model=bpe", f"--out={out}"], check=True, capture_output=True)
  tok = Tokenizer.load(str(out))
  assert (tok.pad_id, tok.cls_id, tok.sep_id) == (0, 2, 3) and tok.vocab_size <= 400
  ids = tok.encode("the gardens follow")
  assert len(ids) == 3 and tok.unk_id not in ids
  assert [tok.continues_word(i) for i in ids[1:]] == [False, False]  # "Ġ" marks a new word
  assert all(tok.continues_word(i) for i in tok.encode(" gardensxyz")[1:])  # pieces inside one word


def blocks(tokenizer, packing, max_len=48, n=30, num_documents=20):
  docs = (tokenizer.encode_batch(d) for d in synthetic.documents(num_documents, seed=3))
  return list(mlm.packer(packing)(docs, max_len, tokenizer.cls_id, tokenizer.sep_id, tokenizer.pad_id))[:n]


@pytest.mark.parametrize("packing", ["stream", "stream_documents"])
def test_stream_packing_cuts_one_token_stream_into_full_rows(tokenizer, packing):
  """The rows, read in order, are the documents' tokens each followed by the end-of-document token; every row but
  the stream's last is full (no [CLS], no padding); ``stream_documents`` restarts segments and positions at each
  document, ``stream`` counts 0..L-1 in one segment."""
  documents = [tokenizer.encode_batch(d) for d in synthetic.documents(6, seed=3)]
  rows = blocks(tokenizer, packing, max_len=16, n=10_000, num_documents=6)
  stream = [t for document in documents for t in [t for sentence in document for t in sentence] + [tokenizer.sep_id]]
  real = [row["attention_mask"].astype(bool) for row in rows]
  np.testing.assert_array_equal(np.concatenate([row["input_ids"][r] for row, r in zip(rows, real)]), stream)
  assert all(r.all() for r in real[:-1]) and tokenizer.cls_id not in stream
  for row, r in zip(rows, real):
    ends = np.flatnonzero(row["input_ids"][r] == tokenizer.sep_id)
    starts = [0, *(e + 1 for e in ends if e + 1 < r.sum())] if packing == "stream_documents" else [0]
    want_positions, want_segments = np.zeros(r.sum(), int), np.zeros(r.sum(), int)
    for k, start in enumerate(starts):
      stop = starts[k + 1] if k + 1 < len(starts) else r.sum()
      want_positions[start:stop], want_segments[start:stop] = np.arange(stop - start), k + 1
    np.testing.assert_array_equal(row["positions"][r], want_positions)
    np.testing.assert_array_equal(row["segment_ids"][r], want_segments)


def test_full_sentence_packing(tokenizer):
  for block in blocks(tokenizer, "full_sentence"):
    real = block["attention_mask"].astype(bool)
    assert block["input_ids"][0] == tokenizer.cls_id
    assert (block["input_ids"][real] == tokenizer.cls_id).sum() == 1  # one [CLS], at position 0
    np.testing.assert_array_equal(block["positions"][real], np.arange(real.sum()))
    assert set(block["segment_ids"][real]) == {1} and real[: real.sum()].all()


def test_document_packing_isolates_documents(tokenizer):
  for block in blocks(tokenizer, "documents"):
    real = block["attention_mask"].astype(bool)
    segments = block["segment_ids"]
    for s in set(segments[real]):
      where = np.flatnonzero(segments == s)
      assert block["input_ids"][where[0]] == tokenizer.cls_id  # each document starts with its own [CLS]
      np.testing.assert_array_equal(block["positions"][where], np.arange(len(where)))
      np.testing.assert_array_equal(where, np.arange(where[0], where[-1] + 1))


@pytest.mark.parametrize("mask_token, random_token", [(0.8, 0.1), (0.85, 0.0)])  # BERT's, ELECTRA's
def test_masking_rates(tokenizer, mask_token, random_token):
  rng = np.random.default_rng(0)
  masked = replaced = kept = candidates = 0
  for block in blocks(tokenizer, "full_sentence", n=1000, num_documents=300):
    out = mlm.mask_block(block, rng, tokenizer, max_predictions=20,
                         masking=mlm.Masking(mask_token=mask_token, random_token=random_token))
    n = int(out["masked_weights"].sum())
    pos, labels = out["masked_positions"][:n], out["masked_labels"][:n]
    np.testing.assert_array_equal(labels, block["input_ids"][pos])
    assert not set(labels) & tokenizer.special_ids
    changed = out["input_ids"] != block["input_ids"]
    assert not changed[np.setdiff1d(np.arange(48), pos)].any()  # only chosen tokens change
    masked += int((out["input_ids"][pos] == tokenizer.mask_id).sum())
    kept += int((out["input_ids"][pos] == labels).sum())
    replaced += n - int((out["input_ids"][pos] == tokenizer.mask_id).sum()) - int((out["input_ids"][pos] == labels).sum())
    candidates += sum(int(t) not in tokenizer.special_ids for t in block["input_ids"][block["attention_mask"] == 1])
  total = masked + replaced + kept
  assert abs(total / candidates - 0.15) < 0.01
  assert abs(masked / total - mask_token) < 0.03  # a random draw can equal the label: kept, not replaced
  assert abs(kept / total - (1 - mask_token - random_token)) < 0.03 and replaced <= (random_token + 0.03) * total


def test_whole_word_masking_masks_whole_words(tmp_path):
  (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "un", "##believ",
                                                  "##able", "cat", "dog", "."]) + "\n")
  tok = Tokenizer.load(str(tmp_path / "vocab.txt"))
  ids = [tok.cls_id] + tok.encode("unbelievable cat unbelievable dog unbelievable .") + [tok.sep_id]
  block = mlm._block(ids, [1] * len(ids), list(range(len(ids))), 16, tok.pad_id)
  words = {1: [1, 2, 3], 4: [4], 5: [5, 6, 7], 8: [8], 9: [9, 10, 11], 12: [12]}
  for seed in range(20):
    out = mlm.mask_block(block, np.random.default_rng(seed), tok, max_predictions=6,
                         masking=mlm.Masking(0.4, whole_word=True))
    chosen = set(out["masked_positions"][out["masked_weights"] > 0].tolist())
    assert chosen and all(set(w) <= chosen or not set(w) & chosen for w in words.values())


@pytest.mark.parametrize("packing", mlm.PACKINGS)
def test_batches_are_deterministic_and_resume_exactly(tokenizer, packing):
  make = lambda: mlm.MlmBatches(lambda: corpus.text_documents(os.path.join(DATA, "tiny_eval.txt")), tokenizer,
                                max_len=32, batch_size=4, seed=7, packing=packing)
  first = make()
  stream = [next(first) for _ in range(30)]  # more than one pass over the eval file: repeats
  resumed = make()
  [next(resumed) for _ in range(11)]
  state = resumed.state()
  restored = make()
  restored.restore(state)
  for want in stream[11:]:
    got = next(restored)
    assert all(np.array_equal(got[k], want[k]) for k in want)
  other_seed = mlm.MlmBatches(lambda: corpus.text_documents(os.path.join(DATA, "tiny_eval.txt")), tokenizer,
                              max_len=32, batch_size=4, seed=8, packing=packing)
  assert not np.array_equal(next(other_seed)["input_ids"], stream[0]["input_ids"])


def test_a_long_streaming_restore_says_what_it_costs_and_what_resumes_at_once(tokenizer, monkeypatch, caplog):
  monkeypatch.setattr(mlm, "SLOW_RESTORE_BLOCKS", 20)
  stream = mlm.MlmBatches(lambda: corpus.text_documents(os.path.join(DATA, "tiny_eval.txt")), tokenizer, max_len=32,
                          batch_size=4, seed=7)
  stream.restore({"blocks_consumed": 19})
  assert "re-reads" not in caplog.text
  stream.restore({"blocks_consumed": 20})
  assert "re-reads the 20 blocks it consumed" in caplog.text and "python -m posjax.data.prepare" in caplog.text


def test_an_unprepared_tfds_data_set_says_how_to_prepare_it(tmp_path):
  import importlib_resources  # noqa: F401  (TFDS imports it to build a data set; the install must bring it)

  with pytest.raises(FileNotFoundError, match=r"TFDS data set 'wikipedia/20190301.en' is not prepared in .*: run "
                                              r"`tfds build wikipedia/20190301.en --data_dir="):
    next(corpus.tfds_documents("wikipedia/20190301.en", "train", data_dir=str(tmp_path)))


@pytest.mark.parametrize("content, name, message", [
    (bytes(range(256)) * 4, "vocab.txt", r"vocabulary file .*vocab.txt cannot be read as a WordPiece vocab.txt"),
    (b'{"not": "a tokenizer"}', "vocab.json", r"vocabulary file .*vocab.json cannot be read as a tokenizers JSON"),
    (b"", "empty.txt", r"vocabulary file .*empty.txt: the vocabulary has no pad token"),
    (b"[PAD]\n[UNK]\nthe\n[CLS]\n[SEP]\n[MASK]\nthe \r\nriver\n", "vocab.txt",
     r"vocabulary file .*vocab.txt: line 7 repeats line 3 \('the'\); a WordPiece vocab.txt holds each piece once, "
     r"one a line \(the piece's id is its line number - 1\)$"),
])
def test_a_file_that_is_not_a_vocabulary_is_named(tmp_path, content, name, message):
  (tmp_path / name).write_bytes(content)
  with pytest.raises(ValueError, match=message):
    Tokenizer.load(str(tmp_path / name))


def test_vocab_command_refuses_what_cannot_make_a_vocabulary_in_one_line(tmp_path):
  (tmp_path / "empty.txt").write_text("")
  (tmp_path / "folder").mkdir()
  train = f"--files={DATA}/tiny_train.txt"
  for args, message in [
      ([f"--files={tmp_path / 'empty.txt'}"], r"the files matching .*empty.txt. \(1\) hold no text to learn pieces from"),
      ([f"--files={tmp_path / 'nothing*.txt'}"], f"no text files match '{tmp_path}/nothing\\*.txt' \\(--files\\)"),
      ([f"--files={tmp_path}/*"], f"--files='{tmp_path}/\\*' matches the directory {tmp_path}/folder; give a glob "
                                  f"of its text files, e.g. '{tmp_path}/folder/\\*.txt'"),
      ([train, "--size=-5"], r"--size=-5: a vocabulary holds its 5 special tokens .*; allowed: an integer above 5"),
      ([train, "--size=0"], r"--size=0: a vocabulary holds its 5 special tokens"),
      ([train, "--model=bpe"], r"--out=\S+vocab.txt: a BPE vocabulary is a tokenizers file; give --out=FILE.json")]:
    result = subprocess.run([sys.executable, "-m", "posjax.data.vocab", "--size=100", *args,
                             f"--out={tmp_path / 'vocab.txt'}"], capture_output=True, text=True)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and re.fullmatch(f"error: {message}.*", lines[0]), lines
    assert not (tmp_path / "vocab.txt").exists()


@pytest.mark.parametrize("model", ["wordpiece", "bpe"])
def test_the_vocab_command_names_the_file_that_is_not_utf8_and_its_first_bad_byte(tmp_path, model):
  (tmp_path / "a.txt").write_text("one sentence .\n")
  (tmp_path / "b.txt").write_bytes(b"another sentence .\n\nthe end \xe9t\xe9 .\n")  # Latin-1
  with pytest.raises(ValueError, match=rf"^text file {tmp_path}/b.txt \(--files\) is not UTF-8 text \(invalid "
                                       r"continuation byte at byte 28\); text files are read as UTF-8: convert it "
                                       r"first$"):
    vocab.train(str(tmp_path / "*.txt"), 100, model)


def test_vocab_command_says_when_the_corpus_caps_the_size(tmp_path):
  result = subprocess.run([sys.executable, "-m", "posjax.data.vocab", f"--files={DATA}/tiny_train.txt",
                           "--size=30522", f"--out={tmp_path / 'vocab.txt'}"], capture_output=True, text=True,
                          check=True)
  pieces = len((tmp_path / "vocab.txt").read_text().splitlines())
  assert pieces < 30522
  assert result.stdout.startswith(f"wrote {pieces:,} pieces (of the 30,522 asked: the corpus holds no more")


def test_text_files_that_cannot_be_a_corpus_are_named_before_a_run_writes_anything(tmp_path):
  (tmp_path / "good.txt").write_text("one .\n\ntwo .\n")
  (tmp_path / "blank.txt").write_text("\n  \n\n")
  (tmp_path / "folder").mkdir()
  data = lambda train: ml_collections.ConfigDict(dict(source="text", train_files=train, eval_files="",
                                                      vocab_file=str(tmp_path / "vocab.txt")))
  rule = r"a document is a run of non-blank lines, documents are separated by blank lines"
  with pytest.raises(ValueError, match=rf"text file {tmp_path}/blank.txt \(data.train_files\) holds no document: it "
                                       rf"is empty or blank lines only \({rule}\)"):
    corpus.check(data(str(tmp_path / "*.txt")), ("train",))
  with pytest.raises(IsADirectoryError, match=rf"data.train_files='{tmp_path}/folder' matches the directory "
                                              rf"{tmp_path}/folder; give a glob of its text files"):
    corpus.check(data(str(tmp_path / "folder")), ("train",))
  with pytest.raises(ValueError, match=r"blank.txt \(data.eval_files\) holds no document"):
    list(corpus.documents(ml_collections.ConfigDict(dict(source="text", eval_files=str(tmp_path / "blank.txt"))),
                          "eval"))


def test_an_eval_shard_may_be_empty_a_train_shard_may_not(tokenizer, tmp_path):
  (tmp_path / "one.txt").write_text("the model sees a river .\n")
  data = ml_collections.ConfigDict(dict(source="text", train_files=str(tmp_path / "one.txt")))
  make = functools.partial(mlm.MlmBatches, tokenizer=tokenizer, max_len=16, batch_size=2, seed=0, shard=1)
  documents = functools.partial(corpus.documents, data, "train", 1, 2)  # shard 1 of 2: no document
  assert list(make(documents, repeat=False)) == []
  empty = make(documents, repeat=False).empty()
  assert empty["input_ids"].shape == (2, 16) and not empty["masked_weights"].any()
  with pytest.raises(ValueError, match="shard 1 of the corpus produced no MLM blocks"):
    next(make(documents))


def test_a_text_file_that_turns_binary_is_named(tmp_path):
  (tmp_path / "mixed.txt").write_bytes(b"one sentence .\n\nanother .\n" + bytes([0xf0, 0x28, 0x8c, 0x28]) + b"\n")
  with pytest.raises(ValueError, match=r"text file .*mixed.txt is not UTF-8 text \(invalid continuation byte\)"):
    list(corpus.text_documents(str(tmp_path / "*.txt")))


def mask_block_loop(block, rng, tokenizer, max_predictions, mask_rate=0.15, whole_word=False, mask_token=0.8,
                    random_token=0.1):
  """BERT masking written as the explicit loop over positions (the reference for mlm.mask_block's numpy)."""
  ids = block["input_ids"].copy()
  candidates = [i for i in np.flatnonzero(block["attention_mask"]) if int(ids[i]) not in tokenizer.special_ids]
  words = []
  for i in candidates:
    if whole_word and words and words[-1][-1] == i - 1 and tokenizer.continues_word(int(ids[i])):
      words[-1].append(i)
    else:
      words.append([i])
  budget = min(max_predictions, max(1, round(len(candidates) * mask_rate))) if candidates else 0
  chosen = []
  for w in rng.permutation(len(words)):
    if len(chosen) >= budget:
      break
    if len(chosen) + len(words[w]) <= budget:
      chosen += words[w]
  chosen.sort()
  labels = ids[chosen].copy()
  action = rng.random(len(chosen))
  random_tokens = rng.integers(0, tokenizer.vocab_size, len(chosen))
  for n, i in enumerate(chosen):
    if action[n] < mask_token:
      ids[i] = tokenizer.mask_id
    elif action[n] < mask_token + random_token:
      ids[i] = random_tokens[n]
  pad = max_predictions - len(chosen)
  return {**block, "input_ids": ids, "masked_positions": np.asarray(chosen + [0] * pad, np.int32),
          "masked_labels": np.asarray(list(labels) + [0] * pad, np.int32),
          "masked_weights": np.asarray([1.0] * len(chosen) + [0.0] * pad, np.float32)}


@pytest.mark.parametrize("whole_word", [False, True])
def test_masking_equals_the_loop_reference_draw_for_draw(whole_word):
  from posjax.data import synthetic

  tokenizer = Tokenizer.load(os.path.join(synthetic.BUILTIN_DIR, "tiny_vocab.txt"))
  data = ml_collections.ConfigDict(dict(source="text", train_files=os.path.join(synthetic.BUILTIN_DIR, "tiny_train.txt")))
  docs = (tokenizer.encode_batch(d) for d in corpus.documents(data, "train"))
  blocks = list(itertools.islice(mlm.pack_full_sentences(docs, 48, tokenizer.cls_id, tokenizer.sep_id,
                                                         tokenizer.pad_id), 40))
  for k, block in enumerate(blocks):
    for rate, mask_token, random_token in ((0.15, 0.8, 0.1), (0.4, 0.8, 0.1), (0.15, 0.85, 0.0), (0.3, 0.5, 0.5)):
      got = mlm.mask_block(block, np.random.default_rng([k, 7]), tokenizer, 12,
                           mlm.Masking(rate, whole_word, mask_token, random_token))
      want = mask_block_loop(block, np.random.default_rng([k, 7]), tokenizer, 12, rate, whole_word, mask_token,
                             random_token)
      for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=f"block {k}, {key}")
