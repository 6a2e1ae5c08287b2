"""argparse types shared by the command lines (``python -m specdec_jax`` and ``train_draft``)."""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Callable
from pathlib import Path


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


def json_schema_file(text: str) -> dict:
  """argparse type: a file holding a JSON Schema (checked with ``jsonschema``)."""
  path = Path(text)
  try:
    schema = json.loads(path.read_text())
  except OSError as err:
    raise argparse.ArgumentTypeError(f"expected a readable JSON Schema file, got {text!r} "
                                     f"({err.strerror})") from None
  except (json.JSONDecodeError, UnicodeDecodeError) as err:
    raise argparse.ArgumentTypeError(f"expected a JSON Schema file, got {text!r}, which is not "
                                     f"JSON ({err})") from None
  try:
    import jsonschema
  except ImportError:  # pragma: no cover - installed with the structured extra's users
    return schema
  try:
    jsonschema.validators.validator_for(schema).check_schema(schema)
  except (jsonschema.SchemaError, TypeError, AttributeError) as err:
    why = getattr(err, "message", err)
    raise argparse.ArgumentTypeError(f"expected a valid JSON Schema, got {text!r}: {why}"
                                     ) from None
  return schema


def regex_pattern(text: str) -> str:
  """argparse type: a non-empty regular expression (syntax checked with ``re``)."""
  if not text:
    raise argparse.ArgumentTypeError("expected a non-empty regular expression, got ''")
  try:
    re.compile(text)
  except re.error as err:
    raise argparse.ArgumentTypeError(f"expected a regular expression, got {text!r}: {err}"
                                     ) from None
  return text
