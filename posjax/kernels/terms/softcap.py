"""The attention logits' soft cap (Gemma 2's ``attn_logit_softcapping``; Grok's): ``cap · tanh(s / cap)`` of the
score so far, an open term (:mod:`posjax.kernels.term`) that modifies the score rather than adding to it, so it goes
last in a call's terms (``terms=(Terms(...), SoftCap(50.0))``)."""

from __future__ import annotations

import flax.struct
import jax.numpy as jnp

from posjax.kernels.term import Term


@flax.struct.dataclass
class SoftCap(Term):
  """``cap · tanh(s / cap)``: the score bounded to ``(-cap, cap)``, near ``s`` where ``|s|`` is well below ``cap``."""

  cap: float = flax.struct.field(pytree_node=False, default=50.0)
  KINDS = {}

  def check(self, batch: int, num_heads: int, head_dim: int, length: int) -> None:
    del batch, num_heads, head_dim, length
    if not self.cap > 0:
      raise ValueError(f"SoftCap(cap={self.cap}): the cap must be > 0")

  def logits(self, tile, s):
    return self.cap * jnp.tanh(s / self.cap)
