"""Model FLOPs of a BERT training step: the numerator of model FLOP utilisation (MFU), counted from the
architecture, as PaLM's appendix B counts them (Chowdhery et al. 2022).

Forward and backward are 3 x the forward's matrix products; rematerialisation's recomputation is not counted (it is
hardware work, not model work), and neither are element-wise operations. Per step of ``T`` tokens of length ``L``:
``6 N T + 12 layers L d T + 6 (d e + e V) M``: ``N`` the layers' weights (``4 d^2 + 2 d F`` each, plus the input
projection where the embeddings are narrower), the attention scores and weighted sums, and the MLM head (its
transform and the tied output layer) over the ``M`` tokens it reads (the masked positions; 0 for a task without it).
XLA's own count differs: it counts a loop's body once (accumulation, scanned layers) and no Pallas kernel.
"""

from __future__ import annotations


def train_step_flops(config, tokens: int, length: int, head_tokens: int = 0) -> float:
  """Model FLOPs of one training step of ``config`` (a :class:`posjax.models.BertConfig`) over ``tokens`` tokens
  of sequences ``length`` long, the MLM head reading ``head_tokens`` of them."""
  d, e = config.hidden_size, config.embed_width
  weights = config.num_layers * (4 * d * d + 2 * d * config.intermediate_size) + (d * e if e != d else 0)
  attention = 12 * config.num_layers * length * d * tokens
  head = 6 * (d * e + e * config.vocab_size) * head_tokens
  return float(6 * weights * tokens + attention + head)
