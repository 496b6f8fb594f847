"""ELECTRA pre-training (Clark, Luong, Le, Manning; ICLR 2020) with any position method in both models: the recipe
of TUPE's Table 4, which follows ELECTRA-Base.

Options (``configs/electra.py:position=tupe_a,size=base,runlocal``):
  position: a registry name, for the generator and the discriminator; default ``absolute`` (ELECTRA's).
  size: ``tiny`` | ``base`` | ``large``; default ``base``. The discriminator is BERT of that size, the generator
    as ELECTRA's (its Table 6): Base 1/3 of the width (256 wide, 4 heads of 64, FFN 1024), Large 1/4 (256, 4,
    1024), every layer (``generator_layers=1.0`` in the official code).
  runlocal: tiny models for about a minute on 2 CPU cores, on the synthetic corpus in ``configs/data``.
  keep: more steps to keep, ``+``-joined, beside ``keep_steps`` (Table 4's "mid" row is the 600k checkpoint).

Recipe (ELECTRA's Table 6 and the official ``configure_pretraining.py``; TUPE says only that it follows
ELECTRA): lr 2e-4, batch 256 x 512, 10k warm-up then linear decay, Adam (0.9, 0.999, 1e-6), weight decay 0.01,
clipping 1.0, dropout 0.1; masking 15% with 85% [MASK] and 15% kept (no random tokens); λ = 50, sampling
temperature 1. ``total_steps`` is the paper's 766k for Base (the repository's default is 1M: set
``--config.total_steps=1000000``). Not confirmed for TUPE's runs: the corpus (TUPE's 16 GB, as Table 1) and the
length of their run; the "mid" row says only 600k.

  python -m posjax.main --config=configs/electra.py:position=tupe_a --workdir=$WORKDIR \\
      --config.data.source=tfds --config.data.tfds_name=wikipedia/20190301.en --config.data.vocab_file=vocab.txt
  python -m posjax.main --config=configs/electra.py:runlocal --workdir=/tmp/electra_local
"""

import ml_collections

from configs import pretrain
from posjax.config_args import parse_arg

# The generator's sizes per discriminator size (ELECTRA's Table 6; tiny: half the width, for tests).
GENERATORS = {"tiny": dict(hidden_size=32, num_heads=2, intermediate_size=128),
              "base": dict(hidden_size=256, num_heads=4, intermediate_size=1024),
              "large": dict(hidden_size=256, num_heads=4, intermediate_size=1024)}


def get_config(arg=None):
  arg = parse_arg(arg, position="absolute", size="base", runlocal=False, keep="")
  config = pretrain.get_config(f"position={arg.position},size={arg.size},runlocal={arg.runlocal},keep={arg.keep}")
  config.task = "electra"
  config.learning_rate = 2e-4
  config.total_steps = 766_000  # keep_steps (configs/pretrain.py) holds 600k, Table 4's "mid" row
  config.data.update(mask_token_rate=0.85, random_token_rate=0.0)
  config.evals = ml_collections.ConfigDict({name: {**spec.to_dict(), "kind": "electra"}
                                            for name, spec in config.evals.items()})
  # The generator: these fields replace the discriminator's (config.model); its embeddings are the
  # discriminator's, read through its own projection.
  config.generator = ml_collections.ConfigDict(
      dict(num_layers=config.model.num_layers, **GENERATORS["tiny" if arg.runlocal else arg.size]))
  config.electra = ml_collections.ConfigDict(dict(
      discriminator_weight=50.0,  # λ
      temperature=1.0,  # of the generator's samples
      tie_embeddings=True,  # one set of embeddings (word, token type, input positions, their LayerNorm)
      share_position_table=True))  # TUPE's table read by both models (TUPE does not say; each its projections)
  if arg.runlocal:
    config.update(total_steps=200, learning_rate=1e-3)
  return config
