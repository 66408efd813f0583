"""The scripts under examples/ run as a user runs them, in a fresh process."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# The environment of a run on the CPU alone: no GPU visible to the process.
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}


def _run_example(name, env=None, timeout=300, args=()):
    env = dict(os.environ, **(env or {}))
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, str(REPO / "examples" / name), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.cpu_only
def test_swap_into_pyg_on_cpu():
    """PyG's GATConv, GATv2Conv and TransformerConv of a model swapped for edgedot's, weights
    kept: the outputs agree in float64 (the script asserts it and says so)."""
    pytest.importorskip("torch_geometric")
    proc = _run_example("swap_into_pyg.py", env=NO_GPU)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.stdout.rstrip().endswith("outputs agree"), proc.stdout
    assert "max difference after the swap" in proc.stdout
    for layer in ("GATConv(", "GATv2Conv(", "TransformerConv("):
        assert layer in proc.stdout, layer


def test_readme_points_to_the_example():
    readme = (REPO / "README.md").read_text()
    assert "examples/swap_into_pyg.py" in readme


@pytest.mark.cpu_only
def test_readme_swap_block_runs(tmp_path):
    """The README's block under "## Into an existing PyG model", as written: prints True."""
    pytest.importorskip("torch_geometric")
    readme = (REPO / "README.md").read_text()
    match = re.search(r"^## Into an existing PyG model\n.*?^```python\n(.*?)^```", readme, re.S | re.M)
    assert match, "README.md has no python block under '## Into an existing PyG model'"
    script = tmp_path / "swap.py"
    script.write_text(match.group(1))
    env = dict(os.environ, **NO_GPU)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.stdout.strip() == "True", proc.stdout


@pytest.mark.cpu_only
@pytest.mark.parametrize("model", ["gatv2", "transformer"])
def test_train_minibatch_on_cpu(model, tmp_path):
    """Sampled mini-batches of the synthetic graph: edgedot's and PyG's models train from the same
    weights on the same batches, and their loss curves agree (the script checks it); a --cora
    folder without the raw files is skipped with a word."""
    pytest.importorskip("torch_geometric")
    proc = _run_example("train_minibatch.py", env=NO_GPU,
                        args=["--model", model, "--steps", "4", "--nodes", "3000", "--batch-size", "128",
                              "--cora", str(tmp_path)])
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    out = proc.stdout
    assert out.rstrip().endswith("loss curves match"), out
    assert "Cora skipped" in out and f"{model} model, 4 steps of 128 seeds" in out
    assert re.search(r"edgedot +[0-9.]+ ms a step", out) and re.search(r"PyG +[0-9.]+ ms a step", out)
    gap = float(re.search(r"largest difference between the loss curves: (\S+)", out).group(1))
    assert gap < 1e-3


@pytest.mark.cpu_only
def test_train_minibatch_refuses_bad_arguments():
    proc = _run_example("train_minibatch.py", env=NO_GPU, args=["--steps", "0"])
    assert proc.returncode != 0 and "--steps" in proc.stderr
