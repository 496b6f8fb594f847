"""Huang, Liang, Xu, Xiang (Findings of EMNLP 2020): BERT-Base pre-trained from scratch with each position
method, SQuAD 1.1 dev exact match and F1 at max length 512.

Rows by the paper's names (``experiments/huang2020/table1.py:row=Method 4``): absolute, Shaw, Method 1, Method 2,
Method 3, Method 4. Paper numbers: those of the authors' released checkpoints (Method 4 EM 83.68 / F1 90.55,
Shaw F1 89.51; absolute: Google's BERT-Base under Hugging Face's recipe, EM 81.22 / F1 88.52); Methods 1-3 have
none we could confirm. Recipe: pre-training as ``configs/pretrain.py`` (the paper does not give its steps,
batch or schedule: BERT's), SQuAD fine-tuning lr 3e-5, 2 epochs, batch 48, stride 128, one seed.

  python -m posjax.experiments.sweep --config=experiments/huang2020/table1.py --root=$ROOT --launcher=print
  python -m posjax.experiments.sweep --config=experiments/huang2020/table1.py:runlocal --root=/tmp/huang
  python -m posjax.experiments.report --root=$ROOT
"""

from posjax.experiments import tables
from posjax.config_args import parse_arg, unless_preset

PAPER = {"absolute": {"EM": 81.22, "F1": 88.52}, "Shaw": {"F1": 89.51}, "Method 4": {"EM": 83.68, "F1": 90.55}}
ROWS = {row: dict(position=method, paper=PAPER.get(row, {})) for row, method in tables.HUANG_METHODS.items()}


def get_config(arg=None):
  text, arg = arg, parse_arg(arg, row="", size="base", runlocal=False)
  rows = tables.select(ROWS, arg.row, "Huang et al.'s table")
  length = 64 if arg.runlocal else 512
  config = tables.squad_table("Huang et al. 2020: SQuAD 1.1 dev (BERT-Base from scratch)", rows,
                              size=unless_preset(text, arg, "size"), runlocal=arg.runlocal, max_len=length, eval_max_lens=(length,),
                              columns={"EM": (f"squad@{length}", "exact_match"), "F1": (f"squad@{length}", "f1")})
  config.selected = tuple(rows)
  return config
