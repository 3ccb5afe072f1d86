# `make demo` and `make test` do all the set-up on a fresh machine.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.mixprec-installed
DEMO_STAMP := $(VENV)/.mixprec-demo-installed
PYTEST_ARGS ?=

.PHONY: demo test lint bench docs-figures venv clean

# torch, mixprec and the demo's two packages (scikit-learn, matplotlib): what `make demo` needs
$(DEMO_STAMP): pyproject.toml mixprec/__init__.py  # the version lives in __init__.py
	test -x $(PY) || python3 -m venv $(VENV)
	# pinned to the tested version; from PyPI on Linux x86-64 this is the CUDA build (several GB
	# with NVIDIA's wheels): a torch 2.13.0 already in $(VENV) (the CPU build, say) is kept
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[demo]'
	touch $(DEMO_STAMP)

# everything the tests, the linter and the benchmarks use: every extra, pinned
$(STAMP): $(DEMO_STAMP)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test,demo,dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(DEMO_STAMP)
	$(PY) -m mixprec demo

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .

bench: $(STAMP)
	$(PY) -m mixprec bench

# re-runs the commands behind the documented figures; writes bench/results/docs-figures.md
docs-figures: $(STAMP)
	$(PY) bench/docs_figures.py

clean:
	rm -rf $(VENV) build *.egg-info
