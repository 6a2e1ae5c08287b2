"""The sandboxed Jinja environment that renders chat templates, built as ``transformers`` builds
it, with every operation that makes a value measured (:mod:`specdec_jax.app.template_limits`
lists them and how), and the output of a block or macro added up as it is written
(:class:`Pieces`).

:mod:`specdec_jax.app.chat_template` renders with it; see that module for what the environment
provides and what it refuses.
"""

from __future__ import annotations

import functools
import inspect
import json
import re
import sys
import types
from datetime import datetime
from typing import Any

from specdec_jax.app import template_limits as limits

_INSTALL = "pip install 'jinja2>=3.1.6'"
_MIN_JINJA = (3, 1, 6)


def jinja2_module() -> Any:
  """The ``jinja2`` module (with ``jinja2.sandbox`` and ``jinja2.ext`` loaded), or ImportError."""
  try:
    import jinja2  # optional dependency, imported on use
    import jinja2.ext
    import jinja2.sandbox
  except ImportError as e:
    raise ImportError(
      f"render_chat_template needs the jinja2 package to render a chat template; run: {_INSTALL}"
    ) from e
  parts = tuple(int(p) for p in re.findall(r"\d+", jinja2.__version__)[:3])
  if parts < _MIN_JINJA:
    raise ImportError(
      f"render_chat_template needs jinja2>=3.1.6 (older versions have known sandbox escapes, and "
      f"chat templates are untrusted code); found jinja2 {jinja2.__version__}; run: {_INSTALL}"
    )
  return jinja2


class Pieces(list):
  """The buffer a block, macro, loop, ``{% filter %}`` or ``{% call %}`` body writes its output
  into: the pieces are added up as they are written, refused once over ``max_chars``."""

  def __init__(self):
    super().__init__()
    self.chars, self.limit = 0, limits.budget().max_chars

  def append(self, piece: Any) -> None:
    self.chars += len(piece) if isinstance(piece, str) else limits.size_of(piece)
    if self.chars > self.limit:
      limits.need(self.chars, "the output of a macro or block")
    super().append(piece)

  def extend(self, pieces: Any) -> None:
    for piece in pieces:
      self.append(piece)


def joined(pieces: Any, what: str) -> str:
  """``"".join(pieces)``, refused as soon as the pieces pass ``max_chars`` (a :class:`Pieces`
  buffer has added them up as they were written)."""
  if isinstance(pieces, Pieces):
    limits.need(pieces.chars, what)
    return "".join(pieces)
  out, n = [], 0
  for piece in pieces:
    n += len(piece)
    if n > limits.budget().max_chars:
      limits.need(n, what)
    out.append(piece)
  limits.need(n, what)
  return "".join(out)


class RaisedByTemplate(Exception):
  """Marks the jinja2 ``TemplateError`` raised by the template's ``raise_exception``."""


@functools.cache
def environment() -> Any:
  """The sandboxed Jinja environment, built as ``transformers`` builds it (once)."""
  jinja2 = jinja2_module()

  class Raised(RaisedByTemplate, jinja2.exceptions.TemplateError):
    pass

  class Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body unchanged."""

    tags = frozenset({"generation"})

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
      return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
      return caller()

  def raise_exception(message):
    raise Raised(message)

  def strftime_now(format):  # glibc pads a field to a width written in it (%0400000000Y)
    limits.need(len(format) + 64 * format.count("%") + limits.numbers(format), "strftime_now()",
                charge=False)
    return datetime.now().strftime(format)

  def lipsum(*args, **kwargs):  # n paragraphs of at most max words of at most 14 characters
    p = inspect.signature(jinja2.utils.generate_lorem_ipsum).bind(*args, **kwargs)
    p.apply_defaults()
    n, most = (limits.width(p.arguments[k]) for k in ("n", "max"))
    limits.need(max(n, 0) * (16 * max(most, 0) + 16), "lipsum()", charge=False)
    return jinja2.utils.generate_lorem_ipsum(*args, **kwargs)

  class TemplateDict:  # ``dict(...)`` without exposing the dict type itself
    def __call__(self, *args, **kwargs):
      return dict(*args, **kwargs)

    def fromkeys(self, iterable, value=None):
      keys = limits.collected(iterable, "dict.fromkeys()")
      limits.need(limits.keyed(keys, value), "dict.fromkeys()", charge=False)
      return dict.fromkeys(keys, value)

  def check_name(name):
    if isinstance(name, str) and name.startswith("_"):
      raise jinja2.exceptions.SecurityError(
        f"a chat template cannot store an underscore-prefixed attribute {name!r} on a namespace"
      )

  class TemplateNamespace(jinja2.utils.Namespace):
    def __init__(*args, **kwargs):  # Jinja's signature trick, so namespace(self=...) works
      self, args = args[0], args[1:]
      attrs = dict(*args, **kwargs)
      for name in attrs:
        check_name(name)
      jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
      check_name(name)
      jinja2.utils.Namespace.__setitem__(self, name, value)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    encoder = json.JSONEncoder(
      ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
    if indent is None and separators is None:
      return encoder.encode(x)  # json.dumps: linear in the size of x, which is bounded
    limits.need(limits.width(indent) * sys.getrecursionlimit(), "tojson's indentation",
                charge=False)
    return joined(encoder.iterencode(x), "the tojson filter")  # the same text, in pieces

  class BoundedFormatter(jinja2.sandbox.SandboxedFormatter):
    """Jinja's ``str.format`` formatter, each field bounded once its spec is expanded."""

    made, what = 0, "str.format()"

    def vformat(self, format_string, args, kwargs):
      self.made = len(format_string)  # then each field's bound, added up
      return super().vformat(format_string, args, kwargs)

    def convert_field(self, value, conversion):  # !s, !r, !a: the value's text
      limits.need(limits.size_of(value) if conversion else 0, self.what, charge=False)
      return super().convert_field(value, conversion)

    def format_field(self, value, format_spec):
      self.made += limits.field_bound(value, format_spec)
      limits.need(self.made, self.what, charge=False)
      return super().format_field(value, format_spec)

  class BoundedEscapeFormatter(BoundedFormatter, jinja2.sandbox.SandboxedEscapeFormatter):
    pass

  def range_(*args):
    r = range(*args)  # its length, give or take one (len() fails past 2**63)
    limits.need((r.stop - r.start) // r.step, "range()", charge=False)
    return jinja2.sandbox.safe_range(*args)

  class CodeGenerator(jinja2.compiler.CodeGenerator):
    """Jinja's, with ``~``, the list, tuple and dict literals and ``*args`` measured, and a
    :class:`Pieces` buffer for the output of a block or macro."""

    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      self.starred = {}  # id: node, of the nodes given as *args

    def buffer(self, frame):
      frame.buffer = self.temporary_identifier()
      self.writeline(f"{frame.buffer} = environment.pieces()")

    def signature(self, node, frame, extra_kwargs=None):
      if node.dyn_args is not None:
        self.starred[id(node.dyn_args)] = node.dyn_args
      super().signature(node, frame, extra_kwargs)

    def visit_Concat(self, node, frame):  # environment.tilde instead of runtime.str_join
      self.write("environment.tilde((")
      for arg in node.nodes:
        self.visit(arg, frame)
        self.write(", ")
      self.write("))")

    def visit(self, node, *args, **kwargs):  # literal lists, dicts and tuples (not targets)
      measure = isinstance(node, jinja2.nodes.List | jinja2.nodes.Dict) or (
        isinstance(node, jinja2.nodes.Tuple) and node.ctx == "load"
      )
      starred = self.starred.get(id(node)) is node
      self.write("environment.starred(" * starred + "environment.checked(" * measure)
      super().visit(node, *args, **kwargs)
      self.write(")" * (starred + measure))

  class Environment(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The sandbox, with each operation that makes a value measured."""

    intercepted_binops = frozenset({"+", "*", "%", "**"})
    code_generator_class = CodeGenerator

    def call_binop(self, context, operator, left, right):
      limits.need(limits.binop_size(operator, left, right), f"`{operator}`")
      return super().call_binop(context, operator, left, right)

    def call(self, context, obj, /, *args, **kwargs):
      name, bound = getattr(obj, "__name__", "a function"), limits.method_bound(obj)
      if bound is not None:
        what, bound = bound
        if name in ("join", "fromkeys") and args:  # an iterator read, to measure it first
          args = (limits.collected(args[0], what), *args[1:])
        limits.need(bound(*args, **kwargs), what, charge=False)
      elif obj is jinja2.utils.Cycler or (
        isinstance(obj, jinja2.runtime.Macro) and (obj.catch_varargs or obj.catch_kwargs)
      ):  # they keep the arguments as a new tuple or dict
        limits.need(limits.size_of((args, kwargs)), f"the arguments of {name}()")
      return limits.checked(super().call(context, obj, *args, **kwargs), f"the result of {name}()")

    def wrap_str_format(self, value):  # Jinja's, with a BoundedFormatter
      if not isinstance(value, types.MethodType | types.BuiltinMethodType) or (
        value.__name__ not in ("format", "format_map") or not isinstance(value.__self__, str)
      ):
        return None
      s, is_map = value.__self__, value.__name__ == "format_map"
      if isinstance(s, jinja2.sandbox.Markup):
        formatter = BoundedEscapeFormatter(self, escape=s.escape)
      else:
        formatter = BoundedFormatter(self)
      formatter.what = f"str.{value.__name__}()"

      def wrapper(*args, **kwargs):
        if is_map and (kwargs or len(args) != 1):
          raise TypeError("format_map() takes exactly one argument, and no keyword arguments")
        args, kwargs = ((), args[0]) if is_map else (args, kwargs)
        return type(s)(formatter.vformat(s, args, kwargs))

      return functools.update_wrapper(wrapper, value)

    def pieces(self):
      return Pieces()

    def starred(self, items):
      return limits.collected(items, "the *arguments of a call")

    def tilde(self, items):
      limits.need(sum(map(limits.size_of, items)), "`~`", charge=False)
      return limits.checked("".join(map(str, items)), "`~`")

    def checked(self, value):
      return limits.checked(value, "a list, tuple or dict literal")

  env = Environment(
    trim_blocks=True,
    lstrip_blocks=True,
    extensions=[Generation, jinja2.ext.loopcontrols],
    finalize=lambda value: limits.checked(value, "a {{ }} expression"),
  )
  env.concat = lambda pieces: joined(pieces, "the output of a macro or block")
  env.globals["range"] = range_
  env.globals["lipsum"] = lipsum
  env.filters["tojson"] = tojson
  env.filters.update({name: limits.guard(name, f) for name, f in env.filters.items()})
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = strftime_now
  env.globals["dict"] = TemplateDict()
  env.globals["namespace"] = TemplateNamespace
  return env
