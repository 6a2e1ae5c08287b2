"""The decoding loops with the target's weights stacked (committed) or one array per layer.

Needs ``tools/patches/per_layer_weights.diff`` applied to the checkout it runs from (the forward
then unrolls the layers when ``params.layers`` is a tuple of per-layer ``LayerParams``)::

  git worktree add /tmp/other HEAD
  git -C /tmp/other apply "$PWD/tools/patches/per_layer_weights.diff"
  PYTHONPATH=/tmp/other python tools/ab_layer_forms.py [--prompt open-ended] [--temperature 0]
      [--rounds 5]

SmolLM2, 128 new tokens at most: plain decoding, the EAGLE chain (gamma 3) fixed and adaptive
(``AdaptiveSpeculation()``) and prompt lookup (gamma 4), each with either form of the weights;
all compiled first, then timed in turn each round (medians,
:func:`~specdec_jax.app.e2e_costs.timed_together`). Each run's tokens must equal those of the
same loop with stacked weights. ``tools/bench_call_widths.py`` times the call alone. Needs the
``model`` extra.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax import PromptLookup
from specdec_jax import SamplingParams
from specdec_jax import generate
from specdec_jax import speculative_generate
from specdec_jax.app import smollm2
from specdec_jax.app.e2e import PROMPTS
from specdec_jax.app.e2e import Setup
from specdec_jax.app.e2e_costs import timed_together
from specdec_jax.decoding import AdaptiveSpeculation
from specdec_jax.models import llama_forward
from specdec_jax.models.llama import make_model


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--prompt", choices=sorted(PROMPTS), default="open-ended")
  parser.add_argument("--temperature", type=float, default=0.0)
  parser.add_argument("--rounds", type=int, default=5)
  args = parser.parse_args()
  if "one LayerParams per layer" not in open(llama_forward.__file__).read():
    raise SystemExit(f"{llama_forward.__file__} has no per-layer form: run this from a checkout "
                     "with tools/patches/per_layer_weights.diff applied (see the docstring)")
  setup = Setup(progress=False)
  params, config = setup.target.params, setup.config
  per_layer = params._replace(layers=tuple(
    jax.tree.map(lambda a, i=i: jnp.asarray(np.asarray(a[i])), params.layers)
    for i in range(config.n_layers)))
  draft = setup.drafts["eagle"]
  ids = setup.encode(PROMPTS[args.prompt])
  prompt, lengths = jnp.asarray([ids], jnp.int32), jnp.asarray([len(ids)], jnp.int32)
  common = dict(max_new_tokens=128, params=SamplingParams(temperature=jnp.float32(
    args.temperature)), eos_id=setup.tokenizer.eos_id)
  key = jax.random.key(0)
  fns = {}
  for form, p in (("stacked", params), ("per-layer", per_layer)):
    target = make_model(p, config, name=setup.target.name)
    fused = smollm2.feature_target(p, config, draft, name=setup.target.name)
    fns[("plain", form)] = lambda t=target: generate(t, prompt, lengths, key, **common)
    fns[("eagle", form)] = lambda t=fused: speculative_generate(
      t, draft, prompt, lengths, key, gamma=3, **common)
    fns[("eagle-adaptive", form)] = lambda t=fused: speculative_generate(
      t, draft, prompt, lengths, key, gamma=3, adaptive=AdaptiveSpeculation(), **common)
    fns[("lookup", form)] = lambda t=target: speculative_generate(
      t, PromptLookup(max_ngram=3), prompt, lengths, key, gamma=4, **common)
  outs = {name: jax.block_until_ready(fn()) for name, fn in fns.items()}
  for (loop, form), out in outs.items():
    if not bool(jnp.all(out.tokens == outs[(loop, "stacked")].tokens)):
      raise SystemExit(f"{loop} with {form} weights gave other tokens than with stacked ones")
  seconds = timed_together(fns, args.rounds)
  base = seconds[("plain", "stacked")]
  print(f"{'loop':15s} {'weights':10s} {'ms':>8s}  {'of plain, same weights':>22s}  "
        f"{'of plain, stacked':>17s}")
  for (loop, form), s in seconds.items():
    print(f"{loop:15s} {form:10s} {s * 1e3:8.1f}  {seconds[('plain', form)] / s:21.3f}x  "
          f"{base / s:16.3f}x")


if __name__ == "__main__":
  main()
