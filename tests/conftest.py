"""Strict JAX settings for the whole test process (set once, before JAX starts, never flipped).

The process runs on 8 CPU devices (``jax_num_cpu_devices``), so the sharded and
vocab-parallel tests run in process beside the rest; single-device code uses device 0.
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")
