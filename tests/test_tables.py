"""The papers' tables: row configs, sweeps (expansion, local runs that skip and resume, printed commands) and
the report's protocol (median over seeds, best learning rate, the GLUE average, missing runs)."""

import json
import os
import shlex
import shutil
import subprocess
import sys

import pytest

from posjax import config_args, results, tasks
from posjax.experiments import protocol, report, sweep
from posjax.main import train
from posjax.train import validate
from conftest import ROOT

TABLES = ("experiments/tupe/table1.py", "experiments/tupe/table4.py", "experiments/huang2020/table1.py",
          "experiments/huang2020/inductive.py")


def test_table1_expands_to_every_row_task_learning_rate_and_seed(tmp_path):
  runs = sweep.plan("experiments/tupe/table1.py:runlocal", str(tmp_path))
  pretrain = [r for r in runs if r.kind == "pretrain"]
  finetune = [r for r in runs if r.kind == "finetune"]
  # 9 rows, of which the two "mid" rows share their runs' pre-training; 8 tasks x 2 lrs x 2 seeds per row.
  assert len(pretrain) == 7 and len(finetune) == 9 * 8 * 2 * 2
  by_name = {r.name: r for r in runs}
  mid = by_name["TUPE-A_mid/rte/lr0.001_seed2"]
  assert mid.depends_on == ["TUPE-A/pretrain"] and mid.overrides == {
      "init": str(tmp_path / "TUPE-A" / "pretrain"), "init_step": 100,
      "data.cache_dir": str(tmp_path / "feature_cache")}
  assert by_name["TUPE-A/pretrain"].overrides == {} and by_name["TUPE-A/pretrain"].options.endswith(",keep=100")
  assert protocol.build(by_name["TUPE-A/pretrain"]).keep_steps == (100,)
  assert by_name["TUPE-A_tie-cls/pretrain"].overrides == {"model.position_options.cls_reset": "none"}
  order = [r.name for r in runs]
  assert all(order.index(r.depends_on[0]) < order.index(r.name) for r in finetune)
  manifest = json.loads((tmp_path / "manifest.json").read_text())
  assert len(manifest["runs"]) == len(runs) and manifest["config"] == "experiments/tupe/table1.py:runlocal"
  full = sweep.plan("experiments/tupe/table1.py", str(tmp_path / "full"))
  assert len(full) == 7 + 9 * 8 * 4 * 5  # the paper's grid: 4 learning rates x 5 seeds
  # The mid row's step is kept beside the recipe's (Figure 5's 100k and 600k), not instead of them.
  assert protocol.build(next(r for r in full if r.name == "TUPE-A/pretrain")).keep_steps == (100_000, 300_000, 600_000)


def test_a_runlocal_sweep_trains_each_run_at_its_grids_learning_rate(tmp_path):
  runs = [r for r in sweep.plan("experiments/tupe/table1.py:row=TUPE-R,runlocal", str(tmp_path)) if r.kind == "finetune"]
  assert {r.lr for r in runs} == {1e-3, 3e-4}
  assert all(protocol.build(r).learning_rate == r.lr for r in runs)


@pytest.mark.parametrize("table", ["experiments/tupe/table1.py", "experiments/tupe/table4.py",
                                   "experiments/huang2020/inductive.py"])
def test_a_runlocal_tables_pretraining_is_tiny_unless_its_size_is_named(tmp_path, table):
  for options, hidden in (("runlocal", 64), ("size=base,runlocal", 768)):
    run = next(r for r in sweep.plan(f"{table}:{options}", str(tmp_path)) if r.kind == "pretrain")
    assert protocol.build(run).model.hidden_size == hidden, options


@pytest.mark.parametrize("config, fields", [
    ("finetune/glue.py:task=rte,lr=3e-5,max_len=128,epochs=2,size=base,runlocal",
     dict(learning_rate=3e-5, max_len=128, total_epochs=2.0, total_steps=None, model_size="base")),
    ("finetune/glue.py:task=rte,runlocal", dict(learning_rate=1e-3, max_len=64, total_steps=60, model_size="tiny")),
    ("finetune/squad.py:lr=3e-5,max_len=128,runlocal", dict(learning_rate=3e-5, max_len=128, total_steps=80)),
    ("finetune/glue.py:task=rte,source=tfds,runlocal", {"data.source": "tfds", "data.data_dir": "", "max_len": 64}),
    ("finetune/squad.py:source=tfds,runlocal", {"data.source": "tfds", "data.train_file": "train-v1.1.json"}),
    ("pretrain.py:size=base,runlocal", {"model.hidden_size": 768, "max_len": 64}),
    ("clm.py:size=base,runlocal", {"model.hidden_size": 768, "model.causal": True}),
    ("clm.py:runlocal", {"model.hidden_size": 64}),
    ("electra.py:size=base,runlocal", {"model.hidden_size": 768, "generator.hidden_size": 256}),
    ("electra.py:runlocal", {"model.hidden_size": 64, "generator.hidden_size": 32}),
    ("length.py:size=base,runlocal", {"size": "base", "train_len": 32}),
])
def test_options_named_with_runlocal_keep_their_values(config, fields):
  built = config_args.load_config(f"configs/{config}")
  for field, value in fields.items():
    got = built
    for part in field.split("."):
      got = got[part]
    assert got == value, field


def test_rows_are_addressed_by_the_papers_names_and_unknown_ones_are_errors(tmp_path):
  runs = sweep.plan("experiments/tupe/table1.py:row=TUPE-R (mid)", str(tmp_path))
  assert {r.row for r in runs} == {"TUPE-R", "TUPE-R (mid)"}  # the mid row brings its pre-training
  with pytest.raises(ValueError, match=r"unknown row 'TUPE-X'; TUPE Table 1 has \['BERT-A', 'BERT-R'"):
    sweep.plan("experiments/tupe/table1.py:row=TUPE-X", str(tmp_path))
  with pytest.raises(ValueError, match=r"unknown row\(s\) \['Method 9'\]"):
    sweep.plan("experiments/huang2020/table1.py", str(tmp_path), rows=["Method 9"])
  with pytest.raises(ValueError, match=r"unknown config field 'learning_rat'"):
    sweep.plan("configs/finetune/glue.py:task=rte,runlocal", str(tmp_path), grid={"learning_rat": [1, 2]})


# A sweep has four code paths: a plain row, a row with position options (the pipeline test's table below), a "mid"
# row fine-tuning from a kept step of another row's pre-training, and ELECTRA pre-training. Each runs end to end once
# (one step of each run); every other row differs only by its position options, which the model tests cover: its
# configs are built and validated (the model traced), without a compile.
END_TO_END = {"experiments/tupe/table4.py": ["ELECTRA-TUPE (mid)"],
              "experiments/huang2020/inductive.py": ["Method 4"]}  # SQuAD at three lengths


def one_step(runs):
  """Each run cut to one step; a mid row's fine-tuning starts from step 1, which its pre-training keeps."""
  for run in runs:
    run.overrides.update(total_steps=1, eval_every_steps=0, **({"warmup_steps": 0} if run.kind == "pretrain" else {}))
    if run.overrides.get("init_step"):
      run.overrides["init_step"] = 1
      next(r for r in runs if r.name == run.depends_on[0]).overrides["keep_steps"] = (1,)
  return runs


@pytest.mark.slow
@pytest.mark.parametrize("table", END_TO_END)
def test_each_sweep_code_path_runs_in_runlocal_mode(tmp_path, table):
  """Pre-training and the first task's fine-tuning (seed 1, the largest learning rate) of the chosen rows."""
  runs = sweep.plan(f"{table}:runlocal", str(tmp_path), rows=END_TO_END[table])
  first_task = next(r.task for r in runs if r.kind == "finetune")
  # The smallest learning rate: not runlocal's own (1e-3), which the grid's must win over.
  chosen = one_step([r for r in runs if r.kind == "pretrain" or (r.task == first_task and r.seed == 1 and r.lr == min(
      x.lr for x in runs if x.kind == "finetune"))])
  assert {r.row for r in chosen if r.kind == "finetune"} == set(END_TO_END[table])
  sweep.run_local(chosen, str(tmp_path), train, say=lambda message: None)
  assert all(r.finished() for r in chosen)
  assert all(protocol.results(r)["learning_rate"] == r.lr for r in chosen if r.kind == "finetune")
  assert all(protocol.results(r)["init_step"] == 1 for r in chosen if r.overrides.get("init_step"))


@pytest.mark.parametrize("table", TABLES + ("experiments/tupe/table3.py",))
def test_every_rows_pretraining_config_is_valid(tmp_path, table):
  """Every row's pre-training config as the sweep builds it: ranges, data, the model and its position options
  (traced, not compiled)."""
  runs = [r for r in one_step(sweep.plan(f"{table}:runlocal", str(tmp_path))) if r.kind == "pretrain"]
  for run in runs:
    assert validate.validate(protocol.build(run), run.workdir, tasks.build).config.total_steps == 1, run.name
  assert not any(os.path.exists(r.workdir) for r in runs)  # validation writes nothing


def tiny_table(tmp_path):
  """A table config file with one row (its own position options), one task, one learning rate, two seeds, a few
  steps."""
  path = tmp_path / "tiny_table.py"
  path.write_text(f'''
import ml_collections
def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.job, c.name = "table", "tiny"
  c.pretrain = dict(config="configs/pretrain.py", options="runlocal,position=shaw",
                    overrides=[["total_steps", 4], ["warmup_steps", 1], ["eval_every_steps", 0],
                               ["checkpoint_every_steps", 2], ["batch_size", 8], ["max_len", 32]])
  c.finetune = dict(sst2=dict(config="configs/finetune/glue.py", options="task=sst2,runlocal",
                              overrides=[["total_steps", 4], ["checkpoint_every_steps", 2], ["keep_checkpoints", 2]]))
  c.lrs, c.seeds = (1e-3,), (1, 2)
  c.columns = [["SST", "sst2", "accuracy"]]
  c.average = ""
  c.rows = {{"Shaw": dict(options="", overrides=[["model.position_options.max_distance", 4]], step=None,
                         pretrain_of="", paper=dict(SST=50.0))}}
  return c
''')
  return str(path)


@pytest.mark.slow
def test_a_table_config_runs_from_posjax_main_as_a_pipeline_that_skips_finished_runs_and_resumes_unfinished_ones(
    tmp_path, capsys):
  config = tiny_table(tmp_path)
  root = tmp_path / "root"
  sweep.run_table(config_args.load_config(config), str(root), train)  # what posjax.main does with a table config
  assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")] == [
      "[1/3] Shaw/pretrain", "[2/3] Shaw/sst2/lr0.001_seed1", "[3/3] Shaw/sst2/lr0.001_seed2"]
  assert all(r.finished() for r in protocol.read_manifest(str(root))[1])
  # the row's position options: its pre-training's, and its fine-tuning's through the encoder it starts from
  for run in ("pretrain", "sst2/lr0.001_seed1"):
    assert json.loads((root / "Shaw" / run / "model_config.json").read_text())["position_options"][
        "max_distance"] == 4, run
  said = []
  seed2 = root / "Shaw" / "sst2" / "lr0.001_seed2"
  finished = json.loads((seed2 / "results.json").read_text())
  (seed2 / "results.json").unlink()  # unfinished: killed after step 2's checkpoint
  shutil.rmtree(seed2 / "checkpoints" / "4")
  sweep.run_local(sweep.plan(config, str(root)), str(root), train, say=said.append)  # children: the launcher test
  assert said == ["[1/3] Shaw/pretrain: finished", "[2/3] Shaw/sst2/lr0.001_seed1: finished",
                  "[3/3] Shaw/sst2/lr0.001_seed2"]
  assert json.loads((seed2 / "results.json").read_text()) == finished
  markdown = report.write(str(root))
  values = [json.loads((root / "Shaw" / "sst2" / f"lr0.001_seed{s}" / "results.json").read_text())["metrics"]["sst2"]
            ["accuracy"] for s in (1, 2)]
  median = sum(values) / 2
  assert f"| Shaw | 4 | {median:.2f} (50.00, {median - 50:+.2f}) n=2 ±{abs(values[0] - values[1]):.2f} |" in markdown


def test_printed_commands_run(tmp_path):
  out = subprocess.run([sys.executable, "-m", "posjax.experiments.sweep", "--config=configs/finetune/glue.py:task=sst2,runlocal",
                        f"--root={tmp_path}", "--launcher=print", "--grid=total_steps=1,2"], cwd=ROOT,
                       capture_output=True, text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
  assert out.returncode == 0, out.stderr[-2000:]
  lines = out.stdout.strip().splitlines()
  assert len(lines) == 2 and all("--config.total_steps=" in line for line in lines)
  first = shlex.split(lines[0])  # the local launcher's test below runs such commands as children
  assert first[1:3] == ["-m", "posjax.main"] and f"--workdir={tmp_path}/run/total_steps=1" in first, lines[0]


def test_the_local_launcher_runs_each_printed_command_as_a_child_and_skips_finished_runs(tmp_path):
  command = [sys.executable, "-m", "posjax.experiments.sweep", "--config=configs/finetune/glue.py:task=sst2,runlocal",
             f"--root={tmp_path}", "--grid=total_steps=1"]
  env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
  first = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
  assert first.returncode == 0, first.stderr[-2000:]
  assert json.loads((tmp_path / "run" / "total_steps=1" / "results.json").read_text())["step"] == 1
  assert any((tmp_path / "compilation_cache").iterdir())  # the children shared the sweep's cache
  again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
  assert again.returncode == 0 and "[1/1] run/total_steps=1: finished" in again.stdout
  broken = subprocess.run(command[:-1] + ["--grid=learning_rate=-1.0"], cwd=ROOT, capture_output=True, text=True,
                          env=env)
  assert broken.returncode == 2 and broken.stderr.strip().splitlines()[-1].startswith(
      "error: run/learning_rate=-1.0 failed (exit status 2"), broken.stderr[-2000:]


def write_results(run, metrics, **info):
  os.makedirs(run.workdir, exist_ok=True)
  with open(os.path.join(run.workdir, "results.json"), "w") as f:
    json.dump({"step": 1, "metrics": metrics, **info}, f)


def test_the_report_applies_median_over_seeds_and_best_learning_rate(tmp_path):
  runs = sweep.plan("experiments/tupe/table1.py:runlocal,row=TUPE-A", str(tmp_path))
  finetune = {(r.task, r.lr, r.seed): r for r in runs if r.kind == "finetune"}
  # RTE: lr 1e-3 seeds 60, 70 (median 65); lr 3e-4 seeds 62, 90 (median 76): the best lr is 3e-4, 76.
  for (lr, seed), value in {(1e-3, 1): 60.0, (1e-3, 2): 70.0, (3e-4, 1): 62.0, (3e-4, 2): 90.0}.items():
    write_results(finetune[("rte", lr, seed)], {"rte": {"accuracy": value}})
  markdown, rows, missing = report.build(str(tmp_path))
  assert "| TUPE-A | — | — (86.05) |" in markdown  # MNLI-m: no result yet, the paper's number shown
  assert "76.00 (71.61, +4.39) n=2 ±28.00 |" in markdown
  assert len(missing) == 7 * 4 and "TUPE-A/rte/lr0.001_seed1" not in missing
  rte = next(r for r in rows if r[:2] == ["TUPE-A", "RTE"])
  assert rte[2:] == [76.0, 71.61, pytest.approx(4.39), 3e-4, 2, 28.0, True, "—"]

  # Every task at one value per task: the GLUE average of the nine numbers (MNLI twice), as the paper.
  numbers = {"mnli_matched": 80.0, "mnli_mismatched": 82.0, "qnli": 90.0, "qqp": 88.0, "sst2": 91.0,
             "cola": 50.0, "mrpc": 85.0, "rte": 70.0, "stsb": 87.0}
  metric = {"cola": "matthews", "stsb": "pearson"}
  for (task, lr, seed), run in finetune.items():
    evaluators = ("mnli_matched", "mnli_mismatched") if task == "mnli" else (task,)
    write_results(run, {e: {metric.get(e, "accuracy"): numbers[e]} for e in evaluators})
  markdown, rows, missing = report.build(str(tmp_path))
  average = next(r for r in rows if r[:2] == ["TUPE-A", "Avg"])
  assert not missing and average[2] == pytest.approx(sum(numbers.values()) / 9)
  assert f"{sum(numbers.values()) / 9:.2f} (84.47" in markdown


def rte_grid(tmp_path, values, row="TUPE-A"):
  """A TUPE Table 1 sweep (runlocal: lrs 1e-3, 3e-4 x seeds 1, 2) with RTE results ``{(lr, seed): accuracy}``."""
  runs = sweep.plan(f"experiments/tupe/table1.py:runlocal,row={row}", str(tmp_path))
  finetune = {(r.task, r.lr, r.seed): r for r in runs if r.kind == "finetune"}
  for (lr, seed), value in values.items():
    write_results(finetune[("rte", lr, seed)], {"rte": {"accuracy": value}}, init_step=200)
  return finetune


def test_a_learning_rate_with_missing_seeds_is_not_eligible_while_a_complete_one_exists(tmp_path):
  # One lucky seed at 1e-3 (its other seed unfinished) against a complete 3e-4: the cell is 3e-4's median.
  rte_grid(tmp_path, {(1e-3, 1): 90.0, (3e-4, 1): 72.0, (3e-4, 2): 75.0})
  markdown, rows, _ = report.build(str(tmp_path))
  rte = next(r for r in rows if r[:2] == ["TUPE-A", "RTE"])
  assert rte[2] == 73.5 and rte[5] == 3e-4 and rte[8] is False
  assert "73.50 (71.61, +1.89) n=2 ±3.00 *partial 3/4* |" in markdown  # marked in the cell itself
  # No complete learning rate: the best of what finished, still marked.
  rte_grid(tmp_path / "b", {(1e-3, 1): 90.0, (3e-4, 1): 72.0})
  assert "90.00 (71.61, +18.39) n=1 *partial 2/4* |" in report.build(str(tmp_path / "b"))[0]


def test_failed_runs_never_become_a_median_and_are_listed(tmp_path):
  nan = float("nan")
  # Whatever the order of seeds and learning rates, a NaN is never a median: 1e-3 has a failed seed, so the
  # complete 3e-4 is reported.
  for i, values in enumerate([{(1e-3, 1): nan, (1e-3, 2): 95.0, (3e-4, 1): 70.0, (3e-4, 2): 71.0},
                              {(1e-3, 1): 95.0, (1e-3, 2): nan, (3e-4, 2): 70.0, (3e-4, 1): 71.0}]):
    rte_grid(tmp_path / str(i), values)
    markdown, rows, _ = report.build(str(tmp_path / str(i)))
    assert next(r for r in rows if r[:2] == ["TUPE-A", "RTE"])[2] == 70.5
    assert "nan" not in markdown.lower().replace("failed runs", "")
    assert f"Failed runs (1: a non-finite number, left out of every median): TUPE-A/rte/lr0.001_seed{i + 1}" in markdown


def test_mnli_matched_and_mismatched_come_from_one_learning_rate_chosen_on_matched(tmp_path):
  runs = sweep.plan("experiments/tupe/table1.py:runlocal,row=TUPE-A", str(tmp_path))
  for run in runs:
    if run.task == "mnli":  # 1e-3 is best on matched, 3e-4 on mismatched
      m, mm = (80.0, 70.0) if run.lr == 1e-3 else (79.0, 90.0)
      write_results(run, {"mnli_matched": {"accuracy": m}, "mnli_mismatched": {"accuracy": mm}})
  rows = report.build(str(tmp_path))[1]
  cells = {r[1]: r for r in rows if r[0] == "TUPE-A"}
  assert (cells["MNLI-m"][2], cells["MNLI-m"][5]) == (80.0, 1e-3)
  assert (cells["MNLI-mm"][2], cells["MNLI-mm"][5]) == (70.0, 1e-3)


def test_a_grids_values_are_scored_as_rows_of_their_own_and_a_nan_in_any_column_fails_the_run(tmp_path):
  runs = sweep.plan("experiments/tupe/table1.py:runlocal,row=TUPE-A", str(tmp_path), grid={"data.batching": ["fixed",
                                                                                                         "dynamic"]})
  for run in runs:
    if run.task == "rte":
      write_results(run, {"rte": {"accuracy": 61.0 if run.name.endswith("fixed") else 81.0}})
    if run.task == "mnli":  # one run's mismatched is NaN: the run failed, in both columns
      mm = float("nan") if run.name == "TUPE-A/mnli/lr0.001_seed1/batching=fixed" else 70.0
      write_results(run, {"mnli_matched": {"accuracy": 80.0}, "mnli_mismatched": {"accuracy": mm}})
  markdown, rows, _ = report.build(str(tmp_path))
  cells = {(r[0], r[1]): r for r in rows}
  assert cells[("TUPE-A [batching=fixed]", "RTE")][2:4] == [61.0, 71.61]
  assert cells[("TUPE-A [batching=dynamic]", "RTE")][2] == 81.0 and cells[("TUPE-A [batching=dynamic]", "RTE")][6] == 2
  assert cells[("TUPE-A [batching=fixed]", "MNLI-mm")][5] == 3e-4  # 1e-3 lost a seed: the complete lr
  assert "Failed runs (1: a non-finite number, left out of every median): TUPE-A/mnli/lr0.001_seed1/batching=fixed" \
      in markdown


def test_the_report_shows_the_step_each_row_starts_from_and_marks_a_partial_average(tmp_path):
  runs = sweep.plan("experiments/tupe/table1.py:runlocal,row=TUPE-A (mid)", str(tmp_path))
  metric = {"cola": "matthews", "stsb": "pearson"}
  for run in runs:
    if run.kind == "finetune" and not (run.task == "qqp" and run.seed == 2 and run.lr == 3e-4):
      evaluators = ("mnli_matched", "mnli_mismatched") if run.task == "mnli" else (run.task,)
      write_results(run, {e: {metric.get(e, "accuracy"): 60.0} for e in evaluators},
                    init_step=100)
  markdown = report.build(str(tmp_path))[0]
  assert "| TUPE-A (mid) | 100 | 60.00 (84.76, -24.76) n=2 ±0.00 |" in markdown
  assert "60.00 (83.33, -23.33) *partial* |" in markdown  # the mid row's average: its QQP lacks a seed


def test_the_report_shows_lengths_a_method_cannot_reach(tmp_path):
  runs = sweep.plan("experiments/huang2020/inductive.py:runlocal,row=absolute", str(tmp_path))
  (run,) = [r for r in runs if r.kind == "finetune"]
  write_results(run, {"squad@32": {"f1": 40.0}, "squad@64": {"f1": 30.0},
                      "squad@128": {"f1": results.UNSUPPORTED, "exact_match": results.UNSUPPORTED}})
  markdown, _, missing = report.build(str(tmp_path))
  assert "| absolute | — | 40.00 n=1 | 30.00 n=1 | unsupported |" in markdown and not missing


class FakeExecutor:
  """submitit's AutoExecutor at its boundary: records parameters, submissions and job arrays."""
  submitted, arrays = [], []

  def __init__(self, folder):
    self.folder, self.parameters, self.in_batch = folder, {}, None

  def update_parameters(self, **parameters):
    self.parameters = parameters

  def submit(self, function):
    job = type("Job", (), {"job_id": str(100 + len(FakeExecutor.submitted))})()
    FakeExecutor.submitted.append((dict(self.parameters), function.command, job.job_id))
    if self.in_batch is not None:
      self.in_batch.append(job.job_id)
    return job

  def batch(self):
    import contextlib

    @contextlib.contextmanager
    def context():
      self.in_batch = []
      yield
      FakeExecutor.arrays.append(self.in_batch)
      self.in_batch = None
    return context()


def test_slurm_submits_pretraining_then_a_dependent_job_array_per_row(tmp_path, monkeypatch):
  import submitit

  monkeypatch.setattr(submitit, "AutoExecutor", FakeExecutor)
  FakeExecutor.submitted, FakeExecutor.arrays = [], []
  runs = sweep.plan("experiments/huang2020/table1.py:runlocal", str(tmp_path), rows=["Shaw", "Method 4"])
  sweep.run_slurm(runs, str(tmp_path), nodes=2, tasks_per_node=4, gpus_per_node=4, partition="gpu")
  pretrain = [s for s in FakeExecutor.submitted if s[0]["name"].endswith("/pretrain")]
  assert [p[0]["nodes"] for p in pretrain] == [2, 2] and all("--distributed" in p[1] for p in pretrain)
  assert all(p[0]["slurm_partition"] == "gpu" and p[0]["gpus_per_node"] == 4 for p in pretrain)
  finetune = [s for s in FakeExecutor.submitted if not s[0]["name"].endswith("/pretrain")]
  assert len(FakeExecutor.arrays) == 2 and all(len(a) == 1 for a in FakeExecutor.arrays)
  assert [f[0]["slurm_additional_parameters"] for f in finetune] == [
      {"dependency": f"afterok:{pretrain[0][2]}"}, {"dependency": f"afterok:{pretrain[1][2]}"}]
  assert all("--distributed" not in f[1] for f in finetune)
