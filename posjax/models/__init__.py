"""Models: one Transformer stack (the BERT encoder and the Llama-family decoder are its presets) and its heads."""

from posjax.models.bert import (DECODER_SIZES, HEADS, SIZES, BertConfig, BertEncoder, BertModel, BertOutput,
                                EncoderOutput)

__all__ = ["DECODER_SIZES", "HEADS", "SIZES", "BertConfig", "BertEncoder", "BertModel", "BertOutput", "EncoderOutput"]
