"""The differential fuzzes (scripts/op_fuzz.py, scripts/layer_fuzz.py) on a few hundred seeds of
each kind, on every device present: every op agrees with its float64 reference, every PyG drop-in
with PyG's layer, but for the differences their docstrings name. The scripts run thousands of
seeds by hand; here they are kept from rotting."""

import importlib.util
import pathlib
import warnings

import pytest
import torch

SCRIPTS = pathlib.Path(__file__).parent.parent / "scripts"
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _load(name):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_ops_match_their_references(device, dtype):
    op_fuzz = _load("op_fuzz")
    failures = []
    for seed in range(300):
        kind, detail = op_fuzz.run(seed, device, dtype)
        if kind not in ("ok", "cancelling gradient (known)"):
            failures.append(f"{kind} {detail}")
    assert not failures, "\n".join(failures[:5])


@pytest.mark.parametrize("device", DEVICES)
def test_layers_match_pyg(device):
    pytest.importorskip("torch_geometric")
    layer_fuzz = _load("layer_fuzz")
    failures, kinds = [], set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for seed in range(300):
            kind, detail = layer_fuzz.run(seed, device)
            kinds.add(kind)
            if kind not in ("ok", "both raise", "PyG refuses the options", "PyG reads out of range (known)"):
                failures.append(f"{kind} {detail}")
    assert not failures, "\n".join(failures[:5])
    assert "ok" in kinds
