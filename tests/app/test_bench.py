"""The benchmark runs end to end on a tiny configuration, and its baselines are exact samplers.

No timing is asserted: the smoke tests only check that ``python -m specdec_jax.app.bench --tiny``
exits 0 and prints its tables. The baselines are checked against the exact law of one step
(:func:`specdec_jax.reference.output_distribution`) with a chi-square test, so the speed-ups the
benchmark reports are over correct samplers; the packed benchmark's ``sorted`` processing is the
test suite's reference (``tests/_baselines.py``), array for array.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from specdec_jax import SamplingParams
from specdec_jax import reference
from specdec_jax.app.baselines import eager_recovery_verify
from specdec_jax.app.baselines import sorted_process_rows
from specdec_jax.app.baselines import torch_speculative_sampling
from specdec_jax.app.bench import main
from specdec_jax.theory import chi_square_test
from tests._baselines import sorted_process_row
from tests._helpers import P_EXAMPLE
from tests._helpers import Q_EXAMPLE
from tests._helpers import sample_rows

ROOT = pathlib.Path(__file__).resolve().parents[2]
ALPHA = 0.001  # per chi-square test below
TRIALS = 100_000


def _run_bench(*flags: str) -> str:
  proc = subprocess.run(
    [sys.executable, "-m", "specdec_jax.app.bench", "--tiny", *flags],
    cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
  )
  assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
  assert "WARNING" not in proc.stdout, proc.stdout
  return proc.stdout


def test_bench_tiny_runs_and_prints_the_tables():
  out = _run_bench()
  assert "jax " in out and "backend " in out
  for title in ("B", "gamma", "V", "verify ms", "floor ms", "verify/floor", "eager-JAX ms",
                "eager/verify", "torch ms", "torch/verify", "reference ms", "reference/verify",
                "compile s"):
    assert title in out, title
  assert "specdec_jax.speculative_step" in out
  assert "specdec_jax.reference.speculative_step" in out
  for title in ("Packed ragged batches", "packed/floor", "gather/packed", "eager/packed",
                "sorted/packed"):  # the packed section (app/bench_packed.py)
    assert title in out, title
  for title in ("From logits, packed", "ours/floor", "tpu-style/ours", "top-k+top-p",
                "greedy-mixed", "flat"):  # the logits section (app/bench_logits.py)
    assert title in out, title


def test_bench_tiny_markdown_without_torch():
  out = _run_bench("--markdown", "--no-torch", "--no-packed", "--no-logits")
  assert "| B | gamma | V |" in out
  assert "torch disabled" in out
  row = next(line for line in out.splitlines() if line.startswith("| 2 | 2 | 1000 |"))
  assert "n/a" in row


def test_main_rejects_bad_flags():
  with pytest.raises(SystemExit):
    main(["--batch", "0"])


# ---------------------------------------------------------------------------------------------
# The baselines are exact.


def _batch(seed: int):
  """TRIALS copies of the worked example, drafts sampled from q, uniforms from NumPy."""
  rng = np.random.default_rng(seed)
  gamma = Q_EXAMPLE.shape[0]
  draft = sample_rows(rng, Q_EXAMPLE, TRIALS).astype(np.int32)
  p = np.broadcast_to(P_EXAMPLE.astype(np.float32), (TRIALS, *P_EXAMPLE.shape)).copy()
  q = np.broadcast_to(Q_EXAMPLE.astype(np.float32), (TRIALS, *Q_EXAMPLE.shape)).copy()
  uniforms = rng.random((TRIALS, gamma + 1), dtype=np.float32)
  return p, q, draft, uniforms


def _assert_exact_law(tokens: np.ndarray, num_accepted: np.ndarray, label: str) -> None:
  law = reference.output_distribution(P_EXAMPLE, Q_EXAMPLE)
  keys = sorted(law)
  index = {key: k for k, key in enumerate(keys)}
  counts = np.zeros(len(keys) + 1)  # last bin: an output the exact law does not have
  for row, n in zip(tokens.tolist(), num_accepted.tolist(), strict=True):
    counts[index.get(tuple(row[: n + 1]), len(keys))] += 1
  probs = np.array([law[key] for key in keys] + [0.0])
  _, _, pvalue, detail = chi_square_test(counts, probs)
  assert pvalue >= ALPHA, f"{label}: chi-square p = {pvalue:.3g}; {detail}"


def test_eager_recovery_verify_is_exact():
  p, q, draft, uniforms = _batch(0)
  tokens, num_accepted = eager_recovery_verify(p, q, draft, uniforms, jax.random.key(1))
  _assert_exact_law(np.asarray(tokens), np.asarray(num_accepted), "eager_recovery_verify")


def test_torch_baseline_is_exact():
  torch = pytest.importorskip("torch")
  torch.manual_seed(2)
  p, q, draft, uniforms = _batch(3)
  tokens, num_accepted = torch_speculative_sampling(
    torch.from_numpy(p), torch.from_numpy(q), torch.from_numpy(draft.astype(np.int64)),
    torch.from_numpy(uniforms))
  _assert_exact_law(tokens.numpy(), num_accepted.numpy(), "torch_speculative_sampling")


def test_sorted_processing_is_the_test_suites_reference():
  rng = np.random.default_rng(4)
  logits = np.asarray(rng.normal(size=(6, 40)) * 3, np.float32)
  params = SamplingParams(np.array([1.0, 0.7, 0.0, 1.3, 1.0, 0.5], np.float32),
                          np.array([0, 5, 3, 40, 1, 10], np.int32),
                          np.array([1.0, 0.9, 0.5, 0.3, 1.0, 0.99], np.float32))
  want = jax.vmap(sorted_process_row)(logits, params)
  np.testing.assert_array_equal(np.asarray(sorted_process_rows(logits, params)), np.asarray(want))
