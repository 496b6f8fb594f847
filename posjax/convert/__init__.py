"""Checkpoint converters: Hugging Face BERT in and out (:mod:`posjax.convert.hf_bert`).

  python -m posjax.convert hf-to-posjax --from HF_DIR --workdir OUT
  python -m posjax.convert posjax-to-hf --workdir RUN [--step N] --out HF_DIR

``transformers`` and ``torch`` (the ``convert`` extra) are imported only by the functions that need them.
"""

from posjax.convert.hf_bert import config_from_hf, config_to_hf, from_hf_bert, to_hf_bert

__all__ = ["config_from_hf", "config_to_hf", "from_hf_bert", "to_hf_bert"]
