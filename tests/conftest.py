import pytest
import torch


@pytest.fixture
def restore_deterministic():
    """Restores torch's deterministic-algorithms switch (and warn_only) after the test."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


@pytest.fixture(autouse=True)
def _cuda_sync_after_test():
    """Surfaces asynchronous CUDA errors in the test that caused them, not in a later one."""
    yield
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        # A check a test left unread (a bad graph passed on purpose) stays with that test.
        from edgedot.runtime.checks import deferred
        deferred.discard()
