"""MLM pre-training of a BERT encoder with any position method: the recipe of TUPE's Table 1.

Options (``configs/pretrain.py:position=tupe_r,size=base,runlocal``):
  position: a registry name (``posjax.positions.names()``); default ``tupe_r``. ``model.position_options``
    starts as that method's defaults, so ``--config.model.position_options.cls_reset=paper`` works; choose
    the method here rather than with ``--config.model.position`` (the options would not match it).
  size: ``tiny`` | ``base`` | ``large``; default ``base``.
  runlocal: a tiny model for about 12 s on 2 CPU cores, on the synthetic corpus in ``configs/data`` (``size``
    named beside it keeps its model).
  keep: more steps to keep, ``+``-joined (``keep=100000+250000``), beside ``keep_steps`` (a table's "mid" rows).

Paper run (BERT-Base, 1M steps, batch 256 × 512, keeps 100k/300k/600k for Figure 5 and the "mid" rows):
  python -m posjax.main --config=configs/pretrain.py:position=tupe_r,size=base --workdir=$WORKDIR \\
      --config.data.source=tfds --config.data.tfds_name=wikipedia/20190301.en --config.data.vocab_file=vocab.txt
Local:
  python -m posjax.main --config=configs/pretrain.py:position=tupe_r,runlocal --workdir=/tmp/posjax_local
  (about 12 s on 2 CPU cores; measured: training loss 5.2 at step 10, eval_loss 3.76 at step 200.)
"""

import os

import ml_collections

from posjax import positions
from posjax.config_args import named, overridable, parse_arg
from posjax.models import SIZES

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
# A passkey prompt in the tiny corpus's words (configs/data/tiny_vocab.txt has no digits) that fits length 32: the
# runlocal decoders' passkey_train texts and the length harness's runlocal passkey (posjax.tasks.passkey).
PASSKEY_RUNLOCAL = {"digits": 3, "symbols": "red old new small large quiet strange early gentle bright", "intro": "",
                    "filler": "the rivers read the layers twice .", "key_line": "the token is {key} .",
                    "question": "the token is"}
# RULER's needle in a haystack in the tiny corpus's words (posjax.tasks.ruler: keys and values single tokens of it,
# its filler, a short question): the length harness's runlocal RULER rows and their positive control.
RULER_RUNLOCAL = {"type_v": "words", "filler": "the rivers read the layers twice .",
                  "template": "{context}\nthe {query}", "needle": "the {key} {value} .",
                  "words": ("red", "old", "new", "small", "large", "quiet", "strange", "early", "gentle", "bright",
                            "model", "token", "sentence", "layer", "head", "student", "river", "city", "machine",
                            "garden")}


def position_defaults(name: str) -> dict:
  """The method's options with their defaults, so ``--config.model.position_options.<option>=`` works (a None
  default too: :func:`posjax.config_args.overridable`)."""
  return overridable(positions.get(name).options())


def get_config(arg=None):
  given = named(arg)
  arg = parse_arg(arg, position="tupe_r", size="base", runlocal=False, keep="")
  if arg.size not in SIZES:
    raise ValueError(f"unknown size {arg.size!r}; allowed: {list(SIZES)}")
  config = ml_collections.ConfigDict()
  config.task = "mlm"
  config.seed = 0
  config.total_steps = 1_000_000  # or, instead, one of:
  config.total_epochs = ml_collections.config_dict.placeholder(float)  # needs data.examples_per_epoch
  config.total_examples = ml_collections.config_dict.placeholder(int)  # sequences
  config.warmup_steps = 10_000
  config.warmup_fraction = ml_collections.config_dict.placeholder(float)  # of the run's steps; replaces warmup_steps
  config.lr_schedule = "linear"  # warm-up, then decay to 0; "electra": warm-up multiplied onto a decay over the run
  config.learning_rate = 1e-4  # peak
  config.batch_size = 256  # global, sequences
  config.max_len = 512
  config.grad_accum_steps = 1
  config.adam_b1, config.adam_b2, config.adam_eps = 0.9, 0.999, 1e-6
  config.adam_bias_correction = True  # False: the released BERT / ELECTRA optimizer's Adam (no bias correction)
  config.weight_decay = 0.01
  config.weight_decay_exclusion = "bert"  # biases and LayerNorm skip decay; "none": every parameter decays (fairseq)
  config.grad_clip_norm = 1.0
  config.parallelism = "jit"  # or "pmap"
  config.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, context=1, tensor=1))
  config.log_every_steps = 100
  config.device_prefetch = 2  # batches put on the devices ahead of the step (the transfer overlaps the step)
  config.eval_every_steps = 10_000  # and at the end; 0: no evaluation
  config.evals = ml_collections.ConfigDict(dict(eval=dict(kind="mlm", split="eval", batches=50)))
  config.checkpoint_every_steps = 10_000
  config.keep_checkpoints = 3
  config.keep_steps = (100_000, 300_000, 600_000)
  config.init_from = ""  # another run's checkpoint directory: warm start (weights only)
  config.allow_config_change = False
  config.tensorboard = True
  config.progress = True  # the progress bar and the status lines
  config.profile_start_step = -1
  config.profile_steps = 5
  config.cpu_collectives = ""  # "gloo" for multi-process CPU runs
  # Multi-process runs: a process that sends no heartbeat for this long counts as lost, and every process stops
  # with one line (posjax.train.peers; JAX's own abort comes 30 s later); a finished process waits this long for
  # the others at exit (JAX's shutdown barrier, its default).
  config.peer_timeout_seconds = 60
  config.shutdown_timeout_seconds = 300

  config.model = ml_collections.ConfigDict(dict(
      vocab_size=0,  # 0: the tokenizer's
      max_len=0,  # 0: config.max_len
      position=arg.position, position_options=position_defaults(arg.position), attention_kernel="auto",
      kernel_platform="",  # the fused kernels' device; --target (ahead-of-time compilation) sets it
      dtype="bfloat16", param_dtype="float32",
      remat="none",  # what a layer keeps for its backward pass: "none" (all), "full" (its input), "dots"
      scan_layers=False,  # the layers as one nn.scan over stacked parameters (one layer compiled)
      causal=False,  # True: attention to earlier tokens only (a decoder)
      type_vocab_size=2,  # 0: no token-type embeddings (TUPE's RoBERTa-style model)
      embedding_size=0,  # 0: hidden_size; narrower embeddings are read through a projection (ELECTRA's)
      layer_norm_eps=1e-12,  # BERT's; fairseq (the official TUPE code) uses 1e-5
      norm="post",  # or "pre", "reordered" (OLMo 2's)
      activation="gelu",  # exact GELU (BERT); "gelu_tanh", "relu"
      dropout_rate=0.1, attention_dropout_rate=0.1,
      # The decoder family's fields (configs/lm.py sets them as Llama's; posjax.models.TransformerConfig documents
      # each).
      norm_type="layernorm", mlp="dense", use_bias="all", qk_norm=False, embedding_norm=True, tie_embeddings=True,
      lm_head="mlm", parallel_residual=False, qk_norm_axes="head", qk_norm_scale=True, embedding_scale=False,
      query_scale=0.0, attention_query_block=0, attention_softcap=0.0, final_logit_softcap=0.0, layer_windows="", layer_chunks="",
      num_kv_heads=0,  # grouped-query attention's k/v heads; 0: num_heads
      head_dim=0,  # 0: hidden_size / num_heads
      sliding_window=0,  # with causal: each query sees its last sliding_window tokens; 0: all
      position_schedule="",  # ","-separated methods repeated over the layers ("rope,rope,rope,none": iRoPE)
      schedule_options={},  # {"rope@local": {"max_timescale": 10000.0}}: a schedule entry's own options
      first_attention_norm=True,  # False: ModernBERT's first layer, its attention without a norm
      head_bias=True,  # the MLM head's transform has a bias (BERT's; ModernBERT's has none)
      attention_sinks=False,  # a learned logit per head in each softmax's denominator (GPT-OSS)
      query_temperature={},  # {"kind": "llama4" | "ministral" | "ssmax", ...options}: queries scaled by position
      temperature_layers="",  # the layers it scales, 0 / 1 repeated ("0,0,0,1"); "": every layer
      layout="",  # a named hybrid layout setting the per-layer fields (posjax.models.hybrid): irope, gemma3, ...
      layout_options={},  # its options ({"chunk": 8192}, {"window": 1024}, ...)
      **SIZES[arg.size]))
  config.data = ml_collections.ConfigDict(dict(
      source="tfds", tfds_name="wikipedia/20190301.en", train_split="train[:99%]", eval_split="train[99%:]",
      data_dir="", text_key="text", train_files="", eval_files="", vocab_file="",
      packing="full_sentence", mask_rate=0.15, whole_word_masking=False,
      mask_selection="permutation",  # distinct positions (BERT's); "electra": drawn with replacement (the official
      # ELECTRA code's, posjax.data.mlm.mask_block)
      mask_token_rate=0.8, random_token_rate=0.1,  # of the chosen tokens: [MASK], a random token (BERT's)
      num_shards=0,  # document shards the global batch is built from; 0: one per process
      prepared_dir="",  # source="prepared": a corpus from python -m posjax.data.prepare
      eval_source="",  # with source="prepared": where evaluation streams its split from (text or tfds)
      workers=0,  # source="prepared": grain reader processes (0: a reader thread in the training process)
      random_positions=0,  # > 0: training rows' positions a sorted draw from [0, N) (Ruoss et al. 2023)
      random_positions_first="drawn",  # the first token's position: "drawn" as the others (the paper's), "zero"
      examples_per_epoch=ml_collections.config_dict.placeholder(int)))  # packed sequences per epoch

  if arg.runlocal:
    config.model.update({} if "size" in given else SIZES["tiny"], dtype="float32", attention_kernel="xla")
    config.data.update(source="text", train_files=os.path.join(DATA, "tiny_train.txt"),
                       eval_files=os.path.join(DATA, "tiny_eval.txt"), vocab_file=os.path.join(DATA, "tiny_vocab.txt"))
    config.update(total_steps=200, warmup_steps=20, learning_rate=1e-3, batch_size=16, max_len=64,
                  log_every_steps=10, eval_every_steps=100, checkpoint_every_steps=100,
                  keep_steps=(), tensorboard=False)
    config.evals.eval.batches = 4
  if arg.keep:
    try:
      extra = {int(step) for step in arg.keep.split("+")}
    except ValueError:
      raise ValueError(f"config option keep={arg.keep!r}: expected steps joined by '+', e.g. keep=100000+250000")
    config.keep_steps = tuple(sorted({*config.keep_steps, *extra}))
  return config
