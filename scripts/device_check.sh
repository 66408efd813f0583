#!/usr/bin/env bash
# The GPU check behind every CUDA change, in one go on a CUDA machine: build, test suite,
# compute-sanitizer (memcheck and racecheck) on forward and backward, then the benchmark.
# Logs, JSON and chart go to $OUT (default ./device_out). BENCH_ARGS passes options to the
# benchmark: "--reps-scale 0.3" took 2 minutes on an H200, the full benchmark about three times that.
# With the test suite (about 5 minutes) and the sanitizers (1.5), one call takes about 9.5 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-device_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"

start=$(date +%s)
python3 -c "from edgedot._build import cuda_module; cuda_module()" && echo "build: $(( $(date +%s) - start )) s"

python3 -m pytest -q tests -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log" | tail -n 15

for tool in memcheck racecheck; do
  compute-sanitizer --tool "$tool" --print-limit 20 python3 scripts/sanitizer_workload.py 2>&1 \
    | tee "$OUT/sanitizer_$tool.log" | tail -n 3
done

python3 -m edgedot.bench --json "$OUT/bench.json" --png "$OUT/bench.png" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
