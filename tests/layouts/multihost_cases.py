"""The calls of the multi-process test, written once for both sides of the comparison.

:func:`run_cases` runs every public entry point on arrays that ``put(host_array, spec)`` places
on a ``(2, 4)`` mesh ``data x model``: in the test process (one process, 8 CPU devices) ``put``
is ``jax.device_put``; in each of the two worker processes (4 CPU devices each, gloo
collectives) it builds a global array that spans both processes (``put(host, spec, on)``
places them on another mesh of the same devices). The workers compare the shards they hold
with the single-process results, exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Collection
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import specdec_jax as sd
from specdec_jax.models import llama
from specdec_jax.models.llama_sharding import shard_model
from specdec_jax.models.toy import make_toy_feature_draft
from specdec_jax.models.toy import make_toy_model

B, GAMMA, V = 8, 3, 32
TOY_V = 16

#: The checks tests/layouts/test_multihost.py also runs in one process under XLA's default flags
#: (the rest of the suite runs under conftest.py's faster-compiling flags): every layout of the
#: logits path, a tree and the two decoding loops with while loops inside while loops, so
#: that a flag which changed a float or a loop's result fails there.
DEFAULT_FLAG_CHECKS = ("vocab-parallel packed_verify from logits",
                       "batch-sharded verify_logits key=", "packed_tree_verify",
                       "speculative_generate lookup adaptive",
                       "tree_speculative_generate feature draft")


def _distributions(rng, shape):
  x = rng.gamma(0.3, size=shape).astype(np.float32) + 1e-3
  return x / x.sum(-1, keepdims=True)


def run_cases(mesh, put: Callable[..., jax.Array], only: Collection[str] | None = None
              ) -> dict[str, Any]:
  """``{check name: result pytree}`` for every entry point (or the checks named in ``only``),
  on arrays placed by ``put``. The random inputs are drawn whatever ``only`` says, so a check's
  inputs do not depend on which others run."""
  rng = np.random.default_rng(0)
  out = _Checks(only)
  p, q = _distributions(rng, (B, GAMMA + 1, V)), _distributions(rng, (B, GAMMA, V))
  draft = np.stack([[rng.choice(V, p=row) for row in q[b]] for b in range(B)]).astype(np.int32)
  uniforms = rng.random((B, GAMMA + 1), dtype=np.float32)
  num_draft = rng.integers(0, GAMMA + 1, size=B).astype(np.int32)
  rows, seq, vec = P("data", None, None), P("data", None), P("data")

  # 1. Batch-sharded jit(vmap(verify)) and jit(vmap(block_verify)).
  for name, fn in (("verify", sd.verify), ("block_verify", sd.block_verify)):
    out[f"batch-sharded {name}"] = lambda fn=fn: jax.jit(jax.vmap(fn))(
      put(p, rows), put(q, rows), put(draft, seq), put(uniforms, seq),
      num_draft=put(num_draft, vec))

  # 2. Vocab-parallel verification (token and block): V over `model`, batch over `data`.
  vocab_rows = P("data", None, "model")
  for rule in ("token", "block"):
    fn = sd.vocab_parallel_verify(mesh, "model", "data", rule=rule)
    out[f"vocab-parallel {rule}"] = lambda fn=fn: fn(
      put(p, vocab_rows), put(q, vocab_rows), put(draft, seq), put(uniforms, seq),
      put(num_draft, vec))

  # 3. The packed entry point (vLLM's interleaved bonus rows), replicated and vocab-parallel.
  flat = np.concatenate([draft[b, :num_draft[b]] for b in range(B)]).astype(np.int32)
  target_rows = np.concatenate([p[b, :num_draft[b] + 1] for b in range(B)])
  draft_rows = np.concatenate([q[b, :num_draft[b]] for b in range(B)])
  out["packed_verify"] = lambda: sd.packed_verify(
    put(flat, P()), put(num_draft, P()), target_probs=put(target_rows, P()),
    draft_probs=put(draft_rows, P()), max_spec_len=GAMMA, uniforms=put(uniforms, P()),
    bonus_rows=True)
  fn = sd.vocab_parallel_packed_verify(mesh, "model", max_spec_len=GAMMA)
  out["vocab-parallel packed_verify"] = lambda: fn(
    put(flat, P()), put(num_draft, P()), target_probs=put(target_rows, P(None, "model")),
    uniforms=put(uniforms, P()), draft_probs=put(draft_rows, P(None, "model")))

  # 3b. Tree verification: batch-sharded tree_verify, vocab-parallel, and sglang's packed trees.
  parents = np.array([-1, 0, 0, 1], np.int32)
  n = len(parents)
  tp, tq = _distributions(rng, (B, n, V)), _distributions(rng, (B, n, V))
  tokens = rng.integers(0, V, size=(B, n)).astype(np.int32)
  coins = rng.random((B, n), dtype=np.float32)
  out["batch-sharded tree_verify"] = lambda: jax.jit(jax.vmap(
    lambda p, q, t, u: sd.tree_verify(p, q, parents, t, u, law="iid")))(
      put(tp, rows), put(tq, rows), put(tokens, seq), put(coins, seq))
  fn = sd.vocab_parallel_tree_verify(mesh, "model", "data", law="iid")
  out["vocab-parallel tree_verify"] = lambda: fn(
    put(tp, vocab_rows), put(tq, vocab_rows), parents, put(tokens, seq), put(coins, seq))
  # The same tree in sglang's links: node 0's children 1, 2 (first child 1, its next sibling
  # 2), node 1's child 3.
  first = np.tile(np.array([1, 3, -1, -1], np.int32), (B, 1))
  sibling = np.tile(np.array([-1, 2, -1, -1], np.int32), (B, 1))
  out["packed_tree_verify"] = lambda: sd.packed_tree_verify(
    put(tokens, seq), put(first, seq), put(sibling, seq), max_depth=2,
    target_probs=put(tp.reshape(B * n, V), P("data", None)), coins=put(coins, seq))

  # 3c. Logits with per-row sampling parameters and keys: jit(vmap(verify_logits(..., key=k))).
  t_logits = rng.normal(size=(B, GAMMA + 1, V)).astype(np.float32)
  d_logits = rng.normal(size=(B, GAMMA, V)).astype(np.float32)
  row_params = sd.SamplingParams(temperature=put(np.linspace(0, 1.2, B).astype(np.float32), vec),
                                 top_k=put(np.full(B, 7, np.int32), vec))
  row_keys = jax.random.wrap_key_data(
    put(np.asarray(jax.random.key_data(jax.random.split(jax.random.key(9), B))), seq))
  out["batch-sharded verify_logits key="] = lambda: jax.jit(jax.vmap(
    lambda k, t, d, x, prm, n: sd.verify_logits(t, d, x, params=prm, num_draft=n, key=k)))(
      row_keys, put(t_logits, rows), put(d_logits, rows), put(draft, seq), row_params,
      put(num_draft, vec))

  # 3d. Vocab-parallel from vocab-sharded logits (per-row parameters, per-row keys), padded and
  # packed: the rows processed on the shards.
  fn = sd.vocab_parallel_verify(mesh, "model", "data", inputs="logits")
  out["vocab-parallel verify from logits"] = lambda: fn(
    put(t_logits, vocab_rows), put(d_logits, vocab_rows), put(draft, seq), params=row_params,
    num_draft=put(num_draft, vec), key=row_keys)
  flat_t = np.concatenate([t_logits[b, :num_draft[b] + 1] for b in range(B)])
  flat_d = np.concatenate([d_logits[b, :num_draft[b]] for b in range(B)])
  fn = sd.vocab_parallel_packed_verify(mesh, "model", max_spec_len=GAMMA, rule="block")
  out["vocab-parallel packed_verify from logits"] = lambda: fn(
    put(flat, P()), put(num_draft, P()), target_logits=put(flat_t, P(None, "model")),
    draft_logits=put(flat_d, P(None, "model")), params=row_params, key=row_keys)

  # 4. process_logits on batch-sharded rows.
  logits = rng.normal(size=(B, V)).astype(np.float32)
  params = sd.SamplingParams(temperature=0.7, top_k=5, top_p=0.9)
  out["process_logits"] = lambda: jax.jit(jax.vmap(lambda x: sd.process_logits(x, params)))(
    put(logits, seq))

  # 5. The decoding loops with a data-parallel batch: prompts, lengths and keys over `data`.
  target = make_toy_model(jax.random.key(0), TOY_V, name="target")
  small = make_toy_model(jax.random.key(1), TOY_V, context=1, name="small")
  feature = make_toy_feature_draft(target, noise=1.0, key=jax.random.key(2))
  host = (rng.integers(0, TOY_V, size=(B, 5)).astype(np.int32),
          rng.integers(1, 6, size=B).astype(np.int32),
          np.asarray(jax.random.key_data(jax.random.split(jax.random.key(3), B))))
  prompts, lengths = put(host[0], seq), put(host[1], vec)
  keys = jax.random.wrap_key_data(put(host[2], seq))
  sampled = sd.SamplingParams(temperature=0.8)
  common = dict(max_new_tokens=10, params=sampled)
  out["generate"] = lambda: sd.generate(target, prompts, lengths, keys, eos_id=3, **common)
  out["speculative_generate"] = lambda: sd.speculative_generate(
    target, small, prompts, lengths, keys, gamma=3, eos_id=3, **common)
  out["speculative_generate lookup adaptive"] = lambda: sd.speculative_generate(
    target, sd.PromptLookup(), prompts, lengths, keys, gamma=3,
    adaptive=sd.AdaptiveSpeculation(), **common)
  out["speculative_generate feature draft"] = lambda: sd.speculative_generate(
    target, feature, prompts, lengths, keys, gamma=3, **common)
  # One tree loop (the feature draft's): the data-parallel wrapper around it is the one every
  # draft kind and verifier goes through (block verification is checked above, sharded).
  out["tree_speculative_generate feature draft"] = lambda: sd.tree_speculative_generate(
    target, feature, prompts, lengths, keys, tree=sd.DraftTree.from_branching((2, 1)), **common)

  # 6. A tensor-parallel Llama target in the loop: heads and MLP over `model`, batch over `data`.
  config = llama.LlamaConfig(vocab_size=32, dim=32, n_layers=2, n_heads=4, n_kv_heads=4,
                             head_dim=8, ffn_dim=64)
  weights = llama.init_params(jax.random.key(4), config)
  model = shard_model(llama.make_model(weights, config), config, mesh, model_axis="model",
                      batch_axis="data")
  lprompts = put(rng.integers(0, 32, size=(B, 4)).astype(np.int32), seq)
  out["tensor-parallel llama"] = lambda: sd.speculative_generate(
    model, sd.PromptLookup(), lprompts, put(np.full(B, 4, np.int32), vec), keys, gamma=2,
    max_new_tokens=8, params=sd.SamplingParams(0.0)).tokens

  # 7. The same batch on an Explicit-axis mesh (jax.make_mesh's default), called outside and
  # inside jax.set_mesh (the README's advice): both must run and agree (test_multihost checks).
  explicit = Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Explicit,) * 2)
  eargs = (put(host[0], seq, explicit), put(host[1], vec, explicit),
           jax.random.wrap_key_data(put(host[2], seq, explicit)))
  lookup = dict(gamma=3, adaptive=sd.AdaptiveSpeculation(), **common)
  out["explicit mesh"] = lambda: sd.speculative_generate(target, sd.PromptLookup(), *eargs,
                                                         **lookup)
  with jax.set_mesh(explicit):
    out["explicit mesh under set_mesh"] = lambda: sd.speculative_generate(
      target, sd.PromptLookup(), *eargs, **lookup)
  return dict(out)


class _Checks(dict):
  """``{name: result}``: ``checks[name] = thunk`` runs ``thunk`` (an entry point's call) and
  stores its result if ``name`` is wanted (every name when ``only`` is None)."""

  def __init__(self, only: Collection[str] | None):
    super().__init__()
    self.only = only

  def __setitem__(self, name: str, thunk: Callable[[], Any]) -> None:
    if self.only is None or name in self.only:
      super().__setitem__(name, thunk())


def make_mesh():
  """The global ``(2, 4)`` mesh ``data x model`` with ``Auto`` axes (XLA's partitioner places
  what is not annotated; the loops also accept ``Explicit``-axis inputs, see
  tests/models/test_llama_sharding.py)."""
  return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def local_put(mesh) -> Callable[..., jax.Array]:
  """``put(host, spec, on=mesh)`` of the single-process side: ``jax.device_put`` onto a mesh."""
  return lambda host, spec, on=mesh: jax.device_put(host, NamedSharding(on, spec))


def global_put(mesh) -> Callable[..., jax.Array]:
  """``put(host, spec, on=mesh)`` of a worker: a global array from host data every process
  holds in full."""
  def put(host, spec, on=mesh):
    sharding = NamedSharding(on, spec)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
  return put
