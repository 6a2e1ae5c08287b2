"""Every public name imports and is documented."""

import inspect

import specdec_jax


def test_every_public_name_imports_and_has_a_docstring():
  assert specdec_jax.__all__, "empty __all__"
  for name in specdec_jax.__all__:
    obj = getattr(specdec_jax, name)
    assert obj.__doc__ and obj.__doc__.strip(), f"{name} has no docstring"


def test_signatures_of_the_entry_points():
  assert list(inspect.signature(specdec_jax.sample).parameters) == ["probs", "rng"]
  assert list(inspect.signature(specdec_jax.speculative_step).parameters) == [
    "p", "q", "draft", "rng"
  ]
  params = inspect.signature(specdec_jax.verify).parameters
  assert list(params)[:4] == ["p", "q", "draft", "uniforms"]
  assert params["pad_id"].kind is inspect.Parameter.KEYWORD_ONLY
  assert params["pad_id"].default == -1
  fields = specdec_jax.VerifyResult._fields
  for field in ("tokens", "num_tokens", "num_uniforms", "valid", "error"):
    assert field in fields


def test_reference_module_is_public():
  from specdec_jax import reference

  for name in ("sample", "speculative_step", "output_distribution", "residual"):
    assert callable(getattr(reference, name))


def test_structured_names_import_and_have_docstrings():
  from specdec_jax import structured

  for name in structured.__all__:
    obj = getattr(structured, name)
    if name != "FREE":  # an int constant, documented where it is defined
      assert obj.__doc__ and obj.__doc__.strip(), f"structured.{name} has no docstring"
  assert structured.FREE == 0
