"""``python -m specdec_jax simulate``: run ``jax.jit(jax.vmap(verify))`` once over many random
draft sequences and compare what comes out with what the theory says: the law of every output
token (it must be the target's), the acceptance rate per position and the mean number of tokens
per step. The exit code is 0 when everything agrees and 1 otherwise.
"""

from __future__ import annotations

import argparse
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

import specdec_jax
from specdec_jax.app.tables import banner
from specdec_jax.app.tables import num
from specdec_jax.app.tables import plain_table
from specdec_jax.theory import chi_square_test

# ---------------------------------------------------------------------------------------------
# simulate: the vmapped step over many random draft sequences
# ---------------------------------------------------------------------------------------------

_SHOW_TOKENS = 32  # tokens shown per position in the distribution tables
_P_FAIL = 1e-6  # a chi-square p-value below this fails the run (chance: negligible)
_Z_FAIL = 6.0  # so does a rate more than this many standard errors off


def make_distributions(gamma: int, vocab: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
  """Random target rows ``p`` ``(gamma + 1, V)`` and similar draft rows ``q`` ``(gamma, V)``.

  ``p[i] ~ Dirichlet(1)``; ``q[i]`` mixes ``p[i]`` with an independent
  ``Dirichlet(1)`` row, with a weight on the noise that grows along the draft, so
  the acceptance probability falls from about 0.8 to about 0.55. Both are float32.
  """
  rng = np.random.default_rng(seed)
  p = rng.dirichlet(np.ones(vocab), size=gamma + 1)
  noise = rng.dirichlet(np.ones(vocab), size=gamma)
  weight = np.linspace(0.35, 0.8, gamma)[:, None] if gamma > 1 else np.full((gamma, 1), 0.5)
  q = (1 - weight) * p[:gamma] + weight * noise
  p32 = (p / p.sum(-1, keepdims=True)).astype(np.float32)
  q32 = (q / q.sum(-1, keepdims=True)).astype(np.float32)
  return p32, q32


def sample_drafts(q: np.ndarray, trials: int, seed: int) -> np.ndarray:
  """``(trials, gamma)`` int32 draft ids with ``draft[:, i] ~ q[i]`` (vectorised inverse CDF)."""
  rng = np.random.default_rng([seed, 1])
  gamma, vocab = q.shape
  draft = np.empty((trials, gamma), dtype=np.int32)
  u = rng.random((trials, gamma))
  for i in range(gamma):
    row = q[i].astype(np.float64)
    cdf = np.cumsum(row / row.sum())
    draft[:, i] = np.minimum(np.searchsorted(cdf, u[:, i], side="right"), vocab - 1)
  return draft


def expected_tokens(alphas: np.ndarray) -> np.ndarray:
  """Law of the number of tokens per step, ``P(N = n)`` for ``n = 1 .. gamma + 1``.

  ``P(N > k) = prod_{i < k} alpha_i``: the first ``k`` proposals were all accepted.
  Its mean is ``1 + sum_{k=1}^{gamma} prod_{i<k} alpha_i``, which for equal alphas is
  ``(1 - alpha^(gamma+1)) / (1 - alpha)`` (Leviathan et al. 2023, Eq. 1).
  """
  survive = np.concatenate([[1.0], np.cumprod(alphas)])  # P(N > k), k = 0 .. gamma
  return survive - np.concatenate([survive[1:], [0.0]])


def _verdict(ok: bool, strict: bool = True) -> str:
  if ok:
    return "ok"
  return "FAIL" if strict else "low"


def run_simulate(args: argparse.Namespace) -> int:
  """``simulate`` subcommand: vmapped verification against the theory. Returns the exit code."""
  trials, gamma, vocab, seed = args.trials, args.gamma, args.vocab, args.seed
  start = time.perf_counter()
  banner(f"Simulation: {trials} steps, gamma = {gamma}, V = {vocab}, seed = {seed}")

  p, q = make_distributions(gamma, vocab, seed)
  draft = sample_drafts(q, trials, seed)
  uniforms = jax.random.uniform(jax.random.key(seed), (trials, gamma + 1), dtype=jnp.float32)
  setup_s = time.perf_counter() - start

  # One jitted call over the whole batch; p and q are shared by every trial.
  step = jax.jit(jax.vmap(specdec_jax.verify, in_axes=(None, None, 0, 0)))
  args_ = (jnp.asarray(p), jnp.asarray(q), jnp.asarray(draft), uniforms)
  t0 = time.perf_counter()
  result = jax.block_until_ready(step(*args_))
  first_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  jax.block_until_ready(step(*args_))
  second_s = time.perf_counter() - t0
  result = jax.device_get(result)
  tokens = np.asarray(result.tokens)
  num_tokens = np.asarray(result.num_tokens)
  num_accepted = np.asarray(result.num_accepted)
  num_uniforms = np.asarray(result.num_uniforms)

  print(f"  p: ({gamma + 1}, {vocab}) target rows ~ Dirichlet(1); q: ({gamma}, {vocab}) draft "
        "rows, p mixed with noise;")
  print(f"  draft[:, i] ~ q[i] (NumPy); uniforms ({trials}, {gamma + 1}) from "
        f"jax.random.uniform(key({seed}));")
  print("  one call of jax.jit(jax.vmap(verify, in_axes=(None, None, 0, 0))) over every trial.")

  # Invariants every single step must satisfy.
  ok = True
  slots = np.arange(gamma + 1)
  problems = []
  if not np.all(result.valid):
    problems.append(f"{int(np.sum(~result.valid))} steps report an error")
  if not np.array_equal(num_tokens, num_accepted + 1):
    problems.append("num_tokens != num_accepted + 1")
  want_uniforms = np.where(num_accepted == gamma, gamma + 1, num_accepted + 2)
  if not np.array_equal(num_uniforms, want_uniforms):
    problems.append("num_uniforms is not num_accepted + 2 (rejection) / gamma + 1 (all accepted)")
  new = slots[None, :] < num_tokens[:, None]
  if np.any(new & ((tokens < 0) | (tokens >= vocab))) or np.any(~new & (tokens != -1)):
    problems.append("a token id outside [0, V), or an unused slot not padded with -1")
  kept = slots[None, :gamma] < num_accepted[:, None]
  if np.any(kept & (tokens[:, :gamma] != draft)):
    problems.append("an accepted token differs from its draft token")
  print()
  if problems:
    ok = False
    for problem in problems:
      print(f"  FAIL: {problem}")
  else:
    print(f"  per-step invariants: ok for all {trials} steps")
    print("    (valid, ids in [0, V), -1 padding, accepted tokens = draft, num_uniforms)")

  # 1. The law of every output token is the target's.
  print()
  print("  1. Output token j, among steps that returned more than j tokens, against p[j]")
  print(f"     (exactness: it must be distributed as p[j]; chi-square p-value {_P_FAIL:g} "
        "or less fails)")
  p64 = p.astype(np.float64)
  q64 = q.astype(np.float64)
  summary = []
  for j in range(gamma + 1):
    reached = num_tokens > j
    n = int(reached.sum())
    if n == 0:
      summary.append([str(j), "0", "-", "-", "-", "-", "no step got this far"])
      continue
    target = p64[j] / p64[j].sum()
    counts = np.bincount(tokens[reached, j], minlength=vocab)
    empirical = counts / n
    diff = np.abs(empirical - target)
    statistic, df, p_value, _ = chi_square_test(counts, target, min_expected=0)
    passed = p_value >= _P_FAIL
    ok &= passed
    summary.append([str(j), str(n), f"{diff.max():.4f}", f"{statistic:.2f}", str(df),
                    f"{p_value:.3f}", _verdict(passed)])
    shown = min(vocab, _SHOW_TOKENS)
    print()
    more = f" (first {shown} of {vocab} tokens)" if shown < vocab else ""
    print(f"     position {j}: n = {n}{more}")
    for lo in range(0, shown, 10):
      cols = range(lo, min(lo + 10, shown))
      rows = [
        ["p[j]", *(f"{target[k]:.4f}" for k in cols)],
        ["empirical", *(f"{empirical[k]:.4f}" for k in cols)],
        ["|diff|", *(f"{diff[k]:.4f}" for k in cols)],
      ]
      print(plain_table(["token", *(str(k) for k in cols)], rows, align="l", indent=7))
  print()
  print(plain_table(["position j", "n", "max |diff|", "chi-square", "df", "p-value", ""], summary,
               align="rrrrrrl", indent=5))

  # 2. Acceptance rate per position.
  print()
  print("  2. Acceptance rate per position, among steps that tested it,")
  print("     against alpha_i = sum_x min(p[i, x], q[i, x])")
  alphas = np.minimum(p64[:gamma], q64[:gamma]).sum(-1)
  rows = []
  for i in range(gamma):
    tested = int(np.sum(num_accepted >= i))
    if tested == 0:
      rows.append([str(i), "0", "-", num(alphas[i]), "-", "-", "never tested"])
      continue
    rate = np.sum(num_accepted > i) / tested
    se = math.sqrt(max(alphas[i] * (1 - alphas[i]), 1e-300) / tested)
    z = (rate - alphas[i]) / se
    passed = abs(z) <= _Z_FAIL
    ok &= passed
    rows.append([str(i), str(tested), num(rate), num(alphas[i]), f"{rate - alphas[i]:+.4f}",
                 f"{z:+.2f}", _verdict(passed)])
  if rows:
    print(plain_table(["position i", "tested", "empirical", "alpha_i", "difference", "z", ""], rows,
                 align="rrrrrrl", indent=5))
  else:
    print("     gamma = 0: nothing to test")

  # 3. Tokens per step.
  law = expected_tokens(alphas)
  sizes = np.arange(1, gamma + 2)
  mean = float(law @ sizes)
  var = float(law @ sizes**2) - mean**2
  empirical_mean = float(num_tokens.mean())
  se = math.sqrt(max(var, 1e-300) / trials)
  z = (empirical_mean - mean) / se
  passed = abs(z) <= _Z_FAIL
  ok &= passed
  freq = np.bincount(num_tokens, minlength=gamma + 2)[1:] / trials
  print()
  print("  3. Tokens per step")
  rows = [["theory", *(f"{x:.4f}" for x in law)], ["empirical", *(f"{x:.4f}" for x in freq)]]
  print(plain_table(["P(N = n)", *(str(n) for n in sizes)], rows, align="l", indent=5))
  print()
  print(f"     mean tokens per step: empirical {empirical_mean:.4f}, theory {mean:.4f}  "
        f"(z = {z:+.2f}, {_verdict(passed)})")
  print("     theory: 1 + sum_{k=1..gamma} prod_{i<k} alpha_i")
  if gamma > 0:
    a = float(alphas.mean())
    iid = (1 - a ** (gamma + 1)) / (1 - a) if a < 1 else gamma + 1.0
    print("     for comparison, the i.i.d. formula (1 - a^(gamma+1)) / (1 - a) with one "
          "a = mean(alpha_i)")
    print(f"     = {a:.4f} gives {iid:.4f} (exact only when all alpha_i are equal)")

  total_s = time.perf_counter() - start
  print()
  print(f"  time: {total_s:.2f} s in all on {jax.devices()[0].platform}: setup {setup_s:.2f} s, "
        f"first call (compile + run) {first_s:.2f} s,")
  print(f"        second call {second_s * 1e3:.1f} ms ({second_s / trials * 1e9:.0f} ns per step)")
  print()
  if ok:
    print("simulate: the output matches the target distribution and the theory.")
    return 0
  print("simulate: FAILED, see FAIL above.")
  return 1
