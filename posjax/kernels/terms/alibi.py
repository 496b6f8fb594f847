"""ALiBi (Press, Smith, Lewis; ICLR 2022): ``-m_h |p_j - p_i|``, one fixed slope per head, as an open term
(:mod:`posjax.kernels.term`): the kernels derive its slopes' gradient per tile (kept: cheap, and exact should one
learn them)."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from posjax.kernels.term import HEAD, Term


@flax.struct.dataclass
class Alibi(Term):
  """ALiBi's fixed slopes, one per head (constants in the paper)."""

  slopes: jax.Array  # [H]
  KINDS = {"slopes": HEAD}

  def check(self, batch: int, num_heads: int, head_dim: int, length: int) -> None:
    """Shapes and options, with errors that say what was given and what is allowed."""
    del batch, head_dim, length
    if jnp.shape(self.slopes) != (num_heads,):
      raise ValueError(f"ALiBi slopes have shape {jnp.shape(self.slopes)}; expected ({num_heads},) (one per head)")

  def logits(self, tile, s):
    return s - tile.head("slopes") * jnp.abs(tile.k_positions - tile.q_positions).astype(jnp.float32)
