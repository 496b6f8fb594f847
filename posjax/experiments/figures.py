"""The papers' figures from posjax runs (PNG, matplotlib).

  python -m posjax.experiments.figures mlm-loss --root=SWEEP --out=fig5.png        TUPE Figure 5: validation MLM loss
      against steps, one line per pre-training run of a sweep (its metrics.jsonl). An ELECTRA run's line is its
      generator's MLM loss (``eval_mlm_loss``; its ``eval_loss`` is the joint loss, no MLM loss), and a second
      panel, drawn when the sweep has ELECTRA runs, holds their discriminators' loss (``eval_disc_loss``).
  python -m posjax.experiments.figures correlation --workdir=RUN --out=fig6.png   TUPE Figure 6: the learned positional
      correlation of a TUPE run (tupe_a / tupe_r), one [L, L] map per head.
  python -m posjax.experiments.figures terms --workdir=RUN --out=fig2.png         TUPE Figure 2: the four terms of the
      first layer's logits of an absolute-position run (word-word, word-position, position-word,
      position-position), for one head on a batch of token ids.
  python -m posjax.experiments.figures length --root=SWEEP --out=f1.png           Huang et al.: SQuAD F1 against evaluation
      length, one line per method (a sweep of experiments/huang2020/inductive.py).

correlation and terms read an ELECTRA run's discriminator (its ``encoder``, as fine-tuning does).
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import jax.numpy as jnp
import numpy as np

from posjax.experiments import plots, protocol
from posjax.models import TransformerConfig, TransformerStack
from posjax.models.electra import ElectraConfig
from posjax.train import checkpoint as checkpoint_lib
from posjax.train import metrics as metrics_lib


def is_electra(workdir: str) -> bool:
  """Whether a run is ELECTRA pre-training (its model_config.json has the generator's fields)."""
  return "generator" in checkpoint_lib.read_model_config(workdir)


def _run(workdir: str, step: int | None = None) -> tuple[TransformerConfig, dict]:
  """A run's encoder config (an ELECTRA run's discriminator: its ``encoder``) and its parameters."""
  fields = checkpoint_lib.read_model_config(workdir)
  config = ElectraConfig.from_dict(fields).discriminator if "generator" in fields else TransformerConfig(**fields)
  return config, checkpoint_lib.load_params(workdir, step)


def mlm_loss_curves(root: str) -> dict[str, dict[str, list[tuple[int, float]]]]:
  """``{"mlm": {label: [(step, loss)]}, "discriminator": {...}}`` of the pre-training runs in ``root``: an mlm
  run's ``eval_loss``, an ELECTRA run's generator (``eval_mlm_loss``) and discriminator (``eval_disc_loss``)."""
  _, runs = protocol.read_manifest(root)
  curves = {"mlm": {}, "discriminator": {}}
  for run in runs:
    if run.kind != "pretrain" or not os.path.isfile(os.path.join(run.workdir, "metrics.jsonl")):
      continue
    lines = metrics_lib.read(run.workdir)
    series = {"mlm": ("eval_loss", run.row)}
    if is_electra(run.workdir):
      series = {"mlm": ("eval_mlm_loss", f"{run.row} (ELECTRA generator)"),
                "discriminator": ("eval_disc_loss", run.row)}
    for panel, (key, label) in series.items():
      points = [(line["step"], line[key]) for line in lines if key in line]
      if points:
        curves[panel][label] = points
  return curves


def mlm_loss(root: str, out: str):
  """TUPE Figure 5: the validation MLM loss of every pre-training run of the sweep in ``root`` (ELECTRA runs: see
  the module docstring); returns the figure (closed), whose lines are the curves."""
  curves = {panel: lines for panel, lines in mlm_loss_curves(root).items() if lines or panel == "mlm"}
  titles = {"mlm": ("validation MLM loss", "MLM loss (TUPE Figure 5)"),
            "discriminator": ("validation discriminator loss", "ELECTRA discriminator loss")}
  plt = plots.pyplot()
  fig, axes = plt.subplots(1, len(curves), figsize=(6 * len(curves), 4), squeeze=False)
  styles = plots.method_styles([label for lines in curves.values() for label in lines])
  for ax, (panel, lines) in zip(axes[0], curves.items()):
    for label, points in lines.items():
      ax.plot(*zip(*points), label=label, **styles[label])
    ax.set(xlabel="pre-training step", ylabel=titles[panel][0], title=titles[panel][1])
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(out, dpi=110)
  plt.close(fig)
  return fig


def _positions(length: int, config: TransformerConfig) -> int:
  """``length`` if the run's position table holds it; else an error naming the table's length."""
  if not 1 <= length <= config.max_len:
    raise ValueError(f"--length={length}: the run's position table has {config.max_len} positions; allowed: 1 to "
                     f"{config.max_len}")
  return length


def correlation(workdir: str, out: str, length: int = 0) -> None:
  """TUPE Figure 6: a TUPE run's learned positional correlation, one map per head of the shared bias."""
  config, params = _run(workdir)
  if not config.position.startswith("tupe"):
    raise ValueError(f"{workdir} uses position {config.position!r}; the positional correlation is TUPE's "
                     "(tupe_a, tupe_r)")
  length = _positions(length or config.max_len, config)
  _, state = TransformerStack(config).apply({"params": params["encoder"]}, jnp.zeros((1, length), jnp.int32),
                                            mutable=["intermediates"])
  bias_HxLxL = np.asarray(state["intermediates"]["position_bias"][0][0])
  plots.head_maps(bias_HxLxL, out, f"learned positional correlation ({config.position}, TUPE Figure 6)")


def terms(workdir: str, out: str, length: int = 0, head: int = 0, seed: int = 0):
  """The first layer's logit split as (w + p) W^Q ((w + p) W^K)^T = ww + wp + pw + pp, on raw embeddings
  (before the embedding LayerNorm, as the paper's decomposition), scaled by 1/sqrt(d_h); returns the figure
  (closed)."""
  config, params = _run(workdir)
  if config.position != "absolute":
    raise ValueError(f"{workdir} uses position {config.position!r}; the four terms are of an absolute-position "
                     "model (BERT-A)")
  encoder = params["encoder"]
  length = _positions(length or min(32, config.max_len), config)
  if not 0 <= head < config.num_heads:
    raise ValueError(f"--head={head}: the run has {config.num_heads} heads; allowed: 0 to {config.num_heads - 1}")
  ids = np.random.default_rng(seed).integers(0, config.vocab_size, length)
  w = np.asarray(encoder["word_embeddings"]["embedding"])[ids]
  p = np.asarray(encoder["position"]["table"]["embedding"])[:length]
  attention = encoder["layer_0"]["attention"]
  wq, wk = np.asarray(attention["query"]["kernel"])[:, head], np.asarray(attention["key"]["kernel"])[:, head]
  scale = 1 / np.sqrt(wq.shape[-1])
  maps = {"word-word": (w @ wq) @ (w @ wk).T, "word-position": (w @ wq) @ (p @ wk).T,
          "position-word": (p @ wq) @ (w @ wk).T, "position-position": (p @ wq) @ (p @ wk).T}
  plt = plots.pyplot()
  # Constrained layout places each panel's colour bar beside it, clear of the next panel; each scale is symmetric
  # about 0, so white is no contribution in every panel.
  fig, axes = plt.subplots(1, 4, figsize=(14, 3.4), layout="constrained")
  for ax, (name, value) in zip(axes, maps.items()):
    limit = float(np.abs(value * scale).max()) or 1.0
    image = ax.imshow(value * scale, cmap="RdBu_r", vmin=-limit, vmax=limit)
    ax.set(title=name, xlabel="key", ylabel="query" if name == "word-word" else "")
    fig.colorbar(image, ax=ax, shrink=0.8)
  fig.suptitle(f"first-layer logit terms, head {head} (TUPE Figure 2)")
  fig.savefig(out, dpi=110)
  plt.close(fig)
  return fig


def length(root: str, out: str):
  """Huang et al.'s inductive plot: SQuAD F1 against evaluation length, a line per row of the sweep (a run with
  several rows of one name, such as seeds, draws each); returns the figure (closed)."""
  _, runs = protocol.read_manifest(root)
  lines = {}
  for run in runs:
    found = protocol.results(run) if run.kind == "finetune" else None
    if not found:
      continue
    points = sorted((int(m.group(1)), values["f1"]) for name, values in found["metrics"].items()
                    if (m := re.fullmatch(r".*@(\d+)", name)) and isinstance(values.get("f1"), float))
    if points:
      lines[run.row] = points
  plt = plots.pyplot()
  fig, ax = plt.subplots(figsize=(6, 4))
  styles = plots.method_styles(list(lines))
  for row, points in lines.items():
    ax.plot(*zip(*points), label=row, **styles[row])
  if lines:
    plots.length_axis(ax, [length for points in lines.values() for length, _ in points])
  ax.set(xlabel="evaluation length (tokens)", ylabel="SQuAD F1", title="F1 against evaluation length (Huang et al. 2020)")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(out, dpi=110)
  plt.close(fig)
  return fig


def main(argv=None) -> int:
  """``python -m posjax.experiments.figures``: one figure per call (see the module docstring)."""
  parser = argparse.ArgumentParser(prog="python -m posjax.experiments.figures", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  commands = parser.add_subparsers(dest="figure", required=True, metavar="FIGURE")
  root = ("--root", dict(required=True, metavar="SWEEP", help="a sweep's --root: the directory of its manifest.json"))
  workdir = ("--workdir", dict(required=True, metavar="RUN", help="a pre-training run's workdir (its checkpoints)"))
  out = ("--out", dict(required=True, metavar="PNG", help="the PNG file to write"))
  figures = {
      "mlm-loss": ("TUPE Figure 5: validation MLM loss against steps, a line per pre-training run", [root, out]),
      "correlation": ("TUPE Figure 6: a TUPE run's learned positional correlation, a map per head", [workdir, out, (
          "--length", dict(type=int, default=0, help="positions shown (default 0: the run's max_len)"))]),
      "terms": ("TUPE Figure 2: the first layer's four logit terms of an absolute-position run", [workdir, out, (
          "--length", dict(type=int, default=0, help="positions shown (default 0: 32, or the run's max_len if shorter)")), (
          "--head", dict(type=int, default=0, help="the attention head (default 0)")), (
          "--seed", dict(type=int, default=0, help="seed of the random token ids (default 0)"))]),
      "length": ("Huang et al.: SQuAD F1 against evaluation length, a line per row of an inductive sweep", [root, out]),
  }
  for name, (description, arguments) in figures.items():
    command = commands.add_parser(name, help=description, description=description)
    for flag, options in arguments:
      command.add_argument(flag, **options)
  args = parser.parse_args(argv)
  draw = {"mlm-loss": lambda: mlm_loss(args.root, args.out),
          "correlation": lambda: correlation(args.workdir, args.out, args.length),
          "terms": lambda: terms(args.workdir, args.out, args.length, args.head, args.seed),
          "length": lambda: length(args.root, args.out)}
  try:
    draw[args.figure]()
  except (ValueError, OSError) as error:
    print(f"error: {error}", file=sys.stderr)
    return 2
  print(f"written {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
