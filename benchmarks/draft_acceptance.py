"""Acceptance of EAGLE drafts on bench-e2e's prompts, side by side, without timing.

``python benchmarks/draft_acceptance.py [WEIGHTS.npz ...] [--gamma 4]``: SmolLM2-135M-Instruct, the
committed draft and each given one (what ``python -m specdec_jax.app.train_draft`` writes; a
draft trained with ``--fused`` runs with the target that computes its fused features), 4 copies
of each of bench-e2e's prompts, 96 new tokens, greedy and at temperature 0.7 (key 1). Prints the
tokens per target call and the conditional acceptance by position: what a draft's quality is,
independently of how fast the machine is. Needs the ``model`` extra.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax import SamplingParams
from specdec_jax import speculative_generate
from specdec_jax.app import e2e
from specdec_jax.app import smollm2


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("weights", nargs="*", type=Path, help="draft weights (.npz) to compare")
  parser.add_argument("--gamma", type=int, default=4)
  args = parser.parse_args()
  setup = e2e.Setup(progress=False)
  params, config, _ = smollm2.load_smollm2(progress=False)
  paths = [("committed", smollm2.EAGLE_WEIGHTS)] + [(p.stem, p) for p in args.weights]
  drafts = {name: smollm2.load_eagle_draft(params, config, path) for name, path in paths}
  targets = {name: smollm2.feature_target(params, config, d) for name, d in drafts.items()}
  for label, text in e2e.PROMPTS.items():
    ids = setup.encode(text)
    prompt = jnp.asarray([ids] * 4, jnp.int32)
    lengths = jnp.full((4,), len(ids), jnp.int32)
    for temperature in (0.0, 0.7):
      for name, draft in drafts.items():
        out = speculative_generate(targets[name], draft, prompt, lengths, jax.random.key(1),
                                   gamma=args.gamma, max_new_tokens=96,
                                   params=SamplingParams(jnp.float32(temperature)),
                                   eos_id=setup.tokenizer.eos_id)
        stats = out.stats
        at = (np.asarray(stats.accepted_at).sum(0)
              / np.maximum(np.asarray(stats.proposed_at).sum(0), 1))
        cond = [at[0]] + [at[i] / max(at[i - 1], 1e-9) for i in range(1, len(at))]
        per_call = float(np.asarray(stats.tokens_per_call).mean())
        print(f"{label:10s} T={temperature} {name}: tokens/call {per_call:.2f}, conditional "
              f"acceptance by position {' '.join(f'{a:.2f}' for a in cond)}", flush=True)


if __name__ == "__main__":
  main()
