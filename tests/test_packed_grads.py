"""Projections of one input by one GEMM, split into column blocks
(``edgedot.ops.column_sum.linear_sides``), and the attention ops' gradients of such blocks, which
on CUDA they write into one buffer for the GEMMs' backward: the same bits as through ``unbind`` and
separate tensors, long rows (merged chunks) included."""

import pytest
import torch

import edgedot
from edgedot.ops.column_sum import linear, linear_sides
from edgedot.runtime.build import cuda_module
from utils import DEVICES, FEAT_DTYPES, dtype_id, fill_cuda_cache_with_nan, gen, rand_feat, requires_cuda

ROWS, IN, WIDTH = 700, 40, 24


def _linear_grads(split, inputs, grad_outputs):
    """The blocks ``split(x, weights, biases)`` gives and the gradients of x, the weights and the
    biases for ``grad_outputs`` (None: that block gets no gradient); ``inputs``: (x, weights,
    biases)."""
    x, weights, biases = inputs
    leaves = [t.detach().clone().requires_grad_() for t in [x, *weights, *biases]]
    count = len(weights)
    blocks = split(leaves[0], leaves[1:1 + count], leaves[1 + count:])
    wanted = [(b, g) for b, g in zip(blocks, grad_outputs) if g is not None]
    grads = torch.autograd.grad([b for b, _ in wanted], leaves, [g for _, g in wanted])
    return [b.detach() for b in blocks] + list(grads)


def _unbound(heads):
    """The reference of linear_sides: one F.linear of the joined weights, viewed and unbound."""
    def split(x, weights, biases):
        bias = torch.cat(biases) if biases else None
        return list(linear(x, torch.cat(weights), bias).view(x.shape[0], len(weights), heads, -1).unbind(1))
    return split


def _sides_inputs(sides, dtype, device, g, bias=True):
    return (rand_feat((ROWS, IN), dtype, device, g), [rand_feat((WIDTH, IN), dtype, device, g) for _ in range(sides)],
            [rand_feat((WIDTH,), dtype, device, g) for _ in range(sides)] if bias else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sides", [2, 3, 4])
@pytest.mark.parametrize("heads", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_linear_sides_as_unbind(device, sides, heads, dtype):
    """Blocks [rows, heads, width / heads] and gradients of x, every weight and every bias as one
    ``linear`` of the joined weights viewed and unbound, bit for bit, whether the blocks' gradients
    are separate tensors, the blocks of one buffer, or absent for one."""
    g = gen(0)
    inputs = _sides_inputs(sides, dtype, device, g)
    separate = [rand_feat((ROWS, heads, WIDTH // heads), dtype, device, g) for _ in range(sides)]
    buffer = torch.stack(separate, 1)  # [ROWS, sides, heads, WIDTH / heads]: the blocks of one result
    blocks = list(buffer.unbind(1))
    assert blocks[1].data_ptr() - blocks[0].data_ptr() == WIDTH * buffer.element_size()

    def split(x, weights, biases):
        return linear_sides(x, weights, biases, heads)

    for grad_outputs in (separate, blocks, [None] + separate[1:]):
        want = _linear_grads(_unbound(heads), inputs, grad_outputs)
        got = _linear_grads(split, inputs, grad_outputs)
        assert len(got) == len(want) == 1 + 3 * sides
        for a, b in zip(got, want):
            assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_linear_sides_without_bias_and_partial_grads(device):
    """No biases; only some parameters wanting a gradient: the others get none, the rest the
    reference's bits."""
    g = gen(3)
    x, weights, _ = _sides_inputs(3, torch.float32, device, g, bias=False)
    x = x.requires_grad_()
    weights = [w.requires_grad_(i != 1) for i, w in enumerate(weights)]
    grad = [rand_feat((ROWS, 2, WIDTH // 2), torch.float32, device, g) for _ in range(3)]
    got = linear_sides(x, weights, None, 2)
    want = _unbound(2)(x, weights, [])
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    leaves = [x, weights[0], weights[2]]
    got_grads = torch.autograd.grad(got, leaves, grad)
    want_grads = torch.autograd.grad(want, leaves, grad)
    for a, b in zip(got_grads, want_grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_linear_sides_errors_name_the_argument(device):
    """Weights of different shapes, a head count that does not divide their width, or biases that
    do not fit raise ValueError naming the argument, on every path."""
    g = gen(6)
    x, weights, biases = _sides_inputs(2, torch.float32, device, g)
    weights = [w.requires_grad_() for w in weights]
    biases = [b.requires_grad_() for b in biases]
    with pytest.raises(ValueError, match="heads"):
        linear_sides(x, weights, biases, 5)
    with pytest.raises(ValueError, match="weights"):
        linear_sides(x, [weights[0], weights[1][:12]], biases, 1)
    with pytest.raises(ValueError, match="bias"):
        linear_sides(x, weights, biases[:1], 1)


@requires_cuda
def test_linear_sides_on_cuda_are_views_of_one_node():
    """On CUDA the blocks are views of one result with the extension's node as their grad_fn (no
    concatenation or view nodes); weights or biases that do not fit are refused, naming them."""
    g = gen(1)
    x, weights, biases = _sides_inputs(3, torch.float32, "cuda", g)
    weights = [w.requires_grad_() for w in weights]
    biases = [b.requires_grad_() for b in biases]
    blocks = linear_sides(x, weights, biases, 4)
    assert all("LinearSidesFunction" in b.grad_fn.name() for b in blocks)
    assert [b.shape for b in blocks] == [(ROWS, 4, WIDTH // 4)] * 3
    assert blocks[2].data_ptr() - blocks[0].data_ptr() == 2 * WIDTH * 4 and blocks[0].stride() == (3 * WIDTH, 6, 1)
    ext = cuda_module()
    with pytest.raises(ValueError, match="width a multiple of heads = 5"):
        ext.linear_sides_autograd(x, weights, biases, 5, False)
    with pytest.raises(ValueError, match=r"weights of one shape \[width, 40\]"):
        ext.linear_sides_autograd(x, [weights[0], weights[1][:12]], biases[:2], 1, False)
    with pytest.raises(ValueError, match="one per weight"):
        ext.linear_sides_autograd(x, weights, biases[:2], 1, False)
    with pytest.raises(ValueError, match=r"biases \[24\]"):
        ext.linear_sides_autograd(x, weights[:1], [biases[0][:5]], 1, False)


@requires_cuda
def test_linear_sides_under_autocast():
    """float32 parameters under bfloat16 autocast: blocks in bfloat16 and every gradient, in the
    parameters' dtype, the bits of F.linear's path under autocast."""
    g = gen(4)
    inputs = _sides_inputs(3, torch.float32, "cuda", g)
    grads = [rand_feat((ROWS, 2, WIDTH // 2), torch.bfloat16, "cuda", g) for _ in range(3)]

    def split(x, weights, biases):
        return linear_sides(x, weights, biases, 2)

    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = _linear_grads(split, inputs, grads)
        want = _linear_grads(_unbound(2), inputs, grads)
    assert all(b.dtype == torch.bfloat16 for b in got[:3]) and all(t.dtype == torch.float32 for t in got[3:])
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)


@requires_cuda
def test_linear_sides_second_derivatives():
    """A backward that records a graph reaches the weights through their concatenation: a penalty
    on x's gradient gives the weights' gradients of the reference's path."""
    g = gen(5)
    inputs = _sides_inputs(2, torch.float32, "cuda", g)
    grads = [rand_feat((ROWS, 1, WIDTH), torch.float32, "cuda", g) for _ in range(2)]
    results = []
    for split in (lambda x, w, b: linear_sides(x, w, b, 1), _unbound(1)):
        x, weights, biases = [t.detach().clone().requires_grad_() for t in [inputs[0]]] + \
            [[t.detach().clone().requires_grad_() for t in ts] for ts in inputs[1:]]
        dx, = torch.autograd.grad(split(x, weights, biases), x, grads, create_graph=True)
        results.append(torch.autograd.grad(dx.square().sum(), weights))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def _hub_graph(num_nodes, num_edges, g):
    """Uniform edges, then a destination and a source of thousands of edges each (long rows on both
    sides: chunks and their merges)."""
    src = torch.randint(num_nodes, (num_edges,), generator=g, device="cuda")
    dst = torch.randint(num_nodes, (num_edges,), generator=g, device="cuda")
    dst[:num_edges // 5] = 7
    src[num_edges // 5:2 * num_edges // 5] = 11
    return src, dst


def _edges(graph, num_nodes, num_edges, g):
    """(src, dst) of a uniform graph, or of ``_hub_graph`` for ``graph == "hubs"``."""
    if graph == "hubs":
        return _hub_graph(num_nodes, num_edges, g)
    return (torch.randint(num_nodes, (num_edges,), generator=g, device="cuda"),
            torch.randint(num_nodes, (num_edges,), generator=g, device="cuda"))


def _packed_and_separate(op, packed, rest, src, dst, grad_out):
    """``op`` on the sides of ``packed`` ([N, sides, H, D]) and on separate copies of them: each
    call's output and its gradients of the sides."""
    sides = packed.unbind(1)
    out = op(*sides, *rest, src, dst)
    got = torch.autograd.grad(out, sides, grad_out)
    copies = [s.detach().clone().requires_grad_() for s in sides]
    out_copies = op(*copies, *rest, src, dst)
    want = torch.autograd.grad(out_copies, copies, grad_out)
    return (out, got), (out_copies, want)


def _assert_packed(grads, heads, dim):
    count = len(grads)
    size = grads[0].element_size()
    for i, grad in enumerate(grads):
        assert grad.stride() == (count * heads * dim, dim, 1)
        assert grad.data_ptr() - grads[0].data_ptr() == i * heads * dim * size


@requires_cuda
@pytest.mark.parametrize("graph", ["uniform", "hubs"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_graph_attention_packed_gradients(dtype, graph):
    """q, k and v as the sides of one [N, 3, H, D] projection: dq, dk and dv come back as the
    sides of one buffer, with the bits of separate q, k and v."""
    g = torch.Generator("cuda").manual_seed(2)
    nodes, heads, dim = 3000, 4, 32
    src, dst = _edges(graph, nodes, 20_000, g)
    qkv = torch.randn(nodes, 3, heads, dim, generator=g, device="cuda").to(dtype).requires_grad_()
    grad_out = torch.randn(nodes, heads, dim, generator=g, device="cuda").to(dtype)
    (out, got), (out_copies, want) = _packed_and_separate(edgedot.graph_attention, qkv, (), src, dst, grad_out)
    _assert_packed(got, heads, dim)
    assert torch.equal(out, out_copies)
    for a, b in zip(got, want):
        assert b.is_contiguous() and torch.equal(a, b)


@requires_cuda
@pytest.mark.parametrize("graph", ["uniform", "hubs", "empty_rows", "no_edges"])
@pytest.mark.parametrize("dtype", FEAT_DTYPES, ids=dtype_id)
def test_graph_attention_packed_residual(dtype, graph):
    """A residual that is the fourth side of q, k and v's projection (TransformerConv's skip): its
    gradient, grad_out, comes back beside dq, dk and dv in one [N, 4, H, D] buffer, written by the
    backward's dst pass for every row, rows without edges too (into memory the cache filled with
    NaN); the output and the gradients are those of separate tensors, bit for bit."""
    g = torch.Generator("cuda").manual_seed(5)
    nodes, heads, dim = 3000, 4, 32
    if graph == "empty_rows":  # destinations in the first third only
        src = torch.randint(nodes, (20_000,), generator=g, device="cuda")
        dst = torch.randint(nodes // 3, (20_000,), generator=g, device="cuda")
    elif graph == "no_edges":
        src = dst = torch.empty(0, dtype=torch.int64, device="cuda")
    else:
        src, dst = _edges(graph, nodes, 20_000, g)
    qkvr = torch.randn(nodes, 4, heads, dim, generator=g, device="cuda").to(dtype).requires_grad_()
    grad_out = torch.randn(nodes, heads, dim, generator=g, device="cuda").to(dtype)

    def attend(q, k, v, residual, src, dst):
        return edgedot.graph_attention(q, k, v, src, dst, residual=residual)

    fill_cuda_cache_with_nan()
    (out, got), (out_copies, want) = _packed_and_separate(attend, qkvr, (), src, dst, grad_out)
    _assert_packed(got, heads, dim)
    assert torch.equal(out, out_copies) and torch.equal(got[3], grad_out)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@requires_cuda
@pytest.mark.parametrize("graph", ["uniform", "hubs"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_gatv2_packed_gradients(dtype, graph):
    """GATv2's x_src and x_dst as the sides of one [N, 2, H, C] projection: their gradients come
    back as the sides of one buffer, with the bits of separate inputs; att's gradient unchanged."""
    g = torch.Generator("cuda").manual_seed(3)
    nodes, heads, dim = 3000, 4, 32
    src, dst = _edges(graph, nodes, 20_000, g)
    both = torch.randn(nodes, 2, heads, dim, generator=g, device="cuda").to(dtype).requires_grad_()
    att = torch.randn(heads, dim, generator=g, device="cuda").to(dtype).requires_grad_()
    grad_out = torch.randn(nodes, heads, dim, generator=g, device="cuda").to(dtype)
    (out, got), (out_copies, want) = _packed_and_separate(edgedot.gatv2_attention, both, (att,), src, dst, grad_out)
    _assert_packed(got, heads, dim)
    assert torch.equal(out, out_copies)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@requires_cuda
def test_packed_sides_need_the_layout():
    """Sides of another layout (k before q, or a gap between them) get separate gradients; so does a
    backward that records a graph (the registered op's outputs never alias)."""
    g = torch.Generator("cuda").manual_seed(4)
    nodes, heads, dim = 500, 2, 16
    src = torch.randint(nodes, (3000,), generator=g, device="cuda")
    dst = torch.randint(nodes, (3000,), generator=g, device="cuda")
    qkv = torch.randn(nodes, 3, heads, dim, generator=g, device="cuda", requires_grad=True)
    wide = torch.randn(nodes, 4, heads, dim, generator=g, device="cuda", requires_grad=True)
    grad_out = torch.randn(nodes, heads, dim, generator=g, device="cuda")
    q, k, v = qkv.unbind(1)
    for sides in ((k, q, v), (wide[:, 0], wide[:, 2], wide[:, 3])):
        grads = torch.autograd.grad(edgedot.graph_attention(*sides, src, dst), sides, grad_out)
        assert all(t.is_contiguous() for t in grads)
    grads = torch.autograd.grad(edgedot.graph_attention(q, k, v, src, dst), (q, k, v), grad_out, create_graph=True)
    assert all(t.is_contiguous() for t in grads)
