"""Verification on the packed, ragged layouts that serving engines keep.

vLLM, vllm-project/tpu-inference and sgl-project/sglang-jax never hold ``(B, gamma + 1, V)``
arrays: the drafts of a batch are concatenated (``draft_token_ids [T]``, ``num_draft_tokens
[B]``) and so are the target rows (``[T, V]``, or ``[T + B, V]`` with each request's bonus
row after its draft rows). :func:`packed_verify` takes those arrays as they are: each request
reads its gathered scalars and its stop row in place (row offsets into the shared arrays), so
nothing is padded, copied or one-hot encoded. Point-mass drafts (n-gram, prompt lookup, greedy
drafters: ``draft_probs=None``) are handled by the rule itself, a caller-sampled bonus token is
emitted as given, logits are processed per request (greedy rows mixed with sampled ones), and
the engines' sentinels are mapped by ``convention``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax._block import block_verify_rows
from specdec_jax._checks import FLOAT
from specdec_jax._checks import INT
from specdec_jax._checks import KEY
from specdec_jax._checks import check_array
from specdec_jax._checks import check_static_int
from specdec_jax._checks import compute_dtype
from specdec_jax._checks import host_array
from specdec_jax._errors import ErrorCode
from specdec_jax._errors import flag
from specdec_jax._logits import SamplingParams
from specdec_jax._logits import check_params
from specdec_jax._logits import params_error
from specdec_jax._logits import process_rows
from specdec_jax._verify import verify_rows

#: The chain rules :func:`packed_verify` can run (``rule=``).
PACKED_RULES = {"token": verify_rows, "block": block_verify_rows}

#: How each engine writes greedy / disabled sampling parameters (``convention=``).
CONVENTIONS = ("specdec", "vllm", "tpu_inference", "sglang")

#: Temperatures below this are greedy under the engines' conventions (tpu-inference's
#: ``_SAMPLING_EPS`` is 1e-5, sglang's 1e-6, vLLM compares with 0).
GREEDY_BELOW = {"specdec": 0.0, "vllm": 1e-5, "tpu_inference": 1e-5, "sglang": 1e-6}


class PackedVerifyResult(NamedTuple):
  """What :func:`packed_verify` produced for a batch of ``B`` requests.

  Attributes:
    tokens: int32 ``(B, max_spec_len + 1)``: per request its accepted drafts, then the
      replacement (first rejection) or bonus token, then ``pad_id`` (vLLM's layout; see
      :func:`flat_tokens` for tpu-inference's).
    num_tokens: int32 ``(B,)`` new tokens per request, ``num_accepted + 1``.
    num_accepted: int32 ``(B,)`` accepted drafts per request.
    valid: bool ``(B,)``: everything the request's step read was in range.
    error: int32 ``(B,)`` :class:`~specdec_jax.ErrorCode` bits; 0 when ``valid``.
  """

  tokens: jax.Array
  num_tokens: jax.Array
  num_accepted: jax.Array
  valid: jax.Array
  error: jax.Array


def engine_params(params: SamplingParams, convention: str = "specdec") -> SamplingParams:
  """An engine's per-request sampling parameters in specdec_jax's convention (traced-safe).

  specdec_jax: temperature ``0`` is greedy, ``top_k = 0`` and ``top_p = 1`` disable. The
  engines write these differently; every mapping below is a ``jnp.where``, so it works on
  traced ``(B,)`` arrays inside a jitted engine step:

  * ``"vllm"``: temperature below ``1e-5`` (0, or -1 in older versions) is greedy;
    ``top_k`` ``<= 0`` (0 or -1) disables.
  * ``"tpu_inference"``: temperature below ``1e-5`` (its ``-1`` greedy and padding rows) is
    greedy; ``top_k <= 0`` disables (``-1`` for ``top_k >= V``).
  * ``"sglang"``: temperature below ``1e-6`` is greedy; ``top_k`` ``-1`` (or ``1 << 30``,
    ``TOP_K_ALL``, which is ``>= V`` and so keeps everything anyway) disables.

  ``top_p`` means the same everywhere (``1`` disables). Values that stay out of range after
  the mapping (a NaN temperature, ``top_p`` 0) are flagged ``BAD_PARAMS`` as usual.

  Args:
    params: :class:`SamplingParams` with scalar or ``(B,)`` fields in the engine's convention.
    convention: one of :data:`CONVENTIONS`.

  Returns:
    :class:`SamplingParams` in specdec_jax's convention.

  Example:
    >>> import jax.numpy as jnp
    >>> p = engine_params(SamplingParams(jnp.array([-1.0, 0.7]), jnp.array([-1, 20])),
    ...                   "tpu_inference")
    >>> p.temperature.tolist(), p.top_k.tolist()
    ([0.0, 0.699999988079071], [0, 20])
  """
  if convention not in CONVENTIONS:
    raise ValueError(f"engine_params: `convention` must be one of {CONVENTIONS}, got "
                     f"{convention!r} instead.")
  if convention == "specdec":
    return params
  temperature = jnp.asarray(params.temperature)
  if not jnp.issubdtype(temperature.dtype, jnp.floating):
    temperature = temperature.astype(jnp.float32)
  greedy = temperature < GREEDY_BELOW[convention]  # NaN stays NaN (flagged)
  temperature = jnp.where(greedy, jnp.zeros_like(temperature), temperature)
  top_k = params.top_k
  if top_k is not None:
    top_k = jnp.asarray(top_k)
    top_k = jnp.where(top_k < 0, jnp.zeros_like(top_k), top_k)
  return SamplingParams(temperature, top_k, params.top_p)


def row_owners(counts: jax.Array, num_rows: int) -> jax.Array:
  """``(num_rows,)`` int32: the request each packed row belongs to (rows past the last: B - 1).

  ``counts[i]`` rows belong to request ``i``, in request order.
  """
  ends = jnp.cumsum(counts)
  owner = jnp.searchsorted(ends, jnp.arange(num_rows, dtype=ends.dtype), side="right")
  return jnp.minimum(owner, counts.shape[0] - 1).astype(jnp.int32)


def _per_row(params: SamplingParams, owners: jax.Array) -> SamplingParams:
  """Per-request (or shared scalar) parameters expanded to packed rows."""
  def expand(v):
    if v is None:
      return None
    v = jnp.asarray(v)
    return jnp.broadcast_to(v, owners.shape) if v.ndim == 0 else v[owners]
  return SamplingParams(*(expand(v) for v in params))


def check_packed(name, draft_token_ids, num_draft_tokens, target, draft, bonus_token_ids,
                  uniforms, max_spec_len, bonus_rows, target_name, draft_name):
  """Trace-time checks of the packed arrays. Returns ``(B, T, V)``."""
  check_array(name, "draft_token_ids", draft_token_ids, 1, INT, batch_hint=False)
  check_array(name, "num_draft_tokens", num_draft_tokens, 1, INT, batch_hint=False)
  check_array(name, target_name, target, 2, FLOAT, batch_hint=False)
  batch, total = num_draft_tokens.shape[0], draft_token_ids.shape[0]
  vocab = target.shape[1]
  if batch < 1 or vocab < 1:
    raise ValueError(f"{name}: need B >= 1 requests (`num_draft_tokens` of shape (B,)) and "
                     f"V >= 1 columns in `{target_name}`, got B = {batch}, V = {vocab}.")
  if bonus_rows and target.shape[0] < batch:
    raise ValueError(f"{name}: `{target_name}` must have at least one bonus row per request "
                     f"(B = {batch}) with `bonus_rows=True`, got shape {tuple(target.shape)}.")
  if draft is not None:
    check_array(name, draft_name, draft, 2, FLOAT, batch_hint=False)
    if draft.shape[1] != vocab:
      raise ValueError(f"{name}: `{draft_name}` must have V = {vocab} columns (from "
                       f"`{target_name}`), got shape {tuple(draft.shape)} instead.")
  if bonus_token_ids is not None:
    check_array(name, "bonus_token_ids", bonus_token_ids, 1, INT, batch_hint=False)
    if bonus_token_ids.shape[0] != batch:
      raise ValueError(f"{name}: `bonus_token_ids` must have shape (B,) = ({batch},), got "
                       f"{tuple(bonus_token_ids.shape)} instead.")
  elif not bonus_rows:
    raise ValueError(f"{name}: without `bonus_token_ids` the bonus token is sampled from each "
                     "request's bonus row: `bonus_rows` must be True (target rows [T + B, V]).")
  if uniforms is not None:
    check_array(name, "uniforms", uniforms, 2, FLOAT, batch_hint=False)
    if tuple(uniforms.shape) != (batch, max_spec_len + 1):
      raise ValueError(f"{name}: `uniforms` must have shape (B, max_spec_len + 1) = ({batch}, "
                       f"{max_spec_len + 1}), got {tuple(uniforms.shape)} instead.")
  return batch, total, vocab


def _draw_uniforms(name: str, key, batch: int, count: int, dtype) -> jax.Array:
  """``(B, count)`` uniforms from one key, or from ``B`` keys (one row per request's key)."""
  dtype_of = getattr(key, "dtype", None)
  shape = tuple(getattr(key, "shape", ()))
  typed = dtype_of is not None and jnp.issubdtype(dtype_of, jax.dtypes.prng_key)
  if (typed and shape == ()) or (dtype_of == jnp.uint32 and shape == (2,)):
    return jax.random.uniform(key, (batch, count), dtype=dtype)
  if (typed and shape == (batch,)) or (dtype_of == jnp.uint32 and shape == (batch, 2)):
    return jax.vmap(lambda k: jax.random.uniform(k, (count,), dtype=dtype))(key)
  raise TypeError(f"{name}: `key` must be one jax.random key or B = {batch} keys (one per "
                  f"request), got {type(key).__name__} of dtype {dtype_of} and shape {shape}.")


def _host_checks(name, num_draft_tokens, draft_token_ids, max_spec_len, params, batch,
                 target, draft, bonus_rows, target_name, draft_name):
  """Host values checked on the host; JAX arrays are not read back (no device round trip),
  their values are flagged under jit like traced ones."""
  if isinstance(num_draft_tokens, np.ndarray) and num_draft_tokens.ndim == 1:
    counts = np.asarray(num_draft_tokens)
    bad = (counts < 0) | (counts > max_spec_len)
    if bad.any():
      raise ValueError(f"{name}: `num_draft_tokens` must be in [0, max_spec_len] = [0, "
                       f"{max_spec_len}], got {counts.tolist()} instead.")
    if counts.sum() > draft_token_ids.shape[0]:
      raise ValueError(f"{name}: `num_draft_tokens` sums to {int(counts.sum())}, more than the "
                       f"{draft_token_ids.shape[0]} entries of `draft_token_ids`.")
    needed = int(counts.sum()) + (batch if bonus_rows else 0)
    if getattr(target, "ndim", 0) == 2 and target.shape[0] < needed:
      layout = "T + B (draft rows and a bonus row per request)" if bonus_rows else "T"
      raise ValueError(f"{name}: `{target_name}` must have at least {layout} = {needed} rows "
                       f"for these counts, got shape {tuple(target.shape)} instead.")
    if getattr(draft, "ndim", 0) == 2 and draft.shape[0] < counts.sum():
      raise ValueError(f"{name}: `{draft_name}` must have at least T = {int(counts.sum())} rows "
                       f"for these counts, got shape {tuple(draft.shape)} instead.")
  if params is not None:
    check_params(params, name, batch=batch, host_only=True)


PACKED_ARRAYS = {"draft_token_ids": INT, "num_draft_tokens": INT, "target_probs": FLOAT,
                 "target_logits": FLOAT, "draft_probs": FLOAT, "draft_logits": FLOAT,
                 "bonus_token_ids": INT, "key": KEY, "uniforms": FLOAT}
STATIC = ("max_spec_len", "bonus_rows", "rule", "convention", "pad_id")


def packed_verify(draft_token_ids, num_draft_tokens, *, max_spec_len: int, target_probs=None,
                  target_logits=None, draft_probs=None, draft_logits=None,
                  bonus_token_ids=None, params: SamplingParams | None = None, key=None,
                  uniforms=None, bonus_rows: bool | None = None, rule: str = "token",
                  convention: str = "specdec", pad_id: int = -1) -> PackedVerifyResult:
  """Exact verification of a packed, ragged batch, reading every row in place (jitted).

  Request ``i`` proposed ``n_i = num_draft_tokens[i]`` tokens, stored at
  ``draft_token_ids[s_i : s_i + n_i]`` with ``s_i = n_0 + ... + n_{i-1}``. Its target rows
  are ``target[s_i + i : s_i + i + n_i + 1]`` with ``bonus_rows=True`` (vLLM's interleaved
  ``[T + B, V]``: draft rows, then the request's bonus row) or ``target[s_i : s_i + n_i]``
  with ``bonus_rows=False`` (tpu-inference's ``[T, V]``; the bonus token is then
  ``bonus_token_ids[i]``, sampled by the caller). Its draft rows are ``draft[s_i : s_i +
  n_i]``; without draft probabilities the drafts are point masses (``q = e_x``: accept with
  probability ``p(x)``, resample from ``p`` without ``x``), which is exact for any drafter
  that picks its tokens deterministically (n-gram, prompt lookup, greedy EAGLE/MTP heads).
  Each request then runs :func:`~specdec_jax.verify` (``rule="token"``) or
  :func:`~specdec_jax.block_verify` (``rule="block"``) with the uniforms ``uniforms[i]``:
  slot ``j`` tests draft ``j``, the slot after the last test draws the final token; a
  request that accepts everything emits ``bonus_token_ids[i]`` when given (no uniform read,
  its bonus row never read). Arrays may be longer than ``T`` (static engine buffers): rows
  past the counts are never read.

  Nothing of shape ``(B, max_spec_len, V)`` is formed: per request the ``2 * n_i``
  gathered probabilities and the stop row are read from the packed arrays (with
  ``target_logits``, every row is processed once, in place of the array; the sort-free
  top-k/top-p of :func:`~specdec_jax.process_logits`).

  Multi-host: a global array that spans several processes (``jax.distributed``) is
  accepted and never read on the host; its values are checked under ``jit`` and flagged in
  ``error``.

  Args:
    draft_token_ids: ``(T,)`` int, the drafts of all requests, concatenated.
    num_draft_tokens: ``(B,)`` int in ``[0, max_spec_len]``, summing to at most ``T``.
    max_spec_len: static int ``>= 0``, the width of the output (``S``).
    target_probs: ``(>= T + B, V)`` or ``(>= T, V)`` target probabilities (processed), or
    target_logits: the same rows as logits, processed with ``params`` per request.
    draft_probs: optional ``(>= T, V)``: the law each draft was sampled from, or
    draft_logits: optional draft logits, processed with ``params`` (as :func:`sample_draft`).
      Neither: point-mass drafts.
    bonus_token_ids: optional ``(B,)`` int, bonus tokens sampled by the caller.
    params: :class:`SamplingParams` with scalar or ``(B,)`` fields (``target_logits`` only).
    key: one ``jax.random`` key (uniforms ``uniform(key, (B, S + 1))``) or ``B`` keys (one
      ``uniform(key_i, (S + 1,))`` per request: results independent of batch composition), or
    uniforms: ``(B, S + 1)`` floats in ``[0, 1)``.
    bonus_rows: static bool, see above; default: True without ``bonus_token_ids``.
    rule: static ``"token"`` or ``"block"``.
    convention: static, how ``params`` writes greedy and "disabled" (:func:`engine_params`).
    pad_id: static int for the unused slots of ``tokens``.

  Returns:
    :class:`PackedVerifyResult` with ``tokens (B, S + 1)``.

  Raises:
    ValueError / TypeError: on shapes, dtypes, static arguments, and concrete counts or
      parameters out of range. Under an outer ``jit`` traced values are clipped and flagged:
      ``BAD_NUM_DRAFT`` (counts), ``BAD_PARAMS``, ``TOKEN_OUT_OF_RANGE`` (a given bonus id),
      and the value codes of :func:`~specdec_jax.verify`.

  Example:
    >>> import jax.numpy as jnp
    >>> p = jnp.array([[0.1, 0.9], [0.5, 0.5], [0.2, 0.8]])  # request 0: 1 draft + bonus row;
    >>> # request 1: no drafts, only its bonus row (vLLM's interleaved [T + B, V])
    >>> r = packed_verify(jnp.array([1]), jnp.array([1, 0]), max_spec_len=2, target_probs=p,
    ...                   uniforms=jnp.array([[0.5, 0.3, 0.0], [0.6, 0.0, 0.0]]))
    >>> r.tokens.tolist(), r.num_tokens.tolist()
    ([[1, 0, -1], [1, -1, -1]], [2, 1])

  Reference:
    Leviathan, Kalman, Matias (2023), arXiv:2211.17192; Sun et al., "Block Verification
    Accelerates Speculative Decoding" (2025), arXiv:2403.10444; the packed layouts of
    vLLM V1 (``rejection_sampler.py``) and vllm-project/tpu-inference (``RejectionSampler``).
  """
  name = "packed_verify"
  args = dict(draft_token_ids=draft_token_ids, num_draft_tokens=num_draft_tokens,
              target_probs=target_probs, target_logits=target_logits, draft_probs=draft_probs,
              draft_logits=draft_logits, bonus_token_ids=bonus_token_ids, key=key,
              uniforms=uniforms)
  args = {k: host_array(name, k, v, PACKED_ARRAYS[k]) for k, v in args.items()}
  max_spec_len = check_static_int(name, "max_spec_len", max_spec_len, 0)
  if (args["target_probs"] is None) == (args["target_logits"] is None):
    raise ValueError(f"{name}: pass exactly one of `target_probs` and `target_logits`.")
  if args["draft_probs"] is not None and args["draft_logits"] is not None:
    raise ValueError(f"{name}: pass at most one of `draft_probs` and `draft_logits`.")
  if (key is None) == (uniforms is None):
    raise ValueError(f"{name}: pass exactly one of `key` and `uniforms`.")
  if params is not None and args["target_logits"] is None:
    raise ValueError(f"{name}: `params` apply to logits; with `target_probs` the rows are "
                     "already processed (pass `target_logits` to have them processed).")
  if rule not in PACKED_RULES:
    raise ValueError(f"{name}: `rule` must be one of {tuple(PACKED_RULES)}, got {rule!r}.")
  if bonus_rows is None:
    bonus_rows = args["bonus_token_ids"] is None
  if not isinstance(bonus_rows, bool):
    raise ValueError(f"{name}: `bonus_rows` must be a static bool, got {bonus_rows!r}.")
  if params is not None:
    params = engine_params(params, convention)
  elif args["target_logits"] is not None:
    params = SamplingParams()
  logits = args["target_probs"] is None
  for arg in ("draft_token_ids", "num_draft_tokens"):
    check_array(name, arg, args[arg], 1, INT, batch_hint=False)
  _host_checks(name, args["num_draft_tokens"], args["draft_token_ids"], max_spec_len, params,
               jnp.shape(args["num_draft_tokens"])[0] if jnp.ndim(args["num_draft_tokens"]) else 0,
               args["target_logits" if logits else "target_probs"],
               args["draft_logits"] if args["draft_logits"] is not None else args["draft_probs"],
               bonus_rows, "target_logits" if logits else "target_probs",
               "draft_logits" if args["draft_logits"] is not None else "draft_probs")
  return _packed_jit(**args, params=params, max_spec_len=max_spec_len, bonus_rows=bonus_rows,
                     rule=rule, pad_id=pad_id)


@functools.partial(jax.jit, static_argnames=("max_spec_len", "bonus_rows", "rule", "pad_id"))
def _packed_jit(draft_token_ids, num_draft_tokens, target_probs, target_logits, draft_probs,
                draft_logits, bonus_token_ids, key, uniforms, params, *, max_spec_len,
                bonus_rows, rule, pad_id) -> PackedVerifyResult:
  name = "packed_verify"
  logits = target_probs is None
  target = target_logits if logits else target_probs
  draft = draft_logits if draft_logits is not None else draft_probs
  batch, _, _ = check_packed(
    name, draft_token_ids, num_draft_tokens, target, draft, bonus_token_ids, uniforms,
    max_spec_len, bonus_rows, "target_logits" if logits else "target_probs",
    "draft_logits" if draft_logits is not None else "draft_probs")
  if uniforms is None:
    dtypes = [target.dtype] + ([] if draft is None else [draft.dtype])
    uniforms = _draw_uniforms(name, key, batch, max_spec_len + 1, compute_dtype(*dtypes))
  return packed_rows(draft_token_ids, num_draft_tokens, target, draft, bonus_token_ids,
                     uniforms, params, max_spec_len=max_spec_len, bonus_rows=bonus_rows,
                     rule=rule, pad_id=pad_id, draft_is_logits=draft_logits is not None)


def packed_rows(draft_token_ids, num_draft_tokens, target, draft, bonus_token_ids, uniforms,
                params, *, max_spec_len: int, bonus_rows: bool, rule: str, pad_id: int,
                draft_is_logits: bool = False, axis_name: str | None = None
                ) -> PackedVerifyResult:
  """The body of :func:`packed_verify` (traced; ``axis_name``: vocab-parallel rows).

  ``params`` is None for processed probabilities, else the logits are processed per row.
  """
  batch, total = num_draft_tokens.shape[0], draft_token_ids.shape[0]
  vocab = target.shape[1]
  counts = jnp.asarray(num_draft_tokens)
  bad_count = (counts < 0) | (counts > max_spec_len)
  counts = jnp.clip(counts, 0, max_spec_len).astype(jnp.int32)
  starts = jnp.cumsum(counts) - counts
  overflow = starts + counts > total  # more drafts claimed than draft_token_ids holds
  counts = jnp.where(overflow, jnp.clip(total - starts, 0, max_spec_len), counts)
  bad_count = bad_count | overflow
  requests = jnp.arange(batch, dtype=jnp.int32)
  p_offsets = starts + requests if bonus_rows else starts
  # Rows the counts claim beyond the arrays (values an outer jit cannot check): flagged.
  bad_count = bad_count | (p_offsets + counts + int(bonus_rows) > target.shape[0])
  if draft is not None:
    bad_count = bad_count | (starts + counts > draft.shape[0])
  error = flag(bad_count, ErrorCode.BAD_NUM_DRAFT)

  if params is not None:  # logits: each row processed with its request's parameters
    row_counts = counts + 1 if bonus_rows else counts
    target = process_rows(target, _per_row(params, row_owners(row_counts, target.shape[0])))
    if draft is not None and draft_is_logits:
      draft = process_rows(draft, _per_row(params, row_owners(counts, draft.shape[0])))
    error = error | jnp.broadcast_to(params_error(params), (batch,))

  positions = jnp.arange(max_spec_len, dtype=jnp.int32)
  slots = jnp.clip(starts[:, None] + positions[None, :], 0, max(total - 1, 0))
  drafts = draft_token_ids[slots] if total else jnp.zeros((batch, max_spec_len), jnp.int32)
  body = PACKED_RULES[rule]

  def one(ids, u, n, p_offset, q_offset, bonus):
    return body(target, draft, ids, u, n, pad_id=pad_id, vocab=vocab * _devices(axis_name),
                axis_name=axis_name, p_offset=p_offset, q_offset=q_offset, bonus_token=bonus)

  bonus = None if bonus_token_ids is None else bonus_token_ids
  result = jax.vmap(one, in_axes=(0, 0, 0, 0, 0, None if bonus is None else 0))(
    drafts, uniforms, counts, p_offsets, starts, bonus)
  error = result.error | error
  return PackedVerifyResult(tokens=result.tokens, num_tokens=result.num_tokens,
                            num_accepted=result.num_accepted, valid=error == 0, error=error)


def _devices(axis_name: str | None) -> int:
  return 1 if axis_name is None else jax.lax.axis_size(axis_name)


@functools.partial(jax.jit, static_argnames=("num_slots",))
def flat_tokens(result: PackedVerifyResult, num_draft_tokens, *, num_slots: int) -> jax.Array:
  """The flat ``[num_slots + B]`` layout of vllm-project/tpu-inference's rejection sampler.

  Slot ``s_i + j`` (``s_i`` = drafts before request ``i``) holds request ``i``'s ``j``-th
  accepted draft or its replacement token at the first rejection, ``-1`` after it; slot
  ``num_slots + i`` holds its bonus token if it accepted every draft, else ``-1``.

  Args:
    result: a :class:`PackedVerifyResult` (``pad_id=-1``).
    num_draft_tokens: ``(B,)`` the counts given to :func:`packed_verify`.
    num_slots: static int ``>= T``, the length of the engine's (padded) draft buffer.

  Returns:
    int32 ``(num_slots + B,)``.

  Example:
    >>> import jax.numpy as jnp
    >>> r = PackedVerifyResult(jnp.array([[5, 7, -1], [9, -1, -1]]), jnp.array([2, 1]),
    ...                        jnp.array([1, 0]), jnp.array([True, True]), jnp.array([0, 0]))
    >>> flat_tokens(r, jnp.array([1, 0]), num_slots=2).tolist()   # 7 is request 0's bonus
    [5, -1, 7, 9]
  """
  counts = jnp.asarray(num_draft_tokens, jnp.int32)
  width = result.tokens.shape[1]
  starts = jnp.cumsum(counts) - counts
  column = jnp.arange(width, dtype=jnp.int32)
  drafted = column[None, :] < counts[:, None]
  emitted = column[None, :] < result.num_tokens[:, None]
  main = jnp.where(drafted & emitted, result.tokens, -1)
  index = jnp.where(drafted, starts[:, None] + column[None, :], num_slots)  # num_slots: dropped
  out = jnp.full((num_slots,), -1, jnp.int32).at[index.ravel()].set(
    main.ravel().astype(jnp.int32), mode="drop")
  took_bonus = result.num_accepted == counts
  bonus = jnp.where(took_bonus, jnp.take_along_axis(
    result.tokens, jnp.minimum(counts, width - 1)[:, None], axis=1)[:, 0], -1)
  return jnp.concatenate([out, bonus.astype(jnp.int32)])


__all__ = ["CONVENTIONS", "PackedVerifyResult", "engine_params", "flat_tokens", "packed_verify"]
