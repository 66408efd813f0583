"""The command lines a new user runs first: ``python -m edgedot`` and the README's usage example."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

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
