"""Just-in-time build of the CUDA kernels, on first use, into a persistent cache.

``torch.utils.cpp_extension.load`` compiles ``csrc/`` and ``kernelbench/csrc/`` with ninja into
the cache folder; later processes find the built module there and load it without compiling.
Importing edgedot never builds anything, so CPU-only use needs no CUDA toolkit.
"""

import os
import threading
from pathlib import Path

import torch

PACKAGE = Path(__file__).parent
CSRC = PACKAGE / "csrc"  # the library's kernels and the plain C++ interface, edgedot.h
# Relative to PACKAGE: the library's sources, then the KernelBench harness's (one extension).
SOURCES = ["csrc/bindings.cpp", "csrc/launch.cu", "csrc/forward.cu", "csrc/backward_atomic.cu",
           "csrc/backward_sorted.cu", "csrc/sort_by_row.cu", "csrc/group_edges.cu", "csrc/edge_order.cu",
           "csrc/attention_schedule.cu", "csrc/attention_forward.cu", "csrc/attention_backward.cu",
           "csrc/attention_merge.cu",
           "kernelbench/csrc/kernelbench.cpp", "kernelbench/csrc/index_cast.cu"]

_lock = threading.Lock()
_module = None


def cache_dir():
    """Build folder: ``$EDGEDOT_CACHE`` if set, else ``~/.cache/edgedot/<torch>-<cuda>``."""
    root = os.environ.get("EDGEDOT_CACHE")
    if root:
        return Path(root)
    tag = f"torch{torch.__version__.split('+')[0]}-cuda{torch.version.cuda}"
    return Path.home() / ".cache" / "edgedot" / tag


def cuda_module():
    """The compiled extension, built on the first call of the process (thread-safe)."""
    global _module
    if _module is not None:
        return _module
    with _lock:
        if _module is None:
            _module = _load()
    return _module


def _load():
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        raise RuntimeError(
            "edgedot needs the CUDA toolkit (nvcc) to build its kernels on first use, but none was "
            "found. Install a toolkit matching torch.version.cuda="
            f"{torch.version.cuda} and set CUDA_HOME, or keep the tensors on the CPU.")
    build = cache_dir()
    build.mkdir(parents=True, exist_ok=True)
    verbose = os.environ.get("EDGEDOT_VERBOSE_BUILD", "0") == "1"
    return cpp_extension.load(
        name="edgedot_cuda",
        sources=[str(PACKAGE / s) for s in SOURCES],
        extra_include_paths=[str(CSRC)],  # the harness's sources include edgedot.h and common.cuh
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3", "-lineinfo"],  # arch: the GPUs present, or TORCH_CUDA_ARCH_LIST
        build_directory=str(build),
        verbose=verbose,
    )
