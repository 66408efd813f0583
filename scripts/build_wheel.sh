#!/usr/bin/env bash
# Builds edgedot's wheel into OUT_DIR (default dist/ of the repository) and checks what it holds.
#
#   scripts/build_wheel.sh [OUT_DIR]
#
# By default the CUDA wheel: edgedot._C compiled ahead of time against the torch of this Python
# ($PYTHON, default python3), which must be a CUDA build with a matching nvcc, for
# TORCH_CUDA_ARCH_LIST (default 8.0;9.0+PTX) with MAX_JOBS compiles at once (default: cores,
# bounded by available memory). EDGEDOT_BUILD_CUDA=0 builds the pure-Python wheel instead (the
# kernels then build on first use). The build runs on a clean copy of the package, so neither an
# earlier build/ folder nor an in-place binary can end up in the wheel. docs/install.md.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$repo/dist}
mkdir -p "$out"
out=$(cd "$out" && pwd)
python=${PYTHON:-python3}
export EDGEDOT_BUILD_CUDA=${EDGEDOT_BUILD_CUDA:-1}

"$python" -c "import setuptools.command.bdist_wheel" 2>/dev/null || "$python" -c "import wheel" 2>/dev/null || {
  echo "build_wheel.sh: needs setuptools>=70.1 (or the wheel package) in $("$python" -c 'import sys; print(sys.prefix)')" >&2
  exit 1
}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp "$repo/pyproject.toml" "$repo/setup.py" "$repo/README.md" "$work/"
cp -r "$repo/edgedot" "$work/edgedot"
find "$work/edgedot" \( -name __pycache__ -o -name '_C*.so' -o -name _build_info.py \) -prune -exec rm -rf {} +

echo "== building the $([ "$EDGEDOT_BUILD_CUDA" = 1 ] && echo CUDA || echo pure-Python) wheel of $repo into $out"
start=$(date +%s)
# No build isolation: the CUDA build compiles against the torch installed here.
(cd "$work" && "$python" -m pip wheel -v --no-deps --no-build-isolation --no-index -w "$work/dist" .)
wheel=$(ls "$work"/dist/edgedot-*.whl)

# The wheel holds every source and header (the JIT fallback compiles them) and, if it is the CUDA
# wheel, the binary and its build record.
"$python" - "$wheel" "$work/edgedot" "$EDGEDOT_BUILD_CUDA" <<'EOF'
import importlib.util
import sys
import zipfile

wheel, package, cuda = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
spec = importlib.util.spec_from_file_location("edgedot_sources", f"{package}/runtime/sources.py")
sources = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sources)
names = set(zipfile.ZipFile(wheel).namelist())
missing = [f"edgedot/{name}" for name in sources.extension_files(package) if f"edgedot/{name}" not in names]
binaries = [name for name in names if name.startswith("edgedot/_C") and name.endswith(".so")]
record = "edgedot/_build_info.py" in names
if missing:
    sys.exit(f"build_wheel.sh: the wheel lacks {missing}")
if cuda and (len(binaries) != 1 or not record):
    sys.exit(f"build_wheel.sh: the CUDA wheel holds binaries {binaries} and {'a' if record else 'no'} build record")
if not cuda and (binaries or record):
    sys.exit(f"build_wheel.sh: the pure-Python wheel holds {binaries + ['edgedot/_build_info.py'] * record}")
if record:
    print(zipfile.ZipFile(wheel).read("edgedot/_build_info.py").decode())
EOF
cp "$wheel" "$out/"
echo "== $out/$(basename "$wheel") ($(du -h "$wheel" | cut -f1), $(( $(date +%s) - start )) s)"
