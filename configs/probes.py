"""Position probes (the embedded default, ``make demo``): one tiny encoder per position method and task,
trained at ``train_len`` and evaluated at 1×, 2×, 4× that length. See :mod:`posjax.experiments.probes` (the experiment) and :mod:`posjax.tasks.probe` (the task).

Options (``configs/probes.py:methods=tupe_a+rope,steps=300,size=small``):
  methods: ``+``-separated registry names; default all (with ``decoder``; otherwise those with an encoder's form:
    not ``cope`` or ``stick_breaking``).
  steps: training steps per (method, task).
  size: ``tiny`` (2×64, the CPU demo) or ``small`` (4×256, for an accelerator).
  tasks: ``+``-separated probe tasks (:mod:`posjax.tasks.probe`); default ``copy_left+reverse+index``, the demo's
    table. Kazemnejad et al. 2023's ``copy``, ``sort``, ``parity`` and ``addition`` are opt-in
    (``tasks=copy+sort+parity+addition``), so that the demo's table stays the one docs/probes.md records.
  decoder: decoder-only probe models (causal attention, ``model.causal=True``), as Kazemnejad et al.'s; the tasks
    take their decoder form and ``reverse``, which labels a token with a later one, is refused
    (``configs/probes.py:decoder,tasks=copy+sort+parity+addition``).
  lm: with ``decoder``, the probe decoders are the Llama-family preset (``configs/lm.py``'s model: Pre-RMSNorm,
    SwiGLU, no biases, k/v heads half the query heads) instead of a causal BERT.
  Expressivity probes (opt-in, decoders or encoders): ``mqar`` (Zoology's multi-query associative recall),
    ``flip_flop`` and the word problems ``s5`` / ``a5`` (``configs/probes.py:decoder,tasks=mqar+flip_flop+s5``).
  layouts: ``+``-separated hybrid layouts (:mod:`posjax.models.hybrid`) as rows beside the methods, over
    ``layout_method`` (default ``rope``), each window and chunk a quarter of ``train_len`` and groups no larger than
    the model (``hybrid.scaled``); ``config.layout_options`` changes them.

  python -m posjax.main --config=configs/probes.py --workdir=workdir/probes
  (2 CPU cores, 2026-12-06: about 5 1/2 minutes for the 20 methods of that day × 3 tasks.)
"""

import ml_collections

from posjax import positions
from posjax.config_args import parse_arg
from posjax.models import TransformerConfig, hybrid

SIZES = {
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128),
    "small": dict(hidden_size=256, num_layers=4, num_heads=8, intermediate_size=1024),
}


def get_config(arg=None):
  arg = parse_arg(arg, methods="", steps=300, size="tiny", tasks="copy_left+reverse+index", decoder=False,
                  lm=False, layouts="", layout_method="rope")
  if arg.lm and not arg.decoder:
    raise ValueError("config option lm=True makes the probe decoders Llama-family ones: it needs decoder=True")
  if arg.size not in SIZES:
    raise ValueError(f"unknown size {arg.size!r}; allowed: {list(SIZES)}")
  config = ml_collections.ConfigDict()
  config.job = "probes"
  config.seed = 0
  default = [name for name in (positions.names() if arg.decoder else positions.encoder_names())
             if positions.get(name).axes <= 1]  # the text probes' positions are [B, L]: the methods of one axis
  config.methods = tuple(arg.methods.split("+")) if arg.methods else tuple(default)
  for method in config.methods:
    if positions.get(method).decoder_only and not arg.decoder:
      raise ValueError(f"position method {method!r} exists in a decoder's form only: add decoder to the probes' "
                       "options (configs/probes.py:decoder,...)")
  config.tasks = tuple(arg.tasks.split("+")) if arg.tasks else ()
  config.symbols = 16
  config.shift = 2  # copy_left: copy the symbol this many places to the left
  config.index = 3  # index: copy the symbol at this absolute index
  config.train_len = 16
  config.eval_multiples = (1, 2, 4)
  config.steps = arg.steps
  config.warmup_steps = 30
  config.learning_rate = 3e-3
  config.batch_size = 32
  config.eval_batch_size = 256
  config.model = ml_collections.ConfigDict(SIZES[arg.size])
  if arg.decoder:  # set only for decoders: an encoder's config stays the one earlier workdirs hold
    config.model.causal = True
  if arg.layouts:  # hybrid layouts as rows (posjax.models.hybrid), scaled to the probes' length and depth
    config.layouts = tuple(arg.layouts.split("+"))
    config.layout_method = arg.layout_method
    config.layout_options = ml_collections.ConfigDict({name: hybrid.scaled(
        name, config.train_len, SIZES[arg.size]["num_layers"]) for name in config.layouts})
  if arg.lm:
    size = {**SIZES[arg.size], "num_kv_heads": SIZES[arg.size]["num_heads"] // 2}
    preset = TransformerConfig.decoder(**size).to_dict()
    config.model.update({k: preset[k] for k in (*size, "norm", "norm_type", "mlp", "activation", "use_bias",
                                                 "embedding_norm", "layer_norm_eps")})
  return config
