"""SQuAD 1.1 fine-tuning (Huang et al. 2020, Tables 1-3): dev exact match and F1, at one or several lengths.

Options (``configs/finetune/squad.py:lr=3e-5,seed=0,max_len=384,eval_max_lens=128+256+384+512+1024``):
  recipe: ``tupe`` (default: TUPE's optimizer with Huang et al.'s learning rate, batch and epochs) or ``electra``
    (:mod:`posjax.finetune.recipe`: ELECTRA's learning rate, layer-wise learning-rate decay, warm-up, weight decay,
    batch 32 and 2 epochs; its Large values with ``size=large``, which a run from ``init`` then names too).
  lr: peak learning rate; default the recipe's: tupe 3e-5 (Huang et al.'s), electra 1e-4 (Large 5e-5).
  seed: default 0.
  epochs: default 2 (both recipes).
  max_len: the training length; default 512 (Huang et al.; 384 is also reported).
  eval_max_lens: ``+``-separated evaluation lengths (the inductive experiment: train short, evaluate long);
    default: max_len. A length beyond a learned position table is reported ``unsupported``.
  source: ``json`` (``data.train_file`` / ``data.dev_file``: the official train-v1.1.json / dev-v1.1.json) or
    ``tfds`` (``squad/v1.1``); default json.
  size, position: the architecture of a run without ``init`` (default base, absolute).
  runlocal: a tiny model on the made-up files in ``configs/data/squad``, trained at 64 tokens and evaluated
    at 64 and 128 (unless eval_max_lens says otherwise); about 10 s on 2 CPU cores; ``lr``, ``epochs``,
    ``max_len`` and ``size`` named beside it keep their values.

Huang et al.'s recipe: batch 48, 2 epochs, doc stride 128, max query length 64, n-best 20, answers of at most 30
tokens. Writes ``results.json`` and ``predictions_<eval>@<length>.json`` (the official script's format).
  python -m posjax.main --config=configs/finetune/squad.py --workdir=$WORKDIR --config.init=$PRETRAIN \\
      --config.data.train_file=train-v1.1.json --config.data.dev_file=dev-v1.1.json
  python -m posjax.main --config=configs/finetune/squad.py:runlocal --workdir=/tmp/posjax_squad
"""

import ml_collections

from posjax.config_args import named, parse_arg
from posjax.finetune import recipe


def get_config(arg=None):
  given = named(arg)
  arg = parse_arg(arg, recipe="tupe", lr=0.0, seed=0, epochs=0.0, max_len=512, eval_max_lens="", source="json",
                  size="base", position="", runlocal=False)
  values = recipe.recipe_values(arg.recipe, task="squad", size=arg.size,
                                own=dict(learning_rate=3e-5, batch_size=48, epochs=2.0),
                                given=dict(learning_rate=arg.lr, epochs=arg.epochs))
  config = recipe.base_config(task="squad", max_len=arg.max_len, seed=arg.seed, size=arg.size, position=arg.position,
                              **values)
  config.data = ml_collections.ConfigDict(dict(
      source=arg.source, train_file="train-v1.1.json", dev_file="dev-v1.1.json", data_dir="",
      vocab_file="",  # "": the init run's (its vocab.txt or data.vocab_file)
      scratch_vocab_file="",  # the vocabulary of a run without init
      **recipe.batching_fields(), doc_stride=128, max_query_len=64, n_best=20, max_answer_len=30,
      skip_misplaced_answers=True))  # BERT's: training questions whose answer is not at answer_start are skipped
  lengths = tuple(int(n) for n in arg.eval_max_lens.split("+") if n) or ((64, 128) if arg.runlocal else ())
  config.evals = ml_collections.ConfigDict(dict(squad=dict(kind="squad", split="validation", max_lens=lengths)))
  config.evals_per_epoch = 1  # a curve at each epoch's end; Huang et al. report the last (select="last")
  if arg.runlocal and "source" not in given:  # a named source keeps its data
    config.data.update(train_file=recipe.DATA + "/squad/train-v1.1.json", dev_file=recipe.DATA + "/squad/dev-v1.1.json")
  if arg.runlocal:
    config.data.doc_stride = 32
    recipe.runlocal(config, steps=80, max_len=64, batch_size=16, given=given)
  return config
