"""Host-side converters from the forms engines hold a request in to the arrays the verifiers take.

Engines keep a request's sampling state in different forms: vLLM output token ids (lists),
sglang dense ``[B, V]`` counts, a boolean allowed-token mask ``[B, V]`` (vLLM: ``True`` means
*disallowed*), ``logit_bias`` dicts. The verifiers take fixed-size, ``-1``-padded id arrays and
int32 bitmask words (:class:`~specdec_jax.History`, :class:`~specdec_jax.SamplingParams`, the
``*_bitmask`` arguments); these functions convert, on the host, with the usual errors.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence

import numpy as np


def output_ids_from_counts(counts, max_len: int) -> np.ndarray:
  """Dense output-token counts ``(V,)`` or ``(B, V)`` (sglang's penalizer state) as ``-1``-padded
  id lists ``(max_len,)`` or ``(B, max_len)``, each id repeated as often as it was produced.

  The order of the output is not in the counts: use the result for the penalties, not for
  multi-token bad words (which need the last tokens produced, in order).

  Args:
    counts: non-negative integer counts.
    max_len: static, the padded length; at least each row's total count.

  Returns:
    int32 ids, ascending per row, then ``-1``.

  Example:
    >>> output_ids_from_counts([0, 2, 0, 1], 4).tolist()
    [1, 1, 3, -1]
  """
  counts = np.asarray(counts)
  if counts.ndim not in (1, 2) or counts.dtype.kind not in "iu":
    raise ValueError("output_ids_from_counts: `counts` must be integer counts of shape (V,) or "
                     f"(B, V), got {counts.dtype}{counts.shape} instead.")
  if np.any(counts < 0):
    raise ValueError("output_ids_from_counts: `counts` must be >= 0, got negative entries.")
  rows = np.atleast_2d(counts)
  totals = rows.sum(axis=-1)
  if np.any(totals > max_len):
    raise ValueError(f"output_ids_from_counts: `max_len` = {max_len} must hold every row's "
                     f"{int(totals.max())} counted tokens.")
  out = np.full((rows.shape[0], max_len), -1, np.int32)
  for b, row in enumerate(rows):
    ids = np.repeat(np.arange(row.shape[0], dtype=np.int32), row)
    out[b, :ids.size] = ids
  return out[0] if counts.ndim == 1 else out


def bitmask_from_mask(allowed) -> np.ndarray:
  """A boolean allowed-token mask ``(..., V)`` as int32 bitmask words ``(..., ceil(V / 32))``
  (bit ``i`` of word ``j``: token ``32 j + i``; xgrammar's and llguidance's layout). For vLLM's
  ``allowed_token_ids_mask`` (``True`` = disallowed) pass ``~mask``.

  Example:
    >>> bitmask_from_mask([True, False, True]).tolist()
    [5]
  """
  allowed = np.asarray(allowed, bool)
  vocab = allowed.shape[-1]
  words = -(-vocab // 32)
  padded = np.zeros((*allowed.shape[:-1], words * 32), bool)
  padded[..., :vocab] = allowed
  weights = (np.uint64(1) << np.arange(32, dtype=np.uint64))
  packed = (padded.reshape(*allowed.shape[:-1], words, 32) * weights).sum(axis=-1)
  return packed.astype(np.uint32).view(np.int32)


def bitmask_from_ids(ids: Sequence[int], vocab: int) -> np.ndarray:
  """The bitmask words ``(ceil(V / 32),)`` allowing exactly ``ids``.

  Example:
    >>> bitmask_from_ids([0, 2, 33], 40).tolist()
    [5, 2]
  """
  allowed = np.zeros(vocab, bool)
  ids = np.asarray(ids, np.int64).reshape(-1)
  if np.any((ids < 0) | (ids >= vocab)):
    raise ValueError(f"bitmask_from_ids: `ids` must be token ids in [0, {vocab}), got "
                     f"{ids[(ids < 0) | (ids >= vocab)][:4].tolist()} instead.")
  allowed[ids] = True
  return bitmask_from_mask(allowed)


def logit_bias_arrays(biases: Sequence[Mapping[int, float] | None],
                      size: int) -> tuple[np.ndarray, np.ndarray]:
  """Per-request ``logit_bias`` dicts as fixed-size ``(B, size)`` arrays: the ids (``-1``
  padded) and the values, for :class:`~specdec_jax.SamplingParams`.

  Raises ``ValueError`` for a dict with more than ``size`` entries (a static size an engine
  sets once) or a non-integer id.

  Example:
    >>> ids, values = logit_bias_arrays([{5: 2.0}, None], 2)
    >>> ids.tolist(), values.tolist()
    ([[5, -1], [-1, -1]], [[2.0, 0.0], [0.0, 0.0]])
  """
  ids = np.full((len(biases), size), -1, np.int32)
  values = np.zeros((len(biases), size), np.float32)
  for b, bias in enumerate(biases):
    bias = dict(bias or {})
    if len(bias) > size:
      raise ValueError(f"logit_bias_arrays: request {b}'s `logit_bias` must have at most "
                       f"{size} entries (the static size), got {len(bias)} instead.")
    for j, (token, value) in enumerate(bias.items()):
      if isinstance(token, bool) or not isinstance(token, int | np.integer) or token < 0:
        raise ValueError(f"logit_bias_arrays: request {b}'s `logit_bias` keys must be token "
                         f"ids >= 0, got {token!r} instead.")
      ids[b, j], values[b, j] = int(token), float(value)
  return ids, values


__all__ = ["bitmask_from_ids", "bitmask_from_mask", "logit_bias_arrays",
           "output_ids_from_counts"]
