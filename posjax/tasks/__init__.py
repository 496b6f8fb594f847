"""The tasks the training loop trains, by ``config.task`` name, with the evaluator kinds each declares.

``build(config, local_batch) -> Task`` (the contract is :mod:`posjax.train.task`) is what :mod:`posjax.main` hands
to the loop. A new task is a module with such a ``build``, registered in ``TASKS`` with its evaluator kinds.
Evaluators are declared in ``config.evals`` (``{name: {kind, ...options}}``, after big_vision's
``config.evals``); their metrics are logged as ``<name>_<metric>``.

- ``mlm``: masked-LM pre-training on a corpus (:mod:`posjax.tasks.mlm`);
- ``clm``: causal language modelling with a decoder on the same corpus (:mod:`posjax.tasks.clm`), evaluators of
  kind ``clm`` and ``passkey`` (passkey retrieval, :mod:`posjax.tasks.passkey`);
- ``electra``: ELECTRA pre-training, a generator and a discriminator on a corpus (:mod:`posjax.tasks.electra`);
- ``glue``: GLUE classification and STS-B regression (:mod:`posjax.tasks.glue`);
- ``squad``: SQuAD 1.1 span extraction (:mod:`posjax.tasks.squad`);
- ``probe``: one position probe (:mod:`posjax.tasks.probe`);
- ``vision``: one image probe of a vision transformer (:mod:`posjax.tasks.vision`).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import ml_collections

from posjax.tasks import clm, electra, glue, mlm, probe, squad, vision
from posjax.train.task import Task


class Entry(NamedTuple):
  """A registered task: its builder and the evaluator kinds its ``config.evals`` may use."""
  build: Callable[[ml_collections.ConfigDict, int], Task]
  eval_kinds: tuple[str, ...]


TASKS = {"mlm": Entry(mlm.build, ("mlm",)), "clm": Entry(clm.build, ("clm", "passkey", "ruler")), "electra": Entry(electra.build, ("electra",)),
         "glue": Entry(glue.build, ("glue",)), "squad": Entry(squad.build, ("squad",)),
         "probe": Entry(probe.build, ("probe",)), "vision": Entry(vision.build, ("vision",))}


def build(config: ml_collections.ConfigDict, local_batch: int) -> Task:
  """The task ``config.task`` names (default ``mlm``), its evaluators checked against its kinds."""
  name = config.get("task", "mlm")
  if name not in TASKS:
    raise ValueError(f"unknown config.task {name!r}; allowed: {list(TASKS)}")
  allowed = TASKS[name].eval_kinds
  for evaluator, spec in config.get("evals", {}).items():
    if spec.get("kind") not in allowed:
      raise ValueError(f"config.evals.{evaluator}.kind={spec.get('kind')!r} does not fit task {name!r}; "
                       f"allowed: {list(allowed)}")
  return TASKS[name].build(config, local_batch)
