"""posjax: positional encoding for Transformers, in JAX/Flax.

``import posjax`` loads nothing else (no JAX): import what you use, e.g. ``from posjax import attention,
positions`` or ``from posjax.models import TransformerConfig``.
"""

__version__ = "0.2.0"
