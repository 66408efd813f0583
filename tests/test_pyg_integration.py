"""edgedot.nn.TransformerConv inside PyG's machinery: MessagePassing, initialisation, every
adjacency form, explain mode, hooks, AttentionExplainer, TorchScript, to_hetero; and
edgedot.nn._pyg.adjacency itself."""

import subprocess
import sys

import pytest
import torch

import edgedot
import edgedot.nn
from edgedot.nn import _pyg
from utils import DEVICES, INDEX_DTYPES, dtype_id, gen, rand_feat, rand_index, rel_error

torch_geometric = pytest.importorskip("torch_geometric")
from torch_geometric import EdgeIndex  # noqa: E402
from torch_geometric.nn import MessagePassing  # noqa: E402
from torch_geometric.nn.conv.transformer_conv import TransformerConv as PyGTransformerConv  # noqa: E402
from torch_geometric.utils import (to_torch_coo_tensor, to_torch_csc_tensor,  # noqa: E402
                                   to_torch_csr_tensor)


def _graph(num_src, num_dst, num_edges, device, g, index_dtype=torch.int64):
    """Random edges, a duplicate, a self-loop, a destination without edges, a hub."""
    edge_index = torch.stack([rand_index(num_src, num_edges, index_dtype, device, g),
                              rand_index(num_dst - 1, num_edges, index_dtype, device, g)])
    edge_index[:, :2] = torch.tensor([[0, 0], [1, 1]])
    edge_index[:, 2] = 2
    edge_index[1, 3:3 + num_edges // 4] = 0
    return edge_index


def _simple_graph(num_src, num_dst, num_edges, device, g, index_dtype=torch.int64):
    """:func:`_graph` without duplicate edges (sparse forms would merge them), in random order."""
    edge_index = torch.unique(_graph(num_src, num_dst, num_edges, device, g, index_dtype), dim=1)
    order = torch.randperm(edge_index.shape[1], generator=g).to(device)
    return edge_index[:, order].contiguous()


def _pair(in_channels, out_channels, device, **options):
    """PyG's layer and ours from the same seed (equal initial weights), float64."""
    torch.manual_seed(0)
    theirs = PyGTransformerConv(in_channels, out_channels, **options)
    torch.manual_seed(0)
    ours = edgedot.nn.TransformerConv(in_channels, out_channels, **options)
    return theirs.to(device, torch.float64), ours.to(device, torch.float64)


def _forms(edge_index, num_src, num_dst):
    """Every adjacency form of one graph: name -> (input for ours, input for PyG's layer,
    the edge order of that form as a permutation of edge_index's columns, or None to skip
    the alignment)."""
    size = (num_src, num_dst)
    order_by_dst = torch.sort(edge_index[1] * num_src + edge_index[0], stable=True).indices
    order_by_src = torch.sort(edge_index[0] * num_dst + edge_index[1], stable=True).indices
    by_dst = edge_index[:, order_by_dst]
    return {
        "dense": (edge_index, None),
        "edge_index_unsorted": (EdgeIndex(edge_index, sparse_size=size), None),
        "edge_index_by_col": (EdgeIndex(by_dst.contiguous(), sparse_size=size, sort_order="col"), order_by_dst),
        "edge_index_by_row": (EdgeIndex(edge_index[:, order_by_src].contiguous(), sparse_size=size, sort_order="row"),
                              order_by_src),
        "edge_index_no_size": (EdgeIndex(by_dst.contiguous(), sort_order="col"), order_by_dst),
        "csr": (to_torch_csc_tensor(edge_index, size=size).t(), order_by_dst),
        "csc": (to_torch_csr_tensor(edge_index, size=size).t(), order_by_src),
        "coo_coalesced": (to_torch_coo_tensor(edge_index[[1, 0]], size=(num_dst, num_src)), order_by_dst),
    }


@pytest.mark.parametrize("edge_dim", [None, 3])
@pytest.mark.parametrize("bipartite", [False, True], ids=["square", "bipartite"])
@pytest.mark.parametrize("device", DEVICES)
def test_adjacency_forms_match_pyg(device, bipartite, edge_dim):
    """On every adjacency form, float64 outputs, attention weights (in the form's edge order)
    and gradients equal PyG's layer's on the same input to rounding."""
    g = gen(11)
    num_src, num_dst = (9, 7) if bipartite else (9, 9)
    theirs, ours = _pair((5, 6) if bipartite else 5, 4, device, heads=2, edge_dim=edge_dim, beta=True)
    x_src = rand_feat((num_src, 5), torch.float64, device, g, requires_grad=True)
    x = (x_src, rand_feat((num_dst, 6), torch.float64, device, g, requires_grad=True)) if bipartite else x_src
    inputs = list(x) if bipartite else [x]
    edge_index = _simple_graph(num_src, num_dst, 30, device, g)
    num_edges = edge_index.shape[1]
    edge_attr = rand_feat((num_edges, 3), torch.float64, device, g) if edge_dim else None
    for name, (adj, order) in _forms(edge_index, num_src, num_dst).items():
        attr = None if edge_attr is None else edge_attr if order is None else edge_attr[order]
        # PyG sizes an EdgeIndex without a sparse size by its largest index (too few nodes
        # here) and refuses a CSC adj_t: it gets the same edges as a plain tensor there.
        theirs_adj = edge_index[:, order] if name in ("edge_index_no_size", "csc") else adj
        results = []
        for layer, layer_adj in ((ours, adj), (theirs, theirs_adj)):
            out, (adj_out, alpha) = layer(x, layer_adj, attr, return_attention_weights=True)
            assert adj_out is layer_adj, name
            grads = torch.autograd.grad(out, inputs + list(layer.parameters()), torch.ones_like(out))
            results.append((out, alpha, grads))
        (out, alpha, grads), (out_p, alpha_p, grads_p) = results
        assert out.shape == out_p.shape and alpha.shape == alpha_p.shape == (num_edges, 2), name
        assert rel_error(out, out_p) <= 1e-12, name
        assert rel_error(alpha, alpha_p) <= 1e-12, name
        for a, b in zip(grads, grads_p):
            assert torch.linalg.vector_norm(a - b) <= 1e-12 * max(torch.linalg.vector_norm(b), 1), name


@pytest.mark.parametrize("device", DEVICES)
def test_sparse_values_serve_as_edge_attr(device):
    """A hybrid torch.sparse adjacency's values [E, F] are the edge features when edge_attr is
    None (as in PyG's propagate)."""
    g = gen(12)
    theirs, ours = _pair(5, 4, device, heads=2, edge_dim=3)
    x = rand_feat((8, 5), torch.float64, device, g)
    edge_index = _simple_graph(8, 8, 20, device, g)
    edge_attr = rand_feat((edge_index.shape[1], 3), torch.float64, device, g)
    adj_t = to_torch_coo_tensor(edge_index[[1, 0]], edge_attr, size=(8, 8))
    ours_out = ours(x, adj_t)
    assert rel_error(ours_out, theirs(x, adj_t)) <= 1e-12
    assert rel_error(ours_out, ours(x, adj_t.coalesce().indices()[[1, 0]], adj_t.coalesce().values())) <= 1e-12


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("device", DEVICES)
def test_adjacency_indices_and_dst_ptr(device, index_dtype):
    """_pyg.adjacency gives each form's edges in its order, and a row pointer exactly where the
    form is sorted by destination (dst[ptr[n]:ptr[n+1]] == n)."""
    g = gen(13)
    num_src, num_dst = 11, 6
    edge_index = _simple_graph(num_src, num_dst, 40, device, g, index_dtype)
    expect_ptr = {"edge_index_by_col", "csr", "coo_coalesced"}
    for name, (adj, order) in _forms(edge_index, num_src, num_dst).items():
        if name.startswith("coo") and index_dtype == torch.int32:
            continue  # torch.sparse COO holds int64 indices only
        result = _pyg.adjacency(adj, num_src, num_dst)
        expected = edge_index if order is None else edge_index[:, order]
        assert torch.equal(result.src.long(), expected[0].long()), name
        assert torch.equal(result.dst.long(), expected[1].long()), name
        if name in expect_ptr:
            ptr = torch._convert_indices_from_coo_to_csr(expected[1].long(), num_dst)
            assert result.dst_ptr is not None and torch.equal(result.dst_ptr.long(), ptr), name
        else:
            assert result.dst_ptr is None, name
    # A torch.sparse input is read anew on every call, also after a write that PyTorch does not see.
    adj_t = to_torch_csc_tensor(edge_index, size=(num_src, num_dst)).t()
    first = _pyg.adjacency(adj_t, num_src, num_dst)
    src, dst = first.src.clone(), first.dst.clone()
    crow = adj_t.crow_indices()
    crow.data[1:] = crow[-1]  # every edge into node 0 now
    adj_t.col_indices().data.copy_((src + 1) % num_src)
    again = _pyg.adjacency(adj_t, num_src, num_dst)
    assert torch.equal(again.src, (src + 1) % num_src) and not again.dst.any() and dst.any()
    assert torch.equal(again.dst_ptr, crow)
    # flow="target_to_source" reads row 1 as the sources.
    flipped = _pyg.adjacency(edge_index[[1, 0]], num_src, num_dst, flow="target_to_source")
    assert torch.equal(flipped.src, edge_index[0]) and torch.equal(flipped.dst, edge_index[1])


def test_bad_adjacency():
    ours = edgedot.nn.TransformerConv((4, 6), 5, heads=2)
    x = (torch.randn(4, 4), torch.randn(2, 6))
    edge_index = torch.tensor([[0, 1, 2, 3], [0, 0, 1, 1]])
    # The adjacency itself instead of its transpose, and a wrong size.
    with pytest.raises(ValueError, match=r"edge_index is a sparse adjacency of size \(4, 2\).*adj.t\(\)"):
        ours(x, to_torch_csc_tensor(edge_index, size=(4, 2)))
    with pytest.raises(ValueError, match="edge_index is a sparse adjacency of size"):
        ours(x, to_torch_csc_tensor(edge_index, size=(4, 3)).t())
    with pytest.raises(ValueError, match="EdgeIndex of sparse size"):
        ours(x, EdgeIndex(edge_index, sparse_size=(5, 2)))
    with pytest.raises(TypeError, match="edge_index must be"):
        ours(x, edge_index.tolist())
    with pytest.raises(ValueError, match=r"edge_index must be \[2, E\]"):
        ours(x, edge_index[:1])
    flipped = edgedot.nn.TransformerConv((4, 6), 5, flow="target_to_source")
    with pytest.raises(ValueError, match="target_to_source"):
        flipped(x, to_torch_csc_tensor(edge_index, size=(4, 2)).t())


@pytest.mark.parametrize("options", [dict(), dict(heads=3, edge_dim=4, beta=True), dict(concat=False, beta=True),
                                     dict(bias=False, root_weight=False)], ids=str)
@pytest.mark.parametrize("in_channels", [7, (5, 6)], ids=str)
def test_initial_weights_match_pyg(in_channels, options):
    """The same seed gives the same initial weights as PyG's layer (and leaves the default
    generator in the same state); reset_parameters draws as PyG's does."""
    torch.manual_seed(123)
    theirs = PyGTransformerConv(in_channels, 8, **options)
    after_theirs = torch.rand(3)
    torch.manual_seed(123)
    ours = edgedot.nn.TransformerConv(in_channels, 8, **options)
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


def test_message_passing_interface():
    ours = edgedot.nn.TransformerConv((4, 6), 5, heads=2, aggr="add")
    assert isinstance(ours, MessagePassing) and ours._alpha is None
    assert repr(ours) == repr(PyGTransformerConv((4, 6), 5, heads=2)) == "TransformerConv((4, 6), 5, heads=2)"
    out, _ = ours((torch.randn(3, 4), torch.randn(2, 6)), torch.tensor([[0, 2], [1, 1]]), return_attention_weights=True)
    assert out.shape == (2, 10) and ours._alpha is None


def _propagate_refused(*args, **kwargs):
    raise AssertionError("PyG's propagate ran instead of the fused kernel")


@pytest.mark.parametrize("device", DEVICES)
def test_path_choice(device, monkeypatch):
    """The fused kernel without explain mode, hooks or another aggregation; PyG's exact path
    (same numbers) with any of them."""
    g = gen(14)
    theirs, ours = _pair(6, 4, device, heads=2, edge_dim=3)
    x = rand_feat((10, 6), torch.float64, device, g)
    edge_index = _graph(10, 10, 35, device, g)
    edge_attr = rand_feat((35, 3), torch.float64, device, g)
    expected = theirs(x, edge_index, edge_attr)
    monkeypatch.setattr(ours, "propagate", _propagate_refused)
    assert rel_error(ours(x, edge_index, edge_attr), expected) <= 1e-12
    monkeypatch.undo()

    seen = []
    handle = ours.register_message_forward_hook(lambda module, inputs, out: seen.append(module._alpha))
    assert rel_error(ours(x, edge_index, edge_attr), expected) <= 1e-12
    assert len(seen) == 1 and seen[0].shape == (35, 2)
    handle.remove()

    ours.explain = True
    ours._edge_mask = torch.zeros(35, device=device, dtype=torch.float64, requires_grad=True)
    masked = ours(x, edge_index, edge_attr)
    theirs.explain = True
    theirs._edge_mask = ours._edge_mask
    assert rel_error(masked, theirs(x, edge_index, edge_attr)) <= 1e-12
    (grad,) = torch.autograd.grad(masked.square().sum(), ours._edge_mask)
    assert grad.abs().sum() > 0
    ours.explain = theirs.explain = False

    summed = edgedot.nn.TransformerConv(6, 4, heads=2, edge_dim=3, aggr="mean").to(device, torch.float64)
    summed.load_state_dict(ours.state_dict())
    mean_theirs = PyGTransformerConv(6, 4, heads=2, edge_dim=3, aggr="mean").to(device, torch.float64)
    mean_theirs.load_state_dict(ours.state_dict())
    assert rel_error(summed(x, edge_index, edge_attr), mean_theirs(x, edge_index, edge_attr)) <= 1e-12


@pytest.mark.parametrize("device", DEVICES)
def test_flow_target_to_source(device):
    g = gen(15)
    theirs, ours = _pair(6, 4, device, heads=2, flow="target_to_source")
    x = rand_feat((10, 6), torch.float64, device, g)
    edge_index = _graph(10, 10, 35, device, g)
    assert rel_error(ours(x, edge_index), theirs(x, edge_index)) <= 1e-12


def check_gnn_explainer_edge_mask(conv):
    """GNNExplainer trains its edge mask through two layers of class ``conv`` (it needs gradients
    to the mask): the mask it returns is not all zeros."""
    from torch_geometric.explain import Explainer, GNNExplainer

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = conv(3, 8, heads=2)
            self.conv2 = conv(16, 4)

        def forward(self, x, edge_index):
            return self.conv2(self.conv1(x, edge_index).relu(), edge_index)

    torch.manual_seed(0)
    g = gen(16)
    x, edge_index = rand_feat((12, 3), g=g), _graph(12, 12, 40, "cpu", g)
    explainer = Explainer(Model(), GNNExplainer(epochs=3), explanation_type="model", edge_mask_type="object",
                          node_mask_type="attributes",
                          model_config=dict(mode="multiclass_classification", task_level="node", return_type="raw"))
    explanation = explainer(x, edge_index, index=2)
    assert explanation.edge_mask.shape == (40,)
    assert explanation.edge_mask.abs().sum() > 0


def test_gnn_explainer_gets_edge_gradients():
    check_gnn_explainer_edge_mask(edgedot.nn.TransformerConv)


def test_attention_explainer_collects_attention():
    from torch_geometric.explain import AttentionExplainer, Explainer

    torch.manual_seed(0)
    g = gen(17)
    model = edgedot.nn.TransformerConv(3, 4, heads=2)
    x, edge_index = rand_feat((12, 3), g=g), _graph(12, 12, 40, "cpu", g)
    explainer = Explainer(model, AttentionExplainer(), explanation_type="model", edge_mask_type="object",
                          model_config=dict(mode="multiclass_classification", task_level="node", return_type="raw"))
    explanation = explainer(x, edge_index)
    _, (_, alpha) = model(x, edge_index, return_attention_weights=True)
    # AttentionExplainer's default reduction: the maximum over the heads.
    torch.testing.assert_close(explanation.edge_mask, alpha.max(dim=-1).values)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=dtype_id)
@pytest.mark.parametrize("device", DEVICES)
def test_torchscript(device, dtype):
    """A scripted module holding the layer runs the fused op too: the eager module's numbers
    bit for bit (PyG's tests compare them with allclose's default tolerance); dropout works in
    training mode there."""
    g = gen(18)
    _, ours = _pair(6, 4, device, heads=2, edge_dim=3, beta=True, dropout=0.3)
    ours = ours.to(dtype).eval()
    x = rand_feat((10, 6), dtype, device, g)
    edge_index = _graph(10, 10, 35, device, g)
    edge_attr = rand_feat((35, 3), dtype, device, g)

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = ours

        def forward(self, x: torch.Tensor, edge_index: torch.Tensor, edge_attr: torch.Tensor):
            return self.conv(x, edge_index, edge_attr, return_attention_weights=True)

    scripted = torch.jit.script(Holder())
    assert "edgedot::graph_attention" in str(scripted.inlined_graph)
    out, (ei, alpha) = scripted(x, edge_index, edge_attr)
    out_eager, (_, alpha_eager) = ours(x, edge_index, edge_attr, return_attention_weights=True)
    assert ei is edge_index and torch.equal(out, out_eager) and torch.equal(alpha, alpha_eager)
    scripted.train()
    dropped, _ = scripted(x, edge_index, edge_attr)
    assert dropped.shape == out.shape and not torch.equal(dropped, out)


def check_to_hetero_matches_pyg(ours_cls, theirs_cls, tol, **layer_kwargs):
    """to_hetero duplicates the layer per edge type and sums what each destination type
    receives: with PyG's weights loaded, the same outputs (within ``tol``) as PyG's layer in the
    same model."""
    from torch_geometric.data import HeteroData
    from torch_geometric.nn import to_hetero

    g = gen(19)
    data = HeteroData()
    data["paper"].x = rand_feat((9, 6), torch.float64, g=g)
    data["author"].x = rand_feat((7, 6), torch.float64, g=g)
    data["paper", "cites", "paper"].edge_index = _graph(9, 9, 20, "cpu", g)
    data["author", "writes", "paper"].edge_index = _graph(7, 9, 15, "cpu", g)
    data["paper", "rev_writes", "author"].edge_index = _graph(9, 7, 15, "cpu", g)

    def model(conv_cls):
        class Model(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.conv1 = conv_cls((6, 6), 8, heads=2, **layer_kwargs)
                self.conv2 = conv_cls((16, 16), 3, **layer_kwargs)

            def forward(self, x, edge_index):
                return self.conv2(self.conv1(x, edge_index).relu(), edge_index)

        return to_hetero(Model(), data.metadata(), aggr="sum").double()

    theirs, ours = model(theirs_cls), model(ours_cls)
    ours.load_state_dict(theirs.state_dict())
    out, out_p = ours(data.x_dict, data.edge_index_dict), theirs(data.x_dict, data.edge_index_dict)
    assert out.keys() == out_p.keys()
    for key in out:
        assert rel_error(out[key], out_p[key]) <= tol, key


def test_to_hetero_matches_pyg():
    check_to_hetero_matches_pyg(edgedot.nn.TransformerConv, PyGTransformerConv, 1e-12)


def test_without_pyg():
    """With torch_geometric not importable, the layer is a torch.nn.Module on the fused path
    with PyG's initialisation; a PyG state dict saved beforehand gives PyG's output."""
    g = gen(20)
    theirs, _ = _pair(6, 4, "cpu", heads=2, edge_dim=3, beta=True)
    x = rand_feat((10, 6), torch.float64, g=g)
    edge_index = _graph(10, 10, 35, "cpu", g)
    edge_attr = rand_feat((35, 3), torch.float64, g=g)
    torch.manual_seed(7)
    fresh = PyGTransformerConv(6, 4, heads=2, edge_dim=3, beta=True)
    script = """
import sys, torch
sys.modules["torch_geometric"] = None  # import torch_geometric raises ImportError
import edgedot.nn
from edgedot.nn import _pyg
state, x, edge_index, edge_attr, fresh = torch.load(sys.argv[1])
assert not _pyg.HAVE_PYG
torch.manual_seed(7)
layer = edgedot.nn.TransformerConv(6, 4, heads=2, edge_dim=3, beta=True)
for name, tensor in fresh.items():
    assert torch.allclose(layer.state_dict()[name], tensor, rtol=1e-6, atol=0), name
layer = layer.double()
layer.load_state_dict(state)
torch.save(layer(x, edge_index, edge_attr), sys.argv[2])
"""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        torch.save((theirs.state_dict(), x, edge_index, edge_attr, fresh.state_dict()), f"{tmp}/in.pt")
        subprocess.run([sys.executable, "-c", script, f"{tmp}/in.pt", f"{tmp}/out.pt"], check=True)
        out = torch.load(f"{tmp}/out.pt")
    assert rel_error(out, theirs(x, edge_index, edge_attr)) <= 1e-12


@pytest.mark.parametrize("device", DEVICES)
def test_inner_product_decoder_matches_pyg(device):
    """PyG's decoder's numbers in float64 on a [2, E] tensor and an EdgeIndex; a scripted
    decoder (forward and forward_all) gives the eager one's."""
    from torch_geometric.nn.models import InnerProductDecoder as PyGDecoder

    g = gen(21)
    z = rand_feat((12, 5), torch.float64, device, g)
    edge_index = _graph(12, 12, 30, device, g)
    ours, theirs = edgedot.nn.InnerProductDecoder(), PyGDecoder()
    assert repr(ours) == repr(theirs)
    for sigmoid in (True, False):
        expected = theirs(z, edge_index, sigmoid=sigmoid)
        assert rel_error(ours(z, edge_index, sigmoid=sigmoid), expected) <= 1e-12
        assert rel_error(ours(z, EdgeIndex(edge_index, sparse_size=(12, 12)), sigmoid=sigmoid), expected) <= 1e-12
    scripted = torch.jit.script(ours)
    z32 = z.float()
    if device == "cpu":  # the same op on the CPU: bit for bit
        assert torch.equal(scripted(z32, edge_index), ours(z32, edge_index))
    torch.testing.assert_close(scripted(z32, edge_index), ours(z32, edge_index))
    assert torch.equal(scripted.forward_all(z32, False), ours.forward_all(z32, False))
