"""GLUE fine-tuning (TUPE, Ke et al. 2021, Table 1): one task, one learning rate, one seed per run.

Options (``configs/finetune/glue.py:task=rte,lr=3e-5,seed=1``):
  task: cola | sst2 | mrpc | stsb | qqp | mnli | qnli | rte | wnli; default rte.
  recipe: ``tupe`` (default) or ``electra`` (:mod:`posjax.finetune.recipe`: ELECTRA's learning rate, layer-wise
    learning-rate decay, warm-up, weight decay, epochs and Adam; its head, the [CLS] state into one dense layer
    without BERT's pooler (``classifier_input="cls"``), and its final model reported; its Large values with
    ``size=large``, which a run from ``init`` then names too).
  lr: peak learning rate; default the recipe's: tupe 2e-5 (TUPE's grid: 2, 3, 4, 5e-5, five seeds each, median over
    seeds, best lr), electra 1e-4 (Large 5e-5).
  seed: default 0.
  epochs: default the recipe's: tupe 5 for MNLI, QNLI, QQP and 10 for the rest; electra 10 for RTE, STS-B and 3 for
    the rest.
  max_len: default 512 (TUPE's).
  source: ``tfds`` (``glue/<task>``, prepared with ``tfds build``) or ``tsv`` (``data.data_dir`` = the GLUE
    download's directory, holding ``RTE/train.tsv`` ...); default tfds.
  size, position: the architecture of a run without ``init`` (default base, absolute).
  runlocal: a tiny model on the made-up TSV files in ``configs/data/glue``, about 20 s on 2 CPU cores; ``lr``,
    ``epochs``, ``max_len`` and ``size`` named beside it keep their values.

From a pre-training run (its encoder, position method and vocabulary; ``init_step`` default: its latest):
  python -m posjax.main --config=configs/finetune/glue.py:task=rte --workdir=$WORKDIR --config.init=$PRETRAIN
Local:
  python -m posjax.main --config=configs/finetune/glue.py:task=rte,runlocal --workdir=/tmp/posjax_rte
Evaluates twice an epoch and at the end (``evals_per_epoch``; ``recipe=electra``: once an epoch); ``results.json``
holds every evaluation and, as ``metrics``, the best one by the paper's metric (``select``, ``select_metric``:
TUPE's protocol; ``select=last``, ELECTRA's, reports the last), the task's dev metrics in percent, MNLI matched and
mismatched both. ``classifier_input``: ``pooler`` (BERT's and TUPE's dense -> tanh on [CLS]) or ``cls`` (the
[CLS] state itself, ELECTRA's); ``classifier_token``: which token that is, ``auto`` (default: [CLS], the first, of
an encoder; the last real token of a causal model, as Hugging Face's ``LlamaForSequenceClassification``), ``first``
(refused for a causal model, whose first token has seen only itself) or ``last``; ``regression_scale``: STS-B's
scores times this in the loss (ELECTRA: 0.2), its predictions divided by it. MNLI's evaluators are
``mnli_matched`` and ``mnli_mismatched``; the others' the task name. Batches are padded to the bucket of their
longest example (``data.batching=dynamic``; ``fixed``: to max_len; ``grouped``: sorted by length), and where a
test split is there its predictions go to ``glue_test/<Task>.tsv`` (``data.test_predictions``).

Not reproduced from fairseq: its batches also hold at most ``--max-tokens 4400`` tokens (fewer than 32 examples
once a batch's longest passes 137 tokens); posjax keeps 32 examples a batch.
"""

import ml_collections

from posjax.config_args import named, parse_arg
from posjax.finetune import glue, metrics, recipe

LONG_TASKS = ("mnli", "qnli", "qqp")  # 5 epochs in TUPE's recipe; the others 10


def get_config(arg=None):
  given = named(arg)
  arg = parse_arg(arg, task="rte", recipe="tupe", lr=0.0, seed=0, epochs=0.0, max_len=512, source="tfds", size="base",
                  position="", runlocal=False)
  task = glue.get(arg.task)
  own = dict(learning_rate=2e-5, batch_size=32, epochs=5.0 if task.name in LONG_TASKS else 10.0)
  values = recipe.recipe_values(arg.recipe, task=task.name, size=arg.size, own=own,
                                given=dict(learning_rate=arg.lr, epochs=arg.epochs))
  config = recipe.base_config(task="glue", max_len=arg.max_len, seed=arg.seed, size=arg.size, position=arg.position,
                              **values)
  config.data = ml_collections.ConfigDict(dict(
      glue_task=task.name, source=arg.source, data_dir="",
      vocab_file="",  # "": the init run's (its vocab.txt or data.vocab_file)
      scratch_vocab_file="",  # the vocabulary of a run without init
      test_predictions=True,  # where a test split is there: glue_test/<Task>.tsv of the reported evaluation
      **recipe.batching_fields()))
  names = [f"mnli_{split.removeprefix('validation_')}" if task.name == "mnli" else task.name
           for split in task.validation_splits]
  config.evals = ml_collections.ConfigDict({name: dict(kind="glue", split=split)
                                            for name, split in zip(names, task.validation_splits)})
  # TUPE's protocol: validate twice an epoch, report the best (fairseq's best checkpoint metric: accuracy, mcc for
  # CoLA, pearson for STS-B; for MNLI its first validation set, matched); ELECTRA's: the final model.
  chosen = dict(recipe.GLUE_RECIPES[arg.recipe])
  config.data.both_orders = chosen.pop("both_orders")
  config.update(chosen)
  config.classifier_token = "auto"  # the first token ([CLS]) of an encoder, the last real one of a causal model
  config.select_metric = f"{names[0]}/{metrics.PAPER_METRIC[names[0]]}" if config.select == "best" else ""
  if arg.runlocal and "source" not in given:  # a named source keeps its data
    config.data.update(source="tsv", data_dir=recipe.DATA + "/glue")
  if arg.runlocal:
    recipe.runlocal(config, steps=60, max_len=64, batch_size=16, given=given)
  return config
