"""``python tests/faults.py STEP ARGS...``: ``python -m posjax.main ARGS...`` whose training raises an ``OSError``
after step STEP, in this process only: one process's error mid-run (a file it cannot read, a bug)."""

import sys

from posjax import main
from posjax.train import metrics

STEP = int(sys.argv.pop(1))
_push = metrics.DelayedMetrics.push


def _failing_push(self, step, values):
  if step == STEP:
    raise OSError(f"cannot read shard-00001 (injected after step {STEP})")
  return _push(self, step, values)


metrics.DelayedMetrics.push = _failing_push
main.entry()
