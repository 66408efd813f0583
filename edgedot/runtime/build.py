"""The CUDA kernels: a prebuilt extension where the install has one that fits, else a build on first use.

A CUDA wheel (``setup.py`` with ``EDGEDOT_BUILD_CUDA=1``, docs/install.md) ships the compiled
extension ``edgedot._C`` and ``edgedot._build_info``, the record of that build: the torch and CUDA
versions it was built against and a fingerprint of its sources (:func:`edgedot.runtime.sources.fingerprint`).
:func:`cuda_module` loads ``_C`` when the record matches the running torch and the sources beside
it. On a mismatch it builds just in time instead, with a warning, if a CUDA toolkit is there, and
otherwise refuses with a message naming both versions: a binary built for another torch is never
loaded. Without a prebuilt extension, ``torch.utils.cpp_extension.load`` compiles the sources of
:mod:`edgedot.runtime.sources` with ninja into a persistent cache folder; later processes find the built
module there and load it without compiling. Importing edgedot never builds or loads anything, so
CPU-only use needs neither.
"""

import importlib
import os
import threading
import warnings
from pathlib import Path

import torch

from . import sources

# The package folder (edgedot/): the sources' paths are relative to it.
PACKAGE = Path(__file__).parent.parent
CSRC = PACKAGE / "csrc"
PREBUILT = "edgedot._C"

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
    """The compiled extension, loaded or built on the first call of the process (thread-safe)."""
    global _module
    if _module is not None:
        return _module
    with _lock:
        if _module is None:
            _module = _load()
    return _module


def prebuilt_info():
    """The record of the ahead-of-time build (module ``edgedot._build_info``), or None without one."""
    try:
        return importlib.import_module("edgedot._build_info")
    except ModuleNotFoundError as error:
        if error.name != "edgedot._build_info":
            raise
        return None


def prebuilt_mismatch(info, torch_version, cuda_version, fingerprint):
    """Why a prebuilt extension with record ``info`` does not fit, as text; None if it fits.

    It fits when it was built against exactly this torch (``torch.__version__``, local label
    included: torch keeps no C++ ABI across releases) and CUDA, from exactly these sources.
    """
    reasons = []
    if info.TORCH_VERSION != torch_version:
        reasons.append(f"it was built for torch {info.TORCH_VERSION}, this is torch {torch_version}")
    if info.CUDA_VERSION != cuda_version:
        have = f"this torch has CUDA {cuda_version}" if cuda_version else "this torch has no CUDA"
        reasons.append(f"it was built for CUDA {info.CUDA_VERSION}, {have}")
    if info.SOURCES_FINGERPRINT != fingerprint:
        reasons.append("the sources in edgedot/ changed since it was built")
    return "; ".join(reasons) or None


def toolkit_nvcc():
    """Path of the nvcc a just-in-time build would use (torch's ``CUDA_HOME``), or None."""
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        return None
    nvcc = Path(cpp_extension.CUDA_HOME) / "bin" / "nvcc"
    return nvcc if nvcc.is_file() else None


def _load():
    info = prebuilt_info()
    if info is not None:
        mismatch = prebuilt_mismatch(info, torch.__version__, torch.version.cuda, sources.fingerprint(PACKAGE))
        if mismatch is None:
            return _import_prebuilt()
        if toolkit_nvcc() is None:
            if torch.version.cuda is None:
                remedy = f"This torch is not a CUDA build; the wheel was built for torch {info.TORCH_VERSION}."
            else:
                remedy = (f"Install the edgedot wheel built for this torch (version label "
                          f"+{sources.build_tag(torch.__version__, torch.version.cuda)}), build one with "
                          "scripts/build_wheel.sh, or install a CUDA toolkit matching torch.version.cuda="
                          f"{torch.version.cuda} and set CUDA_HOME (docs/install.md).")
            raise RuntimeError(f"edgedot's prebuilt CUDA kernels ({PREBUILT}) do not fit: {mismatch}. They are "
                               f"not loaded, and no CUDA toolkit (nvcc) was found to build them on first use. {remedy}")
        warnings.warn(f"edgedot's prebuilt CUDA kernels ({PREBUILT}) do not fit: {mismatch}. Building them "
                      "with nvcc instead (once per torch version; about a minute).", RuntimeWarning, stacklevel=3)
    return _jit_build()


def _import_prebuilt():
    try:
        return importlib.import_module(PREBUILT)
    except ImportError as error:
        raise RuntimeError(f"edgedot's prebuilt CUDA kernels ({PREBUILT}) match this torch but failed to "
                           f"load: {error}. Reinstall edgedot (docs/install.md).") from error


def _jit_build():
    from torch.utils import cpp_extension

    if toolkit_nvcc() is None:
        raise RuntimeError(
            "edgedot needs the CUDA toolkit (nvcc) to build its kernels on first use, but none was "
            "found. Install a toolkit matching torch.version.cuda="
            f"{torch.version.cuda} and set CUDA_HOME, install a CUDA wheel of edgedot built for this "
            "torch (docs/install.md), or keep the tensors on the CPU.")
    build = cache_dir()
    build.mkdir(parents=True, exist_ok=True)
    verbose = os.environ.get("EDGEDOT_VERBOSE_BUILD", "0") == "1"
    return cpp_extension.load(
        name="edgedot_cuda",
        sources=[str(PACKAGE / source) for source in sources.SOURCES],
        extra_include_paths=[str(PACKAGE / folder) for folder in sources.INCLUDE_DIRS],
        extra_cflags=list(sources.CXX_FLAGS),
        extra_cuda_cflags=list(sources.NVCC_FLAGS),  # arch: the GPUs present, or TORCH_CUDA_ARCH_LIST
        extra_ldflags=sources.link_flags(cpp_extension.get_cxx_compiler()),
        build_directory=str(build),
        verbose=verbose,
    )
