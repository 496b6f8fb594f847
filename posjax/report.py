"""Moved: ``python -m posjax.experiments.report`` (this name only says so, in one line)."""

import sys

_MOVED = "posjax.report moved to posjax.experiments.report: run python -m posjax.experiments.report"
if __name__ == "__main__":
  sys.exit(f"error: {_MOVED}")
raise ImportError(_MOVED)
