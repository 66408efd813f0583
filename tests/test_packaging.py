"""Packaging: the one source list, setup.py's CUDA-wheel helpers, the pure-Python wheel's contents,
and how edgedot.runtime.build picks between a prebuilt extension and the just-in-time build."""

import importlib.util
import os
import runpy
import shutil
import subprocess
import sys
import types
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

import edgedot
from edgedot.runtime import build, sources
from edgedot.kernelbench import extension as harness_extension

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "edgedot"
SETUP = runpy.run_path(str(REPO / "setup.py"), run_name="edgedot_setup")


def _record(torch_version=None, cuda_version=None, fingerprint=None, package=PACKAGE):
    """A build record (what edgedot/_build_info.py holds) as setup.py writes it, for the running torch
    and the sources in ``package`` unless told otherwise."""
    text = SETUP["record_text"](torch_version or torch.__version__, cuda_version or torch.version.cuda, "8.0;9.0+PTX",
                                fingerprint or sources.fingerprint(package))
    namespace = {}
    exec(text, namespace)
    return text, types.SimpleNamespace(**{k: v for k, v in namespace.items() if k.isupper()})


# ---- the source list -------------------------------------------------------------------------


def test_sources_are_every_source_file_of_the_package():
    """Every source file is the library's extension's (sources.SOURCES) or, under kernelbench/, the
    KernelBench harness's own extension's (edgedot.kernelbench.extension), which also builds a few
    of the library's kernels."""
    on_disk = {path.relative_to(PACKAGE).as_posix()
               for suffix in sources.SOURCE_SUFFIXES for path in PACKAGE.rglob(f"*{suffix}")}
    listed = set(sources.SOURCES)
    harness = set(harness_extension.SOURCES)
    assert len(listed) == len(sources.SOURCES), "a source is listed twice"
    assert len(harness) == len(harness_extension.SOURCES), "a harness source is listed twice"
    assert not [name for name in listed if name.startswith("kernelbench/")], "the harness in the library's extension"
    unlisted = on_disk - listed - harness
    assert not unlisted, f"in the package but in neither extension's sources: {sorted(unlisted)}"
    assert not listed - on_disk, f"in sources.SOURCES but not in the package: {sorted(listed - on_disk)}"
    assert not harness - on_disk, f"in the harness's sources but not in the package: {sorted(harness - on_disk)}"


@pytest.mark.parametrize("listed", [sources.SOURCES, harness_extension.SOURCES], ids=["library", "harness"])
def test_sources_have_distinct_file_names(listed):
    # torch's just-in-time build names each object file after its source's file name alone.
    stems = [Path(source).stem for source in listed]
    assert len(set(stems)) == len(stems), f"two sources share a file name: {sorted(stems)}"


def test_setup_builds_the_listed_sources():
    assert SETUP["load_sources"]().SOURCES == sources.SOURCES
    assert SETUP["base_version"]() == edgedot.__version__


def test_fingerprint_follows_sources_and_headers(tmp_path):
    copy = tmp_path / "edgedot"
    for folder in sorted({Path(source).parent for source in sources.SOURCES}):
        shutil.copytree(PACKAGE / folder, copy / folder, dirs_exist_ok=True)
    base = sources.fingerprint(copy)
    assert base == sources.fingerprint(PACKAGE)
    (copy / "csrc" / "notes.txt").write_text("not a source")
    assert sources.fingerprint(copy) == base
    headers = [name for name in sources.extension_files(copy) if name.endswith(sources.HEADER_SUFFIXES)]
    assert headers and not set(headers) & set(sources.SOURCES)
    for name in [sources.SOURCES[-1], *headers]:
        original = (copy / name).read_bytes()
        (copy / name).write_bytes(original + b"\n")
        assert sources.fingerprint(copy) != base, name
        (copy / name).write_bytes(original)
    assert sources.fingerprint(copy) == base


# ---- setup.py's helpers ----------------------------------------------------------------------


@pytest.mark.parametrize("torch_version, cuda_version, tag", [
    ("2.11.0+cu130", "13.0", "pt211cu130"), ("2.4.1", "12.1", "pt24cu121"), ("2.13.0a0+git1234", "12.8", "pt213cu128")])
def test_build_tag(torch_version, cuda_version, tag):
    assert sources.build_tag(torch_version, cuda_version) == tag


def test_max_jobs_bounded_by_cores_and_memory():
    jobs, per_job = SETUP["default_max_jobs"], SETUP["BYTES_PER_JOB"]
    assert jobs(16, 100 * per_job) == 16
    assert jobs(16, 3.5 * per_job) == 3
    assert jobs(16, 0.5 * per_job) == 1
    assert jobs(None, None) == 1
    assert jobs(7, None) == 7


def test_available_memory_reads_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemFree:         1000000 kB\nMemAvailable:   12345678 kB\n")
    assert SETUP["available_memory"](str(meminfo)) == 12345678 * 1024
    meminfo.write_text("MemTotal:       32000000 kB\n")
    assert SETUP["available_memory"](str(meminfo)) is None
    assert SETUP["available_memory"](str(tmp_path / "missing")) is None


def test_cuda_build_switch():
    requested = SETUP["cuda_build_requested"]
    assert requested({"EDGEDOT_BUILD_CUDA": "1"})
    for off in ({}, {"EDGEDOT_BUILD_CUDA": "0"}, {"EDGEDOT_BUILD_CUDA": ""}):
        assert not requested(off)
    with pytest.raises(SystemExit, match="EDGEDOT_BUILD_CUDA must be 0 or 1, got 'yes'"):
        requested({"EDGEDOT_BUILD_CUDA": "yes"})


def test_record_of_this_build_fits():
    _, info = _record()
    assert info.TORCH_VERSION == torch.__version__ and info.ARCH_LIST == "8.0;9.0+PTX"
    assert build.prebuilt_mismatch(info, torch.__version__, torch.version.cuda, sources.fingerprint(PACKAGE)) is None


def test_pure_wheel_ships_every_extension_file(tmp_path):
    """The default wheel: the package with every source and header the JIT build compiles, and no
    build record even if an in-place CUDA build left one in the tree."""
    pytest.importorskip("pip")
    if importlib.util.find_spec("setuptools.command.bdist_wheel") is None and importlib.util.find_spec("wheel") is None:
        pytest.skip("building a wheel needs setuptools>=70.1 or the wheel package")
    tree = tmp_path / "tree"
    tree.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, tree / name)
    shutil.copytree(PACKAGE, tree / "edgedot", ignore=shutil.ignore_patterns("__pycache__", "_C*.so", "_build_info.py"))
    (tree / "edgedot" / "_build_info.py").write_text(_record()[0])
    env = {k: v for k, v in os.environ.items() if k != "EDGEDOT_BUILD_CUDA"}
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path / "dist"), str(tree)], cwd=tree, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = (tmp_path / "dist").glob("edgedot-*.whl")
    assert wheel.name == f"edgedot-{edgedot.__version__}-py3-none-any.whl"
    names = set(zipfile.ZipFile(wheel).namelist())
    files = {*sources.extension_files(PACKAGE), *harness_extension.SOURCES}
    missing = [name for name in sorted(files) if f"edgedot/{name}" not in names]
    assert not missing, f"the wheel lacks {missing}"
    assert "edgedot/runtime/sources.py" in names and "edgedot/_build_info.py" not in names
    subpackages = sorted(f"edgedot/{path.parent.relative_to(PACKAGE).as_posix()}/__init__.py"
                         for path in PACKAGE.glob("*/__init__.py"))
    assert {"edgedot/ops/__init__.py", "edgedot/nn/__init__.py", "edgedot/runtime/__init__.py"} <= set(subpackages)
    assert not [name for name in subpackages if name not in names], "the wheel lacks a subpackage"
    assert not [name for name in names if name.startswith("edgedot/_C")]


# ---- the import ------------------------------------------------------------------------------

LEAN_IMPORT = """
import sys

import edgedot
import edgedot.cpu.gat, edgedot.distributed, edgedot.ops, edgedot.reference, edgedot.runtime.build
assert "torch_geometric" not in sys.modules, "import edgedot imported torch_geometric"
assert "edgedot.nn" not in sys.modules, "import edgedot imported edgedot.nn"

import torch

layer = edgedot.nn.GATConv(4, 5, heads=2)
assert edgedot.nn is sys.modules["edgedot.nn"] and "nn" in edgedot.__all__
out = layer(torch.randn(3, 4), torch.tensor([[0, 1, 2], [1, 2, 0]]))
assert out.shape == (3, 10), out.shape
print("ok")
"""


def test_import_is_lean():
    """``import edgedot`` (its ops, runtime, CPU code, distributed) leaves ``torch_geometric`` and
    ``edgedot.nn`` unimported, in a fresh process; ``edgedot.nn`` loads on first access and its
    layers work."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", LEAN_IMPORT], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["ok"]


# ---- edgedot.runtime.build: prebuilt or just in time -----------------------------------------


@pytest.fixture
def loader(monkeypatch):
    """edgedot.runtime.build with its four outside effects replaced by recorders: the build record, the
    prebuilt import, the toolkit lookup and the JIT build."""
    calls = []
    state = types.SimpleNamespace(info=None, nvcc=None, calls=calls)
    monkeypatch.setattr(build, "prebuilt_info", lambda: state.info)
    monkeypatch.setattr(build, "toolkit_nvcc", lambda: state.nvcc)
    monkeypatch.setattr(build, "_import_prebuilt", lambda: calls.append("prebuilt") or "prebuilt module")
    monkeypatch.setattr(build, "_jit_build", lambda: calls.append("jit") or "jit module")
    return state


def test_load_uses_a_matching_prebuilt(loader):
    loader.info = _record()[1]
    loader.nvcc = Path("/usr/bin/nvcc")  # a toolkit does not matter when the binary fits
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert build._load() == "prebuilt module"
    assert loader.calls == ["prebuilt"]


def test_load_without_prebuilt_builds(loader):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert build._load() == "jit module"
    assert loader.calls == ["jit"]


@pytest.mark.parametrize("running_cuda", ["12.8", None])
@pytest.mark.parametrize("field, value, reason", [
    ("torch_version", "2.4.0+cu121", "built for torch 2.4.0+cu121, this is torch " + torch.__version__),
    ("cuda_version", "11.8", "built for CUDA 11.8, this torch has "),
    ("fingerprint", "0" * 64, "sources in edgedot/ changed since it was built"),
])
def test_load_refuses_a_mismatched_prebuilt_without_toolkit(loader, monkeypatch, running_cuda, field, value, reason):
    monkeypatch.setattr(torch.version, "cuda", running_cuda)
    loader.info = _record(**{field: value})[1]
    with pytest.raises(RuntimeError) as error:
        build._load()
    message = str(error.value)
    assert reason in message and "not loaded" in message and "no CUDA toolkit (nvcc)" in message
    if running_cuda:
        assert "+" + sources.build_tag(torch.__version__, running_cuda) in message
    else:
        assert "This torch is not a CUDA build" in message
    assert loader.calls == []


def test_load_rebuilds_a_mismatched_prebuilt_with_toolkit(loader):
    loader.info = _record(torch_version="2.4.0+cu121")[1]
    loader.nvcc = Path("/usr/local/cuda/bin/nvcc")
    with pytest.warns(RuntimeWarning, match="built for torch 2.4.0\\+cu121.*Building them with nvcc instead"):
        assert build._load() == "jit module"
    assert loader.calls == ["jit"]


def _fake_install(tmp_path, torch_version):
    """A copy of the package with a build record for ``torch_version`` and a stand-in ``_C`` module."""
    site = tmp_path / "site"
    shutil.copytree(PACKAGE, site / "edgedot", ignore=shutil.ignore_patterns("__pycache__", "_C*.so", "_build_info.py"))
    (site / "edgedot" / "_build_info.py").write_text(_record(torch_version, package=site / "edgedot")[0])
    (site / "edgedot" / "_C.py").write_text('STAND_IN = "prebuilt"\n')
    return site


def _first_cuda_module(site):
    """Runs cuda_module() in a fresh process that sees ``site`` first and no CUDA toolkit."""
    env = dict(os.environ, PYTHONPATH=str(site), CUDA_HOME=str(site / "no-toolkit"))
    env.pop("CUDA_PATH", None)
    code = "from edgedot.runtime import build; m = build.cuda_module(); print(m.__name__, m.STAND_IN, build.__file__)"
    return subprocess.run([sys.executable, "-c", code], cwd=site, env=env, capture_output=True, text=True, timeout=300)


def test_installed_prebuilt_is_loaded(tmp_path):
    site = _fake_install(tmp_path, torch.__version__)
    proc = _first_cuda_module(site)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["edgedot._C", "prebuilt", str(site / "edgedot" / "runtime" / "build.py")]


def test_installed_prebuilt_for_another_torch_is_refused(tmp_path):
    site = _fake_install(tmp_path, "2.4.0+cu121")
    proc = _first_cuda_module(site)
    assert proc.returncode != 0
    assert "RuntimeError: edgedot's prebuilt CUDA kernels (edgedot._C) do not fit: it was built for torch 2.4.0+cu121" \
        in proc.stderr


def _compiler(tmp_path, name, body):
    """An executable shell script standing in for a C++ compiler."""
    path = tmp_path / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


_CXX = shutil.which("c++") or shutil.which("g++")
needs_cxx = pytest.mark.skipif(_CXX is None or not Path("/proc/self/maps").exists(),
                               reason="needs a C++ compiler and /proc")


def test_elf_needed_reads_the_shared_libraries_a_binary_names(tmp_path):
    """torch's own extension module names libtorch_python; a file that is not ELF is refused."""
    assert "libtorch_python.so" in sources.elf_needed(torch._C.__file__)
    other = tmp_path / "not-elf.so"
    other.write_bytes(b"#!/bin/sh\n" + bytes(100))
    with pytest.raises(ValueError, match="not a 64-bit little-endian ELF file"):
        sources.elf_needed(other)


@needs_cxx
def test_link_flags_read_the_loaded_runtime_from_the_memory_map(tmp_path):
    """For a compiler that links the archive, the runtime the map lists, whatever its version
    suffix; without one loaded, nothing."""
    static = _compiler(tmp_path, "static-c++", f'exec {_CXX} -static-libstdc++ "$@"')
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libstdc++.so.6.0.33\n"
                    "7f02-7f03 r--p 0 08:01 1 /usr/lib/x86_64-linux-gnu/libstdc++.so.6.0.33\n"
                    "7f04-7f05 r-xp 0 08:01 2 /usr/lib/x86_64-linux-gnu/libm.so.6\n")
    assert sources.link_flags(static, maps) == ["/usr/lib/x86_64-linux-gnu/libstdc++.so.6.0.33"]
    maps.write_text("7f04-7f05 r-xp 0 08:01 2 /usr/lib/x86_64-linux-gnu/libm.so.6\n")
    assert sources.link_flags(static, maps) == []


@needs_cxx
def test_link_flags_ask_the_compiler(tmp_path):
    """A compiler that links the shared runtime gets nothing added; one that links the archive
    (here by -static-libstdc++, as a compiler built without the shared library does) gets the
    runtime this process loaded (torch imported), an existing file; a compiler that is missing or
    fails adds nothing, and the build reports its own error."""
    sources.links_shared_runtime.cache_clear()
    assert sources.links_shared_runtime(_CXX) and sources.link_flags(_CXX) == []
    static = _compiler(tmp_path, "static-c++", f'exec {_CXX} -static-libstdc++ "$@"')
    assert not sources.links_shared_runtime(static)
    flags = sources.link_flags(static)
    assert len(flags) == 1 and "/libstdc++.so" in flags[0] and Path(flags[0]).exists()
    assert not sources.links_shared_runtime(f"env {static}")  # a command of two words, as CXX may hold
    assert sources.link_flags(str(tmp_path / "no-such-compiler")) == []
    assert sources.link_flags(_compiler(tmp_path, "failing-c++", "exit 1")) == []


_MESSAGE_EXTENSION = r"""
#include <torch/extension.h>
void fail(int64_t n) { TORCH_CHECK(false, "bad value ", n, " of ", 2.5, " here"); }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("fail", &fail); }
"""

_BUILD_AND_RAISE = """
import sys
import torch
from torch.utils import cpp_extension
from edgedot.runtime import sources
compiler = cpp_extension.get_cxx_compiler()
flags = sources.link_flags(compiler)
module = cpp_extension.load(name="edgedot_runtime_probe", sources=[sys.argv[1]], extra_ldflags=flags,
                            build_directory=sys.argv[2])
print("NEEDED", sources.elf_needed(module.__file__))
try:
    module.fail(5)
except RuntimeError as error:
    print("MESSAGE", str(error).splitlines()[0])
"""


@needs_cxx
def test_an_extension_built_by_a_static_runtime_compiler_keeps_its_messages(tmp_path):
    """End to end: an extension built (by torch's cpp_extension, as the JIT build is) with a compiler
    that links libstdc++ statically, given link_flags, names the process's shared runtime and
    formats numbers in a check's message (without the flags, this platform's static copy lost
    everything after the first number's place)."""
    source = tmp_path / "probe_ext.cpp"
    source.write_text(_MESSAGE_EXTENSION)
    build_dir = tmp_path / "build"
    build_dir.mkdir()
    env = dict(os.environ, CXX=_compiler(tmp_path, "static-c++", f'exec {_CXX} -static-libstdc++ "$@"'))
    proc = subprocess.run([sys.executable, "-c", _BUILD_AND_RAISE, str(source), str(build_dir)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if line.startswith(("NEEDED", "MESSAGE")))
    assert "libstdc++.so" in lines["NEEDED"]
    assert lines["MESSAGE"] == "bad value 5 of 2.5 here"
