"""ELECTRA pre-training (Clark, Luong, Le, Manning; ICLR 2020) with any position method in both models: the recipe
of TUPE's Table 4, which follows ELECTRA-Base.

Options (``configs/electra.py:position=tupe_r,size=base,runlocal``):
  position: a registry name, for the generator and the discriminator; default ``absolute`` (ELECTRA's).
  size: ``base`` | ``large`` | ``tiny``; default ``base``: ELECTRA-Base's or ELECTRA-Large's recipe (below);
    ``tiny``: a CPU-sized model with Base's recipe, for tests.
  runlocal: tiny models for about a minute on 2 CPU cores, on the synthetic corpus in ``configs/data`` (``size``
    named beside it keeps its models).
  keep: more steps to keep, ``+``-joined, beside ``keep_steps`` (Table 4's "mid" row is the 600k checkpoint).

Recipe (ELECTRA's Table 6, §3.1 and the official code: ``configure_pretraining.py``, ``pretrain/pretrain_helpers.py``,
``model/optimization.py``; TUPE says only that it follows ELECTRA):
  Base: the discriminator BERT-Base, the generator 1/3 of its width (256 wide, 4 heads of 64, FFN 1024, every
    layer: ``generator_layers=1.0``), lr 2e-4, batch 256 x 512, 766k steps (Table 6's; the official code's
    default and TUPE's Table 4 run 1M: ``--config.total_steps=1000000``), masking 15%.
  Large: the discriminator BERT-Large, the generator 1/4 of its width (256, 4 heads, FFN 1024), lr 2e-4, batch
    2048 x 512, 400k steps, masking 25% (at most 130 of 512 positions).
  Both: 10k warm-up multiplied onto a linear decay over the whole run (``lr_schedule="electra"``: 0.80e-4 at
  600k of 1M), Adam (0.9, 0.999, ε 1e-6) without bias correction (the official ``AdamWeightDecayOptimizer``;
  ``adam_bias_correction``), weight decay 0.01 (not on biases and LayerNorm),
  clipping 1.0, dropout 0.1; λ = 50, sampling temperature 1; of the chosen positions 85% [MASK] and 15% kept (no
  random tokens), drawn with replacement over the real tokens but [CLS], [SEP], [MASK], their number a share of
  all real tokens, [CLS] and [SEP] counted, at most ``int((rate + 0.005) * max_len)`` (79 of 512 at 15%:
  ``data.mask_selection="electra"``); ``electra.disallow_correct=False``.
Each official choice is a field with the other value beside it: ``data.mask_selection="permutation"`` (BERT's
distinct positions, counted over the maskable tokens), ``adam_bias_correction=True``, ``lr_schedule="linear"``
(decay over the steps after warm-up: 0.81e-4 at 600k), ``electra.disallow_correct=True``.
Not taken: the official examples (``build_pretraining_dataset.py``: ``[CLS] A [SEP] B [SEP]`` of one document with
token types 0 / 1, 5% of them shorter); posjax packs full sentences across documents (RoBERTa's and TUPE's packing)
with one token type, so type 1 is trained only in fine-tuning (``model.type_vocab_size=0``: none, TUPE's). The
official code clips each TPU core's gradient before summing them; posjax clips the step's. Not confirmed for TUPE's
runs: the corpus (TUPE's 16 GB, as Table 1).

  python -m posjax.main --config=configs/electra.py:position=tupe_r --workdir=$WORKDIR \\
      --config.data.source=tfds --config.data.tfds_name=wikipedia/20190301.en --config.data.vocab_file=vocab.txt
  python -m posjax.main --config=configs/electra.py:runlocal --workdir=/tmp/electra_local
"""

import ml_collections

from configs import pretrain
from posjax.config_args import named, parse_arg

# The generator's sizes per discriminator size (ELECTRA's Table 6; tiny: half the width, for tests).
GENERATORS = {"tiny": dict(hidden_size=32, num_heads=2, intermediate_size=128),
              "base": dict(hidden_size=256, num_heads=4, intermediate_size=1024),
              "large": dict(hidden_size=256, num_heads=4, intermediate_size=1024)}
# What ELECTRA-Large's recipe changes (its Table 6; configure_pretraining.py's commented Large values).
LARGE = dict(batch_size=2048, total_steps=400_000, mask_rate=0.25)


def get_config(arg=None):
  given = named(arg)
  arg = parse_arg(arg, position="absolute", size="base", runlocal=False, keep="")
  tiny = arg.runlocal and "size" not in given
  size = f",size={arg.size}" if "size" in given else ""  # unnamed: pretrain's (base; runlocal: tiny)
  config = pretrain.get_config(f"position={arg.position}{size},runlocal={arg.runlocal},keep={arg.keep}")
  config.task = "electra"
  config.learning_rate = 2e-4
  config.total_steps = 766_000  # keep_steps (configs/pretrain.py) holds 600k, Table 4's "mid" row
  config.adam_bias_correction = False
  config.lr_schedule = "electra"
  config.data.update(mask_token_rate=0.85, random_token_rate=0.0, mask_selection="electra")
  if arg.size == "large" and not tiny:
    config.update(batch_size=LARGE["batch_size"], total_steps=LARGE["total_steps"])
    config.data.mask_rate = LARGE["mask_rate"]
  config.evals = ml_collections.ConfigDict({name: {**spec.to_dict(), "kind": "electra"}
                                            for name, spec in config.evals.items()})
  # The generator: these fields replace the discriminator's (config.model); its embeddings are the
  # discriminator's, read through its own projection.
  config.generator = ml_collections.ConfigDict(
      dict(num_layers=config.model.num_layers, **GENERATORS["tiny" if tiny else arg.size]))
  config.electra = ml_collections.ConfigDict(dict(
      discriminator_weight=50.0,  # λ
      temperature=1.0,  # of the generator's samples
      tie_embeddings=True,  # one set of embeddings (word, token type, input positions, their LayerNorm)
      share_position_table=True,  # TUPE's table read by both models (TUPE does not say; each its projections)
      disallow_correct=False))
  if arg.runlocal:
    config.update(total_steps=200, learning_rate=1e-3)
  return config
