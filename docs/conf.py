"""Sphinx configuration of the specdec_jax documentation (``make docs``; warnings are errors).

Pages are Markdown (MyST) and the notebooks, shown with their stored outputs (``make test``
executes them, the site does not run them again); the API reference is generated from the
docstrings (autodoc, Google-style sections through napoleon).
"""

from __future__ import annotations

import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

project = "specdec_jax"
author = "the specdec_jax developers"
copyright = "2026, the specdec_jax developers"

extensions = [
  "myst_nb",
  "sphinx.ext.autodoc",
  "sphinx.ext.autosummary",
  "sphinx.ext.napoleon",
  "sphinx.ext.mathjax",
]
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}
master_doc = "index"
myst_enable_extensions = ["dollarmath"]
myst_heading_anchors = 3
nb_execution_mode = "off"  # the notebooks' stored outputs (make test executes them)
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
suppress_warnings = ["myst.xref_missing", "myst.header"]
html_theme = "alabaster"
html_title = "specdec_jax"
nitpicky = False


def _copy_notebooks(_app) -> None:
  """The notebooks live in notebooks/ (where make test runs them); the site shows copies."""
  target = HERE / "_notebooks"
  target.mkdir(exist_ok=True)
  for notebook in (ROOT / "notebooks").glob("*.ipynb"):
    shutil.copy2(notebook, target / notebook.name)


def setup(app):
  app.connect("builder-inited", _copy_notebooks)
