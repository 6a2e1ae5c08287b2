"""The documentation site covers the public API: every name of ``specdec_jax.__all__`` has an
entry in an API page (docs/api/), every page is in a toctree, and the pages the examples test
reads exist. (The site itself is built with warnings as errors by ``make docs``, which
``make test`` runs first.)"""

import re
from pathlib import Path

import specdec_jax
from tests._readme import PAGES

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _entries() -> set[str]:
  names = set()
  for page in (DOCS / "api").glob("*.md"):
    text = page.read_text()
    names |= set(re.findall(r"^\.\. auto(?:function|class):: (\w+)", text, re.M))
    names |= {m.rpartition(".")[2] for m in re.findall(r"^\.\. automodule:: ([\w.]+)", text,
                                                        re.M)}
  return names


def test_every_public_name_has_an_api_entry():
  missing = set(specdec_jax.__all__) - _entries()
  assert not missing, f"public names without an API entry in docs/api/: {sorted(missing)}"
  assert "structured" in _entries()


def test_every_page_is_in_a_toctree():
  text = "\n".join(p.read_text() for p in DOCS.rglob("*.md"))
  listed = set(re.findall(r"^([\w/]+)$", text, re.M))
  for page in DOCS.rglob("*.md"):
    name = page.relative_to(DOCS).with_suffix("").as_posix()
    if name == "index":
      continue
    short = name.rpartition("/")[2]
    assert name in listed or short in listed, f"docs/{name}.md is in no toctree"


def test_the_example_pages_exist():
  for page in PAGES:
    assert (DOCS / f"{page}.md").is_file(), page
