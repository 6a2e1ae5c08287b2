"""Where a compiled program spends its time, by source line: XLA profile events attributed
through the stack frames of the optimized HLO.

XLA names each op it runs (``dynamic-slice_bitcast_fusion.8``, ``ynn_fusion.149``, ...); the
optimized HLO text (``jax.jit(f).lower(...).compile().as_text()``, or the
``*after_optimizations.txt`` files of ``XLA_FLAGS=--xla_dump_to=DIR``) maps each name to the
Python stack it was traced from. :func:`hlo_locations` reads that map, :func:`op_times` sums a
``jax.profiler`` trace by op name (:func:`without_containers` drops the spans of control flow),
and :func:`by_key` joins the two, so the time of a decoding
loop splits into the target's call, the draft, processing and verification, and the loop's own
bookkeeping (:func:`category`). ``benchmarks/profile_loop.py`` does this for the SmolLM2 loops.

Example:
  >>> import jax, jax.numpy as jnp
  >>> text = jax.jit(lambda x: jnp.tanh(x).sum()).lower(jnp.ones(3)).compile().as_text()
  >>> any(frames for frames in hlo_locations(text).values())
  True
"""

from __future__ import annotations

import collections
import re
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

#: Profile events that are XLA's runtime, not an op of the program.
RUNTIME_EVENTS = ("ThunkExecutor", "ThreadpoolListener", "SlinkyThreadPool", "end:")

_SECTIONS = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
_INSTRUCTION = re.compile(r"\s*(?:ROOT )?%([\w.\-]+) = ")
_FRAME_ID = re.compile(r"stack_frame_id=(\d+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_LOCATION = re.compile(r"(\d+) \{file_name_id=(\d+) function_name_id=(\d+) line=(\d+)")
_STACK_FRAME = re.compile(r"(\d+) \{file_location_id=(\d+)(?: parent_frame_id=(\d+))?")


class Frame(NamedTuple):
  """One Python frame an op was traced from."""

  file: str
  function: str
  line: int


def _closing(text: str, start: int) -> int:
  """The index of the parenthesis closing the one at ``text[start]``."""
  depth = 0
  for i in range(start, len(text)):
    depth += {"(": 1, ")": -1}.get(text[i], 0)
    if depth == 0:
      return i
  return len(text)


def _opcode_and_operands(rest: str) -> tuple[str, list[str]]:
  """``(opcode, operand names)`` of an instruction's text after ``name = ``."""
  at = _closing(rest, 0) + 1 if rest.startswith("(") else 0  # a tuple shape
  paren = rest.find("(", at)
  if paren < 0:
    return "", []
  opcode = rest[at:paren].split()[-1] if rest[at:paren].split() else ""
  return opcode, re.findall(r"%([\w.\-]+)", rest[paren: _closing(rest, paren) + 1])


def hlo_opcodes(hlo_text: str) -> dict[str, str]:
  """Each instruction's opcode (``fusion``, ``dot``, ``while``, ...) by name."""
  return {m[1]: _opcode_and_operands(line[m.end():])[0]
          for line in hlo_text.splitlines() if (m := _INSTRUCTION.match(line))}


def _inherited(own: dict, operands: dict[str, list[str]], missing):
  """``own`` for every instruction, those without one taking their first operand's that has
  one (breadth first), else ``missing``."""
  result = {}
  for name in operands:
    queue, seen = collections.deque([name]), {name}
    while queue and queue[0] not in own:
      for operand in operands.get(queue.popleft(), ()):
        if operand not in seen:
          seen.add(operand)
          queue.append(operand)
    result[name] = own[queue[0]] if queue else missing
  return result


def _instructions(hlo_text: str):
  """``(tables, frame ids, op names, operands)`` of the instructions of a module's text."""
  tables: dict[str, dict[int, object]] = {s: {} for s in _SECTIONS}
  frame_ids: dict[str, int] = {}
  op_names: dict[str, str] = {}
  operands: dict[str, list[str]] = {}
  section = None
  for line in hlo_text.splitlines():
    if line in _SECTIONS:
      section = line
      continue
    if section is not None:
      if not line.strip():
        section = None
      elif section in ("FileNames", "FunctionNames"):
        key, value = line.split(" ", 1)
        tables[section][int(key)] = value.strip().strip('"')
      elif section == "FileLocations" and (m := _LOCATION.match(line)):
        tables[section][int(m[1])] = (int(m[2]), int(m[3]), int(m[4]))
      elif section == "StackFrames" and (m := _STACK_FRAME.match(line)):
        tables[section][int(m[1])] = (int(m[2]), int(m[3] or 0))
      continue
    if m := _INSTRUCTION.match(line):
      operands[m[1]] = _opcode_and_operands(line[m.end():])[1]
      if frame := _FRAME_ID.search(line):
        frame_ids[m[1]] = int(frame[1])
      if op_name := _OP_NAME.search(line):
        op_names[m[1]] = op_name[1]
  return tables, frame_ids, op_names, operands


def hlo_locations(hlo_text: str, *, inherit: bool = True) -> dict[str, tuple[Frame, ...]]:
  """Each instruction of an optimized HLO module's text and the frames it was traced from.

  An instruction without a stack frame of its own (XLA drops the metadata of some ops it
  creates, such as the dots it splits out of a fusion) takes, with ``inherit``, that of its
  first operand that has one, searched breadth first; without, or none found, ``()``.
  The frames stop at the innermost ``jax.jit`` the op was traced in (a model's ``apply``
  inside a decoding loop has its own); :func:`hlo_op_names` gives the whole nesting.

  Args:
    hlo_text: the module's text with its ``FileNames`` .. ``StackFrames`` tables, as
      ``Compiled.as_text()`` and XLA's ``after_optimizations`` dumps print it.
    inherit: give frameless instructions their operands' frames.

  Returns:
    ``{name: frames}``, innermost frame first, file names as written in the module.

  Raises:
    ValueError: the text has no stack frame tables (an XLA that does not print them).
  """
  tables, frame_ids, _, operands = _instructions(hlo_text)
  if not tables["StackFrames"]:
    raise ValueError("hlo_locations: expected an optimized HLO module with its StackFrames "
                     "table; got text without one")

  def frames(frame_id: int) -> tuple[Frame, ...]:
    out, seen = [], set()
    while frame_id in tables["StackFrames"] and frame_id not in seen:
      seen.add(frame_id)
      location, frame_id = tables["StackFrames"][frame_id]
      file_id, function_id, line = tables["FileLocations"][location]
      out.append(Frame(tables["FileNames"][file_id], tables["FunctionNames"][function_id], line))
    return tuple(out)

  located = {name: frames(frame_id) for name, frame_id in frame_ids.items()}
  if not inherit:
    return {name: located.get(name, ()) for name in operands}
  return _inherited(located, operands, ())


def hlo_op_names(hlo_text: str) -> dict[str, str]:
  """Each instruction's ``op_name`` (``jit(loop)/while/body/jit(apply)/...``: the transforms
  and control flow it sits in), frameless ones their first operand's (as
  :func:`hlo_locations`), else ``""``."""
  _, _, op_names, operands = _instructions(hlo_text)
  return _inherited(op_names, operands, "")


def in_loop(op_name: str) -> bool:
  """Whether an op of a jitted decoding loop runs inside its ``while_loop`` (each iteration),
  not before it (the prefill and set-up): its ``op_name`` continues ``jit(...)/while/``."""
  return op_name.split("/")[1:2] == ["while"]


def op_times(xplane: str | Path, *, threads: str = "tf_XLA") -> tuple[collections.Counter,
                                                                        collections.Counter]:
  """Time and count of each op in a ``jax.profiler`` trace, on XLA's compute threads.

  Args:
    xplane: a ``.xplane.pb`` file written by ``jax.profiler.start_trace``/``stop_trace``.
    threads: the prefix of the trace lines (threads) to read; XLA's CPU runtime runs ops on
      ``tf_XLAEigen`` pool threads and ``tf_XLAPjRtCpuClient`` (the calling executor).

  Returns:
    ``(nanoseconds, counts)``, each a ``Counter`` by op name; runtime events
    (:data:`RUNTIME_EVENTS`) are left out.
  """
  import jax  # the profiler's reader; the rest of this module is plain text

  data = jax.profiler.ProfileData.from_file(str(xplane))
  times, counts = collections.Counter(), collections.Counter()
  for plane in data.planes:
    for line in plane.lines:
      if not line.name.startswith(threads):
        continue
      for event in line.events:
        if not event.name.startswith(RUNTIME_EVENTS):
          times[event.name] += event.duration_ns
          counts[event.name] += 1
  return times, counts


#: Control-flow ops: a profile event of one spans the ops it runs (on its own thread or others).
CONTAINERS = ("while", "conditional", "call")


def without_containers(times: collections.Counter, opcodes: dict[str, str]) -> collections.Counter:
  """``times`` less the events of control-flow ops (:data:`CONTAINERS`), whose spans hold the
  ops they run: summing both would count those ops twice."""
  return collections.Counter({name: ns for name, ns in times.items()
                              if opcodes.get(name) not in CONTAINERS})


def by_key(times: collections.Counter, locations: dict[str, tuple[Frame, ...]],
           key: Callable[[tuple[Frame, ...]], str]) -> collections.Counter:
  """Op times summed by ``key(frames)``; ops missing from ``locations`` (other modules) by
  ``key(())``."""
  out = collections.Counter()
  for name, ns in times.items():
    out[key(locations.get(name, ()))] += ns
  return out


#: :func:`category`'s names, in the order a report lists them.
CATEGORIES = ("target model", "draft", "processing and sampling", "verification",
              "loop bookkeeping", "unattributed")

_DRAFT_FUNCTIONS = {"eagle_apply", "eagle_tree_apply", "_layer"}
#: Logits processing and sampling: the logits layer of the core, and its inverse-CDF sampler.
_PROCESSING = ("specdec_jax/_logits/", "specdec_jax/_core/sampling.py")


def category(frames: tuple[Frame, ...]) -> str:
  """The part of a specdec_jax decoding loop an op belongs to, from its frames.

  ``draft``: traced inside ``decoding/drafts.py`` or the EAGLE draft's own layer; ``target
  model``: else inside ``models/`` (the target's call, with the fused features EAGLE-3 reads);
  else by the innermost specdec_jax file: logits processing and sampling (``_logits/``,
  ``_core/sampling.py``), verification (the rest of the core), the loop's bookkeeping
  (``decoding/``); ``unattributed``: no specdec_jax frame.
  """
  files = [(Path(f.file).as_posix(), f.function) for f in frames]
  ours = [(path, fn) for path, fn in files if "specdec_jax/" in path]
  if any(p.endswith("decoding/drafts.py") or (p.endswith("models/eagle.py")
                                               and fn in _DRAFT_FUNCTIONS) for p, fn in ours):
    return "draft"
  if any("specdec_jax/models/" in p for p, _ in ours):
    return "target model"
  if not ours:
    return "unattributed"
  path = ours[0][0]
  if "specdec_jax/decoding/" in path:
    return "loop bookkeeping"
  return "processing and sampling" if any(p in path for p in _PROCESSING) else "verification"


def innermost(frames: tuple[Frame, ...]) -> str:
  """``file:function:line`` of the innermost specdec_jax frame (any frame if none)."""
  ours = [f for f in frames if "specdec_jax/" in Path(f.file).as_posix()] or list(frames)
  if not ours:
    return "(no frame)"
  f = ours[0]
  return f"{f.file.split('specdec_jax/')[-1]}:{f.function}:{f.line}"
