#!/usr/bin/env bash
# Everything the GPU issue asks of a GPU machine, in one run: build, the GPU
# test suites, the GPU benchmarks, and (cpu) the CPU benchmarks of the
# latency issue with a core to spare per rank: training against the
# independent processes at 2 and 3 ranks, and the allreduce at 2.
# Logs go to $OUT (the device tool's folder) or ./gpu-logs; a summary is
# printed last. Wheels in .whl/ (cffi, pycparser) are installed first on a
# machine with no package registry.
#   bash benchmarks/gpu_machine.sh [tests] [bench] [cpu]    (all three when none is named)
# GPU_MACHINE_SECONDS=N ends every step by N seconds after the start, so that
# a device lease's one call returns with its logs rather than being cut off;
# a step with no time left is noted as skipped.
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
parts=" ${*:-tests bench cpu} "
wants() { [[ $parts == *" $1 "* ]]; }
deadline=$(( SECONDS + ${GPU_MACHINE_SECONDS:-100000} ))
step() {  # step NAME TIMEOUT LOG COMMAND...: runs it, appends its output to a log, notes the outcome
  local name=$1 limit=$2 log=$3; shift 3
  local left=$(( deadline - SECONDS ))
  if [ "$left" -lt 15 ]; then echo "$name: skipped, out of time" | tee -a "$OUT/summary.txt"; return; fi
  [ "$left" -lt "$limit" ] && limit=$left
  echo "=== $name" >> "$OUT/$log"
  timeout "$limit" "$@" >> "$OUT/$log" 2>&1
  local rc=$?
  echo "$name: rc=$rc $(grep -E '[0-9]+ (passed|failed|skipped)' "$OUT/$log" | tail -1 | sed 's/^\[[0-9]*\]<stdout>://')" | tee -a "$OUT/summary.txt"
}
pytest=(python3 -m pytest -q -rs -p no:cacheprovider --timeout=60 --maxfail=40)
if wants tests; then
  # tests/test_parallel.py's GPU runs: test_torch_cuda.py and the grid on
  # CUDA tensors at 1 rank (NCCL), 2 and 3 ranks sharing the GPU (staging),
  # and 2 and 3 ranks given a host each (NCCL hierarchical, and flat), four
  # jobs at a time where pytest-xdist is there (16 cores, and a GPU with room
  # for all). The 1-rank staged runs go beside them, in a log of their own.
  xdist=(); python3 -c "import xdist" 2>/dev/null && xdist=(-n 4)
  ( step "test_torch_cuda np1 staged" 150 staged.log env UNISON_GPU_DATA_PLANE=staging python3 -m unison.run -np 1 "${pytest[@]}" tests/parallel/test_torch_cuda.py
    step "grid on cuda np1 staged" 150 staged.log env UNISON_TEST_DEVICE=cuda UNISON_GPU_DATA_PLANE=staging python3 -m unison.run -np 1 "${pytest[@]}" tests/parallel/test_torch_grid.py ) &
  step "GPU suites (test_parallel.py -k cuda)" 450 tests.log python3 -m pytest -v -rs -p no:cacheprovider "${xdist[@]}" tests/test_parallel.py -k cuda
  wait
  grep -E "(PASSED|FAILED|SKIPPED)" "$OUT/tests.log" | sed -E 's/^\[gw[0-9]+\] \[ *[0-9]+%\] //; s/tests\/test_parallel.py:://' | tee -a "$OUT/summary.txt"
fi
if wants bench; then
  for n in 1 2; do step "gpu_allreduce np$n" 120 bench.log python3 -m unison.run -np $n python3 benchmarks/gpu_allreduce.py --blocks 3; done
  step "gpu_allreduce np2, a host per rank" 120 bench.log python3 -m unison.run -np 2 -H localhost:1,127.0.0.1:1 python3 benchmarks/gpu_allreduce.py --blocks 3
  for n in 1 2; do step "gpu_train np$n" 120 bench.log python3 -m unison.run -np $n python3 benchmarks/gpu_train.py; done
  grep -E "^\[0\]<stdout>:(\||ResNet|allreduce|  of which|$)" "$OUT/bench.log" | sed 's/^\[0\]<stdout>://' | tee -a "$OUT/summary.txt"
fi
if wants cpu; then
  # On the 2-core VM the ranks fill every core, so async ops wait for a
  # caller (UNISON_OVERLAP=auto means off there); here each rank's engine
  # has a core of its own and gradients go out during backward.
  for n in 2 3; do step "torch_train np$n (CPU)" 120 cpu.log python3 -m unison.run -np $n python3 benchmarks/torch_train.py --depth 10; done
  step "allreduce np2 (CPU)" 200 cpu.log python3 -m unison.run -np 2 python3 benchmarks/allreduce.py --blocks 3
  # The shared-memory round size, chosen on the 2-core VM: is it right for this CPU's caches too?
  for n in 2 8; do step "round_size np$n (CPU)" 150 cpu.log python3 -m unison.run -np $n python3 benchmarks/round_size.py --slots 8M,4M,2M,1M --sizes 1M,4M,38M --blocks 3; done
  grep -E "^\[0\]<stdout>:(\||MLP|200 x|target|allreduce of|  )" "$OUT/cpu.log" | sed 's/^\[0\]<stdout>://' | tee -a "$OUT/summary.txt"
fi
