"""Fuzzing ``process_logits``, ``verify_logits`` and its ``key=`` form (see
:mod:`tests._fuzz_strategies`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import specdec_jax as sd
from tests._fuzz_strategies import BF16
from tests._fuzz_strategies import F32
from tests._fuzz_strategies import ID_KINDS
from tests._fuzz_strategies import NUM_DRAFT_KINDS
from tests._fuzz_strategies import PAD
from tests._fuzz_strategies import SEEDS
from tests._fuzz_strategies import U_KINDS
from tests._fuzz_strategies import chain_case
from tests._fuzz_strategies import chain_oracle
from tests._fuzz_strategies import check_chain_result
from tests._fuzz_strategies import check_host_error
from tests._fuzz_strategies import fuzz
from tests._fuzz_strategies import row_bad
from tests._fuzz_strategies import tolerance

TEMPERATURES = (0.0, 1e-30, 1e-9, 0.7, 1.0, 1e30, np.inf, np.nan, -1.0)
LOGIT_KINDS = ("normal", "normal", "ties", "four_equal", "huge", "masked", "nan", "posinf",
               "all_neginf")


def logits_rows(rng, n: int, vocab: int, kind: str) -> np.ndarray:
  x = rng.normal(size=(n, vocab)) * 3
  if n == 0 or kind == "normal":
    return x
  r = int(rng.integers(0, n))
  cols = rng.integers(0, vocab, size=int(rng.integers(1, min(vocab, 4) + 1)))
  if kind == "ties":
    x[r] = np.round(x[r])
  elif kind == "huge":
    x[r, cols] = rng.choice([3e38, -3e38, 1e30], size=len(cols))
  elif kind == "four_equal":  # top-p boundaries fall exactly on multiples of 1/4
    x[r] = -np.inf
    x[r, rng.choice(vocab, size=min(vocab, 4), replace=False)] = 1.0
  elif kind == "masked":
    x[r, cols] = -np.inf
    x[r, int(rng.integers(0, vocab))] = 0.0  # at least one finite logit
  elif kind == "nan":
    x[r, cols] = np.nan
  elif kind == "posinf":
    x[r, cols] = np.inf
  elif kind == "all_neginf":
    x[r] = -np.inf
  elif kind == "all_rows_nan":
    x[:] = np.nan
  return x


def logits_broken(row: np.ndarray) -> bool:
  """A row no distribution can come from: a NaN or +inf logit, or no finite logit at all."""
  return bool(np.any(np.isnan(row)) or np.any(row == np.inf) or not np.any(np.isfinite(row)))


def reference_process(x: np.ndarray, temperature: float, top_k, top_p) -> np.ndarray:
  """The documented processing in float64: temperature as (x - max) / T, then top-k, then top-p
  over the survivors (mass before < top_p), ties toward the lower id."""
  x = x.astype(np.float64)
  vocab = len(x)
  finite = np.isfinite(x)
  z = np.where(finite, (x - x[finite].max()) / temperature, -np.inf)
  order = np.argsort(-z, kind="stable")
  if top_k:
    z[order[top_k:]] = -np.inf
  probs = np.exp(z - z.max())
  probs /= probs.sum()
  if top_p is not None and top_p < 1:
    before = np.cumsum(probs[order]) - probs[order]
    drop = order[(before >= top_p) & (np.arange(vocab) > 0)]
    probs[drop] = 0
    probs /= probs.sum()
  return probs


def check_processed_row(probs: np.ndarray, logits: np.ndarray, temperature: float,
                        tol: float) -> None:
  if logits_broken(logits):  # must not look like a valid distribution
    assert row_bad(probs, tol)[0], f"broken logits {logits} gave a valid-looking row {probs}"
    return
  assert not row_bad(probs, tol)[0], f"T={temperature}: {probs} from {logits}"
  assert np.all(probs[logits == -np.inf] == 0)
  greedy = not temperature > 0
  top = int(np.argmax(logits))
  if greedy:
    assert probs.tolist() == np.eye(len(logits))[top].tolist()
  else:
    assert probs[top] >= probs.max() * (1 - 1e-6)


@fuzz(24)
@given(vocab=st.sampled_from([1, 3, 257]), seed=SEEDS, kind=st.sampled_from(LOGIT_KINDS),
       temperature=st.sampled_from(TEMPERATURES), dtype=st.sampled_from([F32, BF16]),
       jit=st.booleans(), top=st.sampled_from(["none", "kp"]))
def test_process_logits_garbage(vocab, seed, kind, temperature, dtype, jit, top):
  rng = np.random.default_rng(seed)
  logits = logits_rows(rng, 2, vocab, kind).astype(dtype)
  top_k = int(rng.integers(0, vocab + 2)) if "k" in top else None
  top_p = float(rng.choice([0.3, 0.5, 0.75, 0.9, 1.0])) if "p" in top else None
  bad_t = not temperature >= 0
  if jit:  # traced parameters cannot raise: out of range values give NaN rows
    params = sd.SamplingParams(jnp.float32(temperature),
                               None if top_k is None else jnp.int32(top_k),
                               None if top_p is None else jnp.float32(top_p))
    probs = jax.jit(sd.process_logits)(jnp.asarray(logits), params)
    if bad_t:
      assert np.isnan(np.asarray(probs)).all(), (temperature, probs)
      return
  else:
    params = sd.SamplingParams(temperature, top_k, top_p)
    try:
      probs = sd.process_logits(logits, params)
    except Exception as err:
      assert bad_t, f"clean parameters raised {err!r}"
      check_host_error(err, "process_logits", ("params.temperature",))
      return
    assert not bad_t, f"temperature {temperature} accepted on the host"
  probs = np.asarray(probs)
  assert probs.shape == logits.shape and probs.dtype == np.float32
  for row, x in zip(probs, logits.astype(np.float32), strict=True):
    if logits_broken(x) or not (top_k or (top_p is not None and top_p < 1)):
      check_processed_row(row, x, temperature, tolerance(np.float32))
    else:
      assert not row_bad(row, tolerance(np.float32))[0], (row, x, temperature)
    if temperature in (0.7, 1.0) and not logits_broken(x) and np.all(np.abs(x) < 1e30):
      want = reference_process(x, temperature, top_k, top_p)
      np.testing.assert_allclose(row, want, atol=1e-5, err_msg=f"{top_k=} {top_p=}")


LOGITS_CASES = ((3, 3, F32), (257, 2, BF16))


def _run_verify_logits(case, seed, t_kind, d_kind, temperature, id_kind, u_kind, nd_kind,
                       with_key, top):
  vocab, gamma, dtype = case
  rng = np.random.default_rng(seed)
  target = logits_rows(rng, gamma + 1, vocab, t_kind).astype(dtype)
  draft_logits = logits_rows(rng, gamma, vocab, d_kind).astype(dtype)
  _, _, draft, uniforms, num_draft = chain_case(seed, vocab, gamma, F32, "clean", "clean",
                                                id_kind, u_kind, nd_kind)
  top_k, top_p = top
  params = sd.SamplingParams(jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p))
  bad_params = not (temperature >= 0 and top_k >= 0 and 0 < top_p <= 1)
  if with_key:
    key = jax.random.key(seed % 1000)
    res = sd.verify_logits(target, draft_logits, draft, params=params,
                                    num_draft=num_draft, pad_id=PAD, key=key)
    uniforms = np.asarray(jax.random.uniform(key, (gamma + 1,), jnp.float32))
  else:
    res = sd.verify_logits(target, draft_logits, draft, uniforms, params, num_draft=num_draft,
                           pad_id=PAD)
  # The processed rows (what the rule reads), with validity decided on the logits: a broken
  # logits row must make its processed row invalid, every other row is a valid distribution.
  clipped = sd.SamplingParams(jnp.float32(temperature if temperature >= 0 else 0.0),
                              jnp.int32(max(top_k, 0)),
                              jnp.float32(min(max(top_p, np.finfo(np.float32).tiny), 1.0)))
  process = jax.jit(sd.process_logits)
  p = np.array(process(jnp.asarray(target), clipped))
  q = np.array(process(jnp.asarray(draft_logits), clipped))
  for rows, logits in ((p, target), (q, draft_logits)):
    for i, x in enumerate(logits.astype(np.float32)):
      rows[i] = np.nan if logits_broken(x) else rows[i]
  want = chain_oracle(p, q, draft.tolist(), uniforms, num_draft, tolerance(np.float32))
  check_chain_result(res, want._replace(bad=want.bad or bad_params), p, q, draft.tolist(),
                     vocab)


@fuzz(30)
@given(case=st.sampled_from(LOGITS_CASES), seed=SEEDS, t_kind=st.sampled_from(LOGIT_KINDS),
       d_kind=st.sampled_from(LOGIT_KINDS), temperature=st.sampled_from(TEMPERATURES),
       id_kind=st.sampled_from(ID_KINDS), u_kind=st.sampled_from(U_KINDS),
       nd_kind=st.sampled_from(NUM_DRAFT_KINDS), with_key=st.booleans(),
       top=st.sampled_from([(0, 1.0), (2, 1.0), (0, 0.8), (-1, 1.0), (0, 0.0), (0, 1.5)]))
def test_verify_logits_garbage(case, seed, t_kind, d_kind, temperature, id_kind, u_kind,
                               nd_kind, with_key, top):
  _run_verify_logits(case, seed, t_kind, d_kind, temperature, id_kind, u_kind, nd_kind,
                     with_key, top)


@pytest.mark.parametrize("temperature", [0.0, 1e-30, 1.0, np.nan])
@pytest.mark.parametrize("t_kind", ["nan", "posinf", "all_neginf", "all_rows_nan"])
@fuzz(3)
@given(seed=SEEDS, with_key=st.booleans())
def test_verify_logits_broken_target_rows_at_every_temperature(temperature, t_kind, seed,
                                                               with_key):
  """A NaN, +inf or all -inf target row that is read never passes as valid, greedy included."""
  _run_verify_logits(LOGITS_CASES[0], seed, t_kind, "normal", temperature, "drawn", "clean",
                     "gamma", with_key, (0, 1.0))

