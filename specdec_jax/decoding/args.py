"""Host-side argument handling of the decoding loops: runs once per call, outside ``jit``.

Shapes, dtypes and static arguments always raise; values raise where this host can read them
(:func:`~specdec_jax._core.checks.is_concrete`), and otherwise are clipped under ``jit`` and flagged
in the result's ``error`` (see :func:`~specdec_jax.decoding.common.make_common`).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType
from jax.sharding import Mesh
from jax.sharding import NamedSharding

from specdec_jax._core.checks import INT
from specdec_jax._core.checks import host_array
from specdec_jax._core.checks import is_concrete
from specdec_jax._logits.params import INT_FIELDS
from specdec_jax._logits.params import per_request
from specdec_jax._logits.process import SamplingParams
from specdec_jax._logits.process import check_params
from specdec_jax.decoding.types import ModelFns
from specdec_jax.models.protocol import Model
from specdec_jax.structured.tables import Grammar


def model_fns(model: Model, name: str, arg: str) -> ModelFns:
  if not isinstance(model, Model):
    raise TypeError(
      f"{name}: `{arg}` must be a specdec_jax.models.Model, got {type(model).__name__} instead."
    )
  return ModelFns(model.apply, model.init_cache, int(model.vocab_size), model.apply_features,
                  f"{name}: `{arg}`")


def check_same_vocab(draft_vocab: int, target_vocab: int, name: str) -> None:
  """``ValueError`` unless a draft model's vocabulary is the target's."""
  if draft_vocab != target_vocab:
    raise ValueError(f"{name}: the draft must share the target's vocabulary, got V = "
                     f"{draft_vocab} for the draft and V = {target_vocab} for the target.")


def auto_axes(tree):
  """``tree`` with every array on an ``Explicit``-axis mesh relabelled to the same mesh's ``Auto``
  axes (same devices and layout: no data moves).

  The loops are written for XLA's partitioner (``Auto`` axes); ``jax.make_mesh`` may give
  ``Explicit`` axes, under which every scatter into a split buffer would need its output
  sharding spelled out. Tracers and unsharded values pass unchanged.
  """
  def relabel(x):
    if isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array):
      return x
    sharding = x.sharding
    if not isinstance(sharding, NamedSharding) or all(
        t == AxisType.Auto for t in sharding.mesh.axis_types):
      return x
    mesh = Mesh(sharding.mesh.devices, sharding.mesh.axis_names,
                axis_types=(AxisType.Auto,) * len(sharding.mesh.axis_names))
    # The same buffers under the new label: no device_put, which refuses a global array whose
    # sharding spans other processes' devices (multi-host) and would copy.
    return jax.make_array_from_single_device_arrays(
      x.shape, NamedSharding(mesh, sharding.spec), [s.data for s in x.addressable_shards])
  return jax.tree.map(relabel, tree)


def check_prompt(prompt_tokens, prompt_lengths, name: str, vocab: int):
  """Shapes and dtypes always; values when the host can read them (raise), else flagged in jit."""
  prompt_tokens = jnp.asarray(host_array(name, "prompt_tokens", prompt_tokens, INT))
  prompt_lengths = jnp.asarray(host_array(name, "prompt_lengths", prompt_lengths, INT))
  if prompt_tokens.ndim != 2 or prompt_tokens.shape[1] < 1:
    raise ValueError(
      f"{name}: `prompt_tokens` must have shape (B, P) with P >= 1, got "
      f"{tuple(prompt_tokens.shape)} instead."
    )
  if not jnp.issubdtype(prompt_tokens.dtype, jnp.integer):
    raise TypeError(f"{name}: `prompt_tokens` must be integer, got {prompt_tokens.dtype} instead.")
  batch, width = prompt_tokens.shape
  if prompt_lengths.shape != (batch,) or not jnp.issubdtype(prompt_lengths.dtype, jnp.integer):
    raise ValueError(
      f"{name}: `prompt_lengths` must be an integer array of shape (B,) = ({batch},), got "
      f"{prompt_lengths.dtype}{tuple(prompt_lengths.shape)} instead."
    )
  if is_concrete(prompt_lengths):
    lengths = np.asarray(prompt_lengths)
    if lengths.size and not ((lengths >= 1).all() and (lengths <= width).all()):
      raise ValueError(
        f"{name}: `prompt_lengths` must be in [1, P] = [1, {width}], got {lengths.tolist()} "
        "instead."
      )
    if is_concrete(prompt_tokens):
      tokens = np.asarray(prompt_tokens)
      real = np.arange(width)[None, :] < lengths[:, None]
      bad = real & ((tokens < 0) | (tokens >= vocab))
      if bad.any():
        row, col = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
          f"{name}: `prompt_tokens` ids must be in [0, V) = [0, {vocab}) within each row's "
          f"length, got {int(tokens[row, col])} at (row {row}, position {col})."
        )
  # Compare in the arrays' own dtypes before the int32 cast, so nothing wraps into range; a
  # traced length outside [1, P] becomes 0 or P + 1, which the loops flag (BAD_LENGTH).
  tokens_ok = (prompt_tokens >= 0) & (prompt_tokens < vocab)
  lengths = jnp.clip(prompt_lengths, 0, width + 1).astype(jnp.int32)
  return prompt_tokens.astype(jnp.int32), lengths, tokens_ok


def row_keys(key, batch: int, name: str) -> jax.Array:
  """One key per row: ``split(key, B)`` for a single key, or ``key`` itself if it has B rows."""
  key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
  typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
  single_ndim = 0 if typed else 1
  if key.ndim == single_ndim:
    return jax.random.split(key, batch)
  if key.ndim == single_ndim + 1 and key.shape[0] == batch:
    return key
  raise ValueError(
    f"{name}: `key` must be one key or a batch of B = {batch} keys, got shape "
    f"{tuple(key.shape)} ({key.dtype}) instead."
  )


def batch_params(params: SamplingParams, batch: int, name: str, *,
                 vocab: int | None = None) -> SamplingParams:
  """Check (:func:`~specdec_jax._logits.process.check_params`; token ids against ``vocab``) and give
  every field a leading ``B`` (a list field: ``(B, L)``)."""
  params = check_params(params, name, batch, vocab=vocab)
  fields = {}
  for field, value in zip(params._fields, params, strict=True):
    if value is None:
      fields[field] = None
      continue
    array = jnp.asarray(value)
    if field == "top_k":  # clip in its own dtype before the cast (no wrap-around)
      array = jnp.clip(array, -1, np.iinfo(np.int32).max)
    dtype = jnp.int32 if field in INT_FIELDS else jnp.float32
    fields[field] = array.astype(dtype)
  return per_request(SamplingParams(**fields), batch)


def static_count(name: str, arg: str, value) -> int:
  """A static count ``>= 1`` (``gamma``, ``max_new_tokens``...) as a Python int: a Python or NumPy
  integer, never a bool (``True`` is not 1) nor a float or string (``"4"`` is not 4)."""
  if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
    raise ValueError(f"{name}: `{arg}` must be an int >= 1, got {value!r} instead.")
  return int(value)


def check_budget(max_new_tokens, max_len, width: int, lengths, name: str,
                  contexts: tuple[tuple[str, int | None], ...]) -> tuple[int, int | None]:
  """``(max_len, context)``: the static buffer length and the models' context (``None``: none).

  A row needs ``length + max_new_tokens`` slots; with concrete lengths a budget that does
  not fit the buffer or a model's context raises, with traced lengths the rows that run out
  of room stop early and are flagged ``OUT_OF_ROOM``.
  """
  max_new_tokens = static_count(name, "max_new_tokens", max_new_tokens)
  if max_len is None:
    max_len = width + int(max_new_tokens)
  elif isinstance(max_len, bool) or not isinstance(max_len, int | np.integer) or max_len < width:
    raise ValueError(
      f"{name}: `max_len` must be an int >= P = {width} (the prompt width), got {max_len!r} "
      "instead."
    )
  known = [(arg, int(c)) for arg, c in contexts if c is not None]
  context = min((c for _, c in known), default=None)
  if is_concrete(lengths) and np.size(lengths):  # (an empty batch needs no room)
    need = int(np.max(np.asarray(lengths))) + int(max_new_tokens)
    if need > max_len:
      raise ValueError(
        f"{name}: `max_len` = {max_len} has no room for the longest prompt plus "
        f"`max_new_tokens` = {need} tokens; pass max_len >= {need} (or None)."
      )
    for arg, c in known:
      if need > c:
        raise ValueError(
          f"{name}: the longest prompt plus `max_new_tokens` is {need} tokens, more than the "
          f"{c} positions the `{arg}` model was trained for (its context_length)."
        )
  return int(max_len), context


def check_grammar(grammar, grammar_state, name: str, batch: int, vocab: int):
  """``(grammar, state (B,) int32)`` of a loop's ``grammar=`` / ``grammar_state=`` arguments,
  ``(None, None)`` without a grammar.

  ``grammar``: a :class:`~specdec_jax.structured.Grammar` over the model's ``vocab`` tokens;
  ``grammar_state``: each row's initial state (``(B,)`` or a scalar for every row; default:
  every row follows the grammar's first grammar, ``grammar.starts[1]``). Concrete states
  outside the table raise; traced ones are flagged ``GRAMMAR`` (the row generates nothing).
  """
  if grammar is None:
    if grammar_state is not None:
      raise ValueError(f"{name}: `grammar_state` was given without `grammar`; pass the "
                       "structured.Grammar its states belong to.")
    return None, None
  if not isinstance(grammar, Grammar):
    raise TypeError(f"{name}: `grammar` must be a specdec_jax.structured.Grammar (from "
                    f"stack_grammars); got {type(grammar).__name__} instead.")
  if grammar.vocab_size != vocab:
    raise ValueError(f"{name}: `grammar` was compiled over {grammar.vocab_size} tokens but the "
                     f"model's vocabulary has {vocab}; compile it with this model's tokenizer.")
  if grammar_state is None:
    if grammar.starts.shape[0] < 2:
      raise ValueError(f"{name}: `grammar` holds no grammar; build it with stack_grammars.")
    grammar_state = grammar.starts[1]
  state = jnp.asarray(grammar_state)
  if not jnp.issubdtype(state.dtype, jnp.integer) or state.ndim > 1 or (
      state.ndim == 1 and state.shape[0] != batch):
    raise ValueError(f"{name}: `grammar_state` must be int ({batch},) or a scalar (each row's "
                     f"initial state); got {state.dtype} {tuple(state.shape)}.")
  if is_concrete(state):
    values = np.asarray(state)
    bad = (values < 0) | (values >= grammar.num_states)
    if np.any(bad):
      raise ValueError(f"{name}: `grammar_state` must be in [0, {grammar.num_states}) (states "
                       f"of `grammar`); got {values.reshape(-1)[np.argmax(bad.reshape(-1))]}.")
  return grammar, jnp.broadcast_to(state.astype(jnp.int32), (batch,))


def check_eos(eos_id, name: str, vocab: int) -> jax.Array:
  """``eos_id`` as an int32 scalar: -1 for None; a traced id outside ``[0, V)`` (-1 included)
  becomes ``V``, which the loops flag (BAD_PARAMS) and no token ever equals."""
  if eos_id is None:
    return jnp.int32(-1)
  eos = host_array(name, "eos_id", eos_id, INT)
  if jnp.shape(eos) != ():
    raise ValueError(f"{name}: `eos_id` must be one token id, got shape {jnp.shape(eos)}.")
  if is_concrete(eos) and not 0 <= int(eos) < vocab:
    raise ValueError(
      f"{name}: `eos_id` must be a token id in [0, V) = [0, {vocab}) or None, got {eos_id!r}."
    )
  eos = jnp.asarray(eos)
  return jnp.where((eos >= 0) & (eos < vocab), eos, vocab).astype(jnp.int32)


def _structure(fn) -> object:
  """A hashable description of what ``fn`` computes, or ``fn`` itself when there is none.

  Functions (lambdas included) are described by their code, defaults and the values they
  close over; ``functools.partial`` objects by their function, arguments and keywords.
  Anything unhashable (an array in a closure) falls back to the object's identity.
  """
  if isinstance(fn, functools.partial):
    key = (functools.partial, _structure(fn.func), fn.args, tuple(sorted(fn.keywords.items())))
  elif isinstance(fn, types.FunctionType):
    cells = tuple(c.cell_contents for c in fn.__closure__ or ())
    key = (fn.__code__, fn.__defaults__, tuple(sorted((fn.__kwdefaults__ or {}).items())),
           cells, id(fn.__globals__))
  else:
    return fn
  try:
    hash(key)
  except TypeError:
    return fn
  return key


class StaticFunction:
  """A user function passed as a static argument of a jitted loop, compared by what it is.

  ``jax.jit`` hashes static arguments; a lambda written at the call site is a new object on
  every call, so hashing by identity would recompile the loop every time. This wrapper
  compares functions by code, defaults and closed-over values instead (see
  :func:`_structure`): the same lambda text with the same captured values reuses the compiled
  loop, a different function or a different captured value compiles a new one. As with any
  jitted code, a global variable the function reads is captured when the loop is traced.
  """

  def __init__(self, fn: Callable):
    self.fn = fn
    self.key = _structure(fn)

  def __call__(self, *args, **kwargs):
    return self.fn(*args, **kwargs)

  def __hash__(self) -> int:
    return hash(self.key)

  def __eq__(self, other) -> bool:
    return isinstance(other, StaticFunction) and self.key == other.key

  def __repr__(self) -> str:
    return f"StaticFunction({self.fn!r})"
