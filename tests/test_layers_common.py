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


# ------------------------------------------------------------------------------ graphs rewritten in place

TOL = 1e-10


def _distinct_edges(num_src, num_dst, num_edges, seed):
    """``num_edges`` distinct edges (a sparse adjacency keeps their count), self-loops among them."""
    g = gen(seed)
    flat = torch.randperm(num_src * num_dst, generator=g)[:num_edges]
    return torch.stack([flat // num_dst, flat % num_dst])


def _layer_options(kind, edge_dim):
    options = dict(heads=2, edge_dim=edge_dim)
    if kind != "transformer":
        options["fill_value"] = "mean"
    return options


def _assert_matches_pyg(ours, theirs, x, edge_index, edge_attr, what):
    out, (ei, alpha) = ours(x, edge_index, edge_attr, return_attention_weights=True)
    out_p, (ei_p, alpha_p) = theirs(x, edge_index, edge_attr, return_attention_weights=True)
    assert rel_error(out, out_p) <= TOL, f"{what}: out off by {rel_error(out, out_p):.2e}"
    if ei_p.layout == torch.strided:
        assert torch.equal(ei, ei_p), what
    assert rel_error(alpha, alpha_p) <= TOL, what
    assert rel_error(ours(x, edge_index, edge_attr), out_p) <= TOL, what


@pytest.mark.parametrize("edge_dim", [None, 3], ids=["noedge", "edge"])
@pytest.mark.parametrize("kind", list(LAYERS))
def test_numpy_buffer_refilled_between_calls(kind, edge_dim):
    """A loader that wraps one numpy buffer with torch.from_numpy and refills it in place (no
    version bump): every call sees the graph the buffer holds now, as PyG's layer does."""
    np = pytest.importorskip("numpy")
    theirs, ours = _pair(kind, 6, 4, **_layer_options(kind, edge_dim))
    x = rand_feat((12, 6), torch.float64, g=gen(41))
    buffer = np.zeros((2, 50), dtype=np.int64)
    edge_index = torch.from_numpy(buffer)
    for step in range(4):
        buffer[...] = _distinct_edges(12, 12, 50, seed=step).numpy()
        edge_attr = rand_feat((50, edge_dim), torch.float64, g=gen(step)) if edge_dim else None
        _assert_matches_pyg(ours, theirs, x, edge_index, edge_attr, f"step {step}")
    assert edge_index._version == 0  # the writes were invisible to PyTorch
    buffer[0, 7] = 12  # out of range: refused, naming the argument
    with pytest.raises(IndexError, match=r"edge_index\[0\]"):
        ours(x, edge_index, edge_attr)


@pytest.mark.parametrize("edge_dim", [None, 3], ids=["noedge", "edge"])
@pytest.mark.parametrize("kind", list(LAYERS))
@pytest.mark.parametrize("device", DEVICES)
def test_writes_through_data_between_calls(device, kind, edge_dim):
    """Writes through ``.data`` (which shares the memory but not the version counter) between
    calls: every call sees the graph the tensor holds now, bipartite graphs included."""
    theirs, ours = _pair(kind, (6, 5), 4, device, **_layer_options(kind, edge_dim))
    g = gen(42)
    x = (rand_feat((12, 6), torch.float64, device, g), rand_feat((9, 5), torch.float64, device, g))
    edge_index = _distinct_edges(12, 9, 40, seed=0).to(device)
    for step in range(4):
        edge_index.data.copy_(_distinct_edges(12, 9, 40, seed=step).to(device))
        edge_attr = rand_feat((40, edge_dim), torch.float64, device, gen(step)) if edge_dim else None
        _assert_matches_pyg(ours, theirs, x, edge_index, edge_attr, f"step {step}")
    assert edge_index._version == 0


@pytest.mark.parametrize("kind", list(LAYERS))
@pytest.mark.parametrize("device", DEVICES)
def test_sparse_adjacency_rewritten_through_data(device, kind):
    """A torch.sparse CSR adjacency whose index tensors are rewritten through ``.data``: every
    call reads the adjacency as it is now."""
    from torch_geometric.utils import to_torch_csc_tensor

    theirs, ours = _pair(kind, 6, 4, device, heads=2, **({} if kind == "transformer" else dict(add_self_loops=False)))
    x = rand_feat((10, 6), torch.float64, device, gen(43))
    adj = to_torch_csc_tensor(_distinct_edges(10, 10, 30, seed=0).to(device), size=(10, 10)).t()  # CSR [dst, src]
    assert adj.layout == torch.sparse_csr
    for step in range(4):
        new = to_torch_csc_tensor(_distinct_edges(10, 10, 30, seed=step).to(device), size=(10, 10)).t()
        adj.crow_indices().data.copy_(new.crow_indices())
        adj.col_indices().data.copy_(new.col_indices())
        out, out_p = ours(x, adj), theirs(x, adj)
        assert rel_error(out, out_p) <= TOL, f"step {step}: {rel_error(out, out_p):.2e}"
