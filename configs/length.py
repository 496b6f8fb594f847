"""Length generalisation: each position method trained at one length and evaluated at 1x-16x it. See
:mod:`posjax.experiments.length`.

Options (``configs/length.py:methods=rope+alibi+fire+kerple_log,model=clm,runlocal``):
  methods: ``+``-separated registry names; default ``rope+alibi+fire+kerple_log``.
  model: ``clm`` (a decoder, next-token perplexity; default) or ``mlm`` (an encoder, masked-token perplexity).
  size: the model's size (``tiny`` | ``base`` | ``large``; default ``base``; runlocal: tiny).
  runlocal: the tiny model on the built-in corpus (``configs/data``); trained at length 32 for 300 steps.

  python -m posjax.main --config=configs/length.py:methods=rope+alibi+fire+kerple_log,runlocal --workdir=DIR
Real runs name their corpus and recipe in ``overrides``: ``(field, value)`` pairs of the base config
(``configs/clm.py`` / ``configs/pretrain.py``, dotted), e.g. ``(("data.source", "text"), ("data.train_files",
"corpus.txt"), ...)``, as the paper tables' configs do; a local text file works as the corpus.
"""

import ml_collections

from posjax import positions
from posjax.config_args import parse_arg


def get_config(arg=None):
  arg = parse_arg(arg, methods="rope+alibi+fire+kerple_log", model="clm", size="base", runlocal=False)
  config = ml_collections.ConfigDict()
  config.job = "length"
  config.seed = 0
  config.methods = tuple(arg.methods.split("+"))
  for method in config.methods:
    positions.get(method)
  config.model = arg.model
  config.size = "tiny" if arg.runlocal else arg.size
  config.runlocal = bool(arg.runlocal)
  config.train_len = 32 if arg.runlocal else 512
  config.eval_multiples = (1, 2, 4, 8, 16)
  config.steps = 300 if arg.runlocal else 100_000
  config.batch_size = 16 if arg.runlocal else 256
  config.eval_batches = 4 if arg.runlocal else 50
  config.overrides = ()  # (dotted field of the base config, value) pairs, e.g. (("learning_rate", 3e-4),)
  return config
