"""PyG's own tests of TransformerConv, GATConv, GATv2Conv and AGNNConv (and its explain tests that
build one), and of the auto-encoders (InnerProductDecoder), unchanged, run against edgedot's classes:
see tests/pyg/README.md for where the files come from."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch_geometric")

PYG_DIR = pathlib.Path(__file__).parent / "pyg"
UPSTREAM = pathlib.Path(os.environ.get("EDGEDOT_PYG_TESTS", PYG_DIR / "upstream"))
CONV_TEST = "test/nn/conv/test_transformer_conv.py"
CONV_TESTS = [CONV_TEST, "test/nn/conv/test_gat_conv.py", "test/nn/conv/test_gatv2_conv.py",
              "test/nn/conv/test_agnn_conv.py"]
DECODER_TEST = "test/nn/models/test_autoencoder.py"
SWAPPED_LAYERS = ("TransformerConv", "GATConv", "GATv2Conv", "AGNNConv")


def _test_files():
    """PyG's tests of the swapped layers and the auto-encoders, and every explain test file that
    builds one of the layers."""
    explain = sorted(p for p in (UPSTREAM / "test" / "explain").rglob("test_*.py")
                     if any(name in p.read_text() for name in SWAPPED_LAYERS))
    return [UPSTREAM / name for name in CONV_TESTS] + [UPSTREAM / DECODER_TEST] + explain


@pytest.mark.parametrize("full_test", ["0", "1"], ids=["FULL_TEST=0", "FULL_TEST=1"])
def test_pyg_tests_pass_with_edgedot_layer(full_test):
    if not (UPSTREAM / CONV_TEST).is_file():
        pytest.skip(f"PyG's test files are not under {UPSTREAM} (tests/pyg/README.md says where to get them)")
    assert (UPSTREAM / "LICENSE").is_file(), "PyG's licence must accompany its test files"
    files = _test_files()
    missing = [str(f) for f in files if not f.is_file()]
    assert not missing, f"missing PyG test files: {missing}"
    assert len(files) > len(CONV_TESTS) + 1, "no explain test of PyG builds a swapped layer: wrong files?"
    root = pathlib.Path(__file__).parent.parent
    env = dict(os.environ, FULL_TEST=full_test,
               PYTHONPATH=os.pathsep.join([str(root), str(PYG_DIR), os.environ.get("PYTHONPATH", "")]))
    # Their own session: PyG's conftests only (confcutdir), edgedot's classes swapped in first.
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "swap_plugin", "-p", "no:cacheprovider", "-W", "ignore",
         f"--rootdir={UPSTREAM}", f"--confcutdir={UPSTREAM}", *map(str, files)],
        cwd=UPSTREAM, env=env, capture_output=True, text=True, timeout=900)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert re.search(r"\d+ passed", summary) and not re.search(r"failed|error", summary), summary


def test_swap_plugin_puts_edgedot_layers_in_pyg(tmp_path):
    """The plugin itself, on a test file of the form PyG's take: names imported from PyG's
    namespaces at module level are edgedot's classes, and so is what PyG's own code builds."""
    (tmp_path / "test_names.py").write_text(
        "import edgedot.nn\n"
        "from torch_geometric.nn import GAE, AGNNConv, GATConv, GATv2Conv, InnerProductDecoder, TransformerConv\n"
        "from torch_geometric.nn.conv.gat_conv import GATConv as Defined\n\n"
        "def test_names():\n"
        "    assert GATConv is edgedot.nn.GATConv and Defined is edgedot.nn.GATConv\n"
        "    assert GATv2Conv is edgedot.nn.GATv2Conv and TransformerConv is edgedot.nn.TransformerConv\n"
        "    assert InnerProductDecoder is edgedot.nn.InnerProductDecoder and AGNNConv is edgedot.nn.AGNNConv\n"
        "    assert type(GAE(GATConv(4, 4)).decoder) is edgedot.nn.InnerProductDecoder\n")
    root = pathlib.Path(__file__).parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(PYG_DIR), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "swap_plugin", "-p", "no:cacheprovider",
                             f"--rootdir={tmp_path}", f"--confcutdir={tmp_path}", str(tmp_path / "test_names.py")],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
