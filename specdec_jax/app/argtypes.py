"""argparse types shared by the command lines (``python -m specdec_jax`` and ``train_draft``)."""

from __future__ import annotations

import argparse
import os
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


def int_in(minimum: int, maximum: int, why: str) -> Callable[[str], int]:
  """argparse type: an integer in ``[minimum, maximum]``; ``why`` (in the message) says where
  the upper bound comes from.

  Example:
    >>> int_in(1, 8191, "it must fit the context")("3")
    3
  """
  at_least = int_at_least(minimum)

  def parse(text: str) -> int:
    value = at_least(text)
    if value > maximum:
      raise argparse.ArgumentTypeError(
        f"expected an integer in [{minimum}, {maximum}] ({why}), got {value}")
    return value
  return parse


def memory_limit() -> int:
  """What a command may allocate: half of this machine's memory (8 GiB where it cannot be read)."""
  try:
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (AttributeError, ValueError, OSError):  # no sysconf (Windows) or no such name
    total = 16 * 2**30
  return total // 2


def gib(size: int) -> str:
  """``size`` bytes in GiB, as the messages print it."""
  return f"{size / 2**30:,.1f} GiB"
