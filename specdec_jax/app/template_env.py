"""The sandboxed Jinja environment that renders chat templates, built as ``transformers`` builds
it, with every operation that makes a value measured (:mod:`specdec_jax.app.template_limits`).

:mod:`specdec_jax.app.chat_template` renders with it; see that module for what the environment
provides and what it refuses.
"""

from __future__ import annotations

import functools
import json
import re
import sys
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

  def strftime_now(format):
    return datetime.now().strftime(format)

  class TemplateDict:  # ``dict(...)`` without exposing the dict type itself
    def __call__(self, *args, **kwargs):
      return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
      return dict.fromkeys(*args, **kwargs)

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
    return limits.joined(encoder.iterencode(x), "the tojson filter")  # the same text, in pieces

  def range_(*args):
    r = range(*args)  # its length, give or take one (len() fails past 2**63)
    limits.need((r.stop - r.start) // r.step, "range()", charge=False)
    return jinja2.sandbox.safe_range(*args)

  class CodeGenerator(jinja2.compiler.CodeGenerator):
    """Jinja's, with ``~`` and the list, tuple and dict literals measured."""

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
      if measure:
        self.write("environment.checked(")
      super().visit(node, *args, **kwargs)
      if measure:
        self.write(")")

  class Environment(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The sandbox, with each operation that makes a value measured."""

    intercepted_binops = frozenset({"+", "*", "%", "**"})
    code_generator_class = CodeGenerator

    def call_binop(self, context, operator, left, right):
      limits.need(limits.binop_size(operator, left, right), f"`{operator}`")
      return super().call_binop(context, operator, left, right)

    def call(self, context, obj, /, *args, **kwargs):
      name = getattr(obj, "__name__", "a function")
      owner = getattr(getattr(obj, "__wrapped__", obj), "__self__", None)  # str.format wrapped
      if isinstance(owner, str | bytes) and name in limits.METHOD_BOUNDS:
        args = (list(args[0]), *args[1:]) if name == "join" and args else args
        limits.need(limits.METHOD_BOUNDS[name](owner, *args, **kwargs),
                    f"{type(owner).__name__}.{name}()")
      elif obj is jinja2.utils.Cycler or (
        isinstance(obj, jinja2.runtime.Macro) and (obj.catch_varargs or obj.catch_kwargs)
      ):  # they keep the arguments as a new tuple or dict
        limits.need(limits.size_of((args, kwargs)), f"the arguments of {name}()")
      return limits.checked(super().call(context, obj, *args, **kwargs), f"the result of {name}()")

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
  env.concat = lambda pieces: limits.joined(pieces, "the output of a macro or block")
  env.globals["range"] = range_
  env.filters["tojson"] = tojson
  env.filters.update({name: limits.guard(name, f) for name, f in env.filters.items()})
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = strftime_now
  env.globals["dict"] = TemplateDict()
  env.globals["namespace"] = TemplateNamespace
  return env
