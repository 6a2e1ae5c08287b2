"""The draft-training code, on a tiny Llama and its own generations (what ``make train-draft``
does to SmolLM2, at toy size): the loss falls, the trained draft is accepted more often than an
untrained one, the stored weights round-trip, and decoding with the trained draft is exact
(greedy: token for token)."""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("optax", reason="the training extra: pip install -e '.[train]'")

from specdec_jax import SamplingParams
from specdec_jax import generate
from specdec_jax import speculative_generate
from specdec_jax.app import draft_training
from specdec_jax.app import train_draft
from specdec_jax.models import eagle
from specdec_jax.models import llama

CONFIG = llama.LlamaConfig(vocab_size=48, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                           head_dim=8, ffn_dim=64, max_position=128)
PARAMS = llama.init_params(jax.random.key(0), CONFIG, scale=1.5)
TARGET = llama.make_model(PARAMS, CONFIG)
PROMPTS = [[int(t) for t in np.random.default_rng(i).integers(0, 48, size=3 + i % 4)]
           for i in range(16)]


@pytest.fixture(scope="module")
def trained():
  sequences = draft_training.generate_corpus(TARGET, PROMPTS, temperatures=[0.0, 0.8],
                                          max_new_tokens=24, batch=16, eos_id=None,
                                          progress=False)
  assert len(sequences) == 32 and all(len(s) > 24 for s in sequences)
  vocab_ids = draft_training.frequent_vocab(sequences, 40, CONFIG.vocab_size, always=[5])
  assert len(vocab_ids) == 40 and 5 in vocab_ids
  corpus = draft_training.Corpus(PARAMS, CONFIG, sequences, length=32, progress=False)
  weights, losses = draft_training.train_eagle(PARAMS, CONFIG, corpus, vocab_ids, steps=150,
                                            batch=8, learning_rate=3e-3, progress=False)
  return weights, vocab_ids, losses, corpus


def _acceptance(weights, vocab_ids, corpus) -> float:
  """Mean ``sum_x min(p, q)`` of teacher-forced draft predictions (temperature 1)."""
  head = PARAMS.embed[jnp.asarray(vocab_ids)]
  params = eagle.EagleParams(weights, PARAMS.embed, head)
  tokens, mask, feats = (jnp.asarray(a) for a in (corpus.tokens, corpus.mask, corpus.features))
  b, t = tokens.shape
  inputs = feats if weights.fuse is None else eagle.fuse_features(jnp.asarray(corpus.hidden),
                                                                  weights.fuse)
  shifted = jnp.pad(inputs, ((0, 0), (1, 0), (0, 0)))[:, :t]
  layer = eagle.layer_config(CONFIG)
  logits, _, _ = eagle.eagle_apply(params, tokens, shifted,
                                   jnp.broadcast_to(jnp.arange(t), (b, t)),
                                   llama.init_cache(layer, b, t, n_layers=1), config=layer)
  q = jax.nn.softmax(logits, -1)
  p = jax.nn.softmax(feats @ PARAMS.embed.T, -1)[..., jnp.asarray(vocab_ids)]
  overlap = jnp.minimum(p, q).sum(-1)
  valid = np.asarray(mask) & (np.arange(t) >= 1)[None]
  return float(np.asarray(overlap)[valid].mean())


def test_training_lowers_the_loss_and_raises_acceptance(trained):
  weights, vocab_ids, losses, corpus = trained
  assert np.mean(losses[-15:]) < 0.8 * np.mean(losses[:15]), losses[::15]
  fresh = eagle.init_weights(jax.random.key(1), CONFIG)
  before, after = _acceptance(fresh, vocab_ids, corpus), _acceptance(weights, vocab_ids, corpus)
  assert after > before + 0.1, (before, after)


@pytest.fixture(scope="module")
def trained_fused(trained):
  """The same corpus with the target's hidden states: an EAGLE-3 draft (fused features)."""
  _, vocab_ids, _, corpus = trained
  sequences = [t[m] for t, m in zip(corpus.tokens, corpus.mask, strict=True)]
  fused = draft_training.Corpus(PARAMS, CONFIG, sequences, length=32, progress=False, fused=True)
  weights, losses = draft_training.train_eagle(PARAMS, CONFIG, fused, vocab_ids, steps=150,
                                            batch=8, learning_rate=3e-3, progress=False)
  return weights, vocab_ids, losses, fused


def test_a_fused_corpus_holds_the_same_features_and_the_taps(trained, trained_fused):
  _, _, _, corpus = trained
  _, _, _, fused = trained_fused
  np.testing.assert_allclose(fused.features, corpus.features, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(fused.lse, corpus.lse, atol=1e-5, rtol=1e-5)
  taps = llama.make_model(PARAMS, CONFIG, feature_layers=eagle.fused_layers(CONFIG.n_layers))
  t = fused.tokens[:2]
  _, hidden, _ = taps.apply_features(taps.params, jnp.asarray(t),
                                     jnp.broadcast_to(jnp.arange(32), t.shape),
                                     taps.init_cache(2, 32))
  np.testing.assert_allclose(fused.hidden[:2], hidden, rtol=2e-3, atol=2e-3)  # float16
  assert corpus.hidden is None


def test_training_a_fused_draft_lowers_the_loss_and_raises_acceptance(trained_fused):
  weights, vocab_ids, losses, corpus = trained_fused
  assert weights.fuse is not None
  assert np.mean(losses[-15:]) < 0.8 * np.mean(losses[:15]), losses[::15]
  fresh = eagle.init_weights(jax.random.key(1), CONFIG, fused=True)
  before = _acceptance(fresh, vocab_ids, corpus)
  after = _acceptance(weights, vocab_ids, corpus)
  assert after > before + 0.1, (before, after)


def test_a_fused_draft_needs_the_hidden_states():
  w = eagle.init_weights(jax.random.key(0), CONFIG, fused=True)
  batch = (jnp.zeros((1, 4), jnp.int32), jnp.ones((1, 4), bool),
           jnp.zeros((1, 4, CONFIG.dim)), jnp.zeros((1, 4)))
  with pytest.raises(ValueError, match="draft_loss: a draft with `fuse` needs the batch's "
                                       "hidden states"):
    draft_training.draft_loss(w, PARAMS.embed, PARAMS.embed[:8], batch, jax.random.key(0),
                              config=CONFIG)


def test_stored_weights_round_trip(trained, tmp_path):
  weights, vocab_ids, _, _ = trained
  path = tmp_path / "draft.npz"
  eagle.save_eagle(path, weights, vocab_ids)
  loaded, ids = eagle.load_eagle(path)
  np.testing.assert_array_equal(ids, vocab_ids)
  for a, b in zip(jax.tree.leaves(weights), jax.tree.leaves(loaded), strict=True):
    np.testing.assert_allclose(b, a, rtol=1e-3, atol=1e-4)  # float16
  assert path.stat().st_size < 2 * eagle.num_weights(weights) + 10_000


@pytest.mark.parametrize("fused", [False, True], ids=["top-feature", "fused"])
def test_decoding_with_the_trained_draft_is_exact_and_accepts(fused, request):
  weights, vocab_ids, _, _ = request.getfixturevalue("trained_fused" if fused else "trained")
  draft = eagle.make_eagle_draft(weights, vocab_ids, PARAMS, CONFIG)
  target = eagle.make_fused_target(weights, PARAMS, CONFIG) if fused else TARGET
  prompt = jnp.asarray([p[:3] for p in PROMPTS[:4]], jnp.int32)
  lengths = jnp.full((4,), 3, jnp.int32)
  greedy = SamplingParams(0.0)
  plain = generate(TARGET, prompt, lengths, jax.random.key(0), max_new_tokens=20, params=greedy)
  fast = speculative_generate(target, draft, prompt, lengths, jax.random.key(0), gamma=3,
                              max_new_tokens=20, params=greedy)
  np.testing.assert_array_equal(fast.tokens, plain.tokens)
  np.testing.assert_array_equal(fast.error, 0)
  assert int(fast.stats.accepted.sum()) > 0.3 * int(fast.stats.proposals.sum())


def test_make_eagle_draft_rejects_bad_vocab_ids():
  w = eagle.init_weights(jax.random.key(0), CONFIG)
  with pytest.raises(ValueError, match="make_eagle_draft: `vocab_ids` must be distinct ids"):
    eagle.make_eagle_draft(w, [1, 1, 2], PARAMS, CONFIG)
  with pytest.raises(ValueError, match="make_eagle_draft: `vocab_ids` must be distinct ids"):
    eagle.make_eagle_draft(w, [0, 48], PARAMS, CONFIG)


# The command line (`make train-draft`): every argument is checked before SmolLM2 is loaded, a
# corpus the model cannot read is refused before training, and diverged weights are not written.


class _Loaded(Exception):
  """Raised in place of loading SmolLM2 (or training): the arguments got past validation."""


def _never(*_args, **_kwargs):
  raise _Loaded


class _TinyTokenizer:
  eos_id = 5

  def chat_ids(self, message):
    return [1 + len(message) % 40, 2, 3]


def _main(argv, capsys):
  with pytest.raises(SystemExit) as exit_info:
    train_draft.main(argv)
  lines = capsys.readouterr().err.strip().splitlines()
  assert lines[-1].startswith("python -m specdec_jax.app.train_draft: error: "), lines
  assert len([x for x in lines if "error" in x]) == 1 and "Traceback" not in "".join(lines)
  return exit_info.value.code, lines[-1]


@pytest.mark.parametrize(("argv", "message"), [
  (["--batch", "0"], "argument --batch: expected an integer >= 1, got 0"),
  (["--length", "0"], "argument --length: expected an integer >= 2, got 0"),
  (["--length", "1"], "argument --length: expected an integer >= 2, got 1"),
  (["--steps", "0"], "argument --steps: expected an integer >= 1, got 0"),
  (["--steps", "many"], "argument --steps: expected an integer >= 1, got 'many'"),
  (["--max-new-tokens", "0"], "argument --max-new-tokens: expected an integer >= 1, got 0"),
  (["--temperatures", "0", "nan"], "argument --temperatures: expected a finite number >= 0"),
  (["--seed", "-1"], "argument --seed: expected an integer >= 0, got -1"),
  (["--unroll", "-1"], "argument --unroll: expected an integer >= 0, got -1"),
  (["--prompts", "all"], "argument --prompts: invalid choice: 'all'"),
  (["--out", "draft"], "argument --out: expected a path ending in .npz, got 'draft'"),
  # Sizes no machine holds: refused before loading, not after (then killed for memory).
  (["--batch", "1000000000"], "argument --batch/--length/--unroll: expected sizes whose training "
                              "fits in "),
  (["--batch", "1000000000"], "(half of this machine's memory), got --batch 1000000000 --length "
                              "256 --unroll 1, which need about "),
  (["--unroll", "100000"], "got --batch 8 --length 256 --unroll 100000, which need about"),
  (["--temperatures", *["1"] * 100_000], "argument --length/--temperatures/--prompts: expected "
                                         "sizes whose training fits in "),
  (["--length", "8193"], "argument --length: expected an integer in [2, 8192] (no sequence is "
                         "longer than SmolLM2's context of 8192), got 8193"),
  (["--max-new-tokens", "8192"], "argument --max-new-tokens: expected an integer in [1, 8191] "
                                 "(SmolLM2's context of 8192 holds the prompt and answer), got "
                                 "8192"),
], ids=lambda x: " ".join(x[:3]) if isinstance(x, list) else None)
def test_train_draft_arguments_are_checked_before_loading(argv, message, capsys, monkeypatch):
  monkeypatch.setattr(train_draft.smollm2, "load_smollm2", _never)
  code, err = _main(argv, capsys)
  assert code == 2 and message in err


def test_train_draft_without_optax_says_how_to_install_it(capsys, monkeypatch, tmp_path):
  monkeypatch.setattr(train_draft.smollm2, "load_smollm2", _never)
  monkeypatch.setitem(sys.modules, "optax", None)  # `import optax` raises ImportError
  code, err = _main(["--steps", "1", "--out", str(tmp_path / "d.npz")], capsys)
  assert code == 2 and "training needs optax" in err and "pip install -e '.[train]'" in err


def test_train_draft_refuses_an_empty_corpus(capsys, monkeypatch, tmp_path):
  monkeypatch.setattr(train_draft.smollm2, "load_smollm2", _never)
  np.savez(tmp_path / "corpus.npz")
  code, err = _main(["--corpus", str(tmp_path / "corpus.npz"), "--out", str(tmp_path / "d.npz")],
                    capsys)
  assert code == 2 and "argument --corpus: expected a corpus with a sequence of 2 tokens" in err
  assert "is empty" in err


def test_train_draft_refuses_to_write_the_weights_over_the_corpus(capsys, monkeypatch, tmp_path):
  """``--out X --corpus X`` once wrote the weights over the corpus (15 minutes of generation) at
  the end: the same file, however spelled (``..``, a symbolic or hard link), is refused."""
  monkeypatch.setattr(train_draft.smollm2, "load_smollm2", _never)
  corpus = tmp_path / "corpus.npz"
  np.savez(corpus, **{"0": np.arange(5, dtype=np.int32)})
  (tmp_path / "sub").mkdir()
  (tmp_path / "link.npz").symlink_to(corpus)
  os.link(corpus, tmp_path / "hard.npz")
  for out, stored in ((corpus, corpus), (tmp_path / "sub" / ".." / "corpus.npz", corpus),
                      (tmp_path / "link.npz", corpus), (corpus, tmp_path / "hard.npz"),
                      (tmp_path / "new.npz", tmp_path / "sub" / ".." / "new.npz")):
    code, err = _main(["--out", str(out), "--corpus", str(stored)], capsys)
    assert code == 2 and "argument --out: expected a path other than --corpus, got " in err, err
    assert "(the weights would overwrite the corpus)" in err
  assert not (tmp_path / "new.npz").exists()
  with pytest.raises(_Loaded):  # another file: on to the model
    train_draft.main(["--out", str(tmp_path / "d.npz"), "--corpus", str(corpus)])


def test_the_training_memory_estimate_bounds_the_defaults_and_grows_with_each_size():
  c = train_draft.smollm2.CONFIG
  sizes = dict(sequences=288, length=256, batch=8, unroll=1, fused=False, draft_vocab=8192,
               answers=160, answer_batch=24)
  parts = draft_training.training_bytes(c, **sizes)
  assert sum(parts.values()) < 4e9  # the defaults fit a small machine
  assert parts["step"] > 0.75e9  # XLA:CPU's memory_analysis of the step: 0.79 GB
  for name, bigger, part in (("batch", 16, "step"), ("unroll", 3, "step"),
                             ("length", 512, "features"), ("sequences", 600, "corpus"),
                             ("answers", 320, "generation"), ("fused", True, "corpus")):
    assert draft_training.training_bytes(c, **sizes | {name: bigger})[part] > parts[part], name
  assert draft_training.training_bytes(c, **sizes | {"answers": 0})["generation"] == 0


def test_train_draft_out_is_never_the_shipped_weights_by_default():
  parser = train_draft.build_parser()
  out = parser.parse_args([]).out
  assert out.resolve() != train_draft.smollm2.EAGLE_WEIGHTS.resolve()
  assert "--out specdec_jax/app/data/smollm2_eagle.npz" in " ".join(parser.format_help().split())


def _with_tiny_model(monkeypatch, tmp_path, corpus):
  monkeypatch.setattr(train_draft.smollm2, "load_smollm2",
                      lambda **_kwargs: (PARAMS, CONFIG, _TinyTokenizer()))
  np.savez(tmp_path / "corpus.npz", **{str(i): np.asarray(s, np.int32)
                                       for i, s in enumerate(corpus)})
  return ["--corpus", str(tmp_path / "corpus.npz"), "--out", str(tmp_path / "d.npz"),
          "--length", "16"]


def test_train_draft_refuses_ids_outside_the_vocabulary(capsys, monkeypatch, tmp_path):
  argv = _with_tiny_model(monkeypatch, tmp_path, [[1, 2, 3], [4, 48, 6]])  # vocab_size 48
  monkeypatch.setattr(train_draft, "Corpus", _never)
  code, err = _main(argv, capsys)
  assert code == 2 and "argument --corpus: expected token ids in [0, 48)" in err
  assert "with id 48" in err and not (tmp_path / "d.npz").exists()


def test_train_draft_writes_nothing_when_training_diverges(capsys, monkeypatch, tmp_path):
  argv = _with_tiny_model(monkeypatch, tmp_path, [[1, 2, 3], [4, 5, 6]])
  shapes = jax.eval_shape(lambda key: eagle.init_weights(key, CONFIG), jax.random.key(0))
  nan = jax.tree.map(lambda w: np.full(w.shape, np.nan, w.dtype), shapes)
  monkeypatch.setattr(train_draft, "Corpus", lambda *_a, **_k: None)
  monkeypatch.setattr(train_draft, "train_eagle", lambda *_a, **_k: (nan, [float("nan")]))
  assert train_draft.main([*argv, "--steps", "1"]) == 1
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1].startswith("error: training diverged: the draft's weights are not finite")
  assert not (tmp_path / "d.npz").exists()


def test_one_training_step_has_a_learning_rate():
  """``--steps 1`` once died inside optax (a cosine decay of zero steps); its one step must
  also learn (a warm-up would be the whole run, at a rate of 0). Longer runs are unchanged."""
  import optax

  assert float(draft_training.learning_rate_schedule(1, 1e-3)(0)) == pytest.approx(1e-3)
  for steps in (2, 9, 700):
    old = optax.warmup_cosine_decay_schedule(0.0, 1e-3, min(100, steps // 10 + 1), steps, 5e-5)
    new = draft_training.learning_rate_schedule(steps, 1e-3)
    for i in (0, 1, steps // 2, steps - 1):
      assert float(new(i)) == float(old(i))


def test_each_unrolled_pass_reads_the_previous_pass_prediction(trained):
  """The training-time test: ``unroll`` passes after the teacher-forced one, each adding its
  loss (so the loss grows with ``unroll`` while the reported first-pass cross-entropy does not
  change), and pass ``k`` reads what pass ``k - 1`` predicted: a pass fed the target's own
  features instead would score as the first pass does (negative control)."""
  weights, vocab_ids, _, corpus = trained
  head = PARAMS.embed[jnp.asarray(vocab_ids)]
  batch = tuple(jnp.asarray(a[:8]) for a in (corpus.tokens, corpus.mask, corpus.features,
                                             corpus.lse))
  key = jax.random.key(0)

  def loss(unroll, **kwargs):
    return draft_training.draft_loss(weights, PARAMS.embed, head, batch, key, config=CONFIG,
                                     unroll=unroll, noise=0.0, **kwargs)

  (l0, ce0), (l1, ce1), (l2, ce2) = loss(0), loss(1), loss(2)
  assert float(ce0) == float(ce1) == float(ce2)
  assert float(l0) < float(l1) < float(l2)
  # With weight 1 on the unrolled passes and no feature term, pass 1's loss alone is l1 - l0:
  # larger than the first pass's (it reads predictions, not the target's features).
  plain0, _ = loss(0, feature_weight=0.0)
  plain1, _ = loss(1, feature_weight=0.0, unrolled_weight=1.0)
  assert float(plain1 - plain0) > float(plain0) + 1e-3


def test_the_prompt_sets_are_distinct_instructions_and_hold_no_benchmark_prompt():
  from specdec_jax.app import e2e

  for name, prompts in train_draft.PROMPT_SETS.items():
    assert len(set(prompts)) == len(prompts), name
    assert not set(prompts) & set(e2e.PROMPTS.values()), name
  assert len(train_draft.PROMPT_SETS["wide"]) == 148
  assert set(train_draft.TRAIN_PROMPTS) < set(train_draft.WIDE_PROMPTS)
