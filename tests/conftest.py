import fcntl
import os
import tempfile

import pytest
import torch


def pytest_addoption(parser):
    parser.addoption("--cuda-cases-only", action="store_true",
                     help="leave out the cases parametrized with device 'cpu' and the tests marked cpu_only (CI "
                          "runs them on a CPU machine; a GPU machine's time goes to the CUDA cases)")


def cpu_case(item):
    """Whether ``item`` runs on the CPU alone: a case of a test parametrized over devices, for the
    CPU, or a test marked ``cpu_only``."""
    if item.get_closest_marker("cpu_only") is not None:
        return True
    params = getattr(getattr(item, "callspec", None), "params", {})
    return any(name in ("device", "dev") and str(value) == "cpu" for name, value in params.items())


def pytest_configure(config):
    config.addinivalue_line("markers", "cpu_only: touches no CUDA device (the CPU paths' own tests); "
                                       "--cuda-cases-only leaves it out")
    config.addinivalue_line("markers", "gpu_memory_heavy: needs several GB of device memory or more; such tests run "
                                       "one at a time among the workers sharing a GPU")


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--cuda-cases-only"):
        return
    cpu = [item for item in items if cpu_case(item)]
    if cpu:
        config.hook.pytest_deselected(items=cpu)
        items[:] = [item for item in items if not cpu_case(item)]


@pytest.fixture
def restore_deterministic():
    """Restores torch's deterministic-algorithms switch (and warn_only) after the test."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


# Device memory a worker's caching allocator may keep between tests: the rest goes back to the
# driver. Several workers share a GPU, and what each one keeps cached the others cannot have (a
# run of 12 workers on an 80 GB card failed its memory-heavy tests).
IDLE_CACHE_BYTES = 2 << 30


@pytest.fixture(autouse=True)
def _cuda_sync_after_test():
    """Surfaces asynchronous CUDA errors in the test that caused them, not in a later one."""
    yield
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        # A check a test left unread (a bad graph passed on purpose) stays with that test.
        from edgedot.runtime.checks import deferred
        deferred.discard()
        if torch.cuda.memory_reserved() > IDLE_CACHE_BYTES:
            torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _one_memory_heavy_test_at_a_time(request):
    """Tests marked ``gpu_memory_heavy`` take a lock shared by the pytest-xdist workers and hand their
    cached blocks back before releasing it: several at once fill an 80 GB card."""
    if request.node.get_closest_marker("gpu_memory_heavy") is None:
        yield
        return
    with open(os.path.join(tempfile.gettempdir(), "edgedot-tests-gpu-memory.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.empty_cache()
            fcntl.flock(lock, fcntl.LOCK_UN)
