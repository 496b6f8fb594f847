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
from posjax.models import BertConfig, BertEncoder
from posjax.models.electra import ElectraConfig
from posjax.train import checkpoint as checkpoint_lib
from posjax.train import metrics as metrics_lib


def is_electra(workdir: str) -> bool:
  """Whether a run is ELECTRA pre-training (its model_config.json has the generator's fields)."""
  return "generator" in checkpoint_lib.read_model_config(workdir)


def _run(workdir: str, step: int | None = None) -> tuple[BertConfig, dict]:
  """A run's encoder config (an ELECTRA run's discriminator: its ``encoder``) and its parameters."""
  fields = checkpoint_lib.read_model_config(workdir)
  config = ElectraConfig.from_dict(fields).discriminator if "generator" in fields else BertConfig(**fields)
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
  for ax, (panel, lines) in zip(axes[0], curves.items()):
    for label, points in lines.items():
      ax.plot(*zip(*points), marker="o", label=label)
    ax.set(xlabel="pre-training step", ylabel=titles[panel][0], title=titles[panel][1])
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(out, dpi=110)
  plt.close(fig)
  return fig


def correlation(workdir: str, out: str, length: int = 0) -> None:
  """TUPE Figure 6: a TUPE run's learned positional correlation, one map per head of the shared bias."""
  config, params = _run(workdir)
  if not config.position.startswith("tupe"):
    raise ValueError(f"{workdir} uses position {config.position!r}; the positional correlation is TUPE's "
                     "(tupe_a, tupe_r)")
  length = min(length or config.max_len, config.max_len)
  _, state = BertEncoder(config).apply({"params": params["encoder"]}, jnp.zeros((1, length), jnp.int32),
                                       mutable=["intermediates"])
  bias_HxLxL = np.asarray(state["intermediates"]["position_bias"][0][0])
  plots.head_maps(bias_HxLxL, out, f"learned positional correlation ({config.position}, TUPE Figure 6)")


def terms(workdir: str, out: str, length: int = 32, head: int = 0, seed: int = 0) -> None:
  """The first layer's logit split as (w + p) W^Q ((w + p) W^K)^T = ww + wp + pw + pp, on raw embeddings
  (before the embedding LayerNorm, as the paper's decomposition), scaled by 1/sqrt(d_h)."""
  config, params = _run(workdir)
  if config.position != "absolute":
    raise ValueError(f"{workdir} uses position {config.position!r}; the four terms are of an absolute-position "
                     "model (BERT-A)")
  encoder = params["encoder"]
  length = min(length, config.max_len)
  ids = np.random.default_rng(seed).integers(0, config.vocab_size, length)
  w = np.asarray(encoder["word_embeddings"]["embedding"])[ids]
  p = np.asarray(encoder["position"]["table"]["embedding"])[:length]
  attention = encoder["layer_0"]["attention"]
  wq, wk = np.asarray(attention["query"]["kernel"])[:, head], np.asarray(attention["key"]["kernel"])[:, head]
  scale = 1 / np.sqrt(wq.shape[-1])
  maps = {"word-word": (w @ wq) @ (w @ wk).T, "word-position": (w @ wq) @ (p @ wk).T,
          "position-word": (p @ wq) @ (w @ wk).T, "position-position": (p @ wq) @ (p @ wk).T}
  plt = plots.pyplot()
  fig, axes = plt.subplots(1, 4, figsize=(12, 3.2))
  for ax, (name, value) in zip(axes, maps.items()):
    image = ax.imshow(value * scale, cmap="RdBu_r")
    ax.set(title=name, xlabel="key", ylabel="query" if name == "word-word" else "")
    fig.colorbar(image, ax=ax, shrink=0.7)
  fig.suptitle(f"first-layer logit terms, head {head} (TUPE Figure 2)")
  fig.savefig(out, dpi=110, bbox_inches="tight")
  plt.close(fig)


def length(root: str, out: str) -> None:
  """Huang et al.'s inductive plot: SQuAD F1 against evaluation length, a line per row of the sweep."""
  _, runs = protocol.read_manifest(root)
  plt = plots.pyplot()
  fig, ax = plt.subplots(figsize=(6, 4))
  for run in runs:
    found = protocol.results(run) if run.kind == "finetune" else None
    if not found:
      continue
    points = sorted((int(m.group(1)), values["f1"]) for name, values in found["metrics"].items()
                    if (m := re.fullmatch(r".*@(\d+)", name)) and isinstance(values.get("f1"), float))
    if points:
      ax.plot(*zip(*points), marker="o", label=run.row)
  ax.set(xscale="log", xlabel="evaluation length (tokens)", ylabel="SQuAD F1",
         title="F1 against evaluation length (Huang et al. 2020)")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(out, dpi=110)
  plt.close(fig)


def main(argv=None) -> int:
  """``python -m posjax.experiments.figures``: one figure per call (see the module docstring)."""
  parser = argparse.ArgumentParser(prog="python -m posjax.experiments.figures", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  commands = parser.add_subparsers(dest="figure", required=True)
  for name, source in (("mlm-loss", "root"), ("correlation", "workdir"), ("terms", "workdir"), ("length", "root")):
    command = commands.add_parser(name)
    command.add_argument(f"--{source}", required=True)
    command.add_argument("--out", required=True, help="the PNG to write")
  args = parser.parse_args(argv)
  try:
    {"mlm-loss": lambda: mlm_loss(args.root, args.out), "correlation": lambda: correlation(args.workdir, args.out),
     "terms": lambda: terms(args.workdir, args.out), "length": lambda: length(args.root, args.out)}[args.figure]()
  except (ValueError, OSError) as error:
    print(f"error: {error}", file=sys.stderr)
    return 2
  print(f"written {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
