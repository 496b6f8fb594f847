"""TUPE (Ke, He, Liu; ICLR 2021) Table 1: BERT-Base pre-trained 1M steps with each position method, GLUE dev.

Rows by the paper's names (``experiments/tupe/table1.py:row=TUPE-R``; no ``row``: the whole table):
BERT-A, BERT-R, BERT-A^d, TUPE-A, TUPE-R, TUPE-A (mid), TUPE-R (mid) (the 300k-step checkpoints of the same
runs), TUPE-A tie-cls, and TUPE-A per-layer (one positional correlation per layer: an ablation the paper did
not run, so it has no paper numbers).

Recipe (the paper's §4 and appendix): pre-training as ``configs/pretrain.py`` (16 GB, 1M steps, batch 256 x 512,
lr 1e-4, 10k warm-up, keeping the 300k checkpoint); fine-tuning as ``configs/finetune/glue.py`` (batch 32, 10
epochs, 5 for MNLI/QNLI/QQP, warm-up 6%), learning rates {2, 3, 4, 5}e-5 x 5 seeds, the median over seeds,
the best learning rate. Where the official code differs (no token types, fairseq's LayerNorm eps 1e-5 and
weight decay on every parameter), override the fields (``model.type_vocab_size=0``, ``model.layer_norm_eps``,
``weight_decay_exclusion=none``); the defaults are BERT's.

  python -m posjax.experiments.sweep --config=experiments/tupe/table1.py --root=$ROOT --launcher=print
  python -m posjax.experiments.sweep --config=experiments/tupe/table1.py:runlocal --root=/tmp/table1   # all of it, on a CPU
  python -m posjax.experiments.report --root=$ROOT
"""

from posjax.experiments import tables
from posjax.config_args import parse_arg, unless_preset

P = tables.paper_row
ROWS = {
    "BERT-A": dict(position="absolute", paper=P((84.93, 84.91, 91.34, 91.04, 92.88, 55.19, 88.29, 68.61, 89.43), 82.96)),
    "BERT-R": dict(position="bert_r", paper=P((85.81, 85.84, 92.16, 91.12, 92.90, 55.43, 89.26, 71.46, 88.94), 83.66)),
    "TUPE-A": dict(position="tupe_a", paper=P((86.05, 85.99, 91.92, 91.16, 93.19, 63.09, 88.37, 71.61, 88.88), 84.47)),
    "TUPE-R": dict(position="tupe_r", paper=P((86.21, 86.19, 92.17, 91.30, 93.26, 63.56, 89.89, 73.56, 89.23), 85.04)),
    "TUPE-A (mid)": dict(position="tupe_a", step=300_000, pretrain_of="TUPE-A",
                         paper=P((84.76, 84.83, 90.96, 91.00, 92.25, 62.13, 87.10, 68.79, 88.16), 83.33)),
    "TUPE-R (mid)": dict(position="tupe_r", step=300_000, pretrain_of="TUPE-R",
                         paper=P((84.86, 85.21, 91.23, 91.14, 92.41, 62.47, 87.29, 69.85, 88.63), 83.68)),
    "TUPE-A tie-cls": dict(position="tupe_a", position_options={"cls_reset": "none"},
                           paper=P((85.91, 85.73, 91.90, 91.05, 93.17, 59.46, 88.53, 69.54, 88.97), 83.81)),
    "BERT-A^d": dict(position="bert_ad", paper=P((85.26, 85.28, 91.56, 91.02, 92.70, 59.73, 88.46, 71.31, 87.47), 83.64)),
    "TUPE-A per-layer": dict(position="tupe_a", position_options={"share_across_layers": False}),
}


def get_config(arg=None):
  text, arg = arg, parse_arg(arg, row="", size="base", runlocal=False)
  rows = tables.select(ROWS, arg.row, "TUPE Table 1")
  config = tables.glue_table("TUPE Table 1 (BERT-Base, GLUE dev)", rows, size=unless_preset(text, arg, "size"), runlocal=arg.runlocal)
  config.selected = (arg.row,) if arg.row else tuple(rows)
  return config
