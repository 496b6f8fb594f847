"""Where a fine-tuning run starts: another run's workdir at a kept step (``init``, ``init_step``), or scratch.

Without ``init_step`` the init run must have finished (its ``results.json``, or its last kept step at its
``total_steps``); an unfinished one is an error naming its last step.

From ``init`` the run takes the encoder's parameters (of an ELECTRA run, the discriminator's; its generator is
dropped), its architecture (``model_config.json``, which every posjax run and ``python -m posjax.convert
hf-to-posjax`` write) and its vocabulary (``vocab.txt`` or ``tokenizer.json`` beside the checkpoints, else the
init run's ``data.vocab_file``). The fine-tuning config's own model fields are dropout, dtypes and the attention
kernel; an architecture field set to something else than the init run's is an error, and so is another position
method or other position options, unless ``allow_position_change`` (then the new position parameters start
fresh, and the log names them).
"""

from __future__ import annotations

import dataclasses
import os

import flax.traverse_util
import ml_collections
from absl import logging

from posjax import results as results_lib
from posjax.models import SIZES
from posjax.positions import base as positions_base
from posjax.train import checkpoint as checkpoint_lib

ARCHITECTURE = ("vocab_size", "hidden_size", "embedding_size", "num_layers", "num_heads", "intermediate_size", "max_len",
                "type_vocab_size", "layer_norm_eps", "norm")
OWN = ("attention_kernel", "dropout_rate", "attention_dropout_rate", "dtype", "param_dtype", "remat", "scan_layers")
DEFAULT_POSITION = "absolute"  # of a run from scratch that names none


@dataclasses.dataclass(frozen=True)
class Start:
  workdir: str
  checkpoints: str
  step: int
  model: dict  # the init run's TransformerConfig fields
  vocab_file: str


def kept_steps(directory: str) -> list[int]:
  """The steps kept in a checkpoint directory (its numeric folders), ascending; none when it does not exist."""
  return sorted(int(p) for p in os.listdir(directory) if p.isdigit()) if os.path.isdir(directory) else []


def find(config: ml_collections.ConfigDict) -> Start | None:
  """The init run named by ``config.init`` (a workdir), checked: checkpoints, the step, its model and vocabulary."""
  workdir = config.get("init") or ""
  if not workdir:
    if config.get("init_step") is not None:
      raise ValueError(f"config.init_step={config.init_step} needs config.init (the run to start from)")
    return None
  if checkpoint_lib.run_directory(workdir) != os.path.normpath(workdir):  # given its checkpoints directory
    workdir, checkpoints = checkpoint_lib.run_directory(workdir), workdir
  else:
    checkpoints = os.path.join(workdir, "checkpoints")
  steps = kept_steps(checkpoints)
  if not steps:
    raise FileNotFoundError(f"config.init={config.init!r} holds no checkpoint (expected {checkpoints}/<step>)")
  if config.get("init_step") is None:
    _check_finished(workdir, steps[-1])
  step = steps[-1] if config.get("init_step") is None else int(config.init_step)
  if step not in steps:
    raise ValueError(f"config.init_step={step} was not kept in {checkpoints}; kept steps: {steps}")
  model = checkpoint_lib.read_model_config(workdir, "config.init")
  model.pop("generator", None)  # an ELECTRA run: its discriminator's fields are the encoder's
  vocab_file = checkpoint_lib.vocab_file_of(workdir)
  return Start(workdir, checkpoints, step, model, vocab_file)


def _check_finished(workdir: str, last: int) -> None:
  """An init run without ``init_step`` must have finished: a run killed by its wall-clock limit would otherwise
  be fine-tuned from wherever it stopped. Converted checkpoints (no ``config.json``) are not training runs."""
  if os.path.isfile(os.path.join(workdir, "results.json")):
    return
  trained = results_lib.read_json(os.path.join(workdir, "config.json"))
  if trained is None:
    return
  # total_steps holds the run's length only when neither examples nor epochs replaced it.
  total = None if trained.get("total_examples") or trained.get("total_epochs") else trained.get("total_steps")
  if total is not None and last >= total:
    return
  raise ValueError(f"config.init={workdir!r} did not finish (no results.json; last kept step {last} of "
                   f"total_steps={total}); resume it, or set config.init_step={last} to start from that step anyway")


def _position(name: str, options) -> tuple[str, dict]:
  """A method's canonical name and its full options (defaults filled in), for comparison."""
  method = positions_base.get(name)
  return method.name, dataclasses.asdict(positions_base.parse_options(method, dict(options or {})))


def model_fields(config: ml_collections.ConfigDict, start: Start | None, vocab_size: int) -> tuple[dict, bool]:
  """The fine-tuning model's TransformerConfig fields and whether its position method differs from the init run's."""
  given = {k: v for k, v in config.model.to_dict().items() if v is not None and v != ""}
  if start is None:
    given = {**SIZES[config.get("model_size", "base")], **given}
    given.setdefault("position", DEFAULT_POSITION)
    given.setdefault("max_len", config.max_len)
    given.setdefault("vocab_size", vocab_size)
    return given, False
  fields = dict(start.model)
  for field in ARCHITECTURE:
    if field in given and given[field] not in (0,) and given[field] != fields[field]:
      raise ValueError(f"config.model.{field}={given[field]!r}, but the init run {start.workdir} has "
                       f"{field}={fields[field]!r}: a pre-trained encoder's architecture cannot change")
  changed = False
  if "position" in given or given.get("position_options"):
    wanted = _position(given.get("position", fields["position"]), given.get("position_options"))
    if wanted != _position(fields["position"], fields.get("position_options")):
      if not config.get("allow_position_change", False):
        raise ValueError(
            f"the init run {start.workdir} uses position {fields['position']!r} with options "
            f"{_position(fields['position'], fields.get('position_options'))[1]}; this config asks for "
            f"{wanted[0]!r} with {wanted[1]}. Drop the position fields to keep the init run's, or set "
            "--config.allow_position_change=True (new position parameters then start fresh)")
      fields["position"], fields["position_options"] = wanted
      changed = True
  fields.update({k: given[k] for k in OWN if k in given})
  return fields, changed


def is_position_parameter(path: str) -> bool:
  """Parameters of a position method live in modules named ``position`` (the encoder's or a layer's)."""
  return "position" in path.split("/")


def load(start: Start, fresh: dict, position_changed: bool) -> dict:
  """``fresh`` with every parameter of the init checkpoint that fits; the task head (outside ``encoder``)
  starts fresh, and so do the position parameters when the method changed (even where names and shapes
  agree: another method's table means something else). Any other encoder parameter that does not fit is an
  error: the checkpoint is not this encoder's."""
  loaded = checkpoint_lib.load_params(start.checkpoints, start.step)
  if "encoder" not in loaded:
    raise ValueError(f"the checkpoint {start.checkpoints}/{start.step} has no 'encoder' parameters; its top level: "
                     f"{sorted(loaded)}")
  if position_changed:
    flat = flax.traverse_util.flatten_dict(loaded, sep="/")
    loaded = flax.traverse_util.unflatten_dict({k: v for k, v in flat.items() if not is_position_parameter(k)},
                                               sep="/")
  if "generator" in loaded:
    logging.info("init from the ELECTRA run %s: its discriminator is the encoder; the generator (%s) is dropped",
                 start.workdir, ", ".join(k for k in sorted(loaded) if k.startswith("generator")))
    loaded = {k: v for k, v in loaded.items() if not k.startswith("generator")}
  merged, kept_fresh, unused = checkpoint_lib.merge_params(fresh, loaded)
  fresh_encoder = [p for p in kept_fresh if p.startswith("encoder/")]
  wrong = [p for p in fresh_encoder if not (position_changed and is_position_parameter(p))]
  if wrong:
    raise ValueError(f"the encoder parameters {wrong} are missing from, or shaped differently in, "
                     f"{start.checkpoints}/{start.step}")
  if fresh_encoder:
    logging.warning("position method changed from the init run's: these parameters start fresh: %s", fresh_encoder)
  logging.info("init from %s step %d: unused %s, fresh head %s", start.checkpoints, start.step, unused,
               [p for p in kept_fresh if not p.startswith("encoder/")])
  return merged
