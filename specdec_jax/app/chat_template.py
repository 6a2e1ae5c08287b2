"""Render a model's own Jinja chat template, as Hugging Face's ``apply_chat_template`` does.

A GGUF file (``tokenizer.chat_template``) or a ``tokenizer_config.json`` (``chat_template``)
carries the model's prompt format as a Jinja template. :func:`render_chat_template` renders one
the way ``transformers`` (``utils/chat_template_utils.py``: ``_compile_jinja_template`` and
``render_jinja_template``; ``PreTrainedTokenizerBase.apply_chat_template`` with
``tokenize=False``) does, so the same template and messages give the same string:

* an ``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` with the
  ``loopcontrols`` extension (``{% break %}``, ``{% continue %}``) and a ``{% generation %}``
  tag that renders its body (``transformers`` uses it to mark assistant tokens);
* a ``tojson`` filter that is ``json.dumps`` (``ensure_ascii=False``; ``indent``,
  ``separators`` and ``sort_keys`` as options) instead of Jinja's HTML-escaping one;
* the globals ``raise_exception(message)``, ``strftime_now(format)`` and restricted ``dict``
  and ``namespace`` (a namespace refuses names that start with ``_``);
* the variables ``messages``, ``tools`` and ``documents`` (None unless given),
  ``add_generation_prompt``, ``bos_token``, ``eos_token`` and any extra keyword arguments
  (``enable_thinking``, ``date_string``, ...);
* the inputs are first copied into plain JSON-like data (dicts, lists, str, int, float, bool,
  None); message keys whose value is None are dropped; a message's reasoning given as
  ``reasoning``, ``thinking`` or ``reasoning_content`` is also given under the other two
  names that templates read (``thinking`` and ``reasoning_content``).

Not supported: ``continue_final_message``, tools given as Python functions (give their JSON
schemas) and batches of conversations. One difference: ``add_generation_prompt`` defaults to
True here (False in ``transformers``), since a prompt is rendered to be answered.

Templates are untrusted code: the sandbox refuses access to private attributes
(``{{ ''.__class__ }}``) and to the file system, and jinja2 older than 3.1.6, which has
known sandbox escapes, is refused (as ``transformers`` does). Nor can a template run or grow
without bound (:class:`ChatTemplateError` names the bound and the argument that raises it):

* time: it runs in a worker thread, and after ``time_limit`` s a watchdog raises an exception
  in it (``PyThreadState_SetAsyncExc``, every 50 ms), which Python delivers between any two
  bytecodes; only one C-level operation runs on to its end, and the size bounds keep it small;
* size: each value it makes (counted in characters, plus 8 per list, tuple or dict element, a
  shared value each time it occurs) is measured where it is made and refused over
  ``max_chars``: the prompt, each ``{{ }}``, ``~``, literal list, tuple or dict, call or filter
  result, and the output of a block, macro or loop, added up as it is written. Every operation
  that can make a value many times its arguments' size (``* % **``, ``str.format`` with a
  width or precision given as an argument, ``ljust``, ``join``, ``int.to_bytes``, the
  ``center`` and ``indent`` filters, ``range``...) is refused before it runs, from its
  arguments: :mod:`specdec_jax.app.template_limits` lists them and how. Integers stay under
  2**65536, and the values of one render add up to at most ``8 * max_chars``.

``jinja2`` is an optional dependency, imported on first use.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import numpy as np

from specdec_jax.app import template_limits as limits
from specdec_jax.app.template_env import RaisedByTemplate
from specdec_jax.app.template_env import environment
from specdec_jax.app.template_env import jinja2_module

__all__ = ["ChatTemplateError", "chat_prompt", "render_chat_template"]

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # as in transformers


class ChatTemplateError(ValueError):
  """A chat template that does not compile, or that failed while rendering (including a call
  to ``raise_exception`` and an operation the sandbox refuses)."""


def _quote_line(template: str, lineno: int | None) -> str:
  """`` (template line N: 'text')``, or without the text when the line is long."""
  lines = template.splitlines()
  if lineno is None or not 1 <= lineno <= len(lines):
    return ""
  text = lines[lineno - 1].strip()
  return (
    f" (template line {lineno}: {text!r})" if len(text) <= 100 else f" (template line {lineno})"
  )


@functools.lru_cache(maxsize=32)
def _compile(template: str) -> Any:
  jinja2 = jinja2_module()
  try:
    return environment().from_string(template)
  except jinja2.exceptions.TemplateSyntaxError as e:
    raise ChatTemplateError(
      f"render_chat_template: the chat template has a syntax error: {e.message}"
      f"{_quote_line(template, e.lineno)}"
    ) from None


def _template_line(exc: BaseException) -> int | None:
  """The template line where rendering failed (Jinja rewrites the traceback to point there)."""
  lineno, tb = None, exc.__traceback__
  while tb is not None:
    if tb.tb_frame.f_code.co_filename == "<template>":
      lineno = tb.tb_lineno
    tb = tb.tb_next
  return lineno


def _plain(value: Any) -> Any:
  """``value`` rebuilt from plain JSON-like types, as ``transformers`` does before rendering:
  the template then sees no object whose methods the sandbox does not know to be harmful."""
  if value is None or type(value) in (str, int, float, bool):
    return value
  if isinstance(value, str):
    return str.__str__(value)
  if isinstance(value, int):
    return int.__int__(value)
  if isinstance(value, float):
    return float.__float__(value)
  if isinstance(value, Mapping):
    return {_plain(k): _plain(v) for k, v in value.items()}
  if isinstance(value, list):
    return [_plain(v) for v in value]
  if isinstance(value, tuple):
    return tuple(_plain(v) for v in value)
  if isinstance(value, np.generic):
    return _plain(value.item())  # np.bool_(False) must stay falsy
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
  if callable(getattr(value, "model_dump", None)):
    return _plain(value.model_dump())  # pydantic models (e.g. OpenAI SDK messages)
  return f"<{type(value).__name__}>"  # anything else becomes an inert placeholder


def _messages(messages: Any) -> list[dict]:
  if isinstance(messages, str | bytes | Mapping) or not hasattr(messages, "__iter__"):
    raise TypeError(
      "render_chat_template: messages must be a list of dicts such as "
      f"{{'role': 'user', 'content': 'Hi'}}; got {type(messages).__name__}"
    )
  out = []
  for i, message in enumerate(messages):
    if dataclasses.is_dataclass(message) and not isinstance(message, type):
      message = {f.name: getattr(message, f.name) for f in dataclasses.fields(message)}
    elif callable(getattr(message, "model_dump", None)):
      message = message.model_dump()
    if not isinstance(message, Mapping):
      raise TypeError(
        f"render_chat_template: messages[{i}] must be a dict with 'role' and 'content'; "
        f"got {message!r}"
      )
    message = _plain({k: v for k, v in message.items() if v is not None})
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is not None:
      message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    out.append(message)
  if not out:
    raise ValueError("render_chat_template: messages is empty; give at least one message")
  return out


def render_chat_template(
  template: str,
  messages: list[dict],
  *,
  add_generation_prompt: bool = True,
  bos_token: str = "",
  eos_token: str = "",
  time_limit: float | None = 2.0,
  max_chars: int = 4_000_000,
  **extra: Any,
) -> str:
  """Render a Jinja chat template as ``tokenizer.apply_chat_template(..., tokenize=False)``.

  Args:
    template: the Jinja source (a GGUF file's ``tokenizer.chat_template`` metadata, or the
      ``chat_template`` of a ``tokenizer_config.json``).
    messages: the conversation: dicts with ``role`` (``"system"``, ``"user"``,
      ``"assistant"``, ...) and ``content``, plus whatever else the template reads
      (``tool_calls``, ``reasoning_content``, ...).
    add_generation_prompt: end with the header of an assistant turn, for the model to answer
      (True here; ``transformers`` defaults to False).
    bos_token: the text of the beginning-of-sequence token, for templates that write it
      (Llama 3, Gemma, Mistral); ``""`` for templates that do not.
    eos_token: the text of the end-of-sequence token (Zephyr writes it after every turn).
    time_limit: the seconds the template may run for (None: no limit).
    max_chars: the most characters the prompt, or any value the template makes, may have (a
      list or dict element counts 8); all the values made may add up to 8 times it.
    **extra: more template variables, e.g. ``tools`` (a list of JSON schemas), ``documents``,
      ``enable_thinking``, ``date_string`` or other special tokens (``pad_token``...).

  Returns:
    The rendered prompt text (to be tokenized without adding special tokens).

  Raises:
    ImportError: jinja2 (3.1.6 or newer) is not installed; the message gives the pip command.
    ChatTemplateError: a ``ValueError``: the template has a syntax error (the message gives the
      line), calls ``raise_exception`` (the message gives the template's reason, e.g. that
      it supports no system message), does something the sandbox refuses, runs past
      ``time_limit``, makes a value or prompt longer than ``max_chars``, or fails otherwise.
    TypeError: ``messages`` is not a list of dicts, or ``tools``/``documents`` are not dicts.
    ValueError: ``messages`` is empty.
  """
  jinja2 = jinja2_module()
  if not isinstance(template, str):
    raise TypeError(
      f"render_chat_template: template must be the Jinja source as a str; got "
      f"{type(template).__name__} (is the model's chat template missing?)"
    )
  compiled = _compile(template)
  chat = _messages(messages)
  variables = {"tools": None, "documents": None, "bos_token": bos_token, "eos_token": eos_token}
  variables.update(extra)
  for name in ("tools", "documents"):
    items = variables[name]
    if items is not None and not all(isinstance(x, Mapping) for x in items):
      raise TypeError(f"render_chat_template: {name} must be a list of dicts (JSON schemas)")
  variables = _plain(variables)
  variables.update(messages=chat, add_generation_prompt=bool(add_generation_prompt))

  def render():  # in the worker thread
    limits.local_state.budget, out, n = limits.Budget(max_chars), [], 0
    for piece in compiled.generate(**variables):
      n += len(piece)
      if n > max_chars:
        raise limits.Exceeded(
          f"exceeded the output-size bound: the prompt comes to over max_chars={max_chars:,} "
          "characters; a larger max_chars allows it"
        )
      out.append(piece)
    return "".join(out)

  try:
    return limits.run_bounded(render, time_limit)
  except limits.Timeout as e:  # not an Exception, so its traceback gives the compiled code's line
    line = _template_line(e)
    raise ChatTemplateError(
      f"render_chat_template: the chat template exceeded the time bound: it ran for over "
      f"time_limit={time_limit} s; a larger time_limit allows it"
      f"{_quote_line(template, line and compiled.get_corresponding_lineno(line))}"
    ) from None
  except limits.Exceeded as e:
    raise ChatTemplateError(
      f"render_chat_template: the chat template {e}{_quote_line(template, _template_line(e))}"
    ) from None
  except RaisedByTemplate as e:
    raise ChatTemplateError(
      f"render_chat_template: the chat template rejected the messages: {e}"
      f"{_quote_line(template, _template_line(e))}"
    ) from None
  except jinja2.exceptions.SecurityError as e:
    raise ChatTemplateError(
      f"render_chat_template: the chat template did something the sandbox forbids: {e}"
      f"{_quote_line(template, _template_line(e))}"
    ) from e
  except Exception as e:  # the template is code: any error in it is the template's
    raise ChatTemplateError(
      f"render_chat_template: the chat template failed while rendering: "
      f"{type(e).__name__}: {e}{_quote_line(template, _template_line(e))}"
    ) from e


def chat_prompt(
  template: str,
  user_message: str,
  system_prompt: str | None = None,
  **kwargs: Any,
) -> str:
  """A one-turn prompt in the model's own chat template, ready for the assistant's reply.

  Args:
    template: the Jinja chat template (e.g. a GGUF file's ``tokenizer.chat_template``).
    user_message: the user's turn.
    system_prompt: a system message, sent first; ``None`` sends none, and the template then
      does what it does without one (SmolLM2's inserts its own default system prompt, "You are
      a helpful AI assistant named SmolLM, trained by Hugging Face"; Gemma's refuses one).
    **kwargs: passed on to :func:`render_chat_template` (``bos_token``, ``eos_token``,
      ``add_generation_prompt``, other template variables).

  Returns:
    The prompt text.
  """
  messages = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
  messages.append({"role": "user", "content": user_message})
  return render_chat_template(template, messages, **kwargs)
