"""``--cuda-cases-only`` (tests/conftest.py), which the GPU machine's runs pass: the cases
parametrized with device "cpu" and the tests marked ``cpu_only`` are deselected and every other
case stays; and no test marked ``cpu_only`` mentions CUDA."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _collected(*args, files=("tests/test_column_sum.py",)):
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          *files, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return {line for line in out.stdout.splitlines() if "::" in line}


def test_cuda_cases_only_leaves_out_exactly_the_cpu_cases():
    every = _collected()
    kept = _collected("--cuda-cases-only")
    cpu = {node for node in every if "[cpu" in node or "-cpu-" in node or "-cpu]" in node}
    assert cpu, "the file has CPU cases to leave out"
    assert kept == every - cpu


def test_cpu_only_tests_are_left_out():
    files = ("tests/test_checked_graph.py", "tests/test_gat.py")
    every = _collected(files=files)
    kept = _collected("--cuda-cases-only", files=files)
    assert not any("test_checked_graph.py" in node for node in kept)  # its module is marked
    left_out = every - kept
    assert any("test_cpu_one_chunk_keeps_rows_and_agrees_with_chunks" in node for node in left_out)
    assert any("cuda" in node for node in kept)


def _marked_cpu_only(decorators):
    return any(ast.unparse(d).startswith("pytest.mark.cpu_only") for d in decorators)


def test_tests_marked_cpu_only_do_not_mention_cuda():
    """A test that may touch CUDA must not be left out of the GPU machine's runs."""
    marked = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        source = path.read_text()
        tree = ast.parse(source)
        module_marked = any(isinstance(node, ast.Assign)
                            and ast.unparse(node).startswith("pytestmark = pytest.mark.cpu_only") for node in tree.body)
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_") and (
                    module_marked or _marked_cpu_only(node.decorator_list)):
                marked.append(f"{path.name}::{node.name}")
                assert "cuda" not in ast.get_source_segment(source, node).lower(), marked[-1]
        if module_marked:
            assert "cuda" not in source.lower().replace("cuda-cases-only", ""), path.name
    assert len(marked) > 5, marked
