"""The batching rule of every verifier: per-sequence row reads, streamed like a memcpy on CPU.

A verifier written for one sequence reads a few rows of its ``(rows, V)`` arrays by a traced
index (the stop row, the rows a block or tree walk visits). Under ``jax.vmap`` JAX turns
such a ``dynamic_slice`` with a batched index into a ``gather``, which XLA:CPU executes
element by element at a fraction of memory bandwidth (measured here: ~4 GB/s against
~17 GB/s for a NumPy row sum) and materialises when several reductions consume it; a
``while_loop`` whose rows are picked by a batched index gathers whole rows for every lane on
every iteration, and turns ``cond`` into ``select``, so a pass that one sequence needs is run
for all.

:func:`per_sequence` runs a per-sequence body that reads rows only through *readers*
(``read(row, start, size)``). Its ``custom_vmap`` rule batches the body as a ``fori_loop``
over the batch on XLA:CPU: each sequence runs its own loops and branches with scalar
indices, each row it reads is streamed once and stays in cache, nothing of size ``B x V`` is
gathered. On accelerators (``lax.platform_dependent``) and when the batch axis is sharded in
the types it is a plain ``vmap``. The numbers are the same either way (the body is the same
function); only the schedule differs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from specdec_jax._rows.sources import reader


def explicitly_sharded_batch(x) -> bool:
  """True if ``x``'s leading axis is sharded over an explicit mesh axis (sharding in types)."""
  try:
    spec = jax.typeof(x).sharding.spec
  except AttributeError:
    return False
  return len(spec) > 0 and spec[0] is not None


def anchored(tree, *refs):
  """``tree`` plus zeros computed from ``refs``, leaf by leaf.

  Inside ``shard_map`` a loop's initial state must vary over the same mesh axes as what its
  body writes into it; a zero derived from the inputs the body reads carries those axes (and
  costs nothing). Outside ``shard_map`` it is a no-op.
  """
  zero = sum(jnp.zeros_like(jnp.ravel(r)[0], jnp.int32) for r in refs if jnp.size(r))
  return jax.tree.map(lambda leaf: leaf + zero.astype(leaf.dtype), tree)


def branch(looped: bool, pred, true_fn: Callable, false_fn: Callable):
  """``lax.cond(pred, true_fn, false_fn)`` where branches are real, else both and a select.

  Under ``vmap`` a ``cond`` on a batched predicate runs both branches and selects anyway;
  writing the select out keeps every output typed alike inside ``shard_map`` (where the
  batched ``cond`` cannot always unify the branches' varying mesh axes).
  """
  if looped:
    return lax.cond(pred, true_fn, false_fn)
  return jax.tree.map(lambda t, f: jnp.where(pred, t, f), true_fn(), false_fn())


def stacked_zeros(shape: jax.ShapeDtypeStruct, size: int) -> jax.Array:
  """Zeros ``(size, *shape.shape)`` that vary over the mesh axes ``shape`` varies over (inside
  ``shard_map``, as :func:`jax.eval_shape` reports them), so a loop can carry them."""
  zeros = jnp.zeros((size, *shape.shape), shape.dtype)
  mat = getattr(shape, "manual_axis_type", None)
  varying = tuple(sorted(mat.varying)) if mat is not None else ()
  return lax.pcast(zeros, varying, to="varying") if varying else zeros


def per_sequence(body: Callable, arrays: Sequence[jax.Array], *scalars):
  """``body(readers, *scalars, looped=...)`` for one sequence, with a streaming batching rule.

  Args:
    body: ``body(readers, *scalars, looped) -> pytree of arrays``; ``readers[k]`` reads rows
      of ``arrays[k]`` (see :func:`reader`). It must read ``arrays`` only through the readers.
      ``looped`` is True when the body runs for one sequence at a time (one sequence, or the
      CPU batch loop: its branches are real, see :func:`branch`), False under ``vmap``.
    arrays: the sequence's ``(R_k, V_k)`` row arrays.
    *scalars: the other per-sequence inputs (pytrees of arrays), passed to ``body`` as is.

  Returns:
    ``body``'s output; under ``jax.vmap`` every leaf gets a leading batch axis.
  """
  arrays = tuple(arrays)
  n = len(arrays)

  def single(*args, looped: bool = True):
    return body([reader(a) for a in args[:n]], *args[n:], looped=looped)

  batched_single = jax.custom_batching.custom_vmap(single)

  @batched_single.def_vmap
  def _rule(axis_size, in_batched, *args):
    axes = tuple(jax.tree.map(lambda b: 0 if b else None, b) for b in in_batched)

    def vectorised(*args):
      return jax.vmap(functools.partial(single, looped=False), in_axes=axes)(*args)

    leaves = [(leaf, b) for x, f in zip(args, in_batched, strict=True)
              for leaf, b in zip(jax.tree.leaves(x), jax.tree.leaves(f), strict=True)]
    if axis_size == 0 or any(b and explicitly_sharded_batch(leaf) for leaf, b in leaves):
      out = vectorised(*args)  # a loop over a sharded batch axis would gather it
      return out, jax.tree.map(lambda _: True, out)

    def looped(*args):
      def at(x, batched, i):
        return jax.tree.map(
          lambda leaf, b: lax.dynamic_index_in_dim(leaf, i, keepdims=False) if b else leaf,
          x, batched)

      def one(i):
        readers = [reader(a, i if any(jax.tree.leaves(in_batched[k])) else None, in_batched[k])
                   for k, a in enumerate(args[:n])]
        rest = [at(x, b, i) for x, b in zip(args[n:], in_batched[n:], strict=True)]
        return body(readers, *rest, looped=True)

      # The loop state is typed like what the body writes (inside shard_map: the same varying
      # mesh axes), from its abstract output: the body is staged once, inside the loop (not
      # also for a first sequence outside it, which made the compiled program a third larger).
      init = jax.tree.map(lambda s: stacked_zeros(s, axis_size),
                          jax.eval_shape(one, jnp.int32(0)))

      def step(i, out):
        return jax.tree.map(lambda o, r: lax.dynamic_update_index_in_dim(o, r, i, 0),
                            out, one(i))

      return lax.fori_loop(0, axis_size, step, init)

    out = lax.platform_dependent(*args, cpu=looped, default=vectorised)
    return out, jax.tree.map(lambda _: True, out)  # every output is batched

  return batched_single(*arrays, *scalars)
