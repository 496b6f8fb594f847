"""Experiments over many runs: the papers' tables as runs (:mod:`~posjax.experiments.protocol`,
:mod:`~posjax.experiments.tables`), the sweep that runs them (:mod:`~posjax.experiments.sweep`), the report that
scores them as the papers did (:mod:`~posjax.experiments.report`), the papers' figures
(:mod:`~posjax.experiments.figures`) and the position probes of ``make demo`` (:mod:`~posjax.experiments.probes`).

They read configs and ``results.json`` files; the sweep's ``print`` and ``slurm`` launchers and the report need no
JAX. Training reaches them as a function, ``train(config, workdir)``, handed over by :mod:`posjax.main`.
"""
