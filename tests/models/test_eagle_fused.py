"""EAGLE-3's fused features on a tiny random Llama: the tapped hidden states are the ones entering
those layers, the fused target gives the target's own logits, the stored projection round-trips,
and decoding with a fused draft is exact (greedy token for token; sampled whole sequences by a
chi-square test against enumeration, with a negative control).

Chi-square test: a fixed seed, ``ALPHA = 0.01``, so a correct implementation fails it with
probability at most 1% (its negative control must reach p < 1e-6).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax import SamplingParams
from specdec_jax import generate
from specdec_jax import speculative_generate
from specdec_jax import tree_speculative_generate
from specdec_jax import verify
from specdec_jax.decoding import DraftTree
from specdec_jax.models import eagle
from specdec_jax.models import llama
from specdec_jax.theory import chi_square_test
from tests._helpers import exact_sequence_probs
from tests._helpers import sequence_index

TOL = {"atol": 2e-5, "rtol": 2e-5}
CONFIG = llama.LlamaConfig(vocab_size=24, dim=16, n_layers=6, n_heads=2, n_kv_heads=1,
                           head_dim=8, ffn_dim=32, max_position=64)
PARAMS = llama.init_params(jax.random.key(0), CONFIG, scale=1.5)
ALPHA = 0.01


def test_fused_layers_are_eagle3s_low_middle_and_high():
  assert eagle.fused_layers(30) == (2, 15, 27)  # SmolLM2-135M
  assert eagle.fused_layers(32) == (2, 16, 29)
  assert eagle.fused_layers(6) == (2, 3)
  assert eagle.fused_layers(2) == (0, 1)
  assert eagle.fused_layers(1) == (0,)


def test_tapped_hidden_states_are_those_entering_the_layers():
  """Tap ``j`` is the hidden state after layers ``0 .. j - 1``: final-normed, it is what a model
  of those ``j`` layers alone returns as its features (an untapped forward); the logits and the
  cache of the tapped forward are the untapped one's."""
  tokens = jax.random.randint(jax.random.key(1), (2, 5), 0, CONFIG.vocab_size, jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (2, 5))
  taps = (1, 3, 4, 6)
  plain = llama.make_model(PARAMS, CONFIG)
  tapped = llama.make_model(PARAMS, CONFIG, feature_layers=taps)
  logits, features, cache = plain.apply_features(plain.params, tokens, positions,
                                                 plain.init_cache(2, 8))
  logits_t, hidden, cache_t = tapped.apply_features(tapped.params, tokens, positions,
                                                    tapped.init_cache(2, 8))
  np.testing.assert_array_equal(logits_t, logits)
  np.testing.assert_array_equal(cache_t.k, cache.k)
  assert hidden.shape == (2, 5, len(taps) * CONFIG.dim)
  pieces = np.split(np.asarray(hidden), len(taps), axis=-1)
  for j, piece in zip(taps, pieces, strict=True):
    short = llama.make_model(PARAMS, CONFIG, layers=range(j))
    _, expected, _ = short.apply_features(short.params, tokens, positions,
                                          short.init_cache(2, 8))
    normed = llama.rms_norm(jnp.asarray(piece), PARAMS.final_norm, CONFIG.norm_eps)
    np.testing.assert_allclose(normed, expected, **TOL)
  # The last tap (6: the last layer's output), final-normed, is the untapped features.
  np.testing.assert_allclose(
    llama.rms_norm(jnp.asarray(pieces[-1]), PARAMS.final_norm, CONFIG.norm_eps), features, **TOL)
  # The pieces differ from layer to layer (a tap that read the wrong layer would repeat one).
  assert not np.allclose(pieces[0], pieces[1], atol=1e-3)


@pytest.mark.parametrize("layers", [(2, 1), (3, 3), (7,), (-1,), ()])
def test_bad_feature_layers_are_refused(layers):
  with pytest.raises(ValueError, match=r"make_model: `feature_layers` must be increasing "
                                       r"indices in \[0, 6\]"):
    llama.make_model(PARAMS, CONFIG, feature_layers=layers)
  with pytest.raises(ValueError, match=r"llama_apply_features: `feature_layers` must be "
                                       r"increasing indices in \[0, 3\]"):
    llama.llama_apply_features(PARAMS, jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 2), jnp.int32),
                               llama.init_cache(CONFIG, 1, 4, n_layers=3), config=CONFIG,
                               layers=(0, 1, 2), feature_layers=(1, 4))


def test_fused_target_keeps_the_targets_logits_and_fuses_its_taps():
  weights = _fused_weights()
  target = eagle.make_fused_target(weights, PARAMS, CONFIG)
  plain = llama.make_model(PARAMS, CONFIG)
  tokens = jax.random.randint(jax.random.key(2), (2, 5), 0, CONFIG.vocab_size, jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (2, 5))
  expected, _ = plain.apply(plain.params, tokens, positions, plain.init_cache(2, 8))
  logits, _ = target.apply(target.params, tokens, positions, target.init_cache(2, 8))
  np.testing.assert_array_equal(logits, expected)
  logits_f, fused, _ = target.apply_features(target.params, tokens, positions,
                                             target.init_cache(2, 8))
  np.testing.assert_array_equal(logits_f, expected)
  taps = llama.make_model(PARAMS, CONFIG, feature_layers=eagle.fused_layers(6))
  _, hidden, _ = taps.apply_features(taps.params, tokens, positions, taps.init_cache(2, 8))
  h = np.asarray(hidden, np.float64).reshape(2, 5, -1, CONFIG.dim)
  h /= np.sqrt((h ** 2).mean(-1, keepdims=True) + 1e-6)
  np.testing.assert_allclose(fused, h.reshape(2, 5, -1) @ np.asarray(weights.fuse), **TOL)
  # The tree form reads the same taps: a chain of nodes is the same computation.
  start = jnp.zeros((2,), jnp.int32)
  nodes = jnp.arange(5, dtype=jnp.int32)
  mask = jnp.tril(jnp.ones((5, 5), bool))
  _, tree_fused, _ = target.tree_apply_features(target.params, tokens, positions,
                                                target.init_cache(2, 8), start, nodes, mask)
  np.testing.assert_allclose(tree_fused, fused, **TOL)


def test_a_draft_without_fuse_has_no_fused_target():
  with pytest.raises(ValueError, match=r"make_fused_target: `weights.fuse` must be \(32, 16\)"):
    eagle.make_fused_target(eagle.init_weights(jax.random.key(0), CONFIG), PARAMS, CONFIG)
  bad = _fused_weights()._replace(fuse=jnp.zeros((48, 16)))
  with pytest.raises(ValueError, match=r"must be \(32, 16\).*got \(48, 16\)"):
    eagle.make_fused_target(bad, PARAMS, CONFIG)


def test_the_projection_is_stored_and_read_back(tmp_path):
  weights = _fused_weights()
  path = tmp_path / "fused.npz"
  eagle.save_eagle(path, weights, np.arange(10))
  loaded, ids = eagle.load_eagle(path)
  np.testing.assert_array_equal(ids, np.arange(10))
  np.testing.assert_allclose(loaded.fuse, weights.fuse, rtol=1e-3, atol=1e-3)  # float16
  plain_path = tmp_path / "plain.npz"
  eagle.save_eagle(plain_path, eagle.init_weights(jax.random.key(0), CONFIG), np.arange(10))
  assert eagle.load_eagle(plain_path)[0].fuse is None


@functools.cache
def _fused_weights() -> eagle.EagleWeights:
  """Fused weights with a projection that reads every tap (not only the initial identity)."""
  w = eagle.init_weights(jax.random.key(3), CONFIG, fused=True)
  assert w.fuse.shape == (2 * CONFIG.dim, CONFIG.dim)
  noise = 0.3 * jax.random.normal(jax.random.key(4), w.fuse.shape)
  return w._replace(fuse=w.fuse + noise)


def _draft(vocab_ids=None):
  ids = np.arange(CONFIG.vocab_size) if vocab_ids is None else np.asarray(vocab_ids)
  return eagle.make_eagle_draft(_fused_weights(), ids, PARAMS, CONFIG)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_a_draft_and_a_target_of_other_features_are_refused(tree):
  """A fused draft with the plain target, or a top-feature draft with the fused target, would
  read features it was not trained on (exact, but rarely accepted): the loops raise, naming both;
  a target without a label (a user's own Model) is not checked."""
  prompt, lengths = jnp.zeros((1, 3), jnp.int32), jnp.array([3], jnp.int32)
  plain = llama.make_model(PARAMS, CONFIG)
  fused = eagle.make_fused_target(_fused_weights(), PARAMS, CONFIG)
  top = eagle.make_eagle_draft(eagle.init_weights(jax.random.key(9), CONFIG),
                               np.arange(CONFIG.vocab_size), PARAMS, CONFIG)
  assert plain.features == llama.FINAL_FEATURES == top.reads
  assert fused.features == eagle.fused_label(CONFIG.n_layers) == _draft().reads

  def run(target, draft):
    if tree:
      return tree_speculative_generate(target, draft, prompt, lengths, jax.random.key(0),
                                       tree=DraftTree.from_branching((2, 1)), max_new_tokens=4)
    return speculative_generate(target, draft, prompt, lengths, jax.random.key(0), gamma=2,
                                max_new_tokens=4)

  name = "tree_speculative_generate" if tree else "speculative_generate"
  with pytest.raises(ValueError, match=rf"{name}: the FeatureDraft .* reads the target's EAGLE-3 "
                                       r"fusion .* return its final-normed hidden state"):
    run(plain, _draft())
  with pytest.raises(ValueError, match=r"reads the target's final-normed hidden state, but .* "
                                       r"return its EAGLE-3 fusion of the hidden states entering "
                                       r"layers \(2, 3\)"):
    run(fused, top)
  out = run(fused._replace(features=None), top)  # unlabelled: the user's responsibility
  np.testing.assert_array_equal(out.error, 0)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_fused_draft_greedy_equals_plain(tree):
  target = eagle.make_fused_target(_fused_weights(), PARAMS, CONFIG)
  prompt = jax.random.randint(jax.random.key(5), (3, 4), 0, CONFIG.vocab_size, jnp.int32)
  lengths = jnp.array([4, 3, 2], jnp.int32)
  greedy = SamplingParams(0.0)
  plain = generate(llama.make_model(PARAMS, CONFIG), prompt, lengths, jax.random.key(0),
                   max_new_tokens=12, params=greedy)
  if tree:
    fast = tree_speculative_generate(target, _draft(), prompt, lengths, jax.random.key(0),
                                     tree=DraftTree.from_branching((2, 1)), max_new_tokens=12,
                                     params=greedy)
  else:
    fast = speculative_generate(target, _draft(), prompt, lengths, jax.random.key(0), gamma=3,
                                max_new_tokens=12, params=greedy)
  np.testing.assert_array_equal(fast.tokens, plain.tokens)
  np.testing.assert_array_equal(fast.error, 0)


# Whole sampled sequences against enumeration: a 4-token vocabulary, 4 new tokens (256 outcomes).
EXACT_CONFIG = CONFIG._replace(vocab_size=4)
EXACT_PARAMS_L = llama.init_params(jax.random.key(6), EXACT_CONFIG, scale=0.5)
EXACT_SAMPLING = SamplingParams(0.8)
EXACT_PROMPT = np.array([0, 1, 2, 3, 1], np.int32)
EXACT_NEW = 4
EXACT_RUNS = 20_000


def _wrong(p, q, draft, uniforms, *, num_draft):
  """Negative control: q squared and renormalised, not the law the draft sampled from."""
  q = q**2 / jnp.maximum(jnp.sum(q**2, axis=-1, keepdims=True), 1e-30)
  return verify(p, q, draft, uniforms, num_draft=num_draft)


def _exact_counts(verifier, seed: int) -> tuple[np.ndarray, np.ndarray]:
  weights = eagle.init_weights(jax.random.key(7), EXACT_CONFIG, fused=True)
  weights = weights._replace(fuse=weights.fuse + 0.3 * jax.random.normal(
    jax.random.key(8), weights.fuse.shape))
  target = eagle.make_fused_target(weights, EXACT_PARAMS_L, EXACT_CONFIG)
  draft = eagle.make_eagle_draft(weights, [0, 1, 3], EXACT_PARAMS_L, EXACT_CONFIG)
  prompt = np.tile(EXACT_PROMPT, (EXACT_RUNS, 1))
  lengths = np.full(EXACT_RUNS, len(EXACT_PROMPT), np.int32)
  out = speculative_generate(target, draft, prompt, lengths, jax.random.key(seed), gamma=3,
                             max_new_tokens=EXACT_NEW, params=EXACT_SAMPLING, verifier=verifier)
  np.testing.assert_array_equal(out.num_new, EXACT_NEW)
  np.testing.assert_array_equal(out.error, 0)
  stats = jax.tree.map(np.asarray, out.stats)
  assert (stats.accepted == 0).any() and (stats.accepted_at[:, 1] > 0).any()
  tokens = np.asarray(out.tokens)[:, len(EXACT_PROMPT):]
  probs = exact_sequence_probs(llama.make_model(EXACT_PARAMS_L, EXACT_CONFIG), EXACT_PROMPT,
                               EXACT_NEW, EXACT_SAMPLING)
  return np.bincount(sequence_index(tokens, EXACT_CONFIG.vocab_size), minlength=len(probs)), probs


def test_fused_draft_sampled_sequences_follow_the_target():
  counts, probs = _exact_counts("token", seed=300)
  _, _, pvalue, detail = chi_square_test(counts, probs)
  assert pvalue >= ALPHA, f"chi-square p = {pvalue:.3g}; {detail}"


def test_fused_draft_with_a_wrong_q_is_detected():
  counts, probs = _exact_counts(_wrong, seed=301)
  _, _, pvalue, detail = chi_square_test(counts, probs)
  assert pvalue < 1e-6, f"the wrong q went undetected (p = {pvalue:.3g}); {detail}"
