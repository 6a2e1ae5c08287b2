"""The documentation's mesh example (docs/sharding.md), on 8 forced host devices."""

import jax
import numpy as np
import pytest

from specdec_jax import verify
from tests._helpers import random_case
from tests._readme import python_blocks

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")


def test_readme_mesh_example_runs_and_matches_verify():
  (block,) = [b for b in python_blocks() if "make_mesh" in b and "jax.distributed" not in b]
  rng = np.random.default_rng(0)
  cases = [random_case(rng, 3, 64, "overlap") for _ in range(8)]
  p, q, draft = (np.stack(parts) for parts in zip(*cases, strict=True))
  namespace = {
    "jax": jax,
    "p_batch": p.astype(np.float32), "q_batch": q.astype(np.float32), "draft_batch": draft,
    "uniforms_batch": rng.random((8, 4)).astype(np.float32),
    "num_draft_batch": np.full(8, 3, np.int32),
  }
  exec(compile(block, "README.md", "exec"), namespace)
  want = jax.vmap(verify)(namespace["p_batch"], namespace["q_batch"], draft,
                          namespace["uniforms_batch"])
  np.testing.assert_array_equal(np.asarray(namespace["result"].tokens), np.asarray(want.tokens))
