"""The bounds of a chat template's render: time (a watchdog thread) and the size of every value.

Used by :mod:`specdec_jax.app.chat_template`, whose module docstring says what is bounded and how:
the watchdog (:func:`run_bounded`), the size of a value (:func:`size_of`, :func:`need`), the
operations checked before they run (:func:`binop_size`, :data:`METHOD_BOUNDS`,
:data:`FILTER_BOUNDS`) and the filters measured after (:func:`guard`).
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import re
import string
import threading
from collections.abc import Mapping
from typing import Any

_ITEM, _MAX_INT_BITS = 8, 1 << 16  # a container element counts 8 (a reference); integer bits

PRINTF = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d*)(?:\.(\*|\d*))?")
local_state = threading.local()  # .budget: the Budget of the render running in this thread


class Exceeded(Exception):
  """A size bound was hit (not a ValueError, which some Jinja filters catch)."""


class Timeout(BaseException):
  """Raised in the rendering thread at its time limit (no ``except Exception`` catches it)."""


class Budget:
  def __init__(self, max_chars: int = 4_000_000):
    self.max_chars, self.left = max_chars, 8 * max_chars  # left: for all the values made


def budget() -> Budget:
  return getattr(local_state, "budget", None) or Budget()  # none: Jinja folding constants


def need(size: int, what: str, charge: bool = True) -> int:
  """Refuse a value of ``size`` over ``max_chars``, or once the values add up to 8 times it."""
  b = budget()
  b.left -= size if charge else 0
  if size > b.max_chars or b.left < 0:
    over = f"max_chars={b.max_chars:,}"
    if size <= b.max_chars:
      over = f"{8 * b.max_chars:,} (8 * {over}) with the values made before it"
    raise Exceeded(
      f"exceeded the intermediate-size bound: {what} comes to {size:,} characters (counting 8 "
      f"per list or dict element), over {over}; a larger max_chars allows it"
    )
  return size


def size_of(x: Any) -> int:
  """Characters, plus 8 per list, tuple or dict element, a nested value each time it occurs
  (the walk stops past ``max_chars``, so it is quick on any shared structure)."""
  limit, total, stack = budget().max_chars, 0, [x]
  while stack and total <= limit:
    v = stack.pop()
    if isinstance(v, (str, bytes)):
      total += len(v)
    elif isinstance(v, (list, tuple, set, frozenset)):
      total += _ITEM * len(v)
      stack.extend(v if total <= limit else ())
    elif isinstance(v, int):
      total += 1 + v.bit_length() // 3  # at least its decimal digits
    elif isinstance(v, Mapping):
      total += 2 * _ITEM * len(v)
      stack.extend((*v, *v.values()) if total <= limit else ())
    else:  # None, a float, or an object the template cannot look into with C code
      total += 1
  return total


def checked(x: Any, what: str) -> Any:
  need(size_of(x), what)
  return x


def int_bits(bits: int, what: str) -> int:
  if bits > _MAX_INT_BITS:
    raise Exceeded(
      f"exceeded the intermediate-size bound: {what} makes an integer of {bits:,} bits, over "
      f"the {_MAX_INT_BITS:,} bits a chat template may use"
    )
  return 0


def width(x: Any) -> int:
  """An argument as a width or count: an int itself, None 0, anything else its size."""
  return x if isinstance(x, int) else 0 if x is None else size_of(x)


def fmt_bound(fmt: str | bytes, values: tuple, printf: bool) -> int:
  """A bound on ``len(fmt % values)`` (``printf``) or ``len(fmt.format(*values))``: each field
  at most all the values and 330 digits (a float), padded to the largest width or precision in
  the format, or in the values where a field takes one from them (``*``, ``{:{}}``)."""
  fmt = fmt if isinstance(fmt, str) else fmt.decode("latin-1")
  if printf:
    specs = ["".join(m) for m in PRINTF.findall(fmt)]
  else:
    specs = [spec for _, name, spec, _ in string.Formatter().parse(fmt) if name is not None]
  widths = [int(w) for w in re.findall(r"\d+", " ".join(specs))]
  if any("*" in spec or "{" in spec for spec in specs):
    widths += [abs(v) for v in values if isinstance(v, int)]
  return len(fmt) + len(specs) * (size_of(values) + max(widths, default=0) + 330)


def replaced(s: Any, old: Any, new: Any, count: Any = -1) -> int:
  n = s.count(old) if count is None or count < 0 else min(s.count(old), count)
  return len(s) + n * max(0, len(new) - len(old))


# Bounds on what str and bytes methods make (the string first), checked before they run.
METHOD_BOUNDS = {
  **dict.fromkeys(("center", "ljust", "rjust", "zfill"), lambda s, w, *_: max(len(s), width(w))),
  "expandtabs": lambda s, tabsize=8: len(s) * (1 + width(tabsize)),
  "replace": replaced,
  "join": lambda s, items: size_of(items) + len(s) * len(items),
  "translate": lambda s, table: len(s) * (1 + size_of(table)),
  "format": lambda s, *args, **kwargs: fmt_bound(s, (*args, *kwargs.values()), False),
  "format_map": lambda s, mapping: fmt_bound(s, tuple(mapping.values()), False),
}
# The same for Jinja's filters, given their arguments by name.
FILTER_BOUNDS = {
  "center": lambda p: max(size_of(p["value"]), width(p["width"])),
  "indent": lambda p: size_of(p["s"]) + (str(p["s"]).count("\n") + 1) * width(p["width"]),
  "wordwrap": lambda p: size_of(p["s"]) * (1 + width(p["wrapstring"])),
  "urlize": lambda p: size_of(p["value"]) * (1 + width(p["target"]) + width(p["rel"])),
  "batch": lambda p: size_of(p["value"]) + width(p["linecount"]) * (1 + size_of(p["fill_with"])),
  "slice": lambda p: size_of(p["value"]) + width(p["slices"]) * (1 + size_of(p["fill_with"])),
  "format": lambda p: fmt_bound(str(p["value"]), (*p["args"], *p["kwargs"].values()), True),
  "join": lambda p: size_of(p["value"]) + width(p["d"]) * len(p["value"]),
  "replace": lambda p: replaced(str(p["s"]), str(p["old"]), str(p["new"]), p["count"]),
  "list": lambda p: _ITEM * len(p["value"]) if isinstance(p["value"], str) else 0,
  "round": lambda p: int_bits(4 * abs(width(p["precision"])), "the round filter"),
  "pprint": lambda p: size_of(p["value"]) ** 2,  # nested dicts indent by their keys
  "sum": lambda p: size_of(p["iterable"]) ** 2 if isinstance(p["start"], list | tuple) else 0,
}


def binop_size(op: str, a: Any, b: Any) -> int:
  """A bound on the size of ``a op b``, for the operators that can make a large value."""
  seq = str | bytes | list | tuple
  if op == "**" and isinstance(a, int) and isinstance(b, int) and b > 0 and abs(a) > 1:
    return int_bits(a.bit_length() * b, "`**`")
  if op == "*" and isinstance(a, int) and isinstance(b, int):
    return int_bits(a.bit_length() + b.bit_length(), "`*`")
  if op == "*" and isinstance(a, seq) and isinstance(b, int):
    return size_of(a) * max(b, 0)
  if op == "*" and isinstance(a, int) and isinstance(b, seq):
    return size_of(b) * max(a, 0)
  if op == "+" and isinstance(a, seq) and isinstance(b, seq):
    return size_of(a) + size_of(b)
  if op == "%" and isinstance(a, str | bytes):
    values = b.values() if isinstance(b, Mapping) else b if isinstance(b, tuple) else (b,)
    return fmt_bound(a, tuple(values), True)
  return 0


def joined(pieces: Any, what: str) -> str:
  """``"".join(pieces)``, refused as soon as the pieces pass ``max_chars``."""
  out, n = [], 0
  for piece in pieces:
    n += len(piece)
    if n > budget().max_chars:
      need(n, what)
    out.append(piece)
  need(n, what)
  return "".join(out)


def guard(name: str, f: Any) -> Any:
  """Filter ``f``, its result measured, and bounded before it runs if in ``FILTER_BOUNDS``."""
  skip = int(hasattr(f, "jinja_pass_arg"))  # a context, eval context or environment first
  signature = inspect.signature(f)  # of the function it wraps, for async_variant filters
  if next(iter(signature.parameters), "") in ("environment", "eval_ctx", "context"):
    signature = signature.replace(parameters=list(signature.parameters.values())[1:])
  bound = FILTER_BOUNDS.get(name)

  @functools.wraps(f)
  def guarded(*args, **kwargs):
    if bound is not None and len(args) > skip:
      if name in ("join", "sum") and not isinstance(args[skip], str | list | tuple):
        args = (*args[:skip], list(args[skip]), *args[skip + 1 :])  # to measure, then join
      p = signature.bind(*args[skip:], **kwargs)
      p.apply_defaults()
      need(bound(p.arguments), f"the {name} filter")
    return checked(f(*args, **kwargs), f"the {name} filter")

  return guarded


def run_bounded(fn: Any, time_limit: float | None) -> Any:
  """``fn()`` in a worker thread, interrupted once ``time_limit`` seconds have passed."""
  box, lock, state = [None], threading.Lock(), [0]  # state: 0 starting, 1 running, 2 done
  set_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc

  def work():
    me = ctypes.c_ulong(threading.get_ident())
    try:
      state[0] = 1
      box[0] = (True, fn())
    except BaseException as e:  # handed to the caller
      box[0] = (False, e)
    finally:
      with lock:  # nothing here runs a call before the one that clears a pending Timeout
        state[0] = 2
        set_exc(me, None)

  worker = threading.Thread(target=work, name="render_chat_template", daemon=True)
  worker.start()
  worker.join(None if time_limit is None else min(time_limit, threading.TIMEOUT_MAX))
  while worker.is_alive():
    with lock:
      if state[0] == 1:
        set_exc(ctypes.c_ulong(worker.ident), ctypes.py_object(Timeout))
    worker.join(0.05)
  ok, value = box[0]
  if ok:
    return value
  raise value
