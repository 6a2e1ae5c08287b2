"""``specdec_jax.app.op_profile``: XLA profile events attributed to source lines.

The stack-frame tables of a real compiled module are read (the op of a known line maps to it),
ops without frames inherit their operands', the categories of a decoding loop follow the files,
and a real profile of a program with one heavy and one light part puts the time on the heavy
one's line (deterministic: the heavy part does 100,000 times the work).
"""

import collections
import glob
import inspect

import jax
import jax.numpy as jnp
import pytest

from specdec_jax.app.op_profile import CATEGORIES
from specdec_jax.app.op_profile import Frame
from specdec_jax.app.op_profile import by_key
from specdec_jax.app.op_profile import category
from specdec_jax.app.op_profile import hlo_locations
from specdec_jax.app.op_profile import hlo_op_names
from specdec_jax.app.op_profile import hlo_opcodes
from specdec_jax.app.op_profile import in_loop
from specdec_jax.app.op_profile import innermost
from specdec_jax.app.op_profile import op_times
from specdec_jax.app.op_profile import without_containers


def _heavy(a):
  return a @ a @ a @ a  # three 256^3 matmuls


def _light(b):
  return b * 2.0


def _program(a, b):
  return _heavy(a), _light(b)


def _line_of(fn, text):
  lines, start = inspect.getsourcelines(fn)
  return start + next(i for i, line in enumerate(lines) if text in line)


def test_ops_map_to_the_lines_they_were_traced_from():
  args = (jnp.ones((256, 256)), jnp.ones((8,)))
  text = jax.jit(_program).lower(*args).compile().as_text()
  locations = hlo_locations(text)
  heavy_line = _line_of(_heavy, "a @ a")
  frames = [f for fs in locations.values() for f in fs]
  assert Frame(__file__, "_heavy", heavy_line) in frames
  assert any(f.function == "_light" for f in frames)
  # every op of the module is there, those XLA left without metadata with an operand's
  assert all(isinstance(v, tuple) for v in locations.values())


def test_ops_without_frames_inherit_an_operands():
  text = "\n".join([
    "HloModule m", "", "FileNames", '1 "/x/specdec_jax/models/llama_forward.py"', "",
    "FunctionNames", '1 "decoder_layer"', '2 "forward"', "",
    "FileLocations", "1 {file_name_id=1 function_name_id=1 line=93 end_line=93}",
    "2 {file_name_id=1 function_name_id=2 line=127 end_line=127}", "",
    "StackFrames", "1 {file_location_id=2 parent_frame_id=0}",
    "2 {file_location_id=1 parent_frame_id=1}", "", "",
    "ENTRY %main (p: f32[2]) -> f32[2] {",
    "  %p = f32[2]{0} parameter(0)",
    '  %copy.1 = f32[2]{0} copy(%p), metadata={op_name="x" stack_frame_id=2}',
    "  %dot.7 = f32[2]{0} dot(%p, %copy.1), lhs_contracting_dims={0}",
    "  %w.3 = (f32[2]{0}, (s32[], f32[2]{0})) while(%t.1), condition=%c, body=%b",
    "  ROOT %neg.2 = f32[2]{0} negate(%dot.7)", "}"])
  locations = hlo_locations(text)
  inner = Frame("/x/specdec_jax/models/llama_forward.py", "decoder_layer", 93)
  outer = Frame("/x/specdec_jax/models/llama_forward.py", "forward", 127)
  assert locations["copy.1"] == (inner, outer)
  assert locations["dot.7"] == (inner, outer)  # through its operand copy.1 (p has none)
  assert locations["neg.2"] == (inner, outer)  # two steps back
  assert locations["p"] == ()
  assert innermost(locations["dot.7"]) == "models/llama_forward.py:decoder_layer:93"
  own = hlo_locations(text, inherit=False)
  assert own["copy.1"] == (inner, outer) and own["dot.7"] == () and own["neg.2"] == ()
  assert hlo_op_names(text) == {"p": "", "copy.1": "x", "dot.7": "x", "w.3": "", "neg.2": "x"}
  opcodes = hlo_opcodes(text)
  assert opcodes == {"p": "parameter", "copy.1": "copy", "dot.7": "dot", "w.3": "while",
                     "neg.2": "negate"}
  times = collections.Counter({"copy.1": 5, "w.3": 100, "dot.7": 7, "other": 1})
  assert without_containers(times, opcodes) == collections.Counter(
    {"copy.1": 5, "dot.7": 7, "other": 1})  # the while's span holds its body: not counted
  assert by_key(without_containers(times, opcodes), locations, innermost)["(no frame)"] == 1


def test_text_without_stack_frames_is_refused():
  with pytest.raises(ValueError, match=r"hlo_locations: expected .*StackFrames"):
    hlo_locations("HloModule m\n\nENTRY %main () -> f32[] {\n}\n")


@pytest.mark.parametrize(("files", "expected"), [
  ([("specdec_jax/models/llama_forward.py", "decoder_layer"),
    ("specdec_jax/decoding/chain_loop.py", "body")], "target model"),
  ([("specdec_jax/models/llama_forward.py", "rms_norm"), ("specdec_jax/models/eagle.py", "_layer"),
    ("specdec_jax/decoding/drafts.py", "run_ahead")], "draft"),
  ([("specdec_jax/models/eagle.py", "fuse_features"),
    ("specdec_jax/models/eagle.py", "fused")], "target model"),
  ([("specdec_jax/_logits/threshold.py", "softmax"), ("specdec_jax/_rules/tokenwise.py", "verify")],
   "processing and sampling"),
  ([("specdec_jax/_rows/residual.py", "residual"), ("specdec_jax/decoding/chain_loop.py", "body")],
   "verification"),
  ([("specdec_jax/decoding/common.py", "advance")], "loop bookkeeping"),
  ([("jax/_src/numpy/lax_numpy.py", "where")], "unattributed"),
  ([], "unattributed"),
])
def test_categories_of_a_decoding_loop(files, expected):
  frames = tuple(Frame(f"/repo/{path}", fn, 1) for path, fn in files)
  assert category(frames) == expected
  assert expected in CATEGORIES


def test_a_real_profile_puts_the_time_on_the_heavy_line(tmp_path):
  args = (jnp.ones((256, 256)) / 256, jnp.ones((8,)))
  program = jax.jit(_program)
  text = program.lower(*args).compile().as_text()
  jax.block_until_ready(program(*args))
  options = jax.profiler.ProfileOptions()
  options.python_tracer_level = 0  # the Python tracer can hang on long traces
  jax.profiler.start_trace(str(tmp_path), profiler_options=options)
  for _ in range(5):
    jax.block_until_ready(program(*args))
  jax.profiler.stop_trace()
  (xplane,) = glob.glob(f"{tmp_path}/**/*.xplane.pb", recursive=True)
  times, counts = op_times(xplane)
  assert times and set(times) == set(counts)
  locations = hlo_locations(text)
  by_function = by_key(times, locations,
                       lambda frames: frames[0].function if frames else "(none)")
  assert by_function["_heavy"] > 0.8 * sum(by_function.values()), by_function


@pytest.mark.parametrize(("op_name", "expected"), [
  ("jit(speculative_loop)/while/body/jit(llama_apply_features)/while/body/dot_general", True),
  ("jit(generate_loop)/while/body/vmap()/select_n", True),
  ("jit(generate_loop)/jit(llama_apply)/while/body/closed_call/dynamic_slice", False),  # prefill
  ("jit(generate_loop)/broadcast_in_dim", False),
  ("", False),
])
def test_ops_inside_a_loops_while_are_told_from_its_prefill(op_name, expected):
  assert in_loop(op_name) is expected
