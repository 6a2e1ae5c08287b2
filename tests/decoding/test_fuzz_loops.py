"""Fuzzing the decoding loops (``generate``, ``speculative_generate`` with a prompt lookup and
with a draft model, ``tree_speculative_generate``): garbage arguments give a clear host error
or flagged rows, never a silent wrong output (see :mod:`tests._fuzz_strategies`)."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import specdec_jax as sd
from specdec_jax.models.toy import make_toy_model
from tests._fuzz_strategies import PAD
from tests._fuzz_strategies import SEEDS
from tests._fuzz_strategies import check_host_error
from tests._fuzz_strategies import fuzz

VOCAB = 12
TARGET = make_toy_model(jax.random.key(0), VOCAB)
DRAFT = make_toy_model(jax.random.key(1), VOCAB, context=1)
PROMPT_WIDTH = 4
MAX_NEW = 3
LOOP_MISTAKES = ("none", "id_high", "id_negative", "id_int64_wraps", "id_uint8",
                 "lengths_zero", "lengths_high", "max_len_small", "max_len_tight", "eos_high",
                 "eos_negative", "eos_valid", "temperature_bad", "temperature_row_bad",
                 "top_k_float", "key_batch_wrong", "max_new_zero")
LOOP_ARG = {"id_high": "prompt_tokens", "id_negative": "prompt_tokens",
            "id_int64_wraps": "prompt_tokens", "lengths_zero": "prompt_lengths",
            "lengths_high": "prompt_lengths", "max_len_small": "max_len",
            "max_len_tight": "max_len", "eos_high": "eos_id", "eos_negative": "eos_id",
            "temperature_bad": "params.temperature", "temperature_row_bad": "params.temperature",
            "top_k_float": "params.top_k", "key_batch_wrong": "key",
            "max_new_zero": "max_new_tokens"}


def _loop(kind: str):
  if kind == "generate":
    return "generate", functools.partial(sd.generate, TARGET)
  if kind == "lookup":
    return "speculative_generate", functools.partial(sd.speculative_generate, TARGET,
                                                     sd.PromptLookup(), gamma=2)
  if kind == "draft":
    return "speculative_generate", functools.partial(sd.speculative_generate, TARGET, DRAFT,
                                                     gamma=2)
  return "tree_speculative_generate", functools.partial(
    sd.tree_speculative_generate, TARGET, DRAFT, tree=sd.DraftTree.from_branching((2, 1)))


LOOPS = ("generate", "lookup", "draft", "tree")


@pytest.mark.parametrize("mistake", sorted(set(LOOP_MISTAKES)))
@pytest.mark.parametrize("loop", LOOPS)
@fuzz(2)
@given(seed=SEEDS, temperature=st.sampled_from([0.0, 1.0]))
def test_decoding_loops_garbage(loop, mistake, seed, temperature):
  _run_loop(loop, seed, mistake, temperature)


@pytest.mark.parametrize("temperature", [0.0, 1e-30, 1e-9, 0.7, 1e30, np.inf])
@pytest.mark.parametrize("loop", LOOPS)
@fuzz(2)
@given(seed=SEEDS)
def test_decoding_loops_extreme_temperatures(loop, temperature, seed):
  """Every temperature >= 0 is valid: no NaN, no error bits, tokens in range."""
  _run_loop(loop, seed, "none", temperature)


def _run_loop(loop, seed, mistake, temperature):
  rng = np.random.default_rng(seed)
  name, run = _loop(loop)
  prompt = rng.integers(0, VOCAB, size=(2, PROMPT_WIDTH))
  lengths = np.array([PROMPT_WIDTH, int(rng.integers(1, PROMPT_WIDTH + 1))])
  kwargs = dict(max_new_tokens=MAX_NEW, params=sd.SamplingParams(temperature), pad_id=PAD)
  dtype = np.int32
  row = int(rng.integers(0, 2))
  col = int(rng.integers(0, lengths[row]))
  if mistake == "id_high":
    prompt[row, col] = VOCAB + int(rng.integers(0, 100))
  elif mistake == "id_negative":
    prompt[row, col] = -1
  elif mistake == "id_int64_wraps":
    prompt[row, col], dtype = 2**32 + 1, np.int64  # int32 would read 1
  elif mistake == "id_uint8":
    dtype = np.uint8
  elif mistake == "lengths_zero":
    lengths[row] = 0
  elif mistake == "lengths_high":
    lengths[row] = PROMPT_WIDTH + 1
  elif mistake == "max_len_small":
    kwargs["max_len"] = PROMPT_WIDTH + 1  # P + max_new_tokens does not fit
  elif mistake == "max_len_tight":
    kwargs["max_len"] = PROMPT_WIDTH + MAX_NEW  # fits exactly
  elif mistake == "eos_high":
    kwargs["eos_id"] = VOCAB + 3
  elif mistake == "eos_negative":
    kwargs["eos_id"] = -2
  elif mistake == "eos_valid":
    kwargs["eos_id"] = int(rng.integers(0, VOCAB))
  elif mistake == "temperature_bad":
    kwargs["params"] = sd.SamplingParams(float(rng.choice([-1.0, np.nan])))
  elif mistake == "temperature_row_bad":
    kwargs["params"] = sd.SamplingParams(np.array([1.0, -0.5], np.float32))
  elif mistake == "top_k_float":
    kwargs["params"] = sd.SamplingParams(1.0, 2.5)
  elif mistake == "max_new_zero":
    kwargs["max_new_tokens"] = 0
  key = jax.random.key(seed % 1000)
  if mistake == "key_batch_wrong":
    key = jax.random.split(key, 3)  # B = 2 rows
  bad = mistake not in ("none", "id_uint8", "max_len_tight", "eos_valid")
  prompt = prompt.astype(dtype)
  try:
    res = run(prompt, lengths, key, **kwargs)
  except Exception as err:
    assert bad, f"{name} refused clean input ({mistake}): {err!r}"
    check_host_error(err, name, (LOOP_ARG[mistake],))
    return
  assert hasattr(res, "error"), f"{type(res).__name__} has no `error` field"
  tokens, out_len = np.asarray(res.tokens), np.asarray(res.lengths)
  num_new, error = np.asarray(res.num_new), np.asarray(res.error)
  max_len = kwargs.get("max_len") or PROMPT_WIDTH + kwargs["max_new_tokens"]
  assert tokens.shape == (2, max_len) and error.shape == (2,)
  for b in range(2):
    start = int(lengths[b])
    assert 0 <= num_new[b] <= kwargs["max_new_tokens"] and out_len[b] == start + num_new[b]
    new = tokens[b, start : out_len[b]]
    assert np.all((new >= 0) & (new < VOCAB)), tokens[b]
    assert np.all(tokens[b, out_len[b] :] == PAD), tokens[b]
    eos = kwargs.get("eos_id")
    stopped_by_eos = eos is not None and len(new) > 0 and new[-1] == eos
    if num_new[b] < kwargs["max_new_tokens"] and not stopped_by_eos:
      assert error[b] != 0, f"row {b} silently stopped after {num_new[b]} tokens"
  if mistake in ("id_high", "id_negative", "id_int64_wraps"):
    assert error[row] != 0, "a prompt id outside [0, V) was not flagged"
  elif bad:
    assert np.all(error != 0), f"{mistake} was not flagged: {error}"
  else:
    assert np.all(error == 0), [sd.describe_error(int(e)) for e in error]
    if temperature == 0.0 and loop != "generate":  # greedy: token for token as generate
      plain = sd.generate(TARGET, prompt, lengths, jax.random.key(seed % 1000),
                          **{k: v for k, v in kwargs.items() if k != "eos_id"},
                          eos_id=kwargs.get("eos_id"))
      np.testing.assert_array_equal(tokens, np.asarray(plain.tokens))
