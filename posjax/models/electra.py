"""ELECTRA (Clark, Luong, Le, Manning, ICLR 2020): a small generator trained by masked LM, and a discriminator
that tells, for every token, whether the generator replaced it.

Parameter layout: the discriminator is ``encoder`` (so a fine-tuning run started from an ELECTRA checkpoint reads
it as it reads a BERT one) with its head ``rtd`` / ``rtd_output``; the generator is ``generator`` with its MLM
head ``generator_head``. As in the official code (``untied_generator_embeddings=False``), the generator reads the
discriminator's embeddings - word, token type, an input position table and their LayerNorm are one set of
arrays - through its own ``embeddings_project`` where the widths differ; every other weight, the position terms
inside the layers included (T5's, TUPE's projections), is each model's own. ``share_position_table``: the
generator reads the discriminator's TUPE table and its LayerNorm too (its projections take the table's width).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import flax.linen as nn
import jax.numpy as jnp

from posjax.models.heads import mlm_head, rtd_head
from posjax.models.transformer import TransformerConfig, TransformerStack


@dataclasses.dataclass(frozen=True)
class ElectraConfig:
  """The two models' configs. ``model_config.json`` of an ELECTRA run holds the discriminator's fields (what a
  fine-tuning run reads as its encoder) and the generator's under ``generator``."""
  generator: TransformerConfig
  discriminator: TransformerConfig

  @property
  def position(self) -> str:
    return self.discriminator.position

  def to_dict(self) -> dict:
    return {**self.discriminator.to_dict(), "generator": self.generator.to_dict()}

  @classmethod
  def from_dict(cls, fields: Mapping[str, Any]) -> "ElectraConfig":
    fields = dict(fields)
    if "generator" not in fields:
      raise ValueError("not an ELECTRA model config: it has no 'generator' fields")
    return cls(TransformerConfig(**fields.pop("generator")), TransformerConfig(**fields))


class MlmHead(nn.Module):
  """BERT's MLM head on another module's encoder (its word embeddings), as a module of its own."""
  config: TransformerConfig

  @nn.compact
  def __call__(self, encoder: TransformerStack, h_BxMxD):
    return mlm_head(self, encoder, h_BxMxD)


class Electra(nn.Module):
  """The generator and the discriminator (see the module docstring).

  ``generate`` gives the generator's logits at the masked positions, ``discriminate`` the discriminator's
  replaced-token logits ``[B, L]``; calling the module runs both (what ``init`` needs)."""

  generator_config: TransformerConfig
  discriminator_config: TransformerConfig
  tie_embeddings: bool = True
  share_position_table: bool = False  # a table inside the layers (TUPE's) read by both models

  def setup(self):
    self.encoder = TransformerStack(self.discriminator_config)
    self.generator = TransformerStack(self.generator_config, shared=self.encoder if self.tie_embeddings else None,
                                      shared_position_table=self.share_position_table)
    self.generator_head = MlmHead(self.generator_config)

  def generate(self, input_ids_BxL, masked_positions_BxM, *, deterministic: bool = True, **encoder_kwargs):
    """``[B, M, V]`` logits of the generator at ``masked_positions`` (NaN rows for indices outside the
    sequence, as :class:`posjax.models.Transformer`'s ``mlm`` head)."""
    h_BxLxD = self.generator(input_ids_BxL, deterministic=deterministic, **encoder_kwargs).last_hidden_state
    h_BxMxD = jnp.take_along_axis(h_BxLxD, masked_positions_BxM[..., None], axis=1, mode="fill",
                                  fill_value=jnp.nan)
    return self.generator_head(self.generator, h_BxMxD)

  def discriminate(self, input_ids_BxL, *, deterministic: bool = True, **encoder_kwargs):
    """``[B, L]`` logits that each token was replaced."""
    h_BxLxD = self.encoder(input_ids_BxL, deterministic=deterministic, **encoder_kwargs).last_hidden_state
    return self._rtd(h_BxLxD)

  @nn.compact
  def _rtd(self, h_BxLxD):
    return rtd_head(self.discriminator_config, h_BxLxD)

  def __call__(self, input_ids_BxL, masked_positions_BxM=None, *, deterministic: bool = True, **encoder_kwargs):
    if masked_positions_BxM is None:
      masked_positions_BxM = jnp.zeros((input_ids_BxL.shape[0], 1), jnp.int32)
    return (self.generate(input_ids_BxL, masked_positions_BxM, deterministic=deterministic, **encoder_kwargs),
            self.discriminate(input_ids_BxL, deterministic=deterministic, **encoder_kwargs))
