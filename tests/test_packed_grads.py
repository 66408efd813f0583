"""Projections of one input by one GEMM, split into column blocks
(``edgedot.ops.column_sum.linear_sides``), and the attention ops' gradients of such blocks, which
on CUDA they write into one buffer for the GEMMs' backward: the same bits as through ``unbind`` and
separate tensors, long rows (merged chunks) included."""

import pytest
import torch

import edgedot
from edgedot.ops.column_sum import linear, linear_sides
from edgedot.runtime.build import cuda_module
from utils import DEVICES, dtype_id, gen, rand_feat, requires_cuda

ROWS, IN, WIDTH = 700, 40, 24


def _linear_grads(split, inputs, grad_outputs):
    """The blocks ``split(x, weight, bias)`` gives and the gradients of x, weight and bias for
    ``grad_outputs`` (None: that block gets no gradient)."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    blocks = split(*leaves)
    wanted = [(b, g) for b, g in zip(blocks, grad_outputs) if g is not None]
    grads = torch.autograd.grad([b for b, _ in wanted], leaves, [g for _, g in wanted])
    return [b.detach() for b in blocks] + list(grads)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sides", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_linear_sides_as_unbind(device, sides, dtype):
    """Blocks and gradients as ``linear(...).view(...).unbind(1)``'s, bit for bit, whether the
    blocks' gradients are separate tensors, the column blocks of one buffer, or absent for one."""
    g = gen(0)
    inputs = (rand_feat((ROWS, IN), dtype, device, g), rand_feat((sides * WIDTH, IN), dtype, device, g),
              rand_feat((sides * WIDTH,), dtype, device, g))
    separate = [rand_feat((ROWS, WIDTH), dtype, device, g) for _ in range(sides)]
    buffer = torch.stack(separate, 1)  # [ROWS, sides, WIDTH]: the blocks of one [ROWS, sides * WIDTH]
    blocks = list(buffer.view(ROWS, sides * WIDTH).view(ROWS, sides, WIDTH).unbind(1))
    assert blocks[1].data_ptr() - blocks[0].data_ptr() == WIDTH * buffer.element_size()

    def unbound(x, weight, bias):
        return list(linear(x, weight, bias).view(ROWS, sides, -1).unbind(1))

    def split(x, weight, bias):
        return linear_sides(x, weight, bias, sides)

    for grad_outputs in (separate, blocks, [None] + separate[1:]):
        want = _linear_grads(unbound, inputs, grad_outputs)
        got = _linear_grads(split, inputs, grad_outputs)
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and torch.equal(a, b)


@requires_cuda
def test_linear_sides_on_cuda_are_views_of_one_node():
    """On CUDA the blocks are views of one result with the extension's node as their grad_fn;
    autocast casts as for ``F.linear``; a weight that does not split is refused."""
    g = gen(1)
    x = rand_feat((ROWS, IN), torch.float32, "cuda", g)
    weight = rand_feat((3 * WIDTH, IN), torch.float32, "cuda", g).requires_grad_()
    bias = rand_feat((3 * WIDTH,), torch.float32, "cuda", g).requires_grad_()
    blocks = linear_sides(x, weight, bias, 3)
    assert "LinearSidesFunction" in blocks[0].grad_fn.name()
    assert [b.shape for b in blocks] == [(ROWS, WIDTH)] * 3
    assert blocks[2].data_ptr() - blocks[0].data_ptr() == 2 * WIDTH * 4 and blocks[0].stride() == (3 * WIDTH, 1)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert all(b.dtype == torch.bfloat16 for b in linear_sides(x, weight, bias, 3))
    with pytest.raises(ValueError, match="split into 5 sides"):
        cuda_module().linear_sides_autograd(x, weight, bias, 5)


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
@pytest.mark.parametrize("graph", ["uniform", "hubs"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_graph_attention_packed_residual(dtype, graph):
    """A residual that is the fourth side of q, k and v's projection (TransformerConv's skip): its
    gradient, grad_out, comes back beside dq, dk and dv in one [N, 4, H, D] buffer; the output and
    the gradients are those of separate tensors, bit for bit."""
    g = torch.Generator("cuda").manual_seed(5)
    nodes, heads, dim = 3000, 4, 32
    src, dst = _edges(graph, nodes, 20_000, g)
    qkvr = torch.randn(nodes, 4, heads, dim, generator=g, device="cuda").to(dtype).requires_grad_()
    grad_out = torch.randn(nodes, heads, dim, generator=g, device="cuda").to(dtype)

    def attend(q, k, v, residual, src, dst):
        return edgedot.graph_attention(q, k, v, src, dst, residual=residual)

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
