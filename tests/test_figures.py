"""Every figure command writes a PNG from real runs (and refuses runs of the wrong kind)."""

import json

import pytest

from posjax.experiments import figures, protocol
from posjax.main import train


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


@pytest.mark.parametrize("figure, source", [("mlm-loss", "root"), ("length", "root"),
                                            ("correlation", "tupe_a"), ("terms", "absolute")])
def test_every_figure_writes_a_png(sweep_root, tmp_path, figure, source):
  where = ["--root", str(sweep_root)] if source == "root" else ["--workdir", str(sweep_root / source / "pretrain")]
  assert figures.main([figure, *where, "--out", str(tmp_path / "figure.png")]) == 0
  assert (tmp_path / "figure.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_figures_refuse_runs_of_the_wrong_kind(sweep_root, tmp_path):
  assert figures.main(["correlation", "--workdir", str(sweep_root / "absolute" / "pretrain"), "--out",
                       str(tmp_path / "x.png")]) == 2
  with pytest.raises(ValueError, match=r"uses position 'tupe_a'; the four terms are of an absolute-position model"):
    figures.terms(str(sweep_root / "tupe_a" / "pretrain"), str(tmp_path / "x.png"))
