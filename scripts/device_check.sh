#!/usr/bin/env bash
# The GPU check behind every CUDA change, on a CUDA machine: build, test suite, compute-sanitizer
# (memcheck and racecheck) on forward and backward of every op, KernelBench's evaluation of the
# exported seed problem, then the benchmark. Logs, JSON and charts go to $OUT (default
# ./device_out).
#
#   scripts/device_check.sh [STAGE ...]     stages: build tests sanitize kernelbench bench
#                                            (default: all, in that order)
#
# One command on the lent machines may run 10 minutes, so on an H200 run it in two calls back to
# back, which find the build of the first in EDGEDOT_CACHE: `build tests sanitize kernelbench`
# (about 8 minutes: build 45 s, tests on 4 workers, sanitizers 2), then `bench` (about 8 minutes
# with BENCH_ARGS="--reps-scale 0.25"). BENCH_ARGS passes options to the benchmark, PYTEST_ARGS
# to pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-device_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16}
export EDGEDOT_CACHE=${EDGEDOT_CACHE:-/tmp/edgedot_build}
stages=${*:-build tests sanitize kernelbench bench}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"

for stage in $stages; do
  start=$(date +%s)
  case $stage in
    build)
      python3 -c "from edgedot._build import cuda_module; cuda_module()" ;;
    tests)
      # Workers share the GPU; no test depends on another's timing.
      python3 -m pytest -q tests -p no:cacheprovider -n "${PYTEST_WORKERS:-4}" ${PYTEST_ARGS:-} 2>&1 \
        | tee "$OUT/pytest.log" | tail -n 15 ;;
    sanitize)
      for tool in memcheck racecheck; do
        compute-sanitizer --tool "$tool" --print-limit 20 python3 scripts/sanitizer_workload.py 2>&1 \
          | tee "$OUT/sanitizer_$tool.log" | tail -n 3
      done ;;
    kernelbench)
      python3 -m edgedot.kernelbench --export "$OUT/model_new.py" &&
        python3 -m edgedot.kernelbench --evaluate "$OUT/model_new.py" 2>&1 | tee "$OUT/kernelbench_eval.log" ;;
    bench)
      python3 -m edgedot.bench --json "$OUT/bench.json" --png "$OUT/bench.png" ${BENCH_ARGS:-} 2>&1 \
        | tee "$OUT/bench.log" ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
  echo "== $stage: $(( $(date +%s) - start )) s"
done
