"""Position methods, one interface, chosen by registry name (see ``base``)."""

# Importing a family registers its methods; this order is the order of ``names()``.
from posjax.positions import absolute  # noqa: F401  none, absolute, sinusoidal
from posjax.positions import t5  # noqa: F401  t5, bert_r
from posjax.positions import tupe  # noqa: F401  bert_ad, tupe_a, tupe_r
from posjax.positions import relative  # noqa: F401  shaw, huang_m1..m4
from posjax.positions import rotary  # noqa: F401  rope, xpos
from posjax.positions import polar  # noqa: F401  pope
from posjax.positions import multi_axis  # noqa: F401  mrope, rope_2d, rope_mixed
from posjax.positions import grid  # noqa: F401  sinusoidal_2d, absolute_2d
from posjax.positions import alibi  # noqa: F401  alibi
from posjax.positions import kerple  # noqa: F401  kerple_log, kerple_power
from posjax.positions import fire  # noqa: F401  fire
from posjax.positions import sandwich  # noqa: F401  sandwich
from posjax.positions import fox  # noqa: F401  fox
from posjax.positions import cope  # noqa: F401  cope
from posjax.positions import stick_breaking  # noqa: F401  stick_breaking
from posjax.positions import path  # noqa: F401  path
from posjax.positions.base import (LayerTerms, Method, PositionSpec, PositionState, encoder_names, get, make, names,
                                   register)

__all__ = ["LayerTerms", "Method", "PositionSpec", "PositionState", "encoder_names", "get", "make", "names",
           "register"]
