"""Input pipeline throughput: tokens/s delivered per process by the streaming path (tokenize, pack and mask in
the training thread) and by a prepared corpus read through grain, and what preparing costs.

  python benchmarks/input_pipeline.py [--files='/usr/share/vim/vim90/doc/*.txt'] [--lengths=128,512]
      [--batch=256] [--batches=10] [--vocab=VOCAB.txt]

The text: any English text files (default: the documentation of Vim, shipped by Debian's vim-runtime package,
9.4 MB; paragraphs are documents, lines sentences). Without ``--vocab`` a 30,522-piece WordPiece vocabulary is
trained on it first. Prints a markdown table (record it in docs/benchmarks.md with the machine).
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
_VOCAB = flags.DEFINE_string("vocab", "", "A vocab.txt; default: train a 30,522-piece WordPiece on --files.")
_LENGTHS = flags.DEFINE_list("lengths", ["128", "512"], "Sequence lengths.")
_BATCH = flags.DEFINE_integer("batch", 256, "Sequences per batch.")
_BATCHES = flags.DEFINE_integer("batches", 10, "Timed batches per measurement.")


def rate(iterator, batches: int, tokens_per_batch: int) -> float:
  next(iterator)  # warm-up: readers started, first blocks read
  start = time.perf_counter()
  for _ in range(batches):
    next(iterator)
  return batches * tokens_per_batch / (time.perf_counter() - start)


def main(argv):
  del argv
  files = sorted(glob.glob(_FILES.value))
  if not files:
    raise app.UsageError(f"no files match {_FILES.value}")
  work = tempfile.mkdtemp(prefix="posjax_input_")
  vocab_file = _VOCAB.value or os.path.join(work, "vocab.txt")
  if not _VOCAB.value:
    vocab.write(vocab.train(_FILES.value, 30522), vocab_file)
  tokenizer = Tokenizer.load(vocab_file)
  size = sum(os.path.getsize(f) for f in files)
  print(f"{describe_device()}; {len(files)} files, {size / 1e6:.1f} MB ({_FILES.value}); WordPiece "
        f"{tokenizer.vocab_size} pieces; batch {_BATCH.value}, {_BATCHES.value} timed batches\n")
  print("| L | path | readers | tokens/s | note |\n|---|---|---|---|---|")
  for length in map(int, _LENGTHS.value):
    tokens = _BATCH.value * length
    data = ml_collections.ConfigDict(dict(source="text", train_files=_FILES.value, eval_files="", vocab_file=vocab_file,
                                          packing="full_sentence", mask_rate=0.15, whole_word_masking=False))
    stream = mlm.MlmBatches(lambda: documents(data, "train"), tokenizer, max_len=length, batch_size=_BATCH.value,
                            seed=0)
    print(f"| {length} | streaming | 1 (training thread) | {rate(stream, _BATCHES.value, tokens):,.0f} | |")
    config = ml_collections.ConfigDict(dict(max_len=length, data=data))
    for workers in (1, 2):
      out = os.path.join(work, f"prepared_{length}_{workers}")
      start = time.perf_counter()
      metadata = prepare.prepare(config, out, workers=workers, chunks=16, progress=False)
      seconds = time.perf_counter() - start
      print(f"| {length} | prepare | {workers} worker(s) | {metadata['tokens'] / seconds:,.0f} | "
            f"{metadata['blocks']} blocks, {seconds:.1f} s |")
    for workers in (0, 1, 2):
      reader = prepared.PreparedBatches(out, tokenizer, vocab_file=vocab_file, max_len=length,
                                        packing="full_sentence", global_batch=_BATCH.value, seed=0, workers=workers)
      readers = f"{workers} worker process(es)" if workers else "1 thread in the training process"
      print(f"| {length} | prepared | {readers} | {rate(reader, _BATCHES.value, tokens):,.0f} | |")
      reader.close()
    reader = prepared.PreparedBatches(out, tokenizer, vocab_file=vocab_file, max_len=length, packing="full_sentence",
                                      global_batch=_BATCH.value, seed=0)
    start = time.perf_counter()
    reader.restore({"prepared": {"next_batch": 10**8 // _BATCH.value}})
    restored = time.perf_counter()
    next(reader)
    first = time.perf_counter() - restored
    print(f"| {length} | restore at block 10^8 | | | {restored - start:.3f} s (then {first:.1f} s to the first "
          "batch) |")


if __name__ == "__main__":
  app.run(main)
