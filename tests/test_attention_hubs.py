"""graph_attention on power-law graphs and on edges given grouped by destination: long rows split
into chunks and merged (CUDA), ``dst_ptr`` (no per-call sort), its checks, and the backward that
skips the grouping by source when k and v need no gradient."""

import math

import pytest
import torch

import edgedot
from edgedot.ops import attention as attention_ops
from test_attention_cuda import full_check, grouping, inputs, run
from utils import (DEVICES, FEAT_DTYPES, INDEX_DTYPES, count_graph_checks, dtype_id, gen, launched_kernels,
                   raises_checked, rand_feat, requires_cuda)


def sorted_graph(num_src, num_dst, num_edges, device, g, index_dtype=torch.int64, hub=None, hub_edges=0):
    """Random edges sorted by destination (stable), optionally hub_edges of them into node hub."""
    src = torch.randint(0, num_src, (num_edges,), generator=g)
    dst = torch.randint(0, num_dst, (num_edges,), generator=g)
    if hub is not None:
        dst[:hub_edges] = hub
    dst, order = torch.sort(dst, stable=True)
    return src[order].to(device, index_dtype), dst.to(device, index_dtype)


def features(num_src, num_dst, heads, dim, dtype, device, g, requires_grad=True):
    return [rand_feat((n, heads, dim), dtype, device, g).requires_grad_(requires_grad)
            for n in (num_dst, num_src, num_src)]


def small_sorted_case(seed, num_edges, device, num_src=20, num_dst=10, heads=2, dim=8):
    """(q, k, v, src, dst, dst_ptr) of a small float32 graph sorted by destination."""
    g = gen(seed)
    q, k, v = features(num_src, num_dst, heads, dim, torch.float32, device, g, requires_grad=False)
    src, dst = sorted_graph(num_src, num_dst, num_edges, device, g)
    return q, k, v, src, dst, edgedot.index_to_ptr(dst, num_dst)


# ------------------------------------------------------------------------------ index_to_ptr


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=dtype_id)
def test_index_to_ptr(device, index_dtype):
    idx = torch.tensor([0, 0, 2, 2, 2, 5], device=device, dtype=index_dtype)
    ptr = edgedot.index_to_ptr(idx, 7)
    assert ptr.tolist() == [0, 2, 2, 5, 5, 5, 6, 6]
    assert edgedot.index_to_ptr(idx[:0], 3).tolist() == [0, 0, 0, 0]
    with raises_checked(TypeError, match="idx"):
        edgedot.index_to_ptr(idx.float(), 7)
    with raises_checked(ValueError, match="num_rows"):
        edgedot.index_to_ptr(idx, -1)


# ------------------------------------------------------------------------------ dst_ptr: results


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("ptr_dtype", INDEX_DTYPES, ids=dtype_id)
def test_dst_ptr_matches_unsorted_call(device, index_dtype, ptr_dtype):
    """Edges given sorted with their pointer: the same outputs and gradients as the plain call
    (bitwise on CUDA: the kernels walk the same positions), with edge features and dropout."""
    g = gen(1)
    num_src, num_dst, heads, dim = 70, 50, 3, 16
    src, dst = sorted_graph(num_src, num_dst - 3, 900, device, g, index_dtype, hub=4, hub_edges=400)
    ef = rand_feat((900, heads, dim), torch.float32, device, g).requires_grad_()
    grad_out = rand_feat((num_dst, heads, dim), torch.float32, device, g)
    ptr = edgedot.index_to_ptr(dst, num_dst).to(ptr_dtype)
    results = []
    for kwargs in ({}, {"dst_ptr": ptr}):
        leaves = features(num_src, num_dst, heads, dim, torch.float32, device, gen(2)) + [ef]
        torch.manual_seed(3)
        out = edgedot.graph_attention(*leaves[:3], src, dst, edge_feat=ef, dropout_p=0.2, **kwargs)
        grads = torch.autograd.grad(out, leaves, grad_out)
        results.append((out,) + grads)
    for a, b in zip(*results):
        if device == "cuda":
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert (results[0][0][-3:] == 0).all(), "nodes without edges: zeros"


@pytest.mark.parametrize("device", DEVICES)
def test_dst_ptr_return_attention_and_empty_graph(device):
    q, k, v, src, dst, ptr = small_sorted_case(4, 150, device)
    out, alpha = edgedot.graph_attention(q, k, v, src, dst, dst_ptr=ptr, return_attention=True)
    want_out, want_alpha = edgedot.graph_attention(q, k, v, src, dst, return_attention=True)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(alpha, want_alpha)
    empty = src[:0]
    out = edgedot.graph_attention(q, k, v, empty, empty, dst_ptr=torch.zeros(11, dtype=torch.int64, device=device))
    assert (out == 0).all()


# ------------------------------------------------------------------------------ dst_ptr: errors


@pytest.mark.parametrize("device", DEVICES)
def test_dst_ptr_errors(device):
    g = gen(55)
    q, k, v, src, dst, ptr = small_sorted_case(5, 60, device)

    def call(p, d=dst, **kwargs):
        return edgedot.graph_attention(q, k, v, src, d, dst_ptr=p, **kwargs)

    with raises_checked(TypeError, match="dst_ptr"):
        call(ptr.float())
    with raises_checked(TypeError, match="dst_ptr"):
        call([0] * 11)
    with raises_checked(ValueError, match="dst_ptr"):
        call(ptr[:-1])
    with raises_checked(ValueError, match="dst_ptr"):
        call(ptr[None])
    bad = ptr.clone()
    bad[-1] -= 1  # ends before E: the last edge would be dropped
    with raises_checked(ValueError, match="dst_ptr must rise from 0"):
        call(bad)
    bad = ptr.clone()
    bad[0] = 1
    with raises_checked(ValueError, match="dst_ptr must rise from 0"):
        call(bad)
    bad = ptr.clone()
    bad[4] = int(ptr[5]) + 1  # then decreases
    with raises_checked(ValueError, match="dst_ptr must rise from 0"):
        call(bad)
    shuffled = dst[torch.randperm(60, generator=g).to(device)]  # not sorted: disagrees with ptr
    with raises_checked(ValueError, match="dst_ptr disagrees with dst_idx"):
        call(ptr, shuffled)
    plan = edgedot.EdgePlan(src, dst, 20, 10)
    with raises_checked(ValueError, match="plan or dst_ptr"):
        call(ptr, plan=plan)
    # The CPU checks whatever check_indices says.
    if device == "cpu":
        with raises_checked(ValueError, match="dst_ptr disagrees"):
            call(ptr, shuffled, check_indices=False)


@pytest.mark.parametrize("device", DEVICES)
def test_dst_ptr_checked_once_per_tensor(device, monkeypatch):
    """On CUDA the pointer is checked against dst_idx once (in the one fused check of the call),
    then remembered until either changes; the CPU, which remembers nothing, checks every call."""
    q, k, v, src, dst, ptr = small_sorted_case(6, 60, device)
    calls = count_graph_checks(monkeypatch)
    for _ in range(3):
        edgedot.graph_attention(q, k, v, src, dst, dst_ptr=ptr)
    checked = 3 if device == "cpu" else 1
    assert len(calls) == checked
    dst[0] = 0  # in place: checked again (still valid)
    edgedot.graph_attention(q, k, v, src, dst, dst_ptr=ptr)
    assert len(calls) == checked + 1
    dst[-1] = 0  # now disagrees
    with raises_checked(ValueError, match="dst_ptr disagrees"):
        edgedot.graph_attention(q, k, v, src, dst, dst_ptr=ptr)


# ------------------------------------------------------------------------------ kv_grad


@pytest.mark.parametrize("device", DEVICES)
def test_backward_without_key_value_gradients(device, monkeypatch):
    """k and v without gradients: the backward computes dq alone (kv_grad False: on CUDA no source
    pass runs) and it equals the full backward's dq. (An eager CPU backward calls the
    implementation itself, with what its forward kept; an eager CUDA one is the extension's.)"""
    g = gen(7)
    q, k, v = features(30, 20, 2, 8, torch.float32, device, g, requires_grad=False)
    src, dst = sorted_graph(30, 20, 200, device, g)
    grad_out = rand_feat((20, 2, 8), torch.float32, device, g)
    seen = []
    if device == "cpu":
        real = attention_ops._backward_on_cpu
        monkeypatch.setattr(attention_ops, "_backward_on_cpu", lambda *a, **kw: seen.append(a[-1]) or real(*a, **kw))

    def gradients(leaves, wanted):
        def run():
            gradients.result = torch.autograd.grad(edgedot.graph_attention(*leaves, src, dst), wanted, grad_out)
        if device == "cuda":
            seen.append(any("attention_backward_src_kernel" in name for name in launched_kernels(run)))
        else:
            run()
        return gradients.result

    q1 = q.clone().requires_grad_()
    dq_alone, = gradients((q1, k, v), q1)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    dq_full = gradients(leaves, leaves)[0]
    assert seen == [False, True]
    assert torch.equal(dq_alone, dq_full)


# ------------------------------------------------------------------------------ CUDA: long rows


@requires_cuda
@pytest.mark.parametrize("dtype", FEAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("edge_feat", [False, True])
def test_long_rows_split_and_merged(dtype, edge_feat):
    """A destination hub of 6000 edges and a source hub of 5000 (under 65 chunks: merged by a warp),
    rows of a few chunks and ordinary rows: every output and gradient against float64, and bitwise
    equal on a second run."""
    g = gen(8)
    num_src, num_dst, num_edges, heads, dim = 400, 300, 20000, 2, 32
    q, k, v, ef, src, dst = inputs(num_src, num_dst, num_edges, heads, dim, dim, dtype, g, edge_feat)
    dst[:6000] = 3
    src[6000:11000] = 5
    dst[11000:11500] = 8  # a few chunks
    src[12000:12300] = 9
    out, dq = full_check(q, k, v, ef, src, dst, p=0.2, seed=77, g=g)
    again, _ = run(q, k, v, ef, src, dst, 1 / math.sqrt(dim), p=0.2, seed=77)
    assert torch.equal(out, again[0])


@requires_cuda
@pytest.mark.parametrize("dims", [(32, 32), (48, 48), (16, 64), (64, 8)], ids=lambda d: f"dim{d[0]}-dimv{d[1]}")
@pytest.mark.parametrize("dtype", FEAT_DTYPES, ids=dtype_id)
def test_hubs_merged_by_blocks(dtype, dims):
    """A destination hub and a source hub of 12,000 edges each (over 64 chunks: merged by a block),
    rows of at most 32 columns (merged one column a lane) and wider ones, keys and values of
    different widths: every output and gradient against float64, the output's bits on a second run."""
    g = gen(11 + sum(dims))
    dim, dim_v = dims
    q, k, v, _, src, dst = inputs(300, 200, 40_000, 2, dim, dim_v, dtype, g, False)
    dst[:12_000] = 4
    src[20_000:32_000] = 6
    out, _ = full_check(q, k, v, None, src, dst, g=g)
    (again, _, _), _ = run(q, k, v, None, src, dst, 1 / math.sqrt(dim))
    assert torch.equal(out, again)


@requires_cuda
@pytest.mark.parametrize("op", ["attention", "gat", "gatv2"])
@pytest.mark.parametrize("source_grads", [True, False], ids=["source-grads", "dst-grads-only"])
def test_backward_merges_in_one_launch(op, source_grads):
    """A forward and backward over long rows on both sides launch two merges: the forward's softmax
    merge and one sum merge of every gradient of both backward passes."""
    g = gen(13)
    q, k, v, _, src, dst = inputs(3000, 2000, 50_000, 2, 16, 16, torch.float32, g, False)
    dst[:4000] = 3
    src[10_000:14_000] = 5
    if op == "attention":
        dst_in, src_in = (q,), (k, v)
        call = lambda: edgedot.graph_attention(q, k, v, src, dst)  # noqa: E731
    elif op == "gat":
        a_src, a_dst = rand_feat((3000, 2), torch.float32, "cuda", g), rand_feat((2000, 2), torch.float32, "cuda", g)
        dst_in, src_in = (a_dst,), (k, a_src)
        call = lambda: edgedot.gat_attention(k, a_src, a_dst, src, dst)  # noqa: E731
    else:
        att = rand_feat((2, 16), torch.float32, "cuda", g)
        dst_in, src_in = (q, att), (k,)
        call = lambda: edgedot.gatv2_attention(k, q, att, src, dst)  # noqa: E731
    for t in dst_in + src_in:
        t.requires_grad_(source_grads or any(t is d for d in dst_in))

    def step():
        for t in dst_in + src_in:
            t.grad = None
        call().sum().backward()
    step()
    merges = [name for name in launched_kernels(step) if "merge_kernel<" in name]
    assert [", true," in name for name in merges] == [True, False], merges


@requires_cuda
def test_long_rows_across_many_rows():
    """Long rows spread over 60,000 rows a side (the chunk schedule's scan spans many tiles and lists
    1,200 long rows on each side, each of a few chunks): every output and gradient against float64."""
    g = gen(10)
    num_nodes, heads, dim = 60_000, 2, 16
    q, k, v, _, src, dst = inputs(num_nodes, num_nodes, 600_000, heads, dim, dim, torch.float32, g, False)
    spread = torch.arange(480_000, device=dst.device) // 400 * 50  # every 50th row gets 400 edges
    dst[:480_000] = spread.to(dst.dtype)
    src[120_000:] = (spread + 7).to(src.dtype)
    full_check(q, k, v, None, src, dst, g=g, return_attention=False)


@requires_cuda
def test_schedules_take_one_launch_each():
    """A forward and backward with chunk schedules (more edges than a chunk) builds each schedule in
    one cooperative kernel, no CUB scan launched; the backward takes the forward's destination
    schedule and builds only the source's."""
    g = gen(12)
    q, k, v, _, src, dst = inputs(3000, 2000, 50_000, 2, 16, 16, torch.float32, g, False)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    dst[:4000] = 3

    def step():
        q.grad = k.grad = v.grad = None
        edgedot.graph_attention(q, k, v, src, dst).sum().backward()
    step()
    names = launched_kernels(step)
    assert sum("cooperative_schedule_kernel" in name for name in names) == 2, names  # dst, then src
    assert not any("DeviceScan" in name for name in names), names


@pytest.mark.gpu_memory_heavy
@requires_cuda
def test_hub_accuracy_two_million_edges():
    """One node with 2,000,000 incoming edges, float32: relative error against float64 <= 1e-5 for
    the output and every gradient."""
    g = gen(9)
    num_src, num_dst, heads, dim = 100_000, 1000, 4, 32
    q, k, v, _, src, dst = inputs(num_src, num_dst, 2_100_000, heads, dim, dim, torch.float32, g, False)
    dst[:2_000_000] = 17
    full_check(q, k, v, None, src, dst, g=g, return_attention=False)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_grouped_kernels_match_sorted_grouping(dtype):
    """Edges given sorted (no grouping, the pointer alone) walk the same positions as build_side's
    grouping of the same edges: bitwise equal outputs and gradients, hubs included."""
    g = gen(10)
    num_src, num_dst, heads, dim = 500, 300, 2, 32
    src, dst = sorted_graph(num_src, num_dst, 15000, "cuda", g, hub=7, hub_edges=5000)
    q, k, v = (t.detach() for t in features(num_src, num_dst, heads, dim, dtype, "cuda", g))
    grad_out = rand_feat((num_dst, heads, dim), dtype, "cuda", g)
    dst_group = grouping(dst, src, num_dst, num_src)
    src_group = grouping(src, dst, num_src, num_dst)
    given = run(q, k, v, None, src, dst, 0.2, p=0.1, seed=3, grad_out=grad_out, groups=(dst_group, src_group))
    ptr = (None, edgedot.index_to_ptr(dst, num_dst))
    grouped = run(q, k, v, None, src, dst, 0.2, p=0.1, seed=3, grad_out=grad_out, groups=(ptr, src_group))
    for a, b in zip(given[0] + given[1], grouped[0] + grouped[1]):
        assert torch.equal(a, b)


@requires_cuda
def test_wrong_pointer_unchecked_gives_nan_rows():
    """With check_indices=False nothing waits for the device: a pointer that disagrees with dst_idx
    makes the destinations concerned NaN (never a wrong finite value, never a bad read), and one
    that does not span [0, E) makes every destination NaN."""
    q, k, v, src, dst, ptr = small_sorted_case(11, 500, "cuda", num_src=40, num_dst=30, dim=16)
    good = edgedot.graph_attention(q, k, v, src, dst, dst_ptr=ptr, check_indices=False)
    wrong = ptr.clone()
    wrong[5] += 1  # the first edge of node 5 now lies in node 4's range
    out = edgedot.graph_attention(q, k, v, src, dst, dst_ptr=wrong, check_indices=False)
    nan_rows = torch.isnan(out).flatten(1).any(1)
    assert nan_rows[4] and nan_rows[5] or bool(ptr[5] == ptr[6])
    assert torch.equal(out[~nan_rows], good[~nan_rows])
    short = ptr.clone()
    short[-1] -= 1
    out = edgedot.graph_attention(q, k, v, src, dst, dst_ptr=short, check_indices=False)
    assert torch.isnan(out).all()
    wild = torch.full_like(ptr, -7)
    wild[-1] = 10**9
    out = edgedot.graph_attention(q, k, v, src, dst, dst_ptr=wild, check_indices=False)
    assert torch.isnan(out).all()


@requires_cuda
@pytest.mark.parametrize("hub_edges", [0, 3000])
def test_all_minus_inf_destination_is_nan(hub_edges):
    """A destination whose edges all score -inf gets NaN output and lse (as torch.softmax), also
    when it is a long row; the others are unaffected."""
    g = gen(12)
    num_src, num_dst, heads, dim = 200, 50, 1, 8
    q, k, v, _, src, dst = inputs(num_src, num_dst, 6000, heads, dim, dim, torch.float32, g, False, empty_dst=0)
    if hub_edges:
        dst[:hub_edges] = 6
    k[..., 0] = k[..., 0].abs() + 0.1
    q[6] = 0
    q[6, :, 0] = -math.inf  # every score of node 6: -inf
    (out, lse, _), _ = run(q, k, v, None, src, dst, 0.3, return_attention=False)
    assert torch.isnan(out[6]).all() and torch.isnan(lse[6]).all()
    rest = torch.arange(num_dst, device="cuda") != 6
    assert torch.isfinite(out[rest]).all() and torch.isfinite(lse[rest]).all()
