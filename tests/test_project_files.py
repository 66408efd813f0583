"""The project's licence and citation files, and the package metadata that names them."""

import datetime
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

import edgedot

REPO = Path(__file__).resolve().parent.parent

# The keys of a CITATION.cff file, Citation File Format 1.2.0 (its schema's top-level properties).
CFF_KEYS = {"abstract", "authors", "cff-version", "commit", "contact", "date-released", "doi", "identifiers",
            "keywords", "license", "license-url", "message", "preferred-citation", "references", "repository",
            "repository-artifact", "repository-code", "title", "type", "url", "version"}
CFF_REQUIRED = {"authors", "cff-version", "message", "title"}


def test_license_is_mit():
    text = (REPO / "LICENSE").read_text()
    assert text.startswith("MIT License\n")
    assert "Copyright (c) 2026 edgedot contributors" in text
    for phrase in ("Permission is hereby granted, free of charge, to any person obtaining a copy",
                   "The above copyright notice and this permission notice shall be included in all",
                   'THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND'):
        assert phrase in " ".join(text.split()), phrase


def _project():
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def test_pyproject_license_and_description():
    project = _project()
    assert project["license"] in ("MIT", {"text": "MIT"})
    description = project["description"]
    for topic in ("dot product", "attention", "GAT", "GATv2", "PyG"):
        assert topic in description, topic


def test_citation_file():
    yaml = pytest.importorskip("yaml")
    cff = yaml.safe_load((REPO / "CITATION.cff").read_text())
    assert set(cff) <= CFF_KEYS, set(cff) - CFF_KEYS
    assert CFF_REQUIRED <= set(cff), CFF_REQUIRED - set(cff)
    assert cff["cff-version"] == "1.2.0"
    assert cff["type"] == "software"
    assert cff["license"] == _project()["license"] == "MIT"
    assert str(cff["version"]) == edgedot.__version__
    assert cff["date-released"] == datetime.date(2026, 12, 2)
    assert cff["title"].startswith("edgedot") and isinstance(cff["message"], str) and cff["message"]
    assert cff["authors"] == [{"name": "edgedot contributors"}]


def test_wheel_metadata_names_the_license(tmp_path):
    """The pure-Python wheel, built as ``pip wheel`` builds it: its metadata says MIT and it
    carries the LICENSE file."""
    pytest.importorskip("pip")
    # Asked of a fresh interpreter: importing setuptools here, after the stdlib's distutils was
    # imported by torch, trips setuptools' distutils shim.
    probe = ("import importlib.util, setuptools; print(setuptools.__version__, "
             "importlib.util.find_spec('setuptools.command.bdist_wheel') is not None "
             "or importlib.util.find_spec('wheel') is not None)")
    version, can_build = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                                        check=True).stdout.split()
    if can_build != "True":
        pytest.skip("building a wheel needs setuptools>=70.1 or the wheel package")
    if int(version.split(".")[0]) < 77:
        pytest.skip(f"license = \"MIT\" (PEP 639) needs setuptools>=77, not {version}")
    tree = tmp_path / "tree"
    tree.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy(REPO / name, tree / name)
    shutil.copytree(REPO / "edgedot", tree / "edgedot",
                    ignore=shutil.ignore_patterns("__pycache__", "_C*.so", "_build_info.py"))
    env = {k: v for k, v in os.environ.items() if k != "EDGEDOT_BUILD_CUDA"}
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path / "dist"), str(tree)], cwd=tree, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = (tmp_path / "dist").glob("edgedot-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (metadata,) = [name for name in names if name.endswith(".dist-info/METADATA")]
        headers = archive.read(metadata).decode().split("\n\n", 1)[0].splitlines()
        licenses = [name for name in names if name.endswith("/LICENSE") and ".dist-info/" in name]
        assert licenses, names
        assert archive.read(licenses[0]).decode() == (REPO / "LICENSE").read_text()
    assert "License-Expression: MIT" in headers or "License: MIT" in headers, headers
    summary = next(line for line in headers if line.startswith("Summary: "))
    assert "attention" in summary and "GAT" in summary, summary
