"""The one exact-enumeration setup the decoding loops' sampling tests share (issue 47).

Every loop's whole-sequence exactness test (the chain with a draft model, prompt lookup, EAGLE
features and adaptive speculation; static and dynamic trees; the plain baseline) samples
:data:`RUNS` continuations of :data:`NEW` tokens after :data:`PROMPT` from the same toy
:data:`TARGET` (``V = 4``: ``4 ** 4 = 256`` continuations) and compares their counts with the law
enumerated in float64 (:func:`probs`, once per process and parameters). One target, one prompt and
one row count: a loop drafted the same way is one compiled program whichever file runs it, and
the persistent compilation cache (tests/conftest.py) shares it between the workers. At 20,000
rows the negative controls are rejected far below their ``p < 1e-6`` bound.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from specdec_jax import SamplingParams
from specdec_jax.models.toy import make_toy_feature_draft
from specdec_jax.models.toy import make_toy_model
from specdec_jax.theory import ChiSquare
from specdec_jax.theory import chi_square_test
from tests._helpers import exact_sequence_probs
from tests._helpers import sequence_index

V = 4
NEW = 4
RUNS = 20_000
#: Truncation too: continuations of probability 0 for the target (top-k 3 of 4).
PARAMS = SamplingParams(0.8, top_k=3)
TARGET = make_toy_model(jax.random.key(10), V, scale=1.5, name="exact_target")
DRAFT = make_toy_model(jax.random.key(11), V, context=1, scale=1.5, name="exact_draft")
#: An EAGLE-style draft reading the target's features; ``q = 0`` on token 2.
FEATURES = make_toy_feature_draft(TARGET, noise=1.0, key=jax.random.key(12), vocab_ids=[0, 1, 3])
#: A noisier feature draft (more rejections: adaptive speculation changes its widths).
NOISY_FEATURES = make_toy_feature_draft(TARGET, noise=2.0, key=jax.random.key(13))
PROMPT = np.array([0, 1, 2, 0, 1], np.int32)  # repeats: prompt lookup finds matches


def batch() -> tuple[np.ndarray, np.ndarray]:
  """``(prompts (RUNS, 5), lengths (RUNS,))``: :data:`PROMPT` on every row."""
  return np.tile(PROMPT, (RUNS, 1)), np.full(RUNS, len(PROMPT), np.int32)


@functools.cache
def probs(params: SamplingParams = PARAMS) -> np.ndarray:
  """P(continuation) of all ``V ** NEW`` continuations, in lexicographic order (float64)."""
  return exact_sequence_probs(TARGET, PROMPT, NEW, params)


def counts(out) -> np.ndarray:
  """How often a loop's result ``out`` (``RUNS`` rows, each ``NEW`` new tokens) drew each
  continuation."""
  np.testing.assert_array_equal(out.num_new, NEW)
  tokens = np.asarray(out.tokens)[:, len(PROMPT):len(PROMPT) + NEW]
  return np.bincount(sequence_index(tokens, V), minlength=V**NEW)


def chi_square(out, params: SamplingParams = PARAMS) -> ChiSquare:
  """Pearson's chi-square test of ``out``'s continuations against the enumerated law."""
  return chi_square_test(counts(out), probs(params))
