"""The documentation against the code: relative links resolve, and docs/api.md documents each
public callable with its real parameters (names, order, defaults), the layers included."""

import ast
import inspect
import re
from pathlib import Path

import pytest

import edgedot
import edgedot.distributed

REPO = Path(__file__).resolve().parent.parent
DOCS = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]
API = (REPO / "docs" / "api.md").read_text()
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: path.name)
def test_relative_links_resolve(doc):
    """Relative to the file that holds them, as GitHub and other renderers read them."""
    broken = [link for link in LINK.findall(doc.read_text())
              if "://" not in link and not link.startswith("mailto:") and not (doc.parent / link).exists()]
    assert not broken, f"{doc.relative_to(REPO)}: {broken}"


def _documented(name):
    """The parameters of ``edgedot.<name>(...)`` as docs/api.md writes them at the head of its
    entry (a list item): (name, kind,
    default) triples, the default as a Python value."""
    match = re.search(rf"^- `edgedot\.{re.escape(name)}\((.*?)\)`", API, re.M)
    assert match, f"docs/api.md does not document edgedot.{name}(...)"
    args = ast.parse(f"def f({match.group(1)}): pass").body[0].args
    params = []
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    for arg, default in zip(positional, defaults):
        params.append((arg.arg, "positional", None if default is None else ast.literal_eval(default)))
    for arg, default in zip(args.kwonlyargs, args.kw_defaults):
        params.append((arg.arg, "keyword", None if default is None else ast.literal_eval(default)))
    if args.kwarg:
        params.append((args.kwarg.arg, "var_keyword", None))
    return params


def _actual(obj):
    kinds = {inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional", inspect.Parameter.POSITIONAL_ONLY: "positional",
             inspect.Parameter.KEYWORD_ONLY: "keyword", inspect.Parameter.VAR_KEYWORD: "var_keyword"}
    return [(p.name, kinds[p.kind], None if p.default is inspect.Parameter.empty else p.default)
            for p in inspect.signature(obj).parameters.values()]


@pytest.mark.parametrize("name", ["edge_dot", "graph_attention", "gat_attention", "gatv2_attention", "index_to_ptr",
                                  "EdgePlan", "nn.TransformerConv", "nn.GATConv", "nn.GATv2Conv",
                                  "distributed.ShardedEdgeDot"])
def test_api_signatures(name):
    obj = edgedot
    for part in name.split("."):
        obj = getattr(obj, part)
    assert _documented(name) == _actual(obj)


@pytest.mark.parametrize("name", ["GATConv", "GATv2Conv"])
def test_api_documents_the_gat_layers_forward(name):
    pytest.importorskip("torch_geometric")  # the documented forward is the one with PyG installed
    layer = getattr(edgedot.nn, name)
    params = [p for p in inspect.signature(layer.forward).parameters.values() if p.name != "self"]
    signature = ", ".join(p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}"
                          for p in params)
    assert f"`forward({signature})`" in API, signature
    for parameter in ("lin_src", "att_src", "lin_edge", "res", "bias") if name == "GATConv" else ("lin_l", "lin_r", "att"):
        assert f"`{parameter}`" in API, parameter


def test_readme_and_install_agree_on_the_gpu_wheel_check():
    """README.md offers the prebuilt CUDA wheel; what it says of that wheel's check on a GPU
    (built, installed without nvcc, CUDA tests run) is what docs/install.md's table of versions
    tested records."""
    install = (REPO / "docs" / "install.md").read_text()
    readme = (REPO / "README.md").read_text()
    (row,) = [line for line in install.splitlines()
              if line.startswith("| CUDA wheel built, installed without nvcc")]
    result = row.strip(" |").split("|")[-1].strip()
    setup = readme[readme.index("## Set-up"):readme.index("## Usage")]
    assert "wheel" in setup
    status = result.split(" (")[0]  # e.g. "not yet run", or the tests' count
    assert status in setup, (status, setup)
