"""A pytest plugin for a test suite spread over several device calls, each under a time limit:
deselects the tests that earlier calls' ``-v`` logs show passed, skipped or expected to fail.

The lent machine copies the working tree afresh for every call, so the logs of earlier calls are
carried into the next (``scripts/device_check.sh`` loads this plugin when ``PYTEST_RESUME_LOGS``
names a folder of them; each call writes its own ``pytest.log`` to ``$OUT``). Tests that failed,
errored or never finished run again, those that failed or erred first (their reports come back
even from a call its limit cuts short)."""

import os
import pathlib
import re

# A result line of `pytest -v`, with pytest-xdist ("[gw3] [ 12%] PASSED tests/x.py::t") or without
# ("tests/x.py::t PASSED [ 12%]"). A parametrized id may hold spaces ("t[a b]"): with xdist the id
# runs to the line's end; without, up to the last result word.
_RESULT = r"\b(?:{0}) (\S+::.+?)\s*$|^(\S+::.+) (?:{0})\b"
_DONE = re.compile(_RESULT.format("PASSED|SKIPPED|XFAIL|XPASS"))
_FAILED = re.compile(_RESULT.format("FAILED|ERROR"))


def _logged(folder, pattern):
    ids = set()
    for path in sorted(pathlib.Path(folder).glob("*.log")):
        for line in path.read_text(errors="replace").splitlines():
            match = pattern.search(line)
            if match:
                ids.add(match.group(1) or match.group(2))
    return ids


def finished_tests(folder):
    """The node ids the ``*.log`` files in ``folder`` show finished without a failure."""
    return _logged(folder, _DONE)


def failed_tests(folder):
    """The node ids the ``*.log`` files in ``folder`` show failed or erred (in some call)."""
    return _logged(folder, _FAILED)


def pytest_collection_modifyitems(config, items):
    folder = os.environ.get("PYTEST_RESUME_LOGS")
    if not folder:
        return
    done = finished_tests(folder)
    finished = [item for item in items if item.nodeid in done]
    if finished:
        config.hook.pytest_deselected(items=finished)
        items[:] = [item for item in items if item.nodeid not in done]
    failed = failed_tests(folder)
    items.sort(key=lambda item: item.nodeid not in failed)  # stable: the suite's order otherwise
