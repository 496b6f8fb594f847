"""Models: the BERT encoder and its task heads."""

from posjax.models.bert import (BertConfig, BertEncoder, BertForMaskedLM, BertForQuestionAnswering,
                                BertForSequenceClassification, EncoderOutput, SIZES)

__all__ = ["BertConfig", "BertEncoder", "BertForMaskedLM", "BertForQuestionAnswering",
           "BertForSequenceClassification", "EncoderOutput", "SIZES"]
