"""Contextual Position Encoding (Golovneva, Wang, Weston, Sukhbaatar 2024) as a rule on the masked logits: its
dataclass and dense form (its kernels: :mod:`posjax.kernels.rules.cope_gpu`, :mod:`posjax.kernels.rules.cope_tpu`).

Shapes: B batch, H heads, Q query rows, L keys, K head dim, P table entries.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from posjax.kernels.rules import suffix_sums


@flax.struct.dataclass
class Cope:
  """Contextual Position Encoding (Golovneva, Wang, Weston, Sukhbaatar 2024, "Contextual Position Encoding:
  Learning to Count What's Important"), as the official layer computes it (facebookresearch/RAM): gates ``g_it =
  sigmoid(z_it)`` of the masked logits (0 at a masked key), a key's position the gates from it to the row's end,
  ``p_ij = Σ_{t >= j} g_it`` (with a causal mask: from ``j`` to the query ``i``), clamped at ``P - 1``, and the logit
  term ``q_i · e(p_ij)`` interpolated linearly between the table's integer rows ``e(floor p)`` and ``e(ceil p)``.
  ``table``: ``[K, P]`` (the official ``pos_emb``, scaled as the method adds the term), shared by the heads."""

  FIELD = "cope"  # its Terms field

  table: jax.Array  # [K, P]

  def term(self, s_BxHxQxL, allowed_Bx1xQxL, q_BxQxHxK):
    """``[B, H, Q, L]`` float32, added to the logits ``s`` (before the softmax) at the queries ``q``'s rows."""
    s_BxHxQxL = s_BxHxQxL.astype(jnp.float32)
    gates_BxHxQxL = jax.nn.sigmoid(s_BxHxQxL)
    if allowed_Bx1xQxL is not None:
      gates_BxHxQxL = jnp.where(allowed_Bx1xQxL, gates_BxHxQxL, 0.0)
    p_BxHxQxL = jnp.minimum(suffix_sums(gates_BxHxQxL, inclusive=True), self.table.shape[1] - 1)
    qe_BxHxQxP = jnp.einsum("bqhk,kp->bhqp", q_BxQxHxK.astype(jnp.float32), self.table.astype(jnp.float32),
                            precision=jax.lax.Precision.HIGHEST)
    floor_BxHxQxL = jnp.floor(p_BxHxQxL)
    row = lambda index_BxHxQxL: jnp.take_along_axis(qe_BxHxQxP, index_BxHxQxL.astype(jnp.int32), axis=-1)
    w_BxHxQxL = p_BxHxQxL - floor_BxHxQxL
    return row(jnp.ceil(p_BxHxQxL)) * w_BxHxQxL + row(floor_BxHxQxL) * (1.0 - w_BxHxQxL)
