"""Fuzzing ``sample_index`` (see :mod:`tests._fuzz_strategies`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import specdec_jax as sd
from tests._fuzz_strategies import BF16
from tests._fuzz_strategies import CORRUPTIONS
from tests._fuzz_strategies import F32
from tests._fuzz_strategies import SEEDS
from tests._fuzz_strategies import check_host_error
from tests._fuzz_strategies import clean_rows
from tests._fuzz_strategies import corrupt
from tests._fuzz_strategies import fuzz
from tests._fuzz_strategies import sanitized


@functools.cache
def _sampler():
  return jax.jit(sd.sample_index)


@fuzz(40)
@given(vocab=st.sampled_from([1, 2, 3, 257, 4097, 262144]), seed=SEEDS,
       kind=st.sampled_from((*CORRUPTIONS, "unnormalised", "single")),
       u=st.sampled_from([0.0, 0.5, 0.999, float(np.nextafter(np.float32(1), np.float32(0))),
                          1.0, 1.5, -0.5, np.nan, np.inf, -np.inf]),
       dtype=st.sampled_from([F32, F32, BF16]))
def test_sample_index_garbage(vocab, seed, kind, u, dtype):
  rng = np.random.default_rng(seed)
  if kind == "unnormalised":
    w = rng.random((1, vocab)) * 10.0 ** rng.integers(-30, 30)
  elif kind == "single":
    w = np.zeros((1, vocab))
    w[0, rng.integers(0, vocab)] = 1.0
  else:
    w = corrupt(rng, clean_rows(rng, 1, vocab), kind)
  w = w[0].astype(dtype)
  k = int(_sampler()(jnp.asarray(w), jnp.asarray(u, dtype)))
  assert 0 <= k < vocab
  w32 = w.astype(np.float32)
  if np.any(sanitized(w32) > 0):
    assert sanitized(w32)[k] > 0, f"weight {w32[k]} at {k}"
  # NaN and negative weights count as 0: the inverse CDF of what is left (when its float32
  # total is finite and positive, and u is away from every boundary).
  clean = sanitized(w32).astype(np.float64)
  total = clean.sum()
  if dtype == F32 and 0 <= u < 1 and vocab <= 4097 and 0 < total < 1e38:
    cdf = np.cumsum(clean) / total
    if np.all(np.abs(cdf - np.float32(u)) > 1e-5):
      want = int(np.searchsorted(cdf, np.float32(u), side="right"))
      assert k == min(want, vocab - 1), (k, want)


@pytest.mark.parametrize("form", ["list", "numpy", "numpy_bf16", "python_u"])
def test_sample_index_host_values(form):
  """Host values work like arrays, or raise a clear error naming the function and argument."""
  w, u = [0.2, 0.0, 0.3, 0.5], 0.6
  want = int(sd.sample_index(jnp.asarray(w, jnp.float32), jnp.float32(u)))
  args = {"list": (w, np.float32(u)), "numpy": (np.asarray(w, np.float32), np.float32(u)),
          "numpy_bf16": (np.asarray(w, BF16), np.asarray(u, BF16)),
          "python_u": (jnp.asarray(w, jnp.float32), u)}[form]
  try:
    got = int(sd.sample_index(*args))
  except Exception as err:
    check_host_error(err, "sample_index", ("`weights`", "`u`"))
    return
  assert got == want


