"""Attention sinks: a learned logit per head in every query row's softmax denominator (GPT-OSS's ``sinks``; the sink
of Xiao et al. 2024 without its value), so that a row may give its keys less than all of its weight:
``w_ij = exp(s_ij) / (exp(sink_h) + Σ_j exp(s_ij))``.

Not a term of the tiles: the kernels' online softmax runs as without it, and its row statistics (maximum, sum) take
the sink afterwards (:func:`rescale`), before they are kept for the backward pass, whose kernels then recompute the
sinked weights from them unchanged; the sink's own gradient is ``-Σ_i w_i,sink · δ_i`` with ``δ_i = dO_i · O_i``
(:func:`gradient`). Shapes: B batch, H heads, Q query rows, L keys; a row statistic ``[B, H, Q]`` or with the TPU
kernels' replicated lanes ``[B, H, Q, T]``.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class Sink:
  """``logits [H]``: each head's sink logit, on the scale of the attention logits (after ``scale q·k`` and the
  position terms)."""

  logits: jax.Array

  def check(self, num_heads: int) -> None:
    if jnp.shape(self.logits) != (num_heads,):
      raise ValueError(f"Sink.logits has shape {jnp.shape(self.logits)}; expected ({num_heads},), one per query head")

  def _per_row(self, ndim: int):
    return self.logits.astype(jnp.float32).reshape((1, -1) + (1,) * (ndim - 2))

  def weights(self, s_BxHxQxL):
    """The dense weights of masked logits (a masked logit the most negative float32, as the softmax takes them):
    a row without an allowed key gives its keys almost nothing, as the kernels' rows do."""
    s_BxHxQxL = s_BxHxQxL.astype(jnp.float32)
    sink_1xHx1x1 = self._per_row(4)
    m_BxHxQx1 = jnp.maximum(jnp.max(s_BxHxQxL, axis=-1, keepdims=True), sink_1xHx1x1)
    e_BxHxQxL = jnp.exp(s_BxHxQxL - m_BxHxQx1)
    return e_BxHxQxL / (jnp.sum(e_BxHxQxL, axis=-1, keepdims=True) + jnp.exp(sink_1xHx1x1 - m_BxHxQx1))


def rescale(sink: Sink, out_BxHxQxV, row_max, row_sum):
  """``(out, row_max, row_sum)`` of a kernel's softmax rows with the sink in their denominators: the output times
  the keys' share of the new sum, the statistics the sinked softmax's (``[B, H, Q]`` or ``[B, H, Q, T]``)."""
  sink_ = sink._per_row(row_max.ndim)
  new_max = jnp.maximum(row_max, sink_)
  kept = row_sum * jnp.exp(row_max - new_max)
  new_sum = kept + jnp.exp(sink_ - new_max)
  share = (kept / new_sum)[..., None] if row_max.ndim == out_BxHxQxV.ndim - 1 else (kept / new_sum)[..., :1]
  return (out_BxHxQxV.astype(jnp.float32) * share).astype(out_BxHxQxV.dtype), new_max, new_sum


def gradient(sink: Sink, row_max, row_sum, delta) -> Sink:
  """The sink's gradient from the sinked statistics and ``delta = Σ_v dO · O`` (shaped as the statistics, or with
  one trailing lane): ``-Σ_{b, i} exp(sink_h - m_i) / l_i · δ_i`` per head."""
  sink_ = sink._per_row(row_max.ndim)
  weight = jnp.exp(sink_ - row_max) / row_sum
  if weight.ndim == 4:  # the TPU kernels' lanes repeat each row's statistic
    weight = weight[..., 0]
  delta = delta.reshape(weight.shape)
  d_H = -jnp.sum(weight * delta.astype(jnp.float32), axis=(0, 2))
  return Sink(d_H.astype(sink.logits.dtype))
