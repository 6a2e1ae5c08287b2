"""The demo behind ``python -m specdec_jax`` (:mod:`specdec_jax.app.cli` parses the arguments).

Subcommands implemented here and in :mod:`specdec_jax.app.simulate`:

- ``examples`` (here): walk both worked examples of the rule step by step, computing every
  printed number with the library and checking that the walk, the NumPy
  reference, :func:`specdec_jax.speculative_step` and :func:`specdec_jax.verify`
  agree on the tokens and on how many random numbers were drawn.
- ``simulate`` (:func:`~specdec_jax.app.simulate.run_simulate`): run
  ``jax.jit(jax.vmap(verify))`` once over many random draft sequences and compare what comes
  out with what the theory says.

The exit code of each is 0 when everything agrees and 1 otherwise.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

import specdec_jax
from specdec_jax import reference
from specdec_jax.app.tables import banner
from specdec_jax.app.tables import num
from specdec_jax.app.tables import plain_table

# ---------------------------------------------------------------------------------------------
# Plain-text formatting
# ---------------------------------------------------------------------------------------------






def _tokens(xs: Sequence[int]) -> str:
  return "[" + ", ".join(str(int(x)) for x in xs) + "]"


def _rows(matrix: np.ndarray) -> str:
  return "[" + ", ".join("[" + ", ".join(f"{v:g}" for v in row) + "]" for row in matrix) + "]"




# ---------------------------------------------------------------------------------------------
# examples: the two worked examples of the rule (p and q over three tokens, gamma = 2)
# ---------------------------------------------------------------------------------------------

EXAMPLE_P = np.array([[0.2, 0.5, 0.3], [0.1, 0.1, 0.8], [0.3, 0.3, 0.4]])
EXAMPLE_Q = np.array([[0.5, 0.3, 0.2], [0.2, 0.2, 0.6]])
EXAMPLE_UNIFORMS = np.array([0.7, 0.9, 0.1])
# (title, draft, and the tokens and number of random numbers the rule gives by hand)
EXAMPLES = (
  ("all accepted", [1, 2], [1, 2, 0], 3),
  ("rejection", [0, 2], [2], 2),
)


def _walk_sample(probs: np.ndarray, u: float, extra: dict[str, np.ndarray],
                 title: str = "probability") -> int:
  """Print the inverse-CDF sampling of ``probs`` with ``u`` and return the sampled token.

  The token comes from :func:`specdec_jax.reference.sample`; it is checked against
  :func:`specdec_jax.sample` (the jitted sampler) by the caller's final comparison.

  Args:
    probs: the normalised row sampled from.
    u: the uniform used.
    extra: columns printed before ``probs`` (e.g. the raw residual), by title.
    title: the title of the ``probs`` column.
  """
  token = reference.sample(probs, specdec_jax.UniformStream([u]))
  cdf = np.cumsum(probs)
  rows = []
  for k, prob in enumerate(probs):
    low = cdf[k - 1] if k else 0.0
    interval = f"[{num(low)}, {num(cdf[k])})" if prob > 0 else "(empty)"
    mark = f"<- u = {u:g}" if k == token else ""
    rows.append([str(k), *(num(col[k]) for col in extra.values()), num(prob), num(cdf[k]),
                 interval, mark])
  header = ["token", *extra, title, "cumulative", "interval", ""]
  print(plain_table(header, rows, align="r" + "r" * len(extra) + "rrll"))
  print(f"    smallest k with u = {u:g} < cumulative[k]: k = {token}  ->  token {token}")
  return token


def _walk_example(title: str, draft: list[int], want_tokens: list[int], want_draws: int) -> bool:
  """Walk one worked example step by step and cross-check every implementation.

  Returns:
    True when the walk, the stated result, the reference, ``speculative_step`` and ``verify``
    all agree on the tokens and the number of random numbers drawn.
  """
  p, q, uniforms = EXAMPLE_P, EXAMPLE_Q, EXAMPLE_UNIFORMS
  gamma = len(draft)
  banner(f"Worked example: {title}, draft = {_tokens(draft)}")
  print(f"  V = {p.shape[1]}, gamma = {gamma}")
  print(f"  p = {_rows(p)}")
  print(f"  q = {_rows(q)}")
  print(f"  random numbers, in order: {', '.join(f'{u:g}' for u in uniforms)}")
  print()

  stream = specdec_jax.UniformStream(uniforms)
  tokens: list[int] = []
  ok = True
  rows = []
  rejected_at = None
  for i, x in enumerate(draft):
    u = stream.random()
    p_x, q_x = p[i, x], q[i, x]
    ratio = reference.acceptance_probability(p_x, q_x)
    accepted = bool(specdec_jax.accepts(np.float64(u), p_x, q_x))
    if accepted != (u < ratio):
      print(f"  MISMATCH: accepts({u}, {p_x}, {q_x}) = {accepted} but u < p/q is {u < ratio}")
      ok = False
    test = f"{u:g} {'<' if accepted else '>='} {num(ratio)}"
    rows.append([str(i), str(x), num(p_x), num(q_x), num(ratio), f"{u:g}", test,
                 "accepted" if accepted else "REJECTED"])
    if not accepted:
      rejected_at = i
      break
    tokens.append(x)
  print("  accept tests: keep draft[i] = x if u < p[i, x] / q[i, x]")
  print(plain_table(["pos i", "token x", "p[i,x]", "q[i,x]", "p/q", "u", "test", "outcome"], rows,
               align="rrrrrrll"))
  print()

  if rejected_at is not None:
    i = rejected_at
    raw = np.maximum(p[i] - q[i], 0.0)
    alpha = float(np.minimum(p[i], q[i]).sum())
    normalized = reference.residual(p[i], q[i])
    u = stream.random()
    print(f"  rejected at position {i}: sample the replacement with the next number u = {u:g}")
    print(f"  from the residual r = max(p[{i}] - q[{i}], 0) / sum(max(p[{i}] - q[{i}], 0)),")
    print(f"  where sum(max(p[{i}] - q[{i}], 0)) = {num(float(raw.sum()))} = 1 - alpha_{i}, "
          f"alpha_{i} = sum(min(p[{i}], q[{i}])) = {num(alpha)}")
    token = _walk_sample(normalized, u, {f"p[{i}]": p[i], f"q[{i}]": q[i], "max(p-q,0)": raw},
                         title="r (normalized)")
    skipped = gamma - i - 1
    if skipped:
      print(f"  stop: the remaining {skipped} proposal(s) {_tokens(draft[i + 1:])} "
            "are never looked at")
  else:
    u = stream.random()
    print(f"  all {gamma} proposals accepted: bonus token from p[{gamma}] with u = {u:g}")
    token = _walk_sample(p[gamma], u, {})
  tokens.append(token)
  draws = stream.position
  print()
  print(f"  result {_tokens(tokens)}: {len(tokens)} token(s) from one target pass, "
        f"{draws} random number(s) drawn ({stream.remaining} never read)")

  # Cross-check: every implementation, same numbers.
  ref_stream = specdec_jax.UniformStream(uniforms)
  ref_tokens = reference.speculative_step(p, q, draft, ref_stream)
  lib_stream = specdec_jax.UniformStream(uniforms)
  lib_tokens = specdec_jax.speculative_step(p, q, draft, lib_stream)
  checks = [
    ("worked by hand", want_tokens, want_draws, "stated"),
    ("this walk-through", tokens, draws, "UniformStream.position"),
    ("reference.speculative_step", ref_tokens, ref_stream.position, "UniformStream.position"),
    ("speculative_step", lib_tokens, lib_stream.position, "UniformStream.position"),
  ]
  for label, dtype, x64 in (("float64", jnp.float64, True), ("float32", jnp.float32, False)):
    with jax.enable_x64(x64):
      result = specdec_jax.verify(jnp.asarray(p, dtype), jnp.asarray(q, dtype),
                                  jnp.asarray(draft, jnp.int32), jnp.asarray(uniforms, dtype))
      result = jax.device_get(result)
    n = int(result.num_tokens)
    note = f"num_uniforms; tokens = {_tokens(result.tokens)}, valid = {bool(result.valid)}"
    checks.append((f"verify ({label})", [int(t) for t in result.tokens[:n]],
                   int(result.num_uniforms), note))
    if not bool(result.valid):
      print(f"  MISMATCH: verify ({label}) reports an error: "
            f"{specdec_jax.describe_error(int(result.error))}")
      ok = False
  # The sampler alone: the jitted inverse CDF against the reference for the final sample.
  final_row = normalized if rejected_at is not None else p[gamma]
  final_u = uniforms[draws - 1]
  jit_token = specdec_jax.sample(final_row, specdec_jax.UniformStream([final_u]))
  if jit_token != token:
    print(f"  MISMATCH: specdec_jax.sample gives {jit_token} for the final sample, "
          f"the reference {token}")
    ok = False

  print()
  print("  cross-check, same random numbers:")
  rows = []
  for label, got_tokens, got_draws, source in checks:
    same = list(got_tokens) == list(want_tokens) and got_draws == want_draws
    ok &= same
    rows.append([label, _tokens(got_tokens), str(got_draws), "ok" if same else "MISMATCH", source])
  print(plain_table(["implementation", "tokens", "draws", "", "draws from"], rows, align="llrll"))
  return ok


def run_examples(args: argparse.Namespace) -> int:
  """``examples`` subcommand: walk both worked examples. Returns the exit code."""
  del args
  ok = True
  for title, draft, want_tokens, want_draws in EXAMPLES:
    ok &= _walk_example(title, draft, want_tokens, want_draws)
  print()
  if ok:
    print("examples: every implementation agrees with the worked examples.")
    return 0
  print("examples: FAILED, see MISMATCH above.")
  return 1
