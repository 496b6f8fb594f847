"""Sandwich (Chi, Fan, Rudnicky, Ramadge; ACL 2023, "Dissecting Transformer Length Extrapolation via the Lens of
Receptive Field Analysis"): the inner product of the query's and the key's sinusoidal embeddings as a fixed bias,
no parameters::

    b_h(i, j) = λ (pe_h(p_i) · pe_h(p_j) - dim/2) = λ (Σ_f cos(r ω_f / ρ_h) - dim/2),   ω_f = base^(-2f/dim)

``r = p_j - p_i``, ``f < dim/2``. The inner product decays with ``|r|`` (roughly logarithmically, the paper's
receptive-field argument); the offset makes ``b(0) = 0`` and changes no attention weight. ``dim`` is the
embeddings' own dimension, not the model's (the paper finds a larger one extrapolates better; 128 here).
[unconfirmed] The per-head compression: ``compression="alibi"`` divides head ``n``'s positions (n = 1..H) by
``ρ_n = 8n / H``, ALiBi's head ratios (head 1 the most local), as the paper's multi-head form follows ALiBi's;
``"none"`` gives every head the same bias. ``scale`` is ``λ`` (1). The authors' own code could not be read to
confirm these choices. NVIDIA NeMo's ``SandwichRelativePositionEmbedding`` differs in three ways, each an option:
it divides each head's bias rather than its positions by ``8n/H`` (``compression="bias"``), uses the attention
head's dimension (``dim=None``) and starts its frequencies at ``f = 1`` (``first_frequency=1``): NeMo's form is
``compression=bias,dim=None,first_frequency=1``. It is a :class:`posjax.kernels.Sandwich` term: every kernel
computes it (the Pallas kernels build each tile's embeddings from the positions).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from posjax import kernels
from posjax.positions import base

COMPRESSIONS = ("alibi", "bias", "none")


@dataclasses.dataclass(frozen=True)
class SandwichOptions:
  """dim: the sinusoidal embeddings' dimension (128, even; None: the attention head's). base: their longest
  wavelength over 2π (10,000). compression: ``alibi`` (head n's positions divided by 8n/H), ``bias`` (head n's bias
  divided by 8n/H, NeMo's) or ``none``. scale: λ on the bias (1.0). first_frequency: the first frequency's index f
  (0; NeMo's 1)."""

  dim: int | None = 128
  base: float = 10_000.0
  compression: str = "alibi"
  scale: float = 1.0
  first_frequency: int = 0

  def __post_init__(self):
    if not (self.dim is None or (isinstance(self.dim, int) and self.dim >= 2 and self.dim % 2 == 0)):
      raise ValueError(f"dim={self.dim!r} must be an even integer >= 2 (or None for the attention head's)")
    if not (isinstance(self.first_frequency, int) and self.first_frequency >= 0):
      raise ValueError(f"first_frequency={self.first_frequency!r} must be an integer >= 0")
    if self.compression not in COMPRESSIONS:
      raise ValueError(f"compression={self.compression!r}; allowed: {list(COMPRESSIONS)}")
    if not self.base > 1:
      raise ValueError(f"base={self.base} must be > 1")


def ratios(num_heads: int, compression: str) -> np.ndarray:
  """``[H]`` each head's ratio ``ρ = 8n/H`` (``alibi``: its positions are divided by it; ``bias``: its bias), or 1
  (``none``)."""
  if compression == "none":
    return np.ones(num_heads, np.float32)
  return (8.0 * np.arange(1, num_heads + 1) / num_heads).astype(np.float32)


class SandwichBias(nn.Module):
  """Sandwich's encoder-level part: the fixed bias every layer adds (and its kernel term)."""

  spec: base.PositionSpec

  @nn.compact
  def __call__(self, positions_BxL):
    base.check_rows("positions", positions_BxL)
    o = self.spec.options
    dim = o.dim or self.spec.head_dim
    if dim % 2:
      raise ValueError(f"sandwich dim=None takes the head dimension, {dim}, which is odd; name an even dim")
    term = kernels.Sandwich(jnp.asarray(ratios(self.spec.num_heads, o.compression)), dim=dim, base=o.base,
                            scale=o.scale, divide="bias" if o.compression == "bias" else "positions",
                            first=o.first_frequency)
    return base.PositionState.build(positions_BxL, terms=kernels.Terms(sandwich=term))


base.register(base.Method("sandwich", SandwichOptions, encoder=SandwichBias,
                          summary="Sandwich: the inner product of sinusoidal embeddings as a bias (Chi et al. 2023)"))
