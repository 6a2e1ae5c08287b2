"""Strict JAX settings for the whole test process (set once, never flipped mid-run)."""

import jax

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")
