"""edgedot.nn.TransformerConv against PyG's TransformerConv itself."""

import itertools
import types

import pytest
import torch

import edgedot
import edgedot.nn
from edgedot.ops.attention import dropout_keep, next_dropout_state
from utils import DEVICES, assert_grads_close, dtype_id, gen, raises_checked, rand_feat, rand_index, rel_error

pyg_conv = pytest.importorskip("torch_geometric.nn.conv.transformer_conv")
PyGTransformerConv = pyg_conv.TransformerConv

OPTIONS = list(itertools.product(
    [1, 3],                   # heads
    [True, False],            # concat
    [False, True],            # beta
    [None, 4],                # edge_dim
    [True, False],            # bias
    [True, False],            # root_weight
))


def _option_id(options):
    heads, concat, beta, edge_dim, bias, root_weight = options
    return (f"h{heads}-{'concat' if concat else 'mean'}-{'beta' if beta else 'nobeta'}-"
            f"{'edge' if edge_dim else 'noedge'}-{'bias' if bias else 'nobias'}-{'root' if root_weight else 'noroot'}")


def _pair(in_channels, out_channels, device, dtype=torch.float64, **options):
    """A PyG layer and ours with the same parameters (PyG's state dict loaded into ours)."""
    torch.manual_seed(0)
    theirs = PyGTransformerConv(in_channels, out_channels, **options).to(device, dtype)
    ours = edgedot.nn.TransformerConv(in_channels, out_channels, **options).to(device, dtype)
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


def _graph(num_src, num_dst, num_edges, device, g, index_dtype=torch.int64):
    edge_index = torch.stack([rand_index(num_src, num_edges, index_dtype, device, g),
                              rand_index(num_dst - 1, num_edges, index_dtype, device, g)])  # last node: no edges
    edge_index[:, :2] = torch.tensor([[0, 1], [1, 1]])  # a duplicate edge
    edge_index[:, 2] = 2  # a self-loop
    return edge_index


def _outputs_and_grads(layer, x, edge_index, edge_attr, grad_out_seed=1):
    out, (ei, alpha) = layer(x, edge_index, edge_attr, return_attention_weights=True)
    params = dict(layer.named_parameters())
    inputs = [t for t in (x if isinstance(x, tuple) else (x,)) if t.requires_grad]
    if edge_attr is not None and edge_attr.requires_grad:
        inputs.append(edge_attr)
    grad_out = rand_feat(out.shape, out.dtype, out.device, gen(grad_out_seed))
    grads = torch.autograd.grad(out, list(params.values()) + inputs, grad_out, allow_unused=True)
    return out, ei, alpha, dict(zip(list(params) + [f"input{i}" for i in range(len(inputs))], grads))


def _assert_same(ours, theirs, rtol=1e-12):
    out, ei, alpha, grads = ours
    out_p, ei_p, alpha_p, grads_p = theirs
    assert ei is ei_p or torch.equal(ei, ei_p)
    assert out.shape == out_p.shape and alpha.shape == alpha_p.shape
    assert rel_error(out, out_p) <= rtol, f"out {rel_error(out, out_p):.2e}"
    assert rel_error(alpha, alpha_p) <= rtol, f"alpha {rel_error(alpha, alpha_p):.2e}"
    assert_grads_close(grads, grads_p, rtol)


@pytest.mark.parametrize("bipartite", [False, True], ids=["square", "bipartite"])
@pytest.mark.parametrize("options", OPTIONS, ids=_option_id)
@pytest.mark.parametrize("device", DEVICES)
def test_matches_pyg(device, options, bipartite):
    """float64 outputs, attention weights and gradients (parameters and inputs) match PyG's
    to rounding on every option combination."""
    heads, concat, beta, edge_dim, bias, root_weight = options
    g = gen(2)
    in_channels = (5, 6) if bipartite else 5
    theirs, ours = _pair(in_channels, 7, device, heads=heads, concat=concat, beta=beta, edge_dim=edge_dim,
                         bias=bias, root_weight=root_weight)
    num_src, num_dst = (10, 8) if bipartite else (10, 10)
    x_src = rand_feat((num_src, 5), torch.float64, device, g, requires_grad=True)
    x = (x_src, rand_feat((num_dst, 6), torch.float64, device, g, requires_grad=True)) if bipartite else x_src
    edge_index = _graph(num_src, num_dst, 40, device, g)
    edge_attr = rand_feat((40, 4), torch.float64, device, g, requires_grad=True) if edge_dim else None
    _assert_same(_outputs_and_grads(ours, x, edge_index, edge_attr),
                 _outputs_and_grads(theirs, x, edge_index, edge_attr))
    # Without return_attention_weights: the output alone, as PyG's.
    torch.testing.assert_close(ours(x, edge_index, edge_attr), theirs(x, edge_index, edge_attr), rtol=1e-12,
                               atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_state_dict_round_trip(device):
    for options in (dict(heads=2, edge_dim=3, beta=True), dict(heads=4, concat=False, bias=False, beta=True)):
        theirs, ours = _pair((4, 6), 5, device, **options)
        assert ours.state_dict().keys() == theirs.state_dict().keys()
        for name, tensor in theirs.state_dict().items():
            assert torch.equal(ours.state_dict()[name], tensor), name
        # And ours into PyG's: a fresh layer of each, ours re-initialised, loaded back strictly.
        ours.reset_parameters()
        fresh = PyGTransformerConv((4, 6), 5, **options).to(device, torch.float64)
        fresh.load_state_dict(ours.state_dict())
        for name, tensor in ours.state_dict().items():
            assert torch.equal(fresh.state_dict()[name], tensor), name


def test_lazy_in_channels():
    theirs, ours = PyGTransformerConv(-1, 4, heads=2).double(), edgedot.nn.TransformerConv(-1, 4, heads=2).double()
    g = gen(3)
    x = rand_feat((9, 6), torch.float64, g=g)
    edge_index = _graph(9, 9, 30, "cpu", g)
    theirs(x, edge_index)  # sizes PyG's layers
    ours.load_state_dict(theirs.state_dict())
    torch.testing.assert_close(ours(x, edge_index), theirs(x, edge_index), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_return_attention_weights_false_also_returns_them(device):
    """PyG returns (out, (edge_index, alpha)) whenever return_attention_weights is a bool."""
    _, ours = _pair(5, 3, device, heads=2)
    g = gen(4)
    x, edge_index = rand_feat((10, 5), torch.float64, device, g), _graph(10, 10, 30, device, g)
    out, (ei, alpha) = ours(x, edge_index, return_attention_weights=False)
    assert ei is edge_index and alpha.shape == (30, 2) and out.shape == (10, 6)
    assert isinstance(ours(x, edge_index), torch.Tensor)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_projection_matches_separate(device):
    """One tensor for both sides takes one fused QKV projection (strided q/k/v); a pair of
    equal tensors takes three: the same result to rounding."""
    _, ours = _pair(8, 4, device, heads=3, edge_dim=2)
    g = gen(5)
    x, edge_index = rand_feat((12, 8), torch.float64, device, g), _graph(12, 12, 50, device, g)
    edge_attr = rand_feat((50, 2), torch.float64, device, g)
    torch.testing.assert_close(ours(x, edge_index, edge_attr), ours((x, x.clone()), edge_index, edge_attr),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.cpu_only
@pytest.mark.parametrize("options", [dict(), dict(bias=False), dict(beta=True), dict(concat=False),
                                     dict(heads=1, concat=False), dict(root_weight=False)],
                         ids=["default", "nobias", "beta", "mean", "h1-mean", "noroot"])
def test_skip_in_the_projection_gemm(options, monkeypatch):
    """On the CPU, an x of 2^18 elements or more, wider than the heads' width, takes lin_skip into
    the query/key/value GEMM as a fourth block where the skip has their shape (not for averaged
    heads, nor without root_weight): float64 outputs and gradients still match PyG's."""
    options = dict(dict(heads=2), **options)
    theirs, ours = _pair(1000, 8, "cpu", **options)
    g = gen(6)
    x = rand_feat((300, 1000), torch.float64, "cpu", g, requires_grad=True)
    edge_index = _graph(300, 300, 900, "cpu", g)
    sides = []
    linear_sides = type(ours)._linear_sides
    monkeypatch.setattr(type(ours), "_linear_sides",
                        lambda self, *args: sides.append(len(args[1])) or linear_sides(self, *args))
    _assert_same(_outputs_and_grads(ours, x, edge_index, None), _outputs_and_grads(theirs, x, edge_index, None),
                 rtol=1e-11)
    folds = options.get("root_weight", True) and (options.get("concat", True) or options["heads"] == 1)
    assert sides == [4 if folds else 3]


def _dropout_as_mask(keep):
    """A stand-in for torch.nn.functional inside PyG's module: its dropout applies ``keep``."""
    def dropout(alpha, p=0.5, training=True):
        return alpha * keep.to(alpha.device) / (1 - p) if training and p > 0 else alpha
    return types.SimpleNamespace(dropout=dropout)


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_train_and_eval(device, monkeypatch):
    """Training drops attention weights as PyG's F.dropout would with the mask of the drawn
    seed (outputs and gradients equal PyG's under that mask); eval mode drops nothing; alpha is
    returned before dropout; a seeded default generator reproduces the mask."""
    p = 0.4
    theirs, ours = _pair(6, 5, device, heads=2, dropout=p, edge_dim=3)
    g = gen(6)
    x = rand_feat((15, 6), torch.float64, device, g, requires_grad=True)
    edge_index = _graph(15, 15, 60, device, g)
    edge_attr = rand_feat((60, 3), torch.float64, device, g)

    ours.eval(), theirs.eval()
    _assert_same(_outputs_and_grads(ours, x, edge_index, edge_attr),
                 _outputs_and_grads(theirs, x, edge_index, edge_attr))

    ours.train(), theirs.train()
    torch.manual_seed(123)
    train = _outputs_and_grads(ours, x, edge_index, edge_attr)
    torch.manual_seed(123)
    keep = dropout_keep(next_dropout_state(device), 60, 2, p)
    monkeypatch.setattr(pyg_conv, "F", _dropout_as_mask(keep))
    _assert_same(train, _outputs_and_grads(theirs, x, edge_index, edge_attr))
    assert not torch.equal(train[0], ours.eval()(x, edge_index, edge_attr))

    ours.train()
    torch.manual_seed(123)
    again = ours(x, edge_index, edge_attr)
    assert torch.equal(again, train[0])
    assert not torch.equal(ours(x, edge_index, edge_attr), again)  # the generator moved on


@pytest.mark.parametrize("device", DEVICES)
def test_int32_edge_index_gives_the_int64_gradients(device):
    """An int32 edge_index: outputs, weights and gradients equal PyG's on the int64 one (PyG's own
    layer on the int32 one gets other gradients: docs/api.md)."""
    theirs, ours = _pair(5, 3, device, heads=2, edge_dim=4)
    g = gen(9)
    x = rand_feat((12, 5), torch.float64, device, g, requires_grad=True)
    edge_index = _graph(12, 12, 50, device, g, torch.int32)
    edge_attr = rand_feat((50, 4), torch.float64, device, g, requires_grad=True)
    ours_result = _outputs_and_grads(ours, x, edge_index, edge_attr)
    theirs_result = _outputs_and_grads(theirs, x, edge_index.long(), edge_attr)
    out, ei, alpha, grads = ours_result
    assert ei.dtype == torch.int32 and torch.equal(ei.long(), theirs_result[1])
    _assert_same((out, theirs_result[1], alpha, grads), theirs_result)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("device", DEVICES)
def test_low_precision(device, dtype):
    theirs, ours = _pair(16, 8, device, heads=4, edge_dim=5, beta=True)
    g = gen(7)
    x, edge_index = rand_feat((40, 16), torch.float64, device, g), _graph(40, 40, 300, device, g, torch.int32)
    edge_attr = rand_feat((300, 5), torch.float64, device, g)
    ref = theirs(x, edge_index.long(), edge_attr)
    out = ours.to(dtype)(x.to(dtype), edge_index, edge_attr.to(dtype))
    assert out.dtype == dtype
    assert rel_error(out, ref) < (1e-5 if dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_plan_and_compile(device):
    """A plan gives the same result; torch.compile(fullgraph=True) of a training step matches
    eager."""
    torch._dynamo.reset()
    _, ours = _pair(6, 4, device, heads=2, edge_dim=3, beta=True)
    g = gen(8)
    x, edge_index = rand_feat((20, 6), torch.float64, device, g), _graph(20, 20, 80, device, g)
    edge_attr = rand_feat((80, 3), torch.float64, device, g)
    plan = edgedot.EdgePlan(edge_index[0], edge_index[1], 20, 20)
    torch.testing.assert_close(ours(x, edge_index, edge_attr, plan=plan), ours(x, edge_index, edge_attr),
                               rtol=0, atol=0)

    def step(x):
        return ours(x, edge_index, edge_attr, plan=plan).square().sum()

    eager = torch.autograd.grad(step(x), list(ours.parameters()))
    compiled = torch.autograd.grad(torch.compile(step, fullgraph=True, backend="aot_eager")(x),
                                   list(ours.parameters()))
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_repr_and_bad_inputs():
    ours, theirs = edgedot.nn.TransformerConv((4, 6), 5, heads=2, edge_dim=3), PyGTransformerConv((4, 6), 5, heads=2)
    assert repr(ours) == repr(theirs)
    x = (torch.randn(10, 4), torch.randn(8, 6))
    edge_index = torch.tensor([[0, 1], [1, 2]])
    with raises_checked(ValueError, match="edge_index"):
        ours(x, edge_index[0], torch.randn(2, 3))
    with raises_checked(TypeError, match="edge_index"):
        ours(x, [[0, 1], [1, 2]], torch.randn(2, 3))
    with raises_checked(ValueError, match="edge_attr is required"):
        ours(x, edge_index)
    with raises_checked(ValueError, match="without edge_dim"):
        edgedot.nn.TransformerConv((4, 6), 5)(x, edge_index, torch.randn(2, 3))
    with raises_checked(IndexError, match=r"edge_index\[1\]"):
        ours(x, torch.tensor([[0, 1], [1, 8]]), torch.randn(2, 3))
