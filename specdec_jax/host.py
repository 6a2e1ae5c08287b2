"""Host-side API: the problem's stateful ``rng.random()`` interface on top of the pure core."""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax._core.accept import accepts
from specdec_jax._core.checks import FLOAT
from specdec_jax._core.checks import check_host_dtype
from specdec_jax._core.checks import compute_dtype
from specdec_jax._core.errors import row_tolerance
from specdec_jax._core.sampling import sample_index
from specdec_jax._rules.tokenwise import verify


class UniformStream:
  """An ``rng``-like object whose ``.random()`` returns the entries of a vector in order.

  It feeds the stateful API (:func:`speculative_step`, :func:`sample`,
  :mod:`specdec_jax.reference`) the same numbers that :func:`verify` takes as its
  ``uniforms`` argument.

  Args:
    uniforms: 1-D sequence or array of floats in ``[0, 1)``.

  Example:
    >>> stream = UniformStream([0.7, 0.9, 0.1])
    >>> stream.random(), stream.position, stream.remaining
    (0.7, 1, 2)
  """

  def __init__(self, uniforms: Sequence[float] | np.ndarray | jax.Array):
    values = np.asarray(uniforms, dtype=np.float64)
    if values.ndim != 1:
      raise ValueError(
        f"UniformStream: `uniforms` must be 1-D, got shape {values.shape} instead."
      )
    self._values = values
    self._position = 0

  @property
  def position(self) -> int:
    """How many numbers have been returned so far."""
    return self._position

  @property
  def remaining(self) -> int:
    """How many numbers are left."""
    return len(self._values) - self._position

  def random(self) -> float:
    """The next number of the vector."""
    if self._position >= len(self._values):
      raise IndexError(
        f"UniformStream exhausted: all {len(self._values)} uniforms were used and "
        "another .random() was requested."
      )
    value = float(self._values[self._position])
    self._position += 1
    return value

  def __repr__(self) -> str:
    return f"UniformStream(position={self._position}, size={len(self._values)})"


def _x64_if(dtype) -> contextlib.AbstractContextManager:
  """Enable float64 locally (never globally) when the computation needs it."""
  if jnp.dtype(dtype) == jnp.float64:
    return jax.enable_x64(True)
  return contextlib.nullcontext()


def _as_probabilities(name: str, value, rank: int | None, func: str) -> np.ndarray:
  """Convert and check an array of probabilities on the host (``rank=None``: any rank)."""
  try:
    array = np.asarray(value)
  except (ValueError, TypeError):  # ragged nested lists
    raise ValueError(
      f"{func}: `{name}` must be a rectangular array of probabilities (rows of equal length), "
      f"got a ragged {type(value).__name__} instead."
    ) from None
  if array.dtype == bool or jnp.issubdtype(array.dtype, jnp.integer):
    array = array.astype(np.float64)
  if not jnp.issubdtype(array.dtype, jnp.floating):
    raise TypeError(
      f"{func}: `{name}` must hold real floating-point probabilities, got dtype {array.dtype} "
      "instead."
    )
  check_host_dtype(func, name, array, FLOAT)  # float128: JAX cannot hold it
  if rank is not None and array.ndim != rank:
    raise ValueError(
      f"{func}: `{name}` must have rank {rank}, got shape {array.shape} instead."
      + (" For a batch, call jax.vmap(verify) on arrays." if array.ndim > rank else "")
    )
  return array


def _check_rows(name: str, array: np.ndarray, func: str) -> None:
  """Entries finite and non-negative, every row sums to 1 within a dtype-aware tolerance.

  Two passes over the array (row sums in float64, and the minimum); nothing is copied.
  """
  rows = array.reshape(-1, array.shape[-1]) if array.ndim > 1 else array[None]
  if rows.size == 0:
    return
  sums = rows.sum(axis=-1, dtype=np.float64)
  if not np.all(np.isfinite(sums)):
    bad = np.argwhere(~np.isfinite(rows.astype(np.float64)))[0]
    index = tuple(int(b) for b in bad) if array.ndim > 1 else (int(bad[1]),)
    raise ValueError(
      f"{func}: `{name}` must be finite, got {rows[tuple(bad)]} at index {index}."
    )
  if rows.min() < 0:
    bad = np.argwhere(rows < 0)[0]
    index = tuple(int(b) for b in bad) if array.ndim > 1 else (int(bad[1]),)
    raise ValueError(
      f"{func}: `{name}` must be non-negative, got {rows[tuple(bad)]} at index {index}."
    )
  tol = row_tolerance(array.dtype)
  off = np.abs(sums - 1.0) > tol
  if np.any(off):
    row = int(np.argmax(off))
    where = f" (row {row})" if array.ndim > 1 else ""
    what = f"every row of `{name}`" if array.ndim > 1 else f"`{name}`"
    raise ValueError(
      f"{func}: {what} must sum to 1 within {tol:.2g} (for {array.dtype}), "
      f"got a sum of {float(sums[row]):.10g}{where}."
    )


def _check_rng(rng, func: str) -> None:
  if not callable(getattr(rng, "random", None)):
    raise TypeError(
      f"{func}: `rng` must have a .random() method returning a float in [0, 1) "
      f"(e.g. numpy.random.default_rng(0) or random.Random(0)), got {type(rng).__name__} instead."
    )


def _draw(rng, dtype, func: str) -> np.ndarray:
  """One ``rng.random()`` call, checked and cast to the computation dtype (kept below 1)."""
  value = rng.random()
  if not isinstance(value, numbers.Real) or not 0.0 <= float(value) < 1.0:
    raise ValueError(f"{func}: `rng.random()` must return a float in [0, 1), got {value!r}.")
  cast = np.asarray(value, dtype=dtype)
  if cast >= 1:  # e.g. 0.99999999 rounds to 1.0 in float32
    cast = np.nextafter(np.asarray(1, dtype), np.asarray(0, dtype))
  return cast


@jax.jit
def _sample_jit(probs: jax.Array, u: jax.Array) -> jax.Array:
  dtype = compute_dtype(probs.dtype)
  return sample_index(probs.astype(dtype), u.astype(dtype))


def sample(probs, rng) -> int:
  """Sample an index from ``probs`` by the inverse-CDF method with one ``rng.random()`` call.

  Returns the smallest ``k`` with ``u < cumsum(probs)[k]`` (computed as
  ``u * total < cumsum``); if rounding leaves ``u`` past the last cumulative
  sum, the largest index with positive probability. A zero-probability index is
  never returned.

  Args:
    probs: ``(V,)`` probabilities (list, NumPy or JAX array) summing to 1.
    rng: object with ``.random()`` returning a float in ``[0, 1)``.

  Returns:
    The sampled index, a Python ``int`` in ``[0, V)``.

  Example:
    >>> sample([0.3, 0.3, 0.4], UniformStream([0.1]))
    0

  Reference:
    The inverse transform method (Devroye 1986, Section 2.1): the smallest ``k`` with
    ``u < cumsum(probs)[k]``.
  """
  func = "sample"
  _check_rng(rng, func)
  array = _as_probabilities("probs", probs, 1, func)
  if array.shape[0] < 1:
    raise ValueError(f"{func}: `probs` must have at least one entry, got shape {array.shape}.")
  _check_rows("probs", array, func)
  dtype = compute_dtype(array.dtype)
  u = _draw(rng, dtype, func)
  with _x64_if(dtype):
    return int(_sample_jit(jnp.asarray(array), jnp.asarray(u)))


def _check_draft(draft, vocab: int, func: str) -> np.ndarray:
  try:
    array = np.asarray(draft)
  except (ValueError, TypeError):
    raise ValueError(
      f"{func}: `draft` must be a 1-D array of token ids, got a ragged {type(draft).__name__} "
      "instead."
    ) from None
  if array.size == 0:
    array = array.astype(np.int32)
  if not jnp.issubdtype(array.dtype, jnp.integer):
    raise TypeError(
      f"{func}: `draft` must hold integer token ids, got dtype {array.dtype} instead."
    )
  if array.ndim != 1:
    raise ValueError(f"{func}: `draft` must have shape (gamma,), got {array.shape} instead.")
  if array.size and (array.min() < 0 or array.max() >= vocab):
    bad = int(np.argmax((array < 0) | (array >= vocab)))
    raise ValueError(
      f"{func}: `draft` ids must be in [0, V) = [0, {vocab}), got {int(array[bad])} "
      f"at position {bad}."
    )
  return array.astype(np.int32)


def speculative_step(p, q, draft, rng) -> list[int]:
  """Verify ``draft`` against the target, drawing random numbers from ``rng`` as the rule does.

  This is the problem's function: for each position it calls ``rng.random()``
  once for the accept test ``u < p[i, x] / q[i, x]`` and, at the first rejection,
  once more to sample the replacement from the residual ``max(p[i] - q[i], 0)``
  and stops; if every proposal is accepted it calls ``rng.random()`` once more
  for the bonus token from ``p[gamma]``. That is ``n + 2`` calls after a
  rejection at position ``n`` and ``gamma + 1`` when all are accepted, in that
  order, so repeated calls on one generator reproduce :mod:`specdec_jax.reference`
  token for token and leave the generator in the same state.

  Internally the accept tests are made on the host with :func:`accepts`, the
  same function the jitted :func:`verify` scans with, so the draw count is exact;
  the final sample is one jitted :func:`verify` call on the suffix that starts at
  the stop position (the rejected token with its uniform, or an empty draft for
  the bonus), so only the one or two rows it needs are moved to the device.

  Arithmetic follows the input dtype: float64 (also Python lists) is computed in
  float64 with ``jax.enable_x64`` switched on locally; float32 in float32;
  float16/bfloat16 in float32.

  Args:
    p: ``(gamma + 1, V)`` target distributions; list, NumPy or JAX array.
    q: ``(gamma, V)`` draft distributions; ``q[i]`` is what ``draft[i]`` was sampled from.
    draft: ``(gamma,)`` integer token ids in ``[0, V)``; ``gamma >= 0``.
    rng: object with ``.random()`` returning a float in ``[0, 1)`` (a
      ``numpy.random.Generator``, ``random.Random``, :class:`UniformStream`, ...).

  Returns:
    The new tokens: the accepted proposals followed by the replacement or bonus
    token, a list of 1 to ``gamma + 1`` Python ints.

  Raises:
    TypeError / ValueError: naming the argument, what was expected and what was received.

  Example:
    >>> p = [[0.2, 0.5, 0.3], [0.1, 0.1, 0.8], [0.3, 0.3, 0.4]]
    >>> q = [[0.5, 0.3, 0.2], [0.2, 0.2, 0.6]]
    >>> speculative_step(p, q, [1, 2], UniformStream([0.7, 0.9, 0.1]))
    [1, 2, 0]
    >>> speculative_step(p, q, [0, 2], UniformStream([0.7, 0.9, 0.1]))
    [2]

  Reference:
    Leviathan, Kalman, Matias, "Fast Inference from Transformers via Speculative
    Decoding", ICML 2023, arXiv:2211.17192, Algorithm 1.
  """
  func = "speculative_step"
  _check_rng(rng, func)
  p_arr = _as_probabilities("p", p, 2, func)
  vocab = p_arr.shape[1]
  q_arr = _as_probabilities("q", q, None, func)
  if q_arr.size == 0 and q_arr.ndim == 1:  # gamma = 0 written as `q=[]`
    q_arr = np.zeros((0, vocab), dtype=p_arr.dtype)
  q_arr = _as_probabilities("q", q_arr, 2, func)
  if vocab < 1:
    raise ValueError(f"{func}: `p` must have V >= 1 columns, got shape {p_arr.shape} instead.")
  draft_arr = _check_draft(draft, vocab, func)
  gamma = draft_arr.shape[0]
  if p_arr.shape != (gamma + 1, vocab):
    raise ValueError(
      f"{func}: `p` must have shape (gamma + 1, V) = ({gamma + 1}, {vocab}) for gamma = {gamma} "
      f"(the length of `draft`), got {p_arr.shape} instead."
    )
  if q_arr.shape != (gamma, vocab):
    raise ValueError(
      f"{func}: `q` must have shape (gamma, V) = ({gamma}, {vocab}) for gamma = {gamma} and "
      f"V = {vocab} (from `p`), got {q_arr.shape} instead."
    )
  _check_rows("p", p_arr, func)
  _check_rows("q", q_arr, func)

  dtype = compute_dtype(p_arr.dtype, q_arr.dtype)
  positions = np.arange(gamma)
  p_x = p_arr[positions, draft_arr].astype(dtype)
  q_x = q_arr[positions, draft_arr].astype(dtype)
  accepted, rejected = 0, False
  for i in range(gamma):
    u = _draw(rng, dtype, func)
    if not accepts(u, p_x[i], q_x[i]):
      rejected = True
      break
    accepted += 1
  final = _draw(rng, dtype, func)

  # The accept decisions above are final (they came from the same `accepts` that
  # verify uses). What remains is one step of verify on the suffix that starts at the
  # stop position: a one-token draft that verify rejects with the same uniform, or
  # an empty draft whose bonus token comes from p[gamma]. Only those rows reach JAX.
  if rejected:
    n = accepted
    sub = (p_arr[[n, n]], q_arr[[n]], draft_arr[[n]], np.stack([u, final]))
  else:
    sub = (p_arr[[gamma]], q_arr[:0], draft_arr[:0], np.stack([final]))
  with _x64_if(dtype):
    result = verify(*sub)  # NumPy in, one transfer per argument inside the jitted call
    tokens, num_uniforms = jax.device_get((result.tokens, result.num_uniforms))
  token = tokens[0]
  if int(num_uniforms) != 1 + rejected:  # the rule lives in `accepts`; this cannot drift
    raise RuntimeError(
      f"{func}: internal error, the accept decisions of the host and of verify disagree."
    )
  return [*(int(x) for x in draft_arr[:accepted]), int(token)]
