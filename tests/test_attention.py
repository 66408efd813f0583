"""edgedot.graph_attention: forward, backward, dropout, determinism, custom ops, errors."""

import numpy as np
import pytest
import torch

import edgedot
from edgedot.cpu import attention as cpu_attention
from edgedot.ops.attention import dropout_keep, next_dropout_state
from edgedot.runtime import dropout
from utils import (DEVICES, FEAT_DTYPES, INDEX_DTYPES, PATHS_AGREE, assert_accurate, assert_one_chunk_path_kept,
                   assert_records_change_nothing, assert_unchanged, dtype_id, fill_cuda_cache_with_nan, gen,
                   raises_checked, rand_feat, rand_index, records_case_graph, rel_error, requires_cuda, skewed_index,
                   snapshot, walk_in_chunks)

OP = torch.ops.edgedot.graph_attention.default
BACKWARD_OP = torch.ops.edgedot.graph_attention_backward.default


@pytest.fixture
def small_chunks(monkeypatch):
    """Makes the CPU path walk a few dozen edges per chunk, so every pass spans many chunks."""
    walk_in_chunks(monkeypatch)


def make_inputs(num_src=37, num_dst=29, num_edges=300, heads=3, dim=24, dim_v=None, dtype=torch.float32,
                device="cpu", index_dtype=torch.int64, edge_feat=False, seed=0, skewed=True):
    """q [Nd, H, D], k [Ns, H, D], v [Ns, H, Dv], src_idx, dst_idx (and edge_feat or None).
    Destinations are power-law (a hub) and the last destination gets no edge."""
    g = gen(seed)
    q = rand_feat((num_dst, heads, dim), dtype, device, g)
    k = rand_feat((num_src, heads, dim), dtype, device, g)
    v = rand_feat((num_src, heads, dim if dim_v is None else dim_v), dtype, device, g)
    src = rand_index(num_src, num_edges, index_dtype, device, g)
    if skewed and num_edges:
        dst = skewed_index(max(num_dst - 1, 1), num_edges, index_dtype, device, g)
    else:
        dst = rand_index(max(num_dst - 1, 1), num_edges, index_dtype, device, g)
    ef = rand_feat((num_edges, heads, dim), dtype, device, g) if edge_feat else None
    return q, k, v, src, dst, ef


def reference(q, k, v, src, dst, ef=None, dtype=None, requires_grad=False, **kwargs):
    """The reference on copies of the inputs cast to ``dtype``: (out, alpha, leaves)."""
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_(requires_grad) for t in (q, k, v)]
    if ef is not None:
        leaves.append(ef.detach().to(dtype or ef.dtype).requires_grad_(requires_grad))
    out, alpha = edgedot.graph_attention_reference(*leaves[:3], src, dst, edge_feat=leaves[3] if ef is not None
                                                   else None, **kwargs)
    return out, alpha, leaves


def score_condition(q, k, src, dst, ef=None, scale=None):
    """max(1, max |score|): a softmax's relative error grows with its logits' magnitude (each
    score carries a rounding error relative to itself), so the error floor scales with it."""
    if src.numel() == 0:
        return 1.0
    key = k.double()[src.long()] + (0 if ef is None else ef.double())
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return max(1.0, (scale * (q.double()[dst.long()] * key).sum(-1)).abs().max().item())


def check_attention(q, k, v, src, dst, ef=None, grad=True, ref_kwargs=None, **kwargs):
    """graph_attention against the float64 reference with the tolerance rule (yardstick: the
    reference in the inputs' dtype): output, alpha and, with ``grad``, every gradient."""
    dtype, ref_kwargs = q.dtype, ref_kwargs or {}
    leaves = [t.detach().clone().requires_grad_(grad) for t in (q, k, v) + ((ef,) if ef is not None else ())]
    inputs, names = leaves + [src, dst], ["q", "k", "v", "edge_feat"][:len(leaves)] + ["src_idx", "dst_idx"]
    copies = snapshot(*inputs)
    out, alpha = edgedot.graph_attention(*leaves[:3], src, dst, edge_feat=leaves[3] if ef is not None else None,
                                         return_attention=True, **kwargs)
    low_out, low_alpha, low_leaves = reference(q, k, v, src, dst, ef, requires_grad=grad, **ref_kwargs)
    out64, alpha64, leaves64 = reference(q, k, v, src, dst, ef, torch.float64, requires_grad=grad, **ref_kwargs)
    condition = score_condition(q, k, src, dst, ef, kwargs.get("scale"))
    assert out.shape == (q.shape[0], q.shape[1], v.shape[-1]) and out.is_contiguous()
    assert_accurate(out, low_out, out64, dtype, "out", condition)
    assert_accurate(alpha, low_alpha, alpha64, dtype, "alpha", condition)
    if not grad:
        return out, alpha, None
    grad_out = rand_feat(out.shape, dtype, q.device, gen(99))
    grad_out_copy = grad_out.clone()
    grads = torch.autograd.grad(out, leaves, grad_out)
    assert_unchanged(inputs + [grad_out], copies + [grad_out_copy], names + ["grad_out"])
    if src.numel() == 0:  # the reference does not depend on its inputs at all then
        for name, g, leaf in zip("qkve", grads, leaves):
            assert torch.equal(g, torch.zeros_like(leaf)), name
        return out, alpha, grads
    low_grads = torch.autograd.grad(low_out, low_leaves, grad_out, allow_unused=True)
    grads64 = torch.autograd.grad(out64, leaves64, grad_out.double(), allow_unused=True)
    for name, g, low, g64, leaf in zip(("dq", "dk", "dv", "d_edge_feat"), grads, low_grads, grads64, leaves):
        low = torch.zeros_like(leaf) if low is None else low
        g64 = torch.zeros_like(leaf, dtype=torch.float64) if g64 is None else g64
        assert_accurate(g, low, g64, dtype, name, condition)
    return out, alpha, grads


# ------------------------------------------------------------------------------ forward + backward


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("dtype", FEAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("device", DEVICES)
def test_dtypes(device, dtype, index_dtype, small_chunks):
    check_attention(*make_inputs(dtype=dtype, device=device, index_dtype=index_dtype, dim_v=13))


@pytest.mark.parametrize("dim", [8, 24, 64, 128, 256])
@pytest.mark.parametrize("device", DEVICES)
def test_head_dims(device, dim):
    check_attention(*make_inputs(dim=dim, device=device, num_edges=200, heads=2))


@pytest.mark.parametrize("dtype", FEAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("device", DEVICES)
def test_edge_feat(device, dtype, small_chunks):
    check_attention(*make_inputs(dtype=dtype, device=device, edge_feat=True))


@pytest.mark.parametrize("shape", [
    dict(heads=1, dim=8, dim_v=8), dict(heads=1, dim=64, dim_v=3), dict(heads=4, dim=8, dim_v=32),
    dict(num_src=5, num_dst=60, num_edges=150), dict(num_src=200, num_dst=3, num_edges=90),
    dict(num_src=1, num_dst=1, num_edges=7, dim=3, dim_v=5), dict(heads=2, dim=5, dim_v=7, num_edges=1)],
    ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
@pytest.mark.parametrize("device", DEVICES)
def test_shapes(device, shape, small_chunks):
    check_attention(*make_inputs(device=device, **shape))


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("device", DEVICES)
def test_no_edges(device, index_dtype):
    q, k, v, src, dst, ef = make_inputs(num_edges=0, device=device, index_dtype=index_dtype, edge_feat=True)
    out, alpha, grads = check_attention(q, k, v, src, dst, ef)
    assert torch.equal(out, torch.zeros_like(out)) and alpha.shape == (0, q.shape[1])
    assert grads[3].shape == ef.shape


@pytest.mark.parametrize("device", DEVICES)
def test_zero_in_degree_self_loops_duplicates(device):
    """Nodes without incoming edges get exact zeros (and zero gradients); self-loops and
    repeated edges count once per copy."""
    num_nodes = 6
    src = torch.tensor([0, 1, 1, 1, 2, 3, 3, 5, 5, 0], device=device)
    dst = torch.tensor([0, 1, 1, 2, 2, 3, 0, 5, 0, 0], device=device)  # node 4 receives nothing
    g = gen(1)
    q, k, v = (rand_feat((num_nodes, 2, 8), torch.float32, device, g) for _ in range(3))
    out, alpha, grads = check_attention(q, k, v, src, dst)
    assert torch.equal(out[4], torch.zeros_like(out[4]))
    assert torch.equal(grads[0][4], torch.zeros_like(grads[0][4]))  # dq of a node without edges
    assert torch.equal(grads[1][4], torch.zeros_like(grads[1][4]))  # dk of a node with no out-edges
    # A node with one incoming edge (a duplicate pair counts twice) puts all its weight on it.
    torch.testing.assert_close(alpha[dst == 3], torch.ones_like(alpha[dst == 3]))
    torch.testing.assert_close(alpha[dst == 1], torch.full_like(alpha[dst == 1], 0.5))
    torch.testing.assert_close(out[1], v[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("offset", [1e4, -1e4])
@pytest.mark.parametrize("device", DEVICES)
def test_large_logits(device, offset, dtype):
    """Logits around +-1e4 with O(1) spread: exp() without the running maximum overflows or
    underflows to 0/0."""
    q, k, v, src, dst, _ = make_inputs(device=device, dtype=torch.float64, dim=16)
    q, k = q.clone(), k.clone()
    k[..., 0] = 1.0  # every key has the same unit component ...
    q[..., 0] = offset * 4.0  # ... that the query scales to the offset (scale = 1/4)
    out, alpha, _ = check_attention(q.to(dtype), k.to(dtype), v.to(dtype), src, dst)
    assert torch.isfinite(out).all()
    sums = torch.zeros(q.shape[0], q.shape[1], dtype=torch.float64, device=device)
    sums.index_add_(0, dst.long(), alpha.double())
    has_edges = torch.bincount(dst.long(), minlength=q.shape[0]) > 0
    torch.testing.assert_close(sums[has_edges], torch.ones_like(sums[has_edges]), rtol=0, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("device", DEVICES)
def test_non_finite_scores(device, dtype):
    """One rule on every device: a destination whose every score is -inf (node 0) or -inf and
    NaN (node 2) gets NaN output and NaN lse; a -inf edge into a node with finite scores (edge 4
    into node 1) has alpha 0 and adds nothing to any gradient, though its key is infinite; a node
    without edges (3) gets zeros and lse -inf. Gradients are finite wherever the output is."""
    g = gen(17)
    heads, dim = 2, 4
    q, k, v = (rand_feat((n, heads, dim), torch.float64, device, g) for n in (4, 7, 7))
    q[:, :, 0] = 1.0
    k[[0, 1, 4, 6], :, 0] = float("-inf")
    k[5, :, 0] = float("nan")
    src = torch.tensor([0, 1, 2, 3, 4, 5, 6, 2], device=device)
    dst = torch.tensor([0, 0, 1, 1, 1, 2, 2, 1], device=device)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    scale = dim ** -0.5
    out, lse, alpha, _ = OP(q, k, v, None, src, dst, None, None, None, None, scale, 0.0, None, True, True)
    assert torch.isnan(out[[0, 2]]).all() and torch.isnan(lse[[0, 2]]).all()
    assert torch.isfinite(out[1]).all() and torch.isfinite(lse[1]).all()
    assert torch.equal(out[3], torch.zeros_like(out[3])) and (lse[3] == float("-inf")).all()
    assert (alpha[4] == 0).all() and torch.isfinite(alpha[[2, 3, 7]]).all()

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    finite_rows = torch.tensor([1, 3], device=device)
    grad_out = rand_feat((2, heads, dim), dtype, device, g)
    got = edgedot.graph_attention(*leaves, src, dst, scale=scale)
    assert torch.equal(torch.isnan(got), torch.isnan(out))
    dq, dk, dv = torch.autograd.grad(got[finite_rows], leaves, grad_out)
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out64, alpha64 = edgedot.graph_attention_reference(*leaves64, src, dst, scale=scale)
    assert torch.equal(torch.isnan(out64), torch.isnan(out)) and (alpha64[4] == 0).all()
    want = torch.autograd.grad(out64[finite_rows], leaves64, grad_out.double())
    live_src = torch.tensor([2, 3, 4], device=device)
    for name, got_grad, want_grad, rows in (("dq", dq, want[0], finite_rows), ("dk", dk, want[1], live_src),
                                            ("dv", dv, want[2], live_src)):
        assert torch.isfinite(got_grad[rows]).all() and torch.isfinite(want_grad[rows]).all(), name
        assert rel_error(got_grad[rows], want_grad[rows]) < {torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, 2e-2), name
    assert torch.equal(dk[4], torch.zeros_like(dk[4])) and torch.equal(dv[4], torch.zeros_like(dv[4]))


@pytest.mark.parametrize("device", DEVICES)
def test_hub(device, monkeypatch):
    """One destination with 100k incoming edges (on the CPU two chunks of the default size), plus
    a sparse rest."""
    monkeypatch.setattr(cpu_attention, "ONE_PASS_BYTES", 0)
    num_edges, hub = 100_000, 3
    q, k, v, src, dst, ef = make_inputs(num_src=5000, num_dst=50, num_edges=num_edges, heads=2, dim=16,
                                        device=device, skewed=False, edge_feat=True)
    dst = dst.clone()
    dst[: num_edges - 500] = hub
    check_attention(q, k, v, src, dst, ef)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_qkv_slices(device, small_chunks):
    """q, k, v as strided views of one [N, 3 * H * D] projection (last dim contiguous), and a
    transposed (non-unit last stride) v."""
    g = gen(2)
    num_nodes, heads, dim = 40, 4, 16
    qkv = rand_feat((num_nodes, 3 * heads * dim), torch.float32, device, g).view(num_nodes, 3, heads, dim)
    q, k, v = qkv.unbind(1)
    assert not q.is_contiguous()
    src, dst = rand_index(num_nodes, 400, device=device, g=g), rand_index(num_nodes, 400, device=device, g=g)
    out = check_attention(q, k, v, src, dst)[0]
    ref = edgedot.graph_attention(q.contiguous(), k.contiguous(), v.contiguous(), src, dst)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    v_t = rand_feat((num_nodes, dim, heads), torch.float32, device, g).transpose(1, 2)
    check_attention(q, k, v_t, src, dst)


@pytest.mark.parametrize("scale", [0.01, 1.0, 3.0])
@pytest.mark.parametrize("device", DEVICES)
def test_scale(device, scale):
    check_attention(*make_inputs(device=device, dim=8), scale=scale, ref_kwargs={"scale": scale})


def test_gradcheck():
    q, k, v, src, dst, ef = make_inputs(num_src=7, num_dst=6, num_edges=25, heads=2, dim=4, dtype=torch.float64,
                                        edge_feat=True)
    dst = dst.clone()
    dst[:3] = 0  # a duplicate-heavy node, and the last node keeps no edge
    q, k, v, ef = (t.requires_grad_() for t in (q, k, v, ef))
    v2 = rand_feat((7, 2, 3), torch.float64, g=gen(5), requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k, v: edgedot.graph_attention(q, k, v2 * v.sum(), src, dst),
                                    (q, k, v))
    assert torch.autograd.gradcheck(
        lambda q, k, v, ef: edgedot.graph_attention(q, k, v, src, dst, edge_feat=ef, scale=0.7), (q, k, v, ef))

    def dropped(q, k, v, ef):  # one mask for every evaluation: the same generator state each time
        return edgedot.graph_attention(q, k, v, src, dst, edge_feat=ef, dropout_p=0.4,
                                       generator=torch.Generator().manual_seed(11))
    assert torch.autograd.gradcheck(dropped, (q, k, v, ef))


# ------------------------------------------------------------------------------ determinism


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("device", DEVICES)
def test_bitwise_repeat(device, dtype):
    """Outputs and gradients repeat bit for bit: default mode, deterministic mode, with a plan
    (and a plan gives the same bits as the groupings built per call)."""
    q, k, v, src, dst, ef = make_inputs(device=device, dtype=dtype, num_edges=2000, edge_feat=True, dim=32)
    plan = edgedot.EdgePlan(src, dst, k.shape[0], q.shape[0])
    grad_out = rand_feat((q.shape[0], q.shape[1], v.shape[-1]), dtype, device, gen(3))

    def run(**kwargs):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, ef)]
        out, alpha = edgedot.graph_attention(*leaves[:3], src, dst, edge_feat=leaves[3], return_attention=True,
                                             dropout_p=0.2, generator=torch.Generator(device).manual_seed(4), **kwargs)
        return (out, alpha) + torch.autograd.grad(out, leaves, grad_out)

    first = run()
    for kwargs in ({}, {"deterministic": True}, {"plan": plan}, {"plan": plan, "deterministic": True}):
        for a, b in zip(first, run(**kwargs)):
            assert torch.equal(a, b), kwargs


def test_plan_offsets():
    src = torch.tensor([4, 0, 2, 2, 1, 0], dtype=torch.int32)
    dst = torch.tensor([1, 1, 0, 3, 1, 0], dtype=torch.int32)
    plan = edgedot.EdgePlan(src, dst, 5, 4)
    assert plan.offsets("dst").tolist() == [0, 2, 5, 5, 6]
    assert plan.offsets("src").tolist() == [0, 2, 3, 5, 5, 6]
    assert plan.offsets("dst") is plan.offsets("dst")  # kept
    assert plan.to("cpu").offsets("src").tolist() == plan.offsets("src").tolist()
    with raises_checked(ValueError, match="side"):
        plan.offsets("rows")


# ------------------------------------------------------------------------------ dropout


def _mix32_numpy(x):
    x = x.astype(np.uint32)
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    x ^= x >> np.uint32(16)
    return x


def _mix64_numpy(x):
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _key_numpy(seed, offset):
    """The key of state (seed, offset) in native uint64 arithmetic."""
    with np.errstate(over="ignore"):
        mixed = _mix64_numpy(np.array([offset % 2**64], dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15))
        return int(_mix64_numpy(np.array([seed % 2**64], dtype=np.uint64) ^ mixed)[0])


def _keep_numpy(seed, offset, first_edge, num_edges, heads, p):
    """The interface's hash in native uint32/uint64 arithmetic (numpy wraps on overflow)."""
    with np.errstate(over="ignore"):
        c = np.arange(first_edge * heads, (first_edge + num_edges) * heads, dtype=np.uint64)
        s = _key_numpy(seed, offset)
        u = _mix32_numpy((c & np.uint64(0xFFFFFFFF)).astype(np.uint32) ^ np.uint32(s & 0xFFFFFFFF))
        u = _mix32_numpy(u ^ (c >> np.uint64(32)).astype(np.uint32) ^ np.uint32(s >> 32))
    threshold = min(int(p * 2**32), 2**32)
    return torch.from_numpy(u.astype(np.int64) >= threshold).reshape(num_edges, heads)


@pytest.mark.parametrize("offset", [0, 4, 2**63 - 4])
@pytest.mark.parametrize("seed", [0, 1, -1, 2**62 + 12345, -(2**63)])
@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_dropout_keep_hash(seed, offset, p):
    keep = dropout_keep((seed, offset), 257, 3, p)
    assert keep.dtype == torch.bool and keep.shape == (257, 3)
    assert torch.equal(keep, _keep_numpy(seed, offset, 0, 257, 3, p))
    assert torch.equal(dropout_keep(torch.tensor([seed, offset]), 257, 3, p), keep)
    if p == 0:
        assert keep.all()
    if p == 1:
        assert not keep.any()


@pytest.mark.cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=dtype_id)
@pytest.mark.parametrize("count,num_rows", [(300, 40), (9000, 5000), (9000, 30000), (40000, 7000), (0, 5)])
@pytest.mark.parametrize("width", [(1,), (4, 2), (16,), (17,), (4, 16), (2, 128)], ids=str)
@pytest.mark.parametrize("grouped", [False, True], ids=["shuffled", "grouped"])
def test_row_sums_in_edge_order(grouped, width, count, num_rows, dtype):
    """The CPU path's sums of rows (one row at a time, flat elements, a scatter by an int64 index,
    or a sparse product, by the rows' width and count and the index's dtype): index_add_'s sums
    against float64, the same bits on every run and by either index dtype, and nothing added to
    rows without edges. An index given grouped (non-decreasing) skips the sparse matrix's sort,
    whose order it already is."""
    g = gen(5)
    idx = torch.randint(num_rows - 1, (count,), generator=g, dtype=torch.int32)
    if grouped:
        idx = idx.sort().values
        matrix = cpu_attention.RowSums(idx)._sparse(num_rows, dtype)
        assert torch.equal(matrix.col_indices(), torch.sort(idx, stable=True).indices)
    rows = torch.randn((count,) + width, generator=g, dtype=dtype)
    start = torch.randn((num_rows,) + width, generator=g, dtype=dtype)
    runs = []
    for index in (idx, idx.long(), idx):
        out = start.clone()
        sums = cpu_attention.RowSums(index)
        sums.add(out, rows)
        sums.add(out, rows)  # a second sum by the same index reuses its matrix
        runs.append(out)
    assert all(torch.equal(runs[0], run) for run in runs[1:])
    want = start.double().index_add_(0, idx, rows.double()).index_add_(0, idx, rows.double())
    assert rel_error(runs[0], want) <= (1e-6 if dtype == torch.float32 else 1e-14)
    assert torch.equal(runs[0][-1], start[-1])


@pytest.mark.cpu_only
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("dtype", FEAT_DTYPES, ids=dtype_id)
def test_cpu_one_chunk_keeps_rows_and_agrees_with_chunks(dtype, index_dtype, monkeypatch):
    """A problem of one chunk keeps the forward's softmax and gathered rows for the backward
    (built once a step); the same problem in chunks recomputes them. Both against float64 (edge
    features, dropout, non-contiguous k and v), each the same bits on a second run, and the two
    paths within rounding of each other."""
    q, k, v, src, dst, ef = make_inputs(dtype=dtype, index_dtype=index_dtype, edge_feat=True)
    k, v = torch.cat([k, v], -1).split(k.shape[-1], -1)  # strided views of one tensor
    built = []
    edges = cpu_attention._attention_edges
    monkeypatch.setattr(cpu_attention, "_attention_edges", lambda *a: built.append(1) or edges(*a))

    def run():
        generator = torch.Generator().manual_seed(3)
        keep = dropout_keep(next_dropout_state("cpu", generator), src.shape[0], q.shape[1], 0.3)
        out, alpha, grads = check_attention(q, k, v, src, dst, ef, dropout_p=0.3, generator=generator,
                                            ref_kwargs={"keep": keep, "dropout_p": 0.3})
        return (out, alpha) + grads

    assert_one_chunk_path_kept(run, built, monkeypatch, PATHS_AGREE[dtype])


def test_cpu_one_chunk_threads_and_ops_agree_bitwise():
    """The one-chunk path gives the same bits with 1 and 2 threads, and through the operators
    (whose backward recomputes what an eager forward keeps) as through the eager call."""
    q, k, v, src, dst, ef = make_inputs(edge_feat=True)
    leaves = [t.detach().requires_grad_() for t in (q, k, v, ef)]
    grad_out = rand_feat(q.shape, torch.float32, "cpu", gen(7))

    def eager():
        out = edgedot.graph_attention(*leaves[:3], src, dst, edge_feat=leaves[3])
        return (out,) + torch.autograd.grad(out, leaves, grad_out)

    def ops():
        out = OP(*leaves, src, dst, None, None, None, None, q.shape[-1] ** -0.5, 0.0, None, False, True)[0]
        return (out,) + torch.autograd.grad(out, leaves, grad_out)

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = eager()
        torch.set_num_threads(2)
        runs = [eager(), ops()]
    finally:
        torch.set_num_threads(threads)
    for run in runs:
        for a, b in zip(one_thread, run):
            assert torch.equal(a, b)


@pytest.mark.cpu_only
@pytest.mark.parametrize("grouped", [False, True], ids=["shuffled", "grouped"])
@pytest.mark.parametrize("edge_feat", [False, True], ids=["noedge", "edge"])
def test_cpu_large_chunks_match_reference(edge_feat, grouped):
    """A graph whose chunks take the sparse sums (9000 edges of 2 x 16), its edges shuffled or
    grouped by destination (as a mini-batch's): forward and gradients against float64, and the
    same bits on a second run."""
    q, k, v, src, dst, ef = make_inputs(num_src=4000, num_dst=6000, num_edges=9000, heads=2, dim=16,
                                        edge_feat=edge_feat)
    if grouped:
        order = torch.argsort(dst, stable=True)
        src, dst, ef = src[order], dst[order], None if ef is None else ef[order]
    leaves = [t.detach().requires_grad_() for t in (q, k, v) + ((ef,) if edge_feat else ())]
    grad_out = rand_feat(q.shape, torch.float32, "cpu", gen(7))
    results = []
    for _ in range(2):
        out = edgedot.graph_attention(*leaves[:3], src, dst, edge_feat=leaves[3] if edge_feat else None)
        results.append((out,) + torch.autograd.grad(out, leaves, grad_out))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    out64, _ = edgedot.graph_attention_reference(*leaves64[:3], src, dst, edge_feat=leaves64[3] if edge_feat else None)
    grads64 = torch.autograd.grad(out64, leaves64, grad_out.double())
    for got, want in zip(results[0], (out64,) + grads64):
        assert rel_error(got, want) <= 1e-5


def test_dropout_keep_rate_and_edge_ids_past_2_to_32():
    keep = dropout_keep((123, 0), 200_000, 4, 0.3)
    assert abs(keep.float().mean().item() - 0.7) < 0.005
    # Counters e * H + h past 2**32 feed their high half into the second round.
    start = 2**32 // 4 - 2
    part = cpu_attention.keep_mask(dropout.key(-77, 8), start, start + 4, 4, 0.5, "cpu")
    assert torch.equal(part, _keep_numpy(-77, 8, start, 4, 4, 0.5))


@pytest.mark.parametrize("p", [0.3, 1.0])
@pytest.mark.parametrize("device", DEVICES)
def test_dropout_matches_reference_with_mask(device, p, small_chunks):
    """The output and every gradient equal the reference's under the mask dropout_keep gives
    for the state the call draws: the backward regenerates the forward's mask."""
    q, k, v, src, dst, ef = make_inputs(device=device, edge_feat=True, dim=16)
    generator = torch.Generator(device).manual_seed(21)
    state = next_dropout_state(device, generator)
    keep = dropout_keep(state, src.shape[0], q.shape[1], p, device)
    assert keep.device.type == torch.device(device).type
    out, alpha, _ = check_attention(q, k, v, src, dst, ef, dropout_p=p, generator=generator,
                                    ref_kwargs={"keep": keep, "dropout_p": p})
    if p == 1.0:
        assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_reproducible_from_generator(device):
    q, k, v, src, dst, _ = make_inputs(device=device)
    runs = [edgedot.graph_attention(q, k, v, src, dst, dropout_p=0.5,
                                    generator=torch.Generator(device).manual_seed(s))
            for s in (5, 5, 6)]
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    torch.manual_seed(8)
    a = edgedot.graph_attention(q, k, v, src, dst, dropout_p=0.5)
    torch.manual_seed(8)
    b = edgedot.graph_attention(q, k, v, src, dst, dropout_p=0.5)
    c = edgedot.graph_attention(q, k, v, src, dst, dropout_p=0.5)  # the default generator moved on
    assert torch.equal(a, b) and not torch.equal(a, c)
    # dropout_p=0 draws nothing and equals the plain call.
    state = torch.get_rng_state()
    torch.testing.assert_close(edgedot.graph_attention(q, k, v, src, dst, dropout_p=0.0),
                               edgedot.graph_attention(q, k, v, src, dst), rtol=0, atol=0)
    assert torch.equal(state, torch.get_rng_state())


# ------------------------------------------------------------------------------ custom ops


def _op_args(device, dtype=torch.float32, edge_feat=False, dropout_p=0.0, return_attention=False, plan=False):
    q, k, v, src, dst, ef = make_inputs(num_edges=120, heads=2, dim=8, dim_v=6 if not edge_feat else None,
                                        dtype=dtype, device=device, edge_feat=edge_feat, index_dtype=torch.int32)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    groups = (None,) * 4
    if plan:
        p = edgedot.EdgePlan(src, dst, k.shape[0], q.shape[0])
        groups = (p.dst, p.offsets("dst"), p.src, p.offsets("src"))
    generator = torch.Generator(device).manual_seed(1234) if dropout_p else None
    return (q, k, v, ef, src, dst, *groups, 0.4, dropout_p, generator, return_attention, True)


@pytest.mark.parametrize("case", [
    dict(), dict(return_attention=True), dict(edge_feat=True, dropout_p=0.25), dict(plan=True, dropout_p=0.5),
    dict(dtype=torch.float64, edge_feat=True, return_attention=True), dict(dtype=torch.bfloat16, plan=True)],
    ids=lambda c: "-".join(f"{k}={dtype_id(v) if isinstance(v, torch.dtype) else v}" for k, v in c.items()) or "plain")
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device, case):
    # With dropout every run draws a new state, so the comparison of eager and traced runs cannot
    # hold: test_compile_fullgraph compares them from one seed of the default generator instead.
    utils = ("test_schema", "test_autograd_registration", "test_faketensor") + \
        (() if case.get("dropout_p") else ("test_aot_dispatch_dynamic",))
    torch.library.opcheck(OP, _op_args(device, **case), test_utils=utils)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_backward(device):
    args = _op_args(device, edge_feat=True, dropout_p=0.3)
    q, k, v, ef, src, dst = args[:6]
    out, lse, _, rng_state = (t.detach() for t in OP(*args))
    grad_out = torch.randn_like(out)
    for edge_feat_grad, kv_grad in ((False, True), (True, True), (False, False)):
        torch.library.opcheck(BACKWARD_OP, (grad_out, q.detach(), k.detach(), v.detach(), ef, out, lse, src, dst,
                                            *args[6:12], rng_state, edge_feat_grad, kv_grad))


def _loss(q, k, v, src, dst, ef, plan, dropout_p):
    out = edgedot.graph_attention(q, k, v, src, dst, edge_feat=ef, plan=plan, dropout_p=dropout_p)
    return (out.float().sin() * out.float()).sum(), out


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph(device, backend):
    """torch.compile(fullgraph=True) of forward + backward matches eager; dropout with the
    default generator traces too."""
    torch._dynamo.reset()
    q, k, v, src, dst, ef = make_inputs(device=device, edge_feat=True, dim=8)
    leaves = [t.requires_grad_() for t in (q, k, v, ef)]
    plan = edgedot.EdgePlan(src, dst, k.shape[0], q.shape[0])
    compiled = torch.compile(_loss, fullgraph=True, backend=backend)
    for use_plan in (None, plan):
        loss_c, out_c = compiled(q, k, v, src, dst, ef, use_plan, 0.0)
        loss_e, out_e = _loss(q, k, v, src, dst, ef, use_plan, 0.0)
        torch.testing.assert_close(out_c, out_e)
        for gc, ge in zip(torch.autograd.grad(loss_c, leaves), torch.autograd.grad(loss_e, leaves)):
            torch.testing.assert_close(gc, ge)
    if backend == "aot_eager":  # eager kernels: the op draws its dropout state when it runs, as in eager
        torch.manual_seed(3)
        loss_c, out_c = compiled(q, k, v, src, dst, ef, None, 0.5)
        torch.manual_seed(3)
        loss_e, out_e = _loss(q, k, v, src, dst, ef, None, 0.5)
        torch.testing.assert_close(out_c, out_e)
        for gc, ge in zip(torch.autograd.grad(loss_c, leaves), torch.autograd.grad(loss_e, leaves)):
            torch.testing.assert_close(gc, ge)


class _ExtensionOnCPU:
    """Stands in for the CUDA extension's attention functions: checks the groupings it is
    handed against their definition, then computes with the CPU implementation."""

    def __init__(self, src, dst, num_src, num_dst):
        self.want = {"dst": edgedot.runtime.plan.build_side(dst, src, num_dst, num_src),
                     "src": edgedot.runtime.plan.build_side(src, dst, num_src, num_dst)}
        self.rows = {"dst": num_dst, "src": num_src}
        self.src, self.dst = src, dst

    def _check(self, side, group, offsets):
        assert torch.equal(group, self.want[side]), side
        rows = group[group.shape[0] // 2:] >> 32
        want = torch.tensor([int((rows < r).sum()) for r in range(self.rows[side] + 1)])
        assert offsets.dtype == torch.int64 and torch.equal(offsets, want), side

    def attention_forward(self, q, k, v, ef, src, dst, dst_group, dst_offsets, scale, p, generator,
                          return_attention):
        assert torch.equal(src, self.src) and torch.equal(dst, self.dst)
        self._check("dst", dst_group, dst_offsets)
        assert isinstance(generator, torch.Generator) and isinstance(scale, float)
        rng_state = dropout.draw_cpu(generator)
        key = dropout.key(*rng_state.tolist())
        out = cpu_attention.forward(q, k, v, ef, self.src, self.dst, scale, p, key, return_attention)
        return out[:3] + (rng_state,)

    def attention_backward(self, grad_out, q, k, v, ef, out, lse, src, dst, dst_group, dst_offsets, src_group,
                           src_offsets, scale, p, rng_state, edge_feat_grad, kv_grad, records):
        assert torch.equal(src, self.src) and torch.equal(dst, self.dst) and kv_grad
        assert records is True  # the records, where they fit
        self._check("dst", dst_group, dst_offsets)
        self._check("src", src_group, src_offsets)
        key = dropout.key(*rng_state.tolist())
        return cpu_attention.backward(grad_out, q, k, v, ef, out, lse, self.src, self.dst, scale, p, key,
                                       edge_feat_grad)


@pytest.mark.parametrize("use_plan", [False, True], ids=["noplan", "plan"])
def test_cuda_implementation_wiring(monkeypatch, use_plan):
    """The CUDA implementations hand the extension the groupings of the interface (built, or
    the plan's) and their results through unchanged: run on CPU tensors with the extension
    replaced by the CPU implementation."""
    from edgedot.ops import attention as attention_ops

    q, k, v, src, dst, ef = make_inputs(edge_feat=True, dim=8, index_dtype=torch.int32)
    monkeypatch.setattr(attention_ops, "cuda_module", lambda: _ExtensionOnCPU(src, dst, k.shape[0], q.shape[0]))
    groups = (None,) * 4
    if use_plan:
        plan = edgedot.EdgePlan(src, dst, k.shape[0], q.shape[0])
        groups = (plan.dst, plan.offsets("dst"), plan.src, plan.offsets("src"))
    out, lse, alpha, rng_state = attention_ops._forward_cuda(q, k, v, ef, src, dst, *groups, 0.3, 0.2,
                                                              torch.Generator().manual_seed(5), True, True)
    want = OP(q, k, v, ef, src, dst, *(None,) * 4, 0.3, 0.2, torch.Generator().manual_seed(5), True, True)
    for a, b in zip((out, lse, alpha, rng_state), want):
        assert torch.equal(a, b)
    grad_out = torch.randn_like(out)
    got = attention_ops._backward_cuda(grad_out, q, k, v, ef, out, lse, src, dst, *groups, 0.3, 0.2, rng_state,
                                        True, True)
    want = BACKWARD_OP(grad_out, q, k, v, ef, out, lse, src, dst, *(None,) * 4, 0.3, 0.2, rng_state, True, True)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------ errors


def _bad(device):
    q, k, v, src, dst, ef = make_inputs(num_edges=20, heads=2, dim=4, device=device, edge_feat=True)
    base = dict(q=q, k=k, v=v, src_idx=src, dst_idx=dst)
    other = edgedot.EdgePlan(src[:10], dst[:10], k.shape[0], q.shape[0])
    return base, ef, other


BAD_CASES = {  # name -> (change to the arguments, exception, message pattern)
    "q_list": (lambda a, ef, p: a.update(q=[1.0]), TypeError, "q must be a tensor"),
    "q_2d": (lambda a, ef, p: a.update(q=a["q"][:, 0]), ValueError, "q must be 3-D"),
    "k_int": (lambda a, ef, p: a.update(k=a["k"].int()), TypeError, "k must be float"),
    "v_dtype": (lambda a, ef, p: a.update(v=a["v"].double()), TypeError, "v is torch.float64"),
    "v_rows": (lambda a, ef, p: a.update(v=a["v"][1:]), ValueError, "k and v"),
    "heads": (lambda a, ef, p: a.update(k=a["k"][:, :1]), ValueError, "head counts"),
    "zero_heads": (lambda a, ef, p: a.update(q=a["q"][:, :0], k=a["k"][:, :0], v=a["v"][:, :0]),
                   ValueError, "at least one head"),
    "dim": (lambda a, ef, p: a.update(k=a["k"][..., :3]), ValueError, "feature sizes"),
    "edge_feat_shape": (lambda a, ef, p: a.update(edge_feat=ef[1:]), ValueError, "edge_feat must be"),
    "edge_feat_2d": (lambda a, ef, p: a.update(edge_feat=ef[:, 0]), ValueError, "edge_feat must be"),
    "edge_feat_dtype": (lambda a, ef, p: a.update(edge_feat=ef.double()), TypeError, "edge_feat is"),
    "edge_feat_dv": (lambda a, ef, p: a.update(edge_feat=ef, v=a["v"][..., :3]), ValueError, "edge_feat is added"),
    "edge_feat_list": (lambda a, ef, p: a.update(edge_feat=[0]), TypeError, "edge_feat must be a tensor"),
    "src_float": (lambda a, ef, p: a.update(src_idx=a["src_idx"].float()), TypeError, "src_idx must be int32"),
    "dst_2d": (lambda a, ef, p: a.update(dst_idx=a["dst_idx"][None]), ValueError, "dst_idx must be 1-D"),
    "lengths": (lambda a, ef, p: a.update(dst_idx=a["dst_idx"][1:]), ValueError, "same length"),
    "scale_str": (lambda a, ef, p: a.update(scale="0.5"), TypeError, "scale"),
    "scale_nan": (lambda a, ef, p: a.update(scale=float("nan")), ValueError, "scale"),
    "dropout_high": (lambda a, ef, p: a.update(dropout_p=1.5), ValueError, "dropout_p"),
    "dropout_type": (lambda a, ef, p: a.update(dropout_p=None), TypeError, "dropout_p"),
    "generator": (lambda a, ef, p: a.update(dropout_p=0.1, generator=3), TypeError, "generator"),
    "plan_type": (lambda a, ef, p: a.update(plan="plan"), TypeError, "plan"),
    "plan_graph": (lambda a, ef, p: a.update(plan=p), ValueError, "plan was built"),
    "deterministic": (lambda a, ef, p: a.update(deterministic="yes"), TypeError, "deterministic"),
    "check_indices": (lambda a, ef, p: a.update(check_indices=None), TypeError, "check_indices"),
    "return_attention": (lambda a, ef, p: a.update(return_attention=1), TypeError, "return_attention"),
    "device": (lambda a, ef, p: a.update(v=a["v"].to("meta")), ValueError, "v is on meta"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
@pytest.mark.parametrize("device", DEVICES)
def test_bad_inputs(device, case):
    change, error, pattern = BAD_CASES[case]
    args, ef, other_plan = _bad(device)
    change(args, ef, other_plan)
    with raises_checked(error, match=pattern):
        edgedot.graph_attention(**args)


@pytest.mark.parametrize("name, value", [("src_idx", 37), ("src_idx", -1), ("dst_idx", 29), ("dst_idx", -5)])
@pytest.mark.parametrize("device", DEVICES)
def test_out_of_range_index(device, name, value):
    q, k, v, src, dst, _ = make_inputs(device=device)
    q.requires_grad_()
    bad = {"src_idx": src.clone(), "dst_idx": dst.clone()}
    bad[name][7] = value
    with raises_checked(IndexError, match=name):
        edgedot.graph_attention(q, k, v, bad["src_idx"], bad["dst_idx"])
    assert q.grad is None
    # Still usable, and the same index tensor fixed in place is checked again.
    bad[name][7] = 0
    check_attention(q.detach(), k, v, bad["src_idx"], bad["dst_idx"])
    bad[name][7] = value
    with raises_checked(IndexError, match=name):
        edgedot.graph_attention(q, k, v, bad["src_idx"], bad["dst_idx"])


def test_cpu_checks_indices_even_without_check():
    q, k, v, src, dst, _ = make_inputs()
    src = src.clone()
    src[0] = 1000
    with raises_checked(IndexError, match="src_idx"):
        edgedot.graph_attention(q, k, v, src, dst, check_indices=False)


# ------------------------------------------------------------------------------ CUDA only


@requires_cuda
@pytest.mark.parametrize("dtype", FEAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("edge_feat", [False, True], ids=["plain", "edge_feat"])
def test_cuda_matches_cpu(dtype, edge_feat, monkeypatch):
    """The CUDA kernels and the CPU path agree (to the accumulation's rounding), dropout mask
    included (the CPU call made to draw the CUDA calls' state), and repeated CUDA calls are
    bitwise identical (poisoned memory in between)."""
    q, k, v, src, dst, ef = make_inputs(num_edges=5000, heads=4, dim=32, dtype=dtype, edge_feat=edge_feat,
                                        index_dtype=torch.int32)
    grad_out = rand_feat((q.shape[0], 4, 32), dtype, "cpu", gen(7))
    cuda_state = next_dropout_state("cuda", torch.Generator("cuda").manual_seed(9))
    monkeypatch.setattr(dropout, "draw_cpu", lambda generator=None: cuda_state.clone())

    def run(device):
        leaves = [t.to(device).requires_grad_() for t in (q, k, v) + ((ef,) if edge_feat else ())]
        out, alpha = edgedot.graph_attention(*leaves[:3], src.to(device), dst.to(device),
                                             edge_feat=leaves[3] if edge_feat else None, dropout_p=0.25,
                                             generator=torch.Generator(device).manual_seed(9), return_attention=True)
        return [t.cpu() for t in (out, alpha) + torch.autograd.grad(out, leaves, grad_out.to(device))]

    cpu = run("cpu")
    fill_cuda_cache_with_nan()
    first = run("cuda")
    fill_cuda_cache_with_nan()
    second = run("cuda")
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    for name, c, a, b in zip(("out", "alpha", "dq", "dk", "dv", "d_edge_feat"), cpu, first, second):
        assert torch.equal(a, b), f"{name}: CUDA calls differ"
        assert torch.isfinite(a).all(), name
        assert rel_error(a, c) <= tol, f"{name}: CUDA vs CPU {rel_error(a, c):.3e}"


@requires_cuda
@pytest.mark.parametrize("dtype", FEAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", ["plain", "edge_feat", "dropout", "hub", "dst_ptr", "dim_v"])
def test_cuda_records_give_the_recomputed_gradients(case, dtype, monkeypatch):
    """The source pass from the destination pass's records (alpha and ds) gives the gradients of
    the source pass that recomputes them, bit for bit: edge features, dropout, a hub whose rows are
    split into chunks, edges given grouped, values of another width."""
    q, k, v, src, dst, ef = make_inputs(num_src=300, num_dst=200, num_edges=40_000 if case == "hub" else 3_000, heads=4,
                                        dim=32, dim_v=16 if case == "dim_v" else None, dtype=dtype, device="cuda",
                                        edge_feat=case == "edge_feat")
    src, dst, kwargs = records_case_graph(case, src, dst, q.shape[0])
    grad_out = rand_feat((q.shape[0], 4, v.shape[2]), dtype, "cuda", gen(5))

    def run():
        leaves = [t.detach().requires_grad_() for t in (q, k, v) + ((ef,) if ef is not None else ())]
        if case == "dropout":
            kwargs.update(dropout_p=0.3, generator=torch.Generator("cuda").manual_seed(11))
        out = edgedot.graph_attention(*leaves[:3], src, dst, edge_feat=leaves[3] if ef is not None else None, **kwargs)
        return (out,) + torch.autograd.grad(out, leaves, grad_out)

    assert_records_change_nothing(run, monkeypatch)


@requires_cuda
def test_cuda_head_dim_limit():
    q, k, v, src, dst, _ = make_inputs(device="cuda", dim=257, dim_v=8)
    with raises_checked(ValueError, match="at most 256"):
        edgedot.graph_attention(q, k, v, src, dst)
    with raises_checked(ValueError, match="at most 256"):
        edgedot.graph_attention(q[..., :8], k[..., :8], v.new_zeros(v.shape[0], v.shape[1], 300), src, dst)


@pytest.mark.gpu_memory_heavy
@requires_cuda
def test_cuda_hub_million_edges():
    """A destination with a million incoming edges; the rest sparse."""
    num_edges = 1 << 20
    q, k, v, src, dst, _ = make_inputs(num_src=100_000, num_dst=1000, num_edges=num_edges, heads=4, dim=32,
                                       device="cuda", skewed=False, index_dtype=torch.int32)
    dst = dst.clone()
    dst[: num_edges - 10_000] = 17
    fill_cuda_cache_with_nan()
    check_attention(q, k, v, src, dst)


@requires_cuda
def test_cuda_memory_stays_below_edge_features():
    """Forward + backward allocate nothing of E x H x D (the reference gathers several)."""
    num_edges, heads, dim = 1 << 21, 4, 64
    q, k, v, src, dst, _ = make_inputs(num_src=20_000, num_dst=20_000, num_edges=num_edges, heads=heads, dim=dim,
                                       device="cuda", index_dtype=torch.int32)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    edgedot.graph_attention(q, k, v, src, dst).sum().backward()  # build and warm up
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    edgedot.graph_attention(q, k, v, src, dst).sum().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert peak < num_edges * heads * dim * 4 // 4, f"peak {peak} bytes"


@requires_cuda
@pytest.mark.parametrize("deterministic", [False, True])
def test_cuda_unchecked_out_of_range(deterministic):
    """check_indices=False never waits: an out-of-range source makes its destination NaN, an
    out-of-range destination drops its edge; no read outside the tables, and the process stays
    usable."""
    q, k, v, src, dst, _ = make_inputs(device="cuda")
    src_bad, dst_bad = src.clone(), dst.clone()
    src_bad[3] = 10**6
    dst_bad[5] = -7
    out = edgedot.graph_attention(q, k, v, src_bad, dst, check_indices=False, deterministic=deterministic)
    nan_rows = torch.isnan(out).any(-1).any(-1)
    assert nan_rows[dst[3]] and nan_rows.sum() == 1
    out = edgedot.graph_attention(q, k, v, src, dst_bad, check_indices=False)
    keep = torch.arange(src.shape[0], device="cuda") != 5
    ref, _ = edgedot.graph_attention_reference(q, k, v, src[keep], dst[keep])
    torch.testing.assert_close(out, ref)
    qg = q.clone().requires_grad_()
    edgedot.graph_attention(qg, k, v, src, dst_bad, check_indices=False).sum().backward()
    assert torch.isfinite(qg.grad).all()
    torch.cuda.synchronize()
    check_attention(q, k, v, src, dst)
