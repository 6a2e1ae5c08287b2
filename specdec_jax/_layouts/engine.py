"""What serving engines hand a verifier besides rows: their sampling-parameter conventions.

vLLM, vllm-project/tpu-inference and sgl-project/sglang-jax write "greedy" and "disabled"
differently from each other and from specdec_jax; :func:`engine_params` maps their per-request
parameters into ours, traced-safe. :func:`flat_tokens` writes a packed result in tpu-inference's
flat output layout.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax._core.checks import INT
from specdec_jax._core.checks import check_array
from specdec_jax._core.checks import check_static_int
from specdec_jax._core.checks import host_array
from specdec_jax._core.checks import is_concrete
from specdec_jax._logits.process import SamplingParams

if TYPE_CHECKING:
  from specdec_jax._core.results import PackedVerifyResult

#: How each engine writes greedy / disabled sampling parameters (``convention=``).
CONVENTIONS = ("specdec", "vllm", "tpu_inference", "sglang")

#: Temperatures below this are greedy under the engines' conventions (tpu-inference's
#: ``_SAMPLING_EPS`` is 1e-5, sglang's 1e-6, vLLM compares with 0).
GREEDY_BELOW = {"specdec": 0.0, "vllm": 1e-5, "tpu_inference": 1e-5, "sglang": 1e-6}


def check_convention(fn: str, convention) -> None:
  """``ValueError`` unless ``convention`` is one of :data:`CONVENTIONS` (checked with or
  without ``params``: a typo such as ``"vLLM"`` is never silently ignored)."""
  if not isinstance(convention, str) or convention not in CONVENTIONS:
    raise ValueError(f"{fn}: `convention` must be one of {CONVENTIONS}, got {convention!r} "
                     "instead.")


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

  ``top_p`` means the same everywhere (``1`` disables). Under every engine convention a
  ``temperature`` of None (vLLM's metadata of an all-greedy batch) means greedy for every
  request. Values that stay out of range after
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
  check_convention("engine_params", convention)
  if convention == "specdec":
    return params
  if params.temperature is None:  # vLLM's metadata of an all-greedy batch
    params = params._replace(temperature=0.0)
  temperature = jnp.asarray(params.temperature)
  if not jnp.issubdtype(temperature.dtype, jnp.floating):
    temperature = temperature.astype(jnp.float32)
  greedy = temperature < GREEDY_BELOW[convention]  # NaN stays NaN (flagged)
  temperature = jnp.where(greedy, jnp.zeros_like(temperature), temperature)
  top_k = params.top_k
  if top_k is not None:
    top_k = jnp.asarray(top_k)
    top_k = jnp.where(top_k < 0, jnp.zeros_like(top_k), top_k)
  return params._replace(temperature=temperature, top_k=top_k)


def all_greedy(params: SamplingParams, convention: str) -> bool:
  """Whether host-known ``params`` make every request greedy (after ``convention``).

  Greedy verification reads no randomness (a draft is kept iff it is the argmax), so the
  packed entry points need neither a key nor uniforms for such a batch. Traced or unknown
  temperatures give False.
  """
  if convention in CONVENTIONS and convention != "specdec" and params.temperature is None:
    return True
  temperature = params.temperature
  if temperature is None or not is_concrete(temperature):
    return False
  try:
    values = np.asarray(temperature, np.float64)
  except (TypeError, ValueError):
    return False  # check_params names the bad value
  if convention == "specdec" or convention not in CONVENTIONS:
    return bool(values.size) and bool(np.all(values <= 0))  # (a negative one is flagged)
  return bool(values.size) and bool(np.all(values < GREEDY_BELOW[convention]))


def row_owners(counts: jax.Array, num_rows: int) -> jax.Array:
  """``(num_rows,)`` int32: the request each packed row belongs to (rows past the last: B - 1).

  ``counts[i]`` rows belong to request ``i``, in request order.
  """
  ends = jnp.cumsum(counts)
  owner = jnp.searchsorted(ends, jnp.arange(num_rows, dtype=ends.dtype), side="right")
  return jnp.minimum(owner, counts.shape[0] - 1).astype(jnp.int32)


def flat_tokens(result: PackedVerifyResult, num_draft_tokens, *, num_slots: int) -> jax.Array:
  """The flat ``[num_slots + B]`` layout of vllm-project/tpu-inference's rejection sampler.

  Slot ``s_i + j`` (``s_i`` = drafts before request ``i``) holds request ``i``'s ``j``-th
  accepted draft or its replacement token at the first rejection, ``-1`` after it; slot
  ``num_slots + i`` holds its bonus token if it accepted every draft, else ``-1``.

  Args:
    result: a :class:`PackedVerifyResult` (``pad_id=-1``).
    num_draft_tokens: ``(B,)`` the counts given to :func:`packed_verify`.
    num_slots: static int ``>= T``, the length of the engine's (padded) draft buffer
      (checked when the counts are concrete; under ``jit`` the engine's buffer holds ``T`` by
      construction).

  Returns:
    int32 ``(num_slots + B,)``.

  Example:
    >>> import jax.numpy as jnp
    >>> from specdec_jax import PackedVerifyResult
    >>> r = PackedVerifyResult(jnp.array([[5, 7, -1], [9, -1, -1]]), jnp.array([2, 1]),
    ...                        jnp.array([1, 0]), jnp.array([2, 1]), jnp.array([True, True]),
    ...                        jnp.array([0, 0]))
    >>> flat_tokens(r, jnp.array([1, 0]), num_slots=2).tolist()   # 7 is request 0's bonus
    [5, -1, 7, 9]
  """
  fn = "flat_tokens"
  num_slots = check_static_int(fn, "num_slots", num_slots, 0)
  batch = result.tokens.shape[0]
  counts = host_array(fn, "num_draft_tokens", num_draft_tokens, INT)
  check_array(fn, "num_draft_tokens", counts, 1, INT)
  if counts.shape != (batch,):
    raise ValueError(f"{fn}: `num_draft_tokens` must have shape ({batch},) (one count per "
                     f"request of `result`), got {tuple(counts.shape)} instead.")
  if is_concrete(counts):
    total = int(np.asarray(counts, np.int64).sum())
    if total > num_slots:
      raise ValueError(f"{fn}: `num_slots` must be >= the number of draft tokens ({total}); "
                       f"got {num_slots}: the accepted tokens would not fit.")
  return _flat_tokens(result, counts, num_slots=num_slots)


@functools.partial(jax.jit, static_argnames=("num_slots",))
def _flat_tokens(result: PackedVerifyResult, counts, *, num_slots: int) -> jax.Array:
  counts = jnp.asarray(counts, jnp.int32)
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
