"""What the CUDA extension is built from: its sources and compiler flags, in one place.

Both builds read this module: the just-in-time build on first use (:mod:`edgedot.runtime.build`) and the
ahead-of-time build of a CUDA wheel (``setup.py`` with ``EDGEDOT_BUILD_CUDA=1``). It imports only
the standard library, so ``setup.py`` loads it by file path without importing torch or the
package. A new ``.cu`` or ``.cpp`` file joins the extension by one entry in ``SOURCES``
(``tests/test_packaging.py`` fails while a source file of the package is missing from it). The
KernelBench harness is not part of it: it builds its own extension (edgedot/kernelbench/extension.py).
"""

import functools
import hashlib
import shlex
import struct
import subprocess
import tempfile
from pathlib import Path

# Translation units of the extension, relative to the package folder (edgedot/), in link order.
SOURCES = [
    "csrc/extension.cpp",
    "csrc/common/tensor_args.cpp",
    "csrc/common/graph_checks.cpp",
    "csrc/common/grouping_ops.cpp",
    "csrc/common/self_loops_ops.cpp",
    "csrc/common/column_sum_ops.cpp",
    "csrc/common/linear_autograd.cpp",
    "csrc/edge_dot/edge_dot_ops.cpp",
    "csrc/attention/dropout_rng.cpp",
    "csrc/attention/attention_ops.cpp",
    "csrc/attention/gat_ops.cpp",
    "csrc/attention/agnn_ops.cpp",
    "csrc/attention/autograd.cpp",
    "csrc/common/launch.cu",
    "csrc/common/sort_by_row.cu",
    "csrc/common/group_edges.cu",
    "csrc/common/group_edges_cooperative.cu",
    "csrc/common/self_loops.cu",
    "csrc/common/edge_order.cu",
    "csrc/common/check_graph.cu",
    "csrc/common/column_sum.cu",
    "csrc/edge_dot/edge_dot_forward.cu",
    "csrc/edge_dot/edge_dot_backward_atomic.cu",
    "csrc/edge_dot/edge_dot_backward_sorted.cu",
    "csrc/attention/schedule.cu",
    "csrc/attention/forward.cu",
    "csrc/attention/backward_dst.cu",
    "csrc/attention/backward_src.cu",
    "csrc/attention/cosine_forward.cu",
    "csrc/attention/cosine_backward_dst.cu",
    "csrc/attention/cosine_backward_src.cu",
    "csrc/attention/gat_forward.cu",
    "csrc/attention/gat_backward_dst.cu",
    "csrc/attention/gat_backward_src.cu",
    "csrc/attention/node_logits.cu",
    "csrc/attention/merge.cu",
]
# Include folders, relative to the package: sources include their headers as "common/edgedot.h".
INCLUDE_DIRS = ["csrc"]

CXX_FLAGS = ["-O3"]
# No -arch here: the JIT build targets the GPUs present (or TORCH_CUDA_ARCH_LIST), setup.py its
# own default list.
NVCC_FLAGS = ["-O3", "-lineinfo"]


def link_flags(compiler, maps="/proc/self/maps"):
    """Linker inputs that keep one C++ runtime in the process: ``[]``, or the ``libstdc++`` this
    process loaded.

    A compiler that links ``libstdc++`` statically into a shared object (one built without the
    shared library, or whose specs ask for the archive) puts a second copy of the C++ runtime in the
    extension, beside the one torch uses; that copy's streams dropped or crashed on numbers in
    messages (NOTES.md, 2026-12-05). :func:`links_shared_runtime` asks the compiler; where it links
    the archive, the loaded ``libstdc++.so.6`` (found in ``maps``, this process's memory map, after
    torch is imported) goes to the linker ahead of it, and the linker takes the runtime from there.
    """
    if links_shared_runtime(compiler):
        return []
    try:
        with open(maps) as lines:
            loaded = sorted({line.split()[-1] for line in lines if "/libstdc++.so" in line})
    except OSError:
        return []
    return loaded[:1]


_PROBE = "#include <sstream>\n#include <string>\n" \
         "std::string edgedot_probe(long n) { std::ostringstream s; s << n; return s.str(); }\n"


@functools.lru_cache(maxsize=None)
def links_shared_runtime(compiler):
    """Whether ``compiler`` (a command, as ``CXX`` holds it) links a shared object that uses C++
    streams against the shared ``libstdc++`` (its ``DT_NEEDED`` entries name it). A probe of a
    few lines is built to find out (about a second, once a process). True where the probe cannot
    be built: then nothing is changed in the build, which reports its own errors."""
    with tempfile.TemporaryDirectory(prefix="edgedot-probe-") as folder:
        source, shared = Path(folder) / "probe.cpp", Path(folder) / "probe.so"
        source.write_text(_PROBE)
        try:
            # (CXX may hold a command of several words, "ccache g++".)
            command = shlex.split(compiler) + ["-shared", "-fPIC", "-o", str(shared), str(source)]
            built = subprocess.run(command, capture_output=True, timeout=300).returncode == 0
        except (OSError, ValueError, subprocess.SubprocessError):  # (ValueError: shlex, on unbalanced quotes)
            return True
        if not built:
            return True
        try:
            needed = elf_needed(shared)
        except (OSError, ValueError, struct.error):
            return True
    return any(name.startswith("libstdc++.so") for name in needed)


def elf_needed(path):
    """The ``DT_NEEDED`` entries (shared libraries a binary names) of a 64-bit little-endian ELF
    file. ValueError for anything else."""
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path} is not a 64-bit little-endian ELF file")
    section_offset, = struct.unpack_from("<Q", data, 0x28)
    section_size, sections = struct.unpack_from("<HH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, section_offset + i * section_size) for i in range(sections)]
    needed = []
    for _, kind, _, _, offset, size, link, _, _, _ in headers:
        if kind != 6:  # SHT_DYNAMIC
            continue
        strings = headers[link][4]
        for tag, value in struct.iter_unpack("<qQ", data[offset:offset + size]):
            if tag == 0:  # DT_NULL
                break
            if tag == 1:  # DT_NEEDED
                end = data.index(b"\0", strings + value)
                needed.append(data[strings + value:end].decode())
    return needed


SOURCE_SUFFIXES = (".cu", ".cpp")
HEADER_SUFFIXES = (".h", ".cuh")


def extension_files(package_dir):
    """Every file the extension is compiled from, relative to ``package_dir``, sorted.

    The files of ``SOURCES`` and the headers (``.h``, ``.cuh``) in their folders.
    """
    package_dir = Path(package_dir)
    files = set(SOURCES)
    for folder in sorted({Path(source).parent for source in SOURCES}):
        files.update(path.relative_to(package_dir).as_posix() for path in (package_dir / folder).iterdir()
                     if path.suffix in HEADER_SUFFIXES)
    return sorted(files)


def fingerprint(package_dir):
    """SHA-256 over the names and bytes of :func:`extension_files`: what a binary was built from.

    A prebuilt extension records it at build time; at load time a different value means the
    sources beside it changed (an edited checkout), so the binary is stale.
    """
    package_dir = Path(package_dir)
    digest = hashlib.sha256()
    for name in extension_files(package_dir):
        data = (package_dir / name).read_bytes()
        digest.update(f"{name}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()


def build_tag(torch_version, cuda_version):
    """The local version label of a CUDA wheel built against these: ``("2.11.0+cu130", "13.0")`` gives
    ``"pt211cu130"``, so that the wheel's version (``0.1.0+pt211cu130``) names what it fits."""
    major, minor = torch_version.split("+")[0].split(".")[:2]
    return f"pt{major}{minor}cu{cuda_version.replace('.', '')}"
