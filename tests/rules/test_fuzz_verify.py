"""Fuzzing ``verify``, ``block_verify``, their ``*_with_key`` forms and ``speculative_step``:
garbage in, a correct validity flag or a clear host error out; clean in, the float64
reference's tokens out (see :mod:`tests._fuzz_strategies`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import specdec_jax as sd
from specdec_jax import reference
from tests._fuzz_strategies import BF16
from tests._fuzz_strategies import CHAIN_ARGS
from tests._fuzz_strategies import CORRUPTIONS
from tests._fuzz_strategies import F32
from tests._fuzz_strategies import ID_KINDS
from tests._fuzz_strategies import NUM_DRAFT_KINDS
from tests._fuzz_strategies import PAD
from tests._fuzz_strategies import SEEDS
from tests._fuzz_strategies import U_KINDS
from tests._fuzz_strategies import VALID_CORRUPTIONS
from tests._fuzz_strategies import Expected
from tests._fuzz_strategies import as_input
from tests._fuzz_strategies import chain_case
from tests._fuzz_strategies import chain_oracle
from tests._fuzz_strategies import check_chain_result
from tests._fuzz_strategies import check_host_error
from tests._fuzz_strategies import clean_rows
from tests._fuzz_strategies import corrupt
from tests._fuzz_strategies import fuzz
from tests._fuzz_strategies import margin_uniform
from tests._fuzz_strategies import pick_interior
from tests._fuzz_strategies import row_bad
from tests._fuzz_strategies import single_fault
from tests._fuzz_strategies import tolerance
from tests._fuzz_strategies import uniform_bad
from tests._fuzz_strategies import value_bad
from tests._helpers import keyed

BLOCK = 256


# ---------------------------------------------------------------------------------------------
# The block oracle: what Algorithm 2's backward scan reads, and whether it was valid.


def _block_masses(w: np.ndarray, block: int) -> np.ndarray:
  full = len(w) // block
  parts = [w[: full * block].reshape(full, block).sum(-1)] if full else []
  if len(w) % block:
    parts.append(w[full * block :].sum(keepdims=True))
  return np.concatenate(parts)


def _log_block_weights(p_x, q_x) -> np.ndarray:
  out = [0.0]
  with np.errstate(all="ignore"):
    for px, qx in zip(p_x.astype(np.float64), q_x.astype(np.float64), strict=True):
      if np.isnan(px) or np.isnan(qx):
        r = np.nan
      elif px > 0:
        r = np.log(px) - np.log(qx) if qx > 0 else np.inf
      else:
        r = -np.inf
      prev = out[-1]
      if prev == -np.inf or r == -np.inf:
        out.append(-np.inf)
      else:
        out.append(np.nan if np.isnan(prev + r) else min(0.0, prev + r))
  return np.asarray(out)


def block_oracle(p, q, draft, uniforms, num_draft, tol) -> Expected:
  """Block verification's reads (Sun et al. 2025, Algorithm 2, as ``block_verify`` scans it)."""
  gamma, vocab = len(draft), p.shape[1]
  block = min(BLOCK, vocab)
  limit = min(max(num_draft, 0), gamma)
  bad = limit != num_draft
  in_range = np.array([0 <= x < vocab for x in draft], bool)
  safe = np.clip(np.asarray(draft, np.int64), 0, vocab - 1)
  p_x = p[np.arange(gamma), safe] if gamma else np.zeros(0, np.float32)
  q_x = q[np.arange(gamma), safe] if gamma else np.zeros(0, np.float32)
  for i in range(limit):
    bad |= (not in_range[i]) or value_bad(p_x[i], tol) or value_bad(q_x[i], tol)
  bad |= any(uniform_bad(u) for u in uniforms[: limit + 1])
  with np.errstate(all="ignore"):
    b = np.exp(_log_block_weights(np.where(in_range, p_x, 0), q_x))
  etas = np.concatenate([[0.0], uniforms[:gamma].astype(np.float64)])
  ambiguous = False

  def below(threshold, eta):  # eta < threshold, and whether float32 could decide otherwise
    nonlocal ambiguous
    if np.isfinite(threshold) and abs(eta - threshold) < 1e-4:
      ambiguous = True
    return bool(eta < threshold)

  keep_all = limit == 0 or below(b[limit], etas[limit])
  if keep_all:
    row_b, amb = row_bad(p[limit], tol)
    return Expected(limit, limit + 1, bool(bad | row_b), ambiguous | amb, limit, False)
  candidates = [i for i in range(limit) if i == 0 or below(b[i], etas[i])]
  for i in reversed(candidates):
    for row in (p[i], q[i]):
      row_b, amb = row_bad(row, tol)
      bad |= row_b
      ambiguous |= amb
    with np.errstate(all="ignore"):
      pr, qr = p[i].astype(np.float64), q[i].astype(np.float64)
      raw = np.where((pr < 0) | (qr < 0), -np.inf, np.maximum(b[i] * pr - qr, 0))
      masses = _block_masses(raw, block)
      z = float(np.sum(np.where(np.isfinite(masses) & (masses > 0), masses, 0)))
      den = z + (1 - b[i])
      h = z / den if den > 0 else 1.0
    if i == 0 or below(h, etas[i]):
      return Expected(i, limit + 1, bool(bad), ambiguous, i, True)
  raise AssertionError("unreachable: position 0 is always kept")  # pragma: no cover


# ---------------------------------------------------------------------------------------------
# Token-wise and block verification.

#: (V, gamma, dtype): every case compiles once per entry point.
CHAIN_CASES = ((1, 2, F32), (2, 3, BF16), (3, 3, F32), (257, 2, BF16), (4097, 1, F32),
               (262144, 1, F32))
BLOCK_CASES = ((1, 2, F32), (3, 3, F32), (257, 2, BF16), (262144, 1, F32))


def _run_chain(fn, oracle, case, seed, p_kind, q_kind, id_kind, u_kind, nd_kind, as_jax, focus):
  vocab, gamma, dtype = case
  p_kind, q_kind, id_kind, u_kind, nd_kind = single_fault(focus, p_kind, q_kind, id_kind,
                                                          u_kind, nd_kind)
  p, q, draft, uniforms, num_draft = chain_case(seed, vocab, gamma, dtype, p_kind, q_kind,
                                                id_kind, u_kind, nd_kind)
  res = fn(as_input(p, as_jax), as_input(q, as_jax), as_input(draft, as_jax),
           as_input(uniforms, as_jax), num_draft=num_draft, pad_id=PAD)
  p32, q32 = p.astype(np.float32), q.astype(np.float32)
  want = oracle(p32, q32, draft.tolist(), uniforms, num_draft, tolerance(dtype))
  check_chain_result(res, want, p32, q32, draft.tolist(), vocab)
  clean = (p_kind in VALID_CORRUPTIONS and q_kind in (*VALID_CORRUPTIONS, "equal_to_p")
           and id_kind == "drawn"
           and u_kind == "clean" and nd_kind in ("gamma", "random"))
  if clean:
    assert bool(res.valid), sd.describe_error(int(res.error))




@fuzz(60)
@given(case=st.sampled_from(CHAIN_CASES), **CHAIN_ARGS)
def test_verify_garbage(case, seed, p_kind, q_kind, id_kind, u_kind, nd_kind, as_jax, focus):
  _run_chain(sd.verify, chain_oracle, case, seed, p_kind, q_kind, id_kind, u_kind, nd_kind,
             as_jax, focus)


@fuzz(40)
@given(case=st.sampled_from(BLOCK_CASES), **CHAIN_ARGS)
def test_block_verify_garbage(case, seed, p_kind, q_kind, id_kind, u_kind, nd_kind, as_jax,
                              focus):
  _run_chain(sd.block_verify, block_oracle, case, seed, p_kind, q_kind, id_kind, u_kind,
             nd_kind, as_jax, focus)


def clean_chain(seed: int, vocab: int, gamma: int, rule: str):
  """Clean float32 ``(p, q, draft)``, a ``num_draft`` and uniforms away from every boundary of
  the float64 reference (computed on the same float32 values), with the reference's tokens."""
  rng = np.random.default_rng(seed)
  p = clean_rows(rng, gamma + 1, vocab).astype(np.float32)
  q_rows = clean_rows(rng, gamma, vocab)
  mode = rng.choice(["independent", "close", "equal"])
  if mode == "close":  # a draft close to the target: long accepted runs
    q_rows = 0.9 * p[:gamma].astype(np.float64) + 0.1 * q_rows
  elif mode == "equal":  # q = p: an id of probability 0 is rejected with an empty residual
    q_rows = p[:gamma].astype(np.float64)
  q = q_rows.astype(np.float32)
  draft = np.array([rng.choice(vocab, p=row / row.sum()) for row in q_rows], np.int32)
  if gamma and (mode == "equal" or rng.random() < 0.2):  # an id the draft gives probability 0
    i = int(rng.integers(0, gamma))
    zeros = np.nonzero(q[i] == 0)[0]
    draft[i] = int(rng.choice(zeros)) if zeros.size else int(rng.integers(0, vocab))
  n = int(rng.integers(0, gamma + 1)) if rng.random() < 0.3 else gamma
  p64, q64 = p[: n + 1].astype(np.float64), q[:n].astype(np.float64)
  if rule == "token":
    us, i = [], 0
    while i < n:
      ratio = reference.acceptance_probability(p64[i, draft[i]], q64[i, draft[i]])
      us.append(margin_uniform(rng, ratio))
      if not us[-1] < ratio:
        _, u = pick_interior(rng, reference.residual(p64[i], q64[i]))
        us.append(u)
        break
      i += 1
    else:
      us.append(pick_interior(rng, p64[n])[1])
  else:
    weights = reference._block_weights(p64, q64, draft[:n])
    stops, residuals = reference._block_stop_weights(p64, q64, weights)
    us = [margin_uniform(rng, stops[i]) for i in range(1, n + 1)]
    tau = max([0] + [i for i in range(1, n + 1) if us[i - 1] < stops[i]])
    us.append(pick_interior(rng, reference._block_final_row(p64, residuals, tau))[1])
  step = reference.speculative_step if rule == "token" else reference.block_speculative_step
  want = step(p64, q64, draft[:n], sd.UniformStream(us))
  uniforms = np.concatenate([np.asarray(us, np.float32),
                             rng.random(gamma + 1 - len(us)).astype(np.float32)])
  return p, q, draft, uniforms, n, want


@fuzz(40)
@given(rule_case=st.sampled_from([("token", c) for c in CHAIN_CASES]
                                 + [("block", c) for c in BLOCK_CASES]), seed=SEEDS)
def test_clean_chains_are_valid_and_exact(rule_case, seed):
  rule, (vocab, gamma, dtype) = rule_case
  p, q, draft, uniforms, n, want = clean_chain(seed, vocab, gamma, rule)
  fn = sd.verify if rule == "token" else sd.block_verify
  if dtype == BF16:  # bfloat16 rows are not normalised exactly: validity and ranges only
    res = fn(p.astype(BF16), q.astype(BF16), draft, uniforms, num_draft=n, pad_id=PAD)
    assert bool(res.valid), sd.describe_error(int(res.error))
    assert 0 <= int(res.tokens[int(res.num_accepted)]) < vocab
    return
  res = fn(p, q, draft, uniforms, num_draft=n, pad_id=PAD)
  assert bool(res.valid), sd.describe_error(int(res.error))
  got = np.asarray(res.tokens)[: int(res.num_tokens)].tolist()
  assert got == want, (got, want)
  assert np.all(np.asarray(res.tokens)[len(want) :] == PAD)


@fuzz(12)
@given(block=st.booleans(), seeds=st.lists(SEEDS, min_size=3, max_size=3),
       kinds=st.lists(st.tuples(*(st.sampled_from(k) for k in (
         CORRUPTIONS, CORRUPTIONS, ID_KINDS, U_KINDS, NUM_DRAFT_KINDS))), min_size=3,
                      max_size=3))
def test_vmap_agrees_with_single_calls(block, seeds, kinds):
  """Under vmap the stop row is read by a batching rule of its own (a loop over the batch on
  CPU): a batch of garbage gives, row for row, what single calls give."""
  vocab, gamma, dtype = 257, 2, BF16  # two blocks; the single calls' compilation is shared
  rows = [chain_case(seed, vocab, gamma, dtype, *kind) for seed, kind in zip(seeds, kinds,
                                                                              strict=True)]
  fn = sd.block_verify if block else sd.verify
  batch = jax.vmap(functools.partial(fn, pad_id=PAD))(
    *(jnp.asarray(np.stack([r[i] for r in rows])) for i in range(4)),
    num_draft=jnp.asarray([r[4] for r in rows], jnp.int32))
  for b, (p, q, draft, uniforms, num_draft) in enumerate(rows):
    one = fn(jnp.asarray(p), jnp.asarray(q), jnp.asarray(draft), jnp.asarray(uniforms),
             num_draft=num_draft, pad_id=PAD)
    for field in one._fields[:6]:  # the logprobs fields are None here
      np.testing.assert_array_equal(np.asarray(getattr(batch, field))[b],
                                    np.asarray(getattr(one, field)), err_msg=f"{field}, row {b}")


INT_DTYPES = (np.int8, np.uint8, np.int16, np.uint32, np.int64)


@fuzz(30)
@given(seed=SEEDS, dtype=st.sampled_from(INT_DTYPES), kind=st.sampled_from(
  ["in_range", "high", "negative", "dtype_max", "dtype_min", "wraps_into_range"]))
def test_draft_ids_of_every_integer_width(seed, dtype, kind):
  """Ids of any integer dtype: their true value decides, never a value wrapped by a cast."""
  rng = np.random.default_rng(seed)
  vocab, gamma = 3, 3
  p = clean_rows(rng, gamma + 1, vocab).astype(np.float32)
  q = clean_rows(rng, gamma, vocab).astype(np.float32)
  info = np.iinfo(dtype)
  ids = [int(i) for i in rng.integers(0, vocab, size=gamma)]
  where = int(rng.integers(0, gamma))
  value = {"in_range": ids[where], "high": min(vocab + 2, info.max), "negative": -1,
           "dtype_max": info.max, "dtype_min": info.min, "wraps_into_range": 2**32 + 1}[kind]
  if not info.min <= value <= info.max:
    value = ids[where]
  ids[where] = value
  draft = np.array(ids, dtype)
  uniforms = np.full(gamma + 1, 0.0, np.float32)  # accept every id with p > 0
  try:
    res = sd.verify(p, q, draft, uniforms, num_draft=gamma, pad_id=PAD)
  except Exception as err:
    assert not all(0 <= i < vocab for i in ids), f"clean input raised {err!r}"
    check_host_error(err, "verify", ("draft",))
    return
  want = chain_oracle(p, q, ids, uniforms, gamma, tolerance(np.float32))
  check_chain_result(res, want, p, q, ids, vocab)


# ---------------------------------------------------------------------------------------------
# The key= form.


@fuzz(30)
@given(block=st.booleans(), **CHAIN_ARGS)
def test_with_key_forms_garbage(block, seed, p_kind, q_kind, id_kind, u_kind, nd_kind, as_jax,
                                focus):
  p_kind, q_kind, id_kind, _, nd_kind = single_fault(focus, p_kind, q_kind, id_kind, u_kind,
                                                     nd_kind)  # the key draws the uniforms
  vocab, gamma, dtype = (257, 2, BF16) if block else (3, 3, F32)  # one compilation each
  p, q, draft, _, num_draft = chain_case(seed, vocab, gamma, dtype, p_kind, q_kind, id_kind,
                                         "clean", nd_kind)
  key = jax.random.key(seed % 1000)
  fn = keyed(sd.block_verify if block else sd.verify)
  res = fn(key, as_input(p, as_jax), as_input(q, as_jax), as_input(draft, as_jax),
           num_draft=num_draft, pad_id=PAD)
  uniforms = np.asarray(jax.random.uniform(key, (gamma + 1,), jnp.float32))  # documented draw
  p32, q32 = p.astype(np.float32), q.astype(np.float32)
  oracle = block_oracle if block else chain_oracle
  want = oracle(p32, q32, draft.tolist(), uniforms, num_draft, tolerance(dtype))
  check_chain_result(res, want, p32, q32, draft.tolist(), vocab)


HOST_MISTAKES = {
  "list_p": lambda p, q, d: (p.tolist(), q, d),
  "list_draft": lambda p, q, d: (p, q, d.tolist()),
  "scalar_draft": lambda p, q, _d: (p, q, np.int32(1)),
  "int_p": lambda p, q, d: ((p * 0).astype(np.int32), q, d),
  "ragged_q": lambda p, q, d: (p, [list(q[0]), list(q[1][:-1]), list(q[2])], d),
  "float128_p": lambda p, q, d: (p.astype(np.longdouble), q, d),
  "huge_id": lambda p, q, _d: (p, q, np.array([0, 2**33, 1], np.int64)),
}
_MISTAKE_ARG = {"list_p": "p", "list_draft": "draft", "scalar_draft": "draft", "int_p": "p",
                "ragged_q": "q", "float128_p": "p", "huge_id": "draft"}


@pytest.mark.parametrize("mistake", sorted(HOST_MISTAKES))
@pytest.mark.parametrize("fn_name", ["verify+key", "block_verify+key", "verify",
                                     "speculative_step", "verify_logits+key"])
def test_host_mistakes_give_clear_errors(fn_name, mistake):
  """Python lists work; anything JAX cannot hold raises a clear error (no raw JAX traceback)."""
  rng = np.random.default_rng(0)
  p = clean_rows(rng, 4, 3, zeros=False).astype(np.float32)
  q = clean_rows(rng, 3, 3, zeros=False).astype(np.float32)
  draft = np.array([0, 1, 2], np.int32)
  p_, q_, d_ = HOST_MISTAKES[mistake](p, q, draft)
  fn = getattr(sd, fn_name.removesuffix("+key"))
  arg = _MISTAKE_ARG[mistake]
  if fn_name == "verify_logits+key":
    arg = {"p": "target_logits", "q": "draft_logits"}.get(arg, arg)
  if fn_name.endswith("+key"):
    call = functools.partial(fn, p_, q_, d_, key=jax.random.key(0))
  elif fn_name == "verify":
    call = functools.partial(fn, p_, q_, d_, np.full(4, 0.5, np.float32))
  else:
    call = functools.partial(fn, p_, q_, d_, sd.UniformStream([0.5] * 4))
  try:
    out = call()
  except Exception as err:  # Python lists may be refused, but clearly
    check_host_error(err, fn_name.removesuffix("+key"), (f"`{arg}`",))
    return
  if mistake == "huge_id" and hasattr(out, "valid"):  # jitted: flagged instead of raised
    assert not bool(out.valid) and 2**33 % 2**32 not in np.asarray(out.tokens)[:1].tolist()
    return
  assert mistake in ("list_p", "list_draft"), f"{fn_name} accepted {mistake} silently: {out}"


@fuzz(30)
@given(seed=SEEDS, kind=st.sampled_from(("clean", "clean", "clean", "nan", "negative",
                                          "scaled_up", "id_high", "list", "float32")))
def test_speculative_step_is_the_reference_or_a_clear_error(seed, kind):
  """The stateful host API: the reference's tokens and draws on clean input, else a clear error
  (it can raise, so it never flags)."""
  rng = np.random.default_rng(seed)
  vocab, gamma = 3, 2
  p, q = clean_rows(rng, gamma + 1, vocab), clean_rows(rng, gamma, vocab)
  draft = np.array([rng.choice(vocab, p=row) for row in q])
  if kind in ("nan", "negative", "scaled_up"):
    p = corrupt(rng, p, kind)
  elif kind == "id_high":
    draft[rng.integers(0, gamma)] = vocab
  elif kind == "float32":
    p, q = p.astype(np.float32), q.astype(np.float32)
  args = (p.tolist(), q.tolist(), draft.tolist()) if kind == "list" else (p, q, draft)
  ours, theirs = np.random.default_rng(seed), np.random.default_rng(seed)
  try:
    got = sd.speculative_step(*args, ours)
  except Exception as err:
    assert kind in ("nan", "negative", "scaled_up", "id_high"), f"clean input raised {err!r}"
    check_host_error(err, "speculative_step", ("`p`", "`draft`"))
    assert ours.random() == theirs.random()  # nothing was drawn before the error
    return
  assert kind not in ("nan", "negative", "scaled_up", "id_high"), f"{kind} accepted: {got}"
  want = reference.speculative_step(np.asarray(p, np.float64), np.asarray(q, np.float64),
                                    draft, theirs)
  assert got == want
  assert ours.random() == theirs.random()  # the same number of draws

