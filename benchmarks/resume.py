"""What resuming the input stream costs at block N: the streaming path (text files or TFDS, tokenized and packed in
the training process) re-reads and re-packs the N blocks a run consumed, so its restore grows with N; a prepared
corpus (``python -m posjax.data.prepare``) starts at its batch index.

  python benchmarks/resume.py [--files='/usr/share/vim/vim90/doc/*.txt'] [--length=128] [--blocks=2000,20000]

The text and vocabulary as ``benchmarks/input_pipeline.py`` (a WordPiece vocabulary trained on the files). Prints a
markdown table (record it in docs/benchmarks.md with the machine).
"""

from __future__ import annotations

import glob
import os
import sys
import tempfile
import time

import ml_collections
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import describe_device  # noqa: E402

from posjax.data import mlm, prepare, prepared, vocab  # noqa: E402
from posjax.data.corpus import documents  # noqa: E402
from posjax.data.tokenizer import Tokenizer  # noqa: E402

_FILES = flags.DEFINE_string("files", "/usr/share/vim/vim90/doc/*.txt", "Glob of English text files.")
_LENGTH = flags.DEFINE_integer("length", 128, "Sequence length.")
_BLOCKS = flags.DEFINE_list("blocks", ["2000", "20000"], "Blocks consumed before the restore.")


def timed(fn) -> float:
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


def main(argv):
  del argv
  if not glob.glob(_FILES.value):
    raise app.UsageError(f"no files match {_FILES.value}")
  work = tempfile.mkdtemp(prefix="posjax_resume_")
  vocab_file = os.path.join(work, "vocab.txt")
  vocab.write(vocab.train(_FILES.value, 30522), vocab_file)
  tokenizer = Tokenizer.load(vocab_file)
  length = _LENGTH.value
  data = ml_collections.ConfigDict(dict(source="text", train_files=_FILES.value, eval_files="", vocab_file=vocab_file,
                                        packing="full_sentence", mask_rate=0.15, whole_word_masking=False))
  out = os.path.join(work, "prepared")
  prepare.prepare(ml_collections.ConfigDict(dict(max_len=length, data=data)), out, workers=1, chunks=16,
                  progress=False)
  print(f"{describe_device()}; {_FILES.value}; L={length}; batch 1 (a restore's cost does not depend on it)\n")
  print("| path | blocks consumed | restore | per 1,000 blocks |\n|---|---|---|---|")
  for blocks in map(int, _BLOCKS.value):
    stream = mlm.MlmBatches(lambda: documents(data, "train"), tokenizer, max_len=length, batch_size=1, seed=0)
    seconds = timed(lambda: stream.restore({"blocks_consumed": blocks}))
    print(f"| streaming | {blocks:,} | {seconds:.2f} s | {1000 * seconds / blocks:.3f} s |")
  for blocks in (*map(int, _BLOCKS.value), 10**8):
    reader = prepared.PreparedBatches(out, tokenizer, vocab_file=vocab_file, max_len=length, packing="full_sentence",
                                      global_batch=1, seed=0)
    seconds = timed(lambda: reader.restore({"prepared": {"next_batch": blocks}}))
    print(f"| prepared | {blocks:,} | {seconds * 1000:.2f} ms | |")
    reader.close()


if __name__ == "__main__":
  app.run(main)
