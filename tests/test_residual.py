"""The attention functions' ``residual``: a skip connection or a bias added to the output, on CUDA by
the kernel as it stores the output (and taken out of the backward's ``<grad_out, out>`` again).
Against float64 references of ``op(...) + residual`` on every device, dtype and form of residual;
hubs whose chunks are merged, rows without edges, E = 0; bitwise reproducible; ``create_graph``;
errors naming it; and the layers that pass their bias or skip connection on CUDA."""

import pytest
import torch

import edgedot
from edgedot.ops import column_sum
from edgedot.ops.gat import gat_layer_attention
from utils import (DEVICES, FEAT_DTYPES, PATHS_AGREE, close_or_zero, dtype_id, fill_cuda_cache_with_nan, gen, rand_feat,
                   rand_index, rel_error, requires_cuda)

NUM_SRC, NUM_DST, HEADS, CHANNELS = 30, 40, 2, 8
# Destinations past this row get no edge: their output is the residual alone.
EDGE_ROWS = NUM_DST - 5

# name -> (call(features, src, dst, **options), feature shapes, rows of the output).
OPS = {
    "graph_attention": (lambda f, s, d, **kw: edgedot.graph_attention(*f, s, d, **kw),
                        [(NUM_DST, HEADS, CHANNELS), (NUM_SRC, HEADS, CHANNELS), (NUM_SRC, HEADS, CHANNELS)], NUM_DST),
    "gat_attention": (lambda f, s, d, **kw: edgedot.gat_attention(*f, s, d, **kw),
                      [(NUM_SRC, HEADS, CHANNELS), (NUM_SRC, HEADS), (NUM_DST, HEADS)], NUM_DST),
    "gatv2_attention": (lambda f, s, d, **kw: edgedot.gatv2_attention(*f, s, d, **kw),
                        [(NUM_SRC, HEADS, CHANNELS), (NUM_DST, HEADS, CHANNELS), (HEADS, CHANNELS)], NUM_DST),
    # One node set for both sides: NUM_DST nodes.
    "gat_layer_attention": (lambda f, s, d, **kw: gat_layer_attention(*f, s, d, **kw),
                            [(NUM_DST, HEADS, CHANNELS), (HEADS, CHANNELS), (HEADS, CHANNELS)], NUM_DST),
}


def _graph(name, device, hub, g):
    """Edges into rows below EDGE_ROWS; with ``hub`` 1,200 of 3,000 go into row 0 (on CUDA walked in
    chunks, then merged). int32 indices for the hub, int64 otherwise."""
    num_src = NUM_DST if name == "gat_layer_attention" else NUM_SRC
    num_edges = 3000 if hub else 300
    dst = rand_index(EDGE_ROWS, num_edges, torch.int64, device, g)
    if hub:
        dst[:1200] = 0
    src = rand_index(num_src, num_edges, torch.int64, device, g)
    index_dtype = torch.int32 if hub else torch.int64
    return src.to(index_dtype), dst.to(index_dtype)


def _residual(form, rows, dtype, device, g):
    """The residual of a form: ``rows`` [Nd, H, C]; ``strided``, a view of every third row block of a
    wider tensor; ``bias`` [H, C]; ``flat`` [H * C]."""
    if form == "rows":
        return rand_feat((rows, HEADS, CHANNELS), dtype, device, g)
    if form == "strided":
        return rand_feat((rows, 3, HEADS, CHANNELS), dtype, device, g)[:, 1]
    if form == "bias":
        return rand_feat((HEADS, CHANNELS), dtype, device, g)
    return rand_feat((HEADS * CHANNELS,), dtype, device, g)


def _step(call, leaves, residual, src, dst, grad_out, **options):
    """(out, the gradients of leaves and residual) of ``call`` given the residual."""
    features = [t.detach().requires_grad_() for t in leaves]
    res = residual.detach().requires_grad_()
    out = call(features, src, dst, residual=res, **options)
    return out, torch.autograd.grad(out, features + [res], grad_out)


def _unfused_step(call, leaves, residual, src, dst, grad_out, **options):
    """The same with the residual added after the call."""
    features = [t.detach().requires_grad_() for t in leaves]
    res = residual.detach().requires_grad_()
    out = call(features, src, dst, **options)
    out = out + (res if res.dim() == 3 else res.reshape(HEADS, CHANNELS))
    return out, torch.autograd.grad(out, features + [res], grad_out)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FEAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("form", ["rows", "strided", "bias", "flat"])
@pytest.mark.parametrize("hub", [False, True], ids=["", "hub"])
@pytest.mark.parametrize("name", list(OPS))
def test_residual_matches_float64_reference(device, dtype, form, hub, name):
    g = gen(1)
    call, shapes, rows = OPS[name]
    src, dst = _graph(name, device, hub, g)
    leaves = [rand_feat(s, dtype, device, g) for s in shapes]
    residual = _residual(form, rows, dtype, device, g)
    grad_out = rand_feat((rows, HEADS, CHANNELS), dtype, device, g)
    if device == "cuda":
        fill_cuda_cache_with_nan()  # outputs and buffers come from memory that holds NaN
    out, grads = _step(call, leaves, residual, src, dst, grad_out)
    assert out.dtype == dtype and out.shape == (rows, HEADS, CHANNELS)
    ref, ref_grads = _unfused_step(call, [t.double() for t in leaves], residual.double(), src, dst, grad_out.double())
    tol = PATHS_AGREE[dtype]
    assert rel_error(out, ref) <= tol
    # Rows without edges hold the residual itself, exactly.
    empty = (residual if residual.dim() == 3 else residual.reshape(HEADS, CHANNELS).expand(rows, -1, -1))[EDGE_ROWS:]
    assert torch.equal(out[EDGE_ROWS:], empty)
    for k, (a, b) in enumerate(zip(grads, ref_grads)):
        assert a.dtype == dtype and a.shape == b.shape, k
        assert rel_error(a, b) <= tol, (k, rel_error(a, b))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", ["rows", "bias"])
@pytest.mark.parametrize("name", list(OPS))
def test_residual_of_a_graph_without_edges(device, form, name):
    """E = 0: every row is the residual; its gradient is grad_out (a bias's: summed over the rows)."""
    g = gen(2)
    call, shapes, rows = OPS[name]
    leaves = [rand_feat(s, torch.float32, device, g) for s in shapes]
    residual = _residual(form, rows, torch.float32, device, g)
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    grad_out = rand_feat((rows, HEADS, CHANNELS), torch.float32, device, g)
    out, grads = _step(call, leaves, residual, empty, empty, grad_out)
    assert torch.equal(out, residual.expand(rows, -1, -1) if form == "bias" else residual)
    want = grad_out if form == "rows" else grad_out.double().sum(0)
    assert rel_error(grads[-1], want) <= 1e-6


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("name", list(OPS))
def test_cuda_residual_bitwise_reproducible_and_the_same_without_gradients(dtype, name):
    g = gen(3)
    call, shapes, rows = OPS[name]
    src, dst = _graph(name, "cuda", True, g)
    leaves = [rand_feat(s, dtype, "cuda", g) for s in shapes]
    grad_out = rand_feat((rows, HEADS, CHANNELS), dtype, "cuda", g)
    for form in ("rows", "bias"):
        residual = _residual(form, rows, dtype, "cuda", g)
        runs = []
        for _ in range(2):
            torch.manual_seed(7)  # the same dropout draw
            runs.append(_step(call, leaves, residual, src, dst, grad_out, dropout_p=0.3))
        first, second = runs
        for a, b in zip((first[0],) + first[1], (second[0],) + second[1]):
            assert torch.equal(a, b)
        with torch.no_grad():
            plain = call(leaves, src, dst, residual=residual)
        reference = call([t.detach().requires_grad_() for t in leaves], src, dst, residual=residual)
        assert plain.grad_fn is None and torch.equal(plain, reference)


@requires_cuda
@pytest.mark.parametrize("name", list(OPS))
def test_cuda_residual_create_graph(name):
    """A backward recording a graph takes the backward op on out minus the residual: the same
    first-order gradients as the node's own backward."""
    g = gen(4)
    call, shapes, rows = OPS[name]
    src, dst = _graph(name, "cuda", True, g)
    leaves = [rand_feat(s, torch.float64, "cuda", g).requires_grad_() for s in shapes]
    grad_out = rand_feat((rows, HEADS, CHANNELS), torch.float64, "cuda", g)
    for form in ("rows", "bias"):
        residual = _residual(form, rows, torch.float64, "cuda", g).requires_grad_()
        out = call(leaves, src, dst, residual=residual)
        first = torch.autograd.grad(out, leaves + [residual], grad_out, retain_graph=True)
        created = torch.autograd.grad(out, leaves + [residual], grad_out, create_graph=True)
        for a, b in zip(first, created):
            assert rel_error(b, a) <= 1e-12


@pytest.mark.parametrize("device", DEVICES)
def test_residual_errors_name_it(device):
    g = gen(5)
    call, shapes, rows = OPS["graph_attention"]
    leaves = [rand_feat(s, torch.float32, device, g) for s in shapes]
    src, dst = _graph("graph_attention", device, False, g)
    with pytest.raises(TypeError, match="residual must be a tensor"):
        call(leaves, src, dst, residual=[1.0])
    with pytest.raises(TypeError, match="residual must have the output's dtype torch.float32"):
        call(leaves, src, dst, residual=torch.zeros(rows, HEADS, CHANNELS, dtype=torch.float64, device=device))
    for shape in ((rows + 1, HEADS, CHANNELS), (HEADS, CHANNELS + 1), (1, HEADS, CHANNELS), (rows, HEADS * CHANNELS)):
        with pytest.raises(ValueError, match=r"residual must be \[Nd, H, C\]"):
            call(leaves, src, dst, residual=torch.zeros(shape, device=device))
    other = "cpu" if device == "cuda" else ("cuda" if torch.cuda.is_available() else None)
    if other is not None:
        with pytest.raises(ValueError, match="residual is on"):
            call(leaves, src, dst, residual=torch.zeros(rows, HEADS, CHANNELS, device=other))


def _layer_pair(kind, **kwargs):
    torch.manual_seed(0)
    layer = getattr(edgedot.nn, kind)(16, CHANNELS, heads=HEADS, **kwargs)
    cuda = getattr(edgedot.nn, kind)(16, CHANNELS, heads=HEADS, **kwargs)
    cuda.load_state_dict(layer.state_dict())
    return layer, cuda.to("cuda")


def _layer_step(layer, x, edge_index, grad_out):
    layer.zero_grad()
    x = x.detach().requires_grad_()
    out = layer(x, edge_index)
    out.backward(grad_out)
    return [out, x.grad] + [p.grad for p in layer.parameters()]


@requires_cuda
@pytest.mark.parametrize("kind", ["GATConv", "GATv2Conv", "TransformerConv"])
def test_cuda_layers_pass_their_bias_or_skip(monkeypatch, kind):
    """On CUDA, GATConv and GATv2Conv hand their bias to the attention, TransformerConv its skip
    connection: no add of their own, and the CPU layer's output and gradients."""
    from edgedot.nn.transformer_conv import TransformerConv
    layer, cuda = _layer_pair(kind)
    g = gen(6)
    x = rand_feat((60, 16), torch.float32, "cpu", g)
    edge_index = torch.stack([rand_index(60, 400, torch.int64, "cpu", g), rand_index(60, 400, torch.int64, "cpu", g)])
    grad_out = rand_feat((60, HEADS * CHANNELS), torch.float32, "cpu", g)
    want = _layer_step(layer, x, edge_index, grad_out)
    monkeypatch.setattr(column_sum, "add_bias", lambda *args: pytest.fail("the layer added its bias itself"))
    monkeypatch.setattr(TransformerConv, "_combine", lambda *args: pytest.fail("the layer added its skip itself"))
    got = _layer_step(cuda, x.cuda(), edge_index.cuda(), grad_out.cuda())
    for k, (a, b) in enumerate(zip(got, want)):
        # (lin_key's bias gets no gradient in exact arithmetic: a shift of all of a node's scores)
        assert close_or_zero(a.cpu(), b, 1e-5)[0], k


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["graph_attention", "gat_attention"])
def test_residual_under_compile(device, name):
    """torch.compile(fullgraph=True) traces the op and the add: eager's output and gradients, the
    residual's included, for rows and for a bias."""
    torch._dynamo.reset()
    g = gen(7)
    call, shapes, rows = OPS[name]
    src, dst = _graph(name, device, False, g)
    leaves = [rand_feat(s, torch.float32, device, g).requires_grad_() for s in shapes]
    grad_out = rand_feat((rows, HEADS, CHANNELS), torch.float32, device, g)

    def step(residual):
        return call(leaves, src, dst, residual=residual)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for form in ("rows", "bias"):
        residual = _residual(form, rows, torch.float32, device, g).requires_grad_()
        out_c, out_e = compiled(residual), step(residual)
        torch.testing.assert_close(out_c, out_e)
        grads_c = torch.autograd.grad(out_c, leaves + [residual], grad_out)
        grads_e = torch.autograd.grad(out_e, leaves + [residual], grad_out)
        for a, b in zip(grads_c, grads_e):
            torch.testing.assert_close(a, b)
