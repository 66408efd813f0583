#!/usr/bin/env bash
# The GPU check behind every CUDA change, on a CUDA machine: build, test suite, compute-sanitizer
# (memcheck and racecheck) on forward and backward of every op, KernelBench's evaluation of the
# exported seed problem, then the benchmark. Logs, JSON and charts go to $OUT (default
# ./device_out).
#
#   scripts/device_check.sh [STAGE ...]     stages: build tests sanitize fuzz kernelbench bench wheel
#                                            ab profile pyg grouping (default: all but fuzz, wheel,
#                                            ab, profile, pyg and grouping, in that order)
#
# One command on the lent machines may run 10 minutes, so on an H200 run it in two calls back to
# back, which find the build of the first in EDGEDOT_CACHE: `build tests sanitize kernelbench`
# (about 8 minutes: build 45 s, tests on 4 workers, sanitizers 2), then `bench` (about 8 minutes
# with BENCH_ARGS="--reps-scale 0.25"). BENCH_ARGS passes options to the benchmark, PYTEST_ARGS
# to pytest, PYTEST_TARGETS the test files (default: tests), PYTEST_RESUME_LOGS a folder of earlier
# calls' pytest.log files whose finished tests are left out (the whole suite over several calls),
# PYTEST_CPU_CASES=1 keeps the CPU's cases and cpu_only tests (left out by default: CI runs them),
# PROFILE_ARGS to scripts/profile_minibatch.py (split at spaces: its --paths substrings hold none),
# FUZZ_COUNT the seeds of each fuzz (`fuzz`; default 300; at 200 the five fuzzes took 38 s on an
# H100).
#
# `wheel` checks the CUDA wheel as a user without a CUDA toolkit gets it, in one call of about 5
# minutes: scripts/build_wheel.sh builds it (about 2 minutes for sm_80 and sm_90 on 16 cores), a
# fresh venv that takes torch from the system installs it with --no-deps, and from a temporary
# folder (no checkout on sys.path), with nvcc hidden from PATH, CUDA_HOME and CUDA_PATH unset and an
# empty EDGEDOT_CACHE that must stay empty (no JIT build), it runs scripts/first_call.py (the
# prebuilt extension must serve the first call, within 2 s), `python -m edgedot`, and pytest on
# WHEEL_TESTS (default: the CUDA test files below).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-device_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16}
export EDGEDOT_CACHE=${EDGEDOT_CACHE:-/tmp/edgedot_build}
stages=${*:-build tests sanitize kernelbench bench}
WHEEL_TESTS=${WHEEL_TESTS:-tests/test_cuda.py tests/test_attention_cuda.py tests/test_group_edges.py}

# A PATH on which no nvcc is found: each folder of $PATH holding one is replaced by a folder of
# links to everything else in it (so a /usr/bin with nvcc keeps its other tools).
path_without_nvcc() {
  local shadows=$1 dir entry kept="" i=0
  local -a dirs
  IFS=: read -ra dirs <<< "$PATH"
  for dir in "${dirs[@]}"; do
    if [ -n "$dir" ] && [ -x "$dir/nvcc" ]; then
      i=$((i + 1))
      mkdir -p "$shadows/$i"
      for entry in "$dir"/*; do
        case $(basename "$entry") in nvcc*) ;; *) ln -s "$entry" "$shadows/$i/" ;; esac
      done
      dir=$shadows/$i
    fi
    kept+=${kept:+:}$dir
  done
  echo "$kept"
}

wheel_check() (
  set -euo pipefail
  work=$(mktemp -d /tmp/edgedot_wheel.XXXXXX)
  trap 'rm -rf "$work"' EXIT
  echo "-- build: scripts/build_wheel.sh (log $OUT/wheel_build.log)"
  if ! scripts/build_wheel.sh "$work/dist" > "$OUT/wheel_build.log" 2>&1; then
    tail -n 40 "$OUT/wheel_build.log"; exit 1
  fi
  grep -E '^(edgedot: building|TORCH_VERSION|CUDA_VERSION|ARCH_LIST|== )' "$OUT/wheel_build.log"
  wheel=$(ls "$work"/dist/edgedot-*.whl)
  echo "-- venv $work/venv (torch from the system), installing $(basename "$wheel") with --no-deps"
  python3 -m venv --system-site-packages --without-pip "$work/venv"
  py=$work/venv/bin/python
  # torch may itself live in a virtual environment (not the system's site-packages): a .pth file
  # puts the folder that holds it (and pytest) on the new venv's path, after the venv's own.
  python3 -c "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))" \
    > "$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/torch_site.pth"
  "$py" -m pip install -q --no-deps --no-index --force-reinstall "$wheel"
  mkdir -p "$work/run" "$work/jit_cache"
  cp -r tests "$work/run/tests"
  cp scripts/first_call.py "$work/run/"
  PATH=$(path_without_nvcc "$work/path")
  export PATH EDGEDOT_CACHE=$work/jit_cache
  unset CUDA_HOME CUDA_PATH PYTHONPATH
  cd "$work/run"
  if command -v nvcc; then echo "nvcc is still on PATH" >&2; exit 1; fi
  "$py" -c "import sys, torch, edgedot; from torch.utils import cpp_extension
assert edgedot.__file__.startswith(sys.prefix), f'edgedot from {edgedot.__file__}, not the venv'
print('edgedot', edgedot.__file__, '| torch', torch.__version__, '| no nvcc on PATH; torch CUDA_HOME:', cpp_extension.CUDA_HOME)"
  echo "-- first call, fresh process"
  "$py" first_call.py --expect-prebuilt --max-first-call 2 2>&1 | tee "$OUT/wheel_first_call.log"
  echo "-- python -m edgedot"
  "$py" -m edgedot 2>&1 | tee "$OUT/wheel_main.log"
  workers=""
  if "$py" -c "import xdist" 2>/dev/null; then workers="-n ${PYTEST_WORKERS:-4}"; fi
  echo "-- pytest $workers $WHEEL_TESTS"
  # shellcheck disable=SC2086
  "$py" -m pytest -q -p no:cacheprovider $workers $WHEEL_TESTS ${PYTEST_ARGS:-} 2>&1 \
    | tee "$OUT/wheel_pytest.log" | tail -n 15
  "$py" -c "import os, sys; left = os.listdir(sys.argv[1])
sys.exit(f'the JIT cache is not empty, something built the kernels: {left}' if left else 0)" "$EDGEDOT_CACHE"
  echo "-- the wheel served everything: no JIT build"
)

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"

for stage in $stages; do
  start=$(date +%s)
  case $stage in
    build)
      # Then the C++ runtime the module links (docs/install.md, "One C++ runtime"): the compiler's
      # answer, the module's NEEDED entries, and whether it defines std::locale (a private copy).
      python3 -c "
from torch.utils import cpp_extension
from edgedot.runtime import build, sources
module = build.cuda_module()
compiler = cpp_extension.get_cxx_compiler()
print('compiler', compiler, 'links the shared runtime:', sources.links_shared_runtime(compiler),
      'flags:', sources.link_flags(compiler))
print('module', module.__file__, 'NEEDED', sources.elf_needed(module.__file__))"
      so=$(find "$EDGEDOT_CACHE" -name '*.so' | head -n 1)
      [ -n "$so" ] && echo "std::locale symbols defined: $(nm -C --defined-only "$so" | grep -c 'std::locale')" ;;
    tests)
      # Workers share the GPU; no test depends on another's timing. Each result is logged as it
      # comes (-v), so a run cut short by the call's time limit still names its failures. With
      # PYTEST_RESUME_LOGS (a carried folder of earlier calls' pytest.log files), the tests they
      # show finished are left out (scripts/pytest_resume.py): the suite spreads over calls.
      # The cases parametrized for the CPU and the tests marked cpu_only (tests/conftest.py) are left
      # out (CI runs them) unless PYTEST_CPU_CASES=1; the 30 slowest tests are listed at the end.
      # Each test's time also goes to durations.txt as it finishes, and each failure's report to
      # failures.txt (scripts/pytest_durations.py), so a run the call's limit cuts keeps them.
      # Each worker's torch takes its share of the cores (OMP_NUM_THREADS): left at every core
      # apiece, workers' CPU work oversubscribes the machine several times over.
      cpu_cases=--cuda-cases-only; [ "${PYTEST_CPU_CASES:-0}" = 1 ] && cpu_cases=
      workers=${PYTEST_WORKERS:-4}
      case $workers in
        0) threads=$(nproc) ;;  # one process
        ''|*[!0-9]*) threads=1 ;;  # -n auto: a worker a core
        *) threads=$(( $(nproc) / workers )); [ "$threads" -ge 1 ] || threads=1 ;;
      esac
      # shellcheck disable=SC2086
      OMP_NUM_THREADS=${OMP_NUM_THREADS:-$threads} PYTEST_DURATIONS_FILE=$OUT/durations.txt \
        PYTEST_FAILURES_FILE=$OUT/failures.txt PYTHONPATH=$PYTHONPATH:$PWD/scripts python3 -m pytest -v \
        ${PYTEST_TARGETS:-tests} -p no:cacheprovider -p pytest_resume -p pytest_durations -n "$workers" \
        --durations=30 $cpu_cases ${PYTEST_ARGS:-} > "$OUT/pytest.log" 2>&1
      grep -E "^(FAILED|ERROR) " "$OUT/pytest.log" | head -n 40
      tail -n 1 "$OUT/pytest.log" ;;
    pyg)
      # PyG's own test files with edgedot's layers swapped in (carry tests/pyg/upstream/test, laid out
      # by scripts/pyg_tests.sh), on their own: beside a full test stage they outlast a call. Without
      # the files the suite would skip, which is no result: refused.
      if [ ! -f "${EDGEDOT_PYG_TESTS:-tests/pyg/upstream}/test/nn/conv/test_transformer_conv.py" ]; then
        echo "pyg: PyG's test files are missing (carry tests/pyg/upstream/test; tests/pyg/README.md)"; exit 1
      fi
      python3 -m pytest -v tests/test_pyg_suite.py -p no:cacheprovider ${PYTEST_ARGS:-} > "$OUT/pyg_suite.log" 2>&1
      grep -E "^(FAILED|ERROR) " "$OUT/pyg_suite.log" | head -n 20
      tail -n 1 "$OUT/pyg_suite.log" ;;
    grouping)
      # The one-launch grouping alone: timed and checked on a mini-batch (scripts/grouping_time.cu),
      # then a workload of groupings under memcheck, racecheck and synccheck.
      nvcc -std=c++17 -O3 -arch=sm_90 -Iedgedot/csrc -o /tmp/grouping_time scripts/grouping_time.cu &&
        /tmp/grouping_time 2>&1 | tee "$OUT/grouping_time.log"
      for tool in memcheck racecheck synccheck; do
        compute-sanitizer --tool "$tool" --print-limit 20 python3 scripts/grouping_sanitize.py 2>&1 \
          | tee "$OUT/sanitizer_grouping_$tool.log" | tail -n 2
      done ;;
    fuzz)
      # The differential fuzzes on this GPU (scripts/op_fuzz.py in each dtype, scripts/layer_fuzz.py
      # against PyG's layers), FUZZ_COUNT seeds each. Run as a stage so that they find the build
      # in EDGEDOT_CACHE: outside it a fuzz first compiles the extension for a minute, silently.
      for dtype in float64 float32 bfloat16 float16; do
        python3 scripts/op_fuzz.py --device cuda --count "${FUZZ_COUNT:-300}" --dtype "$dtype" \
          > "$OUT/op_fuzz_$dtype.log" 2>&1
        echo "op_fuzz $dtype: $(tail -n 1 "$OUT/op_fuzz_$dtype.log")"
      done
      python3 scripts/layer_fuzz.py --device cuda --count "${FUZZ_COUNT:-300}" > "$OUT/layer_fuzz.log" 2>&1
      echo "layer_fuzz: $(tail -n 1 "$OUT/layer_fuzz.log")" ;;
    profile)
      # A training step on fresh mini-batches: kernels, device time and host waits per call.
      python3 scripts/profile_minibatch.py --kernels --json "$OUT/profile.json" ${PROFILE_ARGS:-} 2>&1 \
        | grep -v -i warn | tee "$OUT/profile.log" ;;
    sanitize)
      for tool in memcheck racecheck; do
        compute-sanitizer --tool "$tool" --print-limit 20 python3 scripts/sanitizer_workload.py 2>&1 \
          | tee "$OUT/sanitizer_$tool.log" | tail -n 3
      done
      # Hostile pointers and indices, unchecked, and buffers rewritten between CUDA-graph replays.
      compute-sanitizer --tool memcheck --print-limit 20 python3 scripts/fuzz_pointers.py --rounds "${FUZZ_ROUNDS:-24}" \
        2>&1 | tee "$OUT/sanitizer_fuzz.log" | tail -n 3 ;;
    ab)
      # The same cases timed on AB_BASE (another checkout, e.g. the previous release) and on this
      # tree, in one run: scripts/ab_bench.py.
      python3 scripts/ab_bench.py --a "${AB_BASE:?AB_BASE: the checkout to compare with}" --b . \
        --json "$OUT/ab.json" ${AB_ARGS:-} 2>&1 | tee "$OUT/ab.log" ;;
    kernelbench)
      python3 -m edgedot.kernelbench --export "$OUT/model_new.py" &&
        python3 -m edgedot.kernelbench --evaluate "$OUT/model_new.py" 2>&1 | tee "$OUT/kernelbench_eval.log" ;;
    bench)
      # Peers the device cannot download, as wheels in PEER_WHEELS (default .peers, carried):
      # `pip download anemoi-models==0.19.0 --no-deps -d .peers` here, for instance.
      if compgen -G "${PEER_WHEELS:-.peers}/*.whl" > /dev/null; then
        python3 -m pip install -q --no-deps --no-index "${PEER_WHEELS:-.peers}"/*.whl
      fi
      # Peers shipped as sources (`pip download turbo-gnn --no-deps --no-binary :all: -d .peers`):
      # built in place for this card, then put on the path.
      for sdist in "${PEER_WHEELS:-.peers}"/*.tar.gz; do
        [ -e "$sdist" ] || continue
        src=/tmp/peers/$(basename "$sdist" .tar.gz)
        mkdir -p /tmp/peers && tar xzf "$sdist" -C /tmp/peers
        arch=$(python3 -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
        if (cd "$src" && TURBO_GNN_FORCE_BUILD=TRUE TORCH_CUDA_ARCH_LIST=$arch python3 setup.py build_ext --inplace) \
            > "$OUT/peer_build_$(basename "$src").log" 2>&1; then
          export PYTHONPATH=$PYTHONPATH:$src
          echo "peer built: $(basename "$src")"
        else
          echo "peer build failed: $(basename "$src") (log in $OUT)"; tail -n 5 "$OUT/peer_build_$(basename "$src").log"
        fi
      done
      python3 -m edgedot.bench --json "$OUT/bench.json" --png "$OUT/bench.png" ${BENCH_ARGS:-} 2>&1 \
        | tee "$OUT/bench.log" ;;
    wheel)
      wheel_check || { echo "wheel: FAILED" >&2; failed=1; } ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
  echo "== $stage: $(( $(date +%s) - start )) s"
done
exit "${failed:-0}"
