"""A pytest plugin for a test suite spread over several device calls, each under a time limit:
deselects the tests that earlier calls' ``-v`` logs show passed, skipped or expected to fail.

The lent machine copies the working tree afresh for every call, so the logs of earlier calls are
carried into the next (``scripts/device_check.sh`` loads this plugin when ``PYTEST_RESUME_LOGS``
names a folder of them; each call writes its own ``pytest.log`` to ``$OUT``). Tests that failed,
errored or never finished run again."""

import os
import pathlib
import re

# A result line of `pytest -v`, with pytest-xdist ("[gw3] [ 12%] PASSED tests/x.py::t") or without
# ("tests/x.py::t PASSED [ 12%]"). A parametrized id may hold spaces ("t[a b]"): with xdist the id
# runs to the line's end; without, up to the last result word.
_DONE = re.compile(r"\b(?:PASSED|SKIPPED|XFAIL|XPASS) (\S+::.+?)\s*$|^(\S+::.+) (?:PASSED|SKIPPED|XFAIL|XPASS)\b")


def finished_tests(folder):
    """The node ids the ``*.log`` files in ``folder`` show finished without a failure."""
    done = set()
    for path in sorted(pathlib.Path(folder).glob("*.log")):
        for line in path.read_text(errors="replace").splitlines():
            match = _DONE.search(line)
            if match:
                done.add(match.group(1) or match.group(2))
    return done


def pytest_collection_modifyitems(config, items):
    folder = os.environ.get("PYTEST_RESUME_LOGS")
    if not folder:
        return
    done = finished_tests(folder)
    finished = [item for item in items if item.nodeid in done]
    if finished:
        config.hook.pytest_deselected(items=finished)
        items[:] = [item for item in items if item.nodeid not in done]
