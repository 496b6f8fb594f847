"""posjax's layering, read from its source: arrows run down only (no import cycle, imports inside functions
included), the loop knows no task, kernels know no position method, and the light commands need no JAX."""

import ast
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "posjax"


def _modules() -> dict[str, pathlib.Path]:
  found = {}
  for path in PACKAGE.rglob("*.py"):
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    found[name.removesuffix(".__init__")] = path
  return found


def _imports(modules: dict[str, pathlib.Path]) -> dict[str, set[str]]:
  """Every posjax module each module imports, at module level or inside a function."""
  edges = {}
  for name, path in modules.items():
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        candidates = [alias.name for alias in node.names]
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          parts = package.split(".")
          base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
        candidates = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
      else:
        continue
      for target in candidates:
        while target and target not in modules:
          target = target.rpartition(".")[0]
        if target and target != name:
          targets.add(target)
    edges[name] = targets
  return edges


MODULES = _modules()
IMPORTS = _imports(MODULES)


def _cycle() -> list[str] | None:
  state, stack = {}, []

  def visit(module):
    state[module] = "open"
    stack.append(module)
    for target in sorted(IMPORTS[module]):
      if state.get(target) == "open":
        return stack[stack.index(target):] + [target]
      if target not in state and (found := visit(target)):
        return found
    state[module] = "done"
    stack.pop()
    return None

  for module in sorted(MODULES):
    if module not in state and (found := visit(module)):
      return found
  return None


def test_no_module_imports_itself_back_through_others():
  assert _cycle() is None, " -> ".join(_cycle())


def test_the_checker_sees_an_import_inside_a_function(tmp_path):
  (tmp_path / "a.py").write_text("def f():\n  from posjax import b  # hidden\n")
  (tmp_path / "b.py").write_text("from . import a\n")
  edges = _imports({"posjax.a": tmp_path / "a.py", "posjax.b": tmp_path / "b.py"})
  assert edges == {"posjax.a": {"posjax.b"}, "posjax.b": {"posjax.a"}}


def _posjax_imports_inside_functions(path: pathlib.Path) -> list[int]:
  """Lines that import a posjax module anywhere but at the module's top level."""
  tree = ast.parse(path.read_text())
  top_level = set(map(id, tree.body))
  lines = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      ours = any(alias.name.startswith("posjax") for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      ours = bool(node.level) or (node.module or "").startswith("posjax")
    else:
      continue
    if ours and id(node) not in top_level:
      lines.append(node.lineno)
  return lines


def test_no_module_imports_a_posjax_module_inside_a_function():
  """A function-level import is how a cycle hides, and it makes a module's dependencies hard to see."""
  hidden = {name: lines for name, path in MODULES.items() if (lines := _posjax_imports_inside_functions(path))}
  assert not hidden


def _reaches(start: str, prefixes: tuple[str, ...]) -> list[str]:
  return sorted(t for t in IMPORTS[start] if t.startswith(prefixes))


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("posjax.train")))
def test_the_training_package_imports_no_task_experiment_or_converter(module):
  assert not _reaches(module, ("posjax.tasks", "posjax.experiments", "posjax.convert", "posjax.finetune",
                               "posjax.main"))


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("posjax.kernels")))
def test_kernels_import_no_position_method(module):
  assert not _reaches(module, ("posjax.positions", "posjax.attention", "posjax.models"))


def test_the_loop_is_short_and_the_cli_imports_nothing_of_posjax():
  assert len((PACKAGE / "train" / "loop.py").read_text().splitlines()) <= 250
  assert not IMPORTS["posjax.cli"]


def _public_without_docstring(path: pathlib.Path) -> list[str]:
  missing = []
  for node in ast.parse(path.read_text()).body:
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
      if ast.get_docstring(node) is None and not (isinstance(node, ast.ClassDef) and _is_plain_record(node)):
        missing.append(node.name)
  return missing


def _is_plain_record(node: ast.ClassDef) -> bool:
  """A dataclass of fields alone documents itself by its fields' names and comments."""
  return all(isinstance(item, (ast.AnnAssign, ast.Expr)) for item in node.body)


def test_public_functions_and_classes_say_what_they_are():
  missing = {module: names for module, path in MODULES.items() if (names := _public_without_docstring(path))}
  assert not missing


BLOCK_JAX = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path=None, target=None):
    if name.split(".")[0] in ("jax", "jaxlib", "flax", "optax", "orbax", "tensorflow"):
      raise ImportError(f"{name} is not installed here")
sys.meta_path.insert(0, Block())
"""


def _without_jax(code: str, tmp_path) -> subprocess.CompletedProcess:
  (tmp_path / "sitecustomize.py").write_text(BLOCK_JAX)
  env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")
  return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=300)


def test_import_posjax_loads_no_jax(tmp_path):
  result = _without_jax("import posjax, sys; print(sorted(m for m in sys.modules if m.startswith('jax')))", tmp_path)
  assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr[-2000:]


@pytest.mark.parametrize("table", ["tupe/table1", "tupe/table3", "huang2020/table1"])
def test_the_sweeps_print_launcher_and_the_report_run_without_jax(tmp_path, table):
  root = tmp_path / "root"
  code = f"""
import sys
from posjax.experiments import report, sweep
sys.argv = ["sweep", "--config=experiments/{table}.py", "--root={root}", "--launcher=print"]
try:
  sweep.entry()
except SystemExit as exit:
  assert not exit.code, exit.code
print(report.write("{root}"))
"""
  result = _without_jax(code, tmp_path)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "posjax.main" in result.stdout and "missing" in result.stdout.lower()
  assert "the runs' configs are not checked here (flax is not installed here)" in result.stderr
