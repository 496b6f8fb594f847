"""Query temperature: each query scaled by a factor of its position before its logits, so that attention stays sharp
as the context grows. Three forms, each a function of the query's own position only, so a decoding step with a cache
computes exactly what the full forward does, and every kernel takes it (it acts on q, before the kernel):

- ``llama4``: Llama 4's ``attn_temperature_tuning`` (its NoPE layers), ``1 + attn_scale · log(1 + floor((p + 1) /
  floor_scale))`` (Hugging Face's ``modeling_llama4.py``; defaults ``floor_scale=8192``, ``attn_scale=0.1``).
- ``ministral``: Ministral 3's ``llama_4_scaling_beta``, ``1 + beta · log(1 + floor(p / original_max_len))``
  (defaults ``beta=0.1``, ``original_max_len=16384``).
- ``ssmax``: Scalable-Softmax (Nakanishi 2025, arXiv 2501.19399), the logits times ``s_h · log n`` with ``s`` learned
  per head and ``n`` the number of keys the query attends: ``p + 1`` in a causal layer (``min(p + 1, W)`` in a sliding
  window of ``W``), so a causal model only. ``s`` starts at ``init``, by default ``1 / log(max_len)``: the plain
  softmax at the training length (the paper leaves its initialisation open; this is the choice named here).

``p`` is the query's position (posjax's ``positions``: restarting in each packed document, not counting left
padding; Hugging Face's Llama 4 reads the cache slot, which counts left padding). Under randomised positions
(``data.random_positions``) SSMax's ``n`` is the drawn position plus one, not the count of keys. Only q is scaled: an
additive position bias (ALiBi, T5) is not.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax.numpy as jnp

from posjax.positions import base

KINDS = ("llama4", "ministral", "ssmax")


@dataclasses.dataclass(frozen=True)
class Temperature:
  """One layer's query temperature (:data:`KINDS`) with its options (the others' are ignored)."""

  kind: str
  floor_scale: float = 8192.0
  attn_scale: float = 0.1
  beta: float = 0.1
  original_max_len: int = 16384
  init: float = 0.0

  def __post_init__(self):
    base.check_choice("query_temperature kind", self.kind, KINDS)
    for field in ("floor_scale", "original_max_len"):
      if not getattr(self, field) > 0:
        raise ValueError(f"query_temperature {field} must be > 0, got {getattr(self, field)}")

  @classmethod
  def parse(cls, options) -> "Temperature | None":
    """``options`` (a mapping with ``kind`` and that kind's options; empty: none) as a Temperature; an unknown key is
    an error naming the allowed ones."""
    options = dict(options or {})
    if not options:
      return None
    allowed = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - allowed)
    if unknown or "kind" not in options:
      raise ValueError(f"query_temperature={options}: needs 'kind' ({', '.join(KINDS)}) and takes "
                       f"{sorted(allowed - {'kind'})}" + (f"; unknown {unknown}" if unknown else ""))
    return cls(**options)


class QueryTemperature(nn.Module):
  """``q [B, L, H, K]`` times its position's factor (``positions [B or 1, L]``). ``ssmax``'s ``s`` is the parameter
  ``ssmax_scale [H]``; ``window``: the layer's sliding window (0: none), which caps SSMax's ``n``, as ``chunk`` does
  (``p mod C + 1``); ``max_len``: the training length, where SSMax's default ``s`` gives a factor of 1."""

  temperature: Temperature
  causal: bool
  window: int = 0
  max_len: int = 512
  chunk: int = 0

  @nn.compact
  def __call__(self, q_BxLxHxK, positions_BxL):
    t, p_BxL = self.temperature, positions_BxL.astype(jnp.float32)
    if t.kind == "llama4":
      factor_BxLxH = (jnp.log1p(jnp.floor((p_BxL + 1.0) / t.floor_scale)) * t.attn_scale + 1.0)[..., None]
    elif t.kind == "ministral":
      factor_BxLxH = (1.0 + t.beta * jnp.log1p(jnp.floor(p_BxL / t.original_max_len)))[..., None]
    else:
      if not self.causal:
        raise ValueError("query_temperature kind 'ssmax' counts each query's keys from its position: a causal model "
                         "only (causal=True)")
      init = t.init or 1.0 / math.log(self.max_len)
      s_H = self.param("ssmax_scale", nn.with_logical_partitioning(nn.initializers.constant(init), (base.HEADS,)),
                       (q_BxLxHxK.shape[2],), jnp.float32)
      n_BxL = p_BxL + 1.0 if not self.window else jnp.minimum(p_BxL + 1.0, float(self.window))
      if self.chunk:  # a chunked layer's query attends to its chunk's keys up to itself
        n_BxL = jnp.minimum(n_BxL, jnp.mod(p_BxL, float(self.chunk)) + 1.0)
      factor_BxLxH = jnp.log(n_BxL)[..., None] * s_H
    # the product in float32 (a bf16 factor would round 1 + 0.1 log 2 to 1.0703), then cast: Hugging Face's order
    return (q_BxLxHxK.astype(jnp.float32) * factor_BxLxH[..., None]).astype(q_BxLxHxK.dtype)
