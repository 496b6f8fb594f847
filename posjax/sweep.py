"""Moved: ``python -m posjax.experiments.sweep`` (this name only says so, in one line)."""

import sys

_MOVED = "posjax.sweep moved to posjax.experiments.sweep: run python -m posjax.experiments.sweep"
if __name__ == "__main__":
  sys.exit(f"error: {_MOVED}")
raise ImportError(_MOVED)
