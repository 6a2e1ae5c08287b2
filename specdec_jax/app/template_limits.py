"""The bounds of a chat template's render: time (a watchdog thread) and the size of every value.

:mod:`specdec_jax.app.template_env` calls these checks where a template makes a value;
:mod:`specdec_jax.app.chat_template` says what its caller is promised. Time: :func:`run_bounded`.
Size: :func:`size_of` (characters, plus 8 per list, tuple or dict element, a shared value each
time it occurs; a namespace, dict view or bound method counts what its text shows) and
:func:`need`, which refuses one over ``max_chars``, or once a render's values add up to 8 times it.

A C call cannot be interrupted, so every operation a template can reach that makes a value many
times its arguments' size is bounded from its arguments *before* it runs (its result measured
after too):

* operators (:func:`binop_size`): ``*`` of a str, bytes, list or tuple by an int, ``+`` of two,
  ``*`` and ``**`` of ints (65,536 bits at most), ``%`` of a str or bytes (:func:`printf_bound`:
  each value once, a ``%(key)s`` field's each time, and per field 330 characters plus its width
  and precision, taken from the values for ``*``); ``~`` and ``{{ }}`` (what they write);
* ``str.format``, ``format_map``: each field once its spec is expanded (``'{:{}}'.format('x',
  '400000000')``, ``'{:.{}f}'.format(1.0, '400000000')``), the fields added up
  (:func:`field_bound`: the numbers in the spec, plus a str's length, a float's 500 characters,
  an int's 500 and 2 per bit, another value's size);
* methods (:data:`METHOD_BOUNDS`, :func:`method_bound`) of a str or bytes: ``center``, ``ljust``,
  ``rjust``, ``zfill`` (the width), ``expandtabs`` (the tab size per tab), ``replace`` (the
  growth per occurrence), ``join`` (8 per item, the separator between them), ``translate`` (the
  longest replacement per character), ``encode`` (10 per character, 100 with ``namereplace``),
  ``split``, ``rsplit``, ``splitlines`` (8 per piece, counted); ``int.to_bytes`` (its length),
  ``str.maketrans`` (32 per character), ``dict.fromkeys`` (the keys times the value);
* filters (:data:`FILTER_BOUNDS`): ``batch``, ``center``, ``format`` (as ``%``), ``groupby``,
  ``indent``, ``join``, ``list``, ``pprint``, ``replace``, ``round``, ``slice``, ``sort``,
  ``string``, ``sum``, ``urlize``, ``wordwrap``, a str's characters 8 each where a filter lists
  them (:func:`listed`); an iterator a filter returns (``map``, ``select``...) yields at most
  ``max_chars / 8`` items (:func:`counted`);
* globals (in ``template_env``): ``range`` (its length), ``lipsum`` (paragraphs times words),
  ``strftime_now`` (64 per ``%``, and the widths), ``dict.fromkeys``; ``f(*items)``
  (:func:`collected`);
* output (in ``template_env``): a block, macro, loop, ``{% filter %}`` or ``{% call %}`` body
  writes into a ``Pieces`` buffer that adds up its pieces as they are written; ``self.name()``
  and ``tojson`` add theirs up in ``joined``, and the prompt is added up as it streams.

The rest make at most 12 times their arguments' size and are measured once made: slicing,
``strip``, ``partition``, ``upper`` (3 times), ``hex``, ``decode``, ``int.from_bytes``, the
``escape``, ``xmlattr`` (5), ``urlencode`` (12), ``tojson`` and ``dictsort`` filters, and the
text of a value other than a str (a repr escapes a character in up to 10).
"""

from __future__ import annotations

import codecs
import ctypes
import functools
import inspect
import re
import threading
import types
from collections.abc import ItemsView
from collections.abc import Iterator
from collections.abc import KeysView
from collections.abc import Mapping
from collections.abc import Sized
from collections.abc import ValuesView
from typing import Any

_ITEM, _MAX_INT_BITS = 8, 1 << 16  # a container element counts 8 (a reference); integer bits

PRINTF = re.compile(r"%(\((?:[^()]|\([^()]*\))*\))?[-#0 +]*(\*|\d*)(?:\.(\*|\d*))?[hlL]?(.?)", re.S)
_SPACES = "".join(c for c in map(chr, range(0x3001)) if c.isspace())  # what str.split() splits at
_BREAKS = "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"  # where str.splitlines() splits
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


def _shown(v: Any) -> Any:
  """What the text of an object shows of other values: a bound method's object, a dict view's
  dict, a namespace's attributes (None for other objects)."""
  if isinstance(v, types.MethodType):
    return v.__self__
  if isinstance(v, KeysView | ValuesView | ItemsView):
    return getattr(v, "mapping", None) or getattr(v, "_mapping", None)
  try:
    return object.__getattribute__(v, "_Namespace__attrs")
  except AttributeError:
    return None


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
      stack.extend(() if (shown := _shown(v)) is None else (shown,))
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


def numbers(spec: str) -> int:
  """The sum of the numbers written in ``spec`` (a width, a precision, a fill that is a digit)."""
  return sum(int(d) if len(d) < 19 else 10**18 for d in re.findall(r"\d+", spec))


def listed(x: Any) -> int:
  """The size of ``list(x)``: a str's or bytes' characters count 8 more each."""
  return (1 + _ITEM) * len(x) if isinstance(x, str | bytes) else size_of(x)


def printf_bound(fmt: str | bytes, values: Any) -> int:
  """A bound on ``len(fmt % values)``: the format, each value once (a ``%(key)s`` field its key's
  value each time), and per field 330 characters (a float's digits) and its width and precision
  (read from the values for ``*``)."""
  fmt = fmt if isinstance(fmt, str) else fmt.decode("latin-1")
  items = values if isinstance(values, tuple) else (values,)
  total, i = len(fmt) + size_of(values), 0
  for key, *pads, conversion in PRINTF.findall(fmt):
    for pad in pads:
      star = items[i] if pad == "*" and i < len(items) else 0
      total += abs(star) if isinstance(star, int) else 0
      total += numbers(pad)
      i += pad == "*"
    if key or conversion == "(":  # by key (nested deeper than the pattern reads: any value)
      try:
        total += size_of(values[key[1:-1]])
      except Exception:  # no such key, or not a mapping
        total += size_of(values)
    i += conversion != "%"
    total += 330
  return total


def field_bound(value: Any, spec: str) -> int:
  """A bound on ``len(format(value, spec))``: the numbers in the spec, plus a str's length, a
  float's 500 characters (309 digits, grouped), an int's 500 and 2 per bit (binary, grouped), or
  another value's size."""
  if isinstance(value, str):
    return numbers(spec) + len(value)
  if isinstance(value, int):
    return numbers(spec) + 500 + 2 * value.bit_length()
  return numbers(spec) + (500 if isinstance(value, float) else size_of(value))


def replaced(s: Any, old: Any, new: Any, count: Any = -1) -> int:
  n = s.count(old) if count is None or count < 0 else min(s.count(old), count)
  return len(s) + n * max(0, len(new) - len(old))


def translated(s: Any, table: Any, *_: Any) -> int:
  """A bound on ``s.translate(table)``: the longest replacement for every character."""
  if isinstance(s, bytes) or isinstance(table, str):
    return len(s)
  values = table.values() if isinstance(table, Mapping) else table
  if not isinstance(values, list | tuple | ValuesView):
    return len(s) * (1 + size_of(table))
  return len(s) * max((len(v) for v in values if isinstance(v, str)), default=1)


def encoded(s: str, encoding: str = "utf-8", errors: str = "strict") -> int:
  """A bound on ``s.encode(encoding, errors)``: 10 bytes per character (``\\U0010ffff``), 100
  with ``namereplace`` (``\\N{...}``), 1 for ASCII in UTF-8, ASCII or Latin-1."""
  if s.isascii() and codecs.lookup(encoding).name in ("utf-8", "ascii", "iso8859-1"):
    return len(s)
  return (100 if errors == "namereplace" else 10) * len(s) + 16


def _count_any(s: Any, chars: str) -> int:
  """How many characters of ``s`` are among ``chars`` (its ASCII ones, for bytes)."""
  if isinstance(s, bytes):
    return sum(s.count(ord(c)) for c in chars if c.isascii())
  return sum(map(s.count, chars))


def split_pieces(s: Any, sep: Any = None, maxsplit: int = -1) -> int:
  """A bound on ``s.split(sep, maxsplit)``: the characters, and 8 per piece."""
  n = s.count(sep) if sep is not None else _count_any(s, _SPACES)
  return len(s) + _ITEM * (1 + (n if maxsplit < 0 else min(n, maxsplit)))


def keyed(keys: Any, value: Any = None) -> int:
  """A bound on ``dict.fromkeys(keys, value)``."""
  return len(keys) * (2 * _ITEM + size_of(value)) + size_of(keys)


# Bounds on what a method of a str or bytes value makes (the value first), checked before it
# runs; then those of an int value's or class's and the dict class's (:func:`method_bound`).
METHOD_BOUNDS = {
  **dict.fromkeys(("center", "ljust", "rjust", "zfill"), lambda s, w, *_: max(len(s), width(w))),
  "expandtabs": lambda s, tabsize=8: len(s) + _count_any(s, "\t") * max(width(tabsize), 0),
  "replace": replaced,
  "join": lambda s, items: listed(items) + len(s) * len(items),
  "translate": translated,
  "encode": encoded,
  "split": split_pieces,
  "rsplit": split_pieces,
  "splitlines": lambda s, *_, **__: len(s) + _ITEM * (1 + _count_any(s, _BREAKS)),
}
CLASS_BOUNDS = {
  "to_bytes": lambda _n, length=1, *_, **__: width(length),
  "fromkeys": lambda _cls, keys, value=None: keyed(keys, value),
}


def method_bound(f: Any) -> tuple[str, Any] | None:
  """``(name, bound)`` for a method in the bounds above (``bound(*args, **kwargs)`` bounds its
  result), or None."""
  owner, name = getattr(f, "__self__", None), getattr(f, "__name__", "")
  if f is str.maketrans:  # a dict of ints, 32 per character at most
    return "str.maketrans()", lambda *tables: 4 * _ITEM * sum(map(size_of, tables))
  if isinstance(owner, str | bytes) and name in METHOD_BOUNDS:
    table = METHOD_BOUNDS
  elif (isinstance(owner, int) or owner in (int, bool, dict)) and name in CLASS_BOUNDS:
    table = CLASS_BOUNDS
  else:
    return None
  kind = owner.__name__ if isinstance(owner, type) else type(owner).__name__
  return f"{kind}.{name}()", functools.partial(table[name], owner)


# The same for Jinja's filters, given their arguments by name.
FILTER_BOUNDS = {
  "center": lambda p: max(size_of(p["value"]), width(p["width"])),
  "indent": lambda p: size_of(p["s"]) + (str(p["s"]).count("\n") + 1) * width(p["width"]),
  "wordwrap": lambda p: size_of(p["s"]) * (1 + max(width(p["wrapstring"]), 1)),
  "urlize": lambda p: size_of(p["value"]) * (20 + width(p["target"]) + width(p["rel"])),
  "batch": lambda p: listed(p["value"]) + width(p["linecount"]) * (1 + size_of(p["fill_with"])),
  "slice": lambda p: listed(p["value"]) + width(p["slices"]) * (1 + size_of(p["fill_with"])),
  "format": lambda p: printf_bound(str(p["value"]), p["kwargs"] or p["args"]),
  "join": lambda p: listed(p["value"]) + width(p["d"]) * len(p["value"]),
  "replace": lambda p: replaced(str(p["s"]), str(p["old"]), str(p["new"]), p["count"]),
  **dict.fromkeys(("list", "sort", "groupby"), lambda p: listed(p["value"])),
  "string": lambda p: size_of(p["s"]),
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
    return printf_bound(a, b)
  return 0


def collected(items: Any, what: str) -> Any:
  """``items`` as a sized collection: a str or bytes refused if listing its characters is over
  ``max_chars``; an iterator read into a list, refused once its items are (at 8 each)."""
  if isinstance(items, str | bytes):
    need(listed(items), what, charge=False)
  if isinstance(items, Sized):
    return items
  out, limit = [], budget().max_chars
  for item in items:
    out.append(item)
    if _ITEM * len(out) > limit:
      need(_ITEM * len(out), what, charge=False)
  return out


def counted(items: Any, what: str) -> Any:
  """An iterator's items, refused once they come to over ``max_chars`` at 8 each."""
  limit, n = budget().max_chars, 0
  for item in items:
    n += _ITEM
    if n > limit:
      need(n, what, charge=False)
    yield item


def guard(name: str, f: Any) -> Any:
  """Filter ``f``, bounded before it runs if in ``FILTER_BOUNDS`` and its result measured (an
  iterator as it yields)."""
  skip = int(hasattr(f, "jinja_pass_arg"))  # a context, eval context or environment first
  signature = inspect.signature(f)  # of the function it wraps, for async_variant filters
  if next(iter(signature.parameters), "") in ("environment", "eval_ctx", "context"):
    signature = signature.replace(parameters=list(signature.parameters.values())[1:])
  bound, what = FILTER_BOUNDS.get(name), f"the {name} filter"
  params = signature.parameters.values()  # for a quick bind of positional arguments
  names = [q.name for q in params if q.kind in (q.POSITIONAL_ONLY, q.POSITIONAL_OR_KEYWORD)]
  defaults = {q.name: q.default for q in params if q.default is not q.empty}
  quick = range(len(names) - len(defaults), len(names) + 1) if len(names) == len(params) else ()

  @functools.wraps(f)
  def guarded(*args, **kwargs):
    if bound is not None and len(args) > skip:
      if name in ("join", "sum"):  # an iterator read, to be measured before it is joined
        args = (*args[:skip], collected(args[skip], what), *args[skip + 1 :])
      if not kwargs and len(args) - skip in quick:
        arguments = {**defaults, **dict(zip(names, args[skip:], strict=False))}
      else:
        p = signature.bind(*args[skip:], **kwargs)
        p.apply_defaults()
        arguments = p.arguments
      need(bound(arguments), what, charge=False)
    result = checked(f(*args, **kwargs), what)
    return counted(result, what) if isinstance(result, Iterator) else result

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
