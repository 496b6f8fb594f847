"""TUPE (Ke, He, Liu; ICLR 2021) Table 4: ELECTRA-Base with TUPE in the generator and the discriminator, GLUE dev.

Rows by the paper's names (``experiments/tupe/table4.py:row=ELECTRA-TUPE``; no ``row``: the whole table):
ELECTRA (absolute positions, ELECTRA's own), ELECTRA-TUPE, ELECTRA-TUPE (mid) (the 600k-step checkpoint of the
same run).

What the paper says, and where:
  - Table 4's Steps column: 1M for both rows, the mid row 600k of the same run. Pre-training is ``configs/electra.py``
    (ELECTRA-Base's recipe: generator 1/3 of the width, λ = 50, lr 2e-4, batch 256 x 512, 10k warm-up, keeping the
    600k checkpoint) run for 1,000,000 steps (``configs/electra.py`` keeps ELECTRA's own 766k).
  - The appendix: TUPE-R (with relative positions) is what was integrated into BERT-Large and ELECTRA-Base, so the
    ELECTRA-TUPE rows are ``tupe_r`` (``tupe=tupe_a``: the change of ELECTRA's absolute positions alone).
  - Fine-tuning: the paper names no other protocol for Table 4 than its own (§4, the appendix): every column by
    default follows Table 1's (``configs/finetune/glue.py``: the pooler head, lr {2, 3, 4, 5}e-5 x 5 seeds, the best
    of two evaluations an epoch per run, the median over seeds, the best learning rate).
Options:
  recipe: ``tupe`` (default) or ``electra``: ELECTRA's own fine-tuning for every column (Clark et al. 2020, §3.1
    and Table 7; :mod:`posjax.finetune.recipe`): its head (the [CLS] state into one dense layer, no pooler),
    layer-wise learning-rate decay 0.8, lr 1e-4, 3 epochs (10 for RTE and STS-B), warm-up 10% and the official
    schedule, Adam without bias correction on the batch's summed loss, MRPC and STS-B pairs in both orders, the
    final model of each run, the median of 10 seeds.
  tupe: ``tupe_r`` (default) or ``tupe_a``.

  python -m posjax.experiments.sweep --config=experiments/tupe/table4.py --root=$ROOT --launcher=print
  python -m posjax.experiments.sweep --config=experiments/tupe/table4.py:runlocal --root=/tmp/table4   # tiny, on a CPU
  python -m posjax.experiments.report --root=$ROOT
"""

from posjax.experiments import tables
from posjax.config_args import parse_arg, unless_preset

P = tables.paper_row
TUPE_METHODS = ("tupe_r", "tupe_a")
STEPS = 1_000_000  # Table 4's Steps column


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


ROWS = rows("tupe_r")
# ELECTRA's fine-tuning: its one learning rate per size (its Table 7), the median of 10 runs (its §3.1).
ELECTRA_LRS = {"tiny": 1e-4, "base": 1e-4, "large": 5e-5}
ELECTRA_SEEDS = tuple(range(1, 11))
PROTOCOLS = {
    "tupe": "Fine-tuning, every column: TUPE's (Table 1's) protocol: BERT's pooler head; lr {2, 3, 4, 5}e-5 x 5 "
            "seeds; per run the best of two evaluations an epoch; the median over seeds; the best learning rate.",
    "electra": "Fine-tuning, every column: ELECTRA's (its §3.1, Table 7): the [CLS] state into one dense layer; "
               "lr 1e-4 (Large 5e-5) with layer-wise decay 0.8 (0.9); per run the final model; the median of 10 "
               "seeds.",
}


def recipe(name: str, size: str) -> dict:
  if name == "tupe":
    return dict(finetune_options="")
  if name == "electra":
    return dict(finetune_options=f"recipe=electra,size={size}", lrs=(ELECTRA_LRS[size],), seeds=ELECTRA_SEEDS)
  raise ValueError(f"unknown option recipe={name!r}; allowed: {list(PROTOCOLS)}")


def get_config(arg=None):
  text, arg = arg, parse_arg(arg, row="", size="base", runlocal=False, recipe="tupe", tupe="tupe_r")
  fine_tuning = recipe(arg.recipe, arg.size)
  selected = tables.select(rows(arg.tupe), arg.row, "TUPE Table 4")
  config = tables.glue_table("TUPE Table 4 (ELECTRA-Base, GLUE dev)", selected,
                             size=unless_preset(text, arg, "size"), runlocal=arg.runlocal,
                             pretrain="configs/electra.py", pretrain_overrides=() if arg.runlocal else (
                                 ("total_steps", STEPS),), **fine_tuning)
  config.protocol = PROTOCOLS[arg.recipe]
  config.selected = (arg.row,) if arg.row else tuple(selected)
  return config
