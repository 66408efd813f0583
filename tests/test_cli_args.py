"""Command lines given bad arguments: ``python -m edgedot.bench`` and ``python -m
edgedot.kernelbench`` answer with a usage error naming the option (exit status 2, no
traceback), before any work starts."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from edgedot.bench.__main__ import parse_args, select_cases

REPO = Path(__file__).resolve().parent.parent


def _run(args, env=None, timeout=120):
    env = dict(os.environ, **(env or {}))
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _usage_error(capsys, argv, **kwargs):
    with pytest.raises(SystemExit) as info:
        parse_args(argv, **kwargs)
    assert info.value.code == 2
    return capsys.readouterr().err


# ---------------------------------------------------------------- python -m edgedot.bench

@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "-0.5", "many"])
def test_bench_refuses_reps_scale_that_is_not_positive_and_finite(capsys, value):
    err = _usage_error(capsys, ["--quick", "--reps-scale", value])
    assert "argument --reps-scale" in err and value in err, err


@pytest.mark.parametrize("value", ["0.1", "2", "1e-3"])
def test_bench_takes_positive_reps_scale(value):
    assert parse_args(["--quick", "--reps-scale", value]).reps_scale == float(value)


@pytest.mark.parametrize("argv", [["--cases="], ["--cases", ""], ["--cases", ","], ["--cases", "default,,attn_arxiv_bf16"],
                                  ["--cases", " "]])
def test_bench_refuses_empty_case_names(capsys, argv):
    err = _usage_error(capsys, ["--quick", *argv])
    assert "argument --cases" in err, err


def test_bench_refuses_unknown_case_names(capsys):
    err = _usage_error(capsys, ["--quick", "--cases", "default,no_such_case"])
    assert "argument --cases" in err and "no_such_case" in err and "default" not in err.split("known:")[0], err


def test_bench_takes_case_names():
    args = parse_args(["--quick", "--cases", " default , attn_arxiv_bf16"])
    assert [case.name for case in select_cases(args.cases, quick=True)] == ["default", "attn_arxiv_bf16"]
    assert parse_args(["--quick"]).cases is None  # every case


def test_bench_without_cuda_refuses_the_full_sizes(capsys):
    """The full-size suite takes hours on a CPU: without CUDA, only --quick or --full-on-cpu."""
    err = _usage_error(capsys, [], cuda_available=False)
    assert "no CUDA device" in err and "--quick" in err and "--full-on-cpu" in err, err
    assert parse_args(["--quick"], cuda_available=False).quick
    assert parse_args(["--full-on-cpu"], cuda_available=False).full_on_cpu
    assert not parse_args([], cuda_available=True).quick


def test_bench_without_cuda_says_so_up_front():
    """As a user without a GPU runs it: an immediate usage error, not a silent start."""
    proc = _run(["-m", "edgedot.bench", "--cases", "default"], env={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "no CUDA device" in proc.stderr and "--quick" in proc.stderr and "Traceback" not in proc.stderr
    assert "loading the edgedot kernels" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("argv", [["--reps-scale", "0"], ["--cases="]])
def test_bench_cli_refuses_bad_arguments(argv):
    proc = _run(["-m", "edgedot.bench", "--quick", *argv])
    assert proc.returncode == 2, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert f"argument {argv[0].split('=')[0]}" in proc.stderr and "Traceback" not in proc.stderr


# ---------------------------------------------------------------- python -m edgedot.kernelbench

def test_kernelbench_export_to_a_directory_is_a_usage_error(tmp_path):
    proc = _run(["-m", "edgedot.kernelbench", "--export", str(tmp_path)])
    assert proc.returncode == 2, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "argument --export" in proc.stderr and "is a directory" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_kernelbench_export_below_a_file_is_a_usage_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = _run(["-m", "edgedot.kernelbench", "--export", str(blocker / "model_new.py")])
    assert proc.returncode == 2, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "argument --export" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr

