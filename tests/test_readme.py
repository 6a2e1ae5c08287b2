"""Every Python example in README.md and in the documentation pages runs (the mesh example:
tests/test_readme_mesh.py)."""

from tests._readme import python_blocks
from tests._readme import readme_blocks


def test_readme_examples_run():
  blocks = readme_blocks()
  assert len(blocks) >= 3
  namespace: dict = {}
  for block in blocks:
    exec(compile(block, "README.md", "exec"), namespace)


def test_documentation_examples_run():
  blocks = [b for b in python_blocks() if "make_mesh" not in b]
  assert len(blocks) >= 8
  namespace: dict = {}
  for block in blocks:
    exec(compile(block, "docs", "exec"), namespace)
