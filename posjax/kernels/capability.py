"""Which kernel computes what: one table, :func:`refusal`, that every refusal quotes.

- ``xla``: everything (the dense reference).
- ``cudnn``: a softmax of ``scale q·k`` plus an additive bias, without attention dropout: not a rule that replaces
  the softmax, not a sink, not an open term (it may modify the score, which a bias cannot), not dense logits
  (Methods 1-3, Shaw's value term).
- ``pallas`` (:func:`posjax.kernels.relative_attention`): every term and a sink; not dense logits; a rule (CoPE,
  stick-breaking) alone in its call and without attention dropout (its kernels drop no weights); PaTH's content
  term (``Terms.path``, its blocked form) without a rule or relative vectors.
- ``decode`` (the Pallas decode kernels, :func:`posjax.kernels.decode_attention`): the softmax with the terms built
  per tile from positions (every open term, the built-in ones among them); not Shaw's / Method 4's relative vectors,
  TUPE's untied term (an encoder's) or a rule.
"""

from __future__ import annotations

from posjax.kernels.terms import NAMES, OPEN_BUILTINS, WEIGHT_RULES, Terms

KERNELS = ("xla", "cudnn", "pallas", "decode")
WORDS = {"xla": "xla", "cudnn": "cuDNN", "pallas": "Pallas", "decode": "decode"}
DECODE_BUILT = OPEN_BUILTINS  # the built-in terms the decode kernels build per tile (the open ones)


def refusal(kernel: str, terms: Terms | None = None, *, dropout: bool = False, dense: bool = False) -> str | None:
  """Why ``kernel`` (:data:`KERNELS`) cannot compute ``terms`` with attention dropout ``dropout`` (``dense``: the
  layer's logits replace ``scale q·k`` or it adds a value term), None where it can."""
  if kernel not in KERNELS:
    raise ValueError(f"unknown kernel {kernel!r}; allowed: {list(KERNELS)}")
  terms = terms if terms is not None else Terms()
  given = [name for name in NAMES if getattr(terms, name) is not None] + (["open"] if terms.open else [])
  rules = [name for name in WEIGHT_RULES if name in given]
  if kernel == "xla":
    return None
  if dense:
    return f"the {WORDS[kernel]} kernels do not compute dense logits (logits that replace q·k, or a value term)"
  if terms.path is not None and kernel != "pallas":
    return (f"the {WORDS[kernel]} kernels compute q·k; PaTH's content term is a product of Householder factors "
            "(the xla and Pallas kernels compute it)")
  if kernel == "cudnn":
    if dropout:
      return "dropout on attention weights is on (posjax runs cuDNN without it)"
    if rules:
      return f"cuDNN computes softmax attention; the {rules[0]} rule reads the masked logits"
    if terms.open:
      return "cuDNN adds a bias; an open term may modify the score"
    if terms.sink is not None:
      return "cuDNN's softmax has no sink logit in its denominator"
    return None
  if kernel == "pallas":
    if terms.path is not None and (rules or terms.relative is not None):
      return (f"the Pallas kernels do not compute PaTH's content term with the "
              f"{rules[0] if rules else 'relative'} term")
    others = [name for name in given if rules and name != rules[0]]
    if others:
      return f"the Pallas kernels do not compute {rules[0]} with the {'/'.join(others)} term"
    if rules and dropout:
      return f"the Pallas kernels drop no attention weights under the {rules[0]} rule (attention dropout must be 0)"
    return None
  other = [name for name in given if name not in DECODE_BUILT + ("open", "sink")]
  return f"the decode kernels do not build the {'/'.join(other)} term" if other else None
