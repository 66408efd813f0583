"""What every attention layer (TransformerConv, GATConv, GATv2Conv) owes its PyG counterpart beyond
the numbers of one call: autocast, graphs whose memory is rewritten between calls, hooks on and
swaps of the projections, and TorchScript giving the eager numbers."""

import pytest
import torch

import edgedot.nn
from utils import DEVICES, gen, raises_checked, rand_feat, rand_index, rel_error, requires_cuda

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
    with raises_checked(IndexError, match=r"edge_index\[0\]"):
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


# ------------------------------------------------------------------------------ hooks and swapped projections

# The projections each layer calls in PyG's forward (square input, edge_dim, residual / beta).
PROJECTIONS = {
    "transformer": ["lin_query", "lin_key", "lin_value", "lin_edge", "lin_skip", "lin_beta"],
    "gat": ["lin", "lin_edge", "res"],
    "gat_bipartite": ["lin_src", "lin_dst", "lin_edge", "res"],
    "gatv2": ["lin_l", "lin_r", "lin_edge", "res"],
}


class _Adapter(torch.nn.Module):
    """A LoRA-like wrapper: the wrapped projection plus a low-rank term (not a Linear)."""

    def __init__(self, base):
        super().__init__()
        self.base = base
        out_features, in_features = base.weight.shape
        g = gen(44)
        self.down = torch.nn.Parameter(torch.randn(2, in_features, generator=g, dtype=base.weight.dtype))
        self.up = torch.nn.Parameter(torch.randn(out_features, 2, generator=g, dtype=base.weight.dtype))

    def forward(self, x):
        return self.base(x) + x @ self.down.t() @ self.up.t()


def _scaled_output(module, inputs, output):
    return output * 1.5 + 0.25


def _scaled_input(module, inputs):
    return (inputs[0] * 0.5,)


def _subclassed(module):
    """The module turned into a subclass of its class whose forward scales and shifts."""
    cls = type(module)
    module.__class__ = type(f"Shifted{cls.__name__}", (cls,),
                            {"forward": lambda self, x: cls.forward(self, x) * 1.5 + 0.5})
    return module


MODIFICATIONS = {
    "forward_hook": lambda layer, name: getattr(layer, name).register_forward_hook(_scaled_output),
    "forward_pre_hook": lambda layer, name: getattr(layer, name).register_forward_pre_hook(_scaled_input),
    "adapter": lambda layer, name: setattr(layer, name, _Adapter(getattr(layer, name))),
    "subclass": lambda layer, name: _subclassed(getattr(layer, name)),
}


def _hook_case(kind):
    g = gen(45)
    bipartite = kind == "gat_bipartite"
    layer_kind = "gat" if bipartite else kind
    options = dict(heads=2, edge_dim=3, **({"beta": True} if kind == "transformer" else {"residual": True}))
    theirs, ours = _pair(layer_kind, (6, 5) if bipartite else 6, 4, **options)
    x_src = rand_feat((10, 6), torch.float64, g=g)
    x = (x_src, rand_feat((8, 5), torch.float64, g=g)) if bipartite else x_src
    edge_index = _edges(10, 8 if bipartite else 10, 30, "cpu", g)
    edge_attr = rand_feat((30, 3), torch.float64, g=g)
    return theirs, ours, x, edge_index, edge_attr


@pytest.mark.parametrize("how", list(MODIFICATIONS))
@pytest.mark.parametrize("kind,name", [(kind, name) for kind, names in PROJECTIONS.items() for name in names])
def test_projection_hooks_and_swaps_are_honoured(kind, name, how):
    """A hook on a projection, or a projection swapped for an adapter or a subclass, changes the
    output exactly as it changes PyG's: the fused weight concatenations and foldings apply only
    to plain, unhooked Linear layers."""
    theirs, ours, x, edge_index, edge_attr = _hook_case(kind)
    before = ours(x, edge_index, edge_attr)
    for layer in (ours, theirs):
        MODIFICATIONS[how](layer, name)
    out, out_p = ours(x, edge_index, edge_attr), theirs(x, edge_index, edge_attr)
    assert rel_error(out_p, before) > 1e-3  # the modification matters
    assert rel_error(out, out_p) <= TOL, f"{rel_error(out, out_p):.2e}"


@pytest.mark.parametrize("kind", list(PROJECTIONS))
def test_global_module_hooks_are_honoured(kind):
    """Global forward hooks (``register_module_forward_hook``) see every projection PyG's layer
    calls, and their modifications count."""
    theirs, ours, x, edge_index, edge_attr = _hook_case(kind)
    seen = []

    def hook(module, inputs, output):
        if isinstance(module, (torch.nn.Linear, pyg_nn.Linear)):
            seen.append(module)
            return output * 1.25

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        out_p = theirs(x, edge_index, edge_attr)
        names_p = sorted(n for n, m in theirs.named_modules() for s in seen if s is m)
        seen.clear()
        out = ours(x, edge_index, edge_attr)
        names = sorted(n for n, m in ours.named_modules() for s in seen if s is m)
    finally:
        handle.remove()
    assert names == names_p
    assert rel_error(out, out_p) <= TOL, f"{rel_error(out, out_p):.2e}"


def _refused(*args):
    raise AssertionError("the projection was called: its weights were expected to be used directly")


@pytest.mark.parametrize("kind,names", [("transformer", ["lin_query", "lin_key", "lin_value"]), ("gat", ["lin_edge"]),
                                        ("gatv2", ["lin_l", "lin_r"])])
def test_plain_projections_are_used_by_their_weights(kind, names):
    """Plain, unhooked Linear projections still take the fused GEMM / the folded edge term."""
    theirs, ours, x, edge_index, edge_attr = _hook_case(kind)
    for name in names:
        getattr(ours, name).forward = _refused  # an instance attribute: no hook, the class unchanged
    assert rel_error(ours(x, edge_index, edge_attr), theirs(x, edge_index, edge_attr)) <= TOL


# ------------------------------------------------------------------------------ TorchScript agrees with eager

from typing import Optional, Tuple  # noqa: E402

from torch import Tensor  # noqa: E402


class _Square(torch.nn.Module):
    def __init__(self, conv):
        super().__init__()
        self.conv = conv

    def forward(self, x: Tensor, edge_index: Tensor, edge_attr: Optional[Tensor]) -> Tensor:
        return self.conv(x, edge_index, edge_attr)


class _Pair(torch.nn.Module):
    def __init__(self, conv):
        super().__init__()
        self.conv = conv

    def forward(self, x_src: Tensor, x_dst: Tensor, edge_index: Tensor, edge_attr: Optional[Tensor]) -> Tensor:
        return self.conv((x_src, x_dst), edge_index, edge_attr)


class _Weights(torch.nn.Module):
    def __init__(self, conv):
        super().__init__()
        self.conv = conv

    def forward(self, x: Tensor, edge_index: Tensor, edge_attr: Optional[Tensor]
                ) -> Tuple[Tensor, Tuple[Tensor, Tensor]]:
        return self.conv(x, edge_index, edge_attr, return_attention_weights=True)


class _SourceOnly(torch.nn.Module):
    """GATConv's ``(x_src, None)`` with ``size`` (PyG's test_gat_conv compares this one)."""

    def __init__(self, conv):
        super().__init__()
        self.conv = conv

    def forward(self, x_src: Tensor, edge_index: Tensor, size: Tuple[int, int]) -> Tensor:
        return self.conv((x_src, None), edge_index, size=size)


SCRIPTED_CASES = [(kind, holder, edge_dim) for kind in LAYERS for holder in ("square", "pair", "weights")
                  for edge_dim in (None, 3)] + [("gat", "source_only", None)]


@pytest.mark.cpu_only
@pytest.mark.parametrize("kind,holder,edge_dim", SCRIPTED_CASES, ids=lambda v: str(v))
def test_scripted_matches_eager_bitwise(kind, holder, edge_dim):
    """A scripted module runs the op the eager module runs: outputs (and attention weights)
    equal bit for bit, on 50 graphs (PyG's own tests compare them with allclose's default
    tolerance, which rounding differences exceed now and then)."""
    torch.manual_seed(0)
    options = dict(heads=2, edge_dim=edge_dim)
    if kind != "transformer":
        options.update(residual=True, fill_value="mean")
    bipartite = holder in ("pair", "source_only")
    in_channels = (8, 16) if bipartite and kind == "gat" else (8, 8) if bipartite else 8
    conv = LAYERS[kind][0](in_channels, 32, **options).eval()
    module = {"square": _Square, "pair": _Pair, "weights": _Weights, "source_only": _SourceOnly}[holder](conv)
    scripted = torch.jit.script(module)
    for seed in range(50):
        g = gen(seed)
        num_src, num_dst = (4, 2) if holder == "source_only" else (6, 5) if bipartite else (6, 6)
        x_src = torch.randn(num_src, 8, generator=g)
        x_dst = torch.randn(num_dst, in_channels[1] if bipartite else 8, generator=g)
        edge_index = _edges(num_src, num_dst, 12, "cpu", g)
        edge_attr = torch.randn(12, edge_dim, generator=g) if edge_dim else None
        args = {"square": (x_src, edge_index, edge_attr), "weights": (x_src, edge_index, edge_attr),
                "pair": (x_src, x_dst, edge_index, edge_attr),
                "source_only": (x_src, edge_index, (num_src, num_dst))}[holder]
        eager, script = module(*args), scripted(*args)
        if holder == "weights":
            (eager, (ei, alpha)), (script, (ei_s, alpha_s)) = eager, script
            assert torch.equal(ei, ei_s) and torch.equal(alpha, alpha_s), seed
        assert torch.equal(eager, script), f"seed {seed}: {(eager - script).abs().max():.2e}"


def test_scripted_transformer_takes_a_sparse_adjacency():
    """Under TorchScript a torch.sparse CSR adjacency (no [2, E] rows to read) takes PyG's path
    and gives the eager numbers to rounding."""
    from torch_geometric.utils import to_torch_csc_tensor

    torch.manual_seed(0)
    module = _Square(edgedot.nn.TransformerConv(8, 4, heads=2))
    scripted = torch.jit.script(module)
    g = gen(46)
    x = torch.randn(6, 8, generator=g)
    adj = to_torch_csc_tensor(_distinct_edges(6, 6, 15, seed=1), size=(6, 6)).t()
    torch.testing.assert_close(scripted(x, adj, None), module(x, adj, None))


# ------------------------------------------------------------------------------ EdgeIndex claims


@pytest.mark.parametrize("flow", ["source_to_target", "target_to_source"])
@pytest.mark.parametrize("kind", list(LAYERS))
@pytest.mark.parametrize("device", DEVICES)
def test_edge_index_false_sort_claim(device, kind, flow):
    """An EdgeIndex that claims to be sorted by destination but is not is refused with an error
    naming edge_index, on every device (the kernels would walk its pointer); a true claim gives
    PyG's numbers."""
    from torch_geometric import EdgeIndex

    options = dict(heads=2, flow=flow, **({} if kind == "transformer" else dict(add_self_loops=False)))
    theirs, ours = _pair(kind, 6, 4, device, **options)
    x = rand_feat((10, 6), torch.float64, device, gen(47))
    edge_index = _distinct_edges(10, 10, 30, seed=3).to(device)
    dst_row, order = (1, "col") if flow == "source_to_target" else (0, "row")
    by_dst = edge_index[:, edge_index[dst_row].argsort(stable=True)]
    true_claim = EdgeIndex(by_dst, sparse_size=(10, 10), sort_order=order)
    assert rel_error(ours(x, true_claim), theirs(x, by_dst)) <= TOL
    unsorted = by_dst[:, torch.randperm(30, generator=gen(3)).to(device)]
    false_claim = EdgeIndex(unsorted, sparse_size=(10, 10), sort_order=order)
    with raises_checked(ValueError, match=f"edge_index .*sort_order='{order}'"):
        ours(x, false_claim)
