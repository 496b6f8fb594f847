"""Models: one Transformer stack (:mod:`posjax.models.transformer`; BERT, the Llama-family decoder, Gemma and ModernBERT
are presets of its config) and its heads (:mod:`posjax.models.heads`).

The names before 0.2.0, ``BertConfig``, ``BertEncoder``, ``BertModel`` and ``BertOutput``, are deprecated aliases of
``TransformerConfig``, ``TransformerStack``, ``Transformer`` and ``TransformerOutput`` (a ``DeprecationWarning`` when
read), kept for one release.
"""

import warnings

from posjax.models.heads import HEADS, Transformer, TransformerOutput
from posjax.models.transformer import (DECODER_SIZES, SIZES, EncoderOutput, TransformerConfig, TransformerStack)

__all__ = ["DECODER_SIZES", "HEADS", "SIZES", "EncoderOutput", "Transformer", "TransformerConfig", "TransformerOutput",
           "TransformerStack"]

DEPRECATED = {"BertConfig": "TransformerConfig", "BertEncoder": "TransformerStack", "BertModel": "Transformer",
              "BertOutput": "TransformerOutput"}


def __getattr__(name: str):
  """The deprecated names (:data:`DEPRECATED`), with a warning that names their replacement."""
  if name in DEPRECATED:
    warnings.warn(f"posjax.models.{name} is deprecated: use posjax.models.{DEPRECATED[name]} (the same class; the "
                  "old name goes in the next release)", DeprecationWarning, stacklevel=2)
    return globals()[DEPRECATED[name]]
  raise AttributeError(f"module 'posjax.models' has no attribute {name!r}")
