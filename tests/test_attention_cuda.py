"""The CUDA graph attention kernels, called directly through the extension
(``attention_forward`` / ``attention_backward``) with groupings from ``edgedot.runtime.plan.build_side``,
against a float64 unfused reference written here (gather, scatter_reduce amax, exp, index_add).
Skipped without a GPU, apart from the dropout hash's check against the Python side's."""

import math

import pytest
import torch

import edgedot
import edgedot.runtime.build
import edgedot.runtime.plan
from utils import FEAT_DTYPES, dtype_id, gen, rand_feat, rel_error, requires_cuda

# Relative-error floors: float32 and float64 as agreed for these kernels; half types also pass at
# twice the error of the same unfused math done in their dtype.
FLOORS = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 2e-3, torch.bfloat16: 1e-2}
MASK32 = 0xFFFFFFFF


def _mul32(x, c):
    """(x * c) mod 2**32 for int64 tensors of uint32 values, without int64 overflow."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & MASK32


def _mix32(x):
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _mix64(x):
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) % 2**64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) % 2**64
    return x ^ (x >> 31)


def keep_mask(seed, num_edges, heads, p, device="cpu", offset=0):
    """The agreed dropout mask of state (seed, offset), bool [E, H], in int64 tensor arithmetic."""
    c = torch.arange(num_edges * heads, dtype=torch.int64, device=device)
    key = _mix64(seed % 2**64 ^ _mix64((offset + 0x9E3779B97F4A7C15) % 2**64))
    seed_lo, seed_hi = key & MASK32, (key >> 32) & MASK32
    u = _mix32((c & MASK32) ^ seed_lo)
    u = _mix32(u ^ (c >> 32) ^ seed_hi)
    threshold = min(math.floor(p * 2**32), 2**32)
    return (u >= threshold).reshape(num_edges, heads)


def grouping(row_idx, other_idx, num_rows, num_other):
    """build_side's grouping and its offsets [num_rows + 1]."""
    group = edgedot.runtime.plan.build_side(row_idx, other_idx, num_rows, num_other)
    rows = group[group.shape[0] // 2:] >> 32
    offsets = torch.searchsorted(rows, torch.arange(num_rows + 1, device=rows.device, dtype=torch.int64))
    return group, offsets


def reference(q, k, v, ef, src, dst, scale, keep=None, p=0.0):
    """Unfused graph attention in the inputs' dtype: (out, lse, alpha before dropout)."""
    num_dst, heads = q.shape[0], q.shape[1]
    src, dst = src.long(), dst.long()
    kk = k[src] if ef is None else k[src] + ef
    vv = v[src] if ef is None else v[src] + ef
    score = scale * (q[dst] * kk).sum(-1)  # [E, H]
    m = torch.full((num_dst, heads), -math.inf, dtype=score.dtype, device=score.device)
    m = m.scatter_reduce(0, dst[:, None].expand_as(score), score.detach(), "amax", include_self=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    ex = torch.exp(score - m[dst])
    l = torch.zeros_like(m).index_add(0, dst, ex)
    lse = m + torch.log(l)
    alpha = torch.exp(score - lse[dst])
    weight = alpha if keep is None else alpha * keep.to(alpha.dtype) / (1 - p) if p < 1 else alpha * 0
    out = torch.zeros((num_dst, heads, v.shape[-1]), dtype=v.dtype, device=v.device)
    out = out.index_add(0, dst, weight[..., None] * vv)
    return out, lse, alpha


def reference_grads(q, k, v, ef, src, dst, scale, grad_out, keep=None, p=0.0, dtype=torch.float64):
    """(out, lse, alpha) and autograd's (dq, dk, dv, d_edge_feat) of the reference in ``dtype``."""
    leaves = [t.detach().to(dtype).requires_grad_(True) if t is not None else None for t in (q, k, v, ef)]
    out, lse, alpha = reference(*leaves, src, dst, scale, keep, p)
    wanted = [t for t in leaves if t is not None]
    grads = list(torch.autograd.grad(out, wanted, grad_out.to(dtype)))
    if ef is None:
        grads.append(None)
    return (out.detach(), lse.detach(), alpha.detach()), grads


def check(name, got, want64, yard, dtype, condition=1.0):
    """got vs the float64 reference: at most max(floor * condition, 2 * the error of the same
    unfused math in low precision, ``yard``). ``condition`` scales the floor where the scores are
    large: alpha's relative error is the scores' absolute error."""
    assert got.shape == want64.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want64.shape)}"
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    err = rel_error(got, want64)
    tol = FLOORS[dtype] * condition
    if yard is not None:
        tol = max(tol, 2 * rel_error(yard, want64))
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.3e} ({dtype_id(dtype)})"


def make_graph(num_src, num_dst, num_edges, g, device="cuda", empty_dst=0):
    """Random edges; the last empty_dst destinations and some sources get no edges."""
    src = torch.randint(0, max(num_src - 3, 1), (num_edges,), generator=g).to(device)
    dst = torch.randint(0, max(num_dst - empty_dst, 1), (num_edges,), generator=g).to(device)
    return src, dst


def run(q, k, v, ef, src, dst, scale, p=0.0, seed=0, return_attention=True, edge_feat_grad=None, grad_out=None,
        groups=None):
    """Forward and backward through the extension: ((out, lse, alpha), (dq, dk, dv, d_ef)). Dropout
    draws from a fresh CUDA generator seeded with ``seed``: the state (seed, 0), which the forward
    must return as rng_state."""
    ext = edgedot.runtime.build.cuda_module()
    num_dst, num_src = q.shape[0], k.shape[0]
    dst_group, dst_offsets = groups[0] if groups else grouping(dst, src, num_dst, num_src)
    src_group, src_offsets = groups[1] if groups else grouping(src, dst, num_src, num_dst)
    generator = torch.Generator("cuda").manual_seed(seed) if p > 0 else None
    *fwd, rng_state = ext.attention_forward(q, k, v, ef, src, dst, dst_group, dst_offsets, scale, p, generator,
                                            return_attention)
    fwd = tuple(fwd)
    if p > 0:
        assert rng_state.device == q.device and torch.equal(rng_state.cpu(), torch.tensor([seed, 0]))
        assert generator.get_offset() == 4, "a call moves the generator's offset on by 4"
    else:
        assert rng_state.numel() == 0
    if grad_out is None:
        return fwd, None
    edge_feat_grad = ef is not None if edge_feat_grad is None else edge_feat_grad
    bwd = ext.attention_backward(grad_out, q, k, v, ef, fwd[0], fwd[1], src, dst, dst_group, dst_offsets, src_group,
                                 src_offsets, scale, p, rng_state if p > 0 else None, edge_feat_grad, True, True)
    return fwd, bwd


def full_check(q, k, v, ef, src, dst, p=0.0, seed=1234, g=None, scale=None, return_attention=True):
    """Runs both passes and checks every output against the float64 reference."""
    dtype = q.dtype
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    heads = q.shape[1]
    num_edges = src.shape[0]
    keep = keep_mask(seed, num_edges, heads, p, q.device) if p > 0 else None
    grad_out = rand_feat((q.shape[0], heads, v.shape[-1]), dtype, "cuda", g)
    (out, lse, alpha), (dq, dk, dv, d_ef) = run(q, k, v, ef, src, dst, scale, p, seed, return_attention,
                                               grad_out=grad_out)
    fwd64, grads64 = reference_grads(q, k, v, ef, src, dst, scale, grad_out, keep, p)
    yard_fwd, yard_grads = (None, None, None), (None,) * 4
    if dtype in (torch.float16, torch.bfloat16):
        yard_fwd, yard_grads = reference_grads(q, k, v, ef, src, dst, scale, grad_out, keep, p, dtype=dtype)
    empty = torch.bincount(dst.long(), minlength=q.shape[0]) == 0
    assert out.dtype == dtype and out.shape == fwd64[0].shape
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert torch.isneginf(lse[empty]).all(), "rows without edges: lse must be -inf"
    assert (out[empty] == 0).all(), "rows without edges: zeros"
    check("out", out, fwd64[0], yard_fwd[0], dtype)
    lse_floor = FLOORS[torch.float32] if dtype != torch.float64 else FLOORS[torch.float64]
    assert rel_error(lse[~empty], fwd64[1][~empty]) <= lse_floor, "lse"
    if return_attention:
        check("alpha", alpha, fwd64[2], yard_fwd[2], dtype)
    else:
        assert alpha.shape == (0,)
    for name, got, want, yard in zip(("dq", "dk", "dv", "d_edge_feat"), (dq, dk, dv, d_ef), grads64, yard_grads):
        if want is None:
            assert got.shape == (0,), name
        else:
            assert got.dtype == dtype, name
            check(name, got, want, yard, dtype)
    return out, dq


def inputs(num_src, num_dst, num_edges, heads, dim, dim_v, dtype, g, edge_feat, empty_dst=5):
    q = rand_feat((num_dst, heads, dim), dtype, "cuda", g)
    k = rand_feat((num_src, heads, dim), dtype, "cuda", g)
    v = rand_feat((num_src, heads, dim_v), dtype, "cuda", g)
    ef = rand_feat((num_edges, heads, dim), dtype, "cuda", g) if edge_feat else None
    src, dst = make_graph(num_src, num_dst, num_edges, g, empty_dst=empty_dst)
    return q, k, v, ef, src, dst


@requires_cuda
@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("edge_feat", [False, True])
@pytest.mark.parametrize("heads", [1, 4])
@pytest.mark.parametrize("dim", [8, 24, 32, 64, 128, 256])
@pytest.mark.parametrize("dtype", FEAT_DTYPES, ids=dtype_id)
def test_matrix(dtype, dim, heads, edge_feat, dropout):
    g = gen(dim * 7 + heads)
    q, k, v, ef, src, dst = inputs(150, 120, 1500, heads, dim, dim, dtype, g, edge_feat)
    full_check(q, k, v, ef, src, dst, p=dropout, seed=98765 + dim, g=g)


@requires_cuda
@pytest.mark.parametrize("dims", [(32, 64), (64, 32), (24, 8), (8, 256), (3, 5)])
@pytest.mark.parametrize("dtype", FEAT_DTYPES, ids=dtype_id)
def test_value_dim_differs(dtype, dims):
    g = gen(sum(dims))
    q, k, v, _, src, dst = inputs(90, 70, 800, 4, dims[0], dims[1], dtype, g, False)
    full_check(q, k, v, None, src, dst, p=0.2, g=g)


@requires_cuda
@pytest.mark.parametrize("dim", [1, 3, 33, 129, 256])
@pytest.mark.parametrize("dtype", FEAT_DTYPES, ids=dtype_id)
def test_single_element_loads(dtype, dim):
    """Odd dims, and rows whose stride breaks 16-byte alignment: the VEC=1 kernels (up to 8 per lane)."""
    g = gen(dim)
    num_src, num_dst, num_edges, heads = 60, 50, 600, 2
    q = rand_feat((num_dst, heads, dim + 1), dtype, "cuda", g)[..., 1:]
    k = rand_feat((num_src, heads, dim + 1), dtype, "cuda", g)[..., :dim]
    v = rand_feat((num_src, heads, dim), dtype, "cuda", g)
    ef = rand_feat((num_edges, heads, dim), dtype, "cuda", g)
    src, dst = make_graph(num_src, num_dst, num_edges, g)
    full_check(q, k, v, ef, src, dst, p=0.1, g=g)


@requires_cuda
@pytest.mark.parametrize("dtype", FEAT_DTYPES, ids=dtype_id)
def test_strided_projection(dtype):
    """q, k, v as strided slices of one fused [N, 3 * H * D] projection viewed as [N, H, D]."""
    g = gen(5)
    nodes, heads, dim = 200, 4, 32
    fused = rand_feat((nodes, 3 * heads * dim), dtype, "cuda", g)
    q, k, v = (fused[:, i * heads * dim:(i + 1) * heads * dim].view(nodes, heads, dim) for i in range(3))
    assert not q.is_contiguous()
    src, dst = make_graph(nodes, nodes, 3000, g)
    out, _ = full_check(q, k, v, None, src, dst, g=g)
    contiguous, _ = run(q.contiguous(), k.contiguous(), v.contiguous(), None, src, dst, 1 / math.sqrt(dim))
    assert torch.equal(out, contiguous[0])


@requires_cuda
@pytest.mark.parametrize("dtype", FEAT_DTYPES, ids=dtype_id)
def test_return_attention_off(dtype):
    g = gen(11)
    q, k, v, ef, src, dst = inputs(80, 60, 700, 4, 32, 32, dtype, g, True)
    full_check(q, k, v, ef, src, dst, p=0.5, g=g, return_attention=False)


@requires_cuda
@pytest.mark.parametrize("p", [0.0, 1.0])
def test_dropout_extremes(p):
    """p = 1 drops everything: out and every gradient but dq's softmax part are zeros."""
    g = gen(12)
    q, k, v, ef, src, dst = inputs(80, 60, 700, 2, 16, 16, torch.float32, g, True)
    full_check(q, k, v, ef, src, dst, p=p, g=g)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=dtype_id)
def test_large_logits(dtype):
    """Logits around +-1e4: the running max keeps exp in range (no inf, no NaN)."""
    g = gen(13)
    q, k, v, _, src, dst = inputs(100, 80, 2000, 2, 32, 32, dtype, g, False)
    q = q * 60
    k = k * 60
    scale = 1 / math.sqrt(32)
    (out, lse, alpha), _ = run(q, k, v, None, src, dst, scale)
    fwd64, _ = reference_grads(q, k, v, None, src, dst, scale, torch.zeros_like(out))
    scores = scale * (q[dst.long()].double() * k[src.long()].double()).sum(-1)
    assert scores.abs().max() > 5e3
    # float32: twice the unfused float32 error; float64: the floor scaled by the scores' size.
    yard = reference(q, k, v, None, src, dst, scale) if dtype == torch.float32 else (None, None, None)
    condition = scores.abs().max().item() if dtype == torch.float64 else 1.0
    check("out", out, fwd64[0], yard[0], dtype, condition)
    check("alpha", alpha, fwd64[2], yard[2], dtype, condition)
    empty = torch.isneginf(fwd64[1])
    assert torch.isfinite(lse[~empty]).all()


@requires_cuda
def test_zero_degree_and_empty_graphs():
    g = gen(14)
    # No edges at all (E = 0), and no nodes at all.
    for num_dst, num_src in ((30, 20), (0, 0)):
        q, k, v, ef, src, dst = inputs(max(num_src, 1), max(num_dst, 1), 0, 3, 16, 16, torch.float32, g, True)
        q, k, v = q[:num_dst], k[:num_src], v[:num_src]
        grad_out = rand_feat((num_dst, 3, 16), torch.float32, "cuda", g)
        (out, lse, alpha), (dq, dk, dv, d_ef) = run(q, k, v, ef, src, dst, 0.25, p=0.3, grad_out=grad_out)
        assert out.shape == (num_dst, 3, 16) and (out == 0).all()
        assert torch.isneginf(lse).all() and alpha.shape == (0, 3)
        assert (dq == 0).all() and (dk == 0).all() and (dv == 0).all() and d_ef.shape == (0, 3, 16)


@requires_cuda
def test_hub():
    """One destination with 1,000,000 incoming edges (walked by one team), plus ordinary nodes."""
    g = gen(15)
    num_src, num_dst, heads, dim = 5000, 300, 1, 32
    q, k, v, _, src, dst = inputs(num_src, num_dst, 1_200_000, heads, dim, dim, torch.float32, g, False)
    dst[:1_000_000] = 7
    full_check(q, k, v, None, src, dst, p=0.1, g=g)


@requires_cuda
@pytest.mark.parametrize("dtype", FEAT_DTYPES, ids=dtype_id)
def test_out_of_range_source(dtype):
    """A source index outside k (grouped as other = -1): NaN for its destination in the forward,
    finite outputs elsewhere, and nothing read out of range (compute-sanitizer runs this)."""
    g = gen(16)
    q, k, v, ef, src, dst = inputs(60, 50, 500, 2, 32, 32, dtype, g, True, empty_dst=0)
    bad_src = src.clone()
    bad_src[3] = 60  # out of range
    bad_dst = dst.clone()
    bad_dst[4] = -1  # out of range: the edge lies past offsets[num_dst]
    groups = (grouping(bad_dst, bad_src, 50, 60), grouping(bad_src, bad_dst, 60, 50))
    grad_out = rand_feat((50, 2, 32), dtype, "cuda", g)
    (out, lse, alpha), (dq, dk, dv, d_ef) = run(q, k, v, ef, bad_src, bad_dst, 0.2, grad_out=grad_out,
                                               groups=groups)
    bad_node = int(dst[3])
    nan_rows = torch.zeros(50, dtype=torch.bool, device="cuda")
    nan_rows[bad_node] = True
    assert torch.isnan(out[bad_node]).all() and torch.isnan(lse[bad_node]).all()
    assert torch.isfinite(out[~nan_rows]).all()
    assert torch.isnan(alpha[4]).all(), "an edge without a destination has no attention"
    assert (d_ef[4] == 0).all() and (d_ef[3] == 0).all()
    for t in (dk, dv):
        assert t.shape[0] == 60
    # Edges of healthy destinations match the reference on the graph without the two bad edges.
    keep = torch.ones(500, dtype=torch.bool, device="cuda")
    keep[3] = keep[4] = False
    touched = nan_rows.clone()
    touched[int(dst[4])] = True
    fwd64, _ = reference_grads(q, k, v, ef[keep], src[keep], dst[keep], 0.2, grad_out)
    assert rel_error(out[~touched], fwd64[0][~touched]) <= 4 * FLOORS[dtype]


@requires_cuda
@pytest.mark.parametrize("dtype", FEAT_DTYPES, ids=dtype_id)
def test_bitwise_repeat(dtype):
    g = gen(17)
    q, k, v, ef, src, dst = inputs(300, 200, 20000, 4, 64, 64, dtype, g, True)
    grad_out = rand_feat((200, 4, 64), dtype, "cuda", g)
    first = run(q, k, v, ef, src, dst, 0.125, p=0.2, seed=5, grad_out=grad_out)
    second = run(q, k, v, ef, src, dst, 0.125, p=0.2, seed=5, grad_out=grad_out)
    for a, b in zip(first[0] + first[1], second[0] + second[1]):
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@requires_cuda
def test_seed_changes_mask():
    g = gen(18)
    q, k, v, _, src, dst = inputs(100, 80, 2000, 2, 32, 32, torch.float32, g, False)
    a, _ = run(q, k, v, None, src, dst, 0.2, p=0.5, seed=1)
    b, _ = run(q, k, v, None, src, dst, 0.2, p=0.5, seed=2)
    assert not torch.equal(a[0], b[0])
    assert torch.equal(a[2], b[2]), "alpha is reported before dropout"


@pytest.mark.parametrize("seed", [0, 12345, 2**40 + 7, -3])
def test_dropout_hash_matches_python(seed):
    """The mask written here (the agreed hash) is the Python side's, when it exists; runs on CPU."""
    attention = pytest.importorskip("edgedot.ops.attention")
    if not hasattr(attention, "dropout_keep"):
        pytest.skip("edgedot.ops.attention.dropout_keep not available")
    for offset in (0, 4, 2**40 + 8):
        mine = keep_mask(seed, 1000, 3, 0.3, offset=offset)
        theirs = attention.dropout_keep((seed, offset), 1000, 3, 0.3)
        assert torch.equal(mine, theirs.cpu())
        assert 0.6 < mine.float().mean().item() < 0.8
