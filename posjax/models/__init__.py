"""Models: the BERT encoder and its task heads."""

from posjax.models.bert import HEADS, SIZES, BertConfig, BertEncoder, BertModel, BertOutput, EncoderOutput

__all__ = ["HEADS", "SIZES", "BertConfig", "BertEncoder", "BertModel", "BertOutput", "EncoderOutput"]
