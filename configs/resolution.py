"""The resolution probe: one tiny vision transformer per position method and image task, trained on images of
``grid x grid`` patches and evaluated at larger grids (:mod:`posjax.experiments.resolution`, the tasks
:mod:`posjax.tasks.vision`).

Options (``configs/resolution.py:methods=rope_2d+rope_mixed,steps=600``):
  methods: ``+``-separated registry names; default ViT's learned 2-D table (``absolute_2d``, resized to a larger
    grid), MAE's 2-D sinusoids, 2-D axial RoPE, RoPE-Mixed and no positions. A method of one axis reads the raster
    index (``absolute``: ViT's flattened table, unsupported past its length; ``rope``).
  tasks: ``+``-separated image tasks, ``orientation`` and ``relation`` (both by default).
  steps: training steps per (method, task).
  pooling: ``cls`` (a class token, ViT's; default) or ``mean`` (none: the patches' mean state).
  seeds: trainings per (method, task), seeds 0, 1, ...; the table gives their mean and standard deviation.

  python -m posjax.main --config=configs/resolution.py --workdir=workdir/resolution
"""

import ml_collections

from posjax.config_args import parse_arg


def get_config(arg=None):
  arg = parse_arg(arg, methods="absolute_2d+sinusoidal_2d+rope_2d+rope_mixed+none", tasks="orientation+relation",
                  steps=600, pooling="cls", seeds=1)
  config = ml_collections.ConfigDict()
  config.job = "resolution"
  config.seed = 0
  config.seeds = arg.seeds
  config.methods = tuple(arg.methods.split("+"))
  config.tasks = tuple(arg.tasks.split("+"))
  config.options = ml_collections.ConfigDict()  # {method: its options}
  config.grid = 4  # training images: 4 x 4 patches
  config.eval_grids = (4, 6, 8)  # 1x, 1.5x, 2x the resolution
  config.patch_size = 2
  config.channels = 3
  config.segment = 3
  config.scale_objects = True
  config.noise = 0.1
  config.pooling = arg.pooling
  config.steps = arg.steps
  config.warmup_steps = 40
  config.learning_rate = 3e-3
  config.batch_size = 32
  config.eval_batch_size = 256
  config.model = ml_collections.ConfigDict(dict(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128))
  return config
