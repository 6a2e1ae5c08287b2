"""Strict JAX settings for the whole test process (set once, before JAX starts, never flipped),
and the order in which the test files are handed to the xdist workers.

The process runs on 8 CPU devices (``jax_num_cpu_devices``), so the sharded and
vocab-parallel tests run in process beside the rest; single-device code uses device 0.
"""

import gc
import os
import shutil
import tempfile

#: XLA:CPU code generation that compiles faster (issue 21: the suite is compile-bound; about 30%
#: less compile time on tests/layouts/test_matrix.py's packed and vocab-parallel cells, their
#: outputs bit-identical): the elemental emitters instead of the newer fusion emitters, and LLVM at
#: -O1. Both only change how XLA lowers the same optimised HLO to machine code, so the agreement
#: tests still compare two programs built the same way. Without the loop-invariant code motion pass
#: (which only hoists work out of while loops, the same operations on the same values): another
#: 8% less CPU time on the loop-heavy files (tree and decoding loops, reliability), measured
#: side by side. Set before JAX starts its backend; notebook
#: kernels and tests/layouts/test_multihost.py's two worker processes inherit it; that test's third
#: process drops it and runs a few entry points (the logits layouts, a tree, two decoding loops)
#: under XLA's defaults, which must equal, bit for bit, what this process computes with these
#: flags.
TEST_XLA_FLAGS = ("--xla_cpu_use_fusion_emitters=false --xla_backend_optimization_level=1"
                  " --xla_disable_hlo_passes=while-loop-invariant-code-motion")
if TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()

#: One compilation cache for the whole session (JAX's persistent cache, read from these
#: environment variables when JAX is imported): the process that starts the session makes the
#: directory, the xdist workers and the notebook kernels inherit it, so a program compiled by
#: one of them (or compiled again after :func:`_release_executables` dropped it) is loaded,
#: not compiled. Removed when the session ends (:func:`pytest_unconfigure`); a cache key
#: covers the program, the XLA flags, the devices and the versions, so a hit is the same
#: executable. tests/layouts/test_multihost.py's worker processes do without it.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="specdec-jax-test-cache-")
  os.environ["SPECDEC_TEST_CACHE_OWNER"] = str(os.getpid())
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")

#: The longest test files (and notebooks), longest first: `make test` (``pytest -n 2 --dist
#: loadfile --no-loadscope-reorder``) hands each worker the next file in collection order, so
#: these start first instead of last (xdist's own order, most tests first, ends on one-test
#: files such as test_multihost.py and the notebooks). Each took 35 s or more run alone on 2
#: cores (issue 21); a file missing here just runs in its usual place, after these.
SLOW_FILES = (
  "tests/layouts/test_matrix.py",
  "tests/decoding/test_tree_loop.py",
  "tests/layouts/test_multihost.py",
  "tests/test_reliability.py",
  "tests/rules/test_tree.py",
  "notebooks/tutorial.ipynb",
  "tests/decoding/test_feature_adaptive.py",
  "tests/layouts/test_packed.py",
  "tests/layouts/test_sharding.py",
  "tests/decoding/test_chain.py",
  "tests/logits/test_logits.py",
  "notebooks/theory.ipynb",
  "tests/app/test_real_model.py",
  "tests/logits/test_logits_threshold.py",
)


def pytest_collection_modifyitems(config, items):
  """Move the items of :data:`SLOW_FILES` to the front, in that order (a stable sort: the order
  within a file and of every other file stays as collected)."""
  rank = {path: i for i, path in enumerate(SLOW_FILES)}

  def key(item):
    try:
      path = item.path.relative_to(config.rootpath).as_posix()
    except ValueError:  # outside the repository
      return len(SLOW_FILES)
    return rank.get(path, len(SLOW_FILES))

  items.sort(key=key)


def pytest_unconfigure():
  """The process that made the session's compilation cache removes it."""
  if os.environ.get("SPECDEC_TEST_CACHE_OWNER") == str(os.getpid()):
    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


def _mappings() -> tuple[int, int]:
  """``(memory mappings this process holds, the kernel's limit)``; ``(0, 1)`` off Linux."""
  try:
    with open("/proc/sys/vm/max_map_count") as f:
      limit = int(f.read())
    with open(f"/proc/{os.getpid()}/maps", "rb") as f:
      return sum(1 for _ in f), limit
  except OSError:
    return 0, 1


@pytest.fixture(autouse=True)
def _release_executables():
  """Drop JAX's compiled programs when the worker holds half the kernel's memory-mapping limit.

  Every XLA:CPU executable keeps about 20 memory mappings for as long as JAX caches it, and
  JAX never evicts: a worker that compiles a few thousand programs reaches
  ``vm.max_map_count`` (65,530 by default) and the next compilation segfaults inside XLA
  (seen in CI at about 90% of the suite, and the xdist scheduler then waited until the job's
  time limit). ``jax.clear_caches()`` unmaps them; a test's later calls just compile again.
  """
  yield
  held, limit = _mappings()
  if held > limit // 2:
    jax.clear_caches()
    gc.collect()
