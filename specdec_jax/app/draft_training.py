"""The training behind ``make train-draft``: the self-distillation corpus, the draft vocabulary
and the EAGLE draft's training loop (optax AdamW). :mod:`specdec_jax.app.train_draft` is the
command line that runs them on SmolLM2 and says what each step means.

Reference: Li et al., "EAGLE", arXiv:2401.15077; Li et al., "EAGLE-3", arXiv:2503.01840;
Zhao et al., "FR-Spec", arXiv:2502.14856; Zhang et al., "HASS", arXiv:2408.15766.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax import SamplingParams
from specdec_jax import generate
from specdec_jax.models import eagle
from specdec_jax.models.llama import LlamaConfig
from specdec_jax.models.llama import LlamaParams
from specdec_jax.models.llama import init_cache
from specdec_jax.models.llama import llama_apply_features
from specdec_jax.models.llama import rms_norm


def say(progress: bool, message: str) -> None:
  """Print ``message`` to stderr when ``progress`` is on."""
  if progress:
    print(message, file=sys.stderr, flush=True)


def generate_corpus(target, prompts: Sequence[Sequence[int]], *, temperatures: Sequence[float],
                    max_new_tokens: int, batch: int, eos_id: int | None, seed: int = 0,
                    progress: bool = True) -> list[np.ndarray]:
  """The target's own answers: one sequence (prompt + answer) per prompt and temperature."""
  sequences = []
  jobs = [(list(p), t) for t in temperatures for p in prompts]
  start = time.perf_counter()
  for i in range(0, len(jobs), batch):
    chunk = jobs[i: i + batch]
    chunk += [chunk[-1]] * (batch - len(chunk))  # one compiled shape
    width = max(len(p) for p, _ in chunk)
    prompt = np.zeros((batch, width), np.int32)
    for b, (p, _) in enumerate(chunk):
      prompt[b, :len(p)] = p
    lengths = np.array([len(p) for p, _ in chunk], np.int32)
    params = SamplingParams(temperature=jnp.asarray([t for _, t in chunk], jnp.float32))
    out = generate(target, jnp.asarray(prompt), jnp.asarray(lengths), jax.random.key(seed + i),
                   max_new_tokens=max_new_tokens, params=params, eos_id=eos_id,
                   max_len=width + max_new_tokens)
    tokens, total = np.asarray(out.tokens), np.asarray(out.lengths)
    for b in range(min(batch, len(jobs) - i)):
      sequences.append(tokens[b, :total[b]].copy())
    say(progress, f"  corpus: {min(i + batch, len(jobs))}/{len(jobs)} answers, "
                   f"{sum(map(len, sequences))} tokens, {time.perf_counter() - start:.0f} s")
  return sequences


def frequent_vocab(sequences: Sequence[np.ndarray], size: int, vocab: int,
                   always: Sequence[int] = ()) -> np.ndarray:
  """The ``size`` most frequent ids of the corpus (``always`` included), sorted by id."""
  counts = np.bincount(np.concatenate(list(sequences)), minlength=vocab).astype(np.float64)
  counts[list(always)] = np.inf
  order = np.argsort(-counts, kind="stable")[:min(size, vocab)]
  return np.sort(order).astype(np.int32)


class Corpus:
  """Padded training arrays: ``tokens (N, T)``, ``mask (N, T)``, target ``features (N, T, D)``
  and ``lse (N, T)`` (the log-normaliser of the target's full softmax at each position); with
  ``fused``, also ``hidden (N, T, k D)`` float16, the target's hidden states entering its
  :func:`~specdec_jax.models.eagle.fused_layers` (EAGLE-3), else None."""

  def __init__(self, params: LlamaParams, config: LlamaConfig, sequences: Sequence[np.ndarray],
               *, length: int, batch: int = 8, progress: bool = True, fused: bool = False):
    n = len(sequences)
    self.tokens = np.zeros((n, length), np.int32)
    self.mask = np.zeros((n, length), bool)
    for i, s in enumerate(sequences):
      s = s[:length]
      self.tokens[i, :len(s)] = s
      self.mask[i, :len(s)] = True
    feats, lses, hidden = [], [], []
    taps = eagle.fused_layers(config.n_layers)
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))

    @jax.jit
    def forward(p, t, c):
      if not fused:
        logits, f, _ = llama_apply_features(p, t, positions, c, config=config)
        return jax.nn.logsumexp(logits, axis=-1), f, None
      # One pass: the taps and the last layer's output, final-normed here as the head reads it.
      logits, h, _ = llama_apply_features(p, t, positions, c, config=config,
                                          feature_layers=(*taps, config.n_layers))
      top = len(taps) * config.dim
      f = rms_norm(h[..., top:], p.final_norm, config.norm_eps)
      return jax.nn.logsumexp(logits, axis=-1), f, h[..., :top]

    start = time.perf_counter()
    for i in range(0, n, batch):
      rows = self.tokens[i: i + batch]
      pad = batch - rows.shape[0]
      rows = np.pad(rows, ((0, pad), (0, 0)))
      lse, f, h = forward(params, jnp.asarray(rows), init_cache(config, batch, length))
      feats.append(np.asarray(f)[:batch - pad])
      lses.append(np.asarray(lse)[:batch - pad])
      if fused:
        hidden.append(np.asarray(h, np.float16)[:batch - pad])
      say(progress, f"  features: {min(i + batch, n)}/{n} sequences, "
                     f"{time.perf_counter() - start:.0f} s")
    self.features = np.concatenate(feats)
    self.lse = np.concatenate(lses)
    self.hidden = np.concatenate(hidden) if fused else None


def draft_loss(weights: eagle.EagleWeights, embed, head, batch, noise_key, *,
               config: LlamaConfig, noise: float = 0.05, unrolled_weight: float = 0.5,
               feature_weight: float = 0.1, unroll: int = 1):
  """EAGLE's losses on one batch, over a teacher-forced pass and ``unroll`` unrolled passes.

  ``batch = (tokens (B, T), mask (B, T), features (B, T, D), lse (B, T))``, and for a draft
  with ``weights.fuse`` (EAGLE-3) also ``hidden (B, T, k D)``. Position ``t`` reads ``x[t]``
  and ``f[t - 1]`` (zeros at 0), or the fused hidden states at ``t - 1``, and is scored
  against the target's next-token probabilities at ``t`` on the draft vocabulary
  (cross-entropy) and, without ``fuse``, against ``f[t]`` (smooth L1; EAGLE-3 drops it).
  Unrolled pass ``k`` reads, in place of ``f[t - 1]``, what pass ``k - 1`` predicted there:
  the ``k + 1``-th proposal of a draft run ahead of the target (the training-time test of
  EAGLE-3 / HASS), weighted ``unrolled_weight``. Returns ``(loss, cross-entropy of the first
  pass)``.
  """
  tokens, mask, feats, lse, *hidden = batch
  if weights.fuse is not None:
    if not hidden:
      raise ValueError("draft_loss: a draft with `fuse` needs the batch's hidden states "
                       "(tokens, mask, features, lse, hidden); got 4 arrays")
    feature_weight = 0.0
  b, t = tokens.shape
  layer = eagle.layer_config(config)
  params = eagle.EagleParams(weights=weights, embed=embed, head=head)
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  target_p = jnp.exp(jnp.einsum("btd,kd->btk", feats, head) - lse[..., None])
  valid = (mask & (jnp.arange(t) >= 1)[None]).astype(jnp.float32)
  count = jnp.maximum(valid.sum(), 1.0)

  def run(inputs):
    cache = init_cache(layer, b, t, n_layers=1)
    logits, g, _ = eagle.eagle_apply(params, tokens, inputs, positions, cache, config=layer)
    ce = -(target_p * jax.nn.log_softmax(logits, axis=-1)).sum(-1)
    diff = jnp.abs(g - feats)
    reg = jnp.where(diff < 1.0, 0.5 * diff ** 2, diff - 0.5).mean(-1)
    return (ce * valid).sum() / count, (reg * valid).sum() / count, g

  source = feats if weights.fuse is None else eagle.fuse_features(hidden[0], weights.fuse)
  shifted = jnp.pad(source, ((0, 0), (1, 0), (0, 0)))[:, :t]
  scale = jax.lax.stop_gradient(jnp.std(source))
  shifted = shifted + noise * scale * jax.random.uniform(noise_key, shifted.shape, minval=-1.0)
  ce1, reg1, g = run(shifted)
  loss = ce1 + feature_weight * reg1
  for _ in range(unroll):
    ce, reg, g = run(jnp.pad(g, ((0, 0), (1, 0), (0, 0)))[:, :t])
    loss = loss + unrolled_weight * (ce + feature_weight * reg)
  return loss, ce1


def learning_rate_schedule(steps: int, learning_rate: float):
  """The optax schedule of :func:`train_eagle`: a linear warm-up from 0 over
  ``min(100, steps // 10 + 1)`` steps, then a cosine decay to 5% by step ``steps``.

  A run of one step has no warm-up (it would be the whole run, at a rate of 0), and the decay
  always has a step to take (optax refuses zero decay steps).
  """
  import optax  # the training extra

  warmup = min(100, steps // 10 + 1, steps - 1)
  return optax.warmup_cosine_decay_schedule(0.0, learning_rate, warmup, max(steps, warmup + 1),
                                            learning_rate * 0.05)


def train_eagle(params: LlamaParams, config: LlamaConfig, corpus: Corpus, vocab_ids: np.ndarray,
                *, steps: int, batch: int, learning_rate: float = 1e-3, seed: int = 0,
                unroll: int = 1, progress: bool = True, log_every: int = 50):
  """Train the draft's weights on a :class:`Corpus`: ``(weights, losses)``; ``unroll``: the
  unrolled passes of :func:`draft_loss`. A corpus with ``hidden`` trains a fused-feature
  (EAGLE-3) draft.

  Needs ``optax`` (``pip install 'specdec_jax[train]'``).
  """
  import optax  # the training extra; the library and the demo do not need it

  key = jax.random.key(seed)
  key, init_key = jax.random.split(key)
  fused = corpus.hidden is not None
  weights = eagle.init_weights(init_key, config, fused=fused)
  head_all = params.embed if params.output is None else params.output
  head = jnp.take(head_all, jnp.asarray(vocab_ids), axis=0)
  schedule = learning_rate_schedule(steps, learning_rate)
  optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.0))
  with jax.numpy_dtype_promotion("standard"):
    state = optimizer.init(weights)

  @jax.jit
  def step(weights, state, batch_arrays, key):
    (loss, ce), grads = jax.value_and_grad(draft_loss, has_aux=True)(
      weights, params.embed, head, batch_arrays, key, config=config, unroll=unroll)
    updates, state = optimizer.update(grads, state, weights)
    return optax.apply_updates(weights, updates), state, loss, ce

  rng = np.random.default_rng(seed)
  n = corpus.tokens.shape[0]
  losses = []
  start = time.perf_counter()
  for i in range(steps):
    rows = rng.choice(n, size=batch, replace=n < batch)
    arrays = (jnp.asarray(corpus.tokens[rows]), jnp.asarray(corpus.mask[rows]),
              jnp.asarray(corpus.features[rows]), jnp.asarray(corpus.lse[rows]))
    if fused:
      arrays += (jnp.asarray(corpus.hidden[rows]),)
    key, sub = jax.random.split(key)
    with jax.numpy_dtype_promotion("standard"):  # optax relies on implicit promotion
      weights, state, loss, ce = step(weights, state, arrays, sub)
    losses.append(float(ce))
    if progress and (i + 1) % log_every == 0:
      say(True, f"  step {i + 1}/{steps}: loss {float(loss):.3f}, cross-entropy "
                 f"{np.mean(losses[-log_every:]):.3f}, {time.perf_counter() - start:.0f} s")
  return weights, losses


def training_bytes(config: LlamaConfig, *, sequences: int, length: int, batch: int, unroll: int,
                   fused: bool, draft_vocab: int, answers: int, answer_batch: int,
                   prompt_room: int = 256) -> dict[str, int]:
  """Upper estimates of what each phase of training a draft of ``config`` holds at once, bytes.

  ``model``: the target's float32 weights (held throughout); ``generation``: ``answer_batch``
  answers of ``answers`` tokens at once (caches for prompts of up to ``prompt_room`` tokens
  plus the answers, and the prompts' logits; 0 answers: a stored corpus); ``corpus``: the
  :class:`Corpus` arrays of ``sequences`` sequences of ``length`` tokens (ids, mask,
  log-normaliser, the ``D``-wide feature; ``fused``: three hidden states in float16);
  ``features``: the target's pass over 8 of them (``V`` logits per token, ``8 H T`` bytes of
  attention scores per token); ``step``: one :func:`train_eagle` step (per token and pass the
  ``K = draft_vocab`` probabilities, logits and gradients, and ``12 H T`` bytes of attention).
  The constants bound what XLA:CPU's ``memory_analysis`` reports for these jitted functions at
  SmolLM2's shape: the step at batch 8, length 256, unroll 1 measured 0.8 GB (estimate 0.8 GB),
  at length 2048 11.8 GB (estimate 12.8 GB); the features at length 2048 4.5 GB (6.3 GB).
  """
  c, t, k = config, length, draft_vocab
  d, v, h = c.dim, c.vocab_size, c.n_heads
  n_q, n_kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
  layer = 2 * d + d * n_q + 2 * d * n_kv + n_q * d + 3 * d * c.ffn_dim
  generation = answer_batch * 4 * (
    (prompt_room + answers) * c.n_layers * 2 * n_kv + prompt_room * v) if answers else 0
  return {"model": 4 * (v * d + c.n_layers * layer + d),
          "generation": generation,
          "corpus": sequences * t * (9 + 4 * d + (6 * d if fused else 0)),
          "features": 8 * t * (4 * v + 64 * d + 8 * h * t),
          "step": batch * t * (16 * k + (unroll + 1) * (8 * k + 64 * d + 12 * h * t))}
