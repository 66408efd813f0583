"""``--cuda-cases-only`` (tests/conftest.py), which the GPU machine's runs pass: the cases
parametrized with device "cpu" are deselected and every other case stays."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _collected(*args):
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "tests/test_column_sum.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return {line for line in out.stdout.splitlines() if "::" in line}


def test_cuda_cases_only_leaves_out_exactly_the_cpu_cases():
    every = _collected()
    kept = _collected("--cuda-cases-only")
    cpu = {node for node in every if "[cpu" in node or "-cpu-" in node or "-cpu]" in node}
    assert cpu, "the file has CPU cases to leave out"
    assert kept == every - cpu
