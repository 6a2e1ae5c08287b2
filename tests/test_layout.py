"""The architecture, checked: the library imports nothing of the application, one way only."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "specdec_jax"


def _layer(module: str) -> str:
  """``app``, ``models`` or ``core`` (the library proper, the decoding loops included)."""
  parts = module.split(".")
  if len(parts) > 1 and parts[1] in ("app", "models"):
    return "core" if module == "specdec_jax.models.protocol" else parts[1]
  return "core"


def _imports(path: Path) -> set[str]:
  """Every ``specdec_jax`` module a file imports, at any depth (inside functions too)."""
  tree = ast.parse(path.read_text())
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("specdec_jax"):
      found.add(node.module)
      found.update(f"{node.module}.{a.name}" for a in node.names)
    elif isinstance(node, ast.Import):
      found.update(a.name for a in node.names if a.name.startswith("specdec_jax"))
  return found


def _module_name(path: Path) -> str:
  rel = path.relative_to(PACKAGE.parent).with_suffix("")
  parts = list(rel.parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


ALLOWED = {"core": {"core"}, "models": {"core", "models"}, "app": {"core", "models", "app"}}


def test_imports_point_one_way():
  """core -> core; models -> core; app -> anything. ``__main__`` is the application's door."""
  bad = []
  for path in sorted(PACKAGE.rglob("*.py")):
    name = _module_name(path)
    if name == "specdec_jax.__main__":
      continue
    layer = _layer(name)
    for imported in _imports(path):
      target = _layer(imported)
      if target not in ALLOWED[layer] and not _is_attribute(imported):
        bad.append(f"{name} ({layer}) imports {imported} ({target})")
  assert not bad, "\n".join(bad)


def _is_attribute(name: str) -> bool:
  """``from specdec_jax import verify`` records ``specdec_jax.verify``: a name, not a module."""
  return not (PACKAGE.parent / (name.replace(".", "/") + ".py")).exists() and not (
    PACKAGE.parent / name.replace(".", "/")).is_dir()


def test_the_application_depends_on_nothing_above_it():
  """Inside the application the imports point one way too (no cycle, not even a lazy one)."""
  order = ["tables", "chat_template", "gguf", "tokenizer", "smollm2", "train_draft", "baselines",
           "bench_packed", "bench", "demo", "e2e", "cli"]
  for path in sorted((PACKAGE / "app").glob("*.py")):
    name = path.stem
    if name == "__init__":
      continue
    for imported in _imports(path):
      if imported.startswith("specdec_jax.app."):
        other = imported.split(".")[2]
        assert order.index(other) < order.index(name), f"app.{name} imports app.{other}"


@pytest.mark.parametrize("statement", ["import specdec_jax", "import specdec_jax.decoding"])
def test_importing_the_library_loads_no_application_module(statement):
  code = (f"{statement}; import sys; "
          "print(sorted(m for m in sys.modules if m.startswith(('specdec_jax.app', "
          "'specdec_jax.models.llama', 'specdec_jax.models.toy', 'gguf', 'tokenizers', 'jinja2', "
          "'matplotlib', 'torch'))))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "[]", out.stdout


def test_no_module_is_over_about_600_lines():
  long = {path.name: n for path in PACKAGE.rglob("*.py")
          if (n := len(path.read_text().splitlines())) > 650}
  assert not long, long
