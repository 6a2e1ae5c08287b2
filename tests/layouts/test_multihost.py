"""Multi-host: two processes on localhost, one global ``(2, 4)`` mesh, gloo CPU collectives.

The test process computes the single-process results of every case
(:mod:`tests.layouts.multihost_cases`) on its own 8 CPU devices and saves them; two worker processes
(``tests/layouts/multihost_worker.py``, 4 devices each) run the same calls on global arrays that
span both and compare the shards they hold, exactly. A third process runs a few of the cases
(:data:`~tests.layouts.multihost_cases.DEFAULT_FLAG_CHECKS`) in one process under XLA's *default*
flags and compares them the same way: the check that conftest.py's faster-compiling flags,
under which the rest of the suite (and the workers) run, change no result. A timeout turns a
hang into a failure.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from tests.layouts import multihost_cases

WORKER = Path(__file__).resolve().parent / "multihost_worker.py"
TIMEOUT_S = 600


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _gloo_available() -> bool:
  try:
    from jax._src.lib import _jax
  except ImportError:
    return False
  return hasattr(_jax, "make_gloo_tcp_collectives")


@pytest.mark.skipif(not _gloo_available(), reason="this jaxlib has no gloo CPU collectives")
def test_two_processes_give_the_single_process_results(tmp_path):
  mesh = multihost_cases.make_mesh()
  results = multihost_cases.run_cases(mesh, multihost_cases.local_put(mesh))
  for got, want in zip(jax.tree.leaves(results["explicit mesh under set_mesh"]),
                       jax.tree.leaves(results["explicit mesh"]), strict=True):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  for got, want in zip(jax.tree.leaves(results["explicit mesh"]),
                       jax.tree.leaves(results["speculative_generate lookup adaptive"]),
                       strict=True):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  arrays = {f"{name}/{i}": np.asarray(leaf) for name, result in results.items()
            for i, leaf in enumerate(jax.tree.leaves(result))}
  reference = tmp_path / "reference.npz"
  np.savez(reference, **arrays)
  port = _free_port()
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(WORKER.parents[2]))
  env.pop("JAX_COMPILATION_CACHE_DIR", None)  # their programs are their own: nothing to share
  defaults = {k: v for k, v in env.items() if k != "XLA_FLAGS"}  # XLA's default flags
  commands = [([str(port), str(i), str(reference)], env) for i in range(2)]
  commands.append((["default-flags", str(reference)], defaults))
  procs = [subprocess.Popen([sys.executable, str(WORKER), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=proc_env)
           for args, proc_env in commands]
  outputs = []
  try:
    for proc in procs:
      outputs.append(proc.communicate(timeout=TIMEOUT_S)[0])
  except subprocess.TimeoutExpired:
    for proc in procs:
      proc.kill()
    pytest.fail(f"the workers did not finish within {TIMEOUT_S} s (a hang in a collective?)")
  names = [list(results)] * 2 + [list(multihost_cases.DEFAULT_FLAG_CHECKS)]
  for i, (proc, out, checks) in enumerate(zip(procs, outputs, names, strict=True)):
    assert proc.returncode == 0, f"process {i} failed:\n{out[-5000:]}"
    for name in checks:
      assert f"OK {name}\n" in out, f"process {i} did not check {name}:\n{out[-3000:]}"
    assert "DONE" in out
