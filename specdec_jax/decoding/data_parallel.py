"""Data parallelism of the decoding loops: each shard of the batch runs its own loop.

When the prompts arrive split over a mesh axis (a ``NamedSharding`` whose first dimension is
partitioned), the loops run under ``jax.shard_map`` over that axis: every device group holds
its rows, their caches and their state, and runs the jitted ``while_loop`` on them alone. Rows
never interact in the loops (each row has its own key, and a row's output does not depend on
the rest of the batch), so nothing crosses the data axis per step; a shard whose rows are all
finished stops while the others go on. After the loop the two batch-wide counters
(``target_calls``, ``draft_calls``) take their maximum over the shards, the only collective.
Other mesh axes stay with XLA's partitioner, so a tensor-parallel model (see
:mod:`specdec_jax.models.llama_sharding`) runs inside each shard unchanged.

This is the layout of multi-host serving (``jax.distributed``): each process holds its rows
and nothing of another process's batch is ever gathered.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import jax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from specdec_jax._rows.logprobs import result_specs
from specdec_jax.decoding.types import DecodeStats
from specdec_jax.decoding.types import GrammarOutcome


def batch_axis(prompt) -> tuple[object, str | tuple[str, ...]] | None:
  """``(mesh, axis)`` when ``prompt``'s rows are split over mesh axes, else ``None``."""
  sharding = getattr(prompt, "sharding", None)
  if isinstance(prompt, jax.core.Tracer) or not isinstance(sharding, NamedSharding):
    return None
  spec = tuple(sharding.spec) + (None,) * prompt.ndim
  axis = spec[0]
  if axis is None or axis == ():
    return None
  names = axis if isinstance(axis, tuple) else (axis,)
  size = 1
  for name in names:
    size *= sharding.mesh.shape[name]
  if size == 1 or prompt.shape[0] % size:
    return None  # unsplit, or uneven: left to the partitioner
  return sharding.mesh, axis


@functools.cache
def sharded_loop(loop: Callable, result_type: type, mesh, axis, batch_args: tuple[bool, ...],
             static: tuple) -> Callable:
  """The jitted ``shard_map`` of ``loop`` over ``axis`` (cached; ``static`` as sorted items)."""
  names = frozenset(axis if isinstance(axis, tuple) else (axis,))
  rows = P(axis)
  stats = DecodeStats(P(), P(), *(rows,) * (len(DecodeStats._fields) - 2))
  outcome = GrammarOutcome(rows, rows, rows, rows) if dict(static).get("structured") else None
  out_specs = result_type(rows, rows, rows, stats, rows,
                          *result_specs(dict(static).get("logprobs"), rows), outcome)

  def local(*args):
    result = loop(*args, **dict(static))
    counters = result.stats._replace(target_calls=lax.pmax(result.stats.target_calls, axis),
                                     draft_calls=lax.pmax(result.stats.draft_calls, axis))
    return result._replace(stats=counters)

  in_specs = tuple(rows if is_batch else P() for is_batch in batch_args)
  return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                               axis_names=names, check_vma=False))


def loop_function(loop: Callable, result_type: type, args: tuple, batch_args: tuple[bool, ...],
                  static: dict, *, prompt_index: int) -> Callable:
  """The jitted function :func:`run_loop` calls on ``args``: ``loop`` with ``static`` bound,
  under ``shard_map`` over the batch's mesh axis when the prompts are split (cached)."""
  split = batch_axis(args[prompt_index])
  if split is None:
    return functools.partial(loop, **static)  # `loop` is jitted with these as static arguments
  mesh, axis = split
  return sharded_loop(loop, result_type, mesh, axis, batch_args, tuple(sorted(static.items())))


def run_loop(loop: Callable, result_type: type, args: tuple, batch_args: tuple[bool, ...],
             static: dict, *, prompt_index: int):
  """``loop(*args, **static)``, under ``shard_map`` over the batch's mesh axis when split.

  Args:
    loop: the jitted loop; its result is ``result_type`` (fields ``tokens, lengths, num_new,
      stats, error`` and the logprobs fields, present when ``static["logprobs"]`` is not None).
    args: its positional arguments; ``batch_args[i]`` tells whether ``args[i]`` has the
      batch as its leading axis (else it is the same on every shard: parameters, ``eos_id``).
    static: its static keyword arguments (hashable).
    prompt_index: where the prompts are in ``args`` (their sharding decides).
  """
  fn = loop_function(loop, result_type, args, batch_args, static, prompt_index=prompt_index)
  split = batch_axis(args[prompt_index])
  # A split batch runs under its own (Auto-axis) mesh as the context: under the caller's
  # `jax.set_mesh` of the Explicit-axis mesh the inputs came on, shard_map would refuse a mesh
  # other than the context's; the devices and layout are the same.
  with contextlib.nullcontext() if split is None else jax.set_mesh(split[0]):
    return fn(*args)
