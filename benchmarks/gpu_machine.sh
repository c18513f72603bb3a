#!/usr/bin/env bash
# Everything the GPU issue asks of a GPU machine, in one run: build, the GPU
# test suites, the GPU benchmarks, and the CPU allreduce at 2 to 16 ranks.
# Logs go to $OUT (the device tool's folder) or ./gpu-logs; a summary is
# printed last. Wheels in .whl/ (cffi, pycparser) are installed first on a
# machine with no package registry.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
python3 -m unison.run --check-build | tee "$OUT/summary.txt"
what=${1:-all}
step() {  # step NAME TIMEOUT COMMAND...: runs it, appends its output to a log, notes the outcome
  local name=$1 limit=$2 log=$3; shift 3
  echo "=== $name" >> "$OUT/$log"
  timeout "$limit" "$@" >> "$OUT/$log" 2>&1
  local rc=$?
  echo "$name: rc=$rc $(grep -E '[0-9]+ (passed|failed|skipped)' "$OUT/$log" | tail -1 | sed 's/^\[[0-9]*\]<stdout>://')" | tee -a "$OUT/summary.txt"
}
pytest=(python3 -m pytest -q -rs -p no:cacheprovider --timeout=60 --maxfail=40)
if [ "$what" = all ] || [ "$what" = tests ]; then
  for n in 1 2 3; do step "test_torch_cuda np$n" 150 tests.log python3 -m unison.run -np $n "${pytest[@]}" tests/parallel/test_torch_cuda.py; done
  step "test_torch_cuda np1 staged" 150 tests.log env UNISON_GPU_DATA_PLANE=staging python3 -m unison.run -np 1 "${pytest[@]}" tests/parallel/test_torch_cuda.py
  step "grid on cuda np1 staged" 150 tests.log env UNISON_TEST_DEVICE=cuda UNISON_GPU_DATA_PLANE=staging python3 -m unison.run -np 1 "${pytest[@]}" tests/parallel/test_torch_grid.py
  for n in 1 2 3; do step "grid on cuda np$n" 150 tests.log env UNISON_TEST_DEVICE=cuda python3 -m unison.run -np $n "${pytest[@]}" tests/parallel/test_torch_grid.py; done
fi
if [ "$what" = all ] || [ "$what" = bench ]; then
  for n in 1 2; do step "gpu_allreduce np$n" 200 bench.log python3 -m unison.run -np $n python3 benchmarks/gpu_allreduce.py --blocks 3; done
  for n in 1 2; do step "gpu_train np$n" 200 bench.log python3 -m unison.run -np $n python3 benchmarks/gpu_train.py; done
  grep -E "^\[0\]<stdout>:(\||ResNet|allreduce)" "$OUT/bench.log" | sed 's/^\[0\]<stdout>://' | tee -a "$OUT/summary.txt"
fi
