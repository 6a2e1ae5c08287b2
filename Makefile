# Two commands on a fresh machine with Python 3.11+ and make:
#   make demo   - create .venv, install, run the demo
#   make test   - create .venv, install with the test extra, lint and run the whole suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: demo test test-slow lint bench install install-test clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(VENV)/bin/python
	$(PIP) install --quiet -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(VENV)/bin/python
	$(PIP) install --quiet -e '.[test]'
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

demo: install
	$(PY) -m specdec_jax

lint: install-test
	$(PY) -m ruff check .

test: install-test lint
	$(PY) -m pytest -q

# Side-by-side timings of verify against the NumPy floor and baselines (several minutes).
# The PyTorch column appears when torch is installed: $(PIP) install -e '.[bench]'
bench: install
	$(PY) -m specdec_jax.bench $(BENCH_ARGS)

test-slow: install-test
	$(PY) -m pytest -q -m slow

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
