"""scripts/pytest_resume.py: a suite spread over device calls runs, in a later call, only the tests
that earlier calls' logs do not show finished."""

import os
import pathlib
import re
import subprocess
import sys

SCRIPTS = pathlib.Path(__file__).resolve().parent.parent / "scripts"


def test_later_call_runs_what_earlier_logs_do_not_show_finished(tmp_path):
    (tmp_path / "test_some.py").write_text(
        "import pytest\n\n"
        "@pytest.mark.parametrize('n', [1, 2, 3, 4, 5])\n"
        "def test_n(n):\n"
        "    assert n != 5\n\n"
        "@pytest.mark.parametrize('w', ['a b', 'c d', 'e f'])\n"
        "def test_words(w):\n"
        "    pass\n")
    logs = tmp_path / "logs"
    logs.mkdir()
    # An xdist log (cut short), a plain one, and a failure: what finished without failing is left
    # out, ids with spaces too; the failure runs first.
    (logs / "call1.log").write_text("[gw0] [ 20%] PASSED test_some.py::test_n[1] \n"
                                    "[gw1] [ 40%] FAILED test_some.py::test_n[5] \n"
                                    "[gw1] [ 45%] PASSED test_some.py::test_words[a b] \n"
                                    "test_some.py::test_n[3] \n")
    (logs / "call2.log").write_text("test_some.py::test_n[2] PASSED                [ 50%]\n"
                                    "test_some.py::test_words[c d] PASSED          [ 60%]\n")
    env = dict(_without_xdist(os.environ), PYTEST_RESUME_LOGS=str(logs),
               PYTHONPATH=os.pathsep.join([str(SCRIPTS), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-p", "pytest_resume",
                             "test_some.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    ran = [match.group(1) for match in re.finditer(r"^(test_some\.py::.+?) (?:PASSED|FAILED)", result.stdout, re.M)]
    # What failed before runs first, the rest in the suite's order.
    assert ran == ["test_some.py::test_n[5]", "test_some.py::test_n[3]", "test_some.py::test_n[4]",
                   "test_some.py::test_words[e f]"], result.stdout
    assert "4 deselected" in result.stdout, result.stdout


def _without_xdist(environ):
    """``environ`` without pytest-xdist's variables: a test run by an xdist worker hands them to its
    subprocesses, whose plugins would take themselves for workers."""
    return {key: value for key, value in environ.items() if not key.startswith("PYTEST_XDIST")}


def test_durations_are_written_as_tests_finish(tmp_path):
    """scripts/pytest_durations.py: one line per test, its phases' seconds summed, with its outcome
    (a failure in setup an error, as pytest calls it), under pytest-xdist as without it."""
    (tmp_path / "test_some.py").write_text(
        "import time\n"
        "import pytest\n\n"
        "@pytest.fixture\n"
        "def broken():\n"
        "    raise RuntimeError('setup')\n\n"
        "def test_slow():\n"
        "    time.sleep(0.2)\n\n"
        "def test_fails():\n"
        "    assert False\n\n"
        "def test_setup_fails(broken):\n"
        "    pass\n\n"
        "@pytest.mark.skip\n"
        "def test_skipped():\n"
        "    pass\n")
    workers = [[]]
    try:
        import xdist  # noqa: F401
        workers.append(["-n", "2"])
    except ImportError:
        pass
    for extra in workers:
        durations = tmp_path / f"durations{len(extra)}.txt"
        failures = tmp_path / f"failures{len(extra)}.txt"
        env = dict(_without_xdist(os.environ), PYTEST_DURATIONS_FILE=str(durations), PYTEST_FAILURES_FILE=str(failures),
                   PYTHONPATH=os.pathsep.join([str(SCRIPTS), os.environ.get("PYTHONPATH", "")]))
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "pytest_durations",
                        *extra, "test_some.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        written = durations.read_text().splitlines()
        lines = {line.split(" ", 2)[2]: line.split(" ", 2)[:2] for line in written}
        assert len(written) == len(lines), written
        assert set(lines) == {f"test_some.py::test_{n}" for n in ("slow", "fails", "setup_fails", "skipped")}, lines
        assert lines["test_some.py::test_slow"][1] == "passed" and float(lines["test_some.py::test_slow"][0]) >= 0.2
        assert lines["test_some.py::test_fails"][1] == "failed"
        assert lines["test_some.py::test_setup_fails"][1] == "error"
        assert lines["test_some.py::test_skipped"][1] == "skipped"
        reports = failures.read_text()
        assert reports.count("=== ") == 2, reports
        assert "=== test_some.py::test_fails (call)\n" in reports and "assert False" in reports
        assert "=== test_some.py::test_setup_fails (setup)\n" in reports and "RuntimeError: setup" in reports
