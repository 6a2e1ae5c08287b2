"""The packed layouts split over the vocabulary: :func:`~specdec_jax.packed_verify` and
:func:`~specdec_jax.packed_tree_verify` built for a mesh (the same calls, the same host checks,
their bodies inside ``shard_map``; see :mod:`specdec_jax._layouts.vocab_parallel` for the padded
layouts)."""

from __future__ import annotations

from collections.abc import Callable

from jax.sharding import Mesh

from specdec_jax._core.checks import check_pad_id
from specdec_jax._core.checks import check_static_int
from specdec_jax._layouts.engine import check_convention
from specdec_jax._layouts.mesh import Built
from specdec_jax._layouts.mesh import check_mesh
from specdec_jax._layouts.packed import PackedVerifyResult
from specdec_jax._layouts.packed import packed_call
from specdec_jax._layouts.packed_tree import PackedTreeVerifyResult
from specdec_jax._layouts.packed_tree import packed_tree_call


def vocab_parallel_packed_verify(mesh: Mesh, vocab_axis: str, *, max_spec_len: int,
                                 bonus_rows: bool | None = None, rule: str = "token",
                                 convention: str = "specdec", pad_id: int = -1,
                                 logprobs: int | None = None,
                                 logprobs_mode: str = "processed"
                                 ) -> Callable[..., PackedVerifyResult]:
  """Build :func:`~specdec_jax.packed_verify` on vocab-split packed rows (the same call).

  The packed target (and draft) rows hold ``V / n`` columns per device, as a tensor-parallel
  LM head leaves them, as probabilities or logits with per-request
  :class:`~specdec_jax.SamplingParams` (processed on the shards: greedy rows, temperature,
  top-k, top-p); every request reads its gathered scalars and stop row in place, exactly as
  :func:`vocab_parallel_verify` does for padded rows, so per request O(n) scalars cross
  devices and nothing of size ``V``.

  Multi-host: see the docs, "Sharding and many hosts".

  Args:
    mesh, vocab_axis, pad_id: as in :func:`vocab_parallel_verify`.
    max_spec_len, bonus_rows, rule, convention: static, as in
      :func:`~specdec_jax.packed_verify`.

  Returns:
    ``fn(draft_token_ids, num_draft_tokens, *, target_probs=None, target_logits=None,
    draft_probs=None, draft_logits=None, bonus_token_ids=None, params=None, key=None,
    uniforms=None) -> PackedVerifyResult``: the keyword arguments of
    :func:`~specdec_jax.packed_verify`, with the same meaning.

  Example:
    >>> import jax, numpy as np
    >>> fn = vocab_parallel_packed_verify(jax.make_mesh((1,), ("model",)), "model",
    ...                                   max_spec_len=1)
    >>> p = np.array([[0.0, 1.0], [1.0, 0.0]], np.float32)   # one request: a draft row, a bonus row
    >>> fn(np.array([1]), np.array([1]), target_probs=p,
    ...    uniforms=np.array([[0.5, 0.5]], np.float32)).tokens.tolist()
    [[1, 0]]

  Reference:
    Shoeybi et al., "Megatron-LM", arXiv:1909.08053; the packed layouts of vLLM V1 and
    vllm-project/tpu-inference.
  """
  name = "vocab_parallel_packed_verify"
  check_mesh(name, mesh, vocab_axis)
  pad_id = check_pad_id(name, pad_id)
  check_convention(name, convention)
  max_spec_len = check_static_int(name, "max_spec_len", max_spec_len, 0)

  def impl(a: dict, lower: bool):
    return packed_call(name, mesh, vocab_axis, **a, max_spec_len=max_spec_len,
                       bonus_rows=bonus_rows, rule=rule, convention=convention, pad_id=pad_id,
                       logprobs=logprobs, logprobs_mode=logprobs_mode, lower=lower)

  def fn(draft_token_ids, num_draft_tokens, *, target_probs=None, target_logits=None,
         draft_probs=None, draft_logits=None, bonus_token_ids=None, params=None, key=None,
         uniforms=None, history=None, target_bitmask=None,
         draft_bitmask=None) -> PackedVerifyResult: ...

  return Built(impl, fn, name, vocab_parallel_packed_verify.__doc__)


def vocab_parallel_packed_tree_verify(mesh: Mesh, vocab_axis: str, *, max_depth: int,
                                      law: str = "deterministic",
                                      uniform_layout: str = "per_parent",
                                      convention: str = "specdec", pad_id: int = -1,
                                      logprobs: int | None = None,
                                      logprobs_mode: str = "processed"
                                      ) -> Callable[..., PackedTreeVerifyResult]:
  """Build :func:`~specdec_jax.packed_tree_verify` on vocab-split rows (the same call).

  sglang-jax's tree encoding with target (and draft) rows ``(B * N, V)`` split over
  ``vocab_axis``, as probabilities or logits with per-request parameters; the walk runs
  replicated and only scalars cross devices (as :func:`vocab_parallel_tree_verify`).

  Multi-host: see the docs, "Sharding and many hosts".

  Args:
    mesh, vocab_axis, pad_id: as in :func:`vocab_parallel_verify`.
    max_depth, law, uniform_layout, convention: static, as in
      :func:`~specdec_jax.packed_tree_verify`.

  Returns:
    ``fn(candidates, retrive_next_token, retrive_next_sibling, *, target_probs=None,
    target_logits=None, draft_probs=None, draft_logits=None, params=None, key=None,
    uniforms=None, coins=None, final_coins=None) -> PackedTreeVerifyResult``, as
    :func:`~specdec_jax.packed_tree_verify`.

  Example:
    >>> import jax, numpy as np
    >>> fn = vocab_parallel_packed_tree_verify(jax.make_mesh((1,), ("model",)), "model",
    ...                                        max_depth=1)
    >>> p = np.array([[0.1, 0.6, 0.3], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]], np.float32)
    >>> r = fn(np.array([[0, 2, 1]]), np.array([[1, -1, -1]]), np.array([[-1, 2, -1]]),
    ...        target_probs=p, uniforms=np.array([[0.5, 0.0, 0.9]], np.float32))
    >>> r.tokens.tolist()
    [[1, 2]]

  Reference:
    Miao et al., "SpecInfer", arXiv:2305.09781; sgl-project/sglang-jax (the encoding).
  """
  name = "vocab_parallel_packed_tree_verify"
  check_mesh(name, mesh, vocab_axis)
  pad_id = check_pad_id(name, pad_id)
  check_convention(name, convention)
  max_depth = check_static_int(name, "max_depth", max_depth, 0)

  def impl(a: dict, lower: bool):
    return packed_tree_call(name, mesh, vocab_axis, **a, max_depth=max_depth, law=law,
                            uniform_layout=uniform_layout, convention=convention, pad_id=pad_id,
                            logprobs=logprobs, logprobs_mode=logprobs_mode, lower=lower)

  def fn(candidates, retrive_next_token, retrive_next_sibling, *, target_probs=None,
         target_logits=None, draft_probs=None, draft_logits=None, params=None, key=None,
         uniforms=None, coins=None, final_coins=None, history=None, target_bitmask=None,
         draft_bitmask=None) -> PackedTreeVerifyResult: ...

  return Built(impl, fn, name, vocab_parallel_packed_tree_verify.__doc__)
