"""From logits to the processed distributions that drafting and verification must share.

Exactness of speculative sampling holds with respect to the distributions the
tokens are *actually* drawn from. If the draft samples at temperature 0.7 with
top-p 0.9, the ``q`` handed to verification must be that processed distribution,
and the target's ``p`` must be processed with the same parameters; the output is
then distributed exactly as the target's *processed* distribution. This module
computes that processing once (:func:`process_logits`) and uses it on both sides
(:func:`sample_draft`, :func:`verify_logits`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from specdec_jax._core.checks import FLOAT
from specdec_jax._core.checks import host_array
from specdec_jax._core.sampling import sample_index
from specdec_jax._logits.adjust import History
from specdec_jax._logits.params import SamplingParams as SamplingParams
from specdec_jax._logits.params import check_bitmask
from specdec_jax._logits.params import check_history
from specdec_jax._logits.params import check_params as check_params
from specdec_jax._logits.params import history_error
from specdec_jax._logits.params import params_error as params_error
from specdec_jax._logits.transform import process_rows as process_rows
from specdec_jax._logits.transform import process_unchecked
from specdec_jax._logits.transform import scaled_logits as scaled_logits


def process_logits(logits: jax.Array, params: SamplingParams = SamplingParams(),
                   history: History | None = None, bitmask=None) -> jax.Array:
  """Logits to the processed distribution: adjustments, temperature, min_p, top-k, top-p.

  0. The request's adjustments before the temperature, in vLLM's order (see
     :class:`SamplingParams`): allowed token ids and the grammar ``bitmask``, bad words,
     ``min_tokens``, the logit bias, then the penalties, reading ``history`` (what the
     request produced so far; at a draft position, include the draft prefix in
     ``history.output_ids``). Every later step works on these *adjusted* logits.
  1. ``temperature``: divide by it; ``0`` means greedy (point mass on the argmax).
  2. ``min_p``: keep the tokens whose probability is at least ``min_p`` times the largest.
  3. ``top_k``: keep the ``k`` largest logits. Ties at the boundary are broken
     toward the lower token id (as a stable sort would), so exactly ``k`` survive.
  4. ``top_p``: over the softmax of what survived, in the same order, keep each token
     whose preceding mass is ``< top_p`` (the first token always survives; the token
     that crosses ``top_p`` is kept).
  5. Softmax (log-sum-exp stabilised) over the survivors.

  The order of steps 2 to 4 is that of the *raw* logits (descending, ties toward the
  lower id), never of the temperature-scaled ones: a temperature can round two distinct
  logits to one value, and every verifier from logits, :func:`sample_draft` and the
  decoding loops cut the same order, so they all keep the same set
  (``specdec_jax.reference.process_logits`` states it in float64).

  Nothing is sorted: top-k and top-p are threshold searches by bisection over the row
  (:mod:`specdec_jax._logits.threshold`, as in tpu-inference and FlashInfer), about 32 passes each
  for float32. The top-p masses are summed by value level and token id rather than as a
  cumulative sum in sorted order, so a token whose preceding mass is within rounding
  (an ulp or so) of ``top_p`` may fall on the other side than with a sort; every other
  token, and every top-k decision, is the same.

  bfloat16/float16 logits are processed in float32. Use the *same* function and
  parameters for the draft (its ``q``) and the target (its ``p``): exactness of
  speculative sampling is with respect to these processed distributions.

  Temperature is applied as ``(x - max(x)) / T``, so every positive ``T`` gives a valid
  distribution (no overflow to NaN for tiny ``T``; the limit ``T -> 0`` is greedy up to
  ties). ``-inf`` logits are masked tokens. A row with a NaN or ``+inf`` logit, or without
  any finite logit, is returned as NaN at every temperature (greedy too), so a verifier or
  decoding loop that reads it reports ``ErrorCode.NONFINITE`` instead of a plausible token.
  Parameters out of range that could not be checked on the host (traced, or global arrays:
  ``temperature`` negative or NaN, ``top_k < 0``, ``top_p`` outside ``(0, 1]``) give NaN rows
  too, never a plausible distribution.

  Multi-host: see the docs, "Sharding and many hosts" (out-of-range ``params``
  held so give NaN rows, above).

  Args:
    logits: ``(V,)`` or ``(rows, V)`` floating logits (all rows share ``params``).
    params: :class:`SamplingParams` with one request's fields (use ``jax.vmap`` for
      per-sequence values).
    history: optional :class:`~specdec_jax.History` (prompt and output ids) that the
      penalties, ``min_tokens`` and bad words read.
    bitmask: optional grammar mask, int32 words ``(ceil(V / 32),)`` or ``(rows, ceil(V /
      32))``: token ``32 j + i`` is allowed iff bit ``i`` of word ``j`` is set (xgrammar's
      and llguidance's layout).

  Returns:
    Probabilities of the same shape, float32 (float64 for float64 input).

  Example:
    >>> import jax.numpy as jnp
    >>> logits = jnp.log(jnp.array([0.5, 0.3, 0.2]))
    >>> [round(float(v), 3) for v in process_logits(logits, SamplingParams(top_k=2))]
    [0.625, 0.375, 0.0]
    >>> process_logits(logits, SamplingParams(temperature=0.0)).tolist()
    [1.0, 0.0, 0.0]

  Reference:
    Holtzman et al., "The Curious Case of Neural Text Degeneration" (top-p),
    ICLR 2020, arXiv:1904.09751; Fan et al. 2018 (top-k), arXiv:1805.04833.
  """
  return _process_checked("process_logits", logits, params, history, bitmask)


def _process_checked(name, logits, params, history, bitmask) -> jax.Array:
  """:func:`process_logits` with ``name`` in its messages (``sample_draft`` shares it)."""
  logits = jnp.asarray(host_array(name, "logits", logits, FLOAT))
  if logits.ndim not in (1, 2) or logits.shape[-1] < 1:
    raise ValueError(
      f"{name}: `logits` must have shape (V,) or (rows, V) with V >= 1, "
      f"got {tuple(logits.shape)} instead."
    )
  if not jnp.issubdtype(logits.dtype, jnp.floating):
    raise TypeError(f"{name}: `logits` must be floating, got {logits.dtype} instead.")
  vocab = logits.shape[-1]
  params = check_params(params, name, vocab=vocab)
  history = check_history(name, history, vocab)
  if bitmask is not None and jnp.ndim(bitmask) == 2:
    bitmask = check_bitmask(name, "bitmask", bitmask, logits.shape[0] if logits.ndim == 2
                            else -1, vocab)
  else:
    bitmask = check_bitmask(name, "bitmask", bitmask, None, vocab)
  history = None if history is None else jax.tree.map(jnp.asarray, history)
  probs = process_unchecked(logits, params, history=history,
                            bitmask=None if bitmask is None else jnp.asarray(bitmask))
  bad = params_error(params, vocab) | (0 if history is None else history_error(history, vocab))
  return jnp.where(bad != 0, jnp.asarray(jnp.nan, probs.dtype), probs)


class DraftSample(NamedTuple):
  """A draft token and the distribution it was drawn from.

  Attributes:
    token: int32 ``()``, the sampled id.
    probs: ``(V,)`` the processed distribution ``token`` was drawn from: pass it
      as the ``q`` row to verification.
  """

  token: jax.Array
  probs: jax.Array


def sample_draft(key: jax.Array, logits: jax.Array,
                 params: SamplingParams = SamplingParams(), history: History | None = None,
                 bitmask=None) -> DraftSample:
  """Sample one draft token from the processed distribution and return that distribution.

  Returning ``probs`` with the token means the ``q`` given to verification is, by
  construction, the law the token was drawn from (a mismatch here silently
  breaks exactness; it has been reported against Hugging Face transformers).
  Broken logits and parameters out of range under ``jit`` give NaN ``probs``, as in
  :func:`process_logits`: the verifier that reads them reports ``ErrorCode.NONFINITE``.

  Multi-host: see the docs, "Sharding and many hosts" (as :func:`process_logits`).

  Args:
    key: a ``jax.random`` key.
    logits: ``(V,)`` draft logits for the next position.
    params: :class:`SamplingParams`; the same ones the target is verified with.
    history: optional :class:`~specdec_jax.History`: what the request produced before this
      position, the draft tokens already proposed included (the verifier counts the draft
      prefix the same way).
    bitmask: optional grammar words ``(ceil(V / 32),)`` of this position.

  Returns:
    :class:`DraftSample` ``(token, probs)``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> s = sample_draft(jax.random.key(0), jnp.array([0.0, 2.0, 1.0]), SamplingParams(0.0))
    >>> int(s.token), s.probs.tolist()
    (1, [0.0, 1.0, 0.0])
  """
  probs = _process_checked("sample_draft", logits, params, history, bitmask)
  if probs.ndim != 1:
    raise ValueError(
      f"sample_draft: `logits` must have shape (V,), got {tuple(jnp.shape(logits))} instead. "
      "Use jax.vmap for a batch."
    )
  u = jax.random.uniform(key, (), dtype=probs.dtype)
  return DraftSample(sample_index(probs, u), probs)


def sample_unchecked(key: jax.Array, logits: jax.Array, params: SamplingParams,
                     history: History | None = None, bitmask=None) -> DraftSample:
  """:func:`sample_draft` on :func:`process_unchecked` (the decoding loops, which flag
  ``ErrorCode.BAD_PARAMS`` themselves)."""
  probs = process_unchecked(logits, params, history=history, bitmask=bitmask)
  u = jax.random.uniform(key, (), dtype=probs.dtype)
  return DraftSample(sample_index(probs, u), probs)


__all__ = [
  "DraftSample",
  "SamplingParams",
  "process_logits",
  "sample_draft",
]
