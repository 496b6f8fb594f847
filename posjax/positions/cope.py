"""Contextual Position Encoding, CoPE (Golovneva, Wang, Weston, Sukhbaatar 2024, "Contextual Position Encoding:
Learning to Count What's Important"): a key's position is counted by the query, not by the token index. Gates
``g_ij = sigmoid(z_ij)`` of the scaled causal logits say which keys the query counts; key ``j``'s position is the
count from it to the query, ``p_ij = Σ_{t=j..i} g_it``, clamped at ``npos_max - 1``; and the logits gain ``q_i ·
e(p_ij)``, interpolated between the integer rows of a learned table ``e`` (``[head_dim, npos_max]`` per layer,
shared by the heads, starting at zero: the paper's ``pos_emb``), so a model counts words, sentences or any unit its
gates pick. As the paper's code: the gates read the logits after the mask (a masked key counts nothing), ``q`` enters
unscaled, and no other position signal is added.

Options: ``npos_max``, the table's rows (the largest position; default 64 [unconfirmed]: the paper's code takes it as
an argument, and 64 covers a tiny model's training lengths; a long-context run may want more).

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
  """npos_max: the learned table's rows, positions 0 .. npos_max - 1 (64)."""

  npos_max: int = 64

  def __post_init__(self):
    if self.npos_max < 2:
      raise ValueError(f"npos_max={self.npos_max} must be >= 2 (positions 0 .. npos_max - 1 are interpolated)")


class CopeLayer(nn.Module):
  """One layer's table ``[K, npos_max]`` as a :class:`posjax.kernels.Cope` term."""

  spec: base.PositionSpec

  @nn.compact
  def __call__(self, q, k, state: base.PositionState, scale):
    spec = self.spec
    table_KxP = self.param("pos_emb", base.zeros_init((base.KV, base.POSITION)),
                           (spec.head_dim, spec.options.npos_max), spec.param_dtype)
    return base.LayerTerms(q, k, terms=kernels.Terms(cope=kernels.Cope(table_KxP)))


base.register(base.Method("cope", CopeOptions, layer=CopeLayer, softmax=False, decoder_only=True,
                          summary="Contextual Position Encoding: positions counted by gates on the logits, a learned "
                                  "table interpolated (Golovneva et al. 2024)"))
