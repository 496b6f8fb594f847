"""Contextual Position Encoding, CoPE (Golovneva, Wang, Weston, Sukhbaatar 2024, "Contextual Position Encoding:
Learning to Count What's Important"; official code facebookresearch/RAM, ``projects/cope``): a key's position is
counted by the query, not by the token index. Gates ``g_ij = sigmoid(z_ij)`` of the scaled causal logits say which
keys the query counts; key ``j``'s position is the count from it to the query, ``p_ij = Σ_{t=j..i} g_it``, clamped at
``npos - 1``; and the logits gain ``q_i · e(p_ij)``, interpolated between the integer rows of a learned table ``e``
(``[head_dim, npos]`` per layer, shared by the heads, starting at zero: the official ``pos_emb``), so a model counts
words, sentences or any unit its gates pick. As the official layer: the gates read the logits after the mask (a
masked key counts nothing) and no other position signal is added.

Options, as the official layer's:

- ``npos_max``: the table's rows ``npos`` (the official ``cope_npos``); default None: ``max_len + 1`` (the official
  default, the block size + 1: a count runs from 0 to the length). Every path computes ``q·e[n]`` for every token
  and entry (``[B, H, L, npos]``), quadratic in the length at the default: a long-context run sets a smaller
  ``npos_max`` (counts past it are clamped).
- ``scaled``: the term divided by ``sqrt(head_dim)`` with the content logits (default True: the official default;
  False: the official ``cope_nodiv``, the term added unscaled, as the paper's listing writes it).

The official ``cope_sep_key``, ``cope_val_gates``, ``cope_layers`` and ``cope_shared`` (gates from another key or from
the values, CoPE every k layers, one table for all layers) are left out.

A decoder's method only (:func:`posjax.positions.make` refuses it without ``causal``). Packed documents: the mask
keeps each count inside its document. It is a :class:`posjax.kernels.Cope` term, which reads the masked logits: the
dense ``xla`` path computes it (training and decoding, where the cache's keys give each new query its counts), and
so do both Pallas backends (each query tile walks its key tiles from the diagonal back, carrying each row's count;
the table's entries gathered per pair on GPU, selected per entry on TPU; the backward walks twice, its carries passed
to the dk/dv kernel); not yet the decode kernels (decoding runs on the dense formulas), and not cuDNN.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn

from posjax import kernels
from posjax.positions import base


@dataclasses.dataclass(frozen=True)
class CopeOptions:
  """npos_max: the learned table's rows, positions 0 .. npos_max - 1 (None: max_len + 1). scaled: the term divided
  by sqrt(head_dim) as the content logits (True)."""

  npos_max: int | None = None
  scaled: bool = True

  def __post_init__(self):
    if self.npos_max is not None and self.npos_max < 2:
      raise ValueError(f"npos_max={self.npos_max} must be >= 2 (positions 0 .. npos_max - 1 are interpolated)")


class CopeLayer(nn.Module):
  """One layer's table ``[K, npos_max]`` as a :class:`posjax.kernels.Cope` term."""

  spec: base.PositionSpec

  @nn.compact
  def __call__(self, q, k, state: base.PositionState, scale):
    spec, o = self.spec, self.spec.options
    table_KxP = self.param("pos_emb", base.zeros_init((base.KV, base.POSITION)),
                           (spec.head_dim, o.npos_max or spec.max_len + 1), spec.param_dtype)
    if o.scaled:  # (q·k + q·e) / sqrt(d): the table's share of the scale
      table_KxP = table_KxP * scale
    return base.LayerTerms(q, k, terms=kernels.Terms(cope=kernels.Cope(table_KxP)))


base.register(base.Method("cope", CopeOptions, layer=CopeLayer, decoder_only=True,
                          summary="Contextual Position Encoding: positions counted by gates on the logits, a learned "
                                  "table interpolated (Golovneva et al. 2024)"))
