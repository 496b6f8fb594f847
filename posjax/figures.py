"""Moved: ``python -m posjax.experiments.figures`` (this name only says so, in one line)."""

import sys

_MOVED = "posjax.figures moved to posjax.experiments.figures: run python -m posjax.experiments.figures"
if __name__ == "__main__":
  sys.exit(f"error: {_MOVED}")
raise ImportError(_MOVED)
