"""The KernelBench harness's own CUDA extension, apart from the library's.

``kernelbench_forward`` (``csrc/kernelbench.cpp``, the seed problem's entry point), its index cast
(``csrc/index_cast.cu``) and the library's kernels it calls (the edge dot forward and the launch
helpers of ``edgedot/csrc``), built on first use with ``torch.utils.cpp_extension.load`` as module
``edgedot_kernelbench`` into the subfolder ``kernelbench`` of the library's build folder
(:func:`edgedot.runtime.build.cache_dir`). The library's extension, its source fingerprint and its CUDA
wheel hold none of the harness, so this is always built just in time and needs nvcc, prebuilt
wheel or not.
"""

import os
import threading

from ..runtime import build as _build, sources as _sources

NAME = "edgedot_kernelbench"
# Translation units, relative to the package folder (edgedot/) as in edgedot/runtime/sources.py: the
# harness's own (kernelbench/csrc/) and the library's kernels they call, the same as the export
# inlines (EXPORT_SOURCES in edgedot/kernelbench/__init__.py).
SOURCES = [
    "kernelbench/csrc/harness_module.cpp",
    "kernelbench/csrc/kernelbench.cpp",
    "kernelbench/csrc/index_cast.cu",
    "csrc/common/launch.cu",
    "csrc/edge_dot/edge_dot_forward.cu",
]
# The harness's sources include edgedot.h and common.cuh as "common/edgedot.h".
INCLUDE_DIRS = ["csrc"]

_lock = threading.Lock()
_module = None


def build_dir():
    """The harness's build folder: ``kernelbench`` under the library's (:func:`edgedot.runtime.build.cache_dir`)."""
    return _build.cache_dir() / "kernelbench"


def cuda_module():
    """The harness's compiled extension, built or loaded on the first call of the process (thread-safe)."""
    global _module
    if _module is not None:
        return _module
    with _lock:
        if _module is None:
            _module = _jit_build()
    return _module


def _jit_build():
    from torch.utils import cpp_extension

    if _build.toolkit_nvcc() is None:
        raise RuntimeError(
            "edgedot's KernelBench harness builds its own CUDA extension on first use and needs the CUDA "
            "toolkit (nvcc), but none was found: install a toolkit matching torch.version.cuda and set "
            "CUDA_HOME (docs/install.md).")
    build = build_dir()
    build.mkdir(parents=True, exist_ok=True)
    verbose = os.environ.get("EDGEDOT_VERBOSE_BUILD", "0") == "1"
    return cpp_extension.load(
        name=NAME,
        sources=[str(_build.PACKAGE / source) for source in SOURCES],
        extra_include_paths=[str(_build.PACKAGE / folder) for folder in INCLUDE_DIRS],
        extra_cflags=list(_sources.CXX_FLAGS),
        extra_cuda_cflags=list(_sources.NVCC_FLAGS),  # arch: the GPUs present, or TORCH_CUDA_ARCH_LIST
        extra_ldflags=_sources.link_flags(cpp_extension.get_cxx_compiler()),
        build_directory=str(build),
        verbose=verbose,
    )
