"""Strict JAX settings for the whole test process (set once, never flipped mid-run)."""

import jax

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")

# The multi-device suite needs 8 host devices, which must be requested before JAX starts;
# tests/test_sharding.py runs it in its own process with XLA_FLAGS set.
collect_ignore = [] if jax.device_count() >= 8 else ["multidevice"]
