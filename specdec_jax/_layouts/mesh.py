"""Running a layout's body over vocabulary shards: one wrapper for every vocab-parallel form.

A layout body (padded batch, packed chains, packed trees) takes an optional ``axis_name``; with
it, its row arrays hold one device's ``V / n`` contiguous columns and the rule reduces the few
statistics it needs over that mesh axis (:mod:`~specdec_jax._rows.sources`). :func:`over_vocab` runs
a body inside ``jax.shard_map`` with the row arrays split over the vocabulary and everything
else replicated (or split over a batch axis); nothing of size ``V`` crosses devices.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from specdec_jax._core.checks import FLOAT
from specdec_jax._core.checks import INT
from specdec_jax._core.checks import KEY
from specdec_jax._core.checks import host_array
from specdec_jax._logits.params import per_request as broadcast_params
from specdec_jax._logits.process import SamplingParams


def place(x: jax.Array, sharding: NamedSharding) -> jax.Array:
  """Lay ``x`` out as ``sharding`` inside jit, on meshes with explicit or automatic axes."""
  if any(t == AxisType.Explicit for t in sharding.mesh.axis_types):
    return jax.sharding.reshard(x, sharding)
  return jax.lax.with_sharding_constraint(x, sharding)


def check_mesh(fn: str, mesh: Mesh, vocab_axis: str, batch_axis: str | None = None) -> int:
  """Raise unless the axes name axes of ``mesh``; returns the number of vocabulary shards."""
  if not isinstance(mesh, Mesh):
    raise TypeError(f"{fn}: `mesh` must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
  for arg, axis in (("vocab_axis", vocab_axis), ("batch_axis", batch_axis)):
    if axis is not None and axis not in mesh.axis_names:
      raise ValueError(f"{fn}: `{arg}` must name an axis of the mesh {mesh.axis_names}, got "
                       f"{axis!r} instead.")
  return mesh.shape[vocab_axis]


def check_divisible(fn: str, arg: str, vocab: int, shards: int, vocab_axis: str) -> None:
  """Raise unless the ``V`` columns of ``arg`` split evenly over the shards."""
  if vocab % shards:
    raise ValueError(f"{fn}: V = {vocab} must be divisible by the {shards} devices of mesh "
                     f"axis {vocab_axis!r} (V: the columns of `{arg}`).")


def check_word_aligned(fn: str, vocab: int, shards: int, vocab_axis: str) -> None:
  """Masks and row edits split over the vocabulary need whole bitmask words per device."""
  if vocab % (32 * shards):
    raise ValueError(f"{fn}: grammar bitmasks and the parameters that adjust logits need the "
                     f"vocabulary split into whole 32-token words per device: V = {vocab} must "
                     f"be divisible by 32 * {shards} (the size of mesh axis {vocab_axis!r}).")


def over_vocab(body: Callable, mesh: Mesh, vocab_axis: str, named: dict, rows: tuple[str, ...],
               out_specs, batch_axis: str | None = None, batched: tuple[str, ...] = ()):
  """``body(named, axis_name=vocab_axis)`` in ``shard_map``: ``rows`` split over the vocabulary.

  Args:
    body: ``body(named, axis_name) -> pytree``; the layout's traced body.
    mesh: the mesh.
    vocab_axis: the mesh axis the last dimension of the ``rows`` arrays is split over.
    named: ``{name: array or None}``; ``None`` entries are passed through as ``None``.
    rows: the names of the row arrays (last axis: the vocabulary).
    out_specs: the result's ``PartitionSpec`` pytree.
    batch_axis: optional mesh axis the leading axis of the ``batched`` arrays (and of the
      ``rows``) is split over.
    batched: the names of the arrays with a leading batch axis.
  """
  present = {k: v for k, v in named.items() if v is not None}

  def spec(k, v):
    lead = (batch_axis,) if batch_axis is not None and (k in batched or k in rows) else ()
    if k in rows:
      return P(*lead, *([None] * (v.ndim - len(lead) - 1)), vocab_axis)
    return P(*lead)

  specs = {k: spec(k, v) for k, v in present.items()}
  present = {k: jax.tree.map(lambda x, k=k: place(jnp.asarray(x), NamedSharding(mesh, specs[k])),
                             v) for k, v in present.items()}

  def local(arrays):
    return body({**dict.fromkeys(named), **arrays}, axis_name=vocab_axis)

  return jax.shard_map(local, mesh=mesh, in_specs=(specs,), out_specs=out_specs)(present)


#: What the row arrays hold (``inputs=``).
INPUTS = ("probs", "logits")

ARRAYS = {"p": FLOAT, "q": FLOAT, "target_logits": FLOAT, "draft_logits": FLOAT, "draft": INT,
           "parents": INT, "tokens": INT, "uniforms": FLOAT, "num_draft": INT, "num_nodes": INT,
           "key": KEY}


def check_inputs(name: str, inputs: str) -> None:
  if inputs not in INPUTS:
    raise ValueError(f"{name}: `inputs` must be one of {INPUTS}, got {inputs!r} instead.")


def batch_size(name: str, arrays) -> int:
  """Check ranks of batched arrays; returns the batch size."""
  batch = None
  for arg, value, rank in arrays:
    if value is None:
      continue
    if not hasattr(value, "ndim") or value.ndim != rank:
      raise ValueError(f"{name}: `{arg}` must be batched with rank {rank}, got shape "
                       f"{tuple(jnp.shape(value))}.")
    if batch is not None and value.shape[0] != batch:
      raise ValueError(f"{name}: `{arg}` must have B = {batch} rows (the batch), got shape "
                       f"{tuple(value.shape)}.")
    batch = value.shape[0] if batch is None else batch
  return batch


def batch_counts(name: str, arg: str, value, batch: int, default: int) -> jax.Array:
  if value is None:
    return jnp.full((batch,), default, jnp.int32)
  if jnp.shape(value) != (batch,):
    raise ValueError(f"{name}: `{arg}` must have shape (B,) = ({batch},), got "
                     f"{jnp.shape(value)}.")
  return jnp.clip(jnp.asarray(value), -1, 2**31 - 1).astype(jnp.int32)


def per_request(params: SamplingParams, batch: int) -> SamplingParams:
  """Every field with a leading ``B`` (:func:`specdec_jax._logits.params.per_request`)."""
  return broadcast_params(params, batch)


class Built:
  """A built vocab-parallel verifier: call it, or ``.lower(...)`` it like a jitted function.

  ``impl(arguments, lower)`` does the host checks and calls the jitted body (or its
  ``lower``); ``signature`` is what the caller sees.
  """

  def __init__(self, impl: Callable, signature: Callable, name: str, doc: str | None):
    self._impl, self._signature = impl, inspect.signature(signature)
    self.__name__ = self.__qualname__ = name
    self.__doc__ = doc
    self.__signature__ = self._signature

  def _bind(self, args, kwargs) -> dict:
    bound = self._signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)

  def __call__(self, *args, **kwargs):
    return self._impl(self._bind(args, kwargs), False)

  def lower(self, *args, **kwargs):
    """The lowered jitted program for these arguments (``.compile().as_text()`` for its HLO)."""
    return self._impl(self._bind(args, kwargs), True)

  def __repr__(self) -> str:
    return f"<vocab-parallel verifier {self.__name__}>"


def host_arrays(name: str, args: dict) -> dict:
  return {k: host_array(name, k, v, ARRAYS[k]) for k, v in args.items()}
