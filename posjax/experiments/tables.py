"""Building blocks of the paper-table configs (``experiments/tupe/``, ``experiments/huang2020/``): see
:mod:`posjax.experiments.protocol` for what a table config holds."""

from __future__ import annotations

import ml_collections

GLUE_TASKS = ("mnli", "qnli", "qqp", "sst2", "cola", "mrpc", "rte", "stsb")
# The paper's column -> (evaluator name, metric) in a GLUE run's results.json: TUPE's Table 1 layout.
GLUE_COLUMNS = {"MNLI-m": ("mnli_matched", "accuracy"), "MNLI-mm": ("mnli_mismatched", "accuracy"),
                "QNLI": ("qnli", "accuracy"), "QQP": ("qqp", "accuracy"), "SST": ("sst2", "accuracy"),
                "CoLA": ("cola", "matthews"), "MRPC": ("mrpc", "accuracy"), "RTE": ("rte", "accuracy"),
                "STS": ("stsb", "pearson")}


def select(rows: dict, row: str, table: str) -> dict:
  """All ``rows``, or only ``row`` and the row whose pre-training it shares; an unknown row is an error."""
  if not row:
    return dict(rows)
  if row not in rows:
    raise ValueError(f"unknown row {row!r}; {table} has {list(rows)}")
  return {name: rows[name] for name in rows if name in (row, rows[row].get("pretrain_of"))}


def paper_row(values: tuple[float, ...], average: float | None = None) -> dict:
  """The paper's numbers in :data:`GLUE_COLUMNS` order (and its average)."""
  row = dict(zip(GLUE_COLUMNS, values, strict=True))
  if average is not None:
    row["Avg"] = average
  return row


def pretrain_options(size: str | None, local: str) -> str:
  """The pre-training config's options: ``size`` (None: the config's own) and ``,runlocal`` or nothing."""
  return (f"size={size}" if size else "") + (local if size else local.removeprefix(","))


def glue_table(name: str, rows: dict, *, size: str | None, runlocal: bool, lrs=(2e-5, 3e-5, 4e-5, 5e-5),
               seeds=(1, 2, 3, 4, 5), pretrain: str = "configs/pretrain.py", pretrain_overrides=(),
               finetune_options: str = "") -> ml_collections.ConfigDict:
  """A GLUE table: every row pre-trained with ``pretrain`` (BERT's MLM, or ``configs/electra.py``; its fields
  ``pretrain_overrides``, ``(field, value)`` pairs) and fine-tuned on the eight tasks with
  ``configs/finetune/glue.py`` (plus ``finetune_options``, e.g. ``recipe=electra``) over ``lrs`` x ``seeds``.
  ``runlocal``: tiny models on the made-up data, and a grid shrunk to 2 learning rates x 2 seeds (the
  median/best-lr protocol still applies). ``size`` None: the pre-training config's own (runlocal's tiny model)."""
  local = ",runlocal" if runlocal else ""
  extra = f",{finetune_options}" if finetune_options else ""
  config = ml_collections.ConfigDict()
  config.job = "table"
  config.name = name
  config.pretrain = dict(config=pretrain, options=pretrain_options(size, local),
                         overrides=[list(o) for o in pretrain_overrides])
  config.protocol = ""  # how the numbers are made where the paper leaves a choice (the report prints it)
  config.finetune = {task: dict(config="configs/finetune/glue.py", options=f"task={task}{extra}{local}",
                                overrides=[]) for task in GLUE_TASKS}
  config.lrs = (1e-3, 3e-4) if runlocal else tuple(lrs)
  config.seeds = (1, 2) if runlocal else tuple(seeds)
  config.columns = [[k, *v] for k, v in GLUE_COLUMNS.items()]
  config.average = "glue"
  config.rows = {}
  config.row_order = tuple(rows)
  for row, spec in rows.items():
    # Overrides are [dotted field, value] pairs (a ConfigDict key cannot hold dots).
    options = [[f"model.position_options.{k}", v] for k, v in spec.get("position_options", {}).items()]
    step = spec.get("step")
    if runlocal and step:
      step = 100  # runlocal pre-trains 200 steps: its "mid" checkpoint is step 100
    config.rows[row] = dict(options=f"position={spec['position']}", overrides=options, step=step,
                            pretrain_of=spec.get("pretrain_of", ""), paper=spec.get("paper", {}))
  return config


HUANG_METHODS = {"absolute": "absolute", "Shaw": "shaw", "Method 1": "huang_m1", "Method 2": "huang_m2",
                 "Method 3": "huang_m3", "Method 4": "huang_m4"}


def squad_table(name: str, rows: dict, *, size: str | None, runlocal: bool, max_len: int, eval_max_lens: tuple[int, ...],
                columns: dict, lrs=(3e-5,), seeds=(1,)) -> ml_collections.ConfigDict:
  """A SQuAD 1.1 table: every row pre-trained with ``configs/pretrain.py`` and fine-tuned with
  ``configs/finetune/squad.py`` at ``max_len``, evaluated at ``eval_max_lens`` (Huang et al.'s recipe: lr 3e-5,
  2 epochs, batch 48). ``runlocal``: tiny models (unless ``size`` is given), made-up data, lengths scaled to the tiny runs."""
  local = ",runlocal" if runlocal else ""
  lengths = "+".join(str(n) for n in eval_max_lens)
  config = ml_collections.ConfigDict()
  config.job = "table"
  config.name = name
  config.pretrain = dict(config="configs/pretrain.py", options=pretrain_options(size, local), overrides=[])
  config.finetune = {"squad": dict(config="configs/finetune/squad.py",
                                   options=f"max_len={max_len},eval_max_lens={lengths}{local}",
                                   overrides=[["max_len", max_len]] if runlocal else [])}
  config.lrs = (1e-3,) if runlocal else tuple(lrs)
  config.seeds = tuple(seeds)
  config.columns = [[k, *v] for k, v in columns.items()]
  config.average = ""
  config.row_order = tuple(rows)
  config.rows = {row: dict(options=f"position={spec['position']}", overrides=[], step=None, pretrain_of="",
                           paper=spec.get("paper", {})) for row, spec in rows.items()}
  return config
