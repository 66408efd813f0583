"""edgedot.nn.GATConv and GATv2Conv against PyG's GATConv and GATv2Conv themselves."""

import itertools
import subprocess
import sys
import tempfile
import types

import pytest
import torch

import edgedot
import edgedot.nn
from edgedot.ops.attention import dropout_keep, next_dropout_state
from utils import (DEVICES, assert_grads_close, close_or_zero, dtype_id, gen, raises_checked, rand_feat, rand_index,
                   rel_error)

pytest.importorskip("torch_geometric")
import torch_geometric.nn.conv.gat_conv as pyg_gat  # noqa: E402
import torch_geometric.nn.conv.gatv2_conv as pyg_gatv2  # noqa: E402
from torch import Tensor  # noqa: E402
from torch_geometric import EdgeIndex  # noqa: E402
from torch_geometric.nn import MessagePassing  # noqa: E402
from test_pyg_integration import (_forms, _simple_graph, check_gnn_explainer_edge_mask,  # noqa: E402
                                  check_to_hetero_matches_pyg)

LAYERS = {"gat": (edgedot.nn.GATConv, pyg_gat.GATConv), "gatv2": (edgedot.nn.GATv2Conv, pyg_gatv2.GATv2Conv)}
PYG_MODULES = {"gat": pyg_gat, "gatv2": pyg_gatv2}
TOL = 1e-10

# (kind, heads, concat, add_self_loops, edge (None, or edge_dim 4 with that fill_value), bias, residual,
#  share_weights (GATv2 only))
EDGE = [None, "mean", 0.5]
HEADS = [(1, True), (3, True), (3, False)]  # (heads, concat): one head's mean is its concatenation
OPTIONS = [("gat", h, c, *o, False) for (h, c), *o in itertools.product(HEADS, [True, False], EDGE, [True, False],
                                                                       [False, True])]
OPTIONS += [("gatv2", h, c, *o) for (h, c), *o in itertools.product(HEADS, [True, False], EDGE, [True, False],
                                                                   [False, True], [False, True])]


def _option_id(options):
    kind, heads, concat, loops, edge, bias, residual, share = options
    return "-".join([kind, f"h{heads}", "concat" if concat else "mean", "loops" if loops else "noloops",
                     "noedge" if edge is None else f"edge_{edge}", "bias" if bias else "nobias",
                     "res" if residual else "nores"] + (["shared"] if share else []))


def _kwargs(options):
    kind, heads, concat, loops, edge, bias, residual, share = options
    kwargs = dict(heads=heads, concat=concat, add_self_loops=loops, bias=bias, residual=residual)
    if edge is not None:
        kwargs.update(edge_dim=4, fill_value=edge)
    if share:
        kwargs["share_weights"] = True
    return kwargs


def _pair(kind, in_channels, out_channels, device="cpu", dtype=torch.float64, **options):
    """PyG's layer and ours with the same parameters (PyG's state dict loaded into ours)."""
    ours_cls, theirs_cls = LAYERS[kind]
    torch.manual_seed(0)
    theirs = theirs_cls(in_channels, out_channels, **options).to(device, dtype)
    ours = ours_cls(in_channels, out_channels, **options).to(device, dtype)
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


def _graph(num_src, num_dst, num_edges, device, g, index_dtype=torch.int64):
    """Random edges with a duplicate, self-loops, a hub and a destination without edges."""
    edge_index = torch.stack([rand_index(num_src, num_edges, index_dtype, device, g),
                              rand_index(num_dst - 1, num_edges, index_dtype, device, g)])
    edge_index[:, :2] = torch.tensor([[0, 0], [1, 1]])
    edge_index[:, 2] = 2
    edge_index[:, 3] = 1
    edge_index[1, 4:4 + num_edges // 4] = 0
    return edge_index


def _run(layer, x, edge_index, edge_attr, want_alpha=True, grad_seed=1, **kwargs):
    """Output, attention weights (or None) and gradients of every parameter and input."""
    if want_alpha:
        out, (ei, alpha) = layer(x, edge_index, edge_attr, return_attention_weights=True, **kwargs)
    else:
        out, ei, alpha = layer(x, edge_index, edge_attr, **kwargs), None, None
    params = dict(layer.named_parameters())
    inputs = [t for t in (x if isinstance(x, tuple) else (x,)) if t is not None and t.requires_grad]
    if edge_attr is not None and edge_attr.requires_grad:
        inputs.append(edge_attr)
    grad_out = rand_feat(out.shape, out.dtype, out.device, gen(grad_seed))
    grads = torch.autograd.grad(out, list(params.values()) + inputs, grad_out, allow_unused=True)
    return out, ei, alpha, dict(zip(list(params) + [f"input{i}" for i in range(len(inputs))], grads))


def _assert_same(ours, theirs, tol=TOL):
    out, ei, alpha, grads = ours
    out_p, ei_p, alpha_p, grads_p = theirs
    assert out.shape == out_p.shape
    assert rel_error(out, out_p) <= tol, f"out {rel_error(out, out_p):.2e}"
    if alpha_p is not None:
        assert torch.equal(ei, ei_p)
        assert alpha.shape == alpha_p.shape
        assert close_or_zero(alpha, alpha_p, tol)[0], "alpha"
    assert_grads_close(grads, grads_p, tol)


@pytest.mark.parametrize("bipartite", [False, True], ids=["square", "bipartite"])
@pytest.mark.parametrize("options", OPTIONS, ids=_option_id)
@pytest.mark.parametrize("device", DEVICES)
def test_matches_pyg(device, options, bipartite):
    """float64 outputs, attention weights and gradients (every parameter and input) match PyG's
    on every option combination."""
    kind = options[0]
    kwargs = _kwargs(options)
    g = gen(2)
    dst_width = 5 if kwargs.get("share_weights") else 6  # one projection for both sides needs one width
    in_channels = (5, dst_width) if bipartite else 5
    theirs, ours = _pair(kind, in_channels, 7, device, **kwargs)
    num_src, num_dst = (10, 8) if bipartite else (10, 10)
    x_src = rand_feat((num_src, 5), torch.float64, device, g, requires_grad=True)
    x = (x_src, rand_feat((num_dst, dst_width), torch.float64, device, g, requires_grad=True)) if bipartite else x_src
    edge_index = _graph(num_src, num_dst, 40, device, g)
    edge_attr = rand_feat((40, 4), torch.float64, device, g, requires_grad=True) if "edge_dim" in kwargs else None
    _assert_same(_run(ours, x, edge_index, edge_attr), _run(theirs, x, edge_index, edge_attr))
    _assert_same(_run(ours, x, edge_index, edge_attr, want_alpha=False),
                 _run(theirs, x, edge_index, edge_attr, want_alpha=False))


@pytest.mark.parametrize("kind", LAYERS)
def test_state_dict_both_ways(kind):
    """PyG's state dict loads into ours and ours into PyG's (strictly), keys and values equal."""
    extra = dict(share_weights=True) if kind == "gatv2" else {}
    for options in (dict(heads=2, edge_dim=3, residual=True), dict(heads=4, concat=False, bias=False, **extra)):
        theirs, ours = _pair(kind, (4, 6), 5, **options)
        assert ours.state_dict().keys() == theirs.state_dict().keys()
        for name, tensor in theirs.state_dict().items():
            assert torch.equal(ours.state_dict()[name], tensor), name
        ours.reset_parameters()
        fresh = LAYERS[kind][1]((4, 6), 5, **options).double()
        fresh.load_state_dict(ours.state_dict())
        for name, tensor in ours.state_dict().items():
            assert torch.equal(fresh.state_dict()[name], tensor), name


@pytest.mark.parametrize("options", [dict(), dict(heads=3, edge_dim=4, residual=True), dict(concat=False),
                                     dict(bias=False, residual=True)], ids=str)
@pytest.mark.parametrize("in_channels", [7, (5, 6)], ids=str)
@pytest.mark.parametrize("kind", LAYERS)
def test_initial_weights_match_pyg(kind, in_channels, options):
    """The same seed gives PyG's initial weights (and leaves the default generator where PyG's
    layer leaves it); reset_parameters draws as PyG's does."""
    ours_cls, theirs_cls = LAYERS[kind]
    if kind == "gatv2":
        options = dict(options, share_weights=isinstance(in_channels, int))
    torch.manual_seed(123)
    theirs = theirs_cls(in_channels, 8, **options)
    after_theirs = torch.rand(3)
    torch.manual_seed(123)
    ours = ours_cls(in_channels, 8, **options)
    assert torch.equal(torch.rand(3), after_theirs)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    for name, tensor in theirs.state_dict().items():
        assert torch.equal(ours.state_dict()[name], tensor), name
    torch.manual_seed(5)
    theirs.reset_parameters()
    torch.manual_seed(5)
    ours.reset_parameters()
    for name, tensor in theirs.state_dict().items():
        assert torch.equal(ours.state_dict()[name], tensor), name


@pytest.mark.parametrize("kind", LAYERS)
def test_repr_and_interface(kind):
    ours_cls, theirs_cls = LAYERS[kind]
    for args, kwargs in (((4, 5), dict(heads=2)), (((4, 6), 5), dict()), ((-1, 3), dict(heads=3, edge_dim=2))):
        ours = ours_cls(*args, **kwargs)
        assert repr(ours) == repr(theirs_cls(*args, **kwargs))
        assert isinstance(ours, MessagePassing)
        assert (ours.aggr, ours.node_dim) == (theirs_cls(*args, **kwargs).aggr, 0)
    layer = ours_cls(4, 5, heads=2, negative_slope=0.1, dropout=0.3, add_self_loops=False, fill_value=1.5)
    assert (layer.negative_slope, layer.dropout, layer.add_self_loops, layer.fill_value) == (0.1, 0.3, False, 1.5)


@pytest.mark.parametrize("kind", LAYERS)
def test_lazy_in_channels(kind):
    ours_cls, theirs_cls = LAYERS[kind]
    theirs, ours = theirs_cls(-1, 4, heads=2).double(), ours_cls(-1, 4, heads=2).double()
    g = gen(3)
    x = rand_feat((9, 6), torch.float64, g=g)
    edge_index = _graph(9, 9, 30, "cpu", g)
    theirs(x, edge_index)  # sizes PyG's layer
    ours.load_state_dict(theirs.state_dict())
    torch.testing.assert_close(ours(x, edge_index), theirs(x, edge_index), rtol=TOL, atol=TOL)


@pytest.mark.parametrize("kind", LAYERS)
def test_return_attention_weights_forms(kind):
    """True: (out, (edge_index with self-loops, alpha)); False and None: the output alone (as
    PyG's GAT layers, unlike TransformerConv)."""
    theirs, ours = _pair(kind, 5, 3, heads=2)
    g = gen(4)
    x, edge_index = rand_feat((10, 5), torch.float64, g=g), _graph(10, 10, 30, "cpu", g)
    out, (ei, alpha) = ours(x, edge_index, return_attention_weights=True)
    _, (ei_p, alpha_p) = theirs(x, edge_index, return_attention_weights=True)
    assert torch.equal(ei, ei_p) and ei.shape[1] == alpha.shape[0] and alpha.shape[1] == 2
    assert close_or_zero(alpha, alpha_p, TOL)[0]
    # Each destination's weights sum to 1.
    sums = torch.zeros(10, 2, dtype=alpha.dtype).index_add_(0, ei[1], alpha)
    torch.testing.assert_close(sums, torch.ones_like(sums))
    for flag in (False, None):
        result = ours(x, edge_index, return_attention_weights=flag)
        assert isinstance(result, torch.Tensor) and torch.equal(result, out)
    layer = LAYERS[kind][0](5, 3, heads=2, add_self_loops=False).double()
    _, (ei, alpha) = layer(x, edge_index, return_attention_weights=True)
    assert ei is edge_index and alpha.shape == (30, 2)


@pytest.mark.parametrize("loops", [True, False], ids=["loops", "noloops"])
@pytest.mark.parametrize("bipartite", [False, True], ids=["square", "bipartite"])
@pytest.mark.parametrize("kind", LAYERS)
def test_adjacency_forms_match_pyg(kind, bipartite, loops):
    """On every adjacency form PyG takes (EdgeIndex sorted or not, torch.sparse CSR and COO),
    float64 outputs, attention weights in the returned form and gradients equal PyG's on the
    same input."""
    g = gen(11)
    num_src, num_dst = (9, 7) if bipartite else (9, 9)
    theirs, ours = _pair(kind, (5, 6) if bipartite else 5, 4, heads=2, add_self_loops=loops)
    x_src = rand_feat((num_src, 5), torch.float64, g=g, requires_grad=True)
    x = (x_src, rand_feat((num_dst, 6), torch.float64, g=g, requires_grad=True)) if bipartite else x_src
    inputs = list(x) if bipartite else [x]
    edge_index = _simple_graph(num_src, num_dst, 30, "cpu", g)
    for name, (adj, order) in _forms(edge_index, num_src, num_dst).items():
        if name in ("edge_index_no_size", "csc"):
            continue  # PyG sizes the first by its largest index and refuses the second
        results = []
        for layer in (ours, theirs):
            out, (adj_out, alpha) = layer(x, adj, return_attention_weights=True)
            grads = torch.autograd.grad(out, inputs + list(layer.parameters()), torch.ones_like(out))
            results.append((out, adj_out, alpha, grads))
        (out, adj_out, alpha, grads), (out_p, adj_p, alpha_p, grads_p) = results
        assert type(adj_out) is type(adj_p), name
        if adj_out.layout == torch.strided:
            assert torch.equal(adj_out, adj_p), name
        else:
            assert torch.equal(adj_out.to_dense(), adj_p.to_dense()), name
        assert rel_error(out, out_p) <= TOL, name
        assert close_or_zero(alpha, alpha_p, TOL)[0], name
        for a, b in zip(grads, grads_p):
            assert close_or_zero(a, b, TOL)[0], name


@pytest.mark.parametrize("kind", LAYERS)
def test_sparse_values_serve_as_edge_attr(kind):
    """A hybrid torch.sparse adjacency's values [E, F] are the edge features when edge_attr is
    None (as in PyG's propagate)."""
    from torch_geometric.utils import to_torch_coo_tensor

    g = gen(12)
    theirs, ours = _pair(kind, 5, 4, heads=2, edge_dim=3, add_self_loops=False)
    x = rand_feat((8, 5), torch.float64, g=g)
    edge_index = _simple_graph(8, 8, 20, "cpu", g)
    edge_attr = rand_feat((edge_index.shape[1], 3), torch.float64, g=g)
    adj_t = to_torch_coo_tensor(edge_index[[1, 0]], edge_attr, size=(8, 8))
    assert rel_error(ours(x, adj_t), theirs(x, adj_t)) <= TOL


def _dropout_as_mask(keep):
    """A stand-in for torch.nn.functional inside PyG's module: its dropout applies ``keep``."""
    def dropout(alpha, p=0.5, training=True):
        return alpha * keep.to(alpha.device) / (1 - p) if training and p > 0 else alpha
    return types.SimpleNamespace(dropout=dropout, leaky_relu=torch.nn.functional.leaky_relu)


@pytest.mark.parametrize("kind", LAYERS)
def test_dropout_train_and_eval(kind, monkeypatch):
    """Training drops attention weights as PyG's F.dropout would with the mask of the drawn
    seed (outputs, returned weights and gradients equal PyG's under that mask); eval mode drops
    nothing; a seeded default generator reproduces the mask."""
    p = 0.4
    theirs, ours = _pair(kind, 6, 5, heads=2, dropout=p, edge_dim=3)
    g = gen(6)
    x = rand_feat((15, 6), torch.float64, g=g, requires_grad=True)
    edge_index = _graph(15, 15, 60, "cpu", g)
    edge_attr = rand_feat((60, 3), torch.float64, g=g)
    ours.eval(), theirs.eval()
    _assert_same(_run(ours, x, edge_index, edge_attr), _run(theirs, x, edge_index, edge_attr))

    ours.train(), theirs.train()
    torch.manual_seed(123)
    train = _run(ours, x, edge_index, edge_attr)
    num_edges = train[1].shape[1]  # with the self-loops
    torch.manual_seed(123)
    keep = dropout_keep(next_dropout_state("cpu"), num_edges, 2, p)
    monkeypatch.setattr(PYG_MODULES[kind], "F", _dropout_as_mask(keep))
    _assert_same(train, _run(theirs, x, edge_index, edge_attr))
    assert (train[2] == 0).any()  # the returned weights are after dropout, as PyG's
    assert not torch.equal(train[0], ours.eval()(x, edge_index, edge_attr))

    ours.train()
    torch.manual_seed(123)
    again = ours(x, edge_index, edge_attr)
    assert torch.equal(again, train[0])
    assert not torch.equal(ours(x, edge_index, edge_attr), again)  # the generator moved on


def test_gat_source_only_pair():
    """GATConv takes (x_src, None): without size PyG's exact path, with size the fused one."""
    theirs, ours = _pair("gat", (5, 6), 4, heads=2, add_self_loops=False)
    g = gen(7)
    x_src = rand_feat((10, 5), torch.float64, g=g, requires_grad=True)
    edge_index = _graph(10, 6, 30, "cpu", g)
    for size in (None, (10, 8)):
        _assert_same(_run(ours, (x_src, None), edge_index, None, size=size),
                     _run(theirs, (x_src, None), edge_index, None, size=size))
    shared_theirs, shared = _pair("gat", 5, 4, heads=2)
    _assert_same(_run(shared, (x_src, None), edge_index, None, size=(10, 6)),
                 _run(shared_theirs, (x_src, None), edge_index, None, size=(10, 6)))


@pytest.mark.parametrize("kind", LAYERS)
def test_no_edges(kind):
    """No edges and no self-loops: zeros from the attention (bias and residual only)."""
    theirs, ours = _pair(kind, 5, 4, heads=2, add_self_loops=False, residual=True)
    x = rand_feat((6, 5), torch.float64, g=gen(8), requires_grad=True)
    edge_index = torch.empty(2, 0, dtype=torch.long)
    _assert_same(_run(ours, x, edge_index, None), _run(theirs, x, edge_index, None))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("kind", LAYERS)
def test_low_precision_and_int32(kind, dtype):
    theirs, ours = _pair(kind, 16, 8, heads=4, edge_dim=5, residual=True)
    g = gen(9)
    x = rand_feat((40, 16), torch.float64, g=g)
    edge_index = _graph(40, 40, 300, "cpu", g, torch.int32)
    edge_attr = rand_feat((300, 5), torch.float64, g=g)
    ref = theirs(x, edge_index.long(), edge_attr)
    out = ours.to(dtype)(x.to(dtype), edge_index, edge_attr.to(dtype))
    assert out.dtype == dtype
    assert rel_error(out, ref) < (1e-5 if dtype == torch.float32 else 3e-2)


def _propagate_refused(*args, **kwargs):
    raise AssertionError("PyG's propagate ran instead of the fused kernel")


@pytest.mark.parametrize("kind", LAYERS)
def test_path_choice_and_explain(kind, monkeypatch):
    """The fused kernel without explain mode, hooks or another aggregation; PyG's exact path
    (same numbers) with any of them; explain mode's edge mask gets its gradient."""
    g = gen(14)
    theirs, ours = _pair(kind, 6, 4, heads=2, edge_dim=3)
    x = rand_feat((10, 6), torch.float64, g=g)
    edge_index = _graph(10, 10, 35, "cpu", g)
    edge_attr = rand_feat((35, 3), torch.float64, g=g)
    expected = theirs(x, edge_index, edge_attr)
    monkeypatch.setattr(ours, "propagate", _propagate_refused)
    monkeypatch.setattr(ours, "edge_updater", _propagate_refused)
    assert rel_error(ours(x, edge_index, edge_attr), expected) <= TOL
    monkeypatch.undo()

    seen = []
    handle = ours.register_message_forward_hook(lambda module, inputs, out: seen.append(out.shape))
    assert rel_error(ours(x, edge_index, edge_attr), expected) <= TOL
    assert len(seen) == 1
    handle.remove()

    # Explain mode: PyG masks the messages of the input's edges (not the added self-loops).
    ours.explain = theirs.explain = True
    mask = torch.rand(35, dtype=torch.float64, generator=g).requires_grad_()
    ours._edge_mask = theirs._edge_mask = mask
    ours._loop_mask = theirs._loop_mask = edge_index[0] != edge_index[1]  # as explain's set_masks sets it
    masked = ours(x, edge_index, edge_attr)
    assert rel_error(masked, theirs(x, edge_index, edge_attr)) <= TOL
    (grad,) = torch.autograd.grad(masked.square().sum(), mask)
    assert grad.abs().sum() > 0
    ours.explain = theirs.explain = False

    mean_ours = LAYERS[kind][0](6, 4, heads=2, edge_dim=3, aggr="mean").double()
    mean_theirs = LAYERS[kind][1](6, 4, heads=2, edge_dim=3, aggr="mean").double()
    mean_ours.load_state_dict(mean_theirs.state_dict())
    assert rel_error(mean_ours(x, edge_index, edge_attr), mean_theirs(x, edge_index, edge_attr)) <= TOL


@pytest.mark.parametrize("kind", LAYERS)
def test_gnn_explainer_gets_edge_gradients(kind):
    check_gnn_explainer_edge_mask(LAYERS[kind][0])


@pytest.mark.parametrize("kind", LAYERS)
def test_flow_target_to_source(kind):
    g = gen(15)
    theirs, ours = _pair(kind, 6, 4, heads=2, flow="target_to_source")
    x = rand_feat((10, 6), torch.float64, g=g)
    edge_index = _graph(10, 10, 35, "cpu", g)
    assert rel_error(ours(x, edge_index), theirs(x, edge_index)) <= TOL


@pytest.mark.parametrize("loops", [False, True], ids=["noloops", "loops"])
@pytest.mark.parametrize("kind", LAYERS)
def test_compile(kind, loops):
    """torch.compile of a training step matches eager (whole-graph without self-loop handling,
    whose edge count depends on the data)."""
    torch._dynamo.reset()
    _, ours = _pair(kind, 6, 4, heads=2, edge_dim=3, add_self_loops=loops, residual=True)
    g = gen(8)
    x, edge_index = rand_feat((20, 6), torch.float64, g=g), _graph(20, 20, 80, "cpu", g)
    edge_attr = rand_feat((80, 3), torch.float64, g=g)

    def step(x):
        return ours(x, edge_index, edge_attr).square().sum()

    eager = torch.autograd.grad(step(x), list(ours.parameters()))
    compiled_step = torch.compile(step, fullgraph=not loops, backend="aot_eager")
    compiled = torch.autograd.grad(compiled_step(x), list(ours.parameters()))
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", LAYERS)
def test_torchscript(kind):
    """A module holding the layer compiles with torch.jit.script (PyG's own GAT layers do not:
    their return type depends on a value) and gives the eager numbers (PyG's exact path)."""
    from typing import Tuple

    from torch import Tensor

    _, ours = _pair(kind, 6, 4, heads=2, edge_dim=3)
    g = gen(18)
    x, edge_index = rand_feat((10, 6), torch.float64, g=g), _graph(10, 10, 35, "cpu", g)
    edge_attr = rand_feat((35, 3), torch.float64, g=g)

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = ours

        def forward(self, x: Tensor, edge_index: Tensor, edge_attr: Tensor) -> Tuple[Tensor, Tuple[Tensor, Tensor]]:
            return self.conv(x, edge_index, edge_attr, return_attention_weights=True)

    scripted = torch.jit.script(Holder())
    out, (ei, alpha) = scripted(x, edge_index, edge_attr)
    out_eager, (ei_eager, alpha_eager) = ours(x, edge_index, edge_attr, return_attention_weights=True)
    assert torch.equal(ei, ei_eager)
    torch.testing.assert_close(out, out_eager, rtol=TOL, atol=TOL)
    torch.testing.assert_close(alpha, alpha_eager, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("kind", LAYERS)
def test_to_hetero_matches_pyg(kind):
    check_to_hetero_matches_pyg(LAYERS[kind][0], LAYERS[kind][1], TOL, add_self_loops=False)


def test_bad_inputs():
    x = (torch.randn(10, 4), torch.randn(8, 6))
    edge_index = torch.tensor([[0, 1], [1, 2]])
    with raises_checked(ValueError, match="without edge_dim"):
        edgedot.nn.GATv2Conv((4, 6), 5)(x, edge_index, torch.randn(2, 3))
    with raises_checked(ValueError, match=r"x\[1\]"):
        edgedot.nn.GATv2Conv((4, 6), 5)((x[0], None), edge_index)
    with raises_checked(ValueError, match="x must be"):
        edgedot.nn.GATConv(4, 5)(torch.randn(2, 3, 4), edge_index)
    with raises_checked(TypeError, match="edge_index"):
        edgedot.nn.GATConv((4, 6), 5, add_self_loops=False)(x, [[0, 1], [1, 2]])
    with raises_checked(IndexError, match=r"edge_index\[1\]"):
        edgedot.nn.GATConv((4, 6), 5, add_self_loops=False)(x, torch.tensor([[0, 1], [1, 8]]))


@pytest.mark.parametrize("kind", LAYERS)
def test_without_pyg(kind):
    """With torch_geometric not importable, the layer is a torch.nn.Module on the fused path
    with PyG's initialisation and self-loop handling; a PyG state dict gives PyG's output."""
    ours_cls, theirs_cls = LAYERS[kind]
    options = dict(heads=2, edge_dim=3, residual=True, fill_value="mean")
    g = gen(20)
    torch.manual_seed(0)
    theirs = theirs_cls(6, 4, **options).double()
    x = rand_feat((10, 6), torch.float64, g=g)
    edge_index = _graph(10, 10, 35, "cpu", g)
    edge_attr = rand_feat((35, 3), torch.float64, g=g)
    torch.manual_seed(7)
    fresh = theirs_cls(6, 4, **options)
    script = f"""
import sys, torch
sys.modules["torch_geometric"] = None  # import torch_geometric raises ImportError
import edgedot.nn
from edgedot.nn import _pyg
state, x, edge_index, edge_attr, fresh = torch.load(sys.argv[1])
assert not _pyg.HAVE_PYG
torch.manual_seed(7)
layer = edgedot.nn.{ours_cls.__name__}(6, 4, **{options!r})
assert layer.state_dict().keys() == fresh.keys()
for name, tensor in fresh.items():
    assert torch.allclose(layer.state_dict()[name], tensor, rtol=1e-6, atol=0), name
layer = layer.double()
layer.load_state_dict(state)
torch.save((layer(x, edge_index, edge_attr), layer(x, edge_index)), sys.argv[2])
"""
    with tempfile.TemporaryDirectory() as tmp:
        torch.save((theirs.state_dict(), x, edge_index, edge_attr, fresh.state_dict()), f"{tmp}/in.pt")
        subprocess.run([sys.executable, "-c", script, f"{tmp}/in.pt", f"{tmp}/out.pt"], check=True)
        out, out_no_attr = torch.load(f"{tmp}/out.pt")
    assert rel_error(out, theirs(x, edge_index, edge_attr)) <= TOL
    assert rel_error(out_no_attr, theirs(x, edge_index)) <= TOL


@pytest.mark.parametrize("fill_value", [0.5, "mean", "max"])
@pytest.mark.parametrize("kind", LAYERS)
def test_one_dimensional_edge_attr(kind, fill_value):
    """``edge_attr`` ``[E]`` with ``edge_dim=1`` (an edge weight), self-loops filled as PyG fills them."""
    theirs, ours = _pair(kind, 8, 4, heads=2, edge_dim=1, fill_value=fill_value)
    g = gen(21)
    x = rand_feat((9, 8), torch.float64, g=g, requires_grad=True)
    edge_index = _graph(9, 9, 30, "cpu", g)
    edge_weight = rand_feat((30,), torch.float64, g=g, requires_grad=True)
    _assert_same(_run(ours, x, edge_index, edge_weight), _run(theirs, x, edge_index, edge_weight))


@pytest.mark.parametrize("kind", LAYERS)
def test_no_nodes(kind):
    theirs, ours = _pair(kind, 8, 4, heads=2)
    x, edge_index = torch.randn(0, 8, dtype=torch.float64), torch.empty(2, 0, dtype=torch.long)
    out = ours(x, edge_index)
    assert out.shape == (0, 8) and out.shape == theirs(x, edge_index).shape


@pytest.mark.parametrize("kind", LAYERS)
def test_self_loops_follow_the_graph(kind):
    """A [2, E] graph's self-looped form is PyG's (int32 indices give PyG's int64 result), also
    after the graph changes in place."""
    theirs, ours = _pair(kind, 6, 4, heads=2, edge_dim=2, fill_value="add")
    g = gen(22)
    x = rand_feat((12, 6), torch.float64, g=g)
    edge_index = _graph(12, 12, 40, "cpu", g, torch.int32)
    edge_attr = rand_feat((40, 2), torch.float64, g=g)
    for _ in range(2):
        out, (ei, alpha) = ours(x, edge_index, edge_attr, return_attention_weights=True)
        out_p, (ei_p, alpha_p) = theirs(x, edge_index, edge_attr, return_attention_weights=True)
        assert ei.dtype == ei_p.dtype == torch.int64 and torch.equal(ei, ei_p)
        assert rel_error(out, out_p) <= TOL and close_or_zero(alpha, alpha_p, TOL)[0]
        edge_index[1, 5:9] = edge_index[0, 5:9]  # more self-loops: a new looped graph


def _looped_by_hand(edge_index, edge_attr, num_nodes, fill_value):
    """Self-loops as PyG defines them, computed edge by edge: the edges that are no self-loops,
    then a loop per node below ``num_nodes`` whose features reduce (``fill_value``) those of the
    kept edges into that node (zeros for a node without any), or a number `fill_value`."""
    keep = edge_index[0] != edge_index[1]
    kept, attr = edge_index[:, keep], edge_attr[keep]
    loops = []
    for node in range(num_nodes):
        into = attr[kept[1] == node]
        if into.shape[0] == 0 and isinstance(fill_value, str):
            loops.append(torch.zeros_like(attr[0]))
        elif not isinstance(fill_value, str):
            loops.append(torch.full_like(attr[0], fill_value))
        else:
            loops.append({"add": into.sum(0), "mean": into.mean(0), "max": into.max(0).values}[fill_value])
    loop = torch.arange(num_nodes)
    return torch.cat([kept, torch.stack([loop, loop])], dim=1), torch.cat([attr, torch.stack(loops)])


@pytest.mark.parametrize("fill_value", ["mean", "add", "max"])
@pytest.mark.parametrize("kind", LAYERS)
@pytest.mark.parametrize("device", DEVICES)
def test_bipartite_loops_with_more_destinations(device, kind, fill_value):
    """Loops of a bipartite graph with more destinations than sources: the loops' features reduce
    only the edges into the looped nodes (PyG's own layer indexes past the loops there: an
    error on the CPU, a device-side assert on CUDA); the fused path, PyG's exact path (taken
    with a message hook) and the returned graph all agree with the loops computed by hand."""
    g = gen(23)
    num_src, num_dst = 5, 9
    options = dict(heads=2, edge_dim=3, fill_value=fill_value)
    _, ours = _pair(kind, (6, 7), 4, device, add_self_loops=True, **options)
    _, reference = _pair(kind, (6, 7), 4, device, add_self_loops=False, **options)
    x = (rand_feat((num_src, 6), torch.float64, g=g), rand_feat((num_dst, 7), torch.float64, g=g))
    edge_index = torch.stack([rand_index(num_src, 40, g=g), rand_index(num_dst, 40, g=g)])
    edge_index[:, :3] = torch.tensor([[1, 2, 4], [1, 2, 8]])  # two self-loops, an edge into a node past the loops
    edge_attr = rand_feat((40, 3), torch.float64, g=g)
    looped, looped_attr = _looped_by_hand(edge_index, edge_attr, num_src, fill_value)
    x = tuple(t.to(device) for t in x)
    edge_index, edge_attr, looped, looped_attr = (t.to(device) for t in (edge_index, edge_attr, looped, looped_attr))
    expected = reference(x, looped, looped_attr)
    for adj in (edge_index, EdgeIndex(edge_index, sparse_size=(num_src, num_dst))):
        out, (ei, _) = ours(x, adj, edge_attr, return_attention_weights=True)
        assert torch.equal(ei.as_subclass(torch.Tensor), looped)
        assert rel_error(out, expected) <= TOL, f"{type(adj).__name__}: {rel_error(out, expected):.2e}"
        handle = ours.register_message_forward_hook(lambda module, inputs, output: None)  # PyG's exact path
        assert rel_error(ours(x, adj, edge_attr), expected) <= TOL, type(adj).__name__
        handle.remove()

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = ours

        def forward(self, x_src: Tensor, x_dst: Tensor, edge_index: Tensor, edge_attr: Tensor) -> Tensor:
            return self.conv((x_src, x_dst), edge_index, edge_attr)

    assert rel_error(torch.jit.script(Holder())(*x, edge_index, edge_attr), expected) <= TOL


@pytest.mark.parametrize("fill_value", ["mean", "add", "max", 0.5])
def test_self_looped_function(fill_value):
    """``_pyg.self_looped``, the eager self-loop handling other layers share, gives the loops
    computed by hand, with more destinations than loops too, and follows an in-place change."""
    from edgedot.nn import _pyg

    g = gen(24)
    edge_index = torch.stack([rand_index(5, 30, g=g), rand_index(9, 30, g=g)])
    edge_index[:, :2] = torch.tensor([[1, 4], [1, 8]])
    edge_attr = rand_feat((30, 3), torch.float64, g=g)
    for _ in range(2):
        looped, attr = _pyg.self_looped(edge_index, edge_attr, fill_value, 5)
        want, want_attr = _looped_by_hand(edge_index, edge_attr, 5, fill_value)
        assert torch.equal(looped, want) and torch.allclose(attr, want_attr, rtol=1e-12, atol=0)
        edge_index.data[1, 2:6] = edge_index[0, 2:6]  # more self-loops, behind the version counter
    assert _pyg.self_looped(edge_index, None, fill_value, 5)[1] is None
