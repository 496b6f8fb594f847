"""Stick-breaking attention (Tan, Yang, Courville, Panda, Shen; ICLR 2025, "Scaling Stick-Breaking Attention: An
Efficient Implementation and In-depth Study"; official code shawntan/stickbreaking-attention): no softmax and no
position encoding. Each key ``j`` takes ``β_ij = sigmoid(z_ij)`` of what the keys closer to the query left of the
stick, ``A_ij = β_ij Π_{j<k<i} (1 - β_ik)``, computed in log space; the order of the keys is the only position
signal, and the closest key that matches wins.

Options, as the authors' kernel and model:

- ``attend_current``: the query's own key among the keys (default False, the kernel's ``attend_current``).
- ``remainder``: give what is left of the stick, ``1 - Σ_j A_ij``, to the query's own value (default True: the
  model's ``sb_remainder``, on in IBM's dolomite-engine config of the released models).

A decoder's method only (:func:`posjax.positions.make` refuses it without ``causal``). Packed documents: the mask
keeps each product inside its document. It is a :class:`posjax.kernels.StickBreaking` weight rule beside the logit
terms: the dense ``xla`` path computes it (training and decoding) and so do both Pallas backends (each query tile
walks its key tiles from the diagonal back, carrying each row's ``Σ log(1 - β)``; the backward's carries at every key
tile, ``O(L² / block)`` float32, pass from the dq kernel to the dk/dv kernel: no atomics); not yet the decode kernels
(decoding runs on the dense formulas), and not cuDNN.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn

from posjax import kernels
from posjax.positions import base


@dataclasses.dataclass(frozen=True)
class StickBreakingOptions:
  """attend_current: the query's own key is one of its keys (False). remainder: the rest of the stick goes to the
  query's own value (True)."""

  attend_current: bool = False
  remainder: bool = True


class StickBreakingLayer(nn.Module):
  """The weight rule of every layer (no parameters)."""

  spec: base.PositionSpec

  def __call__(self, q, k, state: base.PositionState, scale):
    o = self.spec.options
    rule = kernels.StickBreaking(attend_current=o.attend_current, remainder=o.remainder)
    return base.LayerTerms(q, k, terms=kernels.Terms(stick_breaking=rule))


base.register(base.Method("stick_breaking", StickBreakingOptions, layer=StickBreakingLayer,
                          decoder_only=True,
                          summary="stick-breaking attention: each key takes a sigmoid's share of what closer keys "
                                  "left, no softmax (Tan et al. 2025)"))
