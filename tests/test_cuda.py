"""CUDA-only behaviour: graph capture and replay, streams. Skipped without a GPU."""

import pytest
import torch

import edgedot
from utils import (PIECE_LEN, assert_accurate, gen, rand_feat, rand_index, reference, reference64,
                   reference_grads, rel_error, requires_cuda, skewed_index)

pytestmark = requires_cuda


def _static_inputs(heads, g):
    num_src, num_dst, num_edges = 3000, 2000, 50_000
    src = rand_feat((num_src, 4, 64) if heads else (num_src, 64), torch.float32, "cuda", g)
    dst = rand_feat((num_dst, 1, 64) if heads else (num_dst, 64), torch.float32, "cuda", g)
    src_idx = skewed_index(num_src, num_edges, torch.int64, "cuda", g, hot={0: 4 * PIECE_LEN})
    dst_idx = rand_index(num_dst, num_edges, torch.int32, "cuda", g)
    return src, dst, src_idx, dst_idx


def _warmup(fn, n=3):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(n):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


@pytest.mark.parametrize("check_indices", [True, False])
@pytest.mark.parametrize("heads", [False, True])
def test_graph_capture_forward(heads, check_indices):
    g = gen(0)
    src, dst, src_idx, dst_idx = _static_inputs(heads, g)

    def run():
        return edgedot.edge_dot(src, dst, src_idx, dst_idx, check_indices=check_indices)

    _warmup(run)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for step in range(3):  # new values in the static inputs, then replay
        src.copy_(rand_feat(src.shape, torch.float32, "cuda", g))
        dst.copy_(rand_feat(dst.shape, torch.float32, "cuda", g))
        src_idx.copy_(rand_index(src.shape[0], src_idx.shape[0], torch.int64, "cuda", g))
        graph.replay()
        torch.cuda.synchronize()
        assert_accurate(out, reference(src, dst, src_idx, dst_idx), reference64(src, dst, src_idx, dst_idx),
                        torch.float32, what=f"replay {step}")
    # Outside capture the checks are back.
    bad = src_idx.clone()
    bad[0] = src.shape[0]
    with pytest.raises(IndexError, match="src_idx"):
        edgedot.edge_dot(src, dst, bad, dst_idx)
    torch.cuda.synchronize()


@pytest.mark.parametrize("use_plan", [False, True], ids=["noplan", "plan"])
def test_graph_capture_forward_backward(use_plan):
    g = gen(1)
    src, dst, src_idx, dst_idx = _static_inputs(True, g)
    src.requires_grad_(True)
    dst.requires_grad_(True)
    grad_out = rand_feat((src_idx.shape[0], 4), torch.float32, "cuda", g)
    plan = edgedot.EdgePlan(src_idx, dst_idx, src.shape[0], dst.shape[0]) if use_plan else None

    def run():
        out = edgedot.edge_dot(src, dst, src_idx, dst_idx, plan=plan)
        return (out, *torch.autograd.grad(out, (src, dst), grad_out))

    _warmup(run)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, grad_src, grad_dst = run()
    for step in range(2):
        with torch.no_grad():
            src.copy_(rand_feat(src.shape, torch.float32, "cuda", g))
            dst.copy_(rand_feat(dst.shape, torch.float32, "cuda", g))
            grad_out.copy_(rand_feat(grad_out.shape, torch.float32, "cuda", g))
        graph.replay()
        torch.cuda.synchronize()
        assert_accurate(out, reference(src, dst, src_idx, dst_idx).detach(),
                        reference64(src, dst, src_idx, dst_idx), torch.float32)
        low = reference_grads(src, dst, src_idx, dst_idx, grad_out)
        f64 = reference_grads(src, dst, src_idx, dst_idx, grad_out, torch.float64)
        assert_accurate(grad_src, low[0], f64[0], torch.float32, what="grad src_feat")
        assert_accurate(grad_dst, low[1], f64[1], torch.float32, what="grad dst_feat")


def test_check_indices_false_runs_on_side_stream_without_sync():
    """An unchecked call on a busy side stream returns before that stream finishes."""
    g = gen(2)
    src, dst, src_idx, dst_idx = _static_inputs(False, g)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s or more of GPU time
        out = edgedot.edge_dot(src, dst, src_idx, dst_idx, check_indices=False)
        assert not side.query(), "edge_dot(check_indices=False) waited for the GPU"
    side.synchronize()
    assert_accurate(out, reference(src, dst, src_idx, dst_idx), reference64(src, dst, src_idx, dst_idx),
                    torch.float32)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_offsets_past_2_pow_31_elements(index_dtype):
    """Rows whose element offset exceeds 2**31, forward and both backward paths."""
    if torch.cuda.get_device_properties(0).total_memory < 48 * 2**30:
        pytest.skip("needs about 30 GB of GPU memory")
    g = gen(31)
    num_src, dim = 2**28 + 4, 8  # the last row starts at element 2**31 + 24
    src = torch.empty(num_src, dim, device="cuda", dtype=torch.bfloat16).normal_(generator=torch.Generator("cuda").manual_seed(1))
    dst = rand_feat((100, dim), torch.bfloat16, "cuda", g)
    far = torch.tensor([num_src - 1, num_src - 2, 2**28, 5, num_src - 1], device="cuda")
    src_idx = torch.cat([far, torch.randint(num_src - 1000, num_src, (500,), device="cuda")]).to(index_dtype)
    dst_idx = rand_index(100, src_idx.shape[0], index_dtype, "cuda", g)
    rows = torch.unique(src_idx.long())
    src_rows = src[rows].detach()
    # The same edges on a compact copy of the touched rows: small enough for the reference.
    compact_idx = torch.searchsorted(rows, src_idx.long())
    expect = reference64(src_rows, dst, compact_idx, dst_idx)
    assert_accurate(edgedot.edge_dot(src, dst, src_idx, dst_idx), reference(src_rows, dst, compact_idx, dst_idx),
                    expect, torch.bfloat16)

    grad_out = rand_feat((src_idx.shape[0],), torch.bfloat16, "cuda", g)
    src.requires_grad_()
    want_rows = torch.zeros(rows.shape[0], dim, dtype=torch.float64, device="cuda")
    want_rows.index_add_(0, compact_idx, grad_out.double()[:, None] * dst.double()[dst_idx.long()])
    plan = edgedot.EdgePlan(src_idx, dst_idx, num_src, 100)
    for kwargs in ({}, {"plan": plan}):
        src.grad = None
        edgedot.edge_dot(src, dst, src_idx, dst_idx, **kwargs).backward(grad_out)
        got_rows = src.grad[rows].double()
        assert ((got_rows - want_rows).norm() / want_rows.norm()).item() < 1e-2, kwargs
        untouched = torch.ones(num_src, dtype=torch.bool, device="cuda")
        untouched[rows] = False
        assert src.grad[untouched].abs().max().item() == 0, kwargs
    del plan, src
    torch.cuda.empty_cache()


@pytest.fixture
def sort_large_gradients(monkeypatch):
    """Every gradient of >= SORT_MIN_EDGES edges in random order takes the sorting path, as if
    the L2 cache were empty: the test graphs' gradients would otherwise fit in it."""
    from edgedot import ops
    monkeypatch.setattr(ops, "_l2_bytes", lambda device_index: 0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_gradients_of_large_graphs(dtype, sort_large_gradients):
    """Default mode on >= SORT_MIN_EDGES edges in random order sorts them per call, then reduces
    each row without atomics: accurate, and bitwise identical run after run."""
    from edgedot.ops import SORT_MIN_EDGES
    from utils import edgedot_grads

    g = gen(20)
    num_src, num_dst, num_edges = 50_000, 40_000, SORT_MIN_EDGES + 123
    src = rand_feat((num_src, 4, 32), dtype, "cuda", g)
    dst = rand_feat((num_dst, 1, 32), dtype, "cuda", g)
    src_idx = skewed_index(num_src, num_edges, torch.int64, "cuda", g, hot={7: 20 * PIECE_LEN})
    dst_idx = rand_index(num_dst, num_edges, torch.int32, "cuda", g)
    grad_out = rand_feat((num_edges, 4), dtype, "cuda", g)
    got = edgedot_grads(src, dst, src_idx, dst_idx, grad_out)
    again = edgedot_grads(src, dst, src_idx, dst_idx, grad_out)
    assert torch.equal(got[0], again[0]) and torch.equal(got[1], again[1]), "sorted reduction is not reproducible"
    want = reference_grads(src, dst, src_idx, dst_idx, grad_out, torch.float64)
    lowp = reference_grads(src, dst, src_idx, dst_idx, grad_out)
    for gr, w, lo, name in zip(got, want, lowp, ("grad_src", "grad_dst")):
        assert_accurate(gr, lo, w, dtype, name)


@pytest.mark.parametrize("dtype, deterministic", [(torch.float32, False), (torch.float32, True),
                                                  (torch.bfloat16, False)], ids=["float32", "float32-det", "bf16"])
def test_large_graph_sorted_on_one_side(dtype, deterministic, sort_large_gradients, monkeypatch):
    """src_idx sorted, dst_idx random, >= SORT_MIN_EDGES edges: the sorted side is reduced as
    given, the other is sorted per call. Deterministic mode and half types then reduce without
    atomics (bitwise reproducible); float32 in the default mode takes the atomic kernel."""
    from edgedot import ops
    from edgedot.ops import SORT_MIN_EDGES
    from utils import edgedot_grads, scatter_grads

    sorted_sides = []
    sort_keys = ops._sort_keys
    monkeypatch.setattr(ops, "_sort_keys", lambda idx, rows: sorted_sides.append(rows) or sort_keys(idx, rows))
    g = gen(21)
    num_src, num_dst, num_edges, dim = 30_000, 20_000, SORT_MIN_EDGES + 77, 40
    src = rand_feat((num_src, dim), dtype, "cuda", g)
    dst = rand_feat((num_dst, dim), dtype, "cuda", g)
    src_idx = torch.sort(skewed_index(num_src, num_edges, torch.int64, "cuda", g, hot={11: 5 * PIECE_LEN}))[0]
    dst_idx = rand_index(num_dst, num_edges, torch.int32, "cuda", g)
    grad_out = rand_feat((num_edges,), dtype, "cuda", g)
    runs = [edgedot_grads(src, dst, src_idx, dst_idx, grad_out, deterministic=deterministic) for _ in range(2)]
    assert sorted_sides == [num_dst, num_dst], "only dst_idx should be sorted, once per backward"
    atomic_free = deterministic or dtype != torch.float32
    if atomic_free:
        assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    want = reference_grads(src, dst, src_idx, dst_idx, grad_out, torch.float64)
    yardstick = (reference_grads if atomic_free else scatter_grads)(src, dst, src_idx, dst_idx, grad_out)
    for gr, w, lo, name in zip(runs[0], want, yardstick, ("grad_src", "grad_dst")):
        assert_accurate(gr, lo, w, dtype, name)


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_large_graph_unchecked_out_of_range_edges_add_nothing(deterministic, sort_large_gradients):
    """check_indices=False with out-of-range indices on a graph the backward sorts per call:
    those edges contribute to no row (sorting must not wrap them onto real rows), with the
    atomic kernel and with the sorted reduction."""
    from edgedot.ops import SORT_MIN_EDGES
    from utils import edgedot_grads

    g = gen(22)
    num_src, num_dst, num_edges, dim = 30_000, 20_000, SORT_MIN_EDGES + 5, 8
    src = rand_feat((num_src, dim), torch.float64, "cuda", g)
    dst = rand_feat((num_dst, dim), torch.float64, "cuda", g)
    src_idx = rand_index(num_src, num_edges, torch.int64, "cuda", g)
    dst_idx = rand_index(num_dst, num_edges, torch.int64, "cuda", g)
    bad = torch.randperm(num_edges, generator=g)[:1000].cuda()
    src_idx[bad[:300]] = -1
    src_idx[bad[300:600]] = num_src + 2**32  # wraps onto row 2 if cast to int32 unclamped
    dst_idx[bad[600:]] = num_dst
    grad_out = rand_feat((num_edges,), torch.float64, "cuda", g)
    got = edgedot_grads(src, dst, src_idx, dst_idx, grad_out, check_indices=False, deterministic=deterministic)
    keep = torch.ones(num_edges, dtype=torch.bool, device="cuda")
    keep[bad] = False
    want = reference_grads(src, dst, src_idx[keep], dst_idx[keep], grad_out[keep], torch.float64)
    for gr, w, name in zip(got, want, ("grad_src", "grad_dst")):
        assert rel_error(gr, w) < 1e-12, name
