"""The length-generalisation harness (``configs/length.py``): every method trained once, evaluated at multiples of
its length (perplexity, accuracy, passkey retrieval), the probes run beside them, the tables and the plot written,
``unsupported`` past a learned table, finished methods skipped, finished runs read without training them, the
positive control and the needle grid, context extension zero-shot and fine-tuned."""

import json
import shutil

import numpy as np
import pytest

from posjax.experiments import extension, length
from posjax.models import TransformerConfig
from posjax.positions import rotary
from posjax.main import evaluate_checkpoint, train
from conftest import load_config
import reference


PROBE_STEPS = (("steps", 4), ("warmup_steps", 1), ("eval_batch_size", 8))


def harness_config(methods="alibi+absolute", **fields):
  config = load_config("length", f"methods={methods},runlocal,control=" + (",passkey=False" if "passkey" in fields
                                                                          else ""))
  fields.pop("passkey", None)
  config.update({"steps": 12, "eval_multiples": (1, 2), "eval_batches": 1, "probes": (), **fields})
  return config


def test_the_harness_writes_a_table_per_measure_and_skips_finished_methods(tmp_path):
  config = harness_config(probes=("copy",), probe_overrides=PROBE_STEPS, steps=4)
  config.passkey.depths = 3
  results = length.run(config, str(tmp_path), train)
  assert list(results) == ["alibi", "absolute"]
  b = config.batch_size  # every length on the same 1 x b x 64 tokens: 2 batches of rows of 32, 1 of 64
  assert results["alibi"]["tokens"] == {"32": 2 * b * 31, "64": b * 63}
  assert results["absolute"]["perplexity"]["64"] == "unsupported"
  assert isinstance(results["absolute"]["perplexity"]["32"], float)
  assert all(isinstance(v, float) and v > 1 for v in results["alibi"]["perplexity"].values())
  assert results["absolute"]["passkey"]["64"] == "unsupported"
  assert all(isinstance(v, float) and 0 <= v <= 1 for v in results["alibi"]["passkey"].values())
  text = (tmp_path / "length.md").read_text()
  assert text.startswith("- `alibi`, `absolute`: trained here, 4 steps at length 32 (lm: configs/lm.py, each "
                         "method's default position options)\n\nEvaluated at 1x, 2x of length 32")
  assert "**next-token perplexity (lower is better)**" in text and "| `absolute` |" in text
  assert "**passkey retrieval (% of prompts whose whole key greedy decoding reproduces)**" in text
  assert "**passkey key tokens retrieved (%)**" in text
  assert results["absolute"]["probes"]["copy"]["32"] == "unsupported"  # the probe's own length is 16
  assert all(isinstance(v, float) for v in results["alibi"]["probes"]["copy"].values())
  assert ("**probe `copy`: token accuracy (%), a decoder of 2 x 64 trained at length 16 for 4 steps**\n\n"
          "| method | copy @16 | copy @32 |") in text
  probe_run = json.loads((tmp_path / "probes" / "runs" / "alibi" / "copy" / "model_config.json").read_text())
  assert probe_run["causal"] and probe_run["max_len"] == 16
  assert "| `absolute` | " in text and "unsupported" in text
  assert (tmp_path / "length.png").stat().st_size > 0
  run = json.loads((tmp_path / "runs" / "alibi" / "config.json").read_text())
  assert run["task"] == "clm" and run["max_len"] == 32 and run["evals"]["x2"]["max_len"] == 64
  assert run["evals"]["passkey_x2"] == {**config.passkey.to_dict(), "kind": "passkey", "max_len": 64}
  assert run["passkey_train"]["fraction"] == 0.0
  evaluations = json.loads((tmp_path / "runs" / "alibi" / "results.json").read_text())["metrics"]
  assert set(evaluations["passkey_x2"]) == {"accuracy", "digit_accuracy", "accuracy@0.00", "accuracy@0.50",
                                            "accuracy@1.00"}
  # the needle grid: a line per row and depth, a panel per row
  assert set(results["alibi"]["needle"]["64"]) == {"0.00", "0.50", "1.00"}
  assert results["absolute"]["needle"]["64"]["0.50"] == "unsupported"
  assert "| `alibi` | 1.00 | " in text and "| `absolute` | 0.50 | " in text
  assert (tmp_path / "needle.png").stat().st_size > 0

  assert length.run(config, str(tmp_path), must_not_train) == results
  # the positive control (a row like the methods', trained the same way): the first method by default, trained for
  # control_steps with passkey prompts in half its rows
  control = load_config("length", "methods=alibi+absolute,runlocal")
  control.control_steps = 3
  row = length.plan(control, str(tmp_path))["alibi+keys"]
  run = row.make()
  assert row.method == "alibi" and run.model.position == "alibi" and run.total_steps == 3
  assert run.passkey_train.to_dict() == {"fraction": 0.5, **{k: v for k, v in control.passkey.to_dict().items()
                                                             if k in ("digits", "symbols", "intro", "filler",
                                                                      "key_line", "question")}}
  assert row.note == ("`alibi+keys`: the positive control, trained for 3 steps at length 32 with passkey prompts in "
                      "50% of its rows")


def must_not_train(*args):
  raise AssertionError("the harness trained a run it was given to read")


def files(directory):
  return {str(p.relative_to(directory)): p.stat().st_mtime_ns for p in directory.rglob("*")}


def test_the_harness_reads_a_finished_run_and_extends_it_zero_shot_and_fine_tuned(tmp_path):
  source = tmp_path / "clm_rope"
  run = load_config("clm", "position=rope,runlocal")
  run.update(total_steps=3, warmup_steps=1, max_len=32, eval_every_steps=3, checkpoint_every_steps=3, progress=False)
  train(run, str(source))
  before = files(source)
  # the longest length's 2 batches of tokens are 4 batches at 32: the run's own evaluation
  config = harness_config(methods="", runs=(str(source),), eval_batches=2, model="clm")
  results = length.run(config, str(tmp_path / "harness"), must_not_train, evaluate=evaluate_checkpoint)
  assert files(source) == before  # only read
  own = json.loads((source / "results.json").read_text())["metrics"]["eval"]
  assert results["rope"]["perplexity"]["32"] == pytest.approx(own["perplexity"], rel=1e-5)  # the run's parameters
  assert isinstance(results["rope"]["perplexity"]["64"], float)
  assert set(results["rope"]["passkey"]) == {"32", "64"}
  evaluated = json.loads((tmp_path / "harness" / "runs" / "rope" / "results.json").read_text())
  assert evaluated["evaluated_from"] == str(source) and evaluated["step"] == 3
  text = (tmp_path / "harness" / "length.md").read_text()
  assert (f"- `rope`: read from {source}: 3 steps at length 32, position options the recipe's defaults; not trained "
          "here") in text and "| `rope` |" in text and "trained here, 12 steps" not in text
  assert length.run(config, str(tmp_path / "harness"), must_not_train, evaluate=must_not_train) == results
  # a second run of the same method (a variant) is a row of its own, named by its directory
  shutil.copytree(source, tmp_path / "rope_variant")
  both = harness_config(methods="", runs=(str(source), str(tmp_path / "rope_variant")), model="clm")
  rows = length.plan(both, str(tmp_path / "harness"))
  assert list(rows) == ["rope", "rope (rope_variant)"] and rows["rope (rope_variant)"].method == "rope"
  assert rows["rope (rope_variant)"].make()[1] == str(tmp_path / "rope_variant")
  # a run that differs from the recipe elsewhere says so in its name; a row trained here is never replaced
  changed = json.loads((tmp_path / "rope_variant" / "config.json").read_text())
  changed["data"]["random_positions"] = 512
  (tmp_path / "rope_variant" / "config.json").write_text(json.dumps(changed))
  mixed = harness_config(methods="rope", runs=(str(source), str(tmp_path / "rope_variant")), model="clm")
  assert list(length.plan(mixed, str(tmp_path / "mixed"))) == ["rope", "rope (clm_rope)",
                                                               "rope [data.random_positions=512]"]

  # context extension of the finished run: PI zero-shot (its checkpoint, interpolated) and fine-tuned at 2x
  extended = harness_config(methods="", passkey=None, model="clm", extension={
      "variants": ("pi",), "base": str(source), "factor": 2.0, "finetune_steps": 2, "lr_fraction": 0.1})
  results = length.run(extended, str(tmp_path / "extended"), train, evaluate=evaluate_checkpoint)
  assert list(results) == ["pi x2", "pi x2 +2 steps"]
  zero_shot = json.loads((tmp_path / "extended" / "runs" / "pi_x2" / "config.json").read_text())
  assert zero_shot["model"]["position_options"]["scaling"] == "linear" and zero_shot["max_len"] == 32
  tuned = json.loads((tmp_path / "extended" / "runs" / "pi_x2_2_steps" / "config.json").read_text())
  assert tuned["init_from"] == str(source) and tuned["max_len"] == 64 and tuned["total_steps"] == 2
  assert tuned["model"]["position_options"]["scaling"] == "linear" and tuned["model"]["position_options"]["factor"] == 2
  assert tuned["learning_rate"] == pytest.approx(0.1 * run.learning_rate)
  assert tuned["evals"]["x1"]["max_len"] == 32  # measured at the harness's lengths, not multiples of its own
  text = (tmp_path / "extended" / "length.md").read_text()
  assert f"`pi x2 +2 steps`: {source} with pi, trained 2 steps at length 64 at 0.1 of its learning rate" in text
  # that fine-tune, finished at another length, read back: a zero-shot row (its base with its options) and a
  # fine-tuned row, labelled by the options it changed, each saying how it was trained
  tuned_dir = tmp_path / "extended" / "runs" / "pi_x2_2_steps"
  extended.runs = (str(tuned_dir),)
  read = length.run(extended, str(tmp_path / "extended"), must_not_train, evaluate=evaluate_checkpoint)
  label = "rope (factor=2, scaling=linear)"
  assert list(read)[2:] == [f"{label} zero-shot", f"{label} +2 steps at 64"]
  for row, same in ((f"{label} zero-shot", "pi x2"), (f"{label} +2 steps at 64", "pi x2 +2 steps")):
    assert read[row]["perplexity"] == pytest.approx(results[same]["perplexity"], rel=1e-5)
  text = (tmp_path / "extended" / "length.md").read_text()
  assert (f"- `{label} zero-shot`: {source} (3 steps at length 32) evaluated with the position options of "
          f"{tuned_dir} (factor=2, scaling=linear") in text
  assert (f"- `{label} +2 steps at 64`: read from {tuned_dir}: fine-tuned from {source} (3 steps at length 32), 2 "
          "steps at length 64, position options factor=2, scaling=linear") in text

  with pytest.raises(ValueError, match=r"config.runs: .* was trained at length 32, the harness's config.train_len "
                                       r"is 64; evaluate it with train_len=32, or read a fine-tune \(init_from\) of a "
                                       r"run trained at 64$"):
    length.run(harness_config(methods="", runs=(str(source),), train_len=64), str(tmp_path / "other"), train)
  with pytest.raises(ValueError, match=r"config.extension.base=.* was trained at length 32, the harness's "
                                       r"config.train_len is 64; set train_len=32"):
    length.run(harness_config(methods="", passkey=None, model="clm", train_len=64,
                              extension=extended.extension.to_dict()), str(tmp_path / "other"), train)
  with pytest.raises(FileNotFoundError, match=r"config.runs: .*nowhere is not a finished run"):
    length.run(harness_config(runs=(str(tmp_path / "nowhere"),)), str(tmp_path / "other"), train)
  assert not (tmp_path / "other").exists()


def test_bad_harness_configs_are_errors_before_anything_is_written(tmp_path):
  with pytest.raises(ValueError, match=r"config.model='gpt'; allowed: \['lm', 'clm', 'mlm'\]"):
    length.run(harness_config(model="gpt"), str(tmp_path / "a"), train)
  with pytest.raises(ValueError, match=r"eval_multiples=\(0,\) must be whole numbers >= 1"):
    length.run(harness_config(eval_multiples=(0,)), str(tmp_path / "b"), train)
  config = harness_config(model="mlm")  # a decoder's passkey, asked of an encoder
  with pytest.raises(ValueError, match=r"config.passkey: passkey retrieval needs a decoder \(model='lm' or 'clm'\), "
                                       r"not model='mlm'; set config.passkey=None"):
    length.run(config, str(tmp_path / "b"), train)
  with pytest.raises(ValueError, match=r"config.stride=5: sliding-window perplexity needs a decoder \(model='lm' or "
                                       r"'clm'\) and a positive stride dividing train_len=32"):
    length.run(harness_config(stride=5), str(tmp_path / "b"), train)
  with pytest.raises(ValueError, match=r"probe task 'reverse' labels a token with a later one, which a decoder"):
    length.run(harness_config(probes=("reverse",)), str(tmp_path / "b"), train)
  assert load_config("length", "model=mlm,runlocal").passkey is None
  assert load_config("length", "runlocal,passkey=False").passkey is None
  with pytest.raises(ValueError, match="unknown position method 'fir'"):
    load_config("length", "methods=fire+fir,runlocal")
  # Huang et al.'s inductive rows as a named set (and no method twice)
  assert load_config("length", "methods=huang+shaw+rope,model=mlm").methods == (
      "absolute", "shaw", "huang_m1", "huang_m2", "huang_m3", "huang_m4", "rope")
  assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_context_extension_variants_follow_their_formulas():
  d, theta, factor = 16, 10_000.0, 4.0
  base = {"max_timescale": theta}
  ntk = extension.options("ntk", base, d, 32, factor)
  expected = (theta * factor ** (d / (d - 2))) ** (-np.arange(0, d, 2, dtype=np.float64) / d)  # NTK-aware base
  np.testing.assert_allclose(rotary.frequencies(rotary.RopeOptions(**ntk), d, 32, 128)[0], expected, rtol=1e-6)
  longrope = rotary.RopeOptions(**extension.options("longrope", base, d, 32, factor))
  np.testing.assert_allclose(rotary.frequencies(longrope, d, 32, 128)[0], expected, rtol=1e-6)  # past 32: NTK's
  np.testing.assert_allclose(rotary.frequencies(longrope, d, 32, 32)[0], theta ** (-np.arange(0, d, 2) / d),
                             rtol=1e-6)  # within the training length: RoPE's own
  assert extension.options("pi", base, d, 32, factor) == {**base, "scaling": "linear", "factor": 4.0}
  assert extension.options("yarn", base, d, 32, factor) == {**base, "scaling": "yarn", "factor": 4.0,
                                                            "original_max_len": 32}
  with pytest.raises(ValueError, match=r"context extension starts from an unscaled RoPE model; this one has "
                                       r"scaling='linear'"):
    extension.options("pi", {"scaling": "linear", "factor": 2.0}, d, 32, factor)
  with pytest.raises(ValueError, match=r"unknown variant 'ntk2'; allowed: \['unscaled', 'pi', 'ntk', 'yarn', "
                                       r"'longrope'\] or all"):
    load_config("length", "extension=pi+ntk2,runlocal")


def test_t5_rows_flag_the_pairs_whose_bucket_was_never_trained():
  # every attended pair of a decoder row (key j <= query i), its bucket by the reference's loop: the share whose
  # bucket no pair of a 32-token row reaches
  trained = {reference.t5_bucket(j - i, 32, 128, False) for i in range(32) for j in range(i + 1)}
  for size in (64, 512):
    pairs = [(i, j) for i in range(size) for j in range(i + 1)]
    want = sum(reference.t5_bucket(j - i, 32, 128, False) not in trained for i, j in pairs) / len(pairs)
    assert length_lib_share(size) == pytest.approx(want, abs=1e-12)
  assert length_lib_share(32) == 0.0
  config = harness_config(methods="t5")
  results = {"t5": {"perplexity": {"32": 9.5, "64": 10.0}, "accuracy": {"32": 0.2, "64": 0.1},
                    "untrained_buckets": {"32": 0.0, "64": length_lib_share(64)}}}
  text = length.tables(results, config, ["t5"]) + "\n" + length.bucket_footnote(results, config, ["t5"])
  assert "| `t5` | 9.50 | 10.00† |" in text and "| `t5` | 20.0 | 10.0† |" in text
  assert f"† `t5`: the share of attended pairs in T5 buckets never trained at 32: @64 {100 * length_lib_share(64):.0f}%" in text


def length_lib_share(size):
  return length.untrained_bucket_share({"num_buckets": 32, "max_distance": 128, "bidirectional": None}, 32, size,
                                       causal=True)


def test_seeds_train_each_row_again_and_the_tables_show_mean_and_spread(tmp_path):
  config = harness_config(methods="alibi", passkey=None, steps=3, seeds=2, stride=16)
  results = length.run(config, str(tmp_path), train)
  runs = [json.loads((tmp_path / "runs" / d / "results.json").read_text())["metrics"]
          for d in ("alibi", "alibi_seed1")]
  assert [json.loads((tmp_path / "runs" / d / "config.json").read_text())["seed"] for d in ("alibi", "alibi_seed1")] \
      == [0, 1]
  each = [run["x1"]["perplexity"] for run in runs]
  assert each[0] != each[1]
  assert results["alibi"]["perplexity"]["32"] == pytest.approx(np.mean(each), rel=1e-12)
  assert results["alibi"]["spread"]["perplexity"]["32"] == pytest.approx(np.std(each, ddof=1), rel=1e-9)
  assert results["alibi"]["seeds"]["perplexity"]["32"] == each
  text = (tmp_path / "length.md").read_text()
  assert f"| `alibi` | {np.mean(each):.2f} ± {np.std(each, ddof=1):.2f} |" in text
  # the loss at each token index of the rows of 64 (63 predictions a row), the mean over the seeds, and its figure
  by_position = [run["x2"]["loss_by_position"] for run in runs]
  assert len(by_position[0]) == 63 and results["alibi"]["loss_by_position"]["64"] == pytest.approx(
      np.mean(by_position, axis=0).tolist(), rel=1e-12)
  assert (tmp_path / "position.png").stat().st_size > 0
  # sliding-window perplexity beside it: windows of 32 and 64 every 16 tokens
  sliding = [run["sw_x2"]["perplexity"] for run in runs]
  assert results["alibi"]["sliding"]["64"] == pytest.approx(np.mean(sliding), rel=1e-12)
  assert "**sliding-window next-token perplexity (windows of each length every 16 tokens" in text
  assert length.run(config, str(tmp_path), must_not_train) == results


def test_layouts_are_rows_over_their_method_trained_here_or_read_from_runs(tmp_path):
  config = load_config("length", "methods=rope,layouts=irope+gemma3,layout_method=alibi,runlocal,control=")
  rows = length.plan(config, str(tmp_path))
  assert list(rows) == ["rope", "irope (alibi)", "gemma3 (alibi)"]
  run = rows["irope (alibi)"].make()
  model = TransformerConfig.from_config(run.model.to_dict(), 61, run.max_len)
  # a quarter of the training length (32) per chunk, every fourth layer global NoPE with Llama 4's temperature
  assert [(k.position, k.chunk) for k in model.layer_kinds] == [("alibi", 8), ("none", 0)]  # 2 tiny layers
  gemma3 = TransformerConfig.from_config(rows["gemma3 (alibi)"].make().model.to_dict(), 61, run.max_len)
  assert [(k.position, k.window) for k in gemma3.layer_kinds] == [("alibi@local", 8), ("alibi", 0)]
  assert rows["irope (alibi)"].note.startswith("`irope (alibi)`: `alibi` in the `irope` layout, chunked layers with "
                                               "the method, one in every 2 global NoPE")
  source = tmp_path / "gemma3_run"
  source.mkdir()
  finished = length.layout_config(config, "gemma3", {"window": 4, "every": 2})
  (source / "config.json").write_text(finished.to_json_best_effort())
  (source / "results.json").write_text(json.dumps({"step": 12, "metrics": {}}))
  read = length.read_runs(load_config("length", f"methods=,layouts=gemma3,layout_method=alibi,runs={source},"
                                                "runlocal,control="))
  assert list(read) == ["gemma3 (alibi) [model.layout_options.window=4]"]


def test_ruler_tasks_are_evaluators_at_every_length_with_a_positive_control():
  config = load_config("length", "methods=rope,ruler=niah_single_1+niah_multivalue,runlocal,control=")
  found = length.evaluators(config)
  assert found["ruler_niah_multivalue_x4"]["max_len"] == 128 and found["ruler_niah_multivalue_x4"]["kind"] == "ruler"
  assert found["ruler_niah_multivalue_x4"]["options"]["values"] == 2  # runlocal: at most 2 needles' values
  assert "ruler_niah_single_1" in length.measured(config)
  row = length.plan(config, "/tmp/unused")["rope+ruler"]
  run = row.make()
  assert run.ruler_train.fraction == 0.5 and set(run.ruler_train.tasks) == {"niah_single_1", "niah_multivalue"}
  assert run.total_steps == config.ruler_control_steps == 8000
  assert row.note.startswith("`rope+ruler`: the positive control of the RULER tasks, trained for 8000 steps")
  for arg, message in (("ruler=vt,runlocal", r"'vt' needs a real vocabulary"),
                       ("ruler=niah_x", r"unknown task\(s\) \['niah_x'\]"),
                       ("ruler=cwe,model=mlm", r"answered by decoding; use model=lm or clm")):
    with pytest.raises(ValueError, match=message):
      load_config("length", arg)
