"""The layers' CPU path past the op's checks (edgedot.ops.checked_graph): the same bits as the
public function's path, and every check the op makes that the layer does not guarantee still made,
its error naming the argument."""

import pytest
import torch

import edgedot.nn
from edgedot.ops import checked_graph
from utils import gen, rand_feat, rand_index

pytestmark = pytest.mark.cpu_only  # a CPU path

LAYERS = {"transformer": edgedot.nn.TransformerConv, "gat": edgedot.nn.GATConv, "gatv2": edgedot.nn.GATv2Conv}


@pytest.fixture
def taken(monkeypatch):
    """The answers of checked_graph.attend in the test, True where it took the call."""
    seen = []
    real = checked_graph.attend

    def spy(*args):
        out = real(*args)
        seen.append(out is not None)
        return out
    monkeypatch.setattr(checked_graph, "attend", spy)
    return seen


def _layer(kind, dtype, edge_dim=None, **options):
    torch.manual_seed(0)
    return LAYERS[kind](12, 8, heads=2, edge_dim=edge_dim, **options).to(dtype)


def _graph(num_src, num_dst, num_edges, index_dtype, g):
    edge_index = torch.stack([rand_index(num_src, num_edges, index_dtype, "cpu", g),
                              rand_index(num_dst, num_edges, index_dtype, "cpu", g)])
    edge_index[:, 0] = 3  # a self-loop
    return edge_index


def _step(layer, x, edge_index, edge_attr, want_alpha):
    """Output, attention weights (or None) and every gradient of a forward + backward."""
    layer.zero_grad(set_to_none=True)
    leaves = [t.detach().requires_grad_() for t in (x if isinstance(x, tuple) else (x,))]
    edge_attr = None if edge_attr is None else edge_attr.detach().requires_grad_()
    torch.manual_seed(5)  # the layers' dropout draws from the default generator
    out = layer(tuple(leaves) if isinstance(x, tuple) else leaves[0], edge_index, edge_attr,
                return_attention_weights=True if want_alpha else None)
    leaves.append(edge_attr)
    out, alpha = out if want_alpha else (out, None)
    out.backward(rand_feat(out.shape, out.dtype, "cpu", gen(9)))
    grads = [t.grad for t in leaves if t is not None] + [p.grad for p in layer.parameters()]
    return [out, None if alpha is None else alpha[1]] + grads


def _assert_bitwise(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b)


CASES = [(kind, loops) for kind in ("gat", "gatv2") for loops in (True, False)] + [("transformer", None)]


@pytest.mark.parametrize("kind,loops", CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
@pytest.mark.parametrize("edge_dim", [None, 3], ids=["noedge", "edge"])
@pytest.mark.parametrize("dropout", [0.0, 0.4], ids=["eval", "dropout"])
def test_same_bits_as_the_public_function(monkeypatch, taken, kind, loops, dtype, index_dtype, edge_dim, dropout):
    options = {} if loops is None else {"add_self_loops": loops}
    layer = _layer(kind, dtype, edge_dim, dropout=dropout, **options)
    layer.train(dropout > 0)
    g = gen(1)
    x = rand_feat((30, 12), dtype, "cpu", g)
    edge_index = _graph(30, 30, 120, index_dtype, g)
    edge_attr = rand_feat((120, 3), dtype, "cpu", g) if edge_dim else None
    for want_alpha in (False, True):
        lean = _step(layer, x, edge_index, edge_attr, want_alpha)
        assert taken and all(taken)
        with monkeypatch.context() as m:
            m.setattr(checked_graph, "attend", lambda *args: None)
            public = _step(layer, x, edge_index, edge_attr, want_alpha)
        _assert_bitwise(lean, public)
        taken.clear()


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_bipartite_and_flow_same_bits(monkeypatch, taken, kind):
    """Sources and destinations of their own (a pair of inputs), and target_to_source."""
    g = gen(2)
    x = (rand_feat((30, 12), torch.float64, "cpu", g), rand_feat((20, 12), torch.float64, "cpu", g))
    for flow, (rows_0, rows_1) in (("source_to_target", (30, 20)), ("target_to_source", (20, 30))):
        layer = _layer(kind, torch.float64, flow=flow, **({} if kind == "transformer" else {"add_self_loops": False}))
        edge_index = torch.stack([rand_index(rows_0, 90, torch.int64, "cpu", g),
                                  rand_index(rows_1, 90, torch.int64, "cpu", g)])
        lean = _step(layer, x, edge_index, None, True)
        with monkeypatch.context() as m:
            m.setattr(checked_graph, "attend", lambda *args: None)
            public = _step(layer, x, edge_index, None, True)
        _assert_bitwise(lean, public)
    assert taken == [True, True]


def test_plan_takes_the_public_function(taken):
    layer = _layer("transformer", torch.float32)
    g = gen(3)
    x, edge_index = rand_feat((30, 12), torch.float32, "cpu", g), _graph(30, 30, 100, torch.int64, g)
    plan = edgedot.EdgePlan(edge_index[0], edge_index[1], 30, 30)
    layer(x, edge_index, plan=plan).sum().backward()
    assert taken == []


@pytest.mark.parametrize("kind", sorted(LAYERS))
@pytest.mark.parametrize("row", [0, 1])
@pytest.mark.parametrize("bad", [-1, 30])
def test_index_out_of_range_names_the_row(taken, kind, row, bad):
    layer = _layer(kind, torch.float32)
    g = gen(4)
    x, edge_index = rand_feat((30, 12), torch.float32, "cpu", g), _graph(30, 30, 100, torch.int64, g)
    edge_index[row, 7] = bad
    with pytest.raises(IndexError, match=rf"edge_index\[{row}\] holds {bad}, outside \[0, 30\)"):
        layer(x, edge_index)
    assert taken == []


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_bipartite_index_past_the_smaller_side_is_checked_by_row(kind):
    """Both rows are first checked against the smaller node count at once; an index between the
    two counts is then checked by its row: accepted in the larger side, refused in the smaller."""
    layer = _layer(kind, torch.float32, **({} if kind == "transformer" else {"add_self_loops": False}))
    g = gen(5)
    x = (rand_feat((30, 12), torch.float32, "cpu", g), rand_feat((20, 12), torch.float32, "cpu", g))
    edge_index = torch.stack([rand_index(30, 60, torch.int64, "cpu", g), rand_index(20, 60, torch.int64, "cpu", g)])
    edge_index[0, 3] = 25
    layer(x, edge_index).sum().backward()
    edge_index[1, 3] = 25
    with pytest.raises(IndexError, match=r"edge_index\[1\] holds 25, outside \[0, 20\)"):
        layer(x, edge_index)


def test_float_index_names_the_op_argument(taken):
    layer = _layer("gat", torch.float32)
    x = rand_feat((30, 12), torch.float32, "cpu", gen(6))
    with pytest.raises(TypeError, match="src_idx must be int32 or int64"):
        layer(x, torch.zeros(2, 10))
    layer = _layer("transformer", torch.float32)
    with pytest.raises(TypeError, match="src_idx must be int32 or int64"):
        layer(x, torch.zeros(2, 10))
    assert taken == []


@pytest.mark.parametrize("kind", ["gat", "gatv2"])
@pytest.mark.parametrize("slope,error,match", [(float("inf"), ValueError, "negative_slope must be finite"),
                                                ("0.2", TypeError, "negative_slope must be a real number")])
def test_slope_attribute_checked(taken, kind, slope, error, match):
    layer = _layer(kind, torch.float32)
    layer.negative_slope = slope
    g = gen(7)
    with pytest.raises(error, match=match):
        layer(rand_feat((30, 12), torch.float32, "cpu", g), _graph(30, 30, 100, torch.int64, g))
    assert taken == [False]


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_dropout_attribute_checked(taken, kind):
    layer = _layer(kind, torch.float32, dropout=1.5).train()
    g = gen(8)
    with pytest.raises(ValueError, match=r"dropout_p must lie in \[0, 1\]"):
        layer(rand_feat((30, 12), torch.float32, "cpu", g), _graph(30, 30, 100, torch.int64, g))
    assert taken == [False]


class _DropRows(torch.nn.Module):
    """A swapped projection returning one row fewer than it is given."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)[1:]


class _Double(torch.nn.Module):
    """A swapped projection returning float64."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x).double()


@pytest.mark.parametrize("kind,name", [("gat", "a_edge"), ("gatv2", "edge_feat"), ("transformer", "edge_feat")])
def test_edge_projection_of_wrong_rows_names_the_edge_tensor(taken, kind, name):
    layer = _layer(kind, torch.float32, edge_dim=3, **({} if kind == "transformer" else {"add_self_loops": False}))
    layer.lin_edge = _DropRows(layer.lin_edge)
    g = gen(9)
    with pytest.raises(ValueError, match=name):
        layer(rand_feat((30, 12), torch.float32, "cpu", g), _graph(30, 30, 100, torch.int64, g),
              rand_feat((100, 3), torch.float32, "cpu", g))
    assert taken == [False]


def test_swapped_key_projection_checked(taken):
    g = gen(10)
    x, edge_index = rand_feat((30, 12), torch.float32, "cpu", g), _graph(30, 30, 100, torch.int64, g)
    layer = _layer("transformer", torch.float32)
    layer.lin_key = _DropRows(layer.lin_key)
    with pytest.raises(ValueError, match="k and v must have one row per source node"):
        layer(x, edge_index)
    layer = _layer("transformer", torch.float32)
    layer.lin_key = _Double(layer.lin_key)
    with pytest.raises(TypeError, match="q is torch.float32 but k is torch.float64"):
        layer(x, edge_index)
    assert taken == [False, False]


def test_swapped_value_projection_of_fewer_rows_is_not_read_past(taken):
    """Values of fewer rows than the nodes the graph was checked against: the op checks the graph
    against its own rows and names the index."""
    g = gen(11)
    layer = _layer("transformer", torch.float32)
    layer.lin_key, layer.lin_value = _DropRows(layer.lin_key), _DropRows(layer.lin_value)
    edge_index = _graph(30, 30, 100, torch.int64, g)
    edge_index[0, 5] = 29
    with pytest.raises(IndexError, match="src_idx holds 29, outside"):
        layer(rand_feat((30, 12), torch.float32, "cpu", g), edge_index)
    assert taken == [False]


@pytest.mark.parametrize("kind", sorted(LAYERS))
@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
def test_without_gradients_same_bits(monkeypatch, taken, kind, mode):
    layer = _layer(kind, torch.float32)
    g = gen(12)
    x, edge_index = rand_feat((30, 12), torch.float32, "cpu", g), _graph(30, 30, 100, torch.int32, g)
    with mode():
        lean = layer(x, edge_index)
        monkeypatch.setattr(checked_graph, "attend", lambda *args: None)
        public = layer(x, edge_index)
    assert taken == [True] and not lean.requires_grad
    assert torch.equal(lean, public)


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_frozen_layer_same_bits(monkeypatch, taken, kind):
    """Gradients on but nothing to differentiate (a frozen layer, an input without a gradient):
    the lean call skips the autograd Function and gives the public route's bits."""
    layer = _layer(kind, torch.float32).requires_grad_(False)
    g = gen(13)
    x, edge_index = rand_feat((30, 12), torch.float32, "cpu", g), _graph(30, 30, 100, torch.int64, g)
    lean = layer(x, edge_index)
    monkeypatch.setattr(checked_graph, "attend", lambda *args: None)
    public = layer(x, edge_index)
    assert taken == [True] and lean.grad_fn is None
    assert torch.equal(lean, public)
