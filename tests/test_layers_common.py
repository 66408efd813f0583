"""What every attention layer (TransformerConv, GATConv, GATv2Conv) owes its PyG counterpart beyond
the numbers of one call: autocast, graphs whose memory is rewritten between calls, hooks on and
swaps of the projections, and TorchScript giving the eager numbers."""

import pytest
import torch

import edgedot.nn
from utils import DEVICES, gen, rand_feat, rand_index, rel_error, requires_cuda

pytest.importorskip("torch_geometric")
import torch_geometric.nn as pyg_nn  # noqa: E402

LAYERS = {
    "transformer": (edgedot.nn.TransformerConv, pyg_nn.TransformerConv),
    "gat": (edgedot.nn.GATConv, pyg_nn.GATConv),
    "gatv2": (edgedot.nn.GATv2Conv, pyg_nn.GATv2Conv),
}
GAT_LAYERS = ["gat", "gatv2"]


def _pair(kind, in_channels, out_channels, device="cpu", dtype=torch.float64, **options):
    """PyG's layer and ours with the same parameters (PyG's state dict loaded into ours)."""
    ours_cls, theirs_cls = LAYERS[kind]
    torch.manual_seed(0)
    theirs = theirs_cls(in_channels, out_channels, **options).to(device, dtype)
    ours = ours_cls(in_channels, out_channels, **options).to(device, dtype)
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


def _edges(num_src, num_dst, num_edges, device, g):
    """Random edges with a self-loop and a duplicate."""
    edge_index = torch.stack([rand_index(num_src, num_edges, torch.int64, device, g),
                              rand_index(num_dst, num_edges, torch.int64, device, g)])
    edge_index[:, 0] = 1
    edge_index[:, 1] = edge_index[:, 2]
    return edge_index


# ------------------------------------------------------------------------------ autocast


def _autocast_case(kind, device, dtype, edge_dim):
    g = gen(40)
    options = dict(heads=2, edge_dim=edge_dim)
    if kind != "transformer":
        options["residual"] = True
    theirs, ours = _pair(kind, 16, 8, device, torch.float32, **options)
    x = rand_feat((30, 16), torch.float32, device, g)
    edge_index = _edges(30, 30, 120, device, g)
    edge_attr = rand_feat((120, edge_dim), torch.float32, device, g) if edge_dim else None
    with torch.autocast(torch.device(device).type, dtype=dtype):
        out = ours(x, edge_index, edge_attr)
        out_p = theirs(x, edge_index, edge_attr)
    assert out.dtype == out_p.dtype, (out.dtype, out_p.dtype)
    # Both compute their projections in the autocast dtype: bf16's rounding (2**-8) sets the bar.
    reference = theirs(x, edge_index, edge_attr)  # float32, autocast off
    err, err_p = rel_error(out, reference), rel_error(out_p, reference)
    assert err <= max(2 * err_p, 1e-2), (err, err_p)
    assert rel_error(out, out_p) <= 1e-2
    # Gradients flow to every parameter as in PyG's layer.
    with torch.autocast(torch.device(device).type, dtype=dtype):
        loss = ours(x, edge_index, edge_attr).float().square().sum()
    grads = torch.autograd.grad(loss, [p for p in ours.parameters()], allow_unused=True)
    assert all(grad is not None and torch.isfinite(grad).all() for grad in grads)


@pytest.mark.parametrize("edge_dim", [None, 3], ids=["noedge", "edge"])
@pytest.mark.parametrize("kind", list(LAYERS))
def test_autocast_cpu_matches_pyg(kind, edge_dim):
    """Under CPU autocast (bfloat16) every layer runs, with PyG's output dtype (float32 for the
    GAT layers, whose attention vectors stay float32) and PyG's numbers to bf16 rounding."""
    _autocast_case(kind, "cpu", torch.bfloat16, edge_dim)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("edge_dim", [None, 3], ids=["noedge", "edge"])
@pytest.mark.parametrize("kind", list(LAYERS))
def test_autocast_cuda_matches_pyg(kind, edge_dim, dtype):
    _autocast_case(kind, "cuda", dtype, edge_dim)
