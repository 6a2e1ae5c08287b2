"""Regression tests: no silent wrong output anywhere in the public API.

One test per defect an adversarial review found, grouped by defect below. Every one failed on
the code before the fix (a silently wrong token, a ``valid=True`` on garbage, a silent
truncation, or a raw exception that named neither the function nor the argument) and passes
after it. The command line's share is in ``tests/app/test_cli.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax import DraftTree
from specdec_jax import ErrorCode
from specdec_jax import PromptLookup
from specdec_jax import SamplingParams
from specdec_jax import block_verify
from specdec_jax import generate
from specdec_jax import process_logits
from specdec_jax import sample_draft
from specdec_jax import speculative_generate
from specdec_jax import speculative_step
from specdec_jax import tree_speculative_generate
from specdec_jax import tree_verify
from specdec_jax import verify
from specdec_jax import verify_logits
from specdec_jax.models import Model
from specdec_jax.models import llama
from specdec_jax.models.toy import make_toy_model
from tests._helpers import P_EXAMPLE
from tests._helpers import Q_EXAMPLE
from tests._helpers import U_EXAMPLE

V = 16
TARGET = make_toy_model(jax.random.key(0), V, name="target")
# LM-scale logits: |logit| ~ 20, as a real model's.
LOUD = make_toy_model(jax.random.key(3), V, scale=20.0, name="loud")
SMALL = make_toy_model(jax.random.key(1), V, context=1, name="small")
PROMPT = np.array([[1, 2, 3, 4], [5, 6, 0, 0]], np.int32)
LENGTHS = np.array([4, 2], np.int32)
GREEDY = SamplingParams(temperature=0.0)
TREE = DraftTree.from_branching((2, 1))


def _loops(target: Model = TARGET, draft: Model = SMALL):
  """The three decoding loops as ``fn(prompt, lengths, **kwargs)`` (same model, drafts)."""
  return {
    "generate": lambda *a, **k: generate(target, *a, **k),
    "speculative": lambda *a, **k: speculative_generate(target, draft, *a, gamma=3, **k),
    "lookup": lambda *a, **k: speculative_generate(target, PromptLookup(), *a, gamma=3, **k),
    "tree": lambda *a, **k: tree_speculative_generate(target, draft, *a, tree=TREE, **k),
  }


# --- tiny temperatures; GenerateResult.error ------------------------------------------------------


@pytest.mark.parametrize("temperature", [1e-3, 1e-6, 1e-9, 1e-12, 1e-30, 1e-45])
@pytest.mark.parametrize("shape", [(3,), (16,), (1000,), (4, 16), (64, 1000)])
def test_any_positive_temperature_gives_a_valid_distribution_under_jit(temperature, shape):
  # Before the fix, XLA:CPU returned NaN for |logit| / T around 1e9 and more, for some shapes.
  logits = 20 * jax.random.normal(jax.random.key(0), shape)
  for fn in (process_logits, jax.jit(process_logits)):
    probs = np.asarray(fn(logits, SamplingParams(temperature)))
    assert np.isfinite(probs).all()
    np.testing.assert_allclose(probs.sum(axis=-1), 1, rtol=1e-5)
    if temperature <= 1e-6:  # the limit T -> 0 is greedy (no ties in random logits)
      np.testing.assert_array_equal(probs.argmax(axis=-1), np.asarray(logits).argmax(axis=-1))
      assert (probs.max(axis=-1) > 0.999).all()


def test_huge_and_infinite_temperatures_give_valid_distributions():
  logits = jnp.array([[3.0, 1.0, -jnp.inf, 2.0]])
  for temperature in (1e30, jnp.inf):
    probs = np.asarray(jax.jit(process_logits)(logits, SamplingParams(temperature)))
    np.testing.assert_allclose(probs, [[1 / 3, 1 / 3, 0, 1 / 3]], rtol=1e-6)


def test_generate_at_a_tiny_temperature_is_greedy_on_lm_scale_logits():
  key = jax.random.key(1)
  greedy = generate(LOUD, PROMPT, LENGTHS, key, max_new_tokens=8, params=GREEDY)
  for temperature in (1e-9, 1e-30):
    out = generate(LOUD, PROMPT, LENGTHS, key, max_new_tokens=8,
                   params=SamplingParams(temperature))
    np.testing.assert_array_equal(out.tokens, greedy.tokens)
    np.testing.assert_array_equal(out.error, 0)


def _nan_after(model: Model, token: int) -> Model:
  """``model`` whose logits are NaN after ``token`` (a broken model)."""

  def apply(params, tokens, positions, cache):
    logits, cache = model.apply(params, tokens, positions, cache)
    return jnp.where((tokens == token)[..., None], jnp.nan, logits), cache

  def tree_apply(params, tokens, positions, cache, start, nodes, mask):
    logits, cache = model.tree_apply(params, tokens, positions, cache, start, nodes, mask)
    return jnp.where((tokens == token)[..., None], jnp.nan, logits), cache

  return model._replace(apply=apply, tree_apply=tree_apply, name="broken")


@pytest.mark.parametrize("name", ["generate", "speculative", "lookup", "tree"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_nan_logits_are_reported_by_every_loop(name, temperature):
  broken = _nan_after(TARGET, 3)  # row 0's prompt ends with 4 after a 3: its prefill is fine
  prompt = np.array([[1, 2, 4, 3], [5, 6, 0, 0]], np.int32)  # row 0 ends in 3: NaN at once
  out = _loops(broken)[name](prompt, LENGTHS, jax.random.key(0), max_new_tokens=6,
                             params=SamplingParams(temperature))
  assert int(out.error[0]) & ErrorCode.NONFINITE
  assert ((np.asarray(out.tokens) >= -1) & (np.asarray(out.tokens) < V)).all()
  clean = _loops()[name](prompt, LENGTHS, jax.random.key(0), max_new_tokens=6,
                         params=SamplingParams(temperature))
  np.testing.assert_array_equal(clean.error, 0)


def _nan_from(model: Model, position: int) -> Model:
  """``model`` whose logits are NaN at every position from ``position`` on."""

  def apply(params, tokens, positions, cache):
    logits, cache = model.apply(params, tokens, positions, cache)
    return jnp.where((positions >= position)[..., None], jnp.nan, logits), cache

  def tree_apply(params, tokens, positions, cache, start, nodes, mask):
    logits, cache = model.tree_apply(params, tokens, positions, cache, start, nodes, mask)
    return jnp.where((positions >= position)[..., None], jnp.nan, logits), cache

  return model._replace(apply=apply, tree_apply=tree_apply, name="broken later")


@pytest.mark.parametrize("name", ["speculative", "tree"])
@pytest.mark.parametrize("params", [SamplingParams(0.0), SamplingParams(0.8, top_k=5, top_p=0.9)],
                         ids=["greedy", "top-k-top-p"])
def test_nan_logits_in_a_verification_step_are_reported(name, params):
  """The prefill is fine, the target's rows turn NaN in the first verification call: the
  verifier reports them, on processed rows (greedy) and on lazily read ones (top-k, top-p)."""
  out = _loops(_nan_from(TARGET, 5))[name](PROMPT, LENGTHS, jax.random.key(0),
                                           max_new_tokens=6, params=params)
  assert int(out.error[0]) & ErrorCode.NONFINITE, int(out.error[0])
  assert ((np.asarray(out.tokens) >= -1) & (np.asarray(out.tokens) < V)).all()


# --- greedy rows are checked like sampled ones ----------------------------------------------------


@pytest.mark.parametrize("bad", [np.nan, -np.inf, np.inf])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_verify_logits_flags_broken_target_rows_at_every_temperature(bad, temperature):
  target = np.zeros((2, 4), np.float32)
  target[0] = bad if bad != np.inf else [0, bad, 0, 0]
  if bad == np.nan:
    target[0, 2] = 1.0  # one NaN among finite logits is as broken
  result = verify_logits(target, np.zeros((1, 4), np.float32), np.array([1]),
                         np.array([0.5, 0.5], np.float32), SamplingParams(temperature))
  assert not bool(result.valid)
  assert int(result.error) & ErrorCode.NONFINITE
  assert 0 <= int(result.tokens[0]) < 4
  # process_logits: NaN at every temperature for such a row, never a plausible one-hot.
  assert np.isnan(np.asarray(process_logits(target[0], SamplingParams(temperature)))).all()


def test_masked_but_finite_rows_stay_valid_when_greedy():
  target = np.array([[-np.inf, 2.0, -np.inf, 1.0], [0.0, 0.0, 0.0, 5.0]], np.float32)
  result = verify_logits(target, np.zeros((1, 4), np.float32), np.array([1]),
                         np.array([0.5, 0.5], np.float32), GREEDY)
  assert bool(result.valid) and result.tokens.tolist() == [1, 3]


# --- prompt ids outside [0, V) --------------------------------------------------------------------


def _tiny_llama() -> Model:
  config = llama.LlamaConfig(vocab_size=V, dim=16, n_layers=2, n_heads=2, n_kv_heads=1,
                             head_dim=8, ffn_dim=32, max_position=24)
  return llama.make_model(llama.init_params(jax.random.key(0), config), config)


@pytest.mark.parametrize("model", ["toy", "llama"])
@pytest.mark.parametrize("name", ["generate", "speculative", "lookup", "tree"])
@pytest.mark.parametrize("bad_id", [99, -5, V])
def test_prompt_ids_out_of_range_raise_when_concrete(model, name, bad_id):
  target = TARGET if model == "toy" else _tiny_llama()
  prompt = PROMPT.copy()
  prompt[1, 1] = bad_id
  fn = _loops(target, target)[name]
  with pytest.raises(ValueError, match=rf"`prompt_tokens` ids must be in \[0, V\) = \[0, {V}\) "
                     rf"within each row's length, got {bad_id} at \(row 1, position 1\)"):
    fn(prompt, LENGTHS, jax.random.key(0), max_new_tokens=4)
  prompt[1, 3] = 99  # beyond row 1's length: padding, not read
  prompt[1, 1] = 1
  fn(prompt, LENGTHS, jax.random.key(0), max_new_tokens=4)


@functools.cache
def _traced_prompts(name: str):
  """Loop ``name`` jitted with the prompt and lengths traced (one program for the tests that
  trace them)."""
  fn = _loops()[name]
  return jax.jit(lambda prompt, lengths: fn(prompt, lengths, jax.random.key(0), max_new_tokens=3))


@pytest.mark.parametrize("name", ["generate", "speculative", "lookup", "tree"])
def test_prompt_ids_out_of_range_are_flagged_when_traced(name):
  prompt = PROMPT.copy()
  prompt[0, 2] = -5
  out = _traced_prompts(name)(prompt, LENGTHS)
  assert int(out.error[0]) & ErrorCode.TOKEN_OUT_OF_RANGE
  assert int(out.error[1]) == 0
  tokens = np.asarray(out.tokens)
  assert ((tokens[:, 4:] >= -1) & (tokens[:, 4:] < V)).all()


@pytest.mark.parametrize("name", ["generate", "speculative", "tree"])
def test_a_model_whose_logits_are_wider_than_its_vocabulary_is_named(name):
  """A model whose logits have more columns than its ``vocab_size`` would emit ids the model
  says do not exist (``generate`` emitted 5 and 6 with V = 4, error 0); the loops name it."""
  narrow = TARGET._replace(vocab_size=V // 2)  # its logits still have V columns
  prompt = PROMPT % (V // 2)
  if name == "generate":
    fn, arg = _loops(narrow)[name], "model"
  else:  # a consistent narrow target, the narrow draft
    target = TARGET._replace(vocab_size=V // 2, apply=_cut_logits(TARGET.apply, V // 2),
                             tree_apply=_cut_logits(TARGET.tree_apply, V // 2))
    fn, arg = _loops(target, narrow)[name], "draft"
  with pytest.raises(ValueError, match=rf"`{arg}` returned logits of shape \(2, 4, {V}\) for "
                     rf"ids of shape \(2, 4\); expected \(B, T, vocab_size\) = \(2, 4, {V // 2}\)"):
    fn(prompt, LENGTHS, jax.random.key(0), max_new_tokens=2)


def _cut_logits(apply, width):
  """``apply`` with its logits cut to the first ``width`` columns (a consistent narrow model)."""
  def cut(*args):
    logits, *rest = apply(*args)
    return (logits[..., :width], *rest)
  return cut


# --- budgets that do not fit the buffer or the model's context ------------------------------------


@pytest.mark.parametrize("name", ["generate", "speculative", "lookup", "tree"])
def test_a_budget_that_does_not_fit_raises_or_is_flagged(name):
  fn = _loops()[name]
  with pytest.raises(ValueError, match=r"`max_len` = 6 has no room for the longest prompt plus "
                     r"`max_new_tokens` = 9 tokens; pass max_len >= 9"):
    fn(PROMPT, LENGTHS, jax.random.key(0), max_new_tokens=5, max_len=6)
  out = jax.jit(lambda lengths: fn(PROMPT, lengths, jax.random.key(0), max_new_tokens=5,
                                   max_len=6))(LENGTHS)
  np.testing.assert_array_equal(out.lengths, [6, 6])
  np.testing.assert_array_equal(out.error, [ErrorCode.OUT_OF_ROOM, ErrorCode.OUT_OF_ROOM])
  fits = fn(PROMPT, LENGTHS, jax.random.key(0), max_new_tokens=2, max_len=6)
  np.testing.assert_array_equal(fits.error, 0)


def test_the_model_context_bounds_every_loop():
  target = _tiny_llama()  # context_length 24
  for name, fn in _loops(target, target).items():
    with pytest.raises(ValueError, match=r"is 24 tokens, more than the 24|is 25 tokens, more "
                       r"than the 24 positions the `(model|target)` model was trained for"):
      fn(PROMPT, LENGTHS, jax.random.key(0), max_new_tokens=21)
    out = jax.jit(lambda lengths, fn=fn: fn(PROMPT, lengths, jax.random.key(0),
                                            max_new_tokens=21))(LENGTHS)
    assert int(out.lengths[0]) == 24 and int(out.error[0]) == ErrorCode.OUT_OF_ROOM, name
    assert int(out.lengths[1]) == 23 and int(out.error[1]) == 0, name


# --- ids that int32 cannot hold -------------------------------------------------------------------


@pytest.mark.parametrize("wide", [2**31, 2**32 + 1, -(2**31) - 1])
def test_wide_host_ids_are_refused_before_the_int32_cast(wide):
  p = np.full((2, 4), 0.25, np.float32)
  q = np.full((1, 4), 0.25, np.float32)
  u = np.full(2, 0.5, np.float32)
  for draft in (np.array([wide], np.int64), [wide]):
    with pytest.raises(ValueError, match=rf"verify: `draft` must hold values that fit in int32 "
                       rf"\(ids and counts are int32\), got {wide} at index \(0,\)"):
      verify(p, q, draft, u)
  with pytest.raises(ValueError, match=r"block_verify: `draft` must hold values"):
    block_verify(p, q, np.array([wide], np.int64), key=jax.random.key(0))
  if wide > 0:
    with pytest.raises(ValueError, match=r"`draft` must hold values that fit in int32"):
      verify(p, q, np.array([wide], np.uint64), u)
  # A wide id that does fit is checked under jit as before: rejected and flagged.
  result = verify(p, q, np.array([2**31 - 1], np.int64), u)
  assert int(result.error) == ErrorCode.DRAFT_OUT_OF_RANGE and int(result.num_accepted) == 0


def test_unsigned_device_ids_do_not_wrap_into_range():
  p = jnp.full((2, 4), 0.25)
  q = jnp.full((1, 4), 0.25)
  result = verify(p, q, jnp.array([2**31 + 1], jnp.uint32), jnp.full(2, 0.5))
  assert int(result.error) == ErrorCode.DRAFT_OUT_OF_RANGE and int(result.num_accepted) == 0


# --- clear errors from every entry point ----------------------------------------------------------


def test_speculative_step_ragged_and_float128():
  rng = np.random.default_rng(0)
  with pytest.raises(ValueError, match=r"speculative_step: `q` must be a rectangular array of "
                     r"probabilities \(rows of equal length\), got a ragged list"):
    speculative_step(P_EXAMPLE, [[0.5, 0.5], [0.2, 0.2, 0.6]], [1, 2], rng)
  with pytest.raises(ValueError, match=r"speculative_step: `draft` must be a 1-D array of token "
                     r"ids, got a ragged list"):
    speculative_step(P_EXAMPLE, Q_EXAMPLE, [[1], [2, 3]], rng)
  with pytest.raises(TypeError, match=r"speculative_step: `p` has dtype float128, which JAX does "
                     r"not support"):
    speculative_step(P_EXAMPLE.astype(np.longdouble), Q_EXAMPLE, [1, 2], rng)


@pytest.mark.parametrize(("call", "error", "match"), [
  (lambda: verify(P_EXAMPLE, Q_EXAMPLE, np.array(1), key=jax.random.key(0)), ValueError,
   r"verify: `draft` must have rank 1, got shape \(\) \(rank 0\)"),
  (lambda: block_verify(P_EXAMPLE, Q_EXAMPLE, 1, key=jax.random.key(0)), ValueError,
   r"block_verify: `draft` must have rank 1"),
  (lambda: verify_logits(np.zeros((3, 3), int), np.zeros((2, 3)),
                                  [1, 2], key=jax.random.key(0)), TypeError,
   r"verify_logits: `target_logits` must have a floating dtype, got int64"),
  (lambda: verify_logits(jnp.zeros((3, 3), int), jnp.zeros((2, 3)),
                                  jnp.array([1, 2]), key=jax.random.key(0)), TypeError,
   r"verify_logits: `target_logits` must have a floating dtype, got int32"),
  (lambda: verify(P_EXAMPLE, Q_EXAMPLE, [1, 2], key=5), TypeError,
   r"verify: `key` must be a jax.random key \(jax.random.key\(seed\)\), got int 5"),
  (lambda: verify(P_EXAMPLE, Q_EXAMPLE,
                           [1, 2], key=jax.random.split(jax.random.key(0), 2)), TypeError,
   r"verify: `key` must be one jax.random key .* shape \(2,\)"),
  (lambda: tree_verify(P_EXAMPLE, P_EXAMPLE, [-1, 0], [0, 1], key=jax.random.key(0)),
   ValueError, r"tree_verify: `parents` must have shape \(3,\)"),
  (lambda: verify(P_EXAMPLE, [[0.5, 0.5], [0.2, 0.2, 0.6]], [1, 2], U_EXAMPLE), ValueError,
   r"verify: `q` must be a rectangular array \(nested sequences of equal lengths\), got a ragged "
   r"list"),
  (lambda: verify(P_EXAMPLE.astype(np.longdouble), Q_EXAMPLE, [1, 2], U_EXAMPLE), TypeError,
   r"verify: `p` has dtype float128, which JAX does not support"),
  (lambda: verify(P_EXAMPLE, Q_EXAMPLE, ["a", "b"], U_EXAMPLE), TypeError,
   r"verify: `draft` must be a numeric array, got dtype <U1"),
  (lambda: verify(P_EXAMPLE, Q_EXAMPLE, [1, 2], U_EXAMPLE + 0j), TypeError,
   r"verify: `uniforms` must hold real numbers, got dtype complex128"),
  (lambda: process_logits([[0.0, 1.0], [2.0]]), ValueError,
   r"process_logits: `logits` must be a rectangular array"),
])
def test_with_key_and_host_values_get_clear_errors(call, error, match):
  with pytest.raises(error, match=match):
    call()


def test_python_lists_work_everywhere():
  key = jax.random.key(0)
  p, q, d = P_EXAMPLE.tolist(), Q_EXAMPLE.tolist(), [1, 2]
  for result in (verify(p, q, d, key=key), block_verify(p, q, d, key=key),
                 verify_logits(np.log(P_EXAMPLE).tolist(),
                                        np.log(Q_EXAMPLE).tolist(), d, key=key)):
    assert bool(result.valid) and 1 <= int(result.num_tokens) <= 3
  assert verify(p, q, d, U_EXAMPLE.tolist()).tokens.tolist() == [1, 2, 0]


# --- documented behaviour of parameters and eos ---------------------------------------------------


def test_concrete_bad_params_flag_in_jitted_verifiers_and_raise_in_host_functions():
  target, drafts = np.zeros((2, 4), np.float32), np.zeros((1, 4), np.float32)
  result = verify_logits(target, drafts, [1], [0.5, 0.5], SamplingParams(temperature=-1.0))
  assert int(result.error) == ErrorCode.BAD_PARAMS and 0 <= int(result.tokens[0]) < 4
  with pytest.raises(ValueError, match=r"process_logits: `params.temperature` must be >= 0"):
    process_logits(target, SamplingParams(temperature=-1.0))
  with pytest.raises(ValueError, match=r"generate: `params.top_p` must be in \(0, 1\], got "
                     r"\[0.5, 1.5\]"):
    generate(TARGET, PROMPT, LENGTHS, jax.random.key(0), max_new_tokens=2,
             params=SamplingParams(1.0, top_p=np.array([0.5, 1.5])))
  assert "the jitted verifiers" in SamplingParams.__doc__


@pytest.mark.parametrize("name", ["generate", "speculative", "lookup", "tree"])
def test_eos_outside_the_vocabulary_raises_or_is_flagged(name):
  fn = _loops()[name]
  with pytest.raises(ValueError, match=rf"`eos_id` must be a token id in \[0, V\) = \[0, {V}\) "
                     rf"or None, got {V}"):
    fn(PROMPT, LENGTHS, jax.random.key(0), max_new_tokens=3, eos_id=V)
  run = jax.jit(lambda eos: fn(PROMPT, LENGTHS, jax.random.key(0), max_new_tokens=3,
                               eos_id=eos))
  # -1 is the loops' own "no eos"; a traced -1 or -2 from the caller is out of range too.
  for eos in (V, -1, -2, 2**31 - 1):  # all int32 arrays: one compiled program
    out = run(np.int32(eos))
    np.testing.assert_array_equal(out.error, [ErrorCode.BAD_PARAMS] * 2, err_msg=str(eos))
    np.testing.assert_array_equal(out.num_new, [3, 3])
  np.testing.assert_array_equal(run(np.int32(1)).error, 0)


@pytest.mark.parametrize("name", ["generate", "speculative", "lookup", "tree"])
def test_traced_prompt_lengths_outside_one_to_p_are_flagged_and_generate_nothing(name):
  run = functools.partial(_traced_prompts(name), PROMPT)
  good = run(LENGTHS)
  np.testing.assert_array_equal(good.error, 0)
  width = PROMPT.shape[1]
  for bad, clipped in ((0, 1), (-2, 1), (width + 5, width)):
    out = run(np.array([bad, 2], np.int32))
    assert int(out.error[0]) == ErrorCode.BAD_LENGTH, (bad, int(out.error[0]))
    assert int(out.num_new[0]) == 0 and int(out.lengths[0]) == clipped, bad
    np.testing.assert_array_equal(out.tokens[0, :clipped], PROMPT[0, :clipped])
    assert int(out.error[1]) == 0 and int(out.num_new[1]) == 3
    np.testing.assert_array_equal(out.tokens[1], good.tokens[1])  # the other row is untouched


def test_traced_bad_params_give_nan_rows_not_a_plausible_distribution():
  """Under jit, out-of-range parameters cannot raise: process_logits and sample_draft return NaN
  rows (never, e.g., greedy for a negative temperature), and verify_logits flags BAD_PARAMS."""
  logits = jnp.array([1.0, 2.0, 0.5, -1.0])
  process = jax.jit(lambda t, k, p: process_logits(logits, SamplingParams(t, top_k=k, top_p=p)))
  draw = jax.jit(lambda t: sample_draft(jax.random.key(0), logits, SamplingParams(t)).probs)
  for t, k, p in ((-1.0, 2, 0.9), (jnp.nan, 2, 0.9), (0.7, -3, 0.9), (0.7, 2, 1.5),
                  (0.7, 2, 0.0)):
    assert np.isnan(np.asarray(process(t, k, p))).all(), (t, k, p)
  assert np.isnan(np.asarray(draw(-1.0))).all()
  good = np.asarray(process(0.7, 2, 0.9))
  assert np.isfinite(good).all() and abs(good.sum() - 1) < 1e-6
  np.testing.assert_array_equal(np.asarray(process(0.0, 2, 0.9)), [0, 1, 0, 0])
  result = jax.jit(lambda t: verify_logits(jnp.stack([logits] * 2), logits[None], jnp.array([1]),
                                           jnp.array([0.5, 0.5]), SamplingParams(t)))(-1.0)
  assert int(result.error) == ErrorCode.BAD_PARAMS and 0 <= int(result.tokens[0]) < 4


# --- static arguments and host values that JAX would silently change (issue round two) ----------

_P4 = np.full((2, 4), 0.25, np.float32)
_Q4 = np.full((1, 4), 0.25, np.float32)
_U2 = np.array([[0.5, 0.5]], np.float32)


def _packed(**kwargs):
  from specdec_jax import packed_verify
  args = dict(max_spec_len=1, target_probs=_P4, uniforms=_U2)
  return packed_verify(np.array([1]), np.array([1]), **{**args, **kwargs})


@pytest.mark.parametrize(("call", "error", "match"), [
  (lambda: verify(_P4, _Q4, [1], _U2[0], pad_id=2.7), ValueError,
   r"verify: `pad_id` must be a static int in int32 range \(the token slots are int32\), got 2.7"),
  (lambda: verify(_P4, _Q4, [1], pad_id="x", key=jax.random.key(0)), ValueError,
   r"verify: `pad_id` must be a static int in int32 range .* got 'x'"),
  (lambda: _packed(pad_id=2.7), ValueError, r"packed_verify: `pad_id` must be a static int"),
  (lambda: _packed(convention="vLLM"), ValueError,
   r"packed_verify: `convention` must be one of \('specdec', 'vllm', 'tpu_inference', "
   r"'sglang'\), got 'vLLM' instead"),
  (lambda: _packed(bonus_rows="no"), ValueError,
   r"packed_verify: `bonus_rows` must be a static bool, got 'no'"),
  (lambda: generate(TARGET, PROMPT, LENGTHS, jax.random.key(0), max_new_tokens=2, pad_id=2.7),
   ValueError, r"generate: `pad_id` must be a static int"),
  (lambda: speculative_generate(TARGET, SMALL, PROMPT, LENGTHS, jax.random.key(0), gamma=2,
                                max_new_tokens=2, adaptive=_policy(prior_accepted=float("inf"))),
   ValueError, r"speculative_generate: `adaptive.prior_accepted` must be finite and at most "
   r"1e\+30 in magnitude \(the estimate runs in float32\), got inf"),
  (lambda: speculative_generate(TARGET, SMALL, PROMPT, LENGTHS, jax.random.key(0), gamma=2,
                                max_new_tokens=2, adaptive=_policy(prior_rejected=1e300)),
   ValueError, r"`adaptive.prior_rejected` must be finite and at most 1e\+30"),
  (lambda: speculative_generate(TARGET, SMALL, PROMPT, LENGTHS, jax.random.key(0), gamma=2,
                                max_new_tokens=2, adaptive=_policy(draft_cost="x")),
   TypeError, r"speculative_generate: `adaptive.draft_cost` must be a real number, got 'x'"),
  (lambda: speculative_generate(TARGET, SMALL, PROMPT, LENGTHS, jax.random.key(0), gamma=2,
                                max_new_tokens=2, adaptive=_policy(decay=None)),
   TypeError, r"`adaptive.decay` must be a real number, got None"),
])
def test_static_arguments_are_checked_not_coerced(call, error, match):
  with pytest.raises(error, match=match):
    call()


def _policy(**kwargs):
  from specdec_jax.decoding import AdaptiveSpeculation
  return AdaptiveSpeculation(**kwargs)


@pytest.mark.parametrize("top_k", [2**40, np.int64(2**32 + 1), np.uint64(2**32 + 1)])
def test_a_top_k_beyond_int32_keeps_every_token(top_k):
  """A Python ``2**40`` raised a bare OverflowError and a NumPy int64 ``2**32 + 1`` wrapped to
  1 (one token kept instead of all); every ``top_k >= V`` keeps the whole row."""
  logits = np.array([3.0, 2.0, 1.0, 0.0], np.float32)
  want = np.asarray(process_logits(logits, SamplingParams(1.0)))
  params = SamplingParams(1.0, top_k=top_k)
  np.testing.assert_allclose(process_logits(logits, params), want, rtol=1e-6)
  rows = np.stack([logits, logits])
  u = np.array([0.0, 0.999], np.float32)  # accept the draft, then the last token of the row
  result = verify_logits(rows, rows[:1], np.array([1]), u, params)
  assert result.tokens.tolist() == [1, 3] and int(result.error) == 0
  packed = _packed(target_probs=None, target_logits=rows, params=params, uniforms=u[None])
  assert packed.tokens.tolist() == [[1, 3]] and int(packed.error[0]) == 0
  # The loops' parameters (what generate & co. pass into their jitted loop): every top-k kept.
  from specdec_jax.decoding.args import batch_params
  assert np.asarray(batch_params(params, 2, "generate").top_k).tolist() == [2**31 - 1] * 2


def test_an_empty_batch_gives_an_empty_result():
  """B = 0 (no requests) raised NumPy's "zero-size array to reduction"; now every loop returns
  empty arrays of the usual shapes."""
  prompt, lengths = np.zeros((0, 4), np.int32), np.zeros((0,), np.int32)
  for name, fn in _loops().items():
    out = fn(prompt, lengths, jax.random.key(0), max_new_tokens=3)
    assert out.tokens.shape == (0, 7) and out.num_new.shape == (0,), name
    assert out.error.shape == (0,) and out.stats.row_target_calls.shape == (0,), name


def test_the_vocab_parallel_entry_points_refuse_ids_int32_cannot_hold():
  """(Issue 23, item 5: they skipped the host conversion, so 2**32 + 1 wrapped to 1.)"""
  from specdec_jax import vocab_parallel_packed_verify
  from specdec_jax import vocab_parallel_verify
  mesh = jax.make_mesh((1,), ("model",))
  rows = np.eye(4, dtype=np.float32)
  wide = np.array([1, 2**32 + 1], np.int64)
  with pytest.raises(ValueError, match=r"vocab_parallel_packed_verify: `draft_token_ids` must "
                     r"hold values that fit in int32 .* got 4294967297"):
    vocab_parallel_packed_verify(mesh, "model", max_spec_len=2)(
      wide, np.array([2]), target_probs=rows[:3], uniforms=np.zeros((1, 3), np.float32))
  with pytest.raises(ValueError, match=r"vocab_parallel_packed_verify: `num_draft_tokens` must "
                     r"hold values that fit in int32"):
    vocab_parallel_packed_verify(mesh, "model", max_spec_len=2)(
      np.array([1, 2]), np.array([2**32 + 1], np.int64), target_probs=rows[:3],
      uniforms=np.zeros((1, 3), np.float32))
  with pytest.raises(ValueError, match=r"vocab_parallel_verify: `draft` must hold values that "
                     r"fit in int32"):
    vocab_parallel_verify(mesh, "model")(rows[None, :3], rows[None, :2], wide[None],
                                         np.zeros((1, 3), np.float32))


@pytest.mark.parametrize("unread", [1.0, np.nan])
def test_an_unread_final_uniform_is_not_checked(unread):
  """(Issue 23, item 25.) With a caller bonus token and every draft accepted, the last uniform
  slot is never read: whatever it holds, the request is valid."""
  from specdec_jax import packed_verify
  rows = np.eye(4, dtype=np.float32)[[1, 2]]  # p = q = a point mass on each draft: accepted
  result = packed_verify(np.array([1, 2]), np.array([2]), max_spec_len=2, target_probs=rows,
                         draft_probs=rows, bonus_token_ids=np.array([3]), bonus_rows=False,
                         uniforms=np.array([[0.5, 0.5, unread]], np.float32))
  assert result.tokens.tolist() == [[1, 2, 3]] and int(result.error[0]) == 0
