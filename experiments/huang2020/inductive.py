"""Huang et al. (2020) §4.3, inductive length robustness: SQuAD fine-tuned at one short length and evaluated at
every length up to 512 and beyond (1024; relative methods only: a learned table cannot, and reports
``unsupported``). The paper's lengths are not confirmed: posjax trains at 128 and reports F1 at 128, 256, 384,
512 and 1024, one row per method (no paper numbers: the paper shows a curve).

  python -m posjax.experiments.sweep --config=experiments/huang2020/inductive.py --root=$ROOT --launcher=print
  python -m posjax.experiments.sweep --config=experiments/huang2020/inductive.py:runlocal --root=/tmp/inductive
  (runlocal: trained at 32 tokens, evaluated at 32, 64 and 128)
"""

from posjax.experiments import tables
from posjax.config_args import parse_arg, unless_preset


def get_config(arg=None):
  text, arg = arg, parse_arg(arg, row="", size="base", runlocal=False)
  rows = tables.select({row: dict(position=method) for row, method in tables.HUANG_METHODS.items()}, arg.row,
                       "the inductive table")
  train, lengths = (32, (32, 64, 128)) if arg.runlocal else (128, (128, 256, 384, 512, 1024))
  config = tables.squad_table("Huang et al. 2020: SQuAD 1.1 F1 by evaluation length, fine-tuned at "
                              f"{train} tokens", rows, size=unless_preset(text, arg, "size"), runlocal=arg.runlocal, max_len=train,
                              eval_max_lens=lengths, columns={f"F1@{n}": (f"squad@{n}", "f1") for n in lengths})
  config.selected = tuple(rows)
  return config
