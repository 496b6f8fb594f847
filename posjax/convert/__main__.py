"""Checkpoint conversion from the command line.

  python -m posjax.convert hf-to-posjax --from HF_DIR --workdir OUT
      A Hugging Face BERT, ModernBERT or ELECTRA directory (by its config.json's ``model_type``; ELECTRA:
      ``ElectraModel``, ``ElectraForPreTraining``, ``ElectraForMaskedLM``) -> OUT/checkpoints/0 (orbax),
      OUT/model_config.json and the tokenizer's vocab.txt (or tokenizer.json): what fine-tuning
      (``--config.init=OUT``) and pre-training warm starts (``--config.init_from=OUT``) start from. An ELECTRA source
      is also recorded in OUT/converted_from.json (``{"model_type": "electra", "source": ...}``), so that
      posjax-to-hf writes it back as ELECTRA: TransformerConfig cannot say so, and an ELECTRA generator's parameters
      are a BERT MLM model's. A decoder (:data:`posjax.convert.hf_decoder.MODEL_TYPES`) or a ModernBERT is recorded
      the same way, so that it goes back as its own family.
  python -m posjax.convert posjax-to-hf --workdir RUN [--step N] --out HF_DIR [--vision_from HF_DIR]
      A posjax run (absolute, shaw or huang_m4) -> config.json, model.safetensors and the tokenizer files:
      Hugging Face BERT; ELECTRA (``to_hf_electra``) for a run converted from ELECTRA (converted_from.json) or
      one with the ``rtd`` head, which BERT has not. An ELECTRA pre-training run (``"generator"`` fields in its
      model_config.json) -> HF_DIR/generator (ElectraForMaskedLM) and HF_DIR/discriminator
      (ElectraForPreTraining), each with the tokenizer files. A decoder run (``lm_head="linear"``: configs/lm.py's,
      or one converted from Hugging Face) -> its family's ``*ForCausalLM`` (the one it was converted from, else the
      one that expresses it: :func:`posjax.convert.hf_decoder.model_type_of`). ModernBERT's layout
      (``first_attention_norm=False``) -> ``ModernBertForMaskedLM`` / ``ModernBertModel``. An M-RoPE decoder
      converted from a Qwen-VL checkpoint -> that checkpoint (``--vision_from``, default the one converted_from.json
      names) with its text decoder's weights replaced, its vision tower kept.
  python -m posjax.convert tupe-to-posjax --from checkpoint_best.pt --workdir OUT [--classification_head NAME]
      An official TUPE (fairseq) checkpoint -> a posjax run. Its vocabulary (a fairseq dictionary over GPT-2
      BPE) is not converted: give the run a ``tokenizers`` JSON with the same ids (``data.vocab_file``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import jax
from tokenizers import processors

from posjax.cli import check_directory
from posjax.convert import hf_bert, hf_decoder, hf_electra, hf_modernbert, tupe_fairseq
from posjax.data import tokenizer as tokenizer_lib
from posjax.data.tokenizer import Tokenizer
from posjax.models import TransformerConfig
from posjax.models.electra import ElectraConfig
from posjax.train import checkpoint as checkpoint_lib

# A vision-language checkpoint's image and video processing, copied beside an M-RoPE decoder exported into it
PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json",
                   "chat_template.json", "chat_template.jinja")
CONVERTED_FROM = "converted_from.json"  # the Hugging Face model type of a run hf-to-posjax wrote, when not BERT
# What an export writes (save_pretrained's files, the tokenizer's, an ELECTRA run's two models) and the file that
# marks a directory as posjax's export (written first): only such a directory may be replaced by a new export.
EXPORT_NAMES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
                "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt", "added_tokens.json",
                "tokenizer.model", "generator", "discriminator", *PROCESSOR_FILES)
EXPORT_MARKER = "posjax_export.json"
# A converted model's tokenizer settings and files beside its tokenizer.json (SentencePiece's model, the chat
# template, added tokens): kept in the run, written back unchanged.
TOKENIZER_SETTINGS = (*tokenizer_lib.SETTINGS, "tokenizer.model", "chat_template.jinja", "added_tokens.json")
# What the converters need beyond posjax's own dependencies: the convert extra's modules, and how to install them.
CONVERT_EXTRA = ("torch", "transformers", "safetensors")
INSTALL_CONVERT = "pip install -e '.[convert]'"


def check_new_workdir(workdir: str) -> None:
  """``workdir`` can take a converted run: a new directory, or one without checkpoints (checked before the
  source is read)."""
  check_directory(workdir, "--workdir", "a new one, or one without checkpoints")
  if os.path.exists(os.path.join(workdir, "checkpoints")):
    raise ValueError(f"{workdir} already holds checkpoints; convert into a new directory")


def write_run(module, variables, workdir: str, source: str) -> str:
  """A converted model as a posjax run in ``workdir``: ``checkpoints/0`` and ``model_config.json``."""
  check_new_workdir(workdir)
  os.makedirs(workdir, exist_ok=True)
  checkpointer = checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints"), keep=1, async_save=False)
  checkpointer.save(0, {"step": jax.numpy.zeros((), jax.numpy.int32), "params": variables["params"]},
                    {"converted_from": os.path.abspath(source)})
  checkpointer.close()
  with open(os.path.join(workdir, "model_config.json"), "w") as f:
    json.dump(module.config.to_dict(), f, indent=1, sort_keys=True)
  return checkpointer.directory


def hf_model_type(source: str) -> str:
  """The ``model_type`` of a Hugging Face directory's config.json (``bert`` where it has none); a type other
  than BERT, ELECTRA or a decoder of :data:`posjax.convert.hf_decoder.MODEL_TYPES` is an error (no config.json is
  :func:`posjax.convert.hf_bert.read_directory`'s)."""
  path = os.path.join(source, "config.json")
  if not os.path.isfile(path):
    return "bert"
  model_type = hf_bert.read_config(path).get("model_type", "bert")
  if model_type not in ("bert", "electra", "modernbert", *hf_decoder.MODEL_TYPES):
    vit = " (a ViT image classifier converts in Python: posjax.convert.from_hf_vit)" if model_type == "vit" else ""
    raise ValueError(f"{path} has model_type={model_type!r}; hf-to-posjax converts BERT ('bert'), ModernBERT "
                     f"('modernbert'), ELECTRA ('electra') and the decoders {list(hf_decoder.MODEL_TYPES)}{vit}")
  return model_type


def hf_special_ids(source: str) -> dict:
  """A Hugging Face decoder's bos / eos / pad ids: its generation config's where it names them, else its config's
  (None where neither does; a list of eos ids stays a list)."""
  ids = {name: None for name in ("bos_token_id", "eos_token_id", "pad_token_id")}
  if hf_model_type(source) == "modernbert":
    ids.update({f"{name}_token_id": None for name in hf_modernbert.SPECIAL_TOKENS})
  for name in ("config.json", "generation_config.json"):  # the generation config's win
    if os.path.isfile(os.path.join(source, name)):
      found = hf_bert.read_config(os.path.join(source, name))
      ids.update({k: found[k] for k in ids if found.get(k) is not None})
  return ids


def hf_to_posjax(source: str, workdir: str) -> str:
  """Writes the converted model (BERT, ELECTRA or a decoder) as a posjax run in ``workdir``, with the tokenizer's
  files; returns its checkpoint directory."""
  check_new_workdir(workdir)
  if _within(workdir, source):
    raise ValueError(f"--workdir={workdir} is --from={source} or inside it; the converted run goes to a new "
                     "directory (a converter never writes into what it reads)")
  model_type = hf_model_type(source)
  convert = {"electra": hf_electra.from_hf_electra, "bert": hf_bert.from_hf_bert,
             "modernbert": hf_modernbert.from_hf_modernbert}.get(model_type, hf_decoder.from_hf_decoder)
  module, variables = convert(source)
  directory = write_run(module, variables, workdir, source)
  if model_type != "bert":
    with open(os.path.join(workdir, CONVERTED_FROM), "w") as f:
      json.dump({"model_type": model_type, "source": os.path.abspath(source)}, f, indent=1)
  if model_type in (*hf_decoder.MODEL_TYPES, "modernbert"):
    with open(os.path.join(workdir, checkpoint_lib.SPECIAL_TOKENS), "w") as f:
      json.dump(hf_special_ids(source), f, indent=1)
  copied = [name for name in (*checkpoint_lib.TOKENIZER_FILES, *TOKENIZER_SETTINGS)
            if os.path.isfile(os.path.join(source, name))]
  for name in copied:
    shutil.copy(os.path.join(source, name), os.path.join(workdir, name))
  print(f"{source} ({module.config.position}, head {module.head}) -> {workdir}: checkpoints/0, model_config.json"
        + "".join(f", {name}" for name in copied))
  return directory


def tupe_to_posjax(source: str, workdir: str, classification_head: str | None = None) -> str:
  """Writes an official TUPE (fairseq) checkpoint as a posjax run in ``workdir``, without its vocabulary
  (``classification_head``: which one, if it has several); returns its checkpoint directory."""
  check_new_workdir(workdir)
  module, variables = tupe_fairseq.from_tupe_fairseq(source, classification_head)
  directory = write_run(module, variables, workdir, source)
  print(f"{source} ({module.config.position}, head {module.head}) -> {workdir}: checkpoints/0, model_config.json "
        "(no vocabulary: give runs from it data.vocab_file)")
  return directory


def converted_from(run: str, field: str = "model_type") -> str:
  """The Hugging Face model type ``run`` was converted from (:data:`CONVERTED_FROM`; ``bert`` without one), or
  another of its fields (``source``: the directory; "" without one)."""
  path = os.path.join(run, CONVERTED_FROM)
  if not os.path.isfile(path):
    return "bert" if field == "model_type" else ""
  with open(path) as f:
    return json.load(f).get(field, "")


def _within(path: str, directory: str) -> bool:
  """Whether ``path`` is ``directory`` or inside it, links resolved (where a converter must never write)."""
  path, directory = os.path.realpath(path), os.path.realpath(directory)
  return path == directory or path.startswith(os.path.join(directory, ""))


def _foreign(directory: str) -> list[str]:
  """The entries of ``directory`` (and of its ELECTRA subdirectories) that no export writes, links included (an
  export never writes through one)."""
  found = []
  for name in sorted(os.listdir(directory)):
    path = os.path.join(directory, name)
    sharded = name.startswith("model-") and name.endswith(".safetensors")
    folder = name in ("generator", "discriminator")
    if os.path.islink(path) or os.path.isdir(path) != folder or not (sharded or name in (*EXPORT_NAMES, EXPORT_MARKER)):
      found.append(name + (" (a link)" if os.path.islink(path) else ""))
    elif folder:
      found += [os.path.join(name, inner) for inner in _foreign(path) if inner != EXPORT_MARKER]
  return found


def check_export_directory(out: str, run: str) -> None:
  """``out`` can take the export of ``run``: new, empty, or an earlier posjax export (:data:`EXPORT_MARKER`, and only
  what an export writes); never the run's own directory or one inside it, nor a Hugging Face model of another
  origin, one holding a run, links or other files. Checked before anything is read or written: an export never
  overwrites a run's ``config.json`` or a model it did not write."""
  check_directory(out, "--out", "a new or empty directory, or an earlier export's")
  if _within(out, run):
    raise ValueError(f"--out={out} is --workdir={run} or inside it; an export goes to another directory (it would "
                     "write Hugging Face's config.json over the run's)")
  if not os.path.isdir(out) or not os.listdir(out):
    return
  foreign = _foreign(out)
  if foreign:
    shown = ", ".join(foreign[:4]) + (f" and {len(foreign) - 4} more" if len(foreign) > 4 else "")
    raise ValueError(f"--out={out} holds {shown}, which no export writes (a posjax run, or other files); give a new "
                     "or empty directory, or an earlier export's")
  if os.path.islink(out) or not os.path.isfile(os.path.join(out, EXPORT_MARKER)):
    what = "is a link to" if os.path.islink(out) else f"holds (no {EXPORT_MARKER})"
    raise ValueError(f"--out={out} {what} a model posjax did not export; give a new or empty directory, or an "
                     "earlier export's")


def start_export(out: str, run: str, step: int | None) -> None:
  """``out`` marked as posjax's export (first, so a failed export is still recognised and replaced) and emptied of
  an earlier export's files (:func:`check_export_directory` has checked they are nothing else)."""
  os.makedirs(out, exist_ok=True)
  for name in os.listdir(out):
    path = os.path.join(out, name)
    if name != EXPORT_MARKER:
      shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
  with open(os.path.join(out, EXPORT_MARKER), "w") as f:
    json.dump({"workdir": os.path.abspath(run), "step": step}, f, indent=1)


def hf_tokenizer(vocab: str, special_ids: dict | None):
  """``vocab`` (a WordPiece vocab.txt, or a causal model's ``tokenizers`` JSON) as a ``transformers`` fast
  tokenizer. An encoder's adds [CLS] ... [SEP] as BERT's; a causal model's (``special_ids``: its bos / eos / pad
  ids) adds its bos alone, where it has one, as its rows began, and names its own special tokens."""
  import transformers

  if special_ids is None:
    return transformers.BertTokenizerFast(vocab_file=vocab)
  tokenizer = Tokenizer.load(vocab)
  backend = tokenizer.backend
  piece = lambda role: None if special_ids.get(f"{role}_token_id") is None else backend.id_to_token(
      special_ids[f"{role}_token_id"])
  # the text as the run encoded it: specials only where its rows had them ([CLS] first under some packings)
  backend.post_processor = None if piece("bos") is None else processors.TemplateProcessing(
      single=f"{piece('bos')} $A", special_tokens=[(piece("bos"), special_ids["bos_token_id"])])
  return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=piece("bos"),
                                              eos_token=piece("eos"), pad_token=piece("pad"),
                                              unk_token=backend.id_to_token(tokenizer.unk_id))


def save_hf(model, run: str, out: str, decoder: bool = False) -> str:
  """Saves a Hugging Face model in ``out`` with ``run``'s vocabulary as its tokenizer; returns that vocabulary
  ("" when the run has none). A decoder's config and generation config name the run's own bos / eos / pad
  (:func:`posjax.train.checkpoint.special_token_ids`); a converted model's tokenizer files go back unchanged."""
  vocab = checkpoint_lib.vocab_file_of(run)
  vocab = vocab if vocab and os.path.isfile(vocab) else ""
  special_ids = None
  if decoder:
    special_ids = checkpoint_lib.special_token_ids(run)
    for settings in (model.config, model.generation_config):
      for name, value in special_ids.items():
        setattr(settings, name, value)
  model.save_pretrained(out, safe_serialization=True)
  converted = os.path.isfile(os.path.join(run, CONVERTED_FROM)) and vocab.startswith(os.path.join(run, ""))
  if converted or (vocab.endswith(".json") and tokenizer_lib.hf_settings(vocab) is not None):
    # a Hugging Face tokenizer (the source's, or the one the run trained with): its files, as they came
    folder = os.path.dirname(vocab)
    shutil.copy(vocab, os.path.join(out, "tokenizer.json" if not converted else os.path.basename(vocab)))
    for name in TOKENIZER_SETTINGS:
      if os.path.isfile(os.path.join(folder, name)):
        shutil.copy(os.path.join(folder, name), os.path.join(out, name))
  elif vocab.endswith(".txt") or (vocab and decoder):
    hf_tokenizer(vocab, special_ids).save_pretrained(out)
  elif vocab:
    shutil.copy(vocab, os.path.join(out, "tokenizer.json"))
  return vocab


def posjax_to_hf(run: str, out: str, step: int | None = None, vision_from: str | None = None) -> None:
  """Writes the run's model (``step``: default its latest) as a Hugging Face model directory: BERT, ELECTRA,
  or an ELECTRA run's generator and discriminator in ``out/generator`` and ``out/discriminator``; an M-RoPE decoder
  into ``vision_from`` (default: the vision-language checkpoint it was converted from) (see the module
  docstring)."""
  check_export_directory(out, run)
  fields = checkpoint_lib.read_model_config(run, "--workdir")
  task = checkpoint_lib.run_config(run).get("task")
  if fields.get("causal") and task not in (None, *checkpoint_lib.LM_TASKS):
    raise ValueError(f"--workdir={run} holds a causal model fine-tuned for {task} (its head, not a language model's),"
                     " which Hugging Face's causal LMs cannot hold; export the run it started from")
  if vision_from and fields.get("position") != "mrope":
    raise ValueError(f"--vision_from is for an M-RoPE decoder's vision-language checkpoint; --workdir={run} holds "
                     f"position={fields.get('position')!r}")
  params = checkpoint_lib.load_params(run, step)
  if "generator" in fields:
    config = ElectraConfig.from_dict(fields)
    models = dict(zip((os.path.join(out, "generator"), os.path.join(out, "discriminator")),
                      hf_electra.electra_to_hf(config.generator, config.discriminator, {"params": params})))
  else:
    config = TransformerConfig(**fields)
    source = converted_from(run)
    if config.lm_head == "linear":  # a decoder: its family's causal LM (the one it came from, if converted)
      if config.position == "mrope":
        vision_from = vision_from or converted_from(run, "source")
        if not vision_from or not os.path.isdir(vision_from):
          raise ValueError(f"--workdir={run} holds an M-RoPE decoder, which goes out inside the vision-language "
                           f"checkpoint it came from; {vision_from or 'none is recorded'} is not a directory: give "
                           "--vision_from HF_DIR")
      model = hf_decoder.to_hf_decoder(config, {"params": params}, source if source != "bert" else None,
                                       vision_from=vision_from)
    elif hf_modernbert.is_modernbert(config):  # its source's special token ids, where it was converted
      model = hf_modernbert.to_hf_modernbert(config, {"params": params})
      for name, value in (checkpoint_lib.recorded_special_tokens(run) or {}).items():
        setattr(model.config, name, value)
    elif source == "electra" or "rtd" in params:
      model = hf_electra.to_hf_electra(config, {"params": params})
    else:
      model = hf_bert.to_hf_bert(config, {"params": params})
    models = {out: model}
  start_export(out, run, step)
  for directory, model in models.items():
    vocab = save_hf(model, run, directory, decoder="generator" not in fields and config.causal)
    for name in PROCESSOR_FILES if vision_from else ():  # a vision-language checkpoint's image processing, as it was
      if os.path.isfile(os.path.join(vision_from, name)):
        shutil.copy(os.path.join(vision_from, name), os.path.join(directory, name))
    print(f"{run} ({config.position}) -> {directory}: {type(model).__name__}"
          + (f", tokenizer from {vocab}" if vocab else ", no tokenizer found"))


def main(argv=None) -> int:
  """``python -m posjax.convert``: runs the command ``argv`` names; its mistakes (a bad path, an unconvertible
  model) are one line on stderr and exit status 2."""
  parser = argparse.ArgumentParser(prog="python -m posjax.convert", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  commands = parser.add_subparsers(dest="command", required=True)
  to_posjax = commands.add_parser("hf-to-posjax", help="a Hugging Face BERT or ELECTRA directory -> a posjax run")
  to_posjax.add_argument("--from", dest="source", required=True, help="Hugging Face model directory")
  to_posjax.add_argument("--workdir", required=True, help="the new posjax run's directory")
  to_hf = commands.add_parser("posjax-to-hf", help="a posjax run -> a Hugging Face BERT or ELECTRA directory")
  to_hf.add_argument("--workdir", required=True, help="the posjax run")
  to_hf.add_argument("--step", type=int, default=None, help="a kept step (default: the latest)")
  to_hf.add_argument("--out", required=True, help="the Hugging Face model directory to write")
  to_hf.add_argument("--vision_from", default=None, help="an M-RoPE decoder's vision-language checkpoint "
                     "(default: the one it was converted from)")
  from_tupe = commands.add_parser("tupe-to-posjax", help="an official TUPE (fairseq) checkpoint -> a posjax run")
  from_tupe.add_argument("--from", dest="source", required=True, help="checkpoint*.pt of the official TUPE code")
  from_tupe.add_argument("--workdir", required=True, help="the new posjax run's directory")
  from_tupe.add_argument("--classification_head", default=None, help="which classification head, if several")
  args = parser.parse_args(argv)
  try:
    if args.command == "posjax-to-hf":  # what the export needs; without it, an error before the run is read
      import torch  # noqa: F401
      import transformers  # noqa: F401
    if args.command == "hf-to-posjax":
      hf_to_posjax(args.source, args.workdir)
    elif args.command == "tupe-to-posjax":
      tupe_to_posjax(args.source, args.workdir, args.classification_head)
    else:
      posjax_to_hf(args.workdir, args.out, args.step, args.vision_from)
  except ModuleNotFoundError as error:
    if (error.name or "").partition(".")[0] not in CONVERT_EXTRA:
      raise
    print(f"error: {args.command} needs the convert extra (PyTorch, transformers, safetensors): no module named "
          f"{error.name!r}; install it with {INSTALL_CONVERT}", file=sys.stderr)
    return 2
  except (ValueError, OSError) as error:
    print(f"error: {error}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
