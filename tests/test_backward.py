"""Backward pass: gradients vs autograd of the float64 reference, gradcheck, plans, determinism."""

import pytest
import torch

import edgedot
from utils import (DEVICES, FEAT_DTYPES, INDEX_DTYPES, CHUNK_EDGES, assert_accurate, check_backward,
                   check_forward, dtype_id, edgedot_grads, fill_cuda_cache_with_nan, gen, rand_feat, rand_index,
                   reference, reference_grads, rel_error, requires_cuda, scatter_grads, skewed_index)

# name -> (num_src, src shape after N, num_dst, dst shape after N, num_edges)
GRAD_CASES = {
    "2d": (40, (33,), 30, (33,), 500),
    "heads": (40, (3, 16), 30, (3, 16), 400),
    "broadcast_1": (40, (1, 16), 30, (4, 16), 400),
    "broadcast_2d": (40, (4, 16), 30, (16,), 400),
    "hot_rows": (50, (8,), 20, (8,), 3 * CHUNK_EDGES + 100),
    "one_edge": (3, (5,), 4, (5,), 1),
    "no_edges": (3, (2, 5), 4, (2, 5), 0),
}


def _graph(case, dtype, index_dtype, device, seed=0):
    num_src, src_shape, num_dst, dst_shape, num_edges = GRAD_CASES[case]
    g = gen(seed)
    src = rand_feat((num_src, *src_shape), dtype, device, g)
    dst = rand_feat((num_dst, *dst_shape), dtype, device, g)
    if case == "hot_rows":  # rows longer than CHUNK_EDGES on both sides (split across chunks)
        src_idx = skewed_index(num_src, num_edges, index_dtype, device, g, hot={1: CHUNK_EDGES + 1})
        dst_idx = skewed_index(num_dst, num_edges, index_dtype, device, g, hot={2: 2 * CHUNK_EDGES})
    else:
        src_idx = rand_index(num_src, num_edges, index_dtype, device, g)
        dst_idx = rand_index(num_dst, num_edges, index_dtype, device, g)
    return src, dst, src_idx, dst_idx


def _grad_out(src, dst, num_edges, g):
    if src.dim() == 2 and dst.dim() == 2:
        shape = (num_edges,)
    else:
        shape = (num_edges, max(src.shape[1] if src.dim() == 3 else 1, dst.shape[1] if dst.dim() == 3 else 1))
    return rand_feat(shape, src.dtype, src.device, g)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("use_plan", [False, True], ids=["noplan", "plan"])
@pytest.mark.parametrize("case", list(GRAD_CASES))
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("dtype", FEAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("device", DEVICES)
def test_grad_matches_reference(device, dtype, index_dtype, case, use_plan, deterministic):
    src, dst, src_idx, dst_idx = _graph(case, dtype, index_dtype, device)
    grad_out = _grad_out(src, dst, src_idx.shape[0], gen(1))
    plan = edgedot.EdgePlan(src_idx, dst_idx, src.shape[0], dst.shape[0]) if use_plan else None
    check_backward(src, dst, src_idx, dst_idx, grad_out, plan=plan, deterministic=deterministic)


# Widest float32 rows whose atomic backward accumulates in double (edgedot/csrc/edge_dot/edge_dot_ops.cpp).
DOUBLE_ACCUM_MAX_DIM = 16


@requires_cuda
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("use_plan", [False, True], ids=["noplan", "plan"])
@pytest.mark.parametrize("dtype", FEAT_DTYPES, ids=dtype_id)
@pytest.mark.gpu_memory_heavy
@pytest.mark.parametrize("dim", [1, 16, 33, 128, 1000])
def test_cuda_grad_large_skewed(dim, dtype, use_plan, deterministic):
    g = gen(2)
    num_src, num_dst, num_edges = 20_000, 10_000, min(1 << 20, (1 << 27) // dim)
    src = rand_feat((num_src, dim), dtype, "cuda", g)
    dst = rand_feat((num_dst, 2, dim), dtype, "cuda", g)
    src_idx = skewed_index(num_src, num_edges, torch.int64, "cuda", g, hot={5: num_edges // 3})
    dst_idx = skewed_index(num_dst, num_edges, torch.int32, "cuda", g, hot={9: 10 * CHUNK_EDGES + 3})
    grad_out = rand_feat((num_edges, 2), dtype, "cuda", g)
    plan = edgedot.EdgePlan(src_idx, dst_idx, num_src, num_dst) if use_plan else None
    # Without a plan or determinism, float32 rows wider than DOUBLE_ACCUM_MAX_DIM are summed with
    # float atomics: a hot row then gets a per-edge scatter-add as its yardstick
    # (utils.scatter_grads). Narrower rows accumulate in double and meet the reference's rule.
    float_atomics = not use_plan and not deterministic and dtype == torch.float32 and dim > DOUBLE_ACCUM_MAX_DIM
    yardstick = scatter_grads if float_atomics else reference_grads
    fill_cuda_cache_with_nan()
    check_backward(src, dst, src_idx, dst_idx, grad_out, yardstick=yardstick, plan=plan, deterministic=deterministic)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_cuda_grad_big_graph_hot_rows(dtype):
    """2**24 edges, one row of 2**20 of them (thousands of chunks), with a plan: as accurate as
    the reference, and bitwise reproducible."""
    g = gen(13)
    num_src, num_dst, num_edges, dim = 100_000, 70_000, 1 << 24, 16
    src = rand_feat((num_src, dim), dtype, "cuda", g)
    dst = rand_feat((num_dst, dim), dtype, "cuda", g)
    src_idx = skewed_index(num_src, num_edges, torch.int32, "cuda", g, hot={3: 1 << 20, 4: CHUNK_EDGES + 1})
    dst_idx = rand_index(num_dst, num_edges, torch.int32, "cuda", g)
    grad_out = rand_feat((num_edges,), dtype, "cuda", g)
    plan = edgedot.EdgePlan(src_idx, dst_idx, num_src, num_dst)
    gs1, gd1 = check_backward(src, dst, src_idx, dst_idx, grad_out, plan=plan)
    gs2, gd2 = edgedot_grads(src, dst, src_idx, dst_idx, grad_out, plan=plan)
    assert torch.equal(gs1, gs2) and torch.equal(gd1, gd2)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("use_plan", [False, True], ids=["noplan", "plan"])
@pytest.mark.parametrize("case", ["2d", "heads", "broadcast_1", "broadcast_2d", "hot_rows"])
@pytest.mark.parametrize("device", DEVICES)
def test_gradcheck(device, case, use_plan, deterministic):
    num_src, src_shape, num_dst, dst_shape, _ = GRAD_CASES[case]
    g = gen(3)
    if case == "hot_rows":  # keep gradcheck cheap, but still split a row across chunks
        num_src, num_dst, src_shape, dst_shape, num_edges = 4, 3, (2,), (2,), CHUNK_EDGES + 7
    else:
        num_src, num_dst, num_edges = 6, 5, 12
        src_shape, dst_shape = tuple(min(s, 3) for s in src_shape), tuple(min(s, 3) for s in dst_shape)
    src = rand_feat((num_src, *src_shape), torch.float64, device, g, requires_grad=True)
    dst = rand_feat((num_dst, *dst_shape), torch.float64, device, g, requires_grad=True)
    src_idx = rand_index(num_src, num_edges, torch.int64, device, g)
    dst_idx = rand_index(num_dst, num_edges, torch.int32, device, g)
    plan = edgedot.EdgePlan(src_idx, dst_idx, num_src, num_dst) if use_plan else None

    def fn(s, d):
        return edgedot.edge_dot(s, d, src_idx, dst_idx, plan=plan, deterministic=deterministic)

    assert torch.autograd.gradcheck(fn, (src, dst), eps=1e-6, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("use_plan", [False, True], ids=["noplan", "plan"])
@pytest.mark.parametrize("dtype", FEAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(30, 16), (30, 2, 16)], ids=["2d", "heads"])
def test_same_tensor_both_sides(device, dtype, use_plan, shape):
    """edge_dot(x, x, s, d): the two gradient contributions are summed into x.grad."""
    g = gen(4)
    x = rand_feat(shape, dtype, device, g)
    num_edges = CHUNK_EDGES + 50
    src_idx = skewed_index(30, num_edges, torch.int64, device, g, hot={0: CHUNK_EDGES + 1})
    dst_idx = rand_index(30, num_edges, torch.int64, device, g)
    grad_out = _grad_out(x, x, num_edges, g)
    plan = edgedot.EdgePlan(src_idx, dst_idx, 30, 30) if use_plan else None

    xe = x.detach().clone().requires_grad_(True)
    edgedot.edge_dot(xe, xe, src_idx, dst_idx, plan=plan).backward(grad_out)
    grads = {}
    for dt in (dtype, torch.float64):
        xr = x.detach().to(dt).requires_grad_(True)
        reference(xr, xr, src_idx, dst_idx).backward(grad_out.to(dt))
        grads[dt] = xr.grad
    assert_accurate(xe.grad, grads[dtype], grads[torch.float64], dtype, what="x.grad")
    if device == "cpu" or use_plan:  # deterministic backward: exactly the sum of both sides
        gs, gd = edgedot_grads(x, x, src_idx, dst_idx, grad_out, plan=plan)
        assert torch.equal(xe.grad, gs + gd)


@pytest.mark.parametrize("side", ["src", "dst"])
@pytest.mark.parametrize("case", ["2d", "broadcast_1", "broadcast_2d"])
@pytest.mark.parametrize("device", DEVICES)
def test_only_one_side_requires_grad(device, case, side):
    src, dst, src_idx, dst_idx = _graph(case, torch.float32, torch.int64, device, seed=5)
    grad_out = _grad_out(src, dst, src_idx.shape[0], gen(6))
    src.requires_grad_(side == "src")
    dst.requires_grad_(side == "dst")
    out = edgedot.edge_dot(src, dst, src_idx, dst_idx)
    assert out.requires_grad
    out.backward(grad_out)
    ref_s, ref_d = reference_grads(src, dst, src_idx, dst_idx, grad_out)
    r64_s, r64_d = reference_grads(src, dst, src_idx, dst_idx, grad_out, torch.float64)
    if side == "src":
        assert dst.grad is None
        assert_accurate(src.grad, ref_s, r64_s, torch.float32)
    else:
        assert src.grad is None
        assert_accurate(dst.grad, ref_d, r64_d, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_no_side_requires_grad(device):
    src, dst, src_idx, dst_idx = _graph("2d", torch.float32, torch.int64, device)
    assert not edgedot.edge_dot(src, dst, src_idx, dst_idx).requires_grad


@pytest.mark.parametrize("dtype", FEAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["broadcast_1", "broadcast_2d"])
def test_heads_broadcast_grad_shapes(device, dtype, case):
    """The broadcast side's gradient keeps its own shape and sums over the heads."""
    src, dst, src_idx, dst_idx = _graph(case, dtype, torch.int64, device, seed=7)
    grad_out = _grad_out(src, dst, src_idx.shape[0], gen(8))
    gs, gd = check_backward(src, dst, src_idx, dst_idx, grad_out)
    assert gs.shape == src.shape and gd.shape == dst.shape
    # Explicit formula for the broadcast side, in float64.
    narrow, wide, n_idx, w_idx, g_narrow = (
        (src, dst, src_idx, dst_idx, gs) if case == "broadcast_1" else (dst, src, dst_idx, src_idx, gd))
    expect = torch.zeros(narrow.shape[0], narrow.shape[-1], dtype=torch.float64, device=device)
    contrib = (grad_out.double()[:, :, None] * wide.double()[w_idx.long()]).sum(1)
    expect.index_add_(0, n_idx.long(), contrib)
    got = g_narrow.double().reshape(narrow.shape[0], narrow.shape[-1])
    tol = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    assert rel_error(got, expect) <= tol


@pytest.mark.parametrize("dtype", FEAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("device", DEVICES)
def test_unused_rows_get_zero_grad(device, dtype):
    """Rows no edge touches get exactly 0 (not garbage), with and without a plan."""
    g = gen(9)
    src, dst = rand_feat((100, 2, 24), dtype, device, g), rand_feat((80, 24), dtype, device, g)
    src_idx = rand_index(10, 600, torch.int64, device, g) * 3  # rows 0, 3, ..., 27 only
    dst_idx = rand_index(40, 600, torch.int32, device, g) + 20  # rows 20..59 only
    grad_out = rand_feat((600, 2), dtype, device, g)
    plan = edgedot.EdgePlan(src_idx, dst_idx, 100, 80)
    for kwargs in ({}, {"plan": plan}, {"deterministic": True}):
        if device == "cuda":
            fill_cuda_cache_with_nan()
        gs, gd = check_backward(src, dst, src_idx, dst_idx, grad_out, **kwargs)
        used_s = torch.zeros(100, dtype=torch.bool, device=device)
        used_s[src_idx.long()] = True
        used_d = torch.zeros(80, dtype=torch.bool, device=device)
        used_d[dst_idx.long()] = True
        assert (gs[~used_s] == 0).all() and (gd[~used_d] == 0).all(), kwargs
        assert (gs[used_s] != 0).any() and (gd[used_d] != 0).any()


@pytest.mark.parametrize("device", DEVICES)
def test_empty_graph_backward(device):
    src = rand_feat((4, 3, 8), torch.float32, device, requires_grad=True)
    dst = rand_feat((5, 1, 8), torch.float32, device, requires_grad=True)
    idx = torch.empty(0, dtype=torch.int64, device=device)
    for plan in (None, edgedot.EdgePlan(idx, idx, 4, 5)):
        src.grad = dst.grad = None
        out = edgedot.edge_dot(src, dst, idx, idx, plan=plan, deterministic=plan is None)
        assert out.shape == (0, 3)
        out.sum().backward()
        assert src.grad.shape == src.shape and dst.grad.shape == dst.shape
        assert (src.grad == 0).all() and (dst.grad == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_plan_reuse(device):
    """One plan serves many steps: identical grads for identical inputs, correct for new ones."""
    g = gen(10)
    num_src, num_dst, num_edges = 60, 50, 4 * CHUNK_EDGES
    src_idx = skewed_index(num_src, num_edges, torch.int32, device, g, hot={4: 2 * CHUNK_EDGES + 5})
    dst_idx = rand_index(num_dst, num_edges, torch.int64, device, g)
    plan = edgedot.EdgePlan(src_idx, dst_idx, num_src, num_dst)
    src, dst = rand_feat((num_src, 16), device=device, g=g), rand_feat((num_dst, 16), device=device, g=g)
    grad_out = rand_feat((num_edges,), device=device, g=g)
    first = edgedot_grads(src, dst, src_idx, dst_idx, grad_out, plan=plan)
    packed = plan.src.clone(), plan.dst.clone()
    for _ in range(3):
        again = edgedot_grads(src, dst, src_idx, dst_idx, grad_out, plan=plan)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert torch.equal(plan.src, packed[0]) and torch.equal(plan.dst, packed[1]), "plan was modified"
    for step in range(3):  # a training loop: new features and upstream gradients each step
        src2 = rand_feat((num_src, 16), device=device, g=g)
        dst2 = rand_feat((num_dst, 16), device=device, g=g)
        go = rand_feat((num_edges,), device=device, g=g)
        check_backward(src2, dst2, src_idx, dst_idx, go, plan=plan)


def _bitwise_runs(src, dst, src_idx, dst_idx, grad_out, runs=5, **kwargs):
    results = [edgedot_grads(src, dst, src_idx, dst_idx, grad_out, **kwargs) for _ in range(runs)]
    for gs, gd in results[1:]:
        assert torch.equal(gs, results[0][0]), f"grad src_feat differs between runs ({kwargs})"
        assert torch.equal(gd, results[0][1]), f"grad dst_feat differs between runs ({kwargs})"
    return results[0]


def _hot_graph(device, dtype=torch.float32):
    g = gen(11)
    big = device == "cuda"
    num_src, num_dst = (5000, 3000) if big else (300, 200)
    num_edges = (1 << 19) if big else 8 * CHUNK_EDGES
    hot_src = {0: num_edges // 4, 17: CHUNK_EDGES + 1, 18: 3 * CHUNK_EDGES} if big else {0: 3 * CHUNK_EDGES + 1}
    src_idx = skewed_index(num_src, num_edges, torch.int64, device, g, hot=hot_src)
    dst_idx = skewed_index(num_dst, num_edges, torch.int32, device, g, hot={1: 2 * CHUNK_EDGES + 9})
    assert torch.bincount(src_idx.long()).max() > CHUNK_EDGES
    assert torch.bincount(dst_idx.long()).max() > CHUNK_EDGES
    src = rand_feat((num_src, 2, 64), dtype, device, g)
    dst = rand_feat((num_dst, 2, 64), dtype, device, g)
    grad_out = rand_feat((num_edges, 2), dtype, device, g)
    return src, dst, src_idx, dst_idx, grad_out


@pytest.mark.parametrize("dtype", FEAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("device", DEVICES)
def test_deterministic_bitwise(device, dtype):
    src, dst, src_idx, dst_idx, grad_out = _hot_graph(device, dtype)
    plan = edgedot.EdgePlan(src_idx, dst_idx, src.shape[0], dst.shape[0])
    _bitwise_runs(src, dst, src_idx, dst_idx, grad_out, deterministic=True)
    _bitwise_runs(src, dst, src_idx, dst_idx, grad_out, plan=plan)
    _bitwise_runs(src, dst, src_idx, dst_idx, grad_out, plan=plan, deterministic=True)
    check_backward(src, dst, src_idx, dst_idx, grad_out, deterministic=True)
    check_backward(src, dst, src_idx, dst_idx, grad_out, plan=plan)


@pytest.mark.parametrize("device", DEVICES)
def test_deterministic_bitwise_on_rmat(device):
    """A power-law R-MAT graph (Graph500 parameters): its hot rows span many chunks.
    Deterministic mode, with and without a plan, gives the same bits in every one of 5 runs."""
    from edgedot.bench.graphs import rmat_edges
    scale, num_edges = (16, 1 << 20) if device == "cuda" else (10, 1 << 14)
    src_idx, dst_idx = rmat_edges(scale, num_edges, torch.Generator(device).manual_seed(5))
    assert torch.bincount(src_idx).max() > CHUNK_EDGES, "no hot row: the graph does not test splitting"
    num_rows = 1 << scale
    src = rand_feat((num_rows, 32), torch.float32, device, gen(6))
    dst = rand_feat((num_rows, 32), torch.float32, device, gen(7))
    grad_out = rand_feat((num_edges,), torch.float32, device, gen(8))
    plan = edgedot.EdgePlan(src_idx, dst_idx, num_rows, num_rows)
    _bitwise_runs(src, dst, src_idx, dst_idx, grad_out, deterministic=True)
    _bitwise_runs(src, dst, src_idx, dst_idx, grad_out, plan=plan)
    check_backward(src, dst, src_idx, dst_idx, grad_out, deterministic=True)


@pytest.mark.parametrize("device", DEVICES)
def test_deterministic_follows_torch_switch(device, restore_deterministic):
    src, dst, src_idx, dst_idx, grad_out = _hot_graph(device)
    torch.use_deterministic_algorithms(True)
    assert torch.are_deterministic_algorithms_enabled()
    # deterministic=None follows the global switch; must not raise under it either.
    _bitwise_runs(src, dst, src_idx, dst_idx, grad_out)
    plan = edgedot.EdgePlan(src_idx, dst_idx, src.shape[0], dst.shape[0])
    _bitwise_runs(src, dst, src_idx, dst_idx, grad_out, plan=plan)
    torch.use_deterministic_algorithms(False)
    check_backward(src, dst, src_idx, dst_idx, grad_out)


@requires_cuda
def test_cuda_deterministic_matches_plan_free_and_default():
    """All backward flavours agree (within tolerance) on a hot-row graph."""
    src, dst, src_idx, dst_idx, grad_out = _hot_graph("cuda")
    plan = edgedot.EdgePlan(src_idx, dst_idx, src.shape[0], dst.shape[0])
    for kwargs in ({}, {"deterministic": True}, {"plan": plan}, {"plan": plan, "deterministic": False}):
        check_backward(src, dst, src_idx, dst_idx, grad_out, **kwargs)


@pytest.mark.parametrize("device", DEVICES)
def test_grad_accumulates_into_existing_grad(device):
    src, dst, src_idx, dst_idx = _graph("2d", torch.float64, torch.int64, device, seed=12)
    src.requires_grad_(True)
    dst.requires_grad_(True)
    edgedot.edge_dot(src, dst, src_idx, dst_idx).sum().backward()
    first = src.grad.clone(), dst.grad.clone()
    edgedot.edge_dot(src, dst, src_idx, dst_idx).sum().backward()
    torch.testing.assert_close(src.grad, 2 * first[0])
    torch.testing.assert_close(dst.grad, 2 * first[1])


def _pairs_only_where(pairs, monkeypatch):
    """The CPU's products of every pair of rows (cpu/edge_dot.py's all_pairs_pay) where its shape
    rule admits them, where ``pairs``; else for no problem: the gathers' tests."""
    from edgedot.cpu import edge_dot as cpu_edge_dot
    if not pairs:
        monkeypatch.setattr(cpu_edge_dot, "MAX_PAIRS", 0)


def _op_grads(src, dst, src_idx, dst_idx, grad_out):
    """Output and gradients through the registered op (the dispatcher and its autograd wrapper)."""
    s, d = src.detach().clone().requires_grad_(True), dst.detach().clone().requires_grad_(True)
    out = torch.ops.edgedot.edge_dot(s, d, src_idx, dst_idx, None, None, False, True)
    return (out, *torch.autograd.grad(out, (s, d), grad_out))


@pytest.mark.cpu_only
@pytest.mark.parametrize("case,path", [(case, path) for case in ("2d", "heads", "broadcast_1", "broadcast_2d", "no_edges")
                                       for path in ("one_chunk", "chunked")] + [("2d", "pairs")])
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("dtype", FEAT_DTYPES, ids=dtype_id)
def test_cpu_eager_paths_keep_the_ops_bits(dtype, index_dtype, case, path, monkeypatch):
    """On the CPU, edge_dot's eager paths (small tables' products of every pair, problems of one
    chunk as ATen ops autograd records, the rest through an autograd.Function) give the registered
    op's outputs and gradients, bit for bit, on contiguous and non-contiguous features."""
    from edgedot.cpu import edge_dot as cpu_edge_dot

    _pairs_only_where(path == "pairs", monkeypatch)
    if path == "chunked":
        monkeypatch.setattr(cpu_edge_dot, "CHUNK_ELEMENTS", 256)
    src, dst, src_idx, dst_idx = _graph(case, dtype, index_dtype, "cpu", seed=11)
    assert cpu_edge_dot.all_pairs_pay(src, dst, src_idx.shape[0]) == (path == "pairs")
    grad_out = _grad_out(src, dst, src_idx.shape[0], gen(12))
    strided = (src.transpose(0, -1).contiguous().transpose(0, -1), dst[:, None].expand(-1, 2, *dst.shape[1:])[:, 1])
    for s, d in ((src, dst), strided):
        assert torch.equal(s, src) and torch.equal(d, dst)
        want = _op_grads(s, d, src_idx, dst_idx, grad_out)
        se, de = s.detach().clone().requires_grad_(True), d.detach().clone().requires_grad_(True)
        out = edgedot.edge_dot(se, de, src_idx, dst_idx)
        recorded = path != "chunked" or case == "no_edges"
        assert (type(out.grad_fn).__name__ == "EagerCPUEdgeDotBackward") != recorded, type(out.grad_fn)
        got = (out, *torch.autograd.grad(out, (se, de), grad_out))
        for name, a, b in zip(("out", "grad src_feat", "grad dst_feat"), got, want):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name
        with torch.no_grad():
            assert torch.equal(edgedot.edge_dot(s, d, src_idx, dst_idx), want[0])


@pytest.mark.parametrize("path", ["recorded", "function_one_chunk", "function_chunked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_cpu_grads_same_bits_by_either_index_dtype(dtype, path, monkeypatch):
    """The CPU backward sums rows by an int64 index whatever the edges' dtype (the int32 serial
    loop is slower): int32 and int64 indices give the same bits, on sums large enough for
    index_add_ (not index_put_), with a hub whose many terms show any change of order."""
    from edgedot.cpu import edge_dot as cpu_edge_dot

    if path == "function_chunked":
        monkeypatch.setattr(cpu_edge_dot, "CHUNK_ELEMENTS", 4096)
    elif path == "function_one_chunk":
        monkeypatch.setattr(cpu_edge_dot, "recordable", lambda *args: False)
    g = gen(21)
    num_nodes, num_edges, dim = 300, 1200, 48  # 57,600 products: past SERIAL_SUM_ELEMENTS
    src_idx = torch.randint(num_nodes, (num_edges,), generator=g)
    dst_idx = torch.randint(num_nodes, (num_edges,), generator=g)
    dst_idx[::3] = 7  # a hub of 400 edges
    src = torch.randn(num_nodes, dim, generator=g).to(dtype)
    dst = torch.randn(num_nodes, dim, generator=g).to(dtype)
    grad_out = torch.randn(num_edges, generator=g).to(dtype)
    runs = []
    for index_dtype in (torch.int32, torch.int64):
        s, d = src.clone().requires_grad_(True), dst.clone().requires_grad_(True)
        out = edgedot.edge_dot(s, d, src_idx.to(index_dtype), dst_idx.to(index_dtype))
        recorded = type(out.grad_fn).__name__ != "EagerCPUEdgeDotBackward"
        assert recorded == (path == "recorded"), type(out.grad_fn)
        runs.append((out, *torch.autograd.grad(out, (s, d), grad_out)))
    for name, a, b in zip(("out", "grad src_feat", "grad dst_feat"), *runs):
        assert torch.equal(a, b), name
    want = torch.zeros(num_nodes, dim, dtype=torch.float64).index_add_(
        0, dst_idx, src.double()[src_idx] * grad_out.double()[:, None])
    assert rel_error(runs[0][2], want) <= (1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", [(50, 200, (16,)), (500, 4096, (16,)), (1000, 8192, (32,)), (1000, 8192, (4, 8))],
                         ids=["serial", "flat", "sparse", "sparse_heads"])
def test_cpu_function_grads_match_the_recorded_path(shape, index_dtype, monkeypatch):
    """The autograd.Function's gradients (summed by RowSums: int64 index_add_, flat views or the
    sparse product, by the shape) have the bits of the recorded path's (autograd's own
    index_add_ / index_put_), in one chunk and in several, with a hub among the rows."""
    from edgedot.cpu import edge_dot as cpu_edge_dot
    _pairs_only_where(False, monkeypatch)  # the gathers' sums (test_cpu_pairs_*: the pairs')
    num_nodes, num_edges, dim = shape
    g = gen(23)
    src_idx = torch.randint(num_nodes, (num_edges,), generator=g)
    dst_idx = torch.randint(num_nodes, (num_edges,), generator=g)
    dst_idx[::5] = 3
    src = torch.randn(num_nodes, *dim, generator=g)
    dst = torch.randn(num_nodes, *dim, generator=g)
    grad_out = torch.randn(num_edges, *dim[:-1], generator=g)

    def grads():
        s, d = src.clone().requires_grad_(True), dst.clone().requires_grad_(True)
        out = edgedot.edge_dot(s, d, src_idx.to(index_dtype), dst_idx.to(index_dtype))
        return type(out.grad_fn).__name__, torch.autograd.grad(out, (s, d), grad_out)

    kind, recorded = grads()
    assert kind != "EagerCPUEdgeDotBackward", kind
    monkeypatch.setattr(cpu_edge_dot, "recordable", lambda *args: False)
    for chunk in (cpu_edge_dot.CHUNK_ELEMENTS, 4096):
        monkeypatch.setattr(cpu_edge_dot, "CHUNK_ELEMENTS", chunk)
        kind, function = grads()
        assert kind == "EagerCPUEdgeDotBackward", kind
        for name, a, b in zip(("grad src_feat", "grad dst_feat"), recorded, function):
            assert torch.equal(a, b), (name, chunk)


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("path", ["pairs", "pairs_no_grad", "pairs_op", "recorded", "recorded_strided", "function",
                                  "no_grad", "no_grad_chunked", "op"])
def test_cpu_paths_refuse_bad_indices(path, index_dtype, monkeypatch):
    """Every CPU path refuses a negative index (which indexing would read from the end) or one
    past the rows with an IndexError naming the index tensor and its value, found by the path's
    own gathers (indexing after a check of its minimum, index_select): small tables' products of
    every pair, the recorded ATen ops, the autograd.Function of problems of several chunks, the
    forward without autograd and the op."""
    from edgedot.cpu import edge_dot as cpu_edge_dot
    _pairs_only_where(path.startswith("pairs"), monkeypatch)
    if path in ("function", "no_grad_chunked"):
        monkeypatch.setattr(cpu_edge_dot, "CHUNK_ELEMENTS", 8)
    g = gen(13)
    grad = path in ("pairs", "recorded", "recorded_strided", "function")
    src = rand_feat((6, 4), torch.float32, "cpu", g, requires_grad=grad)
    dst = rand_feat((5, 4), torch.float32, "cpu", g, requires_grad=grad)
    if path == "recorded_strided":
        src = rand_feat((4, 6), torch.float32, "cpu", g).t().requires_grad_()
    assert cpu_edge_dot.all_pairs_pay(src, dst, 7) == path.startswith("pairs")
    for name, bad in (("src_idx", -1), ("src_idx", 6), ("dst_idx", -2), ("dst_idx", 5)):
        src_idx, dst_idx = torch.zeros(7, dtype=index_dtype), torch.zeros(7, dtype=index_dtype)
        (src_idx if name == "src_idx" else dst_idx)[5] = bad
        with pytest.raises(IndexError, match=f"{name} holds {bad}, outside"):
            if path.endswith("op"):
                torch.ops.edgedot.edge_dot(src, dst, src_idx, dst_idx, None, None, False, True)
            else:
                out = edgedot.edge_dot(src, dst, src_idx, dst_idx)
                raise AssertionError(f"no error; output by {type(out.grad_fn).__name__}")


@pytest.mark.parametrize("dtype", FEAT_DTYPES, ids=dtype_id)
def test_cpu_eager_path_of_large_half_tables(dtype, monkeypatch):
    """A half-type problem of one chunk whose tables exceed a chunk (they would be widened whole)
    takes the autograd.Function; float32 and float64 stay recorded. Both keep the op's bits."""
    from edgedot.cpu import edge_dot as cpu_edge_dot

    monkeypatch.setattr(cpu_edge_dot, "CHUNK_ELEMENTS", 1024)
    g = gen(14)
    src, dst = rand_feat((100, 16), dtype, "cpu", g), rand_feat((90, 16), dtype, "cpu", g)
    src_idx, dst_idx = rand_index(100, 20, torch.int64, "cpu", g), rand_index(90, 20, torch.int32, "cpu", g)
    grad_out = rand_feat((20,), dtype, "cpu", g)
    want = _op_grads(src, dst, src_idx, dst_idx, grad_out)
    se, de = src.detach().clone().requires_grad_(True), dst.detach().clone().requires_grad_(True)
    out = edgedot.edge_dot(se, de, src_idx, dst_idx)
    half = dtype in (torch.float16, torch.bfloat16)
    assert (type(out.grad_fn).__name__ == "EagerCPUEdgeDotBackward") == half, type(out.grad_fn)
    got = (out, *torch.autograd.grad(out, (se, de), grad_out))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("path", ["pairs", "one_chunk", "chunked"])
def test_cpu_index_refilled_before_backward_is_refused(path, monkeypatch):
    """An index tensor written in place between the forward and the backward (a loader refilling
    its buffer) makes the backward raise, as eager PyTorch's does, on every CPU path."""
    from edgedot.cpu import edge_dot as cpu_edge_dot

    _pairs_only_where(path == "pairs", monkeypatch)
    if path == "chunked":
        monkeypatch.setattr(cpu_edge_dot, "CHUNK_ELEMENTS", 16)
    g = gen(15)
    src = rand_feat((10, 4), torch.float32, "cpu", g, requires_grad=True)
    dst = rand_feat((9, 4), torch.float32, "cpu", g, requires_grad=True)
    assert cpu_edge_dot.all_pairs_pay(src, dst, 30) == (path == "pairs")
    for name in ("src_idx", "dst_idx"):
        src_idx, dst_idx = rand_index(10, 30, torch.int64, "cpu", g), rand_index(9, 30, torch.int64, "cpu", g)
        out = edgedot.edge_dot(src, dst, src_idx, dst_idx)
        (src_idx if name == "src_idx" else dst_idx).copy_(torch.zeros(30, dtype=torch.int64))
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()


# name -> (num_src, num_dst, num_edges, dim): small tables beside their edges (the pairs' path)
PAIR_CASES = {
    "seed_like": (64, 48, 1024, 32),
    "hub_and_repeats": (20, 15, 600, 7),
    "one_row": (1, 9, 40, 5),
    "most_edges": (40, 30, 32767, 3),
}


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("case", list(PAIR_CASES))
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("dtype", FEAT_DTYPES, ids=dtype_id)
def test_cpu_pairs_match_the_reference(dtype, index_dtype, case, strided, monkeypatch):
    """Small tables beside many edges take every pair's product from one GEMM: outputs and both
    gradients against float64, with repeated pairs and a hub, both index dtypes, strided
    features, and the registered op's bits."""
    from edgedot.cpu import edge_dot as cpu_edge_dot

    _pairs_only_where(True, monkeypatch)

    num_src, num_dst, num_edges, dim = PAIR_CASES[case]
    g = gen(31)
    src, dst = rand_feat((num_src, dim), dtype, "cpu", g), rand_feat((num_dst, dim), dtype, "cpu", g)
    if strided:
        src = rand_feat((dim, num_src), dtype, "cpu", g).t()
    src_idx, dst_idx = rand_index(num_src, num_edges, index_dtype, "cpu", g), rand_index(num_dst, num_edges, index_dtype, "cpu", g)
    if case == "hub_and_repeats":
        src_idx[::3], dst_idx[::3] = 4, 2  # one pair repeated 200 times: its gradient sums them
    assert cpu_edge_dot.all_pairs_pay(src, dst, num_edges)
    check_forward(src, dst, src_idx, dst_idx)
    grad_out = rand_feat((num_edges,), dtype, "cpu", g)
    check_backward(src, dst, src_idx, dst_idx, grad_out)
    want = _op_grads(src, dst, src_idx, dst_idx, grad_out)
    se, de = src.detach().clone().requires_grad_(True), dst.detach().clone().requires_grad_(True)
    out = edgedot.edge_dot(se, de, src_idx, dst_idx)
    got = (out, *torch.autograd.grad(out, (se, de), grad_out))
    for name, a, b in zip(("out", "grad src_feat", "grad dst_feat"), got, want):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("path", ["pairs", "gathers"])
def test_cpu_gradients_repeat_at_aten_parallel_threshold(path, monkeypatch):
    """Indexing's backward (index_put_) adds float32 in parallel by atomics from 32,768 elements
    on more than one thread, each run rounding its own way: the CPU paths that use it stay below,
    so gradients repeat bit for bit at the sizes on either side of that threshold."""
    from edgedot.cpu import edge_dot as cpu_edge_dot

    _pairs_only_where(path == "pairs", monkeypatch)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        g = gen(33)
        for num_edges, dim in ((2048, 16), (2047, 16), (32767, 1), (32768, 1)):
            rows = 40 if path == "pairs" else 5000
            src, dst = rand_feat((rows, dim), torch.float32, "cpu", g), rand_feat((rows, dim), torch.float32, "cpu", g)
            src_idx = rand_index(3, num_edges, torch.int64, "cpu", g)  # a few hubs: many terms a row
            dst_idx = rand_index(rows, num_edges, torch.int64, "cpu", g)
            grad_out = rand_feat((num_edges,), torch.float32, "cpu", g) * 100
            assert cpu_edge_dot.all_pairs_pay(src, dst, num_edges) == (path == "pairs" and num_edges < 32768)
            runs = []
            for _ in range(8):
                s = src.clone().requires_grad_(True)
                runs.append(torch.autograd.grad(edgedot.edge_dot(s, dst, src_idx, dst_idx), s, grad_out)[0])
            assert all(torch.equal(r, runs[0]) for r in runs), (num_edges, dim)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_cpu_pairs_leave_nonfinite_tables_to_the_gathers(bad, monkeypatch):
    """A non-finite row that no edge touches reaches no gradient: the pairs' GEMMs would multiply
    it by the zeros of its pairs, so the gradients of tables holding one take the gathers' sums, as
    those of a table whose sum overflows do. The forward keeps the pairs (the shapes alone choose
    it), so its bits do not follow the grad mode."""
    from edgedot.cpu import edge_dot as cpu_edge_dot

    _pairs_only_where(True, monkeypatch)
    g = gen(35)
    src, dst = rand_feat((40, 8), torch.float32, "cpu", g), rand_feat((30, 8), torch.float32, "cpu", g)
    src_idx, dst_idx = rand_index(40, 300, torch.int64, "cpu", g), rand_index(29, 300, torch.int64, "cpu", g)
    assert cpu_edge_dot.all_pairs_pay(src, dst, 300) and cpu_edge_dot.pairs_backward(src, dst)
    grad_out = rand_feat((300,), torch.float32, "cpu", g)
    want = reference_grads(src, dst, src_idx, dst_idx, grad_out, torch.float64)
    dst[29] = bad  # row 29: no edge
    assert cpu_edge_dot.all_pairs_pay(src, dst, 300) and not cpu_edge_dot.pairs_backward(src, dst)
    assert not cpu_edge_dot.pairs_backward(src, torch.full_like(dst, 3e38))
    with torch.no_grad():
        no_grad_out = edgedot.edge_dot(src, dst, src_idx, dst_idx)
    s, d = src.clone().requires_grad_(True), dst.clone().requires_grad_(True)
    out = edgedot.edge_dot(s, d, src_idx, dst_idx)
    grad_src, grad_dst = torch.autograd.grad(out, (s, d), grad_out)
    assert torch.isfinite(out).all() and torch.isfinite(grad_src).all() and torch.isfinite(grad_dst[:29]).all()
    assert torch.equal(out, no_grad_out)
    for got, op in zip((out, grad_src, grad_dst), _op_grads(src, dst, src_idx, dst_idx, grad_out)):
        torch.testing.assert_close(got, op, rtol=0, atol=0, equal_nan=True)
    assert rel_error(grad_src, want[0]) <= 1e-6
