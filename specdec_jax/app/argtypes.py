"""argparse types shared by the command lines (``python -m specdec_jax`` and ``train_draft``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def int_at_least(minimum: int) -> Callable[[str], int]:
  """argparse type: an integer ``>= minimum``, or one line saying what was expected.

  Example:
    >>> int_at_least(1)("3")
    3
  """
  def parse(text: str) -> int:
    try:
      value = int(text)
    except ValueError:
      raise argparse.ArgumentTypeError(
        f"expected an integer >= {minimum}, got {text!r}") from None
    if value < minimum:
      raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
    return value
  return parse
