"""Checkpoint converters: Hugging Face BERT in and out (:mod:`posjax.convert.hf_bert`), Hugging Face ELECTRA in
and out (:mod:`posjax.convert.hf_electra`: ``from_hf_electra``, ``to_hf_electra``, and ``electra_to_hf`` for a
posjax ``Electra``'s generator and discriminator), Hugging Face ViT image classifiers in and out
(:mod:`posjax.convert.hf_vit`), and the official TUPE code's fairseq checkpoints in
(:mod:`posjax.convert.tupe_fairseq`).

  python -m posjax.convert hf-to-posjax --from HF_DIR --workdir OUT
  python -m posjax.convert posjax-to-hf --workdir RUN [--step N] --out HF_DIR
  python -m posjax.convert tupe-to-posjax --from checkpoint_best.pt --workdir OUT

``transformers`` and ``torch`` (the ``convert`` extra) are imported only by the functions that need them.
"""

from posjax.convert import hf_decoder
from posjax.convert.hf_bert import config_from_hf, config_to_hf, from_hf_bert, read_config, read_source, to_hf_bert
from posjax.convert.hf_decoder import from_hf_decoder, to_hf_decoder
from posjax.convert.hf_electra import electra_to_hf, from_hf_electra, to_hf_electra
from posjax.convert.hf_modernbert import from_hf_modernbert, is_modernbert, to_hf_modernbert
from posjax.convert.hf_vit import from_hf_vit, to_hf_vit
from posjax.convert.tupe_fairseq import from_tupe_fairseq

__all__ = ["config_from_hf", "config_to_hf", "electra_to_hf", "from_hf", "from_hf_bert", "from_hf_decoder",
           "from_hf_electra", "from_hf_modernbert", "from_hf_vit", "from_tupe_fairseq", "to_hf", "to_hf_bert",
           "to_hf_decoder", "to_hf_electra", "to_hf_modernbert", "to_hf_vit"]


def from_hf(source):
  """``(module, variables)`` equal to a Hugging Face model of any supported ``model_type`` (``bert``, ``electra``,
  ``modernbert``, ``vit`` and the decoders of :data:`posjax.convert.hf_decoder.MODEL_TYPES`): an in-memory
  ``transformers`` model or a directory.
  ``module.apply(variables, input_ids)`` returns an output whose ``.logits`` are the model's head's; a ViT's
  ``module.apply(variables, pixel_values_BxHxWxC)`` returns the logits (:func:`from_hf_vit`)."""
  model_type = _model_type(source)
  known = ("bert", "electra", "modernbert", "vit", *hf_decoder.MODEL_TYPES)
  if model_type not in known:
    raise ValueError(f"model_type={model_type!r}; posjax converts {list(known)}")
  if model_type == "vit":
    return from_hf_vit(source)
  if model_type == "electra":
    return from_hf_electra(source)
  if model_type == "modernbert":
    return from_hf_modernbert(source)
  return from_hf_bert(source) if model_type == "bert" else from_hf_decoder(source)


def to_hf(config, variables, model_type: str | None = None, vision_from=None):
  """The Hugging Face model equal to a posjax model: a decoder (``config.lm_head == "linear"``) as its family's
  causal LM (``model_type`` or the one that expresses it; an M-RoPE decoder inside ``vision_from``, the
  vision-language checkpoint it came from), ModernBERT's layout as ModernBERT, else a BERT (:func:`to_hf_bert`)."""
  if config.lm_head == "linear":
    return to_hf_decoder(config, variables, model_type, vision_from=vision_from)
  if vision_from is not None:
    raise ValueError(f"vision_from is for an M-RoPE decoder's vision-language checkpoint; this model has "
                     f"lm_head={config.lm_head!r}")
  if is_modernbert(config) or model_type == "modernbert":
    return to_hf_modernbert(config, variables)
  if model_type not in (None, "bert"):
    raise ValueError(f"model_type={model_type!r}: a BERT-style model (lm_head={config.lm_head!r}) exports as 'bert'")
  return to_hf_bert(config, variables)


def _model_type(source) -> str:
  import os

  if isinstance(source, (str, os.PathLike)):
    path = os.path.join(os.fspath(source), "config.json")
    if not os.path.isfile(path):
      return read_source(source)[0].get("model_type", "bert")  # its error: what a model directory holds
    return read_config(path).get("model_type", "bert")
  return source.config.model_type
