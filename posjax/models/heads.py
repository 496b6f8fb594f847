"""The task heads on the one Transformer stack (:mod:`posjax.models.transformer`): :class:`Transformer` is the stack
with any one head (:data:`HEADS`), what every task trains and the converters build."""

from __future__ import annotations

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from posjax.models import lm_loss
from posjax.models.transformer import (ACTIVATIONS, DTYPES, MLP, VOCAB, TransformerConfig, TransformerStack, _dense,
                                       _layer_norm)
from posjax.positions import base


def mlm_head(module: nn.Module, encoder: TransformerStack, h_BxMxD):
  """BERT's MLM head, tied to the word embeddings: dense (to the embeddings' width) -> activation -> LayerNorm ->
  ``E^T`` + bias (called inside ``module``'s compact ``__call__``: its parameters are ``transform``,
  ``transform_norm``, ``output_bias``)."""
  h_BxMxE, bias_V = mlm_transform(module, encoder, h_BxMxD)
  return encoder.attend_words(h_BxMxE) + bias_V


def mlm_transform(module: nn.Module, encoder: TransformerStack, h_BxMxD):
  """``(states, output bias)`` of BERT's MLM head before its product with the word embeddings."""
  c = encoder.config
  transform = _dense(c, c.embed_width, (base.EMBED, MLP), "transform", c.head_bias)  # ModernBERT's: none
  h_BxMxE = _layer_norm(c, "transform_norm")(ACTIVATIONS[c.activation](transform(h_BxMxD)))
  return h_BxMxE, module.param("output_bias", base.zeros_init((VOCAB,)), (c.vocab_size,), DTYPES[c.param_dtype])


# Which token a sequence head reads (``classifier_token``): ``first`` ([CLS], an encoder's: BERT, TUPE, ELECTRA),
# ``last`` (the last real token, a decoder's: Hugging Face's ``LlamaForSequenceClassification`` takes each row's last
# non-padding token, the only one that has seen the whole row) or ``auto``: ``last`` for a causal model, else ``first``.
CLASSIFIER_TOKENS = ("auto", "first", "last")


def classifier_token(config: TransformerConfig, token: str = "auto") -> str:
  """``token`` (:data:`CLASSIFIER_TOKENS`) resolved for ``config``: ``first`` or ``last``. A causal model read at
  its first token is refused: that token has seen only itself."""
  base.check_choice("classifier_token", token, CLASSIFIER_TOKENS)
  if token == "auto":
    return "last" if config.causal else "first"
  if token == "first" and config.causal:
    raise ValueError("classifier_token='first' reads a causal model at its first token, which has seen only itself; "
                     "use 'last' (or 'auto')")
  return token


def pooled_token(h_BxLxD, attention_mask_BxL, token: str):
  """``[B, D]``: each row's state at its first token (``first``) or at its last real one (``last``: the rightmost
  position the attention mask keeps, as Hugging Face's decoder classifiers pick it; the first of a row with none;
  without a mask the row's last token, so a padded batch needs its ``attention_mask``: Hugging Face finds the last
  token from ``pad_token_id`` instead, which the model does not know)."""
  if token == "first":
    return h_BxLxD[:, 0]
  length = h_BxLxD.shape[1]
  if attention_mask_BxL is None:
    return h_BxLxD[:, length - 1]
  index_L = jnp.arange(length, dtype=jnp.int32)
  last_B = jnp.argmax(jnp.where(jnp.asarray(attention_mask_BxL) > 0, index_L, -1), axis=-1)
  return jnp.take_along_axis(h_BxLxD, last_B[:, None, None], axis=1)[:, 0]


def pooler(config: TransformerConfig, x_BxD):
  """The pooled token's state (:func:`pooled_token`: [CLS], or a decoder's last token) through dense -> tanh
  (parameters ``pooler``)."""
  return jnp.tanh(_dense(config, config.hidden_size, (base.EMBED, MLP), "pooler")(x_BxD))


# What a sequence classifier reads of the pooled token (:data:`CLASSIFIER_TOKENS`): BERT's pooler (its state through
# dense -> tanh; BERT's and TUPE's heads) or its state itself (ELECTRA's: its ``get_pooled_output`` is
# ``sequence_output[:, 0]``; at a decoder's last token, Hugging Face's ``LlamaForSequenceClassification``'s ``score``).
CLASSIFIER_INPUTS = ("pooler", "cls")


def classification_head(config: TransformerConfig, num_labels: int, x_BxD, deterministic: bool,
                        classifier_input: str = "pooler"):
  """The sequence head on the pooled token's state ``x_BxD`` (:func:`pooled_token`): ``classifier_input``
  (:data:`CLASSIFIER_INPUTS`) -> dropout -> ``num_labels`` outputs (``classifier``). ``pooler``: TUPE's and BERT's;
  ``cls``: ELECTRA's, one dense layer on the state (its kernel drawn N(0, 0.02) as every posjax dense layer; the
  official code's ``tf.layers.dense`` draws Glorot; Hugging Face's decoder ``score`` has no bias, which starts at 0
  here)."""
  base.check_choice("classifier_input", classifier_input, CLASSIFIER_INPUTS)
  x_BxD = pooler(config, x_BxD) if classifier_input == "pooler" else x_BxD
  x_BxD = nn.Dropout(config.dropout_rate)(x_BxD, deterministic=deterministic)
  return _dense(config, num_labels, (base.EMBED, None), "classifier")(x_BxD).astype(jnp.float32)


def rtd_head(config: TransformerConfig, h_BxLxD):
  """ELECTRA's discriminator head: dense -> activation -> one logit per token, ``[B, L]``, that it was replaced
  (parameters ``rtd``, ``rtd_output``; Clark et al. 2020)."""
  h_BxLxD = ACTIVATIONS[config.activation](_dense(config, config.hidden_size, (base.EMBED, MLP), "rtd")(h_BxLxD))
  return _dense(config, 1, (MLP, None), "rtd_output")(h_BxLxD)[..., 0].astype(jnp.float32)


def span_head(config: TransformerConfig, h_BxLxD):
  """SQuAD's start and end logits, ``[B, L]`` each (parameters ``span``)."""
  logits = _dense(config, 2, (base.EMBED, None), "span")(h_BxLxD).astype(jnp.float32)
  return logits[..., 0], logits[..., 1]


@flax.struct.dataclass
class TransformerOutput:
  """What :class:`Transformer` returns: the encoder's last states and, per its head, the head's outputs."""
  last_hidden_state: jax.Array
  pooler_output: jax.Array | None = None
  logits: jax.Array | None = None  # MLM [B, L, V] (or [B, M, V]), classification [B, num_labels], rtd [B, L]
  start_logits: jax.Array | None = None
  end_logits: jax.Array | None = None
  token_loss: jax.Array | None = None  # lm with labels: [B, L] cross-entropy per token (lm_loss.token_losses)
  token_correct: jax.Array | None = None  # and [B, L] 1.0 where the argmax is the label


HEADS = ("none", "pooler", "mlm", "lm", "classification", "span", "rtd")


class Transformer(nn.Module):
  """The encoder with any one head (:data:`HEADS`), returning a :class:`TransformerOutput` (the shape of Hugging Face's
  outputs): every task's model and what the checkpoint converters build. Parameters: ``encoder`` and the head's
  (``transform`` / ``transform_norm`` / ``output_bias``, ``pooler``, ``classifier``, ``span``, ``rtd``), so a
  checkpoint of one head starts a run of any other.

  ``mlm``: BERT's head tied to the word embeddings, ``[B, L, V]``, or with ``masked_positions [B, M]`` only at
  those, ``[B, M, V]`` (an index outside the sequence gives NaN logits, never another token's). ``lm``: the
  language-model head ``config.lm_head`` names: BERT's (``mlm``) or the decoders' ``linear`` one (tied or
  ``encoder/lm_head``); with ``labels [B, L]`` (token i's target) it returns ``token_loss`` and ``token_correct``
  ``[B, L]`` instead of logits, ``loss_chunk`` sequence positions of ``[B, C, V]`` logits at a time, forward and
  backward (:func:`posjax.models.lm_loss.token_losses`, ``z_loss``: PaLM's auxiliary ``logsumexp²`` term).
  ``classification``: ``num_labels`` outputs (1: a regression, STS-B) on the pooled token's state
  (``classifier_token``, :func:`classifier_token`: [CLS] of an encoder, the last real token of a causal model),
  through BERT's pooler or, ``classifier_input="cls"``, directly (ELECTRA's; :func:`classification_head`).
  ``span``: SQuAD's start and end logits, per token (a decoder's as Hugging Face's ``LlamaForQuestionAnswering``).
  ``rtd``: ELECTRA's replaced-token logits. ``pooler``: the pooled token's state through the pooler."""

  config: TransformerConfig
  head: str = "none"
  num_labels: int = 2
  classifier_input: str = "pooler"
  classifier_token: str = "auto"

  @nn.compact
  def __call__(self, input_ids, *, masked_positions=None, labels=None, loss_chunk: int = 0, z_loss: float = 0.0,
               deterministic: bool = True, **encoder_kwargs) -> TransformerOutput:
    base.check_choice("head", self.head, HEADS)
    encoder = TransformerStack(self.config, name="encoder")
    h = encoder(input_ids, deterministic=deterministic, **encoder_kwargs).last_hidden_state
    if self.head in ("pooler", "classification"):
      token = classifier_token(self.config, self.classifier_token)
      if token == "last" and encoder_kwargs.get("segment_ids") is not None:
        raise ValueError(f"head {self.head!r} reads each row's last real token, one per row; rows of packed "
                         "documents (segment_ids) would be read at their last document only: give one sequence a row")
      x_BxD = pooled_token(h, encoder_kwargs.get("attention_mask"), token)
    if self.head == "pooler":
      return TransformerOutput(h, pooler_output=pooler(self.config, x_BxD))
    if self.head == "lm" and labels is not None:  # per-token losses, never the [B, L, V] logits
      linear = self.config.lm_head == "linear"
      x, bias_V = (h, None) if linear else mlm_transform(self, encoder, h)
      matrix, layout_ = encoder.word_matrix()
      loss_BxL, correct_BxL = lm_loss.token_losses(x, matrix, layout_, bias_V, labels, chunk=loss_chunk, z_loss=z_loss,
                                                   softcap=self.config.final_logit_softcap)
      return TransformerOutput(h, token_loss=loss_BxL, token_correct=correct_BxL)
    if self.head in ("mlm", "lm"):
      at = h if masked_positions is None else jnp.take_along_axis(h, masked_positions[..., None], axis=1,
                                                                  mode="fill", fill_value=jnp.nan)
      logits = (encoder.attend_words(at) if self.head == "lm" and self.config.lm_head == "linear"
                else mlm_head(self, encoder, at))
      return TransformerOutput(h, logits=lm_loss.soft_cap(logits, self.config.final_logit_softcap))
    if self.head == "classification":
      return TransformerOutput(h, logits=classification_head(self.config, self.num_labels, x_BxD, deterministic,
                                                      self.classifier_input))
    if self.head == "span":
      start, end = span_head(self.config, h)
      return TransformerOutput(h, start_logits=start, end_logits=end)
    if self.head == "rtd":
      return TransformerOutput(h, logits=rtd_head(self.config, h))
    return TransformerOutput(h)
