"""The fields every fine-tuning config shares (``configs/finetune/*.py`` start from :func:`base_config`).

The recipe is TUPE's (Ke et al. 2021, §4 and its appendix; it follows BERT's): AdamW β = (0.9, 0.999),
ε = 1e-6, weight decay 0.01, gradient clipping 1.0, dropout 0.1, linear warm-up over the first 6% of the
steps, then linear decay to 0. Durations are in epochs of the task's training examples (features, for SQuAD).

A config file's ``recipe=electra`` (:data:`RECIPES`) takes ELECTRA's instead (Clark et al. 2020, appendix Table 7;
google-research/electra ``configure_finetuning.py``, ``model/optimization.py``): learning rate 1e-4 (Large 5e-5),
layer-wise learning-rate decay 0.8 (Large 0.9; :func:`posjax.train.step.layer_scales`), warm-up over 10% of the
steps, weight decay 0 (the paper's; the official code's default is 0.01), batch 32, 3 epochs (10 for RTE and STS-B,
2 for SQuAD), Adam without bias correction (the official ``AdamWeightDecayOptimizer``; ``adam_bias_correction``),
its schedule (warm-up multiplied onto a decay over the whole run, ``lr_schedule="electra"``), the gradient of the
batch's summed loss (``loss_reduction="sum"``: ``tf.reduce_sum`` over the batch, clipped at 1.0 as a sum); ε, β,
clipping and dropout as TUPE's. Layer ``i`` of ``n`` learns at ``lr * decay ** (n - i)``, as Clark intended
(google-research/electra issue #51; ``layerwise_lr_decay_depth="intended"``, the default); the released code gives
every encoder parameter one more factor of ``decay`` (``n + 1 - i``, embeddings ``n + 2``: at 0.8 every encoder
parameter learns at 0.8x the default's rate; ``layerwise_lr_decay_depth="released"``). GLUE under
``recipe=electra`` also reads ELECTRA's head, trains MRPC and STS-B on both orders of each pair, and reports as
ELECTRA does (:data:`GLUE_RECIPES`). Not taken: its GLUE length 128 (``max_len=128`` gives it) and its weight
decay 0.01 (the paper's Table 7 says 0). Layer-wise decay gives posjax's parameters of a position method that
acts in every layer (TUPE's correlation, T5's buckets) the embeddings' factor (the official code has none).

``config.model`` holds only what a fine-tuning run chooses for itself (dropout, dtypes, the attention kernel);
every other model field is ``None``, meaning "the init run's" (:mod:`posjax.finetune.init`), or, without
``init``, ``model_size``'s architecture with ``position`` (default ``absolute``) and the tokenizer's
vocabulary.
"""

from __future__ import annotations

import dataclasses
import os

import ml_collections

from posjax import config_args, positions
from posjax.data import synthetic
from posjax.models import SIZES, TransformerConfig

DATA = synthetic.BUILTIN_DIR
OWN_MODEL_FIELDS = dict(attention_kernel="auto", dtype="bfloat16", param_dtype="float32", dropout_rate=0.1,
                        attention_dropout_rate=0.1)


def model_fields(position: str) -> ml_collections.ConfigDict:
  """Every TransformerConfig field: the run's own choices set, the rest ``None`` (the init run's, or
  ``model_size``'s)."""
  types = {f.name: type(f.default) for f in dataclasses.fields(TransformerConfig) if f.name != "position_options"}
  model = ml_collections.ConfigDict({name: ml_collections.config_dict.placeholder(kind) for name, kind in types.items()})
  model.update(OWN_MODEL_FIELDS)
  model.position = position
  # A method named here brings its options (so --config.model.position_options.<option>= works); none: the init run's.
  model.position_options = config_args.overridable(positions.get(position).options()) if position else {}
  return model


# Each recipe's values over the config file's own (TUPE's optimizer as base_config has it; the file's learning rate,
# batch and epochs), then where they differ by model size and by task.
RECIPES = {
    "tupe": {},
    "electra": dict(learning_rate=1e-4, layerwise_lr_decay=0.8, warmup_fraction=0.1, weight_decay=0.0,
                    adam_eps=1e-6, batch_size=32, epochs=3.0, adam_bias_correction=False, loss_reduction="sum",
                    lr_schedule="electra"),
}
# What a GLUE run reads and reports under each recipe (``configs/finetune/glue.py``). TUPE's (fairseq's sentence
# classification; BERT's): the pooler (dense -> tanh) before the classifier, two evaluations an epoch, the best
# reported. ELECTRA's (``finetune/classification/classification_tasks.py``; the paper's "simple linear classifiers
# on top of ELECTRA"): the [CLS] state through dropout and one dense layer, the final model reported (an evaluation
# per epoch, for the curve), STS-B trained on its scores over 5 (``RegressionTask``'s ``(label - 0) / 5``), MRPC
# and STS-B trained on each pair in both orders (``double_unordered``; ``data.both_orders``).
GLUE_RECIPES = {
    "tupe": dict(classifier_input="pooler", evals_per_epoch=2, select="best", regression_scale=1.0, both_orders=False),
    "electra": dict(classifier_input="cls", evals_per_epoch=1, select="last", regression_scale=0.2, both_orders=True),
}
RECIPE_SIZES = {("electra", "large"): dict(learning_rate=5e-5, layerwise_lr_decay=0.9)}
RECIPE_TASKS = {("electra", "rte"): dict(epochs=10.0), ("electra", "stsb"): dict(epochs=10.0),
                ("electra", "squad"): dict(epochs=2.0)}


def recipe_values(name: str, *, task: str, size: str, own: dict, given: dict) -> dict:
  """:func:`base_config`'s values under recipe ``name`` for ``task`` (a GLUE task's name, or ``squad``): the options
  ``given`` that are set (non-zero) over the recipe's (:data:`RECIPES`, by size, by task) over ``own``, the config
  file's defaults."""
  if name not in RECIPES:
    raise ValueError(f"unknown recipe {name!r}; allowed: {list(RECIPES)}")
  values = {**own, **RECIPES[name], **RECIPE_SIZES.get((name, size), {}), **RECIPE_TASKS.get((name, task), {})}
  return {**values, **{field: value for field, value in given.items() if value}}


def base_config(*, task: str, learning_rate: float, batch_size: int, epochs: float, max_len: int, seed: int,
                size: str = "base", position: str = "", **fields) -> ml_collections.ConfigDict:
  """A fine-tuning config's shared fields (see the module docstring) for one task, ``fields`` (a recipe's) set over
  them; the config file adds its ``data`` and ``evals``."""
  if size not in SIZES:
    raise ValueError(f"unknown size {size!r}; allowed: {list(SIZES)}")
  config = ml_collections.ConfigDict()
  config.task = task
  config.seed = seed
  config.init = ""  # a pre-training (or any posjax) workdir to start from; "": from scratch
  config.init_step = ml_collections.config_dict.placeholder(int)  # a kept step of init; None: its latest
  config.allow_position_change = False  # a position method other than the init run's (its parameters start fresh)
  config.total_epochs = float(epochs)
  config.total_steps = ml_collections.config_dict.placeholder(int)  # or, instead of epochs, steps / examples
  config.total_examples = ml_collections.config_dict.placeholder(int)
  config.warmup_fraction = 0.06  # of the run's steps
  config.learning_rate = learning_rate
  config.batch_size = batch_size
  config.eval_batch_size = ml_collections.config_dict.placeholder(int)  # None: batch_size
  config.max_len = max_len
  config.grad_accum_steps = 1
  config.adam_b1, config.adam_b2, config.adam_eps = 0.9, 0.999, 1e-6
  config.weight_decay = 0.01
  config.weight_decay_exclusion = "bert"  # "none": fairseq's AdamW, which decays every parameter
  config.grad_clip_norm = 1.0
  config.adam_bias_correction = True  # False: the released BERT / ELECTRA Adam (no bias correction)
  config.loss_reduction = "mean"  # "sum": the gradient of the batch's summed loss (ELECTRA's fine-tuning)
  config.lr_schedule = "linear"  # "electra": warm-up multiplied onto a decay over the whole run
  config.layerwise_lr_decay = 1.0  # below 1: lower learning rates for layers nearer the input (ELECTRA's: 0.8)
  config.layerwise_lr_decay_depth = "intended"  # or "released": every encoder factor times the decay once more
  config.parallelism = "jit"
  config.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))
  config.log_every_steps = 50
  config.device_prefetch = 2  # batches put on the devices ahead of the step
  config.eval_every_steps = 1000  # and at the end
  config.evals_per_epoch = 0  # instead of eval_every_steps: this many evaluations an epoch (TUPE: 2), and the end
  config.select = "last"  # the evaluation results.json reports: last | best (of select_metric)
  config.select_metric = ""  # "<evaluator>/<metric>", for select="best"
  config.checkpoint_every_steps = 1000
  config.keep_checkpoints = 1
  config.keep_steps = ()
  config.allow_config_change = False
  config.tensorboard = True
  config.progress = True  # the progress bar and the status lines
  config.profile_start_step = -1
  config.profile_steps = 5
  config.cpu_collectives = ""
  # Multi-process runs: a process that sends no heartbeat for this long counts as lost, and every process stops
  # with one line (posjax.train.peers; JAX's own abort comes 30 s later); a finished process waits this long for
  # the others at exit (JAX's shutdown barrier, its default).
  config.peer_timeout_seconds = 60
  config.shutdown_timeout_seconds = 300
  config.model_size = size  # the architecture of a run without init
  config.model = model_fields(position)
  unknown = sorted(set(fields) - set(config))
  if unknown:
    raise ValueError(f"base_config has no fields {unknown}")
  config.update(fields)
  return config


def batching_fields() -> dict:
  """How fine-tuning batches are padded (:mod:`posjax.data.features`): ``dynamic`` pads each batch to the bucket of
  its longest example (the same batches as ``fixed``, which pads to ``max_len``); ``grouped`` also sorts
  mega-batches of ``group_size`` batches (0: the epoch) by length. ``length_buckets``: the padded lengths; ``()``:
  the ladder of :func:`posjax.data.features.length_buckets` with ``buckets_per_doubling`` steps (4: 20 shapes up to
  512; 8: 40 shapes, half the rounding). ``cache_dir``: where the encoded training and evaluation
  features are kept for the next run (:mod:`posjax.data.feature_cache`; a sweep points every run at one)."""
  return dict(batching="dynamic", length_buckets=(), buckets_per_doubling=4, group_size=50,
              cache_dir="")  # encoded features stored here, keyed by files, vocabulary and max_len; "": none


# The config files' options that runlocal's preset would set, and the fields they set: a named option keeps them.
RUNLOCAL_OPTIONS = {"lr": ("learning_rate",), "epochs": ("total_epochs", "total_steps"), "max_len": ("max_len",),
                    "size": ("model_size",)}


def runlocal(config: ml_collections.ConfigDict, *, steps: int, max_len: int, batch_size: int,
             given: frozenset[str] = frozenset()) -> None:
  """A tiny model with the built-in vocabulary, on the made-up files in ``configs/data`` unless ``source`` is named
(the config files leave the data alone then: ``source=tfds,runlocal`` is the tiny model on TFDS): seconds on a CPU.
  ``given``: the options the user named (:func:`posjax.config_args.named`); those of :data:`RUNLOCAL_OPTIONS` keep
  their values over the preset (``lr=3e-4,runlocal`` trains at 3e-4; ``epochs=3,runlocal`` for 3 epochs)."""
  preset = dict(model_size="tiny", total_epochs=None, total_steps=steps, learning_rate=1e-3, max_len=max_len)
  for option in given & RUNLOCAL_OPTIONS.keys():
    for field in RUNLOCAL_OPTIONS[option]:
      del preset[field]
  config.model.update(dtype="float32", attention_kernel="xla")
  config.data.scratch_vocab_file = os.path.join(DATA, "tiny_vocab.txt")  # with init: the init run's
  config.data.buckets_per_doubling = 1  # 32, 64, 128: few shapes to compile for runs of a few dozen steps
  config.update(preset, batch_size=batch_size, log_every_steps=10, eval_every_steps=steps // 2,
                checkpoint_every_steps=steps // 2, tensorboard=False)
