"""What the figures and the probe plots share: matplotlib on its file-only backend, and one heat map per head."""

from __future__ import annotations

import numpy as np


def pyplot():
  """matplotlib's pyplot on the file-only Agg backend (imported on first use: it is slow to load)."""
  import matplotlib  # imported here: only the commands that draw need it
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def head_maps(maps_HxLxL: np.ndarray, path: str, title: str, *, panel: tuple[float, float] = (2.6, 2.8),
              tick_every: int = 0) -> None:
  """One ``[L, L]`` map per head, on one symmetric colour scale (query rows, key columns), saved as a PNG."""
  plt = pyplot()
  heads = maps_HxLxL.shape[0]
  fig, axes = plt.subplots(1, heads, figsize=(panel[0] * heads, panel[1]), squeeze=False)
  limit = float(np.abs(maps_HxLxL).max()) or 1.0
  for h, ax in enumerate(axes[0]):
    image = ax.imshow(maps_HxLxL[h], cmap="RdBu_r", vmin=-limit, vmax=limit)
    ax.set(title=f"head {h}", xlabel="key position", ylabel="query position" if h == 0 else "")
    if tick_every:
      ticks = range(0, maps_HxLxL.shape[-1], tick_every)
      ax.set(xticks=ticks, yticks=ticks)
  fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8, label="logit added to attention")
  fig.suptitle(title)
  fig.savefig(path, dpi=110, bbox_inches="tight")
  plt.close(fig)
