"""Context-extension variants of a RoPE model for the length harness (:mod:`posjax.experiments.length`): each a set
of RoPE position options (:class:`posjax.positions.rotary.RopeOptions`) that stretches a model trained at
``train_len`` by ``factor``, evaluated zero-shot and after a short fine-tune at ``train_len * factor``.

- ``unscaled``: RoPE as trained (the baseline; fine-tuned, it is plain longer-context training).
- ``pi``: position interpolation (Chen et al. 2023): every frequency divided by the factor (``scaling="linear"``).
- ``ntk``: NTK-aware scaling (bloc97 2023; Peng et al. 2023 section 3.1) in its fixed form, the base raised to
  ``theta * factor^(d/(d-2))`` for the ``d`` rotated features (Code Llama's and YaRN's "NTK-aware" rows; the dynamic
  form, which grows the base with the batch's length, is ``scaling="dynamic"``, a method option, not a variant here).
- ``yarn``: YaRN (Peng et al. 2023): the per-frequency ramp and attention factor, ``original_max_len = train_len``.
- ``longrope``: LongRoPE's form (Ding et al. 2024; Hugging Face's ``longrope``, Phi-3): per-frequency divisors past
  ``original_max_len = train_len`` and its attention factor. LongRoPE finds the divisors by an evolutionary search
  over perplexity; this variant takes the NTK-aware ones, ``factor^(2i/(d-2))`` for frequency ``i`` (1 for the
  short ones), so it measures the form, not the search (named, not hidden: search-found factors can be given as the
  method's ``long_factor``).
"""

from __future__ import annotations

from posjax.positions import rotary

VARIANTS = ("unscaled", "pi", "ntk", "yarn", "longrope")


def options(variant: str, base: dict, head_dim: int, train_len: int, factor: float) -> dict:
  """The RoPE options of ``variant`` over a model's own (``base``, its ``position_options``), for ``head_dim``
  features per head trained at ``train_len``, stretched by ``factor``."""
  if variant not in VARIANTS:
    raise ValueError(f"context-extension variant {variant!r} unknown; allowed: {list(VARIANTS)}")
  if not factor > 1:
    raise ValueError(f"config.extension.factor={factor!r} must be > 1")
  own = rotary.RopeOptions(**{k: v for k, v in base.items() if v is not None})
  if own.scaling != "none":
    raise ValueError(f"context extension starts from an unscaled RoPE model; this one has scaling={own.scaling!r}")
  if variant == "unscaled":
    return dict(base)
  d = rotary.rotary_dim(own, head_dim)
  if variant == "pi":
    return {**base, "scaling": "linear", "factor": float(factor)}
  if variant == "ntk":
    return {**base, "max_timescale": float(own.max_timescale) * factor ** (d / (d - 2))}
  if variant == "yarn":
    return {**base, "scaling": "yarn", "factor": float(factor), "original_max_len": int(train_len)}
  divisors = [float(factor ** (2 * i / (d - 2))) for i in range(d // 2)]
  return {**base, "scaling": "longrope", "factor": float(factor), "original_max_len": int(train_len),
          "short_factor": [1.0] * (d // 2), "long_factor": divisors}
