"""The Python examples of README.md and of the documentation pages, so that tests can run them.

The pages are read in the order the site presents them (the examples build on each other as the
README's once did); the README's own examples run first.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: The documentation pages whose examples run, in reading order.
PAGES = ("getting_started", "errors", "sharding", "engines", "sampling", "structured", "benchmarks",
         "decoding", "trees", "matrix", "layout", "notebooks", "testing")


def _blocks(path: Path) -> list[str]:
  return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


def readme_blocks() -> list[str]:
  return _blocks(README)


def python_blocks() -> list[str]:
  """The docs pages' examples, in reading order."""
  return [b for page in PAGES for b in _blocks(ROOT / "docs" / f"{page}.md")]
