"""A pytest plugin that records each test as it finishes, for a suite run under a time limit (a
device call), whose end-of-session summary a cut run never prints:

- with ``PYTEST_DURATIONS_FILE`` set, every test appends one line ``seconds outcome node_id`` to
  that file when its teardown ends (its setup, call and teardown summed; the outcome passed,
  failed, skipped, or error for a failure in setup or teardown). Unlike ``--durations``, a run cut
  short keeps the times of what it finished;
- with ``PYTEST_FAILURES_FILE`` set, every failing phase appends its report there at once: a
  ``=== node_id (phase)`` line, then pytest's text of the failure (its traceback and captured
  output, cut to :data:`FAILURE_CHARS`).

Under pytest-xdist the records come from the controlling process, which receives every worker's
reports; the workers, which see their own reports first, write none. ``scripts/device_check.sh``
loads it for its ``tests`` stage."""

import os

# Characters of a failure's report kept in the failures file (its end, where the error is).
FAILURE_CHARS = 6000

_so_far = {}  # node id -> (seconds, outcome) of the phases reported so far


def pytest_runtest_logreport(report):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    failures = os.environ.get("PYTEST_FAILURES_FILE")
    if failures and report.failed:
        text = report.longreprtext
        if len(text) > FAILURE_CHARS:
            text = "[...]\n" + text[-FAILURE_CHARS:]
        with open(failures, "a") as out:
            out.write(f"=== {report.nodeid} ({report.when})\n{text}\n")
    path = os.environ.get("PYTEST_DURATIONS_FILE")
    if not path:
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
