"""Causal language modelling: a decoder-only, BERT-sized model (``model.causal=True``) predicts each next token of the
packed corpus, with any position method in its decoder form (T5's unidirectional buckets; ``none`` is NoPE).

Options (``configs/clm.py:position=rope,size=base,runlocal``):
  position: a registry name; default ``rope``.
  size: ``tiny`` | ``base`` | ``large``; default ``base``.
  runlocal: a tiny decoder on the synthetic corpus in ``configs/data`` (about half a minute on 2 CPU cores;
    ``size`` named beside it keeps its model).
  keep: more steps to keep, ``+``-joined.
  eval_multiples: more evaluations at multiples of the training length, ``+``-joined (``eval_multiples=2+4+8``:
    evaluators ``eval_x2``, ... on rows packed to 2, 4, 8 times ``max_len``; a method with a learned table reports
    ``unsupported`` there).

Everything else is the pre-training recipe of ``configs/pretrain.py`` (the corpus, its packing, the optimizer and the
schedule, checkpoints, meshes): only the task (next-token loss over every real token, no masking), the causal mask,
the evaluators (kind ``clm``: loss, accuracy, perplexity) and, as GPT-style decoders train, no token types.
  python -m posjax.main --config=configs/clm.py:position=alibi,runlocal --workdir=/tmp/posjax_clm
"""

import ml_collections

from configs import pretrain
from posjax.config_args import named, parse_arg
from posjax.tasks import clm as clm_task
from posjax.tasks import passkey


def get_config(arg=None):
  given = named(arg)
  arg = parse_arg(arg, position="rope", size="base", runlocal=False, keep="", eval_multiples="")
  size = f",size={arg.size}" if "size" in given else ""  # unnamed: pretrain's (base; runlocal: tiny)
  config = pretrain.get_config(f"position={arg.position}{size},runlocal={arg.runlocal},keep={arg.keep}")
  config.task = "clm"
  clm_task.loss_defaults(config)  # loss_chunk, z_loss
  config.model.causal = True
  config.model.type_vocab_size = 0
  config.evals = ml_collections.ConfigDict({name: {**spec.to_dict(), "kind": "clm"}
                                            for name, spec in config.evals.items()})
  # Passkey prompts in the training batches (posjax.tasks.passkey.TrainingRows): a fraction of each batch's rows
  # (0: none); runlocal: a prompt in the tiny corpus's words.
  config.passkey_train = passkey.training_defaults(**(pretrain.PASSKEY_RUNLOCAL if arg.runlocal else {}))
  # RULER prompts with their answers in training rows (posjax.tasks.ruler_eval.TrainingRows): off
  config.ruler_train = ml_collections.ConfigDict({"fraction": 0.0, "tasks": {}, "tokens": 16})
  try:
    multiples = [int(m) for m in arg.eval_multiples.split("+")] if arg.eval_multiples else []
  except ValueError:
    raise ValueError(f"config option eval_multiples={arg.eval_multiples!r}: expected integers joined by '+', e.g. "
                     "eval_multiples=2+4+8") from None
  for multiple in multiples:
    if multiple < 1:
      raise ValueError(f"config option eval_multiples: {multiple} must be >= 1")
    config.evals[f"eval_x{multiple}"] = {**config.evals.eval.to_dict(), "length_multiple": multiple}
  return config
