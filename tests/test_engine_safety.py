"""The attention engine on inputs that must never be read out of range or summed into a wrong
finite value: crafted pointers (huge, overlapping: the chunk slots they imply pass the partial
buffers) and a +inf score inside a hub's chunk, for every score policy."""

import math

import pytest
import torch

import edgedot
from utils import gen, raises_checked, requires_cuda

OPS = ("graph_attention", "gat_attention", "gatv2_attention")


def op_inputs(op, num_src, num_dst, heads, dim, g, device="cuda", dtype=torch.float32):
    def leaf(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(device, dtype).requires_grad_()
    if op == "graph_attention":
        return [leaf(num_dst, heads, dim), leaf(num_src, heads, dim), leaf(num_src, heads, dim)]
    if op == "gat_attention":
        return [leaf(num_src, heads, dim), leaf(num_src, heads), leaf(num_dst, heads)]
    return [leaf(num_src, heads, dim), leaf(num_dst, heads, dim), leaf(heads, dim)]


def sorted_edges(num_src, num_dst, num_edges, g, hub=None, hub_edges=0, device="cuda"):
    src = torch.randint(0, num_src, (num_edges,), generator=g)
    dst = torch.randint(0, num_dst, (num_edges,), generator=g)
    if hub is not None:
        dst[:hub_edges] = hub
    dst, order = torch.sort(dst, stable=True)
    return src[order].to(device), dst.to(device)


@requires_cuda
@pytest.mark.parametrize("op", OPS)
def test_crafted_pointer_unchecked_is_nan_not_a_bad_read(op):
    g = gen(31)
    inputs = op_inputs(op, 20, 3, 2, 8, g)
    src, dst = sorted_edges(20, 3, 8, g)
    ptr = torch.tensor([0, 10**12, 10**12, 8], device="cuda")
    out = getattr(edgedot, op)(*inputs, src, dst, dst_ptr=ptr, check_indices=False)
    out.sum().backward()
    torch.cuda.synchronize()
    assert torch.isnan(out).all()
    with raises_checked(ValueError, match="dst_ptr"):
        getattr(edgedot, op)(*inputs, src, dst, dst_ptr=ptr)


@requires_cuda
@pytest.mark.parametrize("op", OPS)
def test_overlapping_pointer_past_the_partial_buffers_is_nan(op):
    """Every row claims every edge of a hub-sized graph: the chunks this implies outnumber the
    partial slots the schedule sized for E edges, and the merges must not read past them."""
    g = gen(32)
    num_dst, num_edges = 40, 20000
    inputs = op_inputs(op, 300, num_dst, 2, 16, g)
    src, dst = sorted_edges(300, num_dst, num_edges, g)
    ptr = torch.zeros(num_dst + 1, dtype=torch.int64, device="cuda")
    ptr[1::2] = num_edges
    ptr[-1] = num_edges
    out = getattr(edgedot, op)(*inputs, src, dst, dst_ptr=ptr, check_indices=False)
    out.sum().backward()
    torch.cuda.synchronize()
    assert torch.isnan(out).flatten(1).any(1).all()


@requires_cuda
@pytest.mark.parametrize("hub_edges", [0, 5000])
def test_plus_inf_score_in_a_hub_is_nan_as_on_the_cpu(hub_edges):
    g = gen(33)
    num_src, num_dst = 200, 30
    src, dst = sorted_edges(num_src, num_dst, 8000, g, hub=4, hub_edges=hub_edges, device="cpu")
    q, k, v = (torch.randn(n, 1, 8, generator=g) for n in (num_dst, num_src, num_src))
    q[4] = 1.0
    k[src[dst == 4][7]] = math.inf  # one edge of node 4 scores +inf
    cpu = edgedot.graph_attention(q, k, v, src, dst)
    cuda = edgedot.graph_attention(q.cuda(), k.cuda(), v.cuda(), src.cuda(), dst.cuda()).cpu()
    assert torch.isnan(cpu[4]).all() and torch.isnan(cuda[4]).all()
    assert torch.equal(torch.isnan(cpu), torch.isnan(cuda))


@requires_cuda
@pytest.mark.parametrize("hub_edges", [0, 5000])
def test_plus_inf_gat_score_in_a_hub_is_nan(hub_edges):
    g = gen(34)
    num_src, num_dst = 200, 30
    src, dst = sorted_edges(num_src, num_dst, 8000, g, hub=4, hub_edges=hub_edges, device="cpu")
    x, a_src, a_dst = (t.detach() for t in op_inputs("gat_attention", num_src, num_dst, 1, 8, g, device="cpu"))
    a_src[src[dst == 4][7]] = math.inf
    cpu = edgedot.gat_attention(x, a_src, a_dst, src, dst)
    cuda = edgedot.gat_attention(x.cuda(), a_src.cuda(), a_dst.cuda(), src.cuda(), dst.cuda()).cpu()
    assert torch.isnan(cuda[4]).all()
    assert torch.equal(torch.isnan(cpu), torch.isnan(cuda))


@pytest.mark.parametrize("op", OPS)
def test_rows_at_the_int32_limit_are_refused(op):
    """The chunk schedule scans num_rows + 1 int32 counts: 2**31 - 1 rows would wrap it."""
    rows = 2**31 - 1
    src = dst = torch.zeros(4, dtype=torch.long)

    def wide(*shape):
        return torch.zeros(1, *shape[1:]).expand(*shape)
    if op == "graph_attention":
        args = (wide(rows, 1, 4), wide(3, 1, 4), wide(3, 1, 4))
    elif op == "gat_attention":
        args = (wide(3, 1, 4), wide(3, 1), wide(rows, 1))
    else:
        args = (wide(3, 1, 4), wide(rows, 1, 4), wide(1, 4))
    with raises_checked(ValueError, match="rows|nodes"):
        getattr(edgedot, op)(*args, src, dst)
