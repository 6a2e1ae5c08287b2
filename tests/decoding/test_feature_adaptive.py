"""Feature drafts (EAGLE), adaptive speculation and streamed output of the chain loop.

The toy trigram target exposes features ``concat(one_hot(x[t - 1]), one_hot(x[t]))``; the toy
feature draft reads ``x[t - 1]`` off the feature it is handed, so without noise it *is* the
target exactly when the loop hands it the right features (every proposal accepted), and with
noise or a reduced vocabulary it is an imperfect draft with ragged acceptance.

Chi-square tests: fixed seeds, family-wise ``ALPHA = 0.01`` over the exactness tests of this
module (Bonferroni over ``NUM_EXACT_TESTS``); each negative control must be rejected at 1e-6.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax import SamplingParams
from specdec_jax import verify
from specdec_jax.decoding import AdaptiveSpeculation
from specdec_jax.decoding import PromptLookup
from specdec_jax.decoding import generate
from specdec_jax.decoding import speculative_generate
from specdec_jax.decoding.adaptive import acceptance
from specdec_jax.decoding.adaptive import choose_num_draft
from specdec_jax.decoding.adaptive import policy_efficiency
from specdec_jax.decoding.adaptive import update_counts
from specdec_jax.decoding.drafts import FeatureFns
from specdec_jax.decoding.drafts import feature_sync
from specdec_jax.decoding.drafts import next_features
from specdec_jax.decoding.drafts import propose_features
from specdec_jax.decoding.drafts import propose_features_when
from specdec_jax.models import eagle
from specdec_jax.models import llama
from specdec_jax.models.toy import make_toy_feature_draft
from specdec_jax.models.toy import make_toy_model
from tests._helpers import TOY_PROMPT_LENGTHS
from tests._helpers import TOY_PROMPTS
from tests.decoding import _exact as exact

ALPHA = 0.01
NUM_EXACT_TESTS = 3
GREEDY = SamplingParams(temperature=0.0)
V = 16
TARGET = make_toy_model(jax.random.key(0), V, name="target")
PERFECT = make_toy_feature_draft(TARGET)
NOISY = make_toy_feature_draft(TARGET, noise=1.5, key=jax.random.key(3),
                               vocab_ids=np.arange(12))
POLICY = AdaptiveSpeculation(draft_cost=0.05, verify_cost=0.04, fixed_cost=0.1)
PROMPTS, PROMPT_LENGTHS = TOY_PROMPTS[:5], TOY_PROMPT_LENGTHS[:5]
MAX_NEW = 12


@functools.cache
def _plain(temperature: float = 0.0, seed: int = 0):
  return generate(TARGET, PROMPTS, PROMPT_LENGTHS, jax.random.key(seed), max_new_tokens=MAX_NEW,
                  params=SamplingParams(temperature))


def _run(draft, *, adaptive=None, verifier="token", gamma=3, temperature=0.0, seed=0, **kw):
  return speculative_generate(TARGET, draft, PROMPTS, PROMPT_LENGTHS, jax.random.key(seed),
                              gamma=gamma, max_new_tokens=MAX_NEW,
                              params=SamplingParams(temperature), verifier=verifier,
                              adaptive=adaptive, **kw)


# ---------------------------------------------------------------------------------------------
# Feature drafts.


def test_features_reach_the_draft_at_the_right_positions():
  """propose_features feeds position ``t`` the feature of ``t - 1`` and runs ahead on its own."""
  gamma, vocab = 3, 32

  def apply(_params, _tokens, features, positions, cache):
    # position t must be handed the feature of t - 1
    ok = jnp.all(features[..., 0] == (positions - 1).astype(features.dtype))
    logits = jax.nn.one_hot((positions + 1) % vocab, vocab) * 50.0
    return jnp.where(ok, logits, jnp.nan), features + 1.0, cache

  fns = FeatureFns(apply, lambda b, n: jnp.zeros((b, n)), vocab)
  lengths = jnp.array([7, 9], jnp.int32)
  start = jnp.array([5, 6], jnp.int32)  # the target last scored positions start - 1 ..
  feats = (start[:, None] - 1 + jnp.arange(gamma + 1)[None]).astype(jnp.float32)[..., None]
  tokens = jnp.zeros((2, 20), jnp.int32)
  keys = jax.random.split(jax.random.key(0), 2)
  draft, q, _ = propose_features(fns, (None, jnp.arange(vocab)), (None, feats, start), tokens,
                                 lengths, keys, SamplingParams(jnp.zeros(2)), gamma=gamma,
                                 cache_len=24, vocab=vocab)
  # Proposal j is the token after position L - 1 + j: position L + j.
  np.testing.assert_array_equal(draft, lengths[:, None] + jnp.arange(gamma)[None])
  assert not np.isnan(np.asarray(q)).any()


def test_the_sync_call_reads_only_the_tokens_emitted_since_the_last_call():
  """feature_sync feeds the batch's largest number of new tokens, not the whole window: its
  output at ``L - 1`` and the cache before ``L`` are those of a call on the whole window, and
  the slots after the batch's last new token are left as they were."""
  config = llama.LlamaConfig(vocab_size=24, dim=16, n_layers=1, n_heads=2, n_kv_heads=1,
                             head_dim=8, ffn_dim=32, max_position=32)
  target = llama.init_params(jax.random.key(0), config)
  draft = eagle.make_eagle_draft(eagle.init_weights(jax.random.key(1), config), np.arange(10),
                                 target, config)
  fns = FeatureFns(draft.apply, draft.init_cache, 10)
  gamma, cache_len, batch = 3, 16, 3
  k_tok, k_feat, k_prev = jax.random.split(jax.random.key(2), 3)
  tokens = jax.random.randint(k_tok, (batch, cache_len), 0, 24, jnp.int32)
  features = jax.random.normal(k_feat, (batch, gamma + 1, config.dim), jnp.float32)
  # A cache the draft filled earlier (noise: every slot the sync leaves alone is recognisable).
  cache = jax.tree.map(lambda a: jax.random.normal(k_prev, a.shape, a.dtype),
                       draft.init_cache(batch, cache_len))
  start = jnp.array([5, 6, 4], jnp.int32)
  new = np.array([1, 3, 2])  # tokens the target emitted since: the sync reads 3 per row
  lengths = start + new
  logits, feature, synced = feature_sync(fns, draft.params, cache, features, start, tokens,
                                         lengths, cache_len=cache_len, vocab=24)

  positions = start[:, None] + jnp.arange(gamma + 1)[None]
  full_logits, full_features, full = draft.apply(
    draft.params, jnp.take_along_axis(tokens, positions, axis=1), features, positions, cache)
  rows, at = np.arange(batch), np.asarray(lengths - 1 - start)
  np.testing.assert_allclose(logits, full_logits[rows, at], atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(feature, full_features[rows, at], atol=1e-5, rtol=1e-5)
  for b in range(batch):
    last = int(lengths[b])  # slots 0 .. L - 1 as after the whole window
    np.testing.assert_allclose(synced.k[:, b, :, :last], full.k[:, b, :, :last], atol=1e-5)
    np.testing.assert_allclose(synced.v[:, b, :, :last], full.v[:, b, :, :last], atol=1e-5)
    untouched = int(start[b]) + new.max()  # the call was new.max() = 3 tokens wide
    np.testing.assert_array_equal(synced.k[:, b, :, untouched:], cache.k[:, b, :, untouched:])
    assert not np.allclose(full.k[:, b, :, untouched], cache.k[:, b, :, untouched])


def test_a_put_off_sync_gives_the_draft_what_a_sync_every_iteration_gives():
  """Adaptive speculation without proposals puts the sync call off (propose_features_when):
  after three such iterations (the window full: one sync on 3 tokens) and one that proposes,
  the draft's cache, proposals and q are those of a draft synced after every iteration."""
  config = llama.LlamaConfig(vocab_size=24, dim=16, n_layers=1, n_heads=2, n_kv_heads=1,
                             head_dim=8, ffn_dim=32, max_position=32)
  target = llama.init_params(jax.random.key(0), config)
  draft = eagle.make_eagle_draft(eagle.init_weights(jax.random.key(1), config), np.arange(10),
                                 target, config)
  fns, params_d = FeatureFns(draft.apply, draft.init_cache, 10), (draft.params, jnp.arange(10))
  gamma, cache_len, batch = 2, 16, 2
  k_tok, k_feat, k_prev = jax.random.split(jax.random.key(2), 3)
  tokens = jax.random.randint(k_tok, (batch, cache_len), 0, 24, jnp.int32)
  feats = jax.random.normal(k_feat, (batch, cache_len, config.dim), jnp.float32)  # f[t]
  cache = jax.tree.map(lambda a: jax.random.normal(k_prev, a.shape, a.dtype),
                       draft.init_cache(batch, cache_len))
  rows = jnp.arange(batch)

  def target_call(lengths):  # features of a width-0 call on the token at L - 1, padded
    return jnp.zeros((batch, gamma + 1, config.dim)).at[:, 0].set(feats[rows, lengths - 1])

  keys = jax.random.split(jax.random.key(3), batch)
  greedy = SamplingParams(jnp.zeros(batch))
  kw = dict(gamma=gamma, cache_len=cache_len, vocab=24, steps=jnp.int32(gamma))
  start = jnp.array([4, 6], jnp.int32)
  first = (cache, target_call(start), start)
  put_off, every = first, first
  synced_at = []
  for step in range(4):  # three iterations without proposals, then one with
    lengths = start + 1 + step  # one token emitted by each call: the last call's, at L - 1
    propose = jnp.asarray(step == 3)
    out = propose_features_when(fns, params_d, put_off, tokens, lengths, keys, greedy,
                                propose=propose, **kw)
    synced_at.append(bool(out[3]))
    put_off = (out[2], *next_features(put_off, target_call(lengths), lengths, out[3]))
    ref = propose_features(fns, params_d, every, tokens, lengths, keys, greedy, **kw)
    every = (ref[2], target_call(lengths), lengths)
  assert synced_at == [False, False, True, True]  # the window of 3 filled, then a proposal
  np.testing.assert_array_equal(out[0], ref[0])
  np.testing.assert_allclose(out[1], ref[1], atol=1e-5)
  last = int(jnp.max(lengths))
  np.testing.assert_allclose(put_off[0].k[:, :, :, :last], every[0].k[:, :, :, :last], atol=1e-5)
  np.testing.assert_allclose(put_off[0].v[:, :, :, :last], every[0].v[:, :, :, :last], atol=1e-5)


@pytest.mark.parametrize(("verifier", "adaptive"), [
  ("token", None), ("block", None), ("token", POLICY),
  pytest.param("block", POLICY, marks=pytest.mark.slow)],  # the two axes are independent
  ids=["token-fixed", "block-fixed", "token-adaptive", "block-adaptive"])
def test_feature_draft_greedy_equals_plain(verifier, adaptive):
  plain = _plain()
  for draft in (PERFECT, NOISY):
    out = _run(draft, adaptive=adaptive, verifier=verifier)
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    np.testing.assert_array_equal(out.error, 0)
    stats = jax.tree.map(np.asarray, out.stats)
    np.testing.assert_array_equal(stats.proposals, stats.proposed_at.sum(-1))
    np.testing.assert_array_equal(out.num_new, stats.row_target_calls + stats.accepted)
    if draft is PERFECT:  # the right features make it the target: everything is accepted
      np.testing.assert_array_equal(stats.accepted, stats.proposals)
      assert (stats.proposals >= 8).all()
    else:
      assert (stats.accepted < stats.proposals).any()


def test_a_perfect_feature_draft_is_accepted_when_sampling():
  out = _run(PERFECT, temperature=1.0, seed=4)
  stats = jax.tree.map(np.asarray, out.stats)
  np.testing.assert_array_equal(stats.accepted, stats.proposals)


def test_feature_draft_errors():
  no_features = TARGET._replace(apply_features=None)
  with pytest.raises(ValueError, match="speculative_generate: a FeatureDraft reads the target"):
    speculative_generate(no_features, PERFECT, PROMPTS, PROMPT_LENGTHS, jax.random.key(0),
                         gamma=2, max_new_tokens=4)
  bad = PERFECT._replace(vocab_ids=np.array([0, 0, 3]))
  with pytest.raises(ValueError, match="`vocab_ids` must be distinct ids in"):
    _run(bad)
  short = PERFECT._replace(vocab_ids=np.arange(V - 1))  # its head still has V columns
  with pytest.raises(ValueError, match=rf"speculative_generate: `draft` returned logits of shape "
                     rf"\(\d+, \d+, {V}\) .* one column per entry of its `vocab_ids` "
                     rf"\(K = {V - 1}\)"):
    _run(short)


def test_float_vocab_ids_are_refused_not_truncated():
  floats = PERFECT._replace(vocab_ids=np.arange(V) + 0.5)
  with pytest.raises(TypeError, match="speculative_generate: `vocab_ids` must have an integer "
                     "dtype, got float64"):
    _run(floats)
  c = llama.LlamaConfig(vocab_size=32, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8,
                        ffn_dim=32)
  with pytest.raises(TypeError, match="make_eagle_draft: `vocab_ids` must have an integer dtype"):
    eagle.make_eagle_draft(eagle.init_weights(jax.random.key(1), c), [0.5, 1.5, 2.5],
                           llama.init_params(jax.random.key(0), c), c)


# ---------------------------------------------------------------------------------------------
# Adaptive speculation.


def test_choose_num_draft_follows_the_cost_model():
  counts = jnp.array([[0.0, 8.0], [9.0, 0.0], [0.0, 0.0]])
  np.testing.assert_array_equal(choose_num_draft(POLICY, counts, gamma=4), [0, 4, 3])
  free = AdaptiveSpeculation(draft_cost=0.0, verify_cost=0.0, fixed_cost=0.0)
  np.testing.assert_array_equal(choose_num_draft(free, counts, gamma=4), [4, 4, 4])
  # Without proposals the counts decay towards the prior, by idle_decay: the row probes again,
  # the later the slower they decay. Here k = 1 pays once alpha > 0.19, i.e. F < 3.26: after
  # n idle steps with 10 * idle_decay^n < 3.26.
  for idle, want in ((0.98, 56), (0.9, 11)):
    policy = POLICY._replace(idle_decay=idle)
    stuck = jnp.array([[0.0, 10.0]])
    steps = 0
    while int(choose_num_draft(policy, stuck, gamma=4)[0]) == 0 and steps <= 2 * want:
      stuck = update_counts(policy, stuck, jnp.array([0]), jnp.array([0]), jnp.array([True]))
      steps += 1  # bounded: counts that never decay fail here instead of hanging
    assert steps == want, (idle, steps)


def test_slow_idle_decay_bounds_the_loss_of_a_draft_that_never_hits():
  """Under the policy's own cost model, a draft that is never accepted costs under 5% against
  plain decoding at the default ``idle_decay`` (probing less often), more when idle iterations
  decay as fast as the evidence; a good draft gains the same either way."""
  policy = AdaptiveSpeculation(draft_cost=0.0, verify_cost=0.04, fixed_cost=0.1)
  fast = policy._replace(idle_decay=policy.decay)
  assert policy_efficiency(policy, 0.0, gamma=4) >= 0.97
  assert policy_efficiency(fast, 0.0, gamma=4) < 0.95
  assert policy_efficiency(policy, 0.6, gamma=4) == pytest.approx(
    policy_efficiency(fast, 0.6, gamma=4), rel=0.01)
  assert policy_efficiency(policy, 0.6, gamma=4) > 1.7


def test_update_counts_counts_a_failure_only_below_full_acceptance():
  """``S <- decay S + n``, ``F <- decay F + [n < k]``: a step that accepted all its ``k > 0``
  proposals is no failure (counting one lowers the estimate: fewer proposals, same output)."""
  d, idle = POLICY.decay, POLICY.idle_decay
  assert d != idle
  counts = jnp.tile(jnp.array([[2.0, 1.0]]), (5, 1))
  proposed = jnp.array([3, 3, 3, 0, 3], jnp.int32)
  accepted = jnp.array([3, 1, 0, 0, 3], jnp.int32)
  active = jnp.array([True, True, True, True, False])
  new = update_counts(POLICY, counts, proposed, accepted, active)
  np.testing.assert_allclose(new, [[2 * d + 3, d], [2 * d + 1, d + 1], [2 * d, d + 1],
                                   [2 * idle, idle], [2.0, 1.0]], rtol=1e-6)
  # From the prior alone, one full acceptance of 3: alpha = (1 + 3) / (2 + 3 + 0).
  after = update_counts(POLICY, jnp.zeros((1, 2)), jnp.array([3]), jnp.array([3]),
                        jnp.array([True]))
  np.testing.assert_allclose(acceptance(POLICY, after), [0.8], rtol=1e-6)


@pytest.mark.parametrize("draft", ["lookup", "model"])
def test_adaptive_greedy_equals_plain_and_saves_proposals(draft):
  d = PromptLookup() if draft == "lookup" else make_toy_model(jax.random.key(1), V, context=1)
  plain = _plain()
  fixed = _run(d, gamma=4)
  adaptive = _run(d, gamma=4, adaptive=POLICY)
  np.testing.assert_array_equal(adaptive.tokens, plain.tokens)
  np.testing.assert_array_equal(fixed.tokens, plain.tokens)
  assert int(adaptive.stats.proposals.sum()) < int(fixed.stats.proposals.sum())
  rate_fixed = fixed.stats.accepted.sum() / fixed.stats.proposals.sum()
  rate_adaptive = adaptive.stats.accepted.sum() / max(int(adaptive.stats.proposals.sum()), 1)
  assert rate_adaptive >= rate_fixed


def test_adaptive_keeps_proposing_with_a_good_draft():
  out = _run(PERFECT, gamma=3, adaptive=POLICY)
  stats = jax.tree.map(np.asarray, out.stats)
  assert (stats.proposals >= 8).all()  # 11 tokens after the prefill: 3 + 3 + 3 + 2 or so


# ---------------------------------------------------------------------------------------------
# Sampling exactness of whole sequences.

# The shared setup (tests/decoding/_exact.py).
EXACT_DRAFTS = {
  "feature": exact.FEATURES,
  "adaptive-lookup": PromptLookup(max_ngram=2),
  "adaptive-feature": exact.NOISY_FEATURES,
}
EXACT_POLICY = AdaptiveSpeculation(draft_cost=0.05, verify_cost=0.04, fixed_cost=0.05,
                                   decay=0.5, idle_decay=0.5)


def _wrong(p, q, draft, uniforms, *, num_draft):
  """Negative control: q squared and renormalised, not the law the draft sampled from."""
  q = q**2 / jnp.maximum(jnp.sum(q**2, axis=-1, keepdims=True), 1e-30)
  q = jnp.where(jnp.max(q, axis=-1, keepdims=True) >= 1.0, jnp.full_like(q, 1 / q.shape[-1]), q)
  return verify(p, q, draft, uniforms, num_draft=num_draft)


def _sample(kind: str, verifier, seed: int):
  return speculative_generate(
    exact.TARGET, EXACT_DRAFTS[kind], *exact.batch(), jax.random.key(seed), gamma=3,
    max_new_tokens=exact.NEW, params=exact.PARAMS, verifier=verifier,
    adaptive=EXACT_POLICY if kind.startswith("adaptive") else None)


@pytest.mark.parametrize("kind", list(EXACT_DRAFTS))
def test_sampled_sequences_follow_target(kind):
  out = _sample(kind, "token", seed=100 + len(kind))
  np.testing.assert_array_equal(out.error, 0)
  stats = jax.tree.map(np.asarray, out.stats)
  assert (stats.accepted == 0).any() and (stats.accepted_at[:, 1] > 0).any()
  if kind.startswith("adaptive"):  # the rows chose different proposal counts
    assert len(set(stats.proposals.tolist())) > 1
  _, _, pvalue, detail = exact.chi_square(out)
  assert pvalue >= ALPHA / NUM_EXACT_TESTS, f"{kind}: chi-square p = {pvalue:.3g}; {detail}"


@pytest.mark.parametrize("kind", ["feature", "adaptive-feature"])
def test_wrong_q_is_detected(kind):
  _, _, pvalue, detail = exact.chi_square(_sample(kind, _wrong, seed=200 + len(kind)))
  assert pvalue < 1e-6, f"{kind}: the wrong q went undetected (p = {pvalue:.3g}); {detail}"


# ---------------------------------------------------------------------------------------------
# Streaming: chunks of the compiled loop with the state carried between them.


@pytest.mark.parametrize("draft", ["feature", "lookup", "model"])
def test_streamed_output_is_the_one_shot_output(draft):
  d = {"feature": NOISY, "lookup": PromptLookup(),
       "model": make_toy_model(jax.random.key(1), V, context=1)}[draft]
  one_shot = _run(d, temperature=0.9, seed=5, adaptive=POLICY)
  seen = []
  streamed = _run(d, temperature=0.9, seed=5, adaptive=POLICY, chunk_iterations=2,
                  on_tokens=lambda tokens, lengths: seen.append((tokens.copy(), lengths.copy())))
  for a, b in zip(jax.tree.leaves(one_shot), jax.tree.leaves(streamed), strict=True):
    np.testing.assert_array_equal(a, b)
  assert len(seen) >= 2
  lengths = np.stack([s[1] for s in seen])
  assert (np.diff(lengths, axis=0) >= 0).all()
  np.testing.assert_array_equal(lengths[-1], streamed.lengths)
  for tokens, lengths in seen:  # what was shown is a prefix of the final output
    for b, n in enumerate(lengths):
      np.testing.assert_array_equal(tokens[b, :n], np.asarray(streamed.tokens)[b, :n])


STREAM = {"temperature": 0.9, "seed": 5, "adaptive": POLICY}  # the streamed test's feature run


@functools.cache
def _streamed(chunk_iterations: int):
  """NOISY streamed in chunks: ``(result, [(tokens, lengths) after each chunk])``.

  A loop that never returns fails here instead of hanging: more callbacks than the one-shot
  run has target calls (iterations + 1) raise from ``on_tokens``.
  """
  limit = int(_run(NOISY, **STREAM).stats.target_calls)
  seen = []

  def on_tokens(tokens, lengths):
    seen.append((tokens.copy(), lengths.copy()))
    if len(seen) > limit:
      raise AssertionError(f"chunk_iterations={chunk_iterations}: {len(seen)} chunks for "
                           f"{limit - 1} loop iterations; the streamed loop does not end")

  out = _run(NOISY, chunk_iterations=chunk_iterations, on_tokens=on_tokens, **STREAM)
  return out, seen


def test_each_streamed_chunk_runs_chunk_iterations_iterations():
  """``chunk_iterations=1`` hands over the state after every iteration (each emits a token in
  every unfinished row); ``2`` hands over every second of those states, and the last."""
  one_shot = _run(NOISY, **STREAM)
  iterations = int(one_shot.stats.target_calls) - 1  # the prefill is a target call
  assert iterations >= 5
  every, per_iteration = _streamed(1)
  for a, b in zip(jax.tree.leaves(one_shot), jax.tree.leaves(every), strict=True):
    np.testing.assert_array_equal(a, b)
  assert len(per_iteration) == iterations
  stop = np.asarray(PROMPT_LENGTHS) + MAX_NEW
  lengths = np.stack([np.asarray(PROMPT_LENGTHS) + 1] + [n for _, n in per_iteration])
  for before, after in itertools.pairwise(lengths):
    np.testing.assert_array_equal(np.where(before < stop, after > before, after == before), True)
  np.testing.assert_array_equal(lengths[-1], one_shot.lengths)

  pairs, per_two = _streamed(2)
  for a, b in zip(jax.tree.leaves(one_shot), jax.tree.leaves(pairs), strict=True):
    np.testing.assert_array_equal(a, b)
  assert len(per_two) == -(-iterations // 2)
  for j, (tokens, n) in enumerate(per_two):
    want_tokens, want_n = per_iteration[min(2 * j + 2, iterations) - 1]
    np.testing.assert_array_equal(n, want_n)
    np.testing.assert_array_equal(tokens, want_tokens)

  # A chunk longer than the run (10**12 would not fit the int32 counter) is one chunk.
  whole, once = _streamed(10**12)
  for a, b in zip(jax.tree.leaves(one_shot), jax.tree.leaves(whole), strict=True):
    np.testing.assert_array_equal(a, b)
  assert len(once) == 1


def test_adaptive_proposals_follow_the_estimator_in_the_loop():
  """The documented estimator replayed on each iteration's accepted count (streamed one
  iteration per chunk) predicts every row's proposals: ``k = min(budget, k*(counts))``, then
  ``S <- decay S + n``, ``F <- decay F + [n < k]`` (no failure after a full acceptance), or
  both times ``idle_decay`` where ``k = 0``."""
  out, per_iteration = _streamed(1)
  prompt = np.asarray(PROMPT_LENGTHS)
  lengths = np.stack([prompt + 1] + [n for _, n in per_iteration])  # the prefill emits one
  stop, gamma = prompt + MAX_NEW, 3
  counts = np.zeros((len(prompt), 2), np.float32)
  proposed = np.zeros(len(prompt), np.int64)
  accepted = np.zeros(len(prompt), np.int64)
  full = 0
  for before, after in itertools.pairwise(lengths):
    active = before < stop
    budget = np.where(active, np.clip(stop - before - 1, 0, gamma), 0)
    k = np.minimum(budget, np.asarray(choose_num_draft(POLICY, jnp.asarray(counts), gamma=gamma)))
    n = np.where(active, after - before - 1, 0)  # accepted proposals, then the target's token
    assert ((0 <= n) & (n <= k)).all()
    full += int(np.sum(active & (k > 0) & (n == k)))
    new = np.stack([n, (k > 0) & (n < k)], axis=1).astype(np.float32)
    decay = np.where(k > 0, np.float32(POLICY.decay), np.float32(POLICY.idle_decay))
    counts = np.where(active[:, None], decay[:, None] * counts + new, counts)
    proposed += k
    accepted += n
  assert full >= 3  # full acceptances happen, and the estimate must not count them as failures
  np.testing.assert_array_equal(accepted, out.stats.accepted)
  np.testing.assert_array_equal(proposed, out.stats.proposals)


def test_streaming_arguments_are_checked():
  with pytest.raises(ValueError, match="`chunk_iterations` must be an int >= 1"):
    _run(PromptLookup(), on_tokens=print, chunk_iterations=0)
  with pytest.raises(TypeError, match="`on_tokens` must be a function"):
    _run(PromptLookup(), on_tokens=3)
  with pytest.raises(ValueError, match=r"`adaptive.decay` must be in \(0, 1\)"):
    _run(PromptLookup(), adaptive=AdaptiveSpeculation(decay=1.5))
  for idle in (0.0, 1.5, -0.1):
    with pytest.raises(ValueError, match=r"speculative_generate: `adaptive.idle_decay` must be "
                                         r"in \(0, 1\], got"):
      _run(PromptLookup(), adaptive=AdaptiveSpeculation(idle_decay=idle))
