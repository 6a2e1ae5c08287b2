"""Mutation testing of the core: does the test suite catch small, plausible bugs?

Each entry of :data:`MUTANTS` is a single-point change of the library (one exact snippet of
one file replaced by another) and the tests that should catch it. For every mutant the
script applies the change to a private copy of the repository, runs those tests there with
this interpreter (``python -m pytest -x -q -p no:cacheprovider ...``, ``PYTHONPATH`` set to
the copy so that the copy's ``specdec_jax`` is imported, not the editable install) and
restores the file. A mutant is

* KILLED when the tests fail,
* SURVIVED when they pass (a gap in the tests, or an equivalent mutant to remove),
* STALE when its snippet is not found exactly once (the code moved: update the entry),
* ERROR when pytest could not run the selection (collection error, nothing selected, or the
  mutated file does not compile), TIMEOUT when the run exceeded ``--timeout``.

Before the mutants, the union of their test selections is run once on the unmutated copy
(``--no-baseline`` skips it): a kill only means something if those tests pass without it.

Usage::

  python tools/mutants.py                  # every mutant (make mutants)
  python tools/mutants.py --list           # the list, with each snippet's status
  python tools/mutants.py --only rule-le sampler-no-snap
  python tools/mutants.py --jobs 2         # two copies, two mutants at a time

Exit status 0 only if every selected mutant was KILLED (or TIMEOUT) and the baseline passed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent


class Mutant(NamedTuple):
  id: str
  file: str  # relative to the repository root
  original: str  # must occur exactly once in `file`
  replacement: str
  description: str
  tests: tuple[str, ...]  # pytest arguments: files, node ids, "-k", "expr"


def _m(id_, file, original, replacement, description, *tests) -> Mutant:
  return Mutant(id_, f"specdec_jax/{file}", original, replacement, description, tuple(tests))


T_SAMPLE = "tests/core/test_sample.py"
T_LAZY = "tests/logits/test_lazy_logits.py"
T_TRAPS = "tests/rules/test_traps.py"
T_FEATURE = "tests/decoding/test_feature_adaptive.py"
T_TREE_LOOP = "tests/decoding/test_tree_loop.py"
T_WORKED = "tests/rules/test_worked_examples.py"
T_RAGGED = "tests/rules/test_ragged_and_keys.py"
T_FAST = "tests/rows/test_fast_path.py"
T_BLOCK = "tests/rules/test_block.py"
T_TREE = "tests/rules/test_tree.py"
T_DYNAMIC = "tests/decoding/test_dynamic_tree.py"
T_LOGITS = "tests/logits/test_logits.py"
T_PACKED = "tests/layouts/test_packed.py"
T_KEPT = "tests/logits/test_kept_set.py"
T_BATCH = "tests/rows/test_batch_invariance.py"
T_TEMPLATE = "tests/app/test_chat_template.py"
T_SURFACE = "tests/logits/test_sampling_surface.py"
T_SAMPLING_LOOPS = "tests/decoding/test_sampling_loops.py"
T_SLOTS = "tests/rules/test_agreement.py::test_verify_matches_reference_slot_for_slot_at_one_shape"
T_STRUCT_LOOPS = "tests/decoding/test_structured_loops.py"
T_STRUCT = "tests/structured/test_structured.py"

#: The curated mutants. Keep each selection small: a mutant run should take well under 2 minutes.
MUTANTS: tuple[Mutant, ...] = (
  # --- the accept test (_core/accept.py) ---
  _m("rule-le", "_core/accept.py",
     "return u < acceptance_ratio(p_x, q_x)", "return u <= acceptance_ratio(p_x, q_x)",
     "accept test u <= p/q (accepts p(x) = 0 when u = 0)", T_TRAPS),
  _m("rule-swap-pq", "_core/accept.py",
     "return u < acceptance_ratio(p_x, q_x)", "return u < acceptance_ratio(q_x, p_x)",
     "accept test with p and q swapped (u < q/p)", T_WORKED),
  _m("rule-q0-reject", "_core/accept.py",
     "xp.where(p_x > 0, inf, zero)", "xp.where(p_x > 0, zero, zero)",
     "q(x) = 0 < p(x) rejected instead of always accepted", T_TRAPS, "-k", "zero_q"),
  _m("rule-q0-accept", "_core/accept.py",
     "xp.where(p_x > 0, inf, zero)", "xp.where(p_x > 0, inf, inf)",
     "q(x) = 0 = p(x) accepted (0/0 as a silent accept)", T_TRAPS, "-k", "zero_q"),
  # --- the inverse-CDF sampler (_core/sampling.py) ---
  _m("sampler-no-snap", "_core/sampling.py",
     "  score = jnp.where(w > 0, jnp.where(index <= first, size + index, size - 1 - index), -1)\n"
     "  return jnp.argmax(score).astype(jnp.int32)\n",
     "  return first\n",
     "no snap of a hit (or a miss past the total) to a positive weight", T_SAMPLE),
  _m("sampler-le", "_core/sampling.py",
     "hit = target < cdf", "hit = target <= cdf",
     "smallest k with u <= cumsum[k] instead of u < cumsum[k]", T_SAMPLE),
  _m("sampler-miss-first", "_core/sampling.py",
     "first = jnp.where(hit[first], first, size - 1)", "first = jnp.where(hit[first], first, 0)",
     "past the total: first positive id instead of the last", T_SAMPLE),
  _m("sampler-no-sanitize", "_core/sampling.py",
     "return jnp.where(weights > 0, weights, jnp.zeros_like(weights))", "return weights",
     "NaN and negative weights not zeroed", T_SAMPLE),
  _m("sampler-unscaled-u", "_core/sampling.py",
     "return two_level_inverse_cdf(w, u.astype(dtype) * total)",
     "return two_level_inverse_cdf(w, u.astype(dtype))",
     "u not scaled by the total of unnormalised weights", T_SAMPLE),
  _m("block-pick-rest", "_core/sampling.py",
     "return b, target - (prefix[b] - masses[b])", "return b, target - prefix[b]",
     "block-level pick: remainder measured from the block's end, not its start",
     T_FAST, T_SAMPLE),
  _m("block-mask", "_core/sampling.py",
     "return jnp.where(ids >= lo, values, jnp.zeros_like(values))", "return values",
     "two-level inverse CDF: the previous block's ids in a shifted last slice not masked",
     T_FAST, T_SAMPLE),
  _m("block-start", "_core/sampling.py",
     "return lo, jnp.minimum(lo, size - block)", "return lo, lo",
     "last block's slice start not clamped (dynamic_slice clamps it, ids shift)",
     T_FAST, T_SAMPLE),
  _m("block-masses-tail", "_core/sampling.py",
     "parts.append(w[full * block :].sum(keepdims=True))",
     "parts.append(w[full * block :].max(keepdims=True))",
     "mass of the last, partial block wrong", T_FAST, T_SAMPLE),
  # --- token-wise verification (_rules/tokenwise.py), the chain skeleton (_rows/chain.py) ---
  _m("verify-test-slot", "_rules/tokenwise.py",
     "accepts(uniforms[i], p_x[i], q_x[i])", "accepts(uniforms[i + 1], p_x[i], q_x[i])",
     "accept test at position i reads uniforms[i + 1]", T_WORKED, T_SLOTS),
  _m("verify-final-slot", "_rules/tokenwise.py",
     "block_values, uniforms[num_tests], local_vocab",
     "block_values, uniforms[num_accepted], local_vocab",
     "final sample reads the slot of the rejected test (reuses its uniform)", T_WORKED, T_SLOTS),
  _m("verify-residual-masses", "_rules/tokenwise.py",  # a = c = -1: max(-p + q, 0), the masses only
     "q_rows.slice(q_row_index, 0, vocab), block=block, dtype=dtype)",
     "q_rows.slice(q_row_index, 0, vocab), block=block, dtype=dtype,\n"
     "                                  a=-1, c=-1)",
     "residual block masses from max(q - p, 0)", T_WORKED, T_SLOTS),
  _m("verify-residual-values", "_rules/tokenwise.py",  # the final sample's block values only
     "values = weights(p_rows.slice(row, start, size), q_part, dtype)",
     "values = weights(p_rows.slice(row, start, size), q_part, dtype, a=-1, c=-1)",
     "residual weights inside the block from max(q - p, 0)", T_WORKED),
  _m("verify-no-fallback", "_rules/tokenwise.py",
     "  clean = jnp.where(use_residual | ~rejected, clean, clean_masses(p_masses))\n", "",
     "empty residual: block masses not switched to p[n] (token from the first block)", T_TRAPS),
  _m("verify-fallback-never", "_rules/tokenwise.py",
     "use_residual = rejected & (", "use_residual = rejected & (True or ",
     "empty residual never falls back to p[n]", T_TRAPS),
  _m("verify-stop-row", "_rules/tokenwise.py",
     "  row = num_accepted\n", "  row = num_tests\n",
     "replacement sampled from row n + 1 instead of the rejected row n", T_WORKED, T_SLOTS),
  _m("verify-q-row", "_rules/tokenwise.py",
     "q_row_index = jnp.minimum(row, max(gamma - 1, 0))",
     "q_row_index = jnp.minimum(row + 1, max(gamma - 1, 0))",
     "residual subtracts the next position's q row", T_WORKED),
  _m("verify-in-range", "_rules/tokenwise.py",
     "p_x[i], q_x[i]) & prep.in_range[i]", "p_x[i], q_x[i])",
     "an out-of-range draft id can be accepted (clipped into range)", T_TRAPS),
  _m("verify-num-draft-limit", "_rules/tokenwise.py",
     "return (i < limit) & ~rejected", "return (i < gamma) & ~rejected",
     "num_draft ignored by the accept scan (padded proposals tested)", T_RAGGED),
  _m("chain-num-draft-clip", "_rows/chain.py",
     "return jnp.clip(count, low, high).astype(jnp.int32), bad",
     "return count.astype(jnp.int32), bad",
     "num_draft out of range not clipped", T_RAGGED),
  _m("chain-num-draft-flag", "_rows/chain.py",
     "bad = (count < low) | (count > high)", "bad = count > high",
     "negative num_draft clipped but not flagged", T_RAGGED),
  _m("chain-pad", "_rows/chain.py",
     "tokens = jnp.where(slots < num_accepted, kept, jnp.int32(pad_id))",
     "tokens = jnp.where(slots < num_accepted, kept, jnp.int32(0))",
     "unused slots hold 0 instead of pad_id", T_WORKED),
  _m("flag-draft-range", "_rows/chain.py",
     "in_range, ErrorCode.DRAFT_OUT_OF_RANGE) |", "in_range, ErrorCode.OK) |",
     "error assembly: DRAFT_OUT_OF_RANGE dropped", T_TRAPS),
  _m("flag-num-draft", "_rows/chain.py",
     "bad_limit, ErrorCode.BAD_NUM_DRAFT)", "bad_limit, ErrorCode.OK)",
     "error assembly: BAD_NUM_DRAFT dropped", T_RAGGED),
  _m("flag-final-uniform", "_rows/chain.py",
     "slots < num_uniforms)", "slots < num_uniforms - 1)",
     "error assembly: the final sample's uniform not checked", T_TRAPS),
  _m("flag-value-above-one", "_core/errors.py",
     "values > 1 + tol", "values > jnp.inf",
     "error assembly: a gathered probability above 1 not flagged", T_TRAPS, T_BLOCK,
     "-k", "bad"),
  _m("flag-q-row-sum", "_core/errors.py",
     "off = (jnp.abs(p_sum - 1) > tol) | (rejected & (jnp.abs(q_sum - 1) > tol))",
     "off = jnp.abs(p_sum - 1) > tol",
     "error assembly: the q row of a rejection not checked for normalisation", T_TRAPS),
  # --- block verification (_rules/block.py) ---
  _m("block-h-formula", "_rules/block.py",
     "den = z + (1 - row_b)", "den = z + 1",
     "h_i = Z_i / (Z_i + 1) instead of Z_i / (Z_i + 1 - b_i)", T_BLOCK,
     "-k", "reference or worked or falls_back"),
  _m("block-b-recursion", "_rules/block.py",
     "jnp.minimum(0, prev + r)", "jnp.minimum(0, r)",
     "b_i = min(1, p/q) of position i alone (no product with b_{i-1})", T_BLOCK,
     "-k", "reference or worked or falls_back"),
  _m("block-residual-b", "_rules/block.py",
     "block=block, dtype=dtype, a=row_b)", "block=block, dtype=dtype)",
     "Z_i from max(p - q, 0) without the weight b_i", T_BLOCK,
     "-k", "reference or worked or falls_back"),
  _m("block-final-b", "_rules/block.py",
     "dtype, a=b_tau)", "dtype)",
     "final residual max(p - q, 0) without the weight b_tau", T_BLOCK,
     "-k", "reference or worked or falls_back"),
  _m("block-eta-slot", "_rules/block.py",
     "target_u = uniforms[limit]", "target_u = uniforms[tau]",
     "final sample reads uniforms[tau] instead of uniforms[n]", T_BLOCK,
     "-k", "reference or worked"),
  _m("block-bonus-row", "_rules/block.py",
     "p_rows.slice(limit, 0, vocab)", "p_rows.slice(gamma, 0, vocab)",
     "bonus row p[gamma] instead of p[num_draft]", T_BLOCK,
     "-k", "num_draft or reference or padded_rows"),
  _m("block-no-fallback", "_rules/block.py",
     "clean = jnp.where(use_residual | keep_all, clean_masses(masses), clean_masses(p_masses))",
     "clean = clean_masses(masses)",
     "empty residual: block masses not switched to p[tau]", T_BLOCK,
     "-k", "falls_back or reference or worked"),
  # --- tree verification (_rules/tree_walk.py) ---
  _m("tree-wor-as-iid", "_rules/tree_walk.py",
     "      q_j = jnp.where(jnp.any(known), 0,\n                      "
     "jnp.where(s.n_removed > 0, q_x / jnp.where(q_left > 0, q_left, 1), q_x))",
     "      q_j = q_x",
     "without replacement verified with the i.i.d. law q[u]", T_TREE,
     "-k", "written_out or not_q"),
  _m("tree-wor-unnormalised", "_rules/tree_walk.py",
     "q_x / jnp.where(q_left > 0, q_left, 1)", "q_x",
     "without replacement: q with removed tokens not renormalised", T_TREE,
     "-k", "written_out or not_q"),
  _m("tree-deterministic-q", "_rules/tree_walk.py",
     "      q_j = one\n", "      q_j = p_x\n",
     "deterministic (top-k) children verified with p instead of a point mass", T_TREE,
     "-k", "written_out"),
  # only the tree passes c: the tree's G, rows and entries
  _m("tree-residual-swap", "_rows/residual.py",
     "values = jnp.maximum(p_part - (q_part if c is None else c * q_part), 0)",
     "values = jnp.maximum(p_part - q_part if c is None else c * q_part - p_part, 0)",
     "tree residual max(c q - p, 0)", T_TREE, "-k", "worked or written_out"),
  _m("tree-no-normalise", "_rules/tree_walk.py",
     "r_x = jnp.where(s.raw & ~jnp.any(known), p_x, g_x / s.z)",
     "r_x = jnp.where(s.raw & ~jnp.any(known), p_x, g_x)",
     "accept test of later siblings against the unnormalised residual", T_TREE,
     "-k", "worked or written_out"),
  _m("tree-fallback-frozen", "_rules/tree_walk.py",
     "frozen=jnp.where(empty, t.removed_p, t.frozen)", "frozen=t.frozen",
     "after an empty residual falls back to p[u], the rejected tokens keep weight 0", T_TREE,
     "-k", "not_q or written_out or worked or restores_the_target_weight"),
  _m("tree-per-parent-no-rescale", "_rules/tree_walk.py",
     "coin = jnp.where(a < 1, (s.coin - a) / jnp.where(a < 1, 1 - a, one), s.coin)",
     "coin = s.coin",
     "per-parent coins: the next sibling reads the coin as is, not rescaled", T_TREE,
     "-k", "written_out and per_parent"),
  _m("tree-flag-q-entry", "_rules/tree_walk.py",
     "      error = error | value_codes(q_x, tol)\n", "      pass\n",
     "error assembly: the q entry of a tested child not checked", T_TREE, "-k", "bad"),
  # --- packed layouts (_layouts/packed.py, _rows/chain.py) ---
  _m("packed-offsets-without-bonus-rows", "_layouts/packed.py",
     "p_offsets = starts + requests if bonus_rows else starts",
     "p_offsets = starts if bonus_rows else starts",
     "interleaved target rows read as if there were no bonus rows", T_PACKED, "-k", "interleaved"),
  _m("packed-point-mass-half", "_rows/chain.py",
     "jnp.ones(positions.shape, dtype)", "jnp.full(positions.shape, 0.5, dtype)",
     "point-mass drafts verified with q(x) = 0.5", T_PACKED, "-k", "point_mass"),
  _m("packed-bonus-ignored", "_rows/chain.py",  # shared by token and block; the tests run both
     "token = jnp.where(accepted_all, safe_bonus, token)", "token = token",
     "the caller's bonus token dropped (a token sampled from the wrong row instead)", T_PACKED,
     "-k", "bonus"),
  _m("packed-owner-params", "_layouts/packed.py",
     "row_counts = counts + 1 if bonus_rows else counts", "row_counts = counts",
     "logits rows processed with a neighbour's parameters", T_PACKED, "-k", "logits"),
  # --- logits processing (_logits/transform.py, _logits/threshold.py, _layouts/from_logits.py) ---
  _m("logits-temperature-after-softmax", "_logits/transform.py",
     "  probs = softmax(z, axis_name)\n",
     "  scale = jnp.where(greedy, 1, jnp.asarray(params.temperature, dtype))\n"
     "  probs = softmax(softmax(z * scale, axis_name) / scale, axis_name)\n",
     "temperature applied to the probabilities after a softmax", T_LOGITS,
     "-k", "matches_numpy"),
  _m("logits-topk-ties-high", "_logits/threshold.py",
     "return (z > t_value) | first_true(z == t_value, k - count, axis_name)",
     "return (z > t_value) | first_true((z == t_value)[::-1], k - count, axis_name)[::-1]",
     "top-k ties at the threshold broken toward the higher id", T_LOGITS, "-k", "ties"),
  _m("logits-topk-keeps-all-ties", "_logits/threshold.py",
     "return (z > t_value) | first_true(z == t_value, k - count, axis_name)",
     "return z >= t_value",
     "top-k keeps every tie of the k-th value (more than k survive)", T_LOGITS, "-k",
     "ties or matches_numpy"),
  _m("logits-top-p-le", "_logits/threshold.py",
     "(mass + r.astype(probs.dtype) * p_t < top_p)",
     "(mass + r.astype(probs.dtype) * p_t <= top_p)",
     "top-p keeps a token whose preceding mass equals top_p", T_LOGITS, "-k", "top_p"),
  _m("logits-greedy-ties-high", "_logits/transform.py",
     "one_hot = jax.nn.one_hot(jnp.argmax(x), vocab, dtype=dtype)",
     "one_hot = jax.nn.one_hot(vocab - 1 - jnp.argmax(x[::-1]), vocab, dtype=dtype)",
     "greedy point mass on the last maximal logit, not the first", T_LOGITS, "-k", "ties"),
  _m("lazy-settled-ties", "_logits/cuts.py",
     "  known = (xs > floor[:, None]) | complete[:, None]",
     "  known = (xs >= floor[:, None]) | complete[:, None]",
     "lazy logits: a cut tied with the smallest candidate counts as settled", T_LAZY),
  _m("lazy-cut-id", "_logits/cuts.py",
     "cut = jnp.take_along_axis(ids, last[:, None], axis=-1)[:, 0] + 1",
     "cut = jnp.take_along_axis(ids, last[:, None], axis=-1)[:, 0]",
     "lazy logits: the last kept tie of the top-k/top-p cut dropped", T_LAZY),
  _m("lazy-top-p-inclusive", "_logits/cuts.py",
     "fits = survive & ((before < clipped[:, None])",
     "fits = survive & ((before <= clipped[:, None])",
     "lazy logits: top-p keeps a token whose preceding mass equals top_p", T_LAZY),
  _m("lazy-greedy-last-max", "_logits/passes.py",
     "jnp.min(jnp.where(hits, columns, x.shape[-1] - 1), axis=-1)",
     "jnp.max(jnp.where(hits, columns, 0), axis=-1)",
     "lazy logits: greedy point mass on the last maximal logit of its block", T_LAZY),
  _m("lazy-norm-over-all", "_logits/cuts.py",
     "  norm = jnp.sum(jnp.where(j < kept[:, None], e, jnp.zeros((), dtype)), axis=-1)",
     "  norm = norm_all",
     "lazy logits: the normaliser of the whole row after top-k/top-p", T_LAZY),
  _m("lazy-pieces-stride", "_logits/passes.py",
     "  pieces = x.reshape(rows * count, vocab // count)\n  sums = jnp.sum(jnp.exp(",
     "  pieces = x.T.reshape(rows * count, vocab // count)\n  sums = jnp.sum(jnp.exp(",
     "lazy logits: a long row's pieces taken across rows instead of along it", T_LAZY,
     "-k", "pieces"),
  _m("lazy-nan-left-to-the-max", "_logits/lazy.py",
     "    nan = nan_rows(x, top, words)\n",
     "    nan = jnp.zeros(top.shape, bool)\n",
     "lazy logits: a NaN in a greedy or top-k batch left to the max, which XLA:CPU drops",
     T_LAZY, "-k", "nan"),
  _m("lazy-sharded-candidates-local", "_logits/cuts.py",
     "  values, at = lax.top_k(values, min(CANDIDATES, values.shape[-1]))",
     "  values, at = lax.top_k(values[:, :CANDIDATES], min(CANDIDATES, values.shape[-1]))",
     "vocab-sharded logits: top-k/top-p settled from the first shard's candidates only",
     "tests/logits/test_logits_sharded.py", "-k", "statistics"),
  _m("threshold-tie-block-end", "_logits/threshold.py",
     "  block = jnp.sum(upto < n, dtype=jnp.int32)",
     "  block = jnp.sum(upto <= n, dtype=jnp.int32)",
     "top-k: the n-th tie at the end of a 256-entry block counted into the next block",
     T_LAZY, "-k", "all_equal_row"),
  _m("engine-nan-temperature-greedy", "_layouts/engine.py",
     "  greedy = temperature < GREEDY_BELOW[convention]  # NaN stays NaN (flagged)",
     "  greedy = ~(temperature >= GREEDY_BELOW[convention])",
     "engine conventions: a NaN temperature mapped to greedy (a valid, plausible token)",
     "tests/layouts/test_packed.py", "-k", "nan_temperature"),
  _m("packed-greedy-clears-all", "_layouts/packed.py",
     "    error = jnp.where(greedy & (error & ErrorCode.NOT_NORMALIZED.value == error), 0, error)",
     "    error = jnp.where(greedy, 0, error)",
     "packed: a greedy request's every error cleared, not only an unfilled draft row's",
     "tests/layouts/test_packed.py", "-k", "unfilled"),
  _m("loop-length-unclipped", "decoding/common.py",
     "  stop_len = jnp.where(bad_length | bad_start, prompt_lengths, jnp.minimum(want, capacity))",
     "  stop_len = jnp.where(bad_start, prompt_lengths, jnp.minimum(want, capacity))",
     "loops: a row with a traced prompt length outside [1, P] still generates (flagged, but "
     "its tokens read as output)", "tests/test_reliability.py", "-k", "prompt_lengths_outside"),
  _m("loop-eos-minus-one-is-none", "decoding/args.py",
     "  return jnp.where((eos >= 0) & (eos < vocab), eos, vocab).astype(jnp.int32)",
     "  return jnp.clip(eos, -1, vocab).astype(jnp.int32)",
     "loops: a traced eos_id below 0 read as 'no eos' instead of flagged",
     "tests/test_reliability.py", "-k", "eos_outside"),
  _m("tree-links-backward-ok", "_core/links.py",
     "  out_of_order = (links != -1) & ((links <= jnp.tile(nodes, 2)) | (links >= size))",
     "  out_of_order = (links != -1) & ((links < -1) | (links >= size))",
     "packed trees: a backward sibling link (or a cycle) is walked in index order, unflagged",
     "tests/layouts/test_packed_tree.py", "-k", "malformed"),
  _m("tree-links-twice-ok", "_core/links.py",
     "  return jnp.any(out_of_order) | jnp.any(reached > 1) | (next_sibling[0] != -1)",
     "  return jnp.any(out_of_order) | (next_sibling[0] != -1)",
     "packed trees: a node reached by two links is walked as the child of one, unflagged",
     "tests/layouts/test_packed_tree.py", "-k", "malformed"),
  _m("loop-verifies-processed-rows", "decoding/chain_loop.py",
     'RULE_OF = {verify: "token", block_verify: "block"}',
     "RULE_OF = {}",
     "loops: the named verifiers read a processed copy of every target row again",
     "tests/decoding/test_chain.py", "-k", "lazily"),
  _m("tree-loop-verifies-processed-rows", "decoding/tree_verifier.py",
     "lazily = default and (reads_lazily(logits, params) or not plain)\n",
     "lazily = default and (False or not plain)\n",
     "tree loop: the default verifier reads a processed copy of every target row again",
     T_TREE_LOOP, "-k", "lazily"),
  _m("loop-logits-width-unchecked", "decoding/common.py",
     "  if tuple(logits.shape) != want:",
     "  if tuple(logits.shape[:-1]) != want[:-1]:",
     "loops: a model whose logits are wider than its vocab_size samples ids it says do not exist",
     "tests/test_reliability.py", "-k", "wider"),
  _m("host-top-k-wraps", "_core/checks.py",
     "  if np.all((array >= info.min) & (array <= info.max)):\n    return params\n",
     "  if True:\n    return params\n",
     "a NumPy int64 top_k beyond int32 wraps (2**32 + 1 keeps one token instead of all)",
     "tests/test_reliability.py", "-k", "beyond_int32"),
  _m("pad-id-coerced", "_core/checks.py",
     "  if (isinstance(value, bool) or not isinstance(value, int | np.integer)\n",
     "  if (isinstance(value, bool) or not isinstance(value, int | float | np.integer)\n",
     "a float pad_id (2.7) silently becomes token id 2", "tests/test_reliability.py", "-k",
     "coerced"),
  _m("adaptive-inf-prior", "decoding/adaptive.py",
     "    if not abs(values[field]) <= _LARGEST:",
     "    if not abs(values[field]) <= float('inf'):",
     "an infinite adaptive prior passes (NaN in float32: speculation silently switches off)",
     "tests/test_reliability.py", "-k", "coerced"),
  _m("gguf-head-shape-unchecked", "app/gguf.py",
     '    shapes["output.weight"] = (c.vocab_size, D)',
     "    pass",
     "an output head whose rows contradict llama.vocab_size loads (and generates with error 0)",
     "tests/app/test_gguf.py", "-k", "head-7-rows"),
  _m("gguf-zero-metadata-accepted", "app/gguf.py",
     "not 0 < value < math.inf",
     "not 0 <= value < math.inf",
     "head_count = 0 / block_count = 0 pass the metadata check (ZeroDivisionError, empty model)",
     "tests/app/test_gguf.py", "-k", "head_count-0 or block_count-0"),
  _m("tree-final-coin-ignored", "_rules/tree_walk.py",
     "    u = uniforms[size] if final_coin else u\n",
     "",
     "packed trees: sglang's final coin ignored (the layout's coin draws the final token)",
     "tests/layouts/test_packed_tree.py", "-k", "coin_for_coin"),
  _m("train-draft-one-step-warmup", "app/draft_training.py",
     "  warmup = min(100, steps // 10 + 1, steps - 1)",
     "  warmup = min(100, steps // 10 + 1)",
     "train_draft: a one-step run warms up for its only step (learning rate 0: nothing learnt)",
     "tests/app/test_train_draft.py", "-k", "one_training_step"),
  _m("e2e-tree-accepts-any-draft", "app/e2e.py",
     '  return verifier == "token" or ("+" not in draft and (verifier != "tree" or draft in '
     'DEFAULT_TREE))',
     '  return verifier == "token" or "+" not in draft',
     "CLI: --verifier tree with a draft it cannot use runs a plain-only table (rc 0)",
     "tests/app/test_cli.py", "-k", "would_be_ignored"),
  _m("vp-sampler-block-id", "_core/sampling.py",
     "  candidate = jnp.where(me == owner, me * local_size + k, -1)",
     "  candidate = jnp.where(me == owner, me * block + k, -1)",
     "vocab-parallel sampler: global id from the block size (equal to the slice size while "
     "V / n <= 256)", "tests/layouts/test_sharding.py", "-k", "more_than_one_block"),
  _m("point-rows-no-column", "_rows/sources.py",
     "    columns = self.first_column() + start + jnp.arange(size, dtype=jnp.int32)",
     "    columns = start + jnp.arange(size, dtype=jnp.int32)",
     "vocab-parallel point-mass drafts compared with local, not global, columns",
     "tests/layouts/test_matrix.py", "-k", "point_mass"),
  _m("eagle-head-prefix", "models/eagle.py",
     "head=jnp.take(head_all, ids, axis=0)", "head=head_all[:ids.shape[0]]",
     "the EAGLE head is the first K output rows, not the rows of vocab_ids",
     "tests/models/test_eagle.py"),
  _m("adaptive-fail-on-full-accept", "decoding/adaptive.py",
     "rejected = (proposed > 0) & (accepted < proposed)",
     "rejected = (proposed > 0) & (accepted <= proposed)",
     "a fully accepted step counts as a failure (fewer proposals, same output)",
     T_FEATURE, "-k", "full_acceptance or estimator_in_the_loop"),
  _m("stream-chunk-counter-from-1", "decoding/chain_loop.py",
     "(state, jnp.int32(0), jnp.zeros((gamma + 1,), jnp.int32)))",
     "(state, jnp.int32(1), jnp.zeros((gamma + 1,), jnp.int32)))",
     "streamed chunks run one iteration fewer (chunk_iterations=1 never returns)",
     T_FEATURE, "-k", "chunk_iterations_iterations"),
  _m("caller-bonus-reads-last-uniform", "_rows/chain.py",
     "    num_uniforms = num_uniforms - accepted_all.astype(jnp.int32)\n",
     "",
     "with a caller bonus token the unread last uniform is still range-checked (and counted)",
     "tests/test_reliability.py", "-k", "unread_final"),
  _m("chat-prompt-bound-off-by-one", "app/chat_template.py",
     "      if n > max_chars:", "      if n >= max_chars:",
     "chat templates: a prompt of exactly max_chars characters refused",
     "tests/app/test_chat_template.py", "-k", "prompt_is_bounded"),
  _m("chat-repeat-unchecked", "app/template_limits.py",
     '  if op == "*" and isinstance(a, seq) and isinstance(b, int):',
     '  if op == "*" and isinstance(a, seq) and isinstance(b, str):',
     "chat templates: 'x' * 10**8 built before any size check (100 MB from one expression)",
     "tests/app/test_chat_template.py", "-k", "too_large"),
  _m("logits-params-flag", "_layouts/from_logits.py",  # the chain body's call; the tree's keeps it
     "k=logprobs, mode=logprobs_mode, axis_name=axis_name)\n"
     "  return with_params_error(result, params, vocab, history)",
     "k=logprobs, mode=logprobs_mode, axis_name=axis_name)\n  return result",
     "verify_logits: BAD_PARAMS dropped", T_LOGITS, "-k", "bad_parameters"),
  # --- the chain loop's feature drafts, adaptive speculation, streaming ----------------------
  _m("feature-off-by-one", "decoding/drafts.py",
     "at = jnp.clip(lengths - 1 - start, 0, window - 1)",
     "at = jnp.clip(lengths - 2 - start, 0, window - 1)",
     "the feature draft's first proposal read one position early", T_FEATURE, "-k",
     "right_positions or greedy_equals_plain"),
  _m("feature-window-start", "decoding/chain_loop.py",
     "draft_cache = (feature_cache, feats, s.lengths)",
     "draft_cache = (feature_cache, feats, s.lengths + 1)",
     "the next sync window starts one position late", T_FEATURE, "-k", "perfect"),
  _m("adaptive-ignores-budget", "decoding/chain_loop.py",
     "budget, choose_num_draft(adaptive, s.adapt, gamma=gamma, costs=s.costs))",
     "gamma, choose_num_draft(adaptive, s.adapt, gamma=gamma, costs=s.costs))",
     "adaptive speculation proposes past the token budget", T_FEATURE, "-k", "adaptive"),
  _m("adaptive-counts-frozen", "decoding/adaptive.py",
     "return jnp.where(active[:, None], decay[:, None] * counts + new, counts)",
     "return counts",
     "the acceptance estimate never learns", T_FEATURE, "-k", "cost_model or saves_proposals"),
  _m("adaptive-idle-decay-ignored", "decoding/adaptive.py",
     "jnp.float32(policy.decay), jnp.float32(policy.idle_decay))",
     "jnp.float32(policy.decay), jnp.float32(policy.decay))",
     "iterations without proposals forget as fast as those with", T_FEATURE, "-k",
     "cost_model or update_counts or estimator"),
  _m("stream-chunk-drops-state", "decoding/chain_loop.py",
     "    new = body(state)\n", "    new = body(state)._replace(adapt=state.adapt)\n",
     "streamed chunks lose the adaptive counts", T_FEATURE, "-k", "streamed"),
  _m("feature-sync-too-narrow", "decoding/drafts.py",
     "= run_one(jnp.max(at), [call(w)", "= run_one(jnp.min(at), [call(w)",
     "the feature draft's sync call reads only the fewest new tokens of the batch", T_FEATURE,
     "-k", "sync_call"),
  _m("feature-put-off-slot", "decoding/drafts.py",
     "slot = jnp.clip(lengths - start, 0,", "slot = jnp.clip(lengths - start - 1, 0,",
     "a put-off sync's features appended one slot early", T_FEATURE, "-k", "put_off"),
  _m("feature-put-off-overflows", "decoding/drafts.py",
     "full = jnp.max(lengths - start) >= features.shape[1]",
     "full = jnp.max(lengths - start) > features.shape[1]",
     "the sync put off past a full feature window", T_FEATURE, "-k", "put_off"),
  _m("adaptive-width-off-by-one", "decoding/common.py",
     "lambda carry, k=k: carry[0] == k, loop", "lambda carry, k=k: carry[0] == k + 1, loop",
     "the adaptive target call one token narrower than the proposals", T_FEATURE, "-k",
     "adaptive"),
  # --- feature drafts in the tree loop (EAGLE-2) ---------------------------------------------
  _m("tree-feature-of-the-node", "decoding/tree.py",
     "params_d, node_tokens[:, level], node_features[:, parents[level]],",
     "params_d, node_tokens[:, level], node_features[:, level],",
     "a tree node reads its own (empty) feature slot instead of its parent's prediction",
     T_TREE_LOOP, "-k", "feature_draft_tree"),
  _m("tree-feature-path-shift", "decoding/tree.py",
     "draft_cache = (carry[0], node_features[rows[:, None], path], root + 1)",
     "draft_cache = (carry[0], node_features[rows[:, None], path], root)",
     "the next sync reads the accepted path's features one position early", T_TREE_LOOP, "-k",
     "feature_draft_tree"),
  _m("copy-slots-reads-dst", "models/llama_forward.py",
     "k=cache.k.at[:, rows, :, dst].set(cache.k[:, rows, :, src]),",
     "k=cache.k.at[:, rows, :, dst].set(cache.k[:, rows, :, dst]),",
     "copy_slots leaves the keys of the accepted path where the tree put them",
     "tests/models/test_llama.py", "-k", "copy_slots"),
  # --- EAGLE-3's fused features ---------------------------------------------------------------
  _m("fused-tap-after-the-layer", "models/llama_forward.py",
     "    if k:\n      tapped.append(x)\n    if hi > lo:",
     "    if hi > lo and k == 1:\n      xs = (jnp.arange(lo, lo + 1, dtype=jnp.int32), "
     "jnp.asarray(layer_ids[lo:lo + 1], jnp.int32))\n      (x, cache), _ = lax.scan(body, "
     "(x, cache), xs)\n      lo += 1\n    if k:\n      tapped.append(x)\n    if hi > lo:",
     "the first tapped hidden state read after its layer instead of entering it",
     "tests/models/test_eagle_fused.py", "-k", "tapped"),
  _m("fused-taps-unnormalised", "models/eagle.py",
     "  h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)\n",
     "",
     "the fused hidden states projected without normalising each one",
     "tests/models/test_eagle_fused.py", "-k", "fuses_its_taps"),
  _m("fused-target-reads-the-top-feature", "models/eagle.py",
     "  base = make_model(target_params, target_config, name=name, feature_layers=taps)",
     "  base = make_model(target_params, target_config, name=name)",
     "the fused target hands the draft its top feature, not the fused low/middle/high ones",
     "tests/models/test_eagle_fused.py", "-k", "fuses_its_taps"),
  _m("fused-draft-any-target", "decoding/drafts.py",
     "  if reads is not None and given is not None and reads != given:",
     "  if False:",
     "a fused draft runs with the plain target (exact, but fed features it was not trained on)",
     "tests/models/test_eagle_fused.py", "-k", "refused"),
  # --- EAGLE-2's dynamic tree ------------------------------------------------------------------
  _m("dyntree-rerank-unsorted", "decoding/dynamic_tree.py",
     "chosen = jnp.sort(lax.top_k(cand_scores, tree.num_draft)[1], axis=1)",
     "chosen = lax.top_k(cand_scores, tree.num_draft)[1]",
     "the chosen nodes in confidence order, not breadth-first (a child before its parent)",
     T_DYNAMIC, "-k", "expansion"),
  _m("dyntree-expand-least", "decoding/dynamic_tree.py",
     "chosen = lax.top_k(level_scores[-1], k)[1]", "chosen = lax.top_k(-level_scores[-1], k)[1]",
     "the least confident candidates of a level are expanded", T_DYNAMIC, "-k", "expansion"),
  _m("dyntree-mask-self-only", "decoding/dynamic_tree.py",
     "mask = ancestors[rows, parent_slots] | jax.nn",
     "mask = ancestors[rows, parent_slots] & False | jax.nn",
     "an expanded node sees only itself in the draft's tree slots, not its ancestors",
     T_DYNAMIC, "-k", "expansion"),
  _m("dyntree-root-feature-everywhere", "decoding/dynamic_tree.py",
     "features[rows, parent_slots],", "features[rows, 0 * parent_slots],",
     "every expanded node reads the root's feature instead of its parent's prediction",
     T_DYNAMIC, "-k", "expansion"),
  _m("dyntree-local-confidence", "decoding/dynamic_tree.py",
     "(parent_scores[:, :, None] + logp)", "(0 * parent_scores[:, :, None] + logp)",
     "a candidate ranked by its own probability, not its path's", T_DYNAMIC, "-k", "expansion"),
  _m("tree-mask-row-0-for-all", "models/llama_forward.py",
     "jnp.take_along_axis(tree_mask, at[:, None, :], axis=2)",
     "jnp.take_along_axis(tree_mask[:1], at[:1, None, :], axis=2)",
     "a mask per row: every row attends through the first row's tree",
     "tests/models/test_llama.py", "-k", "one_tree_per_row"),
  # --- one definition of the kept set (issue 44) ---------------------------------------------
  _m("kept-set-top-k-on-scaled", "_logits/transform.py",
     "    keep = top_k_mask(key, params.top_k, axis_name)\n",
     "    keep = top_k_mask(z, params.top_k, axis_name)\n",
     "process_logits cuts top-k on the temperature-scaled logits (ulp-apart logits tie)",
     T_KEPT, "-k", "ulp_apart or every_logits_cell or huge"),
  _m("kept-set-top-p-on-scaled", "_logits/transform.py",
     "    keep = top_p_mask(key, softmax(z, axis_name), top_p, axis_name)\n",
     "    keep = top_p_mask(z, softmax(z, axis_name), top_p, axis_name)\n",
     "process_logits orders top-p by the scaled logits", T_KEPT, "-k", "ulp_apart"),
  _m("kept-set-lazy-fallback-on-scaled", "_logits/cuts.py",
     "lambda: top_k_mask(key, k_eff, axis_name)", "lambda: top_k_mask(z, k_eff, axis_name)",
     "the lazy statistics' bisection fallback cuts top-k on the scaled logits", T_KEPT, "-k",
     "fallback"),
  _m("lazy-fallback-cut-last-id", "_logits/cuts.py",
     "jnp.max(jnp.where(keep & (x == t), ids, -1))", "jnp.max(jnp.where(keep, ids, -1))",
     "lazy bisection fallback: ties cut one past the last kept id, not the last kept tie",
     T_KEPT, "-k", "bisection_fallback"),
  _m("temperature-uncapped", "_logits/transform.py",
     "jnp.minimum(temperature, cap)", "temperature",
     "T = inf divides by inf: a masked logit becomes NaN beside whole-row requests",
     T_KEPT, "-k", "infinite_temperature"),
  _m("temperature-uncapped-batch", "_logits/transform.py",
     "jnp.minimum(temperature, cap)", "temperature",
     "the same, seen as a request that depends on its batch", T_BATCH, "-k",
     "packed_verify and not block and not point and not vocab"),
  _m("packed-tree-greedy-needs-coins", "_layouts/packed_tree.py",
     "    if params is not None and all_greedy(params, convention):",
     "    if False:",
     "packed_tree_verify: an all-greedy batch needs coins again",
     "tests/layouts/test_packed_tree.py", "-k", "needs_no_coins"),
  _m("all-greedy-any", "_layouts/engine.py",
     "bool(np.all(values <= 0))", "bool(np.any(values <= 0))",
     "one greedy request makes the whole batch greedy (a mixed batch runs on zero coins)",
     "tests/layouts/test_packed_tree.py", "-k", "needs_no_coins"),
  _m("packed-tree-draft-dtype-unchecked", "_layouts/packed_tree.py",
     '("target_logits", 2), ("draft_probs", 2),', '("target_logits", 2),',
     "packed_tree_verify: an integer JAX draft_probs reaches NumPy unchecked",
     "tests/layouts/test_packed_tree.py", "-k", "wrong_dtypes"),
  _m("tree-final-coin-per-parent-only", "_rules/tree_walk.py",
     "    u = uniforms[size] if final_coin else u\n",
     "    u = uniforms[size] if final_coin and layout == \"per_parent\" else u\n",
     "packed trees: final_coins honoured only under per_parent",
     "tests/layouts/test_packed_tree.py", "-k", "final_coins_draw"),
  # --- the whole sampling surface (issue 45) --------------------------------------------------
  _m("penalty-prefix-uncounted", "_logits/adjust.py",
     "    count = count_in(jnp.sort(jnp.where(output >= 0, output, NO_ID)), ids) + jnp.sum(",
     "    count = count_in(jnp.sort(jnp.where(output >= 0, output, NO_ID)), ids) + 0 * jnp.sum(",
     "penalties counted without the draft prefix (the peers' bug)", T_SURFACE, "-k",
     "each_parameter and (frequency or presence)"),
  _m("repetition-negative-divided", "_logits/adjust.py",
     "jnp.where(value > 0, value / r, value * r)", "value / r",
     "repetition penalty divides negative logits too (raising them)", T_SURFACE, "-k",
     "fuzz or (each_parameter and repetition)"),
  _m("min-tokens-inclusive", "_logits/adjust.py",
     "(produced < params.min_tokens)", "(produced <= params.min_tokens)",
     "min_tokens holds the stop ids back one token too long", T_SURFACE, "-k",
     "fuzz or (each_parameter and min_tokens)"),
  _m("bias-subtracted", "_logits/adjust.py",
     "    value = value + jnp.sum(jnp.where(matches, bias[None, :], 0), axis=-1)",
     "    value = value - jnp.sum(jnp.where(matches, bias[None, :], 0), axis=-1)",
     "the logit bias subtracted", T_SURFACE, "-k", "fuzz"),
  _m("presence-per-occurrence", "_logits/adjust.py",
     "value - jnp.asarray(params.presence_penalty, dtype) * seen.astype(dtype)",
     "value - jnp.asarray(params.presence_penalty, dtype) * count.astype(dtype)",
     "presence penalty charged per occurrence (a frequency penalty)", T_SURFACE, "-k",
     "fuzz or charged_once"),
  _m("listed-also-dense", "_logits/adjust.py",
     "  dense = dense & ~id_bits(ids, words, first)\n", "",
     "listed tokens left in the dense mask: counted twice in the statistics", T_SURFACE, "-k",
     "fuzz"),
  _m("bad-word-tail-shifted", "_logits/adjust.py",
     "  pos = total - size + jnp.arange(size, dtype=jnp.int32)",
     "  pos = total - size - 1 + jnp.arange(size, dtype=jnp.int32)",
     "bad words matched one token too early", T_SURFACE, "-k", "bad_words or fuzz"),
  _m("edited-slice-window", "_logits/adjust.py",
     "  lo = jnp.searchsorted(edits.ids, ids[0], side=\"left\")",
     "  lo = jnp.searchsorted(edits.ids, ids[0], side=\"right\")",
     "a stop-row slice misses a listed entry at its first column", T_SURFACE, "-k",
     "each_parameter or logprobs_equal"),
  _m("min-p-strict", "_logits/transform.py",
     "  return (z >= jnp.log(jnp.maximum(min_p, jnp.finfo(z.dtype).tiny))) | (min_p <= 0)",
     "  return (z > jnp.log(jnp.maximum(min_p, jnp.finfo(z.dtype).tiny))) | (min_p <= 0)",
     "min_p drops a token exactly at the threshold (the top one at min_p = 1)", T_SURFACE, "-k",
     "fuzz or min_p_one"),
  _m("settle-ignores-min-p", "_logits/cuts.py",
     "      survive = survive & minp_keep\n", "      pass\n",
     "the candidates settle a min_p row as if min_p kept everything", T_SURFACE, "-k",
     "fuzz or min_p or mix"),
  _m("masked-probs-unnormalised", "_rows/sources.py",
     "    return jnp.where(allowed, raw(row, start, size).astype(dtype) / mass[at], 0)",
     "    return jnp.where(allowed, raw(row, start, size).astype(dtype), 0)",
     "masked probability rows read without renormalisation", T_SURFACE, "-k",
     "probability_rows"),
  _m("logprob-without-normaliser", "_rows/logprobs.py",
     "  lp = jnp.where(kept, z - jnp.log(stats.norm), -jnp.inf).astype(dtype)",
     "  lp = jnp.where(kept, z, -jnp.inf).astype(dtype)",
     "logprobs of the unnormalised row", T_SURFACE, "-k", "logprobs_equal"),
  _m("empty-row-emits", "_rows/logprobs.py",
     "    nothing = empty[final_row] & mine", "    nothing = empty[final_row] & False",
     "a row that allows nothing still emits (token 0)", T_SURFACE, "-k", "allows_nothing"),
  _m("tree-logprob-rows", "_rows/logprobs.py",
     "jnp.maximum(path[:-1], 0)", "jnp.maximum(path[1:], 0)",
     "tree logprobs read the next node's row", T_SURFACE, "-k", "logprobs_equal and tree"),
  _m("packed-prefix-offset", "_layouts/packed.py",
     "  position = jnp.clip(jnp.arange(rows.shape[0], dtype=jnp.int32) - offsets[owners], 0,",
     "  position = jnp.clip(jnp.arange(rows.shape[0], dtype=jnp.int32) - offsets[owners] - 1, 0,",
     "packed rows follow one draft fewer than they should", T_SURFACE, "-k",
     "packed_layout and packed_verify and not tree and not vocab"),
  _m("tree-prefix-reversed", "_logits/adjust.py",
     "  at = jnp.clip(depth[:, None] - 1 - j, 0, max(max_depth - 1, 0))",
     "  at = jnp.clip(j, 0, max(max_depth - 1, 0))",
     "a tree node's prefix read leaf first", T_SURFACE, "-k", "prefixes_run_root_first"),
  _m("loop-history-shifted", "decoding/request_rows.py",
     "  at = common.prompt_lengths[:, None] + jnp.arange(size, dtype=jnp.int32)[None]",
     "  at = common.prompt_lengths[:, None] - 1 + jnp.arange(size, dtype=jnp.int32)[None]",
     "loops: a row's output history starts on the prompt's last token", T_SAMPLING_LOOPS,
     "-k", "logprobs_match and plain"),
  _m("loop-logprobs-one-slot-late", "decoding/request_rows.py",
     "  index = jnp.where(slots < counts[:, None], lengths[:, None] + slots, max_len)",
     "  index = jnp.where(slots < counts[:, None], lengths[:, None] + slots + 1, max_len)",
     "loops: each emitted token's logprob recorded one slot late", T_SAMPLING_LOOPS,
     "-k", "logprobs_match and plain"),
  _m("tree-loop-prefix-one-short", "decoding/tree.py",
     "    return prefix, jnp.broadcast_to(jnp.asarray(depths[nodes], jnp.int32),",
     "    return prefix, jnp.broadcast_to(jnp.asarray(np.maximum(depths[nodes] - 1, 0),"
     " jnp.int32),",
     "tree loop: a node's row follows its path without the node itself", T_SAMPLING_LOOPS,
     "-k", "greedy_rows and tree"),
  # --- the application's bounds and files (issue 44) -----------------------------------------
  _m("template-width-digits", "app/template_limits.py",
     'for d in re.findall(r"\\d+", spec))', 'for d in re.findall(r"\\d", spec))',
     "chat templates: a format width of '400000000' read as single digits",
     T_TEMPLATE, "-k", "builder"),
  _m("template-to-bytes-unbounded", "app/template_limits.py",
     '"to_bytes": lambda _n, length=1, *_, **__: width(length),',
     '"to_bytes": lambda _n, length=1, *_, **__: width(_n),',
     "chat templates: int.to_bytes(400000000) not bounded by its length",
     T_TEMPLATE, "-k", "builder"),
  _m("template-block-last-piece", "app/template_env.py",
     "    self.chars += len(piece) if isinstance(piece, str) else limits.size_of(piece)",
     "    self.chars = len(piece) if isinstance(piece, str) else limits.size_of(piece)",
     "chat templates: a block's output counted as its last piece", T_TEMPLATE, "-k", "sum_of"),
  _m("template-joined-last-piece", "app/template_env.py",
     "    n += len(piece)\n", "    n = len(piece)\n",
     "chat templates: self.block() output counted as its last piece", T_TEMPLATE, "-k",
     "sum_of"),
  _m("decode-accepts-v", "app/tokenizer.py",
     "if not 0 <= value < self.vocab_size:", "if not 0 <= value <= self.vocab_size:",
     "Tokenizer.decode accepts the id V", "tests/app/test_tokenizer.py"),
  _m("eagle-rank-only", "models/eagle.py",
     "if tuple(jnp.shape(arrays[name])) != shape:",
     "if len(jnp.shape(arrays[name])) != len(shape):",
     "make_eagle_draft checks only each weight's rank (two layers cut to one)",
     "tests/models/test_eagle.py", "-k", "checks_every_weight_shape"),
  _m("static-count-bool", "decoding/args.py",
     "  if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:",
     "  if not isinstance(value, int | np.integer) or value < 1:",
     "gamma=True runs as gamma 1", "tests/decoding/test_chain.py", "-k",
     "static_counts_are_checked"),
  _m("train-out-over-corpus", "app/train_draft.py",
     "return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))",
     "return a == b",
     "train_draft --out and --corpus compared as spelled", "tests/app/test_train_draft.py",
     "-k", "weights_over_the_corpus"),
  _m("cli-tree-widest-level", "app/cli.py",
     "    if nodes > CONTEXT:", "    if level > CONTEXT:",
     "the --tree bound counts only the widest level", "tests/app/test_cli.py", "-k",
     "cannot_fit_the_context"),
  _m("cli-eagle-always-loaded", "app/e2e.py",
     'if drafts is None or any(d.startswith("eagle") for d in drafts):', "if True:",
     "the EAGLE draft is loaded whatever --draft says", "tests/app/test_cli.py", "-k",
     "loaded_only_when"),
  # --- structured generation (issue 46) -------------------------------------------------------
  _m("grammar-walk-ignores-count", "structured/tables.py",
     "    new = jnp.where(i < count, next_state(grammar, s, token), s)",
     "    new = next_state(grammar, s, token)",
     "grammar: the state walks past the tokens that were not emitted (no rollback)",
     T_STRUCT_LOOPS, "-k", "law and (model or plain)"),
  _m("grammar-mask-ignores-draft-prefix", "decoding/request_rows.py",
     "  return jax.vmap(lambda s, p, n: prefix_state(constrained.grammar, s, p, n))(",
     "  return jax.vmap(lambda s, p, n: s)(",
     "grammar: every row masked by the state before the draft prefix (the bonus row included)",
     T_STRUCT_LOOPS, "-k", "law and model"),
  _m("grammar-forced-token-keeps-draft-q", "decoding/constrained.py",
     "          jnp.where((forced >= 0)[:, None], hot, probs))",
     "          probs)",
     "forced tokens: proposed while the verifier is told the draft's own q", T_STRUCT_LOOPS,
     "-k", "forced_text"),
  _m("grammar-eos-everywhere", "structured/compile.py",
     "  next_state[:, token_class[eos_id]] = np.where(final, np.arange(keep.size), -1)",
     "  next_state[:, token_class[eos_id]] = np.arange(keep.size)",
     "compiled grammar: EOS allowed before the text is complete", T_STRUCT, "-k",
     "agree_with_their_masks"),
  _m("grammar-bad-start-generates", "decoding/common.py",
     "  stop_len = jnp.where(bad_length | bad_start, prompt_lengths, jnp.minimum(want, capacity))",
     "  stop_len = jnp.where(bad_length, prompt_lengths, jnp.minimum(want, capacity))",
     "loops: a row whose traced grammar state is outside the table still generates (flagged)",
     T_STRUCT, "-k", "flagged_under_jit"),
  _m("grammar-stack-no-offset", "structured/tables.py",
     "np.where(c.next_state >= 0, c.next_state + offset, -1)",
     "np.where(c.next_state >= 0, c.next_state, -1)",
     "stacked grammars: a second grammar's next states point into the first's",
     T_STRUCT, "-k", "validates and plain"),
  # --- multi-device and multi-host --------------------------------------------------------
  _m("loop-not-data-parallel", "decoding/data_parallel.py",
     "  split = batch_axis(args[prompt_index])\n  if split is None:",
     "  split = batch_axis(args[prompt_index])\n  if True:",
     "a batch split over a mesh axis runs as one partitioned loop (gathers across the data axis)",
     "tests/models/test_llama_sharding.py", "-k", "crosses"),
)


# ---------------------------------------------------------------------------------------------


def _repo_files(root: Path) -> list[str]:
  """Tracked and untracked-but-not-ignored files (what a commit could hold), or a plain walk."""
  try:
    out = subprocess.run(
      ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=root,
      check=True, capture_output=True).stdout
    return [f for f in out.decode().split("\0") if f and (root / f).is_file()]
  except (OSError, subprocess.CalledProcessError):
    skip = {".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis"}
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
      dirnames[:] = [d for d in dirnames if d not in skip and not d.endswith(".egg-info")]
      files += [os.path.relpath(os.path.join(dirpath, f), root) for f in filenames]
    return files


def _copy_repo(root: Path, dest: Path) -> None:
  for rel in _repo_files(root):
    if rel.startswith((".venv/", ".git/")):
      continue
    target = dest / rel
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(root / rel, target)


def _env(copy: Path) -> dict[str, str]:
  env = dict(os.environ)
  env["PYTHONPATH"] = str(copy) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
  env["PYTHONDONTWRITEBYTECODE"] = "1"
  return env


def _check_import(copy: Path) -> None:
  """The copy's package must be the one imported (not the editable install)."""
  out = subprocess.run([sys.executable, "-c", "import specdec_jax; print(specdec_jax.__file__)"],
                       cwd=copy, env=_env(copy), capture_output=True, text=True)
  where = Path(out.stdout.strip() or "?").resolve()
  if out.returncode or copy.resolve() not in where.parents:
    raise SystemExit(f"mutants: the copy's specdec_jax is not the one imported: {where}\n"
                     f"{out.stderr}")


def _pytest(copy: Path, tests: tuple[str, ...], timeout: float) -> tuple[int | None, str]:
  cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
  try:
    out = subprocess.run(cmd, cwd=copy, env=_env(copy), capture_output=True, text=True,
                         timeout=timeout)
  except subprocess.TimeoutExpired:
    return None, ""
  return out.returncode, out.stdout + out.stderr


def _status(mutant: Mutant, root: Path) -> str | None:
  """``"STALE"`` if the snippet is not found exactly once in the source tree, else None."""
  path = root / mutant.file
  if not path.is_file():
    return "STALE"
  return None if path.read_text().count(mutant.original) == 1 else "STALE"


class Outcome(NamedTuple):
  mutant: Mutant
  status: str
  seconds: float
  detail: str


def _run_one(mutant: Mutant, copy: Path, timeout: float) -> Outcome:
  start = time.perf_counter()
  path = copy / mutant.file
  if not path.is_file():
    return Outcome(mutant, "STALE", 0.0, f"{mutant.file} does not exist")
  text = path.read_text()
  count = text.count(mutant.original)
  if count != 1:
    return Outcome(mutant, "STALE", 0.0, f"snippet found {count} times in {mutant.file}")
  mutated = text.replace(mutant.original, mutant.replacement)
  try:
    compile(mutated, str(path), "exec")
  except SyntaxError as err:
    return Outcome(mutant, "ERROR", 0.0, f"the mutated file does not compile: {err}")
  path.write_text(mutated)
  try:
    code, output = _pytest(copy, mutant.tests, timeout)
  finally:
    path.write_text(text)
  seconds = time.perf_counter() - start
  if code is None:
    return Outcome(mutant, "TIMEOUT", seconds, f"over {timeout:.0f} s")
  last = output.strip().splitlines()[-1] if output.strip() else ""
  if code == 1:
    return Outcome(mutant, "KILLED", seconds, last)
  if code == 0:
    return Outcome(mutant, "SURVIVED", seconds, last)
  return Outcome(mutant, "ERROR", seconds, f"pytest exit {code}: {last}\n{output[-3000:]}")


def _baseline(mutants: list[Mutant], copy: Path, timeout: float) -> bool:
  """Run every distinct selection once, unmutated. True if all pass."""
  ok = True
  for tests in dict.fromkeys(m.tests for m in mutants):
    start = time.perf_counter()
    code, output = _pytest(copy, tests, timeout)
    seconds = time.perf_counter() - start
    status = "pass" if code == 0 else "TIMEOUT" if code is None else f"FAIL (exit {code})"
    print(f"  baseline {' '.join(tests)}: {status} [{seconds:.0f} s]", flush=True)
    if code != 0:
      ok = False
      print(output[-3000:], flush=True)
  return ok


def _table(outcomes: list[Outcome]) -> str:
  width_id = max(len("id"), *(len(o.mutant.id) for o in outcomes))
  width_file = max(len("file"), *(len(o.mutant.file) for o in outcomes))
  lines = [f"{'id':<{width_id}}  {'file':<{width_file}}  {'status':<8}  {'secs':>5}  description",
           "-" * (width_id + width_file + 30 + 40)]
  for o in outcomes:
    lines.append(f"{o.mutant.id:<{width_id}}  {o.mutant.file:<{width_file}}  {o.status:<8}  "
                 f"{o.seconds:5.0f}  {o.mutant.description}")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--only", nargs="+", metavar="ID", help="run only these mutants")
  parser.add_argument("--list", action="store_true",
                      help="list the mutants and whether each snippet is found; run nothing")
  parser.add_argument("--jobs", type=int, default=1, help="mutants run at a time (default 1)")
  parser.add_argument("--timeout", type=float, default=600.0, help="seconds per pytest run")
  parser.add_argument("--no-baseline", action="store_true",
                      help="skip the unmutated run of the selected tests")
  parser.add_argument("--root", type=Path, default=ROOT,
                      help="source tree to copy (default: this repository)")
  args = parser.parse_args(argv)
  root = args.root.resolve()

  ids = [m.id for m in MUTANTS]
  duplicates = {i for i in ids if ids.count(i) > 1}
  if duplicates:
    raise SystemExit(f"mutants: duplicate ids {sorted(duplicates)}")
  selected = list(MUTANTS)
  if args.only:
    unknown = sorted(set(args.only) - set(ids))
    if unknown:
      raise SystemExit(f"mutants: unknown ids {unknown}; see --list")
    selected = [m for m in MUTANTS if m.id in args.only]

  if args.list:
    for m in selected:
      status = _status(m, root) or "ok"
      print(f"{m.id:<34} {m.file:<26} {status:<6} {m.description}\n{'':<34} "
            f"tests: {' '.join(m.tests)}")
    stale = [m.id for m in selected if _status(m, root)]
    if stale:
      print(f"\nSTALE (snippet not found exactly once): {', '.join(stale)}", file=sys.stderr)
    return 1 if stale else 0

  jobs = max(1, min(args.jobs, len(selected)))
  with tempfile.TemporaryDirectory(prefix="specdec-mutants-") as tmp:
    copies = []
    for j in range(jobs):
      copy = Path(tmp) / f"repo{j}"
      _copy_repo(root, copy)
      _check_import(copy)
      copies.append(copy)
    print(f"mutants: {len(selected)} mutant(s), {jobs} job(s), copies of {root} under {tmp}",
          flush=True)

    if not args.no_baseline:
      print("mutants: baseline (the selected tests on the unmutated copy)", flush=True)
      if not _baseline(selected, copies[0], args.timeout):
        print("mutants: the baseline FAILED: fix the tests or the code first; kills would mean "
              "nothing", file=sys.stderr)
        return 2

    free = list(copies)
    lock = threading.Lock()

    def work(mutant: Mutant) -> Outcome:
      with lock:
        copy = free.pop()
      try:
        outcome = _run_one(mutant, copy, args.timeout)
      finally:
        with lock:
          free.append(copy)
      loud = "" if outcome.status in ("KILLED", "TIMEOUT") else f"  <-- {outcome.detail}"
      print(f"  {outcome.status:<8} {mutant.id} [{outcome.seconds:.0f} s]{loud}", flush=True)
      return outcome

    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
      outcomes = list(pool.map(work, selected))

  print()
  print(_table(outcomes))
  bad = [o for o in outcomes if o.status not in ("KILLED", "TIMEOUT")]
  counts = {s: sum(o.status == s for o in outcomes)
            for s in ("KILLED", "SURVIVED", "STALE", "ERROR", "TIMEOUT")}
  print("\n" + ", ".join(f"{k.lower()} {v}" for k, v in counts.items()))
  stale = [o.mutant.id for o in outcomes if o.status == "STALE"]
  if stale:
    print(f"\n!!! STALE mutants (the code moved; update their snippets in tools/mutants.py): "
          f"{', '.join(stale)}", file=sys.stderr)
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
