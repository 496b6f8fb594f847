"""TUPE (Ke, He, Liu; ICLR 2021) Table 4: ELECTRA-Base with TUPE in the generator and the discriminator, GLUE dev.

Rows by the paper's names (``configs/papers/tupe/table4.py:row=ELECTRA-TUPE``; no ``row``: the whole table):
ELECTRA (absolute positions, ELECTRA's own), ELECTRA-TUPE, ELECTRA-TUPE (mid) (the 600k-step checkpoint of the
same run).

Recipe: pre-training as ``configs/electra.py`` (ELECTRA-Base: generator 1/3 of the width, λ = 50, lr 2e-4,
batch 256 x 512, 766k steps, keeping the 600k checkpoint); fine-tuning, as the paper says nothing else, TUPE's
GLUE protocol of Table 1 (``configs/finetune/glue.py``: lr {2, 3, 4, 5}e-5 x 5 seeds, the median over seeds,
the best learning rate). Options:
  recipe: ``tupe`` (default) or ``electra``: ELECTRA's own fine-tuning (layer-wise learning-rate decay 0.8, lr
    1e-4 (Large 5e-5), 3 epochs, 10 for RTE and STS-B, warm-up 10%; its grid is then the one learning rate, 5
    seeds).
  tupe: the TUPE variant of the ELECTRA-TUPE rows, ``tupe_a`` (default) or ``tupe_r``: the paper does not say
    which; TUPE-A is the change of ELECTRA's absolute positions alone.

  python -m posjax.experiments.sweep --config=configs/papers/tupe/table4.py --root=$ROOT --launcher=print
  python -m posjax.experiments.sweep --config=configs/papers/tupe/table4.py:runlocal --root=/tmp/table4   # tiny, on a CPU
  python -m posjax.experiments.report --root=$ROOT
"""

from posjax.experiments import tables
from posjax.config_args import parse_arg

P = tables.paper_row
TUPE_METHODS = ("tupe_a", "tupe_r")


def rows(tupe: str) -> dict:
  if tupe not in TUPE_METHODS:
    raise ValueError(f"unknown option tupe={tupe!r}; allowed: {list(TUPE_METHODS)}")
  return {
      "ELECTRA": dict(position="absolute",
                      paper=P((86.42, 86.14, 92.19, 91.45, 92.97, 65.92, 89.74, 73.56, 89.99), 85.38)),
      "ELECTRA-TUPE": dict(position=tupe,
                           paper=P((86.98, 87.01, 92.03, 91.75, 93.97, 66.51, 89.74, 76.53, 90.13), 86.07)),
      "ELECTRA-TUPE (mid)": dict(position=tupe, step=600_000, pretrain_of="ELECTRA-TUPE",
                                 paper=P((86.72, 86.74, 91.84, 91.72, 93.30, 66.42, 89.34, 75.64, 89.67), 85.71)),
  }


ROWS = rows("tupe_a")
# ELECTRA's fine-tuning: its one learning rate per size (its Table 7), five seeds as TUPE's protocol.
ELECTRA_LRS = {"tiny": 1e-4, "base": 1e-4, "large": 5e-5}


def recipe(name: str, size: str) -> dict:
  if name == "tupe":
    return dict(finetune_options="")
  if name == "electra":
    return dict(finetune_options=f"recipe=electra,size={size}", lrs=(ELECTRA_LRS[size],))
  raise ValueError(f"unknown option recipe={name!r}; allowed: ['tupe', 'electra']")


def get_config(arg=None):
  arg = parse_arg(arg, row="", size="base", runlocal=False, recipe="tupe", tupe="tupe_a")
  fine_tuning = recipe(arg.recipe, arg.size)
  selected = tables.select(rows(arg.tupe), arg.row, "TUPE Table 4")
  config = tables.glue_table("TUPE Table 4 (ELECTRA-Base, GLUE dev)", selected, size=arg.size, runlocal=arg.runlocal,
                             pretrain="configs/electra.py", **fine_tuning)
  config.selected = (arg.row,) if arg.row else tuple(selected)
  return config
