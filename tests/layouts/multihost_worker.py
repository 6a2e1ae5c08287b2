"""One process of the multi-process test (tests/layouts/test_multihost.py launches three of them).

Usage: ``python tests/layouts/multihost_worker.py PORT PROCESS_ID REFERENCE.npz``: the process joins
a 2-process ``jax.distributed`` cluster on localhost (4 CPU devices each, gloo collectives), builds
the global ``(2, 4)`` mesh ``data x model``, runs :func:`multihost_cases.run_cases` on global
arrays that span both processes, and checks that every shard it holds equals the same slice of
the single-process results in ``REFERENCE.npz``, exactly.

``python tests/layouts/multihost_worker.py default-flags REFERENCE.npz``: one process on 8 CPU
devices, started without the suite's ``XLA_FLAGS``, runs the checks of
:data:`multihost_cases.DEFAULT_FLAG_CHECKS` and compares them with the reference (computed under
those flags), exactly.

Prints ``OK <check>`` per check and ``DONE``; any mismatch raises. Importing the module
(pytest's doctest collection) runs nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(argv: list[str]) -> None:
  import jax

  jax.config.update("jax_platforms", "cpu")
  distributed = argv[0] != "default-flags"
  if distributed:
    port, process, reference = int(argv[0]), int(argv[1]), argv[2]
    jax.config.update("jax_num_cpu_devices", 4)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process,
                               initialization_timeout=60)
  else:
    reference = argv[1]
    jax.config.update("jax_num_cpu_devices", 8)

  import numpy as np

  sys.path.insert(0, str(Path(__file__).resolve().parent))
  import multihost_cases

  mesh = multihost_cases.make_mesh()
  if distributed:
    assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
    results = multihost_cases.run_cases(mesh, multihost_cases.global_put(mesh))
  else:
    results = multihost_cases.run_cases(mesh, multihost_cases.local_put(mesh),
                                        only=multihost_cases.DEFAULT_FLAG_CHECKS)
  with np.load(reference) as want_all:
    for name, result in results.items():
      for i, leaf in enumerate(jax.tree.leaves(result)):
        want = want_all[f"{name}/{i}"]
        assert isinstance(leaf, jax.Array) and leaf.shape == want.shape, (name, i)
        assert leaf.is_fully_addressable != distributed, f"{name}: not a global array"
        for shard in leaf.addressable_shards:
          np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index],
                                        err_msg=f"{name} field {i}")
      print(f"OK {name}", flush=True)
  print("DONE", flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
