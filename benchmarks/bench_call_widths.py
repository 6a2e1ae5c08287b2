"""What one SmolLM2 target call costs on 1, 2, 4 tokens, and four ways of computing it.

``python benchmarks/bench_call_widths.py [--widths 1 2 4] [--rounds 5]``: batch 1, a 512-slot KV
cache, 16 calls per jitted ``fori_loop`` (each call's argmax feeds the next, the cache carried
as in a decoding loop); every variant is compiled first, then timed in turn each round
(medians, :func:`~specdec_jax.app.e2e_costs.timed_together`), so the ratios are side by side.
Variants of the projections of each layer:

* ``scan``: the committed forward (``models.llama_forward.forward``: a scan over the layers
  reading each layer's weights out of the stacked arrays by a dynamic index);
* ``per-layer``: the layers unrolled over per-layer weight arrays made before the call, so
  nothing is sliced out of stacked arrays;
* ``split``: the committed forward with each projection done token by token (one
  matrix-vector product per token);
* ``transposed``: the weights stored ``(out, in)`` and contracted on their last axis, as the
  output head is.

Run it again with ``XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=`` to see the calls without
XLA's YNNPACK dots. The variants replace ``llama_forward``'s ``jnp`` by a namespace whose
``einsum`` differs, while tracing only. Needs the ``model`` extra.
"""

from __future__ import annotations

import argparse
import contextlib
import types

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from specdec_jax.app.e2e_costs import timed_together
from specdec_jax.app.smollm2 import load_smollm2
from specdec_jax.models import llama_forward
from specdec_jax.models.llama_params import init_cache

SLOTS, CALLS = 512, 16
PROJECTIONS = ("btd,dn->btn", "btn,nd->btd", "btd,df->btf", "btf,fd->btd")


@contextlib.contextmanager
def projections(einsum):
  """``llama_forward`` traced with ``einsum`` for the layer projections (jnp's otherwise)."""
  def patched(spec, a, b, **kw):
    return einsum(a, b) if spec in PROJECTIONS else jnp.einsum(spec, a, b, **kw)
  namespace = types.SimpleNamespace(**{k: getattr(jnp, k) for k in dir(jnp)
                                       if not k.startswith("__")})
  namespace.einsum = patched
  llama_forward.jnp = namespace
  try:
    yield
  finally:
    llama_forward.jnp = jnp


def split(a, w):  # one matrix-vector product per token
  return jnp.stack([a[:, t] @ w for t in range(a.shape[1])], axis=1)


def transposed(a, w):  # w stored (out, in)
  return lax.dot_general(a, w, (((2,), (1,)), ((), ())))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4])
  parser.add_argument("--rounds", type=int, default=5)
  args = parser.parse_args()
  if min(args.widths) < 1:
    parser.error(f"--widths: expected tokens per call >= 1, got {args.widths}")
  model = load_smollm2(progress=False)
  params, config = model.params, model.config
  per_layer = tuple(jax.tree.map(lambda a, i=i: jnp.asarray(np.asarray(a[i])), params.layers)
                    for i in range(config.n_layers))
  stored_out_in = params._replace(layers=params.layers._replace(
    **{k: jnp.swapaxes(getattr(params.layers, k), 1, 2)
       for k in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")}))

  def scan_forward(p, tokens, positions, cache):
    visible = jnp.arange(SLOTS)[None, None, :] <= positions[:, :, None]
    logits, _, cache = llama_forward.forward(p, tokens, positions, positions, visible, cache,
                                             config, None)
    return logits, cache

  def unrolled_forward(p, tokens, positions, cache):
    visible = jnp.arange(SLOTS)[None, None, :] <= positions[:, :, None]
    x = jnp.take(params.embed, tokens, axis=0)
    cos, sin = llama_forward.rope_angles(positions, config)
    for j, w in enumerate(p):
      x, cache = llama_forward.decoder_layer(config, w, x, cache, j, positions, visible, cos, sin)
    x = llama_forward.rms_norm(x, params.final_norm, config.norm_eps)
    return jnp.einsum("btd,vd->btv", x, params.embed), cache

  def loop(forward, width, einsum=None):
    @jax.jit
    def run(p, cache):
      def body(i, carry):
        cache, token = carry
        positions = (i * width + jnp.arange(width, dtype=jnp.int32))[None]
        logits, cache = forward(p, jnp.broadcast_to(token, (1, width)), positions, cache)
        return cache, jnp.argmax(logits[0, -1]).astype(jnp.int32)
      with projections(einsum) if einsum else contextlib.nullcontext():
        return lax.fori_loop(0, CALLS, body, (cache, jnp.int32(1)))[1]
    return run

  variants = {}
  for width in args.widths:
    variants[("scan", width)] = (loop(scan_forward, width), params)
    variants[("per-layer", width)] = (loop(unrolled_forward, width), per_layer)
    if width > 1:
      variants[("split", width)] = (loop(scan_forward, width, split), params)
    variants[("transposed", width)] = (loop(scan_forward, width, transposed), stored_out_in)
  cache = init_cache(config, 1, SLOTS)
  last = {}
  for key, (run, p) in variants.items():  # compile; every variant must compute the same call
    last[key] = int(run(p, cache))
  for (name, width), token in last.items():
    if token != last[("scan", width)]:
      raise SystemExit(f"{name} at width {width} ended on token {token}, the committed "
                       f"forward on {last[('scan', width)]}")
  seconds = timed_together({key: lambda run=run, p=p: run(p, cache)
                            for key, (run, p) in variants.items()}, args.rounds)
  base = seconds[("scan", min(args.widths))]
  print(f"{'variant':12s} {'tokens':>6s} {'ms/call':>8s}  of scan on {min(args.widths)}")
  for (name, width), s in seconds.items():
    print(f"{name:12s} {width:6d} {s / CALLS * 1e3:8.1f}  {s / base:.2f}x")


if __name__ == "__main__":
  main()
