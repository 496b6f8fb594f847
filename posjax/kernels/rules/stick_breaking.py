"""Stick-breaking attention (Tan, Yang, Courville, Panda, Shen; ICLR 2025) as a rule in place of the softmax: its
dataclass and dense weights (its kernels: :mod:`posjax.kernels.rules.stick_breaking_gpu`,
:mod:`posjax.kernels.rules.stick_breaking_tpu`).

Shapes: B batch, H heads, Q query rows, L keys.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from posjax.kernels.rules import suffix_sums


@flax.struct.dataclass
class StickBreaking:
  """Stick-breaking attention (Tan, Yang, Courville, Panda, Shen; ICLR 2025): the weights are not a softmax but
  ``A_ij = β_ij Π_{j<k} (1 - β_ik)``, ``β = sigmoid(z)``, the product over the allowed keys after ``j`` (with a
  causal mask: up to the query), computed in log space; the closest key takes its share of the stick first. As the
  authors' ``sb_attn`` (shawntan/stickbreaking-attention): ``attend_current=False`` leaves the query's own key out,
  and ``remainder`` (their model's ``sb_remainder``, on by default in IBM's dolomite-engine config) gives what is
  left of the stick, ``1 - Σ_j A_ij``, to the query's own value."""

  FIELD = "stick_breaking"  # its Terms field

  attend_current: bool = flax.struct.field(pytree_node=False, default=False)
  remainder: bool = flax.struct.field(pytree_node=False, default=True)

  def weights(self, s_BxHxQxL, allowed_Bx1xQxL, rows_Q=None):
    """``[B, H, Q, L]`` float32 weights from the logits ``s`` at query rows ``rows_Q`` (default all)."""
    s_BxHxQxL = s_BxHxQxL.astype(jnp.float32)
    length = s_BxHxQxL.shape[-1]
    rows_Q = jnp.arange(length) if rows_Q is None else rows_Q
    own_QxL = jnp.arange(length)[None, :] == rows_Q[:, None]
    allowed_BxHxQxL = jnp.ones(s_BxHxQxL.shape, bool) if allowed_Bx1xQxL is None else jnp.broadcast_to(
        allowed_Bx1xQxL, s_BxHxQxL.shape)
    if not self.attend_current:
      allowed_BxHxQxL = allowed_BxHxQxL & ~own_QxL
    rest_BxHxQxL = jnp.where(allowed_BxHxQxL, jax.nn.log_sigmoid(-s_BxHxQxL), 0.0)
    log_a_BxHxQxL = jax.nn.log_sigmoid(s_BxHxQxL) + suffix_sums(rest_BxHxQxL, inclusive=False)
    a_BxHxQxL = jnp.where(allowed_BxHxQxL, jnp.exp(log_a_BxHxQxL), 0.0)
    if self.remainder:
      a_BxHxQxL = a_BxHxQxL + jnp.where(own_QxL, 1.0 - jnp.sum(a_BxHxQxL, axis=-1, keepdims=True), 0.0)
    return a_BxHxQxL
