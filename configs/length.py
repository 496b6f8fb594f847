"""Length generalisation: each position method trained at one length and evaluated at 1x-16x it. See
:mod:`posjax.experiments.length`.

Options (``configs/length.py:methods=rope+alibi+fire+kerple_log,model=lm,runlocal``):
  methods: ``+``-separated registry names, trained here; default ``rope+alibi+fire+kerple_log``; ``methods=``: none.
    Named sets expand in place: ``huang`` (Huang et al. 2020's inductive rows: absolute, shaw, huang_m1-m4; their
    models are encoders, so ``model=mlm``), ``extrapolation`` (the length-generalisation methods: none (NoPE), rope,
    xpos, alibi, t5, kerple_log, kerple_power, fire, sandwich, fox, cope, stick_breaking; with ``model=mlm`` those
    with an encoder's form).
  runs: ``+``-separated workdirs of finished runs (``python -m posjax.main --config=configs/lm.py:... --workdir=DIR``,
    ``configs/clm.py`` for ``model=clm``, ``configs/pretrain.py`` for ``model=mlm``) to evaluate instead of training: each its last checkpoint, with its own
    config and the harness's evaluators, as the row of its position method and the options it changed from the
    recipe's, ``<method> (<option>=<value>, ...)`` (a second run of the same: `` (<its directory's name>)`` after it;
    ``runs=DIR1+DIR2,methods=`` trains nothing). A run is trained at ``train_len`` (32 in runlocal, else 512), or
    fine-tuned at another length from a run trained at it (its ``init_from``): then two rows, ``<label> zero-shot``
    (the run it started from, with its options) and ``<label> +<steps> steps at <length>``.
  model: ``lm`` (the Llama-family decoder of ``configs/lm.py``, next-token perplexity; default), ``clm`` (a causal
    BERT, ``configs/clm.py``) or ``mlm`` (an encoder, masked-token perplexity).
  size: the model's size (``lm``: ``tiny`` | ``125m`` | ``350m`` | ``1b``, default ``125m``; the others: ``tiny`` |
    ``base`` | ``large``, default ``base``; runlocal: tiny unless named).
  runlocal: the tiny model on the built-in corpus (``configs/data``); trained at length 32 for 300 steps.
  passkey: passkey retrieval at every length (decoders, ``model=lm`` or ``clm``, only: :mod:`posjax.tasks.passkey`); default on,
    ``passkey=False`` turns it off. A key of 5 digits in Mohtashami & Jaggi's prompt; runlocal: 3 of 10 adjectives
    in a prompt of the tiny corpus's words (it has no digits), which the tiny model was never taught to retrieve.
  probes: position probes run for every method too (``+``-separated tasks of :mod:`posjax.tasks.probe`; default
    ``copy+sort+parity``, Kazemnejad et al. 2023's; ``probes=`` runs none): ``configs/probes.py``'s tiny models
    (runlocal; ``small`` otherwise), decoders for ``model=lm`` (Llama-family) and ``clm``, trained at length 16 and evaluated at the same
    multiples; a table per task in ``length.md``. ``config.probe_overrides`` changes their config.
  control: the positive control of passkey retrieval, a method trained with passkey prompts in half its rows (the
    row ``<method>+keys``; ``config.control_steps``, ``config.control_fraction``); default the first method when
    passkey is on, ``control=`` none.
  seeds: how many times each trained row is trained (seeds ``seed``, ``seed + 1``, ...; default 1): its tables show the
    mean ± the sample standard deviation, the plot the mean with a band from the lowest to the highest seed, and
    ``length.json`` every seed's value (``seeds``, ``spread``).
  stride: > 0 adds sliding-window perplexity (Press et al. 2022): the same text in windows of each length every
    ``stride`` tokens, each token predicted once after up to ``length - stride`` tokens of context (a decoder on a
    stream packing, in one process; ``stride`` must divide ``train_len``); default 0, off.
  depths: the needle-in-a-haystack grid's depths (``config.passkey.depths``: retrieval at each depth fraction x
    length, ``needle.png``); default 5, ``depths=0`` draws each depth uniformly.
  layouts: ``+``-separated hybrid layouts (:mod:`posjax.models.hybrid`: ``full``, ``irope``, ``rnope_swa``, ``swan``,
    ``gpt_oss``, ``gemma3``), each a row trained here over ``layout_method`` (default ``rope``), side by side with the methods;
    default none. Their options are ``config.layout_options`` (``{layout: {option: value}}``); by default each
    window and chunk is a quarter of ``train_len`` (Llama 4's ``floor_scale`` the chunk), so that the local layers
    are local at the training length, not the families' 512-8192 tokens; runlocal's 2-layer decoder takes groups of
    ``every=2`` (one local layer, one global).
  ruler: ``+``-separated RULER tasks (:data:`posjax.tasks.ruler_eval.SUITE`: ``niah_single_1``, ``niah_multikey_2``,
    ``niah_multivalue``, ``niah_multiquery``, ``vt``, ``cwe``, ``fwe``; ``all``), decoders only: each scored at every
    length by RULER's string match after greedy decoding, a table each; runlocal: the ``niah_*`` ones in the tiny
    corpus's words (``configs/pretrain.py``'s ``RULER_RUNLOCAL``). Default none.
  ruler_control: the method of their positive control, ``<method>+ruler``, trained for ``ruler_control_steps``
    (runlocal 8,000; else ``steps``) with the
    tasks' prompts and answers in half its rows; default the first method when ``ruler`` is on, ``ruler_control=``
    none.
  extension: ``+``-separated context-extension variants of a RoPE model (:mod:`posjax.experiments.extension`:
    ``unscaled``, ``pi``, ``ntk``, ``yarn``, ``longrope``; ``all``: every one), each zero-shot and fine-tuned at
    ``factor`` (default 4) times the training length for ``config.extension.finetune_steps``; default none.
  extension_base: the model they extend: a method among the rows (default ``rope``), the positive control's row
    (``rope+keys``: a model that retrieves, so the passkey tables show what each extension keeps), or the workdir of a finished
    run or of ``python -m posjax.convert hf-to-posjax`` trained at ``train_len``.

  python -m posjax.main --config=configs/length.py:methods=rope+alibi+fire+kerple_log,runlocal --workdir=DIR
  python -m posjax.main --config=configs/length.py:methods=rope,extension=all,probes=,runlocal --workdir=DIR
  python -m posjax.main --config=configs/length.py:methods=rope+none,layouts=irope+rnope_swa+swan+gemma3,runlocal \
      --workdir=DIR
Real runs name their corpus and recipe in ``overrides``: ``(field, value)`` pairs of the base config
(``configs/lm.py`` / ``clm.py`` / ``pretrain.py``, dotted), e.g. ``(("data.source", "text"), ("data.train_files",
"corpus.txt"), ...)``, as the paper tables' configs do; a local text file works as the corpus.
"""

import ml_collections

from configs.pretrain import PASSKEY_RUNLOCAL, RULER_RUNLOCAL
from posjax import positions
from posjax.experiments import extension
from posjax.config_args import named, parse_arg
from posjax.experiments.tables import HUANG_METHODS
from posjax.models import DECODER_SIZES, SIZES, hybrid
from posjax.tasks import ruler_eval

METHOD_SETS = {"huang": tuple(HUANG_METHODS.values()),
               "extrapolation": ("none", "rope", "xpos", "pope", "alibi", "t5", "kerple_log", "kerple_power", "fire",
                                 "sandwich", "fox", "cope", "stick_breaking", "path")}



def _ruler_spec(name: str, runlocal: bool) -> dict:
  """A RULER task's evaluator spec: RULER's, or in runlocal its needles in the tiny corpus's words (only the needle
  tasks, on the repeat haystack: the 20 words cannot fill a haystack of needles), at most 2 keys, values and queries
  (4 needles and their question pass the training length of 32), 4 tokens answered."""
  spec = {"options": {}, **ruler_eval.SUITE[name]}
  if not runlocal:
    return spec
  if spec["task"] != "niah":
    raise ValueError(f"config option ruler: {name!r} needs a real vocabulary (its names, numbers or words); runlocal's "
                     "tiny corpus has only the needle tasks (niah_*)")
  small = {key: min(value, 2) for key, value in spec["options"].items() if key in ("keys", "values", "queries")}
  return {**spec, "options": {**spec["options"], **small, **RULER_RUNLOCAL, "haystack": "repeat"}, "tokens": 4}


def get_config(arg=None):
  given = named(arg)
  arg = parse_arg(arg, methods="rope+alibi+fire+kerple_log", model="lm", size="base", runlocal=False, passkey=True,
                  probes="copy+sort+parity", runs="", control="", depths=5, extension="", extension_base="rope",
                  factor=4.0, seeds=1, stride=0, layouts="", layout_method="rope", ruler="", ruler_control="")
  config = ml_collections.ConfigDict()
  config.job = "length"
  config.seed = 0
  config.seeds = arg.seeds  # runs per trained row (seeds seed .. seed + seeds - 1): tables show mean ± std
  config.stride = arg.stride  # > 0: sliding-window perplexity too (windows of each length every `stride` tokens)
  names = arg.methods.split("+") if arg.methods else []
  # a named set gives an encoder (model=mlm) its methods with an encoder's form; a method named alone must have one
  encoder = arg.model == "mlm"
  config.methods = tuple(dict.fromkeys(m for name in names for m in METHOD_SETS.get(name, (name,))
                                       if not (encoder and name in METHOD_SETS and positions.get(m).decoder_only)))
  for method in config.methods:
    if positions.get(method).decoder_only and encoder:
      raise ValueError(f"position method {method!r} exists in a decoder's form only: use model=lm or model=clm")
  config.model = arg.model
  default_size = "125m" if arg.model == "lm" else "base"
  config.size = arg.size if "size" in given else "tiny" if arg.runlocal else default_size
  config.runlocal = bool(arg.runlocal)
  config.train_len = 32 if arg.runlocal else 512
  config.eval_multiples = (1, 2, 4, 8, 16)
  config.steps = 300 if arg.runlocal else 100_000
  config.batch_size = 16 if arg.runlocal else 256
  config.eval_batches = 4 if arg.runlocal else 50
  config.runs = tuple(arg.runs.split("+")) if arg.runs else ()  # finished runs' workdirs, read instead of trained
  config.overrides = ()  # (dotted field of the base config, value) pairs, e.g. (("learning_rate", 3e-4),)
  # Probe tasks run for every method (posjax.tasks.probe; a decoder's for model=lm / clm), and the probes' config fields
  # to override (configs/probes.py's, dotted), e.g. (("steps", 1000),).
  config.probes = tuple(arg.probes.split("+")) if arg.probes else ()
  config.probe_overrides = ()
  # The passkey evaluators' options (posjax.tasks.passkey: batches of eval rows, digits, symbols, texts); None: off.
  config.passkey = ml_collections.ConfigDict(
      {"batches": 2, **PASSKEY_RUNLOCAL} if arg.runlocal else {"batches": 1, "digits": 5}
  ) if arg.passkey and arg.model in ("lm", "clm") else None
  if config.passkey is not None:
    config.passkey.depths = arg.depths
  # The positive control (posjax.tasks.passkey.TrainingRows): a method trained with passkey prompts in its rows.
  config.control = (arg.control if "control" in given else config.methods[0] if config.methods else ""
                    ) if config.passkey is not None else arg.control
  config.control_steps = 3000 if arg.runlocal else config.steps
  config.control_fraction = 0.5
  # Hybrid layouts (posjax.models.hybrid) as rows over layout_method, windows and chunks a quarter of train_len.
  config.layouts = tuple(arg.layouts.split("+")) if arg.layouts else ()
  for name in config.layouts:
    hybrid.options(name)  # an unknown layout is an error here
  config.layout_method = arg.layout_method
  sizes = DECODER_SIZES if arg.model == "lm" else SIZES
  if config.layouts and config.size not in sizes:
    raise ValueError(f"config option size={config.size!r} with layouts: model={arg.model} has sizes {list(sizes)}")
  config.layout_options = ml_collections.ConfigDict({
      name: hybrid.scaled(name, config.train_len, sizes[config.size]["num_layers"]) for name in config.layouts})
  # RULER's tasks (posjax.tasks.ruler_eval.SUITE) at every length, each a table, and their positive control: a method
  # trained with the tasks' prompts and answers in half its rows (the row <ruler_control>+ruler).
  names = list(ruler_eval.SUITE) if arg.ruler == "all" else arg.ruler.split("+") if arg.ruler else []
  if names and arg.model not in ("lm", "clm"):
    raise ValueError(f"config option ruler={arg.ruler!r}: RULER's tasks are answered by decoding; use model=lm or clm")
  unknown = sorted(set(names) - set(ruler_eval.SUITE))
  if unknown:
    raise ValueError(f"config option ruler: unknown task(s) {unknown}; allowed: {list(ruler_eval.SUITE)} or all")
  config.ruler = ml_collections.ConfigDict({name: _ruler_spec(name, arg.runlocal) for name in names})
  config.ruler_control = (arg.ruler_control if "ruler_control" in given else config.methods[0] if config.methods
                          else "") if names else ""
  config.ruler_control_steps = 8000 if arg.runlocal else config.steps  # runlocal: 4 tasks solved at 75-100% at 32
  # Context extension (posjax.experiments.extension): variants of a RoPE base, zero-shot and fine-tuned.
  variants = arg.extension.split("+") if arg.extension else []
  variants = list(extension.VARIANTS) if variants == ["all"] else variants
  for variant in variants:
    if variant not in extension.VARIANTS:
      raise ValueError(f"extension={arg.extension!r}: unknown variant {variant!r}; allowed: "
                       f"{list(extension.VARIANTS)} or all")
  config.extension = ml_collections.ConfigDict({
      "variants": tuple(variants), "base": arg.extension_base, "factor": float(arg.factor),
      "finetune_steps": 300 if arg.runlocal else 1000, "lr_fraction": 0.1})
  return config
