"""Packaging of edgedot: a pure-Python wheel by default, a CUDA wheel with ``EDGEDOT_BUILD_CUDA=1``.

Default: the package and its CUDA sources; the kernels are built on first use (edgedot/runtime/build.py).

``EDGEDOT_BUILD_CUDA=1``: also compiles the extension ``edgedot._C`` ahead of time with torch's
``CUDAExtension``, against the torch of the build environment (pip needs ``--no-build-isolation``
to see it), for ``TORCH_CUDA_ARCH_LIST`` (default ``8.0;9.0+PTX``: A100, H100/H200, and newer GPUs
through the PTX), with ``MAX_JOBS`` parallel compiles (default: one per core, at most one per
3 GiB of available memory). Beside the binary it writes ``edgedot/_build_info.py``, the record
edgedot checks before loading it (torch and CUDA version, arch list, source fingerprint), and the
wheel's version carries torch and CUDA: ``0.1.0+pt211cu130``. Sources and flags come from
edgedot/runtime/sources.py, which the just-in-time build reads too. docs/install.md has both routes.
"""

import ast
import importlib.util
import os
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PACKAGE = ROOT / "edgedot"
DEFAULT_ARCH_LIST = "8.0;9.0+PTX"
# Memory one nvcc job may take on these sources: 2.2 GiB peak measured (nvcc 13.0, two archs), plus margin.
BYTES_PER_JOB = 3 * 2**30
RECORD = "_build_info"


def load_sources():
    """edgedot/runtime/sources.py, loaded by path: no torch and no package import."""
    spec = importlib.util.spec_from_file_location("edgedot_sources", PACKAGE / "runtime" / "sources.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def base_version():
    """``__version__`` of edgedot/__init__.py, read without importing it."""
    for node in ast.parse((PACKAGE / "__init__.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__version__" for t in node.targets):
            return ast.literal_eval(node.value)
    raise RuntimeError("edgedot/__init__.py defines no __version__")


def cuda_build_requested(environ=os.environ):
    """True for ``EDGEDOT_BUILD_CUDA=1``, False when it is unset, empty or 0; an error otherwise."""
    value = environ.get("EDGEDOT_BUILD_CUDA", "")
    if value not in ("", "0", "1"):
        raise SystemExit(f"EDGEDOT_BUILD_CUDA must be 0 or 1, got {value!r}")
    return value == "1"


def available_memory(meminfo="/proc/meminfo"):
    """``MemAvailable`` in bytes, or None where /proc/meminfo has no such line."""
    try:
        with open(meminfo) as lines:
            for line in lines:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def default_max_jobs(cpus, memory):
    """Parallel nvcc jobs: one per core, at most one per ``BYTES_PER_JOB`` of ``memory``, at least one."""
    jobs = cpus or 1
    if memory is not None:
        jobs = min(jobs, int(memory // BYTES_PER_JOB))
    return max(1, jobs)


def record_text(torch_version, cuda_version, arch_list, fingerprint):
    """Source of edgedot/_build_info.py for a build with these."""
    return ('"""Record of the ahead-of-time build of edgedot._C, written by setup.py and checked by\n'
            'edgedot.runtime.build before it loads the binary."""\n\n'
            f"TORCH_VERSION = {torch_version!r}\n"
            f"CUDA_VERSION = {cuda_version!r}\n"
            f"ARCH_LIST = {arch_list!r}\n"
            f"SOURCES_FINGERPRINT = {fingerprint!r}\n")


class BuildPyWithoutRecord(build_py):
    """``build_py`` that leaves out edgedot/_build_info.py: only ``build_ext`` writes it, beside the binary
    it describes, so one left in the tree by an in-place CUDA build never reaches a wheel alone."""

    def find_package_modules(self, package, package_dir):
        return [module for module in super().find_package_modules(package, package_dir)
                if module[:2] != ("edgedot", RECORD)]


def cuda_extension(sources):
    """The ``CUDAExtension`` ``edgedot._C`` of ``sources`` (edgedot/runtime/sources.py)."""
    from torch.utils.cpp_extension import CUDAExtension, get_cxx_compiler

    return CUDAExtension(
        name="edgedot._C",
        sources=[f"edgedot/{source}" for source in sources.SOURCES],
        include_dirs=[str(PACKAGE / folder) for folder in sources.INCLUDE_DIRS],
        extra_compile_args={"cxx": list(sources.CXX_FLAGS), "nvcc": list(sources.NVCC_FLAGS)},
        extra_link_args=sources.link_flags(get_cxx_compiler()),
    )


def build_ext_with_record(text):
    """torch's ``BuildExtension``, writing ``text`` to ``_build_info.py`` beside the built ``edgedot._C``."""
    from torch.utils.cpp_extension import BuildExtension

    class BuildExtensionWithRecord(BuildExtension):
        def run(self):
            super().run()
            path = self._record_path()
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)

        def get_outputs(self):
            return super().get_outputs() + [str(self._record_path())]

        def _record_path(self):
            return Path(self.get_ext_fullpath("edgedot._C")).with_name(f"{RECORD}.py")

    return BuildExtensionWithRecord


def import_cuda_torch():
    """torch, if it is a CUDA build; exits with what to do otherwise."""
    try:
        import torch
    except ImportError:
        raise SystemExit("EDGEDOT_BUILD_CUDA=1 compiles against the installed torch, which this build "
                         "environment does not see: build with pip's --no-build-isolation (python -m build: "
                         "--no-isolation), in an environment with a CUDA build of torch.") from None
    if torch.version.cuda is None:
        raise SystemExit(f"EDGEDOT_BUILD_CUDA=1 needs a CUDA build of torch; torch {torch.__version__} is not one.")
    return torch


def cuda_setup_arguments():
    """``setup()`` arguments of the CUDA wheel; sets the arch list and MAX_JOBS defaults in the environment."""
    torch = import_cuda_torch()
    sources = load_sources()
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCH_LIST)
    os.environ.setdefault("MAX_JOBS", str(default_max_jobs(os.cpu_count(), available_memory())))
    print(f"edgedot: building edgedot._C against torch {torch.__version__} (CUDA {torch.version.cuda}) for "
          f"TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']}, MAX_JOBS={os.environ['MAX_JOBS']}")
    text = record_text(torch.__version__, torch.version.cuda, os.environ["TORCH_CUDA_ARCH_LIST"],
                       sources.fingerprint(PACKAGE))
    return {
        "version": f"{base_version()}+{sources.build_tag(torch.__version__, torch.version.cuda)}",
        "ext_modules": [cuda_extension(sources)],
        "cmdclass": {"build_py": BuildPyWithoutRecord, "build_ext": build_ext_with_record(text)},
    }


if __name__ == "__main__":
    if cuda_build_requested():
        setup(**cuda_setup_arguments())
    else:
        setup(version=base_version(), cmdclass={"build_py": BuildPyWithoutRecord})
