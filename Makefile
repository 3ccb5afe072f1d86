# `make demo` and `make test` do all the set-up on a fresh machine.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.mixprec-installed
PYTEST_ARGS ?=

.PHONY: demo test lint bench venv clean

$(STAMP): pyproject.toml mixprec/__init__.py  # the version lives in __init__.py
	test -x $(PY) || python3 -m venv $(VENV)
	# pinned: an unpinned torch pulls a multi-GB CUDA build
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test,demo,dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) -m mixprec demo

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .

bench: $(STAMP)
	$(PY) -m mixprec bench

clean:
	rm -rf $(VENV) build *.egg-info
