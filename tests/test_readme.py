"""The README and docs/ as a new user meets them: the README a front page, each Python example runs on its own,
every relative link resolves, ``make`` alone lists the targets, and every command and config the README, docs and
configs name exists and loads."""

import pathlib
import re
import subprocess
import sys

import flax
import jax
import numpy as np

from posjax import config_args

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
DOCS = README.parent / "docs"
MARKDOWN = [README, *sorted(DOCS.glob("*.md")), *sorted((README.parent / "experiments").rglob("*.md"))]


def test_the_readme_is_a_front_page():
  assert len(README.read_text()) <= 15_000  # the rest lives in docs/


def test_examples_run_each_on_its_own():
  blocks = [(path, block) for path in MARKDOWN for block in re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)]
  assert [path.name for path, _ in blocks] == ["api.md", "api.md", "api.md", "kernels.md", "kernels.md"]
  previous = flax.config.flax_always_shard_variable
  namespaces = [{} for _ in blocks]
  try:
    for (path, block), namespace in zip(blocks, namespaces):
      exec(compile(block, str(path), "exec"), namespace)
  finally:
    flax.config.update("flax_always_shard_variable", previous)
  linen, bridged, bert, fused, own = namespaces
  assert linen["y"].shape == (2, 16, 64) and np.isfinite(linen["y"]).all()
  assert bridged["y"].shape == (2, 16, 64) and np.isfinite(bridged["y"]).all()
  assert bert["out"].last_hidden_state.shape == (2, 16, 32)
  assert bert["state"]["intermediates"]["position_bias"][0].shape == (1, 4, 16, 16)
  np.testing.assert_allclose(fused["out"], fused["reference"], rtol=1e-5, atol=1e-5)
  assert fused["dq"].shape == (2, 48, 4, 16) and np.isfinite(fused["dq"]).all()
  # the user's own terms: the table's and the temperature's gradients reach them
  d_table = np.asarray(own["d_terms"][1].table)  # causal: the entries of later keys are never read
  assert d_table.shape == (4, 8) and np.abs(d_table[:, :4]).min() > 0 and not d_table[:, 4:].any()
  assert own["d_terms"][0].beta.shape == (4,) and np.isfinite(own["dq"]).all()
  namespace = bridged
  # The NNX block trains: gradients reach the bridged linen parameters.
  from flax import nnx
  import jax.numpy as jnp
  grads = nnx.grad(lambda block: jnp.sum(block(namespace["x"], namespace["pos"]) ** 2))(namespace["block"])
  leaves = [np.asarray(g) for g in jax.tree.leaves(grads)]
  assert len(leaves) > 8 and all(np.isfinite(g).all() for g in leaves) and any(np.abs(g).max() > 0 for g in leaves)


def test_make_alone_lists_the_targets_with_the_readmes_sizes():
  result = subprocess.run(["make", "--no-print-directory"], cwd=README.parent, capture_output=True, text=True,
                          check=True)
  targets = [line.split()[1] for line in result.stdout.splitlines() if line.startswith("make ")]
  assert {"demo", "test"} <= set(targets)
  # .venv, the dev and convert extras, .aot: the same sizes, in the same order, as the README's Install section
  sizes = lambda text: list(dict.fromkeys(re.findall(r"(\d+(?:\.\d+)?) GB", text)))
  install = README.read_text().split("## Install")[1].split("\n## ")[0]
  assert sizes(result.stdout) == sizes(install) == ["2.6", "1.0", "1.3"]


def _anchor(heading: str) -> str:
  """GitHub's anchor of a heading: lower case, spaces to hyphens, punctuation dropped."""
  return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_resolves():
  checked = 0
  for path in MARKDOWN:
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
      if re.match(r"[a-z]+://", target):
        continue
      file, _, anchor = target.partition("#")
      linked = (path.parent / file).resolve() if file else path
      assert linked.exists(), f"{path.relative_to(README.parent)}: {target} does not exist"
      if anchor:
        headings = re.findall(r"^#+ (.*)$", linked.read_text(), flags=re.M)
        assert anchor in {_anchor(h) for h in headings}, f"{path.relative_to(README.parent)}: no heading #{anchor}"
      checked += 1
  assert checked >= 20


DOCUMENTED = [README, *sorted(DOCS.glob("*.md")),
              *(path for folder in ("configs", "experiments") for pattern in ("*.py", "*.md")
                for path in sorted((README.parent / folder).rglob(pattern)))]
COMMAND = re.compile(r"python -m (posjax[\w.]*)")
CONFIG = re.compile(r"--config=((?:configs|experiments)/[\w/.]+\.py)(?::([^\s`'\"\\]*))?")


def _documented(pattern):
  return sorted({(path.relative_to(README.parent).as_posix(), *match.groups(""))
                 for path in DOCUMENTED for match in pattern.finditer(path.read_text())})


# `python -m <module> --help` for each module in one child: it imports what every module imports once, then each
# module runs as `python -m` runs it (runpy, as __main__, with its own argv) in a process forked for it, its output
# and exit status its own.
HELP = """
import os, runpy, sys, tempfile, traceback
import jax, flax, ml_collections, numpy  # noqa: F401  (imported once, before the forks)
for module, out in zip(sys.argv[1::2], sys.argv[2::2]):
  pid = os.fork()
  if pid == 0:
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.argv = [module, "--help"]
    code = 0
    try:
      runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exit:
      code = exit.code if isinstance(exit.code, int) else int(exit.code is not None)
    except BaseException:  # noqa: BLE001
      traceback.print_exc()
      code = 3
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
  print(module, os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""


def test_every_documented_command_names_a_module_that_runs(tmp_path):
  modules = sorted({module for _, module in _documented(COMMAND)})
  assert {"posjax.main", "posjax.experiments.sweep", "posjax.experiments.report", "posjax.convert"} <= set(modules)
  outputs = {module: tmp_path / f"{module}.txt" for module in modules}
  result = subprocess.run([sys.executable, "-c", HELP, *(str(x) for m in modules for x in (m, outputs[m]))],
                          cwd=README.parent, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  codes = dict(line.split() for line in result.stdout.splitlines())
  assert list(codes) == modules, result.stdout
  for module in modules:
    said = outputs[module].read_text()
    where = [path for path, m in _documented(COMMAND) if m == module]
    assert codes[module] in ("0", "1") and "Traceback" not in said, (module, where, said[-2000:])
    assert "usage" in said.lower() or "flags" in said, module


def test_every_documented_config_loads_with_its_options(tmp_path):
  # a run for the texts' init_from=DIR (an earlier command's workdir): its model_config.json is what the config reads
  (tmp_path / "model_config.json").write_text('{"position": "rope", "max_len": 32}')
  found = _documented(CONFIG)
  assert len({config for _, config, _ in found}) >= 8
  for where, config, options in found:
    options = (options or "").rstrip(".,)")
    if "..." in options or "[" in options:
      options = ""  # an elided or optional list of the text: the file itself must load
    options = re.sub(r"\$\w+", "/a/workdir", options)  # $CONVERTED and such: the text's placeholders
    options = re.sub(r"init_from=[^,]+", f"init_from={tmp_path}", options)
    try:
      config_args.load_config(f"{config}:{options}" if options else config)
    except Exception as error:  # noqa: BLE001
      raise AssertionError(f"{where}: --config={config}:{options}: {error}") from error


