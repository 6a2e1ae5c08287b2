"""What serving engines hand a verifier besides rows: their sampling-parameter conventions.

vLLM, vllm-project/tpu-inference and sgl-project/sglang-jax write "greedy" and "disabled"
differently from each other and from specdec_jax; :func:`engine_params` maps their per-request
parameters into ours, traced-safe. :func:`rows_params` expands per-request parameters to the
packed rows each request owns.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specdec_jax._logits import SamplingParams

#: How each engine writes greedy / disabled sampling parameters (``convention=``).
CONVENTIONS = ("specdec", "vllm", "tpu_inference", "sglang")

#: Temperatures below this are greedy under the engines' conventions (tpu-inference's
#: ``_SAMPLING_EPS`` is 1e-5, sglang's 1e-6, vLLM compares with 0).
GREEDY_BELOW = {"specdec": 0.0, "vllm": 1e-5, "tpu_inference": 1e-5, "sglang": 1e-6}


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


def rows_params(params: SamplingParams, owners: jax.Array) -> SamplingParams:
  """Per-request (or shared scalar) parameters expanded to packed rows."""
  def expand(v):
    if v is None:
      return None
    v = jnp.asarray(v)
    return jnp.broadcast_to(v, owners.shape) if v.ndim == 0 else v[owners]
  return SamplingParams(*(expand(v) for v in params))

