"""What a new user runs first: the README's usage example (as written, on CPU and on CUDA), its
set-up commands, and ``python -m edgedot``."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from utils import requires_cuda

REPO = Path(__file__).resolve().parent.parent


def _run(args, env=None, timeout=600):
    env = dict(os.environ, **(env or {}))
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("reps", ["0", "-3", "two"])
def test_main_refuses_reps_below_one(reps):
    """``--reps 0`` once crashed with ``no median for empty data``: now an argparse error."""
    proc = _run(["-m", "edgedot", "--reps", reps])
    assert proc.returncode == 2, proc.stderr
    assert "argument --reps" in proc.stderr and "Traceback" not in proc.stderr


def test_main_runs_with_few_reps():
    proc = _run(["-m", "edgedot", "--reps", "1"])
    assert proc.returncode == 0, proc.stderr
    assert "edgedot speed-up" in proc.stdout


README = (REPO / "README.md").read_text()


def _usage_block():
    """The README's first python block under "## Usage"."""
    match = re.search(r"^## Usage\n.*?^```python\n(.*?)^```", README, re.S | re.M)
    assert match, "README.md has no python block under '## Usage'"
    return match.group(1)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_readme_usage_runs_as_written(device, tmp_path):
    """The usage block, copied as it is into a file and run in a fresh process; on "cpu" with no
    CUDA device visible, as on a machine without a GPU."""
    script = tmp_path / "usage.py"
    script.write_text(_usage_block())
    proc = _run([str(script)], env={"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else None)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    _check_usage_output(proc.stdout, device)


def _check_usage_output(stdout, device):
    """What the usage block prints, so a new user sees it worked: the device, each result's
    shape, and edge_dot's largest difference from the unfused math."""
    lines = stdout.splitlines()
    assert lines and lines[0] == f"device: {device}", stdout
    for shape in ("scores: (16384,)", "multi-head logits: (16384, 4)", "graph attention: (768, 4, 48)",
                  "TransformerConv: (768, 128)"):
        assert any(line.startswith(shape) for line in lines), (shape, stdout)
    (difference,) = [line for line in lines if line.startswith("scores: ")]
    assert float(difference.rsplit(" ", 1)[1]) < 1e-4, difference


def test_readme_stays_short_and_keeps_its_setup_commands():
    assert len(README.encode()) < 10_000, "README.md past 10 KB: move detail to docs/"
    for command in ('pip install -e . && python -m edgedot', 'pip install -e ".[test]" && python -m pytest -q tests',
                    "pip install torch --index-url https://download.pytorch.org/whl/cpu"):
        assert command in README, command
    for link in re.findall(r"\]\((docs/[^)#]+)", README):
        assert (REPO / link).is_file(), link
