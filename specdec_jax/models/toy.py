"""Tiny n-gram language models that follow the :class:`~specdec_jax.models.protocol.Model` protocol.

They exist for tests, docs and notebooks: the logits at position ``t`` depend only on
the tokens at ``t - 1`` and ``t`` (a trigram model, ``context=2``) or on the token at
``t`` alone (a bigram model, ``context=1``), through a fixed random table. So the
probability of any sequence can be enumerated exactly, while the cache behaves as a
real one does: it stores the tokens by position, a call writes its tokens into their
slots first and then reads slot ``t - 1``, and writing past the accepted length is
rolled back just by moving the length. Their ``tree_apply`` reads each tree node's
parent slot instead of the previous slot, as tree attention does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specdec_jax.models.protocol import FeatureDraft
from specdec_jax.models.protocol import Model


def _init_cache(batch: int, max_len: int) -> jax.Array:
  return jnp.zeros((batch, max_len), jnp.int32)


def _apply_trigram(params, tokens, positions, cache):
  table = params["table"]  # (V + 1, V, V); row V is "before the start"
  vocab = table.shape[-1]
  rows = jnp.arange(tokens.shape[0], dtype=jnp.int32)[:, None]
  cache = cache.at[rows, positions].set(tokens, mode="drop")
  prev_pos = positions - 1
  prev = cache[rows, jnp.clip(prev_pos, 0, cache.shape[1] - 1)]
  prev = jnp.where(prev_pos >= 0, prev, vocab)
  return table[prev, tokens].astype(jnp.float32), cache


def _features_trigram(params, tokens, positions, cache):
  """``apply`` plus features: ``concat(one_hot(previous token, V + 1), one_hot(token, V))``."""
  logits, cache = _apply_trigram(params, tokens, positions, cache)
  return logits, _trigram_features(params, tokens, positions - 1, cache), cache


def _trigram_features(params, tokens, prev_slots, cache):
  """``concat(one_hot(token at prev_slots, V + 1), one_hot(token, V))``; row ``V``: no token."""
  vocab = params["table"].shape[-1]
  rows = jnp.arange(tokens.shape[0], dtype=jnp.int32)[:, None]
  prev = cache[rows, jnp.clip(prev_slots, 0, cache.shape[1] - 1)]
  prev = jnp.where(prev_slots >= 0, prev, vocab)
  return jnp.concatenate([jax.nn.one_hot(prev, vocab + 1), jax.nn.one_hot(tokens, vocab)], -1)


def _apply_bigram(params, tokens, positions, cache):
  rows = jnp.arange(tokens.shape[0], dtype=jnp.int32)[:, None]
  cache = cache.at[rows, positions].set(tokens, mode="drop")
  return params["table"][tokens].astype(jnp.float32), cache


def _tree_prev_slots(start, nodes, tree_mask):
  """``(B, T)``: the slot of each tree token's parent (``start - 1`` for a node without one)."""
  tree_mask = jnp.asarray(tree_mask, bool)
  lead = (1,) * (tree_mask.ndim - 1)  # (1,) for one mask (T, N), (1, 1) for one per row
  j = jnp.arange(tree_mask.shape[-1], dtype=jnp.int32).reshape(*lead, -1)
  strict = tree_mask & (j < nodes.reshape(*lead[1:], -1, 1))  # strict ancestors
  parent = jnp.max(jnp.where(strict, j, -1), axis=-1)  # the deepest one is the parent
  return start[:, None] + parent.reshape(-1, parent.shape[-1])  # (B, T)


def _tree_apply_trigram(params, tokens, positions, cache, start, nodes, tree_mask):
  table = params["table"]
  vocab = table.shape[-1]
  rows = jnp.arange(tokens.shape[0], dtype=jnp.int32)[:, None]
  cache = cache.at[rows, start[:, None] + nodes[None, :]].set(tokens, mode="drop")
  prev_slot = _tree_prev_slots(start, nodes, tree_mask)
  prev = cache[rows, jnp.clip(prev_slot, 0, cache.shape[1] - 1)]
  prev = jnp.where(positions >= 1, prev, vocab)
  return table[prev, tokens].astype(jnp.float32), cache


def _tree_features_trigram(params, tokens, positions, cache, start, nodes, tree_mask):
  """``tree_apply`` plus the features of :func:`_features_trigram` (previous = the parent)."""
  logits, cache = _tree_apply_trigram(params, tokens, positions, cache, start, nodes, tree_mask)
  prev_slots = jnp.where(positions >= 1, _tree_prev_slots(start, nodes, tree_mask), -1)
  return logits, _trigram_features(params, tokens, prev_slots, cache), cache


def _tree_apply_bigram(params, tokens, positions, cache, start, nodes, tree_mask):
  del positions, tree_mask
  rows = jnp.arange(tokens.shape[0], dtype=jnp.int32)[:, None]
  cache = cache.at[rows, start[:, None] + nodes[None, :]].set(tokens, mode="drop")
  return params["table"][tokens].astype(jnp.float32), cache


def _copy_slots(cache, src, dst):
  return jax.vmap(lambda c, s, d: c.at[d].set(c[s]))(cache, src, dst)


def make_toy_model(key: jax.Array, vocab_size: int, *, context: int = 2, scale: float = 2.0,
                   name: str | None = None) -> Model:
  """A random bigram or trigram model as a :class:`Model` (for tests and examples).

  The next-token logits after the token at position ``t`` are
  ``table[token[t - 1], token[t]]`` (``context=2``; before position 0 the row
  ``table[V]`` is used) or ``table[token[t]]`` (``context=1``), with the table drawn
  from ``scale * normal(key)``. Two models made from the same key and arguments
  share ``apply``/``init_cache`` functions, so they hit the same compiled loop.

  Args:
    key: a ``jax.random`` key for the table.
    vocab_size: ``V >= 1``.
    context: 1 (bigram) or 2 (trigram).
    scale: standard deviation of the logits.
    name: label; defaults to ``"bigram"`` / ``"trigram"``.

  Returns:
    :class:`Model` whose ``params`` is ``{"table": float32 (V + 1, V, V) or (V, V)}``
    and whose cache is the int32 ``(batch, max_len)`` array of tokens by position.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> model = make_toy_model(jax.random.key(0), vocab_size=5)
    >>> cache = model.init_cache(1, 8)
    >>> logits, cache = model.apply(model.params, jnp.array([[3, 1]]), jnp.array([[0, 1]]), cache)
    >>> logits.shape, cache[0, :3].tolist()
    ((1, 2, 5), [3, 1, 0])

  Reference:
    Shannon, "A Mathematical Theory of Communication" (n-gram models), 1948.
  """
  if vocab_size < 1:
    raise ValueError(f"make_toy_model: expected vocab_size >= 1, got {vocab_size} instead.")
  if context not in (1, 2):
    raise ValueError(f"make_toy_model: expected context 1 or 2, got {context} instead.")
  shape = (vocab_size + 1, vocab_size, vocab_size) if context == 2 else (vocab_size, vocab_size)
  table = scale * jax.random.normal(key, shape, jnp.float32)
  apply = _apply_trigram if context == 2 else _apply_bigram
  tree_apply = _tree_apply_trigram if context == 2 else _tree_apply_bigram
  label = name or ("trigram" if context == 2 else "bigram")
  return Model(params={"table": table}, apply=apply, init_cache=_init_cache,
               vocab_size=vocab_size, name=label, tree_apply=tree_apply, copy_slots=_copy_slots,
               apply_features=_features_trigram if context == 2 else None,
               tree_apply_features=_tree_features_trigram if context == 2 else None)


def _feature_draft_apply(params, tokens, features, positions, cache):
  """The toy feature draft: the previous token is read off the feature ``f[t - 1]``."""
  del positions
  table, ids = params["table"], params["ids"]
  vocab = table.shape[-1]
  second = features[..., vocab + 1:]
  prev = jnp.where(second.sum(-1) > 0, jnp.argmax(second, -1), vocab)  # zeros: before the start
  logits = table[prev, tokens][..., ids]
  predicted = jnp.concatenate([jax.nn.one_hot(prev, vocab + 1), jax.nn.one_hot(tokens, vocab)],
                              -1)
  return logits, predicted, cache


def _feature_draft_tree_apply(params, tokens, features, positions, cache, start, nodes,
                              tree_mask):
  """The toy feature draft on tree nodes: each node reads its parent's feature, no cache."""
  del start, nodes, tree_mask
  return _feature_draft_apply(params, tokens, features, positions, cache)


def make_toy_feature_draft(target: Model, *, noise: float = 0.0, key: jax.Array | None = None,
                           vocab_ids=None, name: str = "toy feature draft") -> FeatureDraft:
  """A :class:`~specdec_jax.decoding.FeatureDraft` for a trigram toy target (tests, examples).

  The target's features (``apply_features``) are ``concat(one_hot(x[t - 1]), one_hot(x[t]))``;
  the draft reads ``x[t - 1]`` off ``f[t - 1]`` and looks up the target's table, plus
  ``noise * normal(key)``, over ``vocab_ids`` (default: all). With no noise and the whole
  vocabulary it is the target itself, *if* the loop hands it the right features: every
  proposal is then accepted, which tests the feature plumbing.

  Example:
    >>> import jax
    >>> target = make_toy_model(jax.random.key(0), vocab_size=5)
    >>> make_toy_feature_draft(target).vocab_ids.tolist()
    [0, 1, 2, 3, 4]
  """
  table = target.params["table"]
  vocab = table.shape[-1]
  if noise:
    table = table + noise * jax.random.normal(key, table.shape, table.dtype)
  ids = jnp.arange(vocab, dtype=jnp.int32) if vocab_ids is None else jnp.asarray(vocab_ids,
                                                                                jnp.int32)
  return FeatureDraft(params={"table": table, "ids": ids}, apply=_feature_draft_apply,
                      init_cache=_init_cache, vocab_ids=ids, name=name,
                      tree_apply=_feature_draft_tree_apply)


__all__ = ("make_toy_feature_draft", "make_toy_model")
