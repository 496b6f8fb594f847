"""Every figure command writes a PNG from real runs (and refuses runs of the wrong kind); ELECTRA runs: the
generator's and the discriminator's losses, never the joint one, and their discriminator's correlation."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

from posjax import config_args
from posjax.experiments import figures, plots, probes, protocol
from posjax.experiments import length as length_harness
from posjax.main import train
from posjax.models import TransformerConfig
from posjax.models.electra import Electra, ElectraConfig
from posjax.train import checkpoint
from conftest import randomize

# The generator has half the discriminator's heads, so a figure of the wrong model shows.
ELECTRA = ElectraConfig(TransformerConfig.tiny(position="tupe_a", hidden_size=16, num_heads=2, intermediate_size=32,
                                        embedding_size=32), TransformerConfig.tiny(position="tupe_a"))


@pytest.fixture(scope="module")
def sweep_root(tmp_path_factory):
  """A two-row pre-training sweep (absolute, tupe_a) with evaluations, and made-up inductive SQuAD results."""
  root = tmp_path_factory.mktemp("sweep")
  runs = [protocol.Run(f"{name}/pretrain", name, "pretrain", "configs/pretrain.py", f"runlocal,position={name}",
                          {"total_steps": 4, "warmup_steps": 1, "eval_every_steps": 2, "batch_size": 8,
                           "max_len": 32}, str(root / name / "pretrain")) for name in ("absolute", "tupe_a")]
  for run in runs:
    train(protocol.build(run), run.workdir)
  squad = protocol.Run("absolute/squad/lr0.001_seed1", "absolute", "finetune", "configs/finetune/squad.py",
                          "runlocal", {}, str(root / "absolute" / "squad"), task="squad", lr=1e-3, seed=1)
  squad_dir = root / "absolute" / "squad"
  squad_dir.mkdir(parents=True)
  (squad_dir / "results.json").write_text(json.dumps({"metrics": {"squad@32": {"f1": 40.0}, "squad@64": {"f1": 35.0},
                                                                   "squad@128": {"f1": "unsupported"}}}))
  protocol.write_manifest(runs + [squad], str(root), "configs/pretrain.py")
  return root


@pytest.mark.xdist_group("figures_sweep")
@pytest.mark.parametrize("figure, source", [("mlm-loss", "root"), ("length", "root"),
                                            ("correlation", "tupe_a"), ("terms", "absolute")])
def test_every_figure_writes_a_png(sweep_root, tmp_path, figure, source):
  where = ["--root", str(sweep_root)] if source == "root" else ["--workdir", str(sweep_root / source / "pretrain")]
  assert figures.main([figure, *where, "--out", str(tmp_path / "figure.png")]) == 0
  assert (tmp_path / "figure.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.xdist_group("figures_sweep")
def test_figures_refuse_runs_of_the_wrong_kind(sweep_root, tmp_path):
  assert figures.main(["correlation", "--workdir", str(sweep_root / "absolute" / "pretrain"), "--out",
                       str(tmp_path / "x.png")]) == 2
  with pytest.raises(ValueError, match=r"uses position 'tupe_a'; the four terms are of an absolute-position model"):
    figures.terms(str(sweep_root / "tupe_a" / "pretrain"), str(tmp_path / "x.png"))


def fake_run(root, row: str, model_config: dict, metrics: list[dict]) -> protocol.Run:
  """A pre-training run of ``root`` with only its model_config.json and metrics.jsonl."""
  workdir = root / row / "pretrain"
  workdir.mkdir(parents=True)
  (workdir / "model_config.json").write_text(json.dumps(model_config))
  (workdir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in metrics))
  return protocol.Run(f"{row}/pretrain", row, "pretrain", "configs/pretrain.py", "runlocal", {}, str(workdir))


@pytest.fixture(scope="module")
def electra_root(tmp_path_factory):
  """A sweep of an mlm run and an ELECTRA (tupe_a) run with made-up metrics; the ELECTRA run also has a
  checkpoint of random parameters (drawn, not initialised: a figure reads any)."""
  root = tmp_path_factory.mktemp("electra")
  mlm = fake_run(root, "bert", TransformerConfig.tiny().to_dict(),
                 [{"step": 2, "loss": 6.0}, {"step": 2, "eval_loss": 5.0}, {"step": 4, "eval_loss": 4.0}])
  electra = fake_run(root, "electra", ELECTRA.to_dict(),
                     [{"step": 2, "loss": 41.0, "mlm_loss": 5.5, "disc_loss": 0.71},
                      {"step": 2, "eval_loss": 40.0, "eval_mlm_loss": 5.25, "eval_disc_loss": 0.69},
                      {"step": 4, "eval_loss": 39.0, "eval_mlm_loss": 5.125, "eval_disc_loss": 0.625}])
  params = randomize(jax.eval_shape(Electra(ELECTRA.generator, ELECTRA.discriminator).init, jax.random.PRNGKey(0),
                                    jnp.ones((1, 8), jnp.int32))["params"])
  checkpointer = checkpoint.Checkpointer(f"{electra.workdir}/checkpoints", keep=1, async_save=False)
  checkpointer.save(0, {"step": jnp.zeros((), jnp.int32), "params": params}, {})
  checkpointer.close()
  protocol.write_manifest([mlm, electra], str(root), "configs/pretrain.py")
  return root


def plotted(fig) -> list[dict]:
  """Each panel's lines as ``{label: [[x, y], ...]}``."""
  return [{line.get_label(): line.get_xydata().tolist() for line in ax.get_lines()} for ax in fig.axes]


@pytest.mark.xdist_group("figures_electra")
def test_the_mlm_loss_figure_plots_an_electra_runs_generator_and_discriminator_not_its_joint_loss(electra_root,
                                                                                                 tmp_path):
  fig = figures.mlm_loss(str(electra_root), str(tmp_path / "figure.png"))
  assert plotted(fig) == [{"bert": [[2, 5.0], [4, 4.0]], "electra (ELECTRA generator)": [[2, 5.25], [4, 5.125]]},
                          {"electra": [[2, 0.69], [4, 0.625]]}]
  _, runs = protocol.read_manifest(str(electra_root))
  protocol.write_manifest(runs[:1], str(tmp_path / "mlm_only"), "configs/pretrain.py")
  assert plotted(figures.mlm_loss(str(tmp_path / "mlm_only"), str(tmp_path / "figure.png"))) == [
      {"bert": [[2, 5.0], [4, 4.0]]}]


@pytest.mark.xdist_group("figures_electra")
def test_the_correlation_of_an_electra_run_is_its_discriminators(electra_root, tmp_path, monkeypatch):
  maps = []
  monkeypatch.setattr(figures.plots, "head_maps", lambda maps_HxLxL, *args: maps.append(maps_HxLxL))
  assert figures.main(["correlation", "--workdir", str(electra_root / "electra" / "pretrain"), "--out",
                       str(tmp_path / "figure.png")]) == 0
  (bias_HxLxL,) = maps
  assert bias_HxLxL.shape == (ELECTRA.discriminator.num_heads, ELECTRA.discriminator.max_len,
                              ELECTRA.discriminator.max_len)
  assert np.isfinite(bias_HxLxL).all()


def styles_of(ax) -> list[tuple]:
  return [(line.get_color(), line.get_marker(), line.get_linestyle()) for line in ax.get_lines()
          if line.get_label() and not line.get_label().startswith("_")]


def labelled_ticks(ax) -> list[float]:
  """The y values of the labelled ticks inside the axes' range."""
  low, high = ax.get_ylim()
  return [t.get_position()[1] for t in ax.get_yticklabels() if t.get_text() and low <= t.get_position()[1] <= high]


def test_every_row_of_a_figure_has_a_colour_and_a_marker_of_its_own_and_the_control_a_panel_of_its_own(tmp_path):
  styles = plots.method_styles([f"row {i}" for i in range(20)])
  assert len({s["color"] for s in styles.values()}) == 20
  assert len({s["marker"] for s in list(styles.values())[:15]}) == 15

  # The probes' plot (make demo): 22 methods, four of them a learned table (points only) that stop at length 16.
  config = config_args.load_config("configs/probes.py")
  short = {"absolute", "bert_r", "tupe_a", "tupe_r"}
  results = {m: {t: {str(l): "unsupported" if m in short and l > 16 else 0.5 for l in (16, 32, 64)}
                 for t in config.tasks} for m in config.methods}
  fig = probes.plot_accuracy(results, config, str(tmp_path / "probes.png"))
  for ax in fig.axes:
    drawn = styles_of(ax)
    assert len(drawn) == len(config.methods) == 22 and len({(c, m) for c, m, _ in drawn}) == len(drawn)
    assert len({c for c, _, _ in drawn[:20]}) == 20
    assert [t.get_text() for t in ax.get_xticklabels()] == ["16", "32", "64"]

  # The length harness's plot: the fifteen rows of methods=extrapolation+absolute (RoPE and T5 once both red
  # triangles) in one panel, a colour and a marker each, ticks at the lengths (32, not 3x10^1) and at least four
  # labelled perplexities within 11 to 14.5; the positive control (26 to 40) in a panel of its own.
  config = config_args.load_config("configs/length.py:methods=extrapolation+absolute,runlocal")
  lengths = [config.train_len * m for m in config.eval_multiples]
  rows = list(config.methods) + [length_harness.control_name(config)]
  results = {m: {"perplexity": {str(l): 11.0 + 0.25 * i + l / 150 for l in lengths}} for i, m in enumerate(rows)}
  results["none+keys"] = {"perplexity": {str(l): 26.0 + l / 36 for l in lengths}}
  methods_ax, control_ax = length_harness.plot(results, config, rows, str(tmp_path / "length.png")).axes
  drawn = styles_of(methods_ax) + styles_of(control_ax)
  assert [line.get_label() for line in methods_ax.get_lines() if not line.get_label().startswith("_")] == rows[:-1]
  assert [line.get_label() for line in control_ax.get_lines() if not line.get_label().startswith("_")] == ["none+keys"]
  assert len({c for c, _, _ in drawn}) == len({m for _, m, _ in drawn}) == len(rows)
  assert methods_ax.get_ylim()[1] < 20 < control_ax.get_ylim()[0]  # the control stretches no axis
  assert len(labelled_ticks(methods_ax)) >= 4 and len(labelled_ticks(control_ax)) >= 4
  assert [t.get_text() for t in methods_ax.get_xticklabels()] == [str(l) for l in lengths] == [
      "32", "64", "128", "256", "512"]
  # a row that spans more than three times: a log axis, still a labelled tick at least every factor of 2.5
  results["none"]["perplexity"]["512"] = 130.0
  methods_ax, _ = length_harness.plot(results, config, rows, str(tmp_path / "length.png")).axes
  ticks = labelled_ticks(methods_ax)
  assert methods_ax.get_yscale() == "log" and len(ticks) >= 4 and max(np.diff(np.log(ticks))) <= np.log(2.5)


@pytest.mark.xdist_group("figures_sweep")
def test_figures_label_lengths_as_lengths_and_keep_colour_bars_clear_of_the_next_panel(sweep_root, tmp_path):
  (ax,) = figures.length(str(sweep_root), str(tmp_path / "f1.png")).axes
  assert [t.get_text() for t in ax.get_xticklabels()] == ["32", "64"]
  fig = figures.terms(str(sweep_root / "absolute" / "pretrain"), str(tmp_path / "terms.png"))
  panels, bars = fig.axes[:4], fig.axes[4:]
  assert len(bars) == 4
  canvas = FigureCanvasAgg(fig)  # the figure drawn again as the PNG was: extents with the tick labels
  canvas.draw()
  renderer = canvas.get_renderer()
  for bar, next_panel in zip(bars, panels[1:]):
    assert bar.get_tightbbox(renderer).x1 < next_panel.get_tightbbox(renderer).x0
  with pytest.raises(ValueError, match=r"--head=9: the run has 4 heads; allowed: 0 to 3"):
    figures.terms(str(sweep_root / "absolute" / "pretrain"), str(tmp_path / "terms.png"), head=9)
  with pytest.raises(ValueError, match=r"--length=64: the run's position table has 32 positions; allowed: 1 to 32"):
    figures.terms(str(sweep_root / "absolute" / "pretrain"), str(tmp_path / "terms.png"), length=64)
