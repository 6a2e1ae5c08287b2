"""A tensor- and data-parallel Llama in the decoding loops, on the 8 in-process CPU devices."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from specdec_jax import PromptLookup
from specdec_jax import SamplingParams
from specdec_jax import generate
from specdec_jax import speculative_generate
from specdec_jax.models import llama
from specdec_jax.models.llama_sharding import auto_mesh
from specdec_jax.models.llama_sharding import shard_model

CONFIG = llama.LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=8,
                           ffn_dim=64)
PARAMS = llama.init_params(jax.random.key(0), CONFIG)
MESH = jax.make_mesh((2, 4), ("data", "model"))
B = 4


def _inputs(sharded: bool):
  rng = np.random.default_rng(0)
  prompt = rng.integers(0, 64, size=(B, 6)).astype(np.int32)
  lengths = np.array([6, 3, 5, 1], np.int32)
  if not sharded:
    return jnp.asarray(prompt), jnp.asarray(lengths)
  return (jax.device_put(prompt, NamedSharding(MESH, P("data", None))),
          jax.device_put(lengths, NamedSharding(MESH, P("data"))))


def test_parameters_and_cache_are_split_over_the_model_axis():
  model = shard_model(llama.make_model(PARAMS, CONFIG), CONFIG, MESH, model_axis="model",
                      batch_axis="data")
  wq = model.params.layers.wq
  assert wq.sharding.spec == P(None, None, "model")
  assert {s.data.shape for s in wq.addressable_shards} == {(2, 32, 8)}  # 1/4 of the heads each
  w_down = model.params.layers.w_down
  assert {s.data.shape for s in w_down.addressable_shards} == {(2, 16, 32)}
  cache = jax.jit(model.init_cache, static_argnums=(0, 1))(B, 16)
  assert {s.data.shape for s in cache.k.addressable_shards} == {(2, B // 2, 1, 16, 8)}


@pytest.mark.parametrize("loop", ["generate", "speculative"])
def test_sharded_decoding_gives_the_unsharded_tokens(loop):
  plain = llama.make_model(PARAMS, CONFIG)
  sharded = shard_model(plain, CONFIG, MESH, model_axis="model", batch_axis="data")
  greedy = SamplingParams(0.0)

  def run(model, prompt, lengths):
    if loop == "generate":
      return generate(model, prompt, lengths, jax.random.key(1), max_new_tokens=12, params=greedy)
    return speculative_generate(model, PromptLookup(), prompt, lengths, jax.random.key(1),
                                gamma=3, max_new_tokens=12, params=greedy)

  want = run(plain, *_inputs(False))
  got = run(sharded, *_inputs(True))
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
  np.testing.assert_array_equal(np.asarray(got.error), 0)
  assert got.tokens.sharding.spec[0] == "data" or not got.tokens.sharding.is_fully_replicated


def collectives(hlo: str) -> list[tuple[str, str]]:
  """``(op, result shape)`` of every collective in compiled HLO text."""
  pattern = r"= (\S+) (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)\("
  return [(op, shape) for shape, op in re.findall(pattern, hlo)]


def test_what_crosses_devices_per_step():
  """Only activations cross devices, never a weight or the cache: per layer and step, the
  all-reduces of the row-split projections' partial sums, (B / data, T, D) per device, and
  small gathers of the new keys/values and their positions for the cache write."""
  sharded = shard_model(llama.make_model(PARAMS, CONFIG), CONFIG, MESH, model_axis="model",
                        batch_axis="data")
  # Called directly (outside the loops, which relabel), the model takes Auto-axis inputs.
  tokens = jax.device_put(np.zeros((B, 1), np.int32),
                          NamedSharding(auto_mesh(MESH), P("data", None)))
  cache = jax.jit(sharded.init_cache, static_argnums=(0, 1))(B, 16)
  hlo = jax.jit(sharded.apply).lower(sharded.params, tokens, tokens, cache).compile().as_text()
  found = collectives(hlo)
  assert any(op == "all-reduce" for op, _ in found), f"the model is not split: {found}"
  sizes = [int(np.prod([int(d) for d in shape.split("[")[1].split("]")[0].split(",") if d]))
           for _, shape in found]
  smallest_weight = CONFIG.dim * CONFIG.head_dim  # one head's slice of one projection
  assert max(sizes) <= B * 1 * CONFIG.dim < smallest_weight, found


def test_bad_split_is_rejected():
  config = CONFIG._replace(n_kv_heads=2)
  model = llama.make_model(llama.init_params(jax.random.key(0), config), config)
  with pytest.raises(ValueError, match=r"shard_model: `config.n_kv_heads` = 2 must be divisible"):
    shard_model(model, config, MESH, model_axis="model")


def replica_groups(text: str) -> list[list[int]]:
  """The device groups of an HLO ``replica_groups=`` value (explicit or iota form)."""
  if text.startswith("{"):
    return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", text)]
  shape, rest = re.match(r"\[([\d,]+)\]<=(.*)", text).groups()
  dims = [int(d) for d in re.match(r"\[([\d,]+)\]", rest).group(1).split(",")]
  ids = np.arange(int(np.prod(dims))).reshape(dims)
  perm = re.search(r"T\(([\d,]+)\)", rest)
  if perm:
    ids = ids.transpose([int(p) for p in perm.group(1).split(",")])
  return ids.reshape([int(d) for d in shape.split(",")]).tolist()


def loop_collectives(generate_call) -> list[tuple[str, str, str, list[list[int]]]]:
  """``(computation, op, result shape, groups)`` of every collective in the compiled
  data-parallel loop that ``generate_call(run_loop)`` runs."""
  from specdec_jax.decoding import chain
  from specdec_jax.decoding import data_parallel

  seen = {}

  def spy(loop, result_type, args, batch_args, static, *, prompt_index):
    assert prompt_index == 2
    seen.update(loop=loop, result_type=result_type, args=args, batch_args=batch_args,
                static=static)
    return data_parallel.run_loop(loop, result_type, args, batch_args, static,
                                  prompt_index=prompt_index)

  original = chain.run_loop
  chain.run_loop = spy
  try:
    generate_call()
  finally:
    chain.run_loop = original
  fn = data_parallel.loop_function(seen["loop"], seen["result_type"], seen["args"],
                                   seen["batch_args"], seen["static"], prompt_index=2)
  found, computation = [], None
  for line in fn.lower(*seen["args"]).compile().as_text().splitlines():
    if line and not line.startswith(" ") and "{" in line:
      computation = line.split("(")[0].strip()
    m = re.search(r"= (.+?) (all-reduce|all-gather|reduce-scatter|all-to-all|"
                  r"collective-permute)(?:-start)?\(.*replica_groups=(\{\{[\d,{}]*\}\}|\S+?\])"
                  r"(?:T\([\d,]+\))?", line)
    if m:
      groups_text = line[m.start(3):].split(" ")[0].rstrip(",")
      found.append((computation, m.group(2), m.group(1), replica_groups(groups_text)))
  return found


def test_what_crosses_the_data_axis_in_the_loop():
  """Data-parallel loop (shard_map over `data`), tensor-parallel model (over `model`): per step
  only the model's activation all-reduces within a data group; across the data axis nothing
  but the final max of the two batch-wide counters (two int32 scalars, once)."""
  sharded = shard_model(llama.make_model(PARAMS, CONFIG), CONFIG, MESH, model_axis="model",
                        batch_axis="data")
  prompt, lengths = _inputs(True)
  found = loop_collectives(lambda: speculative_generate(
    sharded, PromptLookup(), prompt, lengths, jax.random.key(1), gamma=3, max_new_tokens=6,
    params=SamplingParams(0.0)))
  model_size = MESH.shape["model"]
  crossing = [f for f in found if any(len({d // model_size for d in g}) > 1 for g in f[3])]
  assert [(op, shape) for _, op, shape, _ in crossing] == [("all-reduce", "(s32[], s32[])")], found
  assert crossing[0][0].startswith("ENTRY"), crossing  # after the loop, not in it
  in_loop = [f for f in found if not f[0].startswith("ENTRY")]
  assert in_loop and all(op == "all-reduce" for _, op, _, _ in in_loop), found
  for _, _, shape, groups in in_loop:  # (B / data, <= gamma + 1 or the prompt, D) activations
    dims = [int(d) for d in shape.split("[")[1].split("]")[0].split(",")]
    assert dims[0] == B // 2 and dims[-1] == CONFIG.dim, found
    assert sorted(map(sorted, groups)) == [[0, 1, 2, 3], [4, 5, 6, 7]], found
