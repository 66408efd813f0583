"""A pytest plugin that writes each test's time as it finishes, for a suite run under a time limit
(a device call): with ``PYTEST_DURATIONS_FILE`` set, every test appends one line ``seconds outcome
node_id`` to that file when its teardown ends (its setup, call and teardown summed; the outcome
passed, failed, skipped, or error for a failure in setup or teardown). Unlike ``--durations``,
whose table comes at the end of the session, a run cut short keeps the times of what it finished.
Under pytest-xdist the lines come from the controlling process, which receives every worker's
reports; the workers, which see their own reports first, write none. ``scripts/device_check.sh``
loads it for its ``tests`` stage."""

import os

_so_far = {}  # node id -> (seconds, outcome) of the phases reported so far


def pytest_runtest_logreport(report):
    path = os.environ.get("PYTEST_DURATIONS_FILE")
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    seconds, outcome = _so_far.get(report.nodeid, (0.0, "passed"))
    seconds += report.duration
    if outcome == "passed" and not report.passed:
        # pytest's words: a failure outside the test's call is an error.
        outcome = "error" if report.failed and report.when != "call" else report.outcome
    if report.when != "teardown":
        _so_far[report.nodeid] = (seconds, outcome)
        return
    _so_far.pop(report.nodeid, None)
    with open(path, "a") as out:
        out.write(f"{seconds:.3f} {outcome} {report.nodeid}\n")
