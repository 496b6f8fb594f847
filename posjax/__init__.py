"""posjax: positional encoding for Transformers, in JAX/Flax."""

from posjax import attention, models, positions  # noqa: F401

__version__ = "0.1.0"
