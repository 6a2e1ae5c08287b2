"""The EAGLE draft on a tiny random Llama, without training (no optax, no real weights).

tests/app/test_train_draft.py covers the trained draft but is skipped without the train extra,
and its frequency-ranked subset happens to start with the ids ``0 .. K - 1``; here the draft
vocabulary is a scrambled subset, so a head built from the first ``K`` output rows (instead of
the rows of ``vocab_ids``) gives the wrong logits.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax.models import eagle
from specdec_jax.models import llama

TOL = {"atol": 1e-5, "rtol": 1e-5}  # float32 vs float32, the same products
CONFIG = llama.LlamaConfig(vocab_size=24, dim=16, n_layers=1, n_heads=2, n_kv_heads=1,
                           head_dim=8, ffn_dim=32, max_position=32)
VOCAB_IDS = np.array([5, 2, 9, 17, 0, 11], np.int32)  # distinct, not a prefix, not sorted
MAX_LEN = 8


@pytest.mark.parametrize("tie_embeddings", [False, True], ids=["output-head", "tied"])
def test_the_draft_head_is_the_targets_rows_of_vocab_ids(tie_embeddings):
  config = CONFIG._replace(tie_embeddings=tie_embeddings)
  target = llama.init_params(jax.random.key(0), config)
  head_all = np.asarray(target.embed if target.output is None else target.output)
  weights = eagle.init_weights(jax.random.key(1), config)
  draft = eagle.make_eagle_draft(weights, VOCAB_IDS, target, config)
  np.testing.assert_array_equal(draft.vocab_ids, VOCAB_IDS)
  np.testing.assert_array_equal(draft.params.head, head_all[VOCAB_IDS])

  # Through the draft's forward: logit k is the predicted feature's product with the target's
  # output row of token vocab_ids[k].
  tokens = jnp.array([[3, 5, 2, 9], [17, 0, 11, 4]], jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(4, dtype=jnp.int32), (2, 4))
  features = jax.random.normal(jax.random.key(2), (2, 4, config.dim), jnp.float32)
  logits, g, _ = draft.apply(draft.params, tokens, features, positions,
                             draft.init_cache(2, MAX_LEN))
  assert logits.shape == (2, 4, len(VOCAB_IDS))
  g = np.asarray(g, np.float64)
  np.testing.assert_allclose(logits, g @ head_all[VOCAB_IDS].T, **TOL)
  assert not np.allclose(logits, g @ head_all[:len(VOCAB_IDS)].T, **TOL)

  # The same ids in another order: the same logits, their columns in that order.
  order = np.array([3, 0, 5, 1, 4, 2])
  shuffled = eagle.make_eagle_draft(weights, VOCAB_IDS[order], target, config)
  logits2, _, _ = shuffled.apply(shuffled.params, tokens, features, positions,
                                 shuffled.init_cache(2, MAX_LEN))
  np.testing.assert_allclose(logits2, np.asarray(logits)[..., order], **TOL)


@pytest.mark.parametrize(("replace", "named", "shape"), [
  (lambda w: w._replace(fc=w.fc[:, :8]), "`weights.fc`", (32, 16)),
  (lambda w: w._replace(layer=w.layer._replace(wq=w.layer.wq[..., :8])), "`weights.layer.wq`",
   (1, 16, 16)),
  (lambda w: w._replace(layer=jax.tree.map(lambda a: jnp.concatenate([a, a]), w.layer)),
   "`weights.layer.attn_norm`", (1, 16)),
  (lambda w: w._replace(fuse=jnp.zeros((32, 16))), "`weights.fuse`", (16, 16)),
], ids=["fc", "wq", "two-layers", "fuse"])
def test_make_eagle_draft_checks_every_weight_shape(replace, named, shape):
  """A wrong ``fc`` or ``wq`` once failed deep in tracing without naming either, and a ``layer``
  holding two layers was silently cut to the first: each is named, with the expected shape."""
  weights = replace(eagle.init_weights(jax.random.key(1), CONFIG))
  target = llama.init_params(jax.random.key(0), CONFIG)
  with pytest.raises(ValueError, match=rf"make_eagle_draft: {named} must have shape "
                                       rf"{re.escape(str(shape))} for the target's config"):
    eagle.make_eagle_draft(weights, VOCAB_IDS, target, CONFIG)
  with pytest.raises(TypeError, match=r"make_eagle_draft: `weights` must be an EagleWeights"):
    eagle.make_eagle_draft(tuple(weights), VOCAB_IDS, target, CONFIG)


def test_weight_shapes_are_what_init_weights_makes():
  for fused in (False, True):
    weights = eagle.init_weights(jax.random.key(1), CONFIG._replace(n_layers=6), fused=fused)
    arrays = {"fc": weights.fc, **{f"layer.{k}": v for k, v in weights.layer._asdict().items()}}
    if fused:
      arrays["fuse"] = weights.fuse
    shapes = eagle.weight_shapes(CONFIG._replace(n_layers=6), fused=fused)
    assert {k: tuple(v.shape) for k, v in arrays.items()} == shapes
