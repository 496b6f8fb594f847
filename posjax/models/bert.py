"""Deprecated: this module's classes are :mod:`posjax.models.transformer` (the config and the stack) and
:mod:`posjax.models.heads` (the heads) under new names (:data:`posjax.models.DEPRECATED`); its old names still read
here, with a ``DeprecationWarning``, for one release."""

import warnings

from posjax import models
from posjax.models import heads, transformer


def __getattr__(name: str):
  """An old name (:data:`posjax.models.DEPRECATED`) or a name of the two modules this one was split into."""
  if name in models.DEPRECATED:
    warnings.warn(f"posjax.models.bert.{name} is deprecated: use posjax.models.{models.DEPRECATED[name]} (the same "
                  "class; the old name goes in the next release)", DeprecationWarning, stacklevel=2)
    return getattr(models, models.DEPRECATED[name])
  for module in (transformer, heads):
    if hasattr(module, name):
      warnings.warn(f"posjax.models.bert is deprecated: {name} is posjax.models.{module.__name__.split('.')[-1]}."
                    f"{name}", DeprecationWarning, stacklevel=2)
      return getattr(module, name)
  raise AttributeError(f"module 'posjax.models.bert' has no attribute {name!r}")
