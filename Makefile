# `make demo`, `make test` and `make test-all` do all the set-up on a fresh machine.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.mixprec-installed
DEMO_STAMP := $(VENV)/.mixprec-demo-installed
PYTEST_ARGS ?=

.PHONY: demo test test-all test-slow slow-list lint bench docs-figures venv clean gpu-check

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

# two worker processes, a file each (a file's launched gloo ranks stay in one worker)
PYTEST := $(PY) -m pytest -q -n 2 --dist loadfile

# the fast default: every module's quick tests; `make test-all` adds the `slow` ones; CI runs both halves
test: $(STAMP)
	$(PYTEST) -m "not slow" $(PYTEST_ARGS)

test-all: $(STAMP)
	$(PYTEST) $(PYTEST_ARGS)

# the tests `make test` leaves out (CI runs `make test` then this: together, `make test-all`)
# (of the test matrices: a sample drawn with a printed seed; tests/covering.py says how to steer it)
test-slow: $(STAMP)
	$(PYTEST) -m slow $(PYTEST_ARGS)

# re-measure which tests `make test` leaves out (tests/slow_tests.txt: each >= 0.3 s here)
slow-list: $(STAMP)
	MIXPREC_NO_SLOW_LIST=1 $(PYTEST) -m "not slow" --durations=0 -p no:cacheprovider \
	  > .slow-durations.txt || true
	$(PY) tests/slow_list.py .slow-durations.txt > tests/slow_tests.txt

lint: $(STAMP)
	$(PY) -m ruff check .

bench: $(STAMP)
	$(PY) -m mixprec bench

# re-runs the commands behind the documented figures; writes bench/results/docs-figures.md
docs-figures: $(STAMP)
	$(PY) bench/docs_figures.py

# on a CUDA machine, with that machine's own python3 and torch: installs nothing from an index
# and makes no venv (bench/gpu_check.sh says what it runs; GPU_OUT, GPU_WORKERS, GPU_BUDGET
# adjust it). The CUDA-marked tests, then every GPU benchmark row (bench/gpu_check.py), in under
# 8 minutes; one markdown table with device, torch and commit.
gpu-check:
	bash bench/gpu_check.sh

clean:
	rm -rf $(VENV) build *.egg-info
