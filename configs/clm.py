"""Causal language modelling: a decoder-only, BERT-sized model (``model.causal=True``) predicts each next token of the
packed corpus, with any position method in its decoder form (T5's unidirectional buckets; ``none`` is NoPE).

Options (``configs/clm.py:position=rope,size=base,runlocal``):
  position: a registry name; default ``rope``.
  size: ``tiny`` | ``base`` | ``large``; default ``base``.
  runlocal: a tiny decoder on the synthetic corpus in ``configs/data`` (about half a minute on 2 CPU cores).
  keep: more steps to keep, ``+``-joined.

Everything else is the pre-training recipe of ``configs/pretrain.py`` (the corpus, its packing, the optimizer and the
schedule, checkpoints, meshes): only the task (next-token loss over every real token, no masking), the causal mask,
the evaluators (kind ``clm``: loss, accuracy, perplexity) and, as GPT-style decoders train, no token types.
  python -m posjax.main --config=configs/clm.py:position=alibi,runlocal --workdir=/tmp/posjax_clm
"""

import ml_collections

from configs import pretrain
from posjax.config_args import parse_arg


def get_config(arg=None):
  arg = parse_arg(arg, position="rope", size="base", runlocal=False, keep="")
  config = pretrain.get_config(f"position={arg.position},size={arg.size},runlocal={arg.runlocal},keep={arg.keep}")
  config.task = "clm"
  config.model.causal = True
  config.model.type_vocab_size = 0
  config.evals = ml_collections.ConfigDict({name: {**spec.to_dict(), "kind": "clm"}
                                            for name, spec in config.evals.items()})
  return config
