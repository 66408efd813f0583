"""Just-in-time build of the CUDA kernels, on first use, into a persistent cache.

``torch.utils.cpp_extension.load`` compiles ``csrc/`` with ninja into the cache folder; later
processes find the built module there and load it without compiling. Importing edgedot never
builds anything, so CPU-only use needs no CUDA toolkit.
"""

import os
import threading
from pathlib import Path

import torch

CSRC = Path(__file__).parent / "csrc"
SOURCES = ["bindings.cpp", "kernelbench.cpp", "launch.cu", "forward.cu", "index_cast.cu", "backward_atomic.cu",
           "backward_sorted.cu", "sort_by_row.cu", "group_edges.cu", "edge_order.cu", "attention_schedule.cu",
           "attention_forward.cu", "attention_backward.cu", "attention_merge.cu"]

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
        sources=[str(CSRC / s) for s in SOURCES],
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3", "-lineinfo"],  # arch: the GPUs present, or TORCH_CUDA_ARCH_LIST
        build_directory=str(build),
        verbose=verbose,
    )
