"""GLUE examples from TSV files and TFDS, and their encoding as sentence pairs."""

import os

import pytest

from posjax.data import synthetic
from posjax.data.tokenizer import Tokenizer
from posjax.finetune import glue


@pytest.fixture(scope="module")
def tokenizer():
  return Tokenizer.load(os.path.join(synthetic.BUILTIN_DIR, "tiny_vocab.txt"))


def write(root, task_dir, name, lines):
  (root / task_dir).mkdir(parents=True, exist_ok=True)
  (root / task_dir / name).write_text("".join("\t".join(row) + "\n" for row in lines))


def test_tsv_files_as_the_glue_download_writes_them(tmp_path):
  write(tmp_path, "CoLA", "dev.tsv", [["gj04", "1", "", "The sailors rode the breeze ."],
                                     ["gj04", "0", "*", "The more we study verbs , the crazier they get get ."]])
  write(tmp_path, "MRPC", "train.tsv", [["Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"],
                                       ["1", "702876", "702977", 'He said "yes" .', "He agreed ."]])
  write(tmp_path, "STS-B", "dev.tsv", [["index", "genre", "filename", "year", "old_index", "source1", "source2",
                                       "sentence1", "sentence2", "score"],
                                      ["0", "main-captions", "MSRvid", "2012test", "0000", "none", "none",
                                       "A man plays .", "A man is playing .", "4.750"]])
  write(tmp_path, "MNLI", "dev_mismatched.tsv", [["index", "sentence1", "sentence2", "label1", "gold_label"],
                                                ["0", "A premise .", "A hypothesis .", "neutral", "contradiction"]])
  assert list(glue.examples("cola", "validation", "tsv", str(tmp_path))) == [
      (("The sailors rode the breeze .",), 1), (("The more we study verbs , the crazier they get get .",), 0)]
  assert list(glue.examples("mrpc", "train", "tsv", str(tmp_path))) == [(('He said "yes" .', "He agreed ."), 1)]
  assert list(glue.examples("stsb", "validation", "tsv", str(tmp_path))) == [
      (("A man plays .", "A man is playing ."), 4.75)]
  assert list(glue.examples("mnli", "validation_mismatched", "tsv", str(tmp_path))) == [
      (("A premise .", "A hypothesis ."), 2)]


def test_a_byte_order_mark_and_qqps_short_lines_are_read_as_the_references_read_them(tmp_path, caplog):
  # MRPC as the GLUE download script writes it: a UTF-8 byte-order mark before 'Quality'.
  (tmp_path / "MRPC").mkdir()
  (tmp_path / "MRPC" / "dev.tsv").write_bytes("\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
                                              "0\t1\t2\tA café .\tB .\n".encode("utf-8"))
  assert list(glue.examples("mrpc", "validation", "tsv", str(tmp_path))) == [(("A café .", "B ."), 0)]
  # QQP: lines with fewer than the header's 6 fields are dropped and counted; elsewhere they are errors.
  write(tmp_path, "QQP", "train.tsv", [["id", "qid1", "qid2", "question1", "question2", "is_duplicate"],
                                      ["0", "1", "2", "How ?", "Why ?", "0"], ["1", "3", "4", "What ?"],
                                      ["2", "5", "6", "Who ?", "Whom ?", "1"], ["3", "7", "8", "When ?", "1"]])
  with caplog.at_level("WARNING"):
    assert list(glue.examples("qqp", "train", "tsv", str(tmp_path))) == [(("How ?", "Why ?"), 0),
                                                                          (("Who ?", "Whom ?"), 1)]
  assert "dropped 2 line(s) with fewer than the header's 6 fields" in caplog.text
  write(tmp_path, "RTE", "dev.tsv", [["index", "sentence1", "sentence2", "label"], ["0", "a", "entailment"]])
  with pytest.raises(ValueError, match=r"RTE/dev.tsv:2: 3 tab-separated fields, need at least 4"):
    list(glue.examples("rte", "validation", "tsv", str(tmp_path)))


def test_test_files_as_the_glue_download_writes_them_and_the_servers_submission_format(tmp_path):
  write(tmp_path, "CoLA", "test.tsv", [["index", "sentence"], ["0", "Bill cried ."]])  # a header, unlike train
  write(tmp_path, "QQP", "test.tsv", [["id", "question1", "question2"], ["7", "How ?", "Why ?"]])
  write(tmp_path, "MNLI", "test_matched.tsv", [["index", "promptID", "pairID", "genre", "sentence1", "sentence2"],
                                              ["3", "1", "1a", "fiction", "A premise .", "A hypothesis ."]])
  assert list(glue.test_examples("cola", "test", "tsv", str(tmp_path))) == [("0", ("Bill cried .",))]
  assert list(glue.test_examples("qqp", "test", "tsv", str(tmp_path))) == [("7", ("How ?", "Why ?"))]
  assert list(glue.test_examples("mnli", "test_matched", "tsv", str(tmp_path))) == [
      ("3", ("A premise .", "A hypothesis ."))]
  assert glue.has_test("mnli", "validation_matched", "tsv", str(tmp_path))
  assert not glue.has_test("mnli", "validation_mismatched", "tsv", str(tmp_path))
  glue.write_submission(str(tmp_path / "MNLI-m.tsv"), "mnli", ["3", "4"], [2, 0])
  assert (tmp_path / "MNLI-m.tsv").read_text() == "index\tprediction\n3\tcontradiction\n4\tentailment\n"
  glue.write_submission(str(tmp_path / "STS-B.tsv"), "stsb", ["0"], [3.14159])
  assert (tmp_path / "STS-B.tsv").read_text() == "index\tprediction\n0\t3.142\n"
  with pytest.raises(ValueError, match=r"QQP/test.tsv: the header has no column\(s\) \['id'\]"):
    write(tmp_path, "QQP", "test.tsv", [["index", "question1", "question2"], ["7", "How ?", "Why ?"]])
    list(glue.test_examples("qqp", "test", "tsv", str(tmp_path)))


def test_bad_tsv_input_names_the_file_line_and_value(tmp_path):
  write(tmp_path, "RTE", "train.tsv", [["index", "sentence1", "sentence2", "label"], ["0", "a", "b", "entailment"],
                                      ["1", "a", "b", "maybe"]])
  with pytest.raises(ValueError, match=r"RTE/train.tsv:3: rte label 'maybe' is not one of \['entailment', "
                                       r"'not_entailment'\]"):
    list(glue.examples("rte", "train", "tsv", str(tmp_path)))
  write(tmp_path, "RTE", "dev.tsv", [["index", "sentence1", "sentence2", "label"], ["0", "a only"]])
  with pytest.raises(ValueError, match=r"RTE/dev.tsv:2: 2 tab-separated fields, need at least 4"):
    list(glue.examples("rte", "validation", "tsv", str(tmp_path)))
  write(tmp_path, "QNLI", "dev.tsv", [["index", "question", "label"]])
  with pytest.raises(ValueError, match=r"QNLI/dev.tsv: the header has no column\(s\) \['sentence'\]"):
    list(glue.examples("qnli", "validation", "tsv", str(tmp_path)))
  with pytest.raises(FileNotFoundError, match=r"GLUE sst2 train: no file .*SST-2/train.tsv"):
    list(glue.examples("sst2", "train", "tsv", str(tmp_path)))
  with pytest.raises(ValueError, match=r"unknown GLUE task 'sts'; allowed: \['cola', 'sst2'"):
    glue.examples("sts", "train", "tsv", str(tmp_path))
  with pytest.raises(ValueError, match=r"mnli has no split 'validation'; allowed: \['train', 'validation_matched', "):
    list(glue.examples("mnli", "validation", "tsv", str(tmp_path)))


@pytest.mark.parametrize("name", ["rte", "stsb", "mnli"])
def test_tfds_source(name):
  import tensorflow_datasets as tfds

  task = glue.get(name)
  split = task.validation_splits[0]
  with tfds.testing.mock_data(num_examples=5):
    found = list(glue.examples(name, split, "tfds"))
  assert len(found) == 5 and all(len(texts) == 2 and all(isinstance(t, str) for t in texts) for texts, _ in found)
  if task.labels is None:
    assert all(isinstance(label, float) for _, label in found)
  else:
    assert all(0 <= label < len(task.labels) for _, label in found)


def test_pairs_are_truncated_longest_first_and_typed(tokenizer):
  a, b = "the old model sees the small river near a city", "the heads count"
  ids_a, ids_b = tokenizer.encode(a), tokenizer.encode(b)
  assert len(ids_a) == 10 and len(ids_b) == 3
  out = glue.encode(tokenizer, [a, b], max_len=12)  # room for 9 text tokens: a loses 4, b keeps all
  real = out["attention_mask"].sum()
  expected = [tokenizer.cls_id] + ids_a[:6] + [tokenizer.sep_id] + ids_b + [tokenizer.sep_id]
  assert out["input_ids"][:real].tolist() == expected and real == 12
  assert out["token_type_ids"].tolist() == [0] * 8 + [1] * 4
  # A tie drops from the later text, as BERT's _truncate_seq_pair does.
  assert [len(p) for p in glue.truncate_longest_first([[1] * 6, [2] * 6], 9)] == [5, 4]
  single = glue.encode(tokenizer, [b], max_len=8)
  assert single["input_ids"].tolist() == [tokenizer.cls_id, *ids_b, tokenizer.sep_id] + [tokenizer.pad_id] * 3
  assert not single["token_type_ids"].any() and single["attention_mask"].sum() == 5
  with pytest.raises(ValueError, match="max_len=3 leaves no room for text beside 3 special tokens"):
    glue.encode(tokenizer, [a, b], max_len=3)
