"""What ``make bench`` times: the inputs, and each implementation prepared for timing.

A :class:`Case` is one configuration's random inputs; a :class:`Method` turns a case into a
:class:`Timed` call (``verify``, ``block_verify``, the NumPy floor, the eager-JAX and PyTorch
baselines, the reference). :mod:`specdec_jax.app.bench` runs them side by side and prints the
tables; to add a variant, append a :class:`Method` to :func:`default_methods`.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

import specdec_jax
from specdec_jax import block_verify
from specdec_jax import reference
from specdec_jax.app.baselines import eager_recovery_verify
from specdec_jax.app.baselines import torch_speculative_sampling

MIX = 0.55  # q = MIX * p + (1 - MIX) * noise: acceptance rate ~0.7 per position


def import_torch():
  """The ``torch`` module, or ``None`` when it cannot be imported."""
  try:
    import torch
  except Exception:  # not installed, or a broken install: the column shows n/a
    return None
  return torch


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
  """One configuration's inputs, on the host and on the default JAX device.

  ``num_accepted`` is filled in by the ``verify`` method (the first one run) and read by the
  floor, which needs to know which rows the rule stops at.
  """

  batch: int
  gamma: int
  vocab: int
  p: np.ndarray  # (B, gamma + 1, V) float32
  q: np.ndarray  # (B, gamma, V) float32
  draft: np.ndarray  # (B, gamma) int32, sampled from q
  uniforms: np.ndarray  # (B, gamma + 1) float32
  seed: int
  device: tuple[jax.Array, ...] = ()
  num_accepted: np.ndarray | None = None

  @property
  def rule_bytes(self) -> int:
    """Bytes the rule needs: per sequence the stop row of p, of q if rejected, 2 * gamma scalars."""
    if self.num_accepted is None:
      raise RuntimeError("rule_bytes needs num_accepted from the verify method.")
    rejected = int(np.sum(self.num_accepted < self.gamma))
    rows = self.batch + rejected
    return self.p.itemsize * (rows * self.vocab + 2 * self.gamma * self.batch)

  def release(self) -> None:
    """Free the device buffers and drop the host arrays."""
    for array in self.device:
      array.delete()
    self.device = ()
    self.p = self.q = self.draft = self.uniforms = None  # type: ignore[assignment]


def make_case(batch: int, gamma: int, vocab: int, seed: int) -> Case:
  """Cheap random float32 inputs with an acceptance rate of about 0.7 per position.

  ``p`` is normalised ``uniform ** 4``, ``q`` a normalised mix of ``p`` and independent
  noise of the same kind, ``draft`` is sampled from ``q`` by the inverse CDF and
  ``uniforms`` are NumPy uniforms. Works in place to keep the peak memory near the size of
  ``p`` and ``q``.
  """
  rng = np.random.default_rng([seed, batch, gamma, vocab])
  p = rng.random((batch, gamma + 1, vocab), dtype=np.float32)
  p *= p
  p *= p
  p /= p.sum(axis=-1, keepdims=True)
  q = rng.random((batch, gamma, vocab), dtype=np.float32)
  q *= q
  q *= q
  q *= (1 - MIX) / q.sum(axis=-1, keepdims=True)
  for b in range(batch):  # no (B, gamma, V) temporary
    q[b] += MIX * p[b, :gamma]
  q /= q.sum(axis=-1, keepdims=True)

  targets = rng.random((batch, gamma))
  draft = np.empty((batch, gamma), dtype=np.int32)
  for b in range(batch):
    cdf = np.cumsum(q[b], axis=-1, dtype=np.float64)
    for i in range(gamma):
      draft[b, i] = np.searchsorted(cdf[i], targets[b, i] * cdf[i, -1], side="right")
  np.minimum(draft, vocab - 1, out=draft)
  uniforms = rng.random((batch, gamma + 1), dtype=np.float32)
  case = Case(batch, gamma, vocab, p, q, draft, uniforms, seed)
  case.device = tuple(jax.device_put(x) for x in (p, q, draft, uniforms))
  return case


# ---------------------------------------------------------------------------------------------
# Methods: named timed callables
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Timed:
  """A prepared, zero-argument call to time, and what is known about it.

  Attributes:
    call: runs the method once on the case's inputs and returns its output.
    scale: the measured time is multiplied by this (extrapolation to the whole batch).
    covered: how many sequences ``call`` processes, when fewer than the batch.
    compile_s: compilation time, where there is one.
    nbytes: bytes the method reads, for a GB/s column.
    num_accepted: extracts ``num_accepted`` (for the sequences covered) from the output, for a
      cross-check against ``verify``; ``None`` to skip the check.
  """

  call: Callable[[], Any]
  scale: float = 1.0
  covered: int | None = None
  compile_s: float | None = None
  nbytes: int | None = None
  num_accepted: Callable[[Any], np.ndarray] | None = None


@dataclasses.dataclass(frozen=True)
class Method:
  """One column group of the table.

  Attributes:
    name: title prefix, e.g. ``"torch"`` gives ``"torch ms"``.
    prepare: ``(case, args) -> Timed``, or ``None`` when the method is unavailable (``n/a``).
    ratio: ``"over"`` for a ``name/verify`` column, ``"under"`` for ``verify/name``, ``""`` none.
    show_bytes: add a ``name MB`` column with :attr:`Timed.nbytes`.
    show_bandwidth: add a ``name GB/s`` column when :attr:`Timed.nbytes` is known.
    show_peak: add a ``% peak`` column (share of ``--peak-gbps``) when the backend is a GPU.
  """

  name: str
  prepare: Callable[[Case, argparse.Namespace], Timed | None]
  ratio: str = "over"
  show_bytes: bool = False
  show_bandwidth: bool = False
  show_peak: bool = False


def on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def _compile(fn, *args) -> tuple[Callable, float]:
  start = time.perf_counter()
  compiled = fn.lower(*args).compile()
  return compiled, time.perf_counter() - start


def _prepare_verify(case: Case, _args: argparse.Namespace) -> Timed:
  compiled, compile_s = _compile(jax.jit(jax.vmap(specdec_jax.verify)), *case.device)
  result = jax.block_until_ready(compiled(*case.device))
  case.num_accepted = np.asarray(result.num_accepted)
  if not bool(np.all(np.asarray(result.valid))):
    raise RuntimeError(f"verify flagged invalid inputs: errors {np.unique(result.error)}")
  return Timed(
    call=lambda: compiled(*case.device),
    compile_s=compile_s,
    nbytes=case.rule_bytes if on_gpu() else None,
    num_accepted=lambda out: np.asarray(out.num_accepted),
  )


def _prepare_block(case: Case, _args: argparse.Namespace) -> Timed:
  """``jax.jit(jax.vmap(block_verify))``: block verification on the same inputs (it keeps a
  different number of proposals, so there is no cross-check of ``num_accepted``)."""
  compiled, compile_s = _compile(jax.jit(jax.vmap(block_verify)), *case.device)
  result = jax.block_until_ready(compiled(*case.device))
  if not bool(np.all(np.asarray(result.valid))):
    raise RuntimeError(f"block_verify flagged invalid inputs: errors {np.unique(result.error)}")
  return Timed(call=lambda: compiled(*case.device), compile_s=compile_s)


def _prepare_floor(case: Case, _args: argparse.Namespace) -> Timed:
  p, q, draft, gamma = case.p, case.q, case.draft, case.gamma
  stops = [int(s) for s in case.num_accepted]
  rows = np.arange(case.batch)[:, None]
  positions = np.arange(gamma)[None, :]

  def floor() -> float:
    total = float(p[rows, positions, draft].sum()) + float(q[rows, positions, draft].sum())
    for b, stop in enumerate(stops):
      total += float(p[b, stop].sum())
      if stop < gamma:
        total += float(q[b, stop].sum())
    return total

  return Timed(call=floor, nbytes=case.rule_bytes)


def _prepare_eager(case: Case, args: argparse.Namespace) -> Timed:
  inputs = (*case.device, jax.random.key(args.seed))
  compiled, compile_s = _compile(eager_recovery_verify, *inputs)
  return Timed(call=lambda: compiled(*inputs), compile_s=compile_s,
               num_accepted=lambda out: np.asarray(out[1]))


def _prepare_torch(case: Case, args: argparse.Namespace) -> Timed | None:
  torch = None if args.no_torch else import_torch()
  if torch is None or case.gamma == 0:
    return None
  torch.manual_seed(args.seed)
  inputs = (torch.from_numpy(case.p), torch.from_numpy(case.q),
            torch.from_numpy(case.draft.astype(np.int64)), torch.from_numpy(case.uniforms))
  return Timed(call=lambda: torch_speculative_sampling(*inputs),
               num_accepted=lambda out: out[1].numpy())


def _prepare_reference(case: Case, args: argparse.Namespace) -> Timed:
  covered = max(1, min(case.batch, args.reference_max_batch))
  p, q, draft, uniforms = case.p, case.q, case.draft, case.uniforms

  def loop() -> list[list[int]]:
    return [reference.speculative_step(p[b], q[b], draft[b], specdec_jax.UniformStream(uniforms[b]))
            for b in range(covered)]

  return Timed(call=loop, scale=case.batch / covered,
               covered=covered if covered < case.batch else None,
               num_accepted=lambda out: np.array([len(tokens) - 1 for tokens in out]))


def default_methods() -> list[Method]:
  """The timed methods, in column order; the first is the one every ratio refers to."""
  return [
    Method("verify", _prepare_verify, ratio="", show_bandwidth=True, show_peak=True),
    Method("block", _prepare_block),
    Method("floor", _prepare_floor, ratio="under", show_bytes=True, show_bandwidth=True),
    Method("eager-JAX", _prepare_eager),
    Method("torch", _prepare_torch),
    Method("reference", _prepare_reference),
  ]
