"""Checkpoint converters: Hugging Face BERT in and out (:mod:`posjax.convert.hf_bert`), Hugging Face ELECTRA in
and out (:mod:`posjax.convert.hf_electra`: ``from_hf_electra``, ``to_hf_electra``, and ``electra_to_hf`` for a
posjax ``Electra``'s generator and discriminator), and the official TUPE code's fairseq checkpoints in
(:mod:`posjax.convert.tupe_fairseq`).

  python -m posjax.convert hf-to-posjax --from HF_DIR --workdir OUT
  python -m posjax.convert posjax-to-hf --workdir RUN [--step N] --out HF_DIR
  python -m posjax.convert tupe-to-posjax --from checkpoint_best.pt --workdir OUT

``transformers`` and ``torch`` (the ``convert`` extra) are imported only by the functions that need them.
"""

from posjax.convert.hf_bert import config_from_hf, config_to_hf, from_hf_bert, to_hf_bert
from posjax.convert.hf_electra import electra_to_hf, from_hf_electra, to_hf_electra
from posjax.convert.tupe_fairseq import from_tupe_fairseq

__all__ = ["config_from_hf", "config_to_hf", "electra_to_hf", "from_hf_bert", "from_hf_electra", "from_tupe_fairseq",
           "to_hf_bert", "to_hf_electra"]
