"""What the figures and the probe plots share: matplotlib on its file-only backend, one style per method, a length
axis, and one heat map per head."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from posjax import positions

# tab10's colours; a name's place picks its colour, and each further ten names take the next line style and shift
# the markers, so that no two of the first forty share a colour and a line style, or a colour and a marker.
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
          "#17becf")
MARKERS = "osD^vP*Xhp"
LINESTYLES = ("-", "--", ":", "-.")


def pyplot():
  """matplotlib's pyplot on the file-only Agg backend (imported on first use: it is slow to load)."""
  import matplotlib  # imported here: only the commands that draw need it
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def method_styles(names: Sequence[str]) -> dict[str, dict]:
  """A matplotlib style (``color``, ``marker``, ``linestyle``) per name, distinct within the call. A registered
  position method's style is fixed by its place in the registry, so it is the same in every figure; other names
  (a table's rows) take the places after them, in the order given."""
  known = positions.names()
  others = [name for name in dict.fromkeys(names) if name not in known]
  index = {name: i for i, name in enumerate(known)} | {name: len(known) + i for i, name in enumerate(others)}
  return {name: _style(index[name]) for name in names}


def _style(i: int) -> dict:
  cycle = i // len(COLORS)
  return dict(color=COLORS[i % len(COLORS)], marker=MARKERS[(i + cycle) % len(MARKERS)],
              linestyle=LINESTYLES[cycle % len(LINESTYLES)])


def length_axis(ax, lengths: Sequence[int], train_len: int | None = None) -> None:
  """An x axis of evaluation lengths: log base 2, a tick labelled with each length (32, not 3x10^1), no minor
  ticks; the training length as a grey dotted line."""
  lengths = sorted(set(int(length) for length in lengths))
  ax.set_xscale("log", base=2)
  ax.set_xticks(lengths, [str(length) for length in lengths])
  ax.xaxis.set_minor_locator(pyplot().NullLocator())
  if train_len:
    ax.axvline(train_len, color="grey", linestyle=":")


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
