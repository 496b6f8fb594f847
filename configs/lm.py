"""Decoder pre-training as the field does it: a Llama-family model (Pre-RMSNorm, SwiGLU, grouped-query attention,
no biases, untied LM head; :meth:`posjax.models.TransformerConfig.llama`) predicting each next token of one token stream
cut into full rows (``data.packing="stream"``), with any position method (``position=``, default ``rope``; ``none``
is NoPE).

Options (``configs/lm.py:position=rope,size=125m,runlocal``):
  position: a registry name; default ``rope``.
  size: ``tiny`` | ``125m`` | ``350m`` | ``1b`` (:data:`posjax.models.DECODER_SIZES`); default ``125m``.
  runlocal: a tiny decoder on the synthetic corpus in ``configs/data`` (about 15 s on 2 CPU cores; ``size`` named
    beside it keeps its model).
  keep: more steps to keep, ``+``-joined.
  init_from: a run to continue pre-training (a converted Hugging Face decoder, ``python -m posjax.convert
    hf-to-posjax``, or a posjax run): its architecture (``model_config.json``: every field but the kernel, dtypes,
    remat and layer layout, which stay this recipe's) and its weights (``config.init_from``); its tokenizer where it
    has one (``data.vocab_file``). ``position`` and ``size`` are then the run's.

The loss is computed ``loss_chunk`` positions at a time (default 512; 0: the whole sequence), never as ``[B, L, V]``
logits, with ``z_loss`` (default 0) for PaLM's auxiliary term (:func:`posjax.models.lm_loss.token_losses`).

The recipe (GPT-3's and Llama's, as nanoGPT, MaxText and levanter train them): AdamW (beta2 0.95, eps 1e-8, weight
decay 0.1 on the weights, not on norms or biases), gradients clipped at 1.0, linear warm-up over 2,000 steps then a
cosine decay to a tenth of the peak (3e-4) at 100,000 steps, batch 256 x 2048 tokens, bf16 compute with float32
parameters, no dropout. ``--config.data.packing=stream_documents`` keeps documents apart (segment ids); every other
field is ``configs/pretrain.py``'s (corpus, checkpoints, meshes, kernels) and can be named on the command line.

  python -m posjax.main --config=configs/lm.py:position=rope,runlocal --workdir=/tmp/posjax_lm
"""

import ml_collections

from configs import pretrain
from posjax.config_args import named, parse_arg
from posjax.models import DECODER_SIZES, TransformerConfig
from posjax.tasks import clm as clm_task
from posjax.tasks import passkey
from posjax.train import checkpoint

# A run's model fields that stay this recipe's when it continues from the run (init_from=): how it runs, not what.
RUN_CHOICES = ("attention_kernel", "kernel_platform", "dtype", "param_dtype", "remat", "scan_layers")
# The decoder preset's fields that configs/pretrain.py's model block sets otherwise (or not at all).
DECODER_FIELDS = ("causal", "norm", "norm_type", "mlp", "activation", "use_bias", "embedding_norm", "type_vocab_size",
                  "tie_embeddings", "lm_head", "dropout_rate", "attention_dropout_rate", "layer_norm_eps", "qk_norm",
                  "num_kv_heads", "head_dim", "parallel_residual", "sliding_window", "position_schedule")


def get_config(arg=None):
  given = named(arg)
  arg = parse_arg(arg, position="rope", size="125m", runlocal=False, keep="", init_from="")
  if arg.init_from and ({"position", "size"} & given):
    raise ValueError("config option init_from takes the run's architecture; position= and size= cannot go with it "
                     "(name model fields with --config.model.<field> to change one)")
  if arg.size not in DECODER_SIZES:
    raise ValueError(f"unknown size {arg.size!r}; allowed: {list(DECODER_SIZES)}")
  config = pretrain.get_config(f"position={arg.position},runlocal={arg.runlocal},keep={arg.keep}")
  config.task = "clm"
  clm_task.loss_defaults(config)  # loss_chunk, z_loss
  preset = TransformerConfig.decoder(**DECODER_SIZES[arg.size]).to_dict()
  size = DECODER_SIZES["tiny" if arg.runlocal and "size" not in given else arg.size]
  config.model.update({**{field: preset[field] for field in DECODER_FIELDS}, **size})
  config.evals = ml_collections.ConfigDict({name: {**spec.to_dict(), "kind": "clm"}
                                            for name, spec in config.evals.items()})
  config.data.packing = "stream"
  # Passkey prompts in the training batches (posjax.tasks.passkey.TrainingRows): a fraction of each batch's rows
  # (0: none); runlocal: a prompt in the tiny corpus's words.
  config.passkey_train = passkey.training_defaults(**(pretrain.PASSKEY_RUNLOCAL if arg.runlocal else {}))
  # RULER prompts with their answers in training rows (posjax.tasks.ruler_eval.TrainingRows): off
  config.ruler_train = ml_collections.ConfigDict({"fraction": 0.0, "tasks": {}, "tokens": 16})
  config.update(adam_b1=0.9, adam_b2=0.95, adam_eps=1e-8, weight_decay=0.1, grad_clip_norm=1.0, lr_schedule="cosine",
                lr_end_fraction=0.1)
  if arg.init_from:
    run = checkpoint.read_model_config(arg.init_from, "config option init_from")
    config.model.update({k: v for k, v in run.items() if k not in RUN_CHOICES})
    config.init_from = arg.init_from
    vocab = checkpoint.vocab_file_of(arg.init_from)
    if vocab:
      config.data.vocab_file = vocab
  if not arg.runlocal:
    config.update(learning_rate=3e-4, warmup_steps=2000, total_steps=100_000, batch_size=256, max_len=2048,
                  keep_steps=())
  return config
