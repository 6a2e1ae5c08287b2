"""The README's Python examples, so that tests can run them."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
  return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
