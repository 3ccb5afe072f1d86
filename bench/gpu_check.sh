#!/usr/bin/env bash
# `make gpu-check` (also runnable without make): on a CUDA machine, with its own python3 and torch.
# The CUDA-marked tests, spread over GPU_WORKERS processes sharing the GPU (each test stopped after
# 120 s, all of them after 240 s), then every GPU benchmark row (bench/gpu_check.py), whose groups
# start within GPU_BUDGET seconds. GPU_OUT receives the test log, a JUnit XML of the tests and the
# table (rewritten after each group, so a run stopped from outside keeps its rows). torchao (the
# FP8 rows) is installed from a wheel in .whl/ when one is there; nothing comes from an index.
# pytest-benchmark, where installed, is turned off: under xdist it warns at start-up, which the
# suite's filterwarnings=error turns into an internal error (seen on an H100 image).
set -u
cd "$(dirname "$0")/.."
GPU_PY=${GPU_PY:-python3}
GPU_SITE=${GPU_SITE:-/tmp/mixprec-gpu-site}
GPU_OUT=${GPU_OUT:-.gpu-check}
GPU_WORKERS=${GPU_WORKERS:-6}
GPU_BUDGET=${GPU_BUDGET:-300}
PYTHONPATH=$PWD "$GPU_PY" bench/gpu_check.py --check-cuda || exit $?
mkdir -p "$GPU_OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  "$GPU_PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$GPU_SITE" \
    .whl/*.whl || exit $?
else
  echo "no wheels in .whl/: the FP8 rows run only if torchao is installed here"
fi
export PYTHONPATH=$GPU_SITE:$PWD PYTHONUNBUFFERED=1
status=0
timeout 240 "$GPU_PY" -m pytest -m cuda -q -rfE -p no:cacheprovider -p no:benchmark -n "$GPU_WORKERS" --dist load \
  --timeout 120 --junitxml="$GPU_OUT/cuda-tests.xml" tests > "$GPU_OUT/cuda-tests.log" 2>&1 \
  || status=$?
tail -n 60 "$GPU_OUT/cuda-tests.log"
timeout $((GPU_BUDGET + 150)) "$GPU_PY" bench/gpu_check.py --budget "$GPU_BUDGET" \
  --out "$GPU_OUT/gpu-table.md" || status=$?
exit $status
