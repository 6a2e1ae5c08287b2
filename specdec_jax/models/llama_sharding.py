"""A tensor- and data-parallel Llama: ``jax.sharding`` annotations, no hand-written collectives.

Megatron-style tensor parallelism (Shoeybi et al. 2019, arXiv:1909.08053) over a ``model`` mesh
axis: the q/k/v projections and the MLP's gate/up projections are split by output columns
(attention heads, hidden units), the output and down projections by input rows, so each device
holds ``1 / n`` of every layer and of the KV cache (its heads); embeddings and norms are
replicated. The batch (and the KV cache's batch axis) is split over a ``data`` axis. XLA's
partitioner inserts the collectives (an all-reduce after each row-split projection); the
decoding loops need no change: a target too large for one device runs in them as is.

Works the same with one process or many (``jax.distributed``): :func:`shard_params` builds the
global arrays from host values every process holds in full.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import AxisType
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from specdec_jax.models.llama import KVCache
from specdec_jax.models.llama import LayerParams
from specdec_jax.models.llama import LlamaConfig
from specdec_jax.models.llama import LlamaParams
from specdec_jax.models.llama import init_cache
from specdec_jax.models.protocol import Model


def layer_specs(model_axis: str) -> LayerParams:
  """The :class:`~specdec_jax.models.llama.LayerParams` partition specs of tensor parallelism."""
  cols, rows = P(None, None, model_axis), P(None, model_axis, None)
  return LayerParams(attn_norm=P(), wq=cols, wk=cols, wv=cols, wo=rows, mlp_norm=P(),
                     w_gate=cols, w_up=cols, w_down=rows)


def auto_mesh(mesh: Mesh) -> Mesh:
  """``mesh`` with every axis of type ``Auto`` (XLA's partitioner places what is not annotated).

  ``jax.make_mesh`` may give ``Explicit`` axes, under which every contraction over a split
  dimension needs an explicit output sharding; the model is written for the partitioner.
  """
  return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def _global(value, mesh: Mesh, spec: P) -> jax.Array:
  host = np.asarray(value)
  sharding = NamedSharding(mesh, spec)
  return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def shard_params(params: LlamaParams, mesh: Mesh, model_axis: str) -> LlamaParams:
  """Place a Llama's parameters on ``mesh``, tensor-parallel over ``model_axis``.

  Every process must pass the same values (as after loading the same file or seeding the same
  key); each keeps only the shards of its own devices.

  Args:
    params: :class:`~specdec_jax.models.llama.LlamaParams` (host or single-device arrays).
    mesh: a ``jax.sharding.Mesh``.
    model_axis: the mesh axis the heads and MLP units are split over.

  Returns:
    :class:`~specdec_jax.models.llama.LlamaParams` of global arrays.
  """
  mesh = auto_mesh(mesh)
  specs = layer_specs(model_axis)
  layers = LayerParams(*(_global(a, mesh, s) for a, s in zip(params.layers, specs, strict=True)))
  output = None if params.output is None else _global(params.output, mesh, P())
  return LlamaParams(embed=_global(params.embed, mesh, P()), layers=layers,
                     final_norm=_global(params.final_norm, mesh, P()), output=output)


def shard_model(model: Model, config: LlamaConfig, mesh: Mesh, *, model_axis: str,
                batch_axis: str | None = None) -> Model:
  """A Llama :class:`~specdec_jax.models.Model` whose parameters and KV cache are sharded.

  Args:
    model: from :func:`~specdec_jax.models.llama.make_model` (its parameters on the host or
      one device).
    config: its shape; ``n_heads``, ``n_kv_heads`` and ``ffn_dim`` must be divisible by the
      size of ``model_axis``.
    mesh: the mesh.
    model_axis: the tensor-parallel axis.
    batch_axis: optional data-parallel axis of the batch (the cache's batch axis is split
      over it; the batch size must be divisible by its size).

  Returns:
    The same :class:`~specdec_jax.models.Model` with sharded ``params`` and an ``init_cache``
    that lays the cache out as ``(layers, B / data, KV / model, max_len, head_dim)`` per device.

  Example:
    >>> import jax
    >>> from specdec_jax.models import llama
    >>> c = llama.LlamaConfig(vocab_size=32, dim=16, n_layers=1, n_heads=2, n_kv_heads=2,
    ...                       head_dim=8, ffn_dim=32)
    >>> mesh = jax.make_mesh((1, 2), ("data", "model"))
    >>> m = shard_model(llama.make_model(llama.init_params(jax.random.key(0), c), c), c, mesh,
    ...                 model_axis="model", batch_axis="data")
    >>> m.params.layers.wq.sharding.spec == jax.sharding.PartitionSpec(None, None, "model")
    True
  """
  n = mesh.shape[model_axis]
  for field in ("n_heads", "n_kv_heads", "ffn_dim"):
    if getattr(config, field) % n:
      raise ValueError(f"shard_model: `config.{field}` = {getattr(config, field)} must be "
                       f"divisible by the size {n} of mesh axis {model_axis!r}.")
  mesh = auto_mesh(mesh)
  n_run = model.init_cache(1, 1).k.shape[0]  # the layers the model runs
  return model._replace(params=shard_params(model.params, mesh, model_axis),
                        init_cache=functools.partial(_sharded_cache, config, mesh, model_axis,
                                                     batch_axis, n_run))


def _sharded_cache(config: LlamaConfig, mesh: Mesh, model_axis: str, batch_axis: str | None,
                   n_run: int, batch: int, max_len: int) -> KVCache:
  """An empty cache split by heads over ``model_axis`` and by rows over ``batch_axis``.

  Inside ``shard_map`` over the batch axis (the decoding loops' data parallelism, see
  :mod:`specdec_jax.decoding.data_parallel`) the rows are already local: only the heads are
  constrained, on the context mesh.
  """
  cache = init_cache(config, batch, max_len, n_layers=n_run)
  context = jax.sharding.get_abstract_mesh()
  if not context.empty and batch_axis in context.manual_axes:
    spec = P(None, None, model_axis, None, None)
    return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, spec), cache)
  sharding = NamedSharding(auto_mesh(mesh), P(None, batch_axis, model_axis, None, None))
  return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, sharding), cache)
