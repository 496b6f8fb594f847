"""What the figures and the probe plots share: matplotlib on its file-only backend, one style per method of a figure,
a length axis, a value axis, and one heat map per head."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# A figure's i-th name takes the i-th colour and marker: tab10's colours with solid lines for the first ten names, ten
# darker ones with dashed lines for the next ten, so that no two of a figure's first twenty share a colour and no two
# of its first seventeen a marker (a colour and a marker together: 340).
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
          "#17becf", "#000000", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#1b9e77", "#e6ab02",
          "#6a3d9a", "#b15928")
MARKERS = "osD^vP*Xhp<>dH8x+"
LINESTYLES = ("-", "--", ":", "-.")


def pyplot():
  """matplotlib's pyplot on the file-only Agg backend (imported on first use: it is slow to load)."""
  import matplotlib  # imported here: only the commands that draw need it
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def method_styles(names: Sequence[str]) -> dict[str, dict]:
  """A matplotlib style (``color``, ``marker``, ``linestyle``) per name, by its place among ``names`` (repeats
  dropped): distinct colours for up to twenty names, distinct markers for up to seventeen, so a figure's legend reads
  in the order of its colours. Draw every name of a figure from one call, so that all its panels agree."""
  return {name: _style(i) for i, name in enumerate(dict.fromkeys(names))}


def _style(i: int) -> dict:
  return dict(color=COLORS[i % len(COLORS)], marker=MARKERS[i % len(MARKERS)],
              linestyle=LINESTYLES[(i // 10) % len(LINESTYLES)])


def length_axis(ax, lengths: Sequence[int], train_len: int | None = None) -> None:
  """An x axis of evaluation lengths: log base 2, a tick labelled with each length (32, not 3x10^1), no minor
  ticks; the training length as a grey dotted line."""
  lengths = sorted(set(int(length) for length in lengths))
  ax.set_xscale("log", base=2)
  ax.set_xticks(lengths, [str(length) for length in lengths])
  ax.xaxis.set_minor_locator(pyplot().NullLocator())
  if train_len:
    ax.axvline(train_len, color="grey", linestyle=":")


def value_axis(ax, values: Sequence[float]) -> None:
  """A y axis that the values can be read off: linear over a range of less than 3x (perplexities 11 to 14.5: ticks
  every 0.5), else log with a labelled tick at 1, 2, 3, ... 9 times each power of ten (2, 5 over more than a
  decade and a half; powers of ten alone over more than three), the numbers written plainly (20, not 2x10^1);
  a light grid line at each."""
  ticker = pyplot().matplotlib.ticker
  values = [float(v) for v in values if np.isfinite(v)]
  if not values:
    return
  low, high = min(values), max(values)
  ax.grid(True, axis="y", which="major", color="0.92", linewidth=0.8)
  ax.set_axisbelow(True)
  if low <= 0 or high / low < 3:
    ax.yaxis.set_major_locator(ticker.MaxNLocator(nbins=8, steps=[1, 2, 2.5, 5, 10]))
    ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
    return
  decades = np.log10(high / low)
  subs = tuple(range(1, 10)) if decades < 1.5 else (1, 2, 5) if decades < 3 else (1,)
  ax.set_yscale("log")
  ax.yaxis.set_major_locator(ticker.LogLocator(base=10, subs=subs))
  ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
  ax.yaxis.set_minor_locator(ticker.LogLocator(base=10, subs=tuple(range(1, 10))))
  ax.yaxis.set_minor_formatter(ticker.NullFormatter())


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
