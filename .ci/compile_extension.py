"""Compiles the CUDA extension the way a CUDA wheel build does, up to its link step.

setup.py's own ``CUDAExtension`` and ``BuildExtension`` (its default ``TORCH_CUDA_ARCH_LIST`` and
``MAX_JOBS`` bound, the flags of edgedot/runtime/sources.py, ninja), with the link left out: CI's torch is
a CPU build, without the CUDA libraries the link needs. Then checks the build record written beside
the (unlinked) binary.
"""

import os
import re
import runpy
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from setuptools import Distribution
from torch.utils import cpp_extension

root = Path(__file__).resolve().parent.parent
os.chdir(root)
if cpp_extension.CUDA_HOME is None:
    # A CPU build of torch looks for no toolkit; nvcc (maybe a wrapper script) says where its own is.
    dryrun = subprocess.run(["nvcc", "--dryrun", "-c", "-x", "cu", "/dev/null"], capture_output=True, text=True)
    cpp_extension.CUDA_HOME = str(Path(re.search(r"^#\$ TOP=(.*)$", dryrun.stderr, re.M).group(1)).resolve())
setup_py = runpy.run_path("setup.py", run_name="edgedot_setup")
sources = setup_py["load_sources"]()
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", setup_py["DEFAULT_ARCH_LIST"])
os.environ.setdefault("MAX_JOBS", str(setup_py["default_max_jobs"](os.cpu_count(), setup_py["available_memory"]())))
extension = setup_py["cuda_extension"](sources)
record = setup_py["record_text"]("ci", "ci", os.environ["TORCH_CUDA_ARCH_LIST"], sources.fingerprint(root / "edgedot"))


class CompileOnly(setup_py["build_ext_with_record"](record)):
    def build_extensions(self):
        self.compiler.link_shared_object = lambda *args, **kwargs: None
        super().build_extensions()


with tempfile.TemporaryDirectory() as work:
    # CPU builds of torch lack this generated header; the CUDA builds' copy only sets export macros.
    stub = Path(work, "stub", "c10", "cuda", "impl")
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
    extension.include_dirs.append(str(Path(work, "stub")))
    command = CompileOnly(Distribution({"name": "edgedot", "ext_modules": [extension]}))
    command.build_temp, command.build_lib = str(Path(work, "temp")), str(Path(work, "lib"))
    command.ensure_finalized()
    print(f"setup.py's extension: {len(extension.sources)} sources, TORCH_CUDA_ARCH_LIST="
          f"{os.environ['TORCH_CUDA_ARCH_LIST']}, MAX_JOBS={os.environ['MAX_JOBS']}", flush=True)
    start = time.time()
    command.run()
    objects = sorted(Path(work, "temp").rglob("*.o"))
    written = Path(work, "lib", "edgedot", "_build_info.py")
    if len(objects) != len(extension.sources) or not written.is_file() or written.read_text() != record:
        sys.exit(f"setup.py's build: {len(objects)} objects of {len(extension.sources)} sources, record "
                 f"{'written' if written.is_file() else 'missing'}")
    print(f"setup.py's extension: all {len(objects)} sources compile ({time.time() - start:.0f} s), record written")
