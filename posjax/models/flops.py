"""Model FLOPs of a training step of the stack (BERT or a decoder): the numerator of model FLOP utilisation (MFU),
counted from the architecture, as PaLM's appendix B counts them (Chowdhery et al. 2022).

Forward and backward are 3 x the forward's matrix products; rematerialisation's recomputation is not counted (it is
hardware work, not model work), and neither are element-wise operations or the causal mask's skipped half (PaLM's
convention). Per step of ``T`` tokens of length ``L``: ``6 N T + 12 layers L H K T + 6 W M``: ``N`` the layers'
weights (q and out ``d H K`` each, k and v ``d G K`` each with ``G`` key/value heads, the MLP ``2 d F``, or ``3 d F``
gated, plus the input projection where the embeddings are narrower), the attention scores and weighted sums, and the
head's ``W`` weights (BERT's MLM transform and tied output layer, ``d e + e V``; a decoder's linear head, ``d V``)
over the ``M`` tokens it reads (the masked positions; every token for next-token prediction).
XLA's own count differs: it counts a loop's body once (accumulation, scanned layers) and no Pallas kernel.
"""

from __future__ import annotations


def train_step_flops(config, tokens: int, length: int, head_tokens: int = 0) -> float:
  """Model FLOPs of one training step of ``config`` (a :class:`posjax.models.TransformerConfig`) over ``tokens`` tokens
  of sequences ``length`` long, the head reading ``head_tokens`` of them."""
  d, e, spec = config.hidden_size, config.embed_width, config.position_spec
  heads, kv_heads, head_dim = spec.num_heads, spec.kv_heads, spec.head_dim
  mlp = (3 if getattr(config, "mlp", "dense") == "gated" else 2) * d * config.intermediate_size
  weights = config.num_layers * (2 * d * head_dim * (heads + kv_heads) + mlp) + (d * e if e != d else 0)
  attention = 12 * config.num_layers * length * heads * head_dim * tokens
  linear = getattr(config, "lm_head", "mlm") == "linear"
  head_weights = d * config.vocab_size if linear else d * e + e * config.vocab_size
  return float(6 * weights * tokens + attention + 6 * head_weights * head_tokens)
