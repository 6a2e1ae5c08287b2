"""The architecture, checked: imports point one way (the core below the decoding loops and the
models, which do not import each other, the application on top), and only the application's
tests import the application."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "specdec_jax"
TESTS = PACKAGE.parent / "tests"


def _layer(module: str) -> str:
  """``api`` (the package's ``__init__``, which re-exports the loops), ``decoding``, ``models``,
  ``app`` or ``core`` (the library proper, with the protocols of ``models.protocol``)."""
  parts = module.split(".")
  if module == "specdec_jax":
    return "api"
  if parts[1] == "__main__":
    return "app"
  if parts[1] == "decoding":
    return "decoding"
  if parts[1] in ("app", "models"):
    return "core" if module == "specdec_jax.models.protocol" else parts[1]
  return "core"


def _imports(source: str) -> set[str]:
  """Every ``specdec_jax`` module a source imports, at any depth (inside functions too).

  ``from m import name`` counts as importing ``m.name`` when that is a module, else ``m``
  (``from specdec_jax import verify`` imports the package's ``__init__``).
  """
  found = set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("specdec_jax"):
      found.update(_module_of(f"{node.module}.{a.name}") for a in node.names)
    elif isinstance(node, ast.Import):
      found.update(a.name for a in node.names if a.name.startswith("specdec_jax"))
  return found


def _module_of(name: str) -> str:
  """``name`` if it is a module or package of the source tree, else the module it is taken from."""
  path = PACKAGE.parent / name.replace(".", "/")
  return name if path.with_suffix(".py").exists() or path.is_dir() else name.rpartition(".")[0]


def _module_name(path: Path) -> str:
  rel = path.relative_to(PACKAGE.parent).with_suffix("")
  parts = list(rel.parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


# Who may import whom: the models never import the loops (a draft's type, ``FeatureDraft``,
# lives in ``models.protocol``), the loops never the models they run, the core neither.
ALLOWED = {
  "core": {"core"},
  "decoding": {"core", "decoding"},
  "models": {"core", "models"},
  "api": {"core", "decoding"},
  "app": {"core", "decoding", "models", "api", "app"},
}


def _violations(name: str, source: str) -> list[str]:
  layer = _layer(name)
  return [f"{name} ({layer}) imports {imported} ({_layer(imported)})"
          for imported in sorted(_imports(source)) if _layer(imported) not in ALLOWED[layer]]


def test_imports_point_one_way():
  """core -> core; decoding -> core; models -> core; the package -> core, decoding; the
  application (``__main__`` its door) -> anything."""
  bad = []
  for path in sorted(PACKAGE.rglob("*.py")):
    bad += _violations(_module_name(path), path.read_text())
  assert not bad, "\n".join(bad)


@pytest.mark.parametrize(("module", "source"), [
  ("specdec_jax.models.toy", "from specdec_jax.decoding.drafts import FeatureDraft"),
  ("specdec_jax.models.eagle", "import specdec_jax.decoding"),
  ("specdec_jax.models.llama", "def f():\n  from specdec_jax import decoding"),
  ("specdec_jax.models.llama", "from specdec_jax import speculative_generate"),
  ("specdec_jax.models.protocol", "from specdec_jax.decoding import PromptLookup"),
  ("specdec_jax.decoding.chain", "from specdec_jax.models.llama import make_model"),
  ("specdec_jax._rules.tokenwise", "from specdec_jax.decoding import generate"),
  ("specdec_jax._rules.tokenwise", "from specdec_jax.app import cli"),
])
def test_an_import_against_the_direction_is_caught(module, source):
  assert _violations(module, source), f"{module}: {source!r} was not caught"


def test_no_core_test_imports_the_application():
  """Only ``tests/app`` tests the application: the library's tests run without it."""
  bad = []
  for path in sorted(TESTS.rglob("*.py")):
    if path.is_relative_to(TESTS / "app"):
      continue
    for imported in sorted(_imports(path.read_text())):
      if _layer(imported) == "app":
        bad.append(f"{path.relative_to(TESTS.parent)} imports {imported}")
  assert not bad, "\n".join(bad)


def test_the_application_depends_on_nothing_above_it():
  """Inside the application the imports point one way too (no cycle, not even a lazy one)."""
  order = ["argtypes", "tables", "template_limits", "template_env", "chat_template", "gguf",
           "tokenizer", "smollm2", "draft_training", "train_draft", "baselines", "bench_packed",
           "bench_logits", "bench_methods", "bench", "demo", "simulate", "e2e_costs", "e2e_tree",
           "e2e_report", "e2e_structured", "e2e", "cli"]
  for path in sorted((PACKAGE / "app").glob("*.py")):
    name = path.stem
    if name == "__init__":
      continue
    for imported in _imports(path.read_text()):
      if imported.startswith("specdec_jax.app."):
        other = imported.split(".")[2]
        assert order.index(other) < order.index(name), f"app.{name} imports app.{other}"


@pytest.mark.parametrize("statement", ["import specdec_jax", "import specdec_jax.decoding"])
def test_importing_the_library_loads_no_application_module(statement):
  code = (f"{statement}; import sys; "
          "print(sorted(m for m in sys.modules if m.startswith(('specdec_jax.app', "
          "'specdec_jax.models.llama', 'specdec_jax.models.toy', 'gguf', 'tokenizers', 'jinja2', "
          "'matplotlib', 'torch', 'outlines_core', 'jsonschema'))))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "[]", out.stdout


def test_no_module_is_over_about_400_lines():
  """Every module of the package, the application's included, stays under about 400 lines."""
  long = {}
  for path in PACKAGE.rglob("*.py"):
    if (n := len(path.read_text().splitlines())) > 400:
      long[str(path.relative_to(PACKAGE))] = n
  assert not long, long


#: The layers inside the core, lowest first, one private package each: a module imports only from
#: its own package or one below. (The rules do not import each other, except the tree rule its
#: walk and the registry all of them.) The public modules ``host``, ``reference`` and ``theory``
#: sit on top of the core.
CORE_LAYERS = ("_core", "_logits", "_rows", "_rules", "_layouts")
RULES_MAY_IMPORT = {("tree", "tree_walk")} | {("registry", r) for r in
                                               ("tokenwise", "block", "tree", "tree_walk")}


def _core_modules() -> dict[str, Path]:
  """``{"_rows.chain": path, ...}``: every module of the five layer packages."""
  return {f"{path.parent.name}.{path.stem}": path for layer in CORE_LAYERS
          for path in (PACKAGE / layer).glob("*.py") if path.stem != "__init__"}


def _core_imports() -> dict[str, set[str]]:
  modules = _core_modules()
  graph = {}
  for name, path in modules.items():
    deps = {".".join(m.split(".")[1:3]) for m in _imports(path.read_text())}
    graph[name] = (deps & set(modules)) - {name}
  return graph


def test_every_core_module_is_in_a_layer_package():
  """No flat private module is left beside the layer packages, and no other private package."""
  flat = sorted(p.name for p in PACKAGE.glob("_*.py") if p.stem not in ("__init__", "__main__"))
  assert not flat, flat
  packages = sorted(p.name for p in PACKAGE.glob("_*") if p.is_dir() and p.name != "__pycache__")
  assert packages == sorted(CORE_LAYERS), packages
  assert all((PACKAGE / layer / "__init__.py").is_file() for layer in CORE_LAYERS)


def _downward_violations(graph: dict[str, set[str]]) -> list[str]:
  rank = {layer: i for i, layer in enumerate(CORE_LAYERS)}
  bad = [f"{m} -> {d} (up a layer)" for m, deps in graph.items() for d in deps
         if rank[d.split(".")[0]] > rank[m.split(".")[0]]]
  for m, deps in graph.items():
    package, _, stem = m.partition(".")
    for d in deps:
      other_package, _, other = d.partition(".")
      if package == other_package == "_rules" and (stem, other) not in RULES_MAY_IMPORT:
        bad.append(f"{m} -> {d} (a rule imports another rule)")
  state: dict[str, int] = {}

  def visit(m, path):
    state[m] = 1
    for d in sorted(graph[m]):
      if state.get(d) == 1:
        bad.append(f"import cycle: {' -> '.join([*path, m, d])}")
      elif d not in state:
        visit(d, [*path, m])
    state[m] = 2

  for m in sorted(graph):
    if m not in state:
      visit(m, [])
  return bad


def test_the_core_layers_import_downward_only_and_without_cycles():
  """_core <- _logits <- _rows <- _rules <- _layouts; no import cycle among the modules; a rule
  never imports another rule (they share the rows layer's skeleton instead)."""
  bad = _downward_violations(_core_imports())
  assert not bad, "\n".join(bad)


@pytest.mark.parametrize("edit", [
  ("_core.checks", "_rows.chain"),          # a primitive reaching up to the skeleton
  ("_rules.block", "_rules.tokenwise"),     # a rule importing another rule
  ("_logits.transform", "_logits.process"),  # the cycle issue 47 broke, put back
])
def test_a_layering_break_is_caught(edit):
  graph = _core_imports()
  module, dep = edit
  assert dep not in graph[module]
  graph[module] = graph[module] | {dep}
  assert _downward_violations(graph), edit


def _private_names_taken_across_packages() -> list[str]:
  bad = []
  for path in sorted(PACKAGE.rglob("*.py")):
    here = _module_name(path)
    for node in ast.walk(ast.parse(path.read_text())):
      if not (isinstance(node, ast.ImportFrom) and node.module
              and node.module.startswith("specdec_jax.")):
        continue
      same_package = node.module.rpartition(".")[0] == here.rpartition(".")[0]
      for alias in node.names:
        if alias.name.startswith("_") and not same_package:
          bad.append(f"{here} takes {node.module}.{alias.name}")
  return bad


def test_no_private_name_is_taken_from_another_package():
  """A name with a leading underscore stays inside its package: other layers, the loops and the
  application use what a module offers without one."""
  bad = _private_names_taken_across_packages()
  assert not bad, "\n".join(bad)
