"""Host and trace-time checks of the packed layout's arguments (:func:`~specdec_jax.packed_verify`
and its vocabulary-parallel form): shapes, dtypes, and the counts against the arrays they index."""

from __future__ import annotations

import numpy as np

from specdec_jax._core.checks import FLOAT
from specdec_jax._core.checks import INT
from specdec_jax._core.checks import KEY
from specdec_jax._core.checks import check_array
from specdec_jax._logits.process import check_params


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


def host_checks(name, num_draft_tokens, draft_token_ids, max_spec_len, params, batch,
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


def no_draft_mask(name, draft_bitmask):
  if draft_bitmask is not None:
    raise ValueError(f"{name}: `draft_bitmask` masks the draft's rows: pass `draft_probs` or "
                     "`draft_logits` with it (point-mass drafts have no rows).")
  return None


__all__ = ["PACKED_ARRAYS", "check_packed", "host_checks", "no_draft_mask"]
