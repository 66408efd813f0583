"""CUDA-only behaviour: graph capture and replay, streams. Skipped without a GPU."""

import pytest
import torch

import edgedot
from utils import (CHUNK_EDGES, FEAT_DTYPES, assert_accurate, capture_graph, check_forward, dtype_id,
                   fill_cuda_cache_with_nan, gen, launched_kernels, raises_checked, rand_feat, rand_index, reference,
                   reference64, reference_grads, rel_error, requires_cuda, skewed_index)

pytestmark = requires_cuda


def _static_inputs(heads, g):
    num_src, num_dst, num_edges = 3000, 2000, 50_000
    src = rand_feat((num_src, 4, 64) if heads else (num_src, 64), torch.float32, "cuda", g)
    dst = rand_feat((num_dst, 1, 64) if heads else (num_dst, 64), torch.float32, "cuda", g)
    src_idx = skewed_index(num_src, num_edges, torch.int64, "cuda", g, hot={0: 4 * CHUNK_EDGES})
    dst_idx = rand_index(num_dst, num_edges, torch.int32, "cuda", g)
    return src, dst, src_idx, dst_idx


@pytest.mark.parametrize("check_indices", [True, False])
@pytest.mark.parametrize("heads", [False, True])
def test_graph_capture_forward(heads, check_indices):
    g = gen(0)
    src, dst, src_idx, dst_idx = _static_inputs(heads, g)

    def run():
        return edgedot.edge_dot(src, dst, src_idx, dst_idx, check_indices=check_indices)

    graph, out = capture_graph(run, warmups=3)
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
    with raises_checked(IndexError, match="src_idx"):
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

    graph, (out, grad_src, grad_dst) = capture_graph(run, warmups=3)
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


def test_cuda_index_views_wait_once():
    """edge_dot's CUDA forward (its memo lives in the extension) waits for its range check once
    for the views ``edge_index[0]``, ``edge_index[1]`` made anew each call, and again after an
    in-place write to ``edge_index``."""
    g = gen(3)
    src, dst, src_idx, dst_idx = _static_inputs(False, g)
    edge_index = torch.stack([src_idx.long(), dst_idx.long()])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())

    def call_waits():
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)  # ~0.1 s or more of GPU time
            out = edgedot.edge_dot(src, dst, edge_index[0], edge_index[1])
            waited = side.query()
        side.synchronize()
        return out, waited

    assert call_waits()[1], "the first checked call must wait for its verdict"
    for _ in range(3):
        out, waited = call_waits()
        assert not waited, "a view of an edge_index already checked waited again"
    assert_accurate(out, reference(src, dst, src_idx, dst_idx), reference64(src, dst, src_idx, dst_idx),
                    torch.float32)
    edge_index[1, 0] = 0
    assert call_waits()[1], "a write to edge_index must bring the check back"
    edge_index[0, 1] = src.shape[0]
    with raises_checked(IndexError, match="src_idx"):
        call_waits()


@pytest.mark.gpu_memory_heavy
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


# Device memory the test below needs at its peak, in bytes: two int32 indices (8 B per edge), the
# output and its gradient (8 B), the sort's keys and packed pairs in double buffers (24 B).
NEAR_2_POW_31_PEAK_BYTES = 40 * (2**31 - 1000)


@pytest.mark.gpu_memory_heavy
def test_edge_count_near_2_pow_31():
    """E = 2**31 - 1000 edges with int32 indices, D=1: within one grid stride of 2**31, where a
    32-bit grid-stride counter wraps negative (and wrote before the sort's keys). Forward, then the
    deterministic backward, which sorts the edges by row (sort_by_row.cu). About 86 GB."""
    free, _ = torch.cuda.mem_get_info()
    if free < NEAR_2_POW_31_PEAK_BYTES + 8 * 2**30:
        pytest.skip(f"needs about {NEAR_2_POW_31_PEAK_BYTES / 2**30:.0f} GiB of free GPU memory")
    num_edges, num_src, num_dst = 2**31 - 1000, 1000, 700
    g = gen(2031)
    cuda_gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**62, (1,), generator=g)))
    src = rand_feat((num_src, 1), torch.float32, "cuda", g, requires_grad=True)
    dst = rand_feat((num_dst, 1), torch.float32, "cuda", g)
    src_idx = torch.randint(0, num_src, (num_edges,), generator=cuda_gen, device="cuda", dtype=torch.int32)
    dst_idx = torch.randint(0, num_dst, (num_edges,), generator=cuda_gen, device="cuda", dtype=torch.int32)
    out = edgedot.edge_dot(src, dst, src_idx, dst_idx, deterministic=True)
    want_grad = torch.zeros(num_src, 1, dtype=torch.float64, device="cuda")
    chunk = 2**27
    with torch.no_grad():
        for start in range(0, num_edges, chunk):
            s, d = src_idx[start:start + chunk].long(), dst_idx[start:start + chunk].long()
            want = (src[s, 0].double() * dst[d, 0].double())
            assert torch.allclose(out[start:start + chunk].double(), want, rtol=1e-6, atol=0), start
            want_grad.index_add_(0, s, dst[d].double())
        del s, d, want
    out.backward(torch.ones_like(out))  # grad_src[r] = sum of dst[d] over the edges of row r
    del out
    assert rel_error(src.grad, want_grad) < 1e-4
    del src_idx, dst_idx
    torch.cuda.empty_cache()


@pytest.fixture
def sort_large_gradients(monkeypatch):
    """Every gradient of >= SORT_MIN_EDGES edges in random order takes the sorting path, as if
    the L2 cache were empty: the test graphs' gradients would otherwise fit in it."""
    from edgedot.ops import edge_dot as edge_dot_ops
    monkeypatch.setattr(edge_dot_ops, "_l2_bytes", lambda device_index: 0)


@pytest.fixture
def reductions(monkeypatch):
    """The reduction each eager CUDA gradient call takes, as (rows, reduction) pairs."""
    from edgedot.ops import edge_dot as edge_dot_ops
    seen = []
    grad_cuda = edge_dot_ops.grad_cuda

    def spy(grad_out, row_feat, other_feat, row_idx, other_idx, plan, reduction):
        seen.append((row_feat.shape[0], reduction))
        return grad_cuda(grad_out, row_feat, other_feat, row_idx, other_idx, plan, reduction)
    monkeypatch.setattr(edge_dot_ops, "grad_cuda", spy)
    return seen


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("heads", [2, 4], ids=["2heads-packed", "4heads"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_gradients_of_large_graphs(dtype, heads, deterministic, sort_large_gradients, reductions):
    """>= SORT_MIN_EDGES edges in random order are sorted by row per call in both modes, then
    reduced without atomics: accurate, and bitwise identical run after run. Two heads of a half
    type travel through the sort packed with the other row; four are gathered after it."""
    from edgedot.ops import SORT_MIN_EDGES
    from utils import edgedot_grads

    g = gen(20)
    num_src, num_dst, num_edges = 50_000, 40_000, SORT_MIN_EDGES + 123
    src = rand_feat((num_src, heads, 32), dtype, "cuda", g)
    dst = rand_feat((num_dst, 1, 32), dtype, "cuda", g)
    src_idx = skewed_index(num_src, num_edges, torch.int64, "cuda", g, hot={7: 20 * CHUNK_EDGES})
    dst_idx = rand_index(num_dst, num_edges, torch.int32, "cuda", g)
    grad_out = rand_feat((num_edges, heads), dtype, "cuda", g)
    got = edgedot_grads(src, dst, src_idx, dst_idx, grad_out, deterministic=deterministic)
    again = edgedot_grads(src, dst, src_idx, dst_idx, grad_out, deterministic=deterministic)
    assert reductions == [(num_src, "sort"), (num_dst, "sort")] * 2
    assert torch.equal(got[0], again[0]) and torch.equal(got[1], again[1]), "sorted reduction is not reproducible"
    want = reference_grads(src, dst, src_idx, dst_idx, grad_out, torch.float64)
    lowp = reference_grads(src, dst, src_idx, dst_idx, grad_out)
    for run in (got, again):
        for gr, w, lo, name in zip(run, want, lowp, ("grad_src", "grad_dst")):
            assert_accurate(gr, lo, w, dtype, name)


@pytest.mark.parametrize("dtype, deterministic", [(torch.float32, False), (torch.float32, True),
                                                  (torch.bfloat16, False)], ids=["float32", "float32-det", "bf16"])
def test_large_graph_sorted_on_one_side(dtype, deterministic, sort_large_gradients, reductions):
    """src_idx sorted, dst_idx random, >= SORT_MIN_EDGES edges: the sorted side is reduced as
    given by the sorted reduction, the other is sorted per call; bitwise reproducible."""
    from utils import edgedot_grads
    from edgedot.ops import SORT_MIN_EDGES

    g = gen(21)
    num_src, num_dst, num_edges, dim = 30_000, 20_000, SORT_MIN_EDGES + 77, 40
    src = rand_feat((num_src, dim), dtype, "cuda", g)
    dst = rand_feat((num_dst, dim), dtype, "cuda", g)
    src_idx = torch.sort(skewed_index(num_src, num_edges, torch.int64, "cuda", g, hot={11: 5 * CHUNK_EDGES}))[0]
    dst_idx = rand_index(num_dst, num_edges, torch.int32, "cuda", g)
    grad_out = rand_feat((num_edges,), dtype, "cuda", g)
    runs = [edgedot_grads(src, dst, src_idx, dst_idx, grad_out, deterministic=deterministic) for _ in range(2)]
    assert reductions == [(num_src, "sorted"), (num_dst, "sort")] * 2
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    want = reference_grads(src, dst, src_idx, dst_idx, grad_out, torch.float64)
    yardstick = reference_grads(src, dst, src_idx, dst_idx, grad_out)
    for run in runs:
        for gr, w, lo, name in zip(run, want, yardstick, ("grad_src", "grad_dst")):
            assert_accurate(gr, lo, w, dtype, name)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32-packed"])
@pytest.mark.parametrize("order", ["random", "sorted", "random-deterministic"])
def test_large_graph_unchecked_out_of_range_edges_add_nothing(order, dtype, sort_large_gradients, reductions):
    """check_indices=False with out-of-range indices on a graph of >= SORT_MIN_EDGES edges: those
    edges contribute to no row through both reductions that see them (sorted as given, sorted per
    call, in either mode; float32 edges travel through the sort packed with their other row), and
    no cast wraps a huge int64 index onto a real row."""
    from edgedot.ops import SORT_MIN_EDGES
    from utils import edgedot_grads

    g = gen(22)
    num_src, num_dst, num_edges, dim = 30_000, 20_000, SORT_MIN_EDGES + 5, 8
    src = rand_feat((num_src, dim), dtype, "cuda", g)
    dst = rand_feat((num_dst, dim), dtype, "cuda", g)
    src_idx = rand_index(num_src, num_edges, torch.int64, "cuda", g)
    dst_idx = rand_index(num_dst, num_edges, torch.int64, "cuda", g)
    bad = torch.randperm(num_edges, generator=g)[:1000].cuda()
    src_idx[bad[:300]] = -1
    src_idx[bad[300:450]] = num_src + 2**32  # row 2 if cast to int32
    src_idx[bad[450:600]] = 2**63 - 1  # overflows if one is added
    dst_idx[bad[600:]] = num_dst
    keep = torch.ones(num_edges, dtype=torch.bool, device="cuda")
    keep[bad] = False
    if order == "sorted":
        src_idx, perm = torch.sort(src_idx)
        dst_idx, keep = dst_idx[perm], keep[perm]
    grad_out = rand_feat((num_edges,), dtype, "cuda", g)
    got = edgedot_grads(src, dst, src_idx, dst_idx, grad_out, check_indices=False,
                        deterministic=order == "random-deterministic")
    expected = "sorted" if order == "sorted" else "sort"
    assert reductions[0] == (num_src, expected)
    want = reference_grads(src, dst, src_idx[keep], dst_idx[keep], grad_out[keep], torch.float64)
    yardstick = reference_grads(src, dst, src_idx[keep], dst_idx[keep], grad_out[keep])
    for gr, w, lo, name in zip(got, want, yardstick, ("grad_src", "grad_dst")):
        assert_accurate(gr, lo, w, dtype, name)


def _one_side_grad(row_idx, num_rows, dtype, reduction, g, num_other, dim, heads):
    """edge_dot_grad over the given rows, with random other rows, features and gradient: a function
    that computes it into memory that held NaN, and the float64 and dtype references."""
    from edgedot.ops import edge_dot_grad_op

    other_idx = rand_index(num_other, row_idx.shape[0], torch.int64, "cuda", g)
    row_feat = rand_feat((num_rows, heads, dim), dtype, "cuda", g)
    other_feat = rand_feat((num_other, heads, dim), dtype, "cuda", g)
    grad_out = rand_feat((row_idx.shape[0], heads), dtype, "cuda", g)
    want = torch.zeros(num_rows, heads, dim, dtype=torch.float64, device="cuda")
    want.index_add_(0, row_idx.long(), grad_out.double()[..., None] * other_feat.double()[other_idx])
    lowp = torch.zeros_like(row_feat).index_add_(0, row_idx.long(), grad_out[..., None] * other_feat[other_idx])

    def grad():
        fill_cuda_cache_with_nan()
        return edge_dot_grad_op(grad_out, row_feat, other_feat, row_idx, other_idx, None, reduction)

    return grad, want, lowp


@pytest.mark.parametrize("reduction", ["sorted", "sort"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_rows_without_edges_are_zero(dtype, reduction):
    """The sorted reduction writes every row itself (no memset): rows before, between and after
    the rows with edges come out as exact zeros, even in memory that held NaN."""
    g = gen(23)
    num_rows = 1000
    rows = torch.cat([torch.randint(100, 200, (3000,), generator=g), torch.randint(500, 503, (2000,), generator=g),
                      torch.tensor([998])])
    row_idx = (torch.sort(rows)[0] if reduction == "sorted" else rows).to(torch.int32).cuda()
    grad, want, lowp = _one_side_grad(row_idx, num_rows, dtype, reduction, g, num_other=50, dim=24, heads=2)
    got = grad()
    empty = torch.ones(num_rows, dtype=torch.bool)
    empty[rows.unique()] = False
    assert torch.equal(got[empty.cuda()], torch.zeros_like(got[empty.cuda()]))
    assert_accurate(got, lowp, want, dtype, "grad")


@pytest.mark.parametrize("reduction", ["sorted", "sort"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_sorted_reduction_runs_of_every_length(dtype, reduction):
    """Runs of one row from a single edge to several chunks, with rows without edges between:
    rows inside a chunk, rows cut by a chunk boundary and rows spanning many chunks (summed through
    the workspace) are each right row by row, and a second call gives the same bits."""
    g = gen(25)
    lengths = torch.cat([torch.randint(1, 40, (3000,), generator=g),
                         torch.randint(40, 3 * CHUNK_EDGES, (60,), generator=g)])
    lengths = lengths[torch.randperm(lengths.shape[0], generator=g)]
    rows = torch.cumsum(torch.randint(1, 4, lengths.shape, generator=g), 0)  # gaps: rows without edges
    num_rows = int(rows[-1]) + 3
    row_idx = torch.repeat_interleave(rows, lengths)
    if reduction == "sort":
        row_idx = row_idx[torch.randperm(row_idx.shape[0], generator=g)]
    grad, want, _ = _one_side_grad(row_idx.to(torch.int32).cuda(), num_rows, dtype, reduction, g, num_other=70,
                                   dim=12, heads=2)
    got = grad()
    # Row by row, so that one wrong row among thousands cannot hide in the norm of the whole.
    row_err = (got.double() - want).flatten(1).norm(dim=1) / want.flatten(1).norm(dim=1).clamp_min(1e-30)
    bound = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    assert row_err.max().item() <= bound, f"worst row {row_err.argmax().item()}: relative error {row_err.max():.2e}"
    assert torch.equal(got, grad())


def _order_buckets(row_idx, num_rows, shift):
    rows = row_idx.long()
    last = (num_rows - 1) >> shift
    return torch.where((rows >= 0) & (rows < num_rows), rows >> shift, torch.full_like(rows, last))


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_edge_order_groups_edges_by_row_bucket(index_dtype):
    """The forward's visit order: a permutation of the edges with their row buckets non-decreasing,
    out-of-range rows in the last bucket."""
    from edgedot.runtime.build import cuda_module
    g = gen(40)
    num_rows, num_edges, shift = 50_000, 100_000, 6  # 782 buckets
    row_idx = rand_index(num_rows, num_edges, index_dtype, "cuda", g)
    row_idx[::997] = -1
    row_idx[5::991] = num_rows
    other_idx = rand_index(3000, num_edges, index_dtype, "cuda", g)
    order, used = cuda_module().edge_order(row_idx, other_idx, num_rows, shift)
    assert used
    assert order.dtype == torch.int32 and order.shape == (num_edges,)
    assert torch.equal(torch.sort(order.long()).values, torch.arange(num_edges, device="cuda"))
    buckets = _order_buckets(row_idx, num_rows, shift)[order.long()]
    assert bool((buckets[1:] >= buckets[:-1]).all())
    assert buckets[-1].item() == (num_rows - 1) >> shift


@pytest.mark.parametrize("sorted_side", ["row", "other"])
def test_edge_order_leaves_sorted_edges_alone(sorted_side):
    """Edges sorted by either index already read rows in order: the order is not used."""
    from edgedot.runtime.build import cuda_module
    g = gen(41)
    row_idx = rand_index(50_000, 100_000, torch.int64, "cuda", g)
    other_idx = rand_index(3000, 100_000, torch.int64, "cuda", g)
    if sorted_side == "row":
        row_idx = torch.sort(row_idx).values
    else:
        other_idx = torch.sort(other_idx).values
    _, used = cuda_module().edge_order(row_idx, other_idx, 50_000, 6)
    assert not used


def _forward_variants(kernels):
    """(ordered, whole_block) of each forward kernel among demangled kernel names: its template
    arguments kOrdered and kWholeBlock, before kRoundProducts and kDependent (edgedot/csrc/forward.cu)."""
    return [flags[:2] for flags in _forward_flags(kernels)]


def _forward_flags(kernels):
    """(kOrdered, kWholeBlock, kRoundProducts, kDependent) of each forward kernel among demangled
    kernel names: its last four template arguments (edgedot/csrc/forward.cu)."""
    variants = []
    for name in kernels:
        if "forward_kernel<" in name:
            args = name.split("forward_kernel<", 1)[1].split(">(", 1)[0].split(", ")
            variants.append(tuple(arg == "true" for arg in args[-4:]))
    return variants


@pytest.mark.parametrize("dtype, heads, index_dtype, larger", [
    (torch.float32, 1, torch.int64, "src"),
    (torch.float32, 1, torch.int32, "dst"),
    (torch.float16, 1, torch.int32, "src"),
    (torch.bfloat16, 1, torch.int64, "src"),
    (torch.bfloat16, 4, torch.int32, "src"),
    (torch.float64, 1, torch.int64, "dst"),
], ids=lambda v: str(v).replace("torch.", ""))
def test_forward_of_shuffled_graph_larger_than_l2(dtype, heads, index_dtype, larger):
    """Shuffled edges over wide rows of a table larger than L2 are visited grouped by row range of
    the larger side; every edge's output lands at its own position, under NaN poison."""
    g = gen(42)
    row_bytes = 2048  # wide enough to pay for the grouping (edgedot/csrc/edge_dot/edge_dot_ops.cpp)
    dim = row_bytes * 8 // torch.finfo(dtype).bits // heads
    big = torch.cuda.get_device_properties(0).L2_cache_size // row_bytes + 1
    small = 3000
    num_src, num_dst = (big, small) if larger == "src" else (small, big)
    num_edges = 4 * big
    src = rand_feat((num_src, heads, dim) if heads > 1 else (num_src, dim), dtype, "cuda", g)
    dst = rand_feat((num_dst, heads, dim) if heads > 1 else (num_dst, dim), dtype, "cuda", g)
    src_idx = rand_index(num_src, num_edges, index_dtype, "cuda", g)
    dst_idx = rand_index(num_dst, num_edges, index_dtype, "cuda", g)
    fill_cuda_cache_with_nan()
    out = None

    def run():
        nonlocal out
        out = edgedot.edge_dot(src, dst, src_idx, dst_idx)

    kernels = launched_kernels(run)
    assert any("bucket_scatter" in k for k in kernels), kernels
    assert (True, False) in _forward_variants(kernels), kernels
    assert_accurate(out, reference(src, dst, src_idx, dst_idx), reference64(src, dst, src_idx, dst_idx), dtype)

    # The same edges sorted by src take the given order, with the same results.
    src_sorted, order = torch.sort(src_idx, stable=True)
    fill_cuda_cache_with_nan()
    again = edgedot.edge_dot(src, dst, src_sorted, dst_idx[order])
    assert torch.equal(again, out[order])


def test_forward_of_narrow_rows_keeps_the_given_order():
    """Rows of 512 bytes save too little per edge to pay for grouping the edges: not grouped."""
    g = gen(44)
    big = torch.cuda.get_device_properties(0).L2_cache_size // 512 + 1
    src = rand_feat((big, 128), torch.float32, "cuda", g)
    dst = rand_feat((big, 128), torch.float32, "cuda", g)
    src_idx = rand_index(big, 4 * big, torch.int64, "cuda", g)
    dst_idx = rand_index(big, 4 * big, torch.int64, "cuda", g)
    kernels = launched_kernels(lambda: edgedot.edge_dot(src, dst, src_idx, dst_idx))
    assert _forward_variants(kernels) == [(False, False)], kernels
    assert not any("bucket" in k for k in kernels), kernels


@pytest.mark.parametrize("layout, whole_block", [
    ("aligned", True), ("strided", True), ("offset", False), ("two_heads", False)])
@pytest.mark.parametrize("dtype", FEAT_DTYPES, ids=dtype_id)
def test_forward_of_rows_of_one_256_byte_block(dtype, layout, whole_block):
    """Rows of exactly 256 bytes, contiguous ("aligned") or two blocks apart ("strided"), load
    through whole-block fetches; rows that start 16 bytes into a block ("offset") or hold two heads
    of 128 bytes ("two_heads") through plain loads. Both are accurate under NaN poison."""
    g = gen(11)
    item_size = torch.empty((), dtype=dtype).element_size()
    dim = 256 // item_size
    num_src, num_dst, num_edges = 7000, 5000, 100_003

    def feat(num_rows):
        if layout == "strided":
            return rand_feat((num_rows, 2 * dim), dtype, "cuda", g)[:, :dim]
        if layout == "offset":
            skip = 16 // item_size
            return rand_feat((num_rows * dim + skip,), dtype, "cuda", g)[skip:].view(num_rows, dim)
        if layout == "two_heads":
            return rand_feat((num_rows, 2, dim // 2), dtype, "cuda", g)
        return rand_feat((num_rows, dim), dtype, "cuda", g)

    src, dst = feat(num_src), feat(num_dst)
    src_idx = torch.sort(rand_index(num_src, num_edges, torch.int32, "cuda", g)).values
    dst_idx = rand_index(num_dst, num_edges, torch.int64, "cuda", g)
    kernels = launched_kernels(lambda: edgedot.edge_dot(src, dst, src_idx, dst_idx))
    assert _forward_variants(kernels) == [(False, whole_block)], kernels
    fill_cuda_cache_with_nan()
    check_forward(src, dst, src_idx, dst_idx)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_shuffled_graph_larger_than_l2_out_of_range_edges(index_dtype):
    """Out-of-range edges in the grouped order: checked calls raise, unchecked ones give NaN at
    exactly those edges."""
    g = gen(43)
    big = torch.cuda.get_device_properties(0).L2_cache_size // 2048 + 1
    num_edges = 4 * big
    src = rand_feat((big, 512), torch.float32, "cuda", g)
    dst = rand_feat((2000, 512), torch.float32, "cuda", g)
    src_idx = rand_index(big, num_edges, index_dtype, "cuda", g)
    dst_idx = rand_index(2000, num_edges, index_dtype, "cuda", g)
    bad = torch.zeros(num_edges, dtype=torch.bool, device="cuda")
    bad[7::1013] = True
    bad_src = src_idx.clone()
    bad_src[7::2026] = -1
    bad_src[1020::2026] = big
    with raises_checked(IndexError, match="src_idx"):
        edgedot.edge_dot(src, dst, bad_src, dst_idx)
    fill_cuda_cache_with_nan()
    out = edgedot.edge_dot(src, dst, bad_src, dst_idx, check_indices=False)
    assert torch.equal(torch.isnan(out), bad)
    good = ~bad
    assert_accurate(out[good], reference(src, dst, src_idx[good], dst_idx[good]),
                    reference64(src, dst, src_idx[good], dst_idx[good]), torch.float32)


@pytest.mark.parametrize("num_edges, dependent", [(16384, True), (3, True), (2_000_000, False)])
def test_forward_of_small_graphs_is_a_dependent_launch(num_edges, dependent):
    """Graphs that one pass of the resident warps covers take the programmatic-dependent kernel,
    larger ones the plain one; both are accurate under NaN poison."""
    g = gen(8)
    src = rand_feat((1024, 128), device="cuda", g=g)
    dst = rand_feat((768, 128), device="cuda", g=g)
    si = rand_index(1024, num_edges, torch.int32, "cuda", g)
    di = rand_index(768, num_edges, torch.int32, "cuda", g)
    out = {}
    kernels = launched_kernels(lambda: out.setdefault("v", edgedot.edge_dot(src, dst, si, di)))
    assert [flags[3] for flags in _forward_flags(kernels)] == [dependent]
    ref = edgedot.edge_dot_reference(src.double(), dst.double(), si, di)
    assert_accurate(out["v"], edgedot.edge_dot_reference(src, dst, si, di), ref, torch.float32)


def test_dependent_forwards_back_to_back_in_a_cuda_graph():
    """Forwards launched as dependent launches, captured back to back in one CUDA graph, each
    reading the output of the one before: every one waits for its input."""
    g = gen(9)
    n = 512
    feats = [rand_feat((n, 64), device="cuda", g=g) for _ in range(2)]
    si = rand_index(n, n * 64, torch.int64, "cuda", g)
    di = rand_index(n, n * 64, torch.int64, "cuda", g)

    def chain(x):
        for _ in range(6):  # each forward's output, viewed as [n, 64], is the next one's features
            x = edgedot.edge_dot(x, feats[1], si, di).view(n, 64)
        return x

    static = feats[0].clone()
    chain(static)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = chain(static)
    for _ in range(3):
        static.copy_(rand_feat((n, 64), device="cuda", g=g))
        graph.replay()
        expect = static.double()
        for _ in range(6):
            expect = edgedot.edge_dot_reference(expect, feats[1].double(), si, di).view(n, 64)
        torch.cuda.synchronize()
        err = ((result.double() - expect).norm() / expect.norm()).item()
        assert err < 1e-4, err
