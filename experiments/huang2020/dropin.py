"""Huang et al. (2020) §4.4, the "drop-in" BERT-Large: an absolute-position BERT switched to Method 4
(``huang_m4``) and pre-trained further, then fine-tuned on SQuAD 1.1 (F1 93.15 -> 93.52 in the paper).

Start from a Hugging Face checkpoint converted to a posjax run (whole-word-masking BERT-Large, uncased):
  python -m posjax.convert hf-to-posjax --from bert-large-uncased-whole-word-masking --workdir $CONVERTED
  python -m posjax.main --config=experiments/huang2020/dropin.py:init=$CONVERTED --workdir $DROPIN \\
      --config.data.tfds_name=wikipedia/20190301.en
  python -m posjax.main --config=configs/finetune/squad.py --workdir $SQUAD --config.init=$DROPIN
The warm start loads every parameter but the absolute position table (dropped) and creates the relative
tables (fresh); the log lists both. Recipe: the pre-training config's BERT recipe (the paper's steps, batch and
schedule are not given; it continues "3 epochs": set ``total_epochs=3`` with ``data.examples_per_epoch``).

Options: ``init`` (the converted run), ``size`` (default large), ``runlocal`` (a tiny model, unless ``size`` is
named, on the built-in corpus; ``init`` must then be a converted model of that tiny architecture, as the tests build).
"""

import os

from posjax.config_args import load_config, parse_arg, unless_preset


def get_config(arg=None):
  text, arg = arg, parse_arg(arg, init="", size="large", runlocal=False)
  if not arg.init:
    raise ValueError("experiments/huang2020/dropin.py needs init=DIR: a converted absolute-position BERT "
                     "(python -m posjax.convert hf-to-posjax --from HF_DIR --workdir DIR)")
  size = unless_preset(text, arg, "size")  # runlocal: the tiny model unless size= is given
  config = load_config("configs/pretrain.py:position=huang_m4" + (f",size={size}" if size else "")
                       + (",runlocal" if arg.runlocal else ""))
  config.init_from = arg.init
  if not arg.runlocal:  # runlocal keeps the built-in vocabulary, which its converted tiny model must use
    config.data.vocab_file = os.path.join(arg.init, "vocab.txt")
  return config
