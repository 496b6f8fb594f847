"""TUPE (Ke, He, Liu; ICLR 2021) Table 3: BERT-Large (24 layers, 1024 wide, 16 heads), GLUE dev.

Rows: BERT-Large (absolute), TUPE-Large (TUPE-R), TUPE-Large (mid) (its 300k-step checkpoint). The recipe is
Table 1's (``experiments/tupe/table1.py``) at ``size=large``.

  python -m posjax.experiments.sweep --config=experiments/tupe/table3.py --root=$ROOT --launcher=print
  python -m posjax.experiments.sweep --config=experiments/tupe/table3.py:runlocal --root=/tmp/table3   # tiny, on a CPU
"""

from posjax.experiments import tables
from posjax.config_args import parse_arg, unless_preset

P = tables.paper_row
ROWS = {
    "BERT-Large": dict(position="absolute",
                       paper=P((88.21, 88.18, 93.56, 91.66, 94.08, 58.42, 90.46, 77.63, 90.15), 85.82)),
    "TUPE-Large": dict(position="tupe_r", paper=P((88.22, 88.21, 93.55, 91.69, 94.98, 67.46, 90.06, 81.66, 90.67), 87.39)),
    "TUPE-Large (mid)": dict(position="tupe_r", step=300_000, pretrain_of="TUPE-Large",
                             paper=P((86.92, 86.80, 92.61, 91.48, 93.97, 63.88, 89.26, 75.82, 89.34), 85.56)),
}


def get_config(arg=None):
  text, arg = arg, parse_arg(arg, row="", size="large", runlocal=False)
  rows = tables.select(ROWS, arg.row, "TUPE Table 3")
  config = tables.glue_table("TUPE Table 3 (BERT-Large, GLUE dev)", rows, size=unless_preset(text, arg, "size"), runlocal=arg.runlocal)
  config.selected = tuple(rows)
  return config
