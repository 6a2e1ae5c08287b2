"""The one table formatter of the application (demo, benchmarks, end-to-end runs, tools)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]], *, align: str = "",
                 markdown: bool = False, rule: bool = True, indent: int = 0) -> str:
  """Format already formatted cells as aligned columns, or as a Markdown table.

  Args:
    header: column titles.
    rows: rows of cells (strings), one per column.
    align: one character per column, ``"l"`` or ``"r"``; missing ones are ``"r"``.
    markdown: a Markdown table (``align`` gives each column's alignment marker).
    rule: in plain text, a line of dashes under the header.
    indent: spaces before every plain-text line.

  Returns:
    The table as one string without a trailing newline.

  Example:
    >>> print(format_table(["name", "ms"], [["verify", "1.46"], ["floor", "0.83"]], align="l"))
    name      ms
    ------  ----
    verify  1.46
    floor   0.83
  """
  columns = len(header)
  align = align.ljust(columns, "r")
  if markdown:
    marks = [":---" if a == "l" else "---:" for a in align]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(marks) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])
  widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]

  def line(cells: Sequence[str]) -> str:
    parts = [cell.ljust(w) if a == "l" else cell.rjust(w)
             for cell, w, a in zip(cells, widths, align, strict=True)]
    return " " * indent + "  ".join(parts).rstrip()

  lines = [line(header)]
  if rule:
    lines.append(" " * indent + "  ".join("-" * w for w in widths))
  return "\n".join(lines + [line(row) for row in rows])


def plain_table(header: Sequence[str], rows: Sequence[Sequence[str]], align: str = "",
                indent: int = 4) -> str:
  """:func:`format_table` as the demo prints it: plain text, no rule, indented."""
  return format_table(header, rows, align=align, rule=False, indent=indent)


def num(x: float, digits: int = 4) -> str:
  """A probability-like number with a fixed number of decimals (``inf`` spelled out)."""
  if math.isinf(x):
    return "inf"
  return f"{x:.{digits}f}"


def banner(title: str) -> None:
  """Print ``title`` underlined, after a blank line."""
  print()
  print(title)
  print("=" * len(title))
