#!/usr/bin/env bash
# The CUDA backend's GPU check, as a user installs it: build the native wheels, install
# deepinfer[cuda] from dist/ only into the interpreter that has torch, then run the CUDA
# tests, the conformance suite (cuda), the distributed test and the benchmarks.
#   tests/cuda/run_on_gpu.sh [LOG_DIR]     (pure-Python wheels may be pre-built in .devcarry/)
set -uo pipefail
log=${1:-build/gpu-logs}
mkdir -p "$log" dist
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-16} PYTHONUNBUFFERED=1
python3 -m pip wheel -q --no-build-isolation --no-deps -w dist "${ENGINE_SRC:-packages/deepinfer-engine}" packages/deepinfer-cuda \
  >"$log/build.log" 2>&1 || { tail -40 "$log/build.log"; exit 1; }
[ -d .devcarry ] && cp .devcarry/*.whl dist/
# Into the interpreter that holds torch (a throw-away machine's; use a venv elsewhere).
py=${PYTHON:-python3}
$py -m pip install -q --no-index --find-links dist "deepinfer[cuda]" >"$log/install.log" 2>&1 \
  || { tail -40 "$log/install.log"; exit 1; }
$py -m pip list 2>/dev/null | grep -i -E "deepinfer|^torch " | tee "$log/versions.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$log/versions.txt"
$py -m deepinfer env 2>&1 | tee "$log/env.txt" | head -40
rc=0
$py -m pytest -p no:cacheprovider -rs -v tests/cuda tests/graph_timer tests/distributed 2>&1 | tee "$log/pytest_cuda.txt" | tail -60 || rc=1
DEEPINFER_CONFORMANCE_BACKENDS=cuda $py -m pytest -p no:cacheprovider -rs -q tests/conformance 2>&1 \
  | tee "$log/pytest_conformance.txt" | tail -25 || rc=1
$py bench/cuda_graph_timer_bench.py 2>&1 | tee "$log/bench_graph_timer.txt"
$py bench/cuda_alloc_bench.py 2>&1 | tee "$log/bench_alloc.txt"
exit $rc
