"""edgedot.gat_attention and edgedot.gatv2_attention: forward, backward, dropout, non-finite
scores, dst_ptr and plans, custom ops, torch.compile, errors, and PyG's GATConv / GATv2Conv."""

import math

import pytest
import torch

import edgedot
from edgedot.cpu import attention as cpu_attention
from edgedot.cpu import gat as cpu_gat
from edgedot.ops import attention as attention_ops
from edgedot.ops import gat as gat_ops
from edgedot.ops.attention import dropout_keep, next_dropout_state
from edgedot.runtime import dropout
from utils import (DEVICES, FEAT_DTYPES, INDEX_DTYPES, PATHS_AGREE, assert_accurate, assert_one_chunk_path_kept,
                   assert_records_change_nothing, assert_unchanged, capture_graph, dtype_id, fill_cuda_cache_with_nan,
                   gen, raises_checked, rand_feat, rand_index, records_case_graph, rel_error, requires_cuda,
                   skewed_index, snapshot, walk_in_chunks)

GAT_OP = torch.ops.edgedot.gat_attention.default
GAT_BACKWARD_OP = torch.ops.edgedot.gat_attention_backward.default
GATV2_OP = torch.ops.edgedot.gatv2_attention.default
GATV2_BACKWARD_OP = torch.ops.edgedot.gatv2_attention_backward.default


class Kind:
    """One of the two attentions: its function, reference, ops and the names of its float inputs
    (the first three positional, the last the optional per-edge tensor)."""

    def __init__(self, name, fn, ref, op, backward_op, names, cpu_backward):
        self.name, self.fn, self.ref, self.op, self.backward_op = name, fn, ref, op, backward_op
        self.names, self.cpu_backward = names, cpu_backward

    def __repr__(self):
        return self.name

    def call(self, fn, feats, src, dst, **kwargs):
        """``fn`` (the function or the reference) on ``feats`` = [three tensors, edge tensor or None]."""
        return fn(*feats[:3], src, dst, **{self.names[3]: feats[3]}, **kwargs)

    def make(self, num_src=37, num_dst=29, num_edges=300, heads=3, dim=16, dtype=torch.float32, device="cpu",
             index_dtype=torch.int64, edge=False, seed=0, skewed=True):
        """(feats, src_idx, dst_idx) of a fresh random graph: destinations power-law (a hub) and
        the last destination without edges."""
        g = gen(seed)
        if self is GAT:
            shapes = [(num_src, heads, dim), (num_src, heads), (num_dst, heads), (num_edges, heads)]
        else:
            shapes = [(num_src, heads, dim), (num_dst, heads, dim), (heads, dim), (num_edges, heads, dim)]
        feats = [rand_feat(shape, dtype, device, g) for shape in shapes[:3]]
        feats.append(rand_feat(shapes[3], dtype, device, g) if edge else None)
        src = rand_index(num_src, num_edges, index_dtype, device, g)
        rows = max(num_dst - 1, 1)
        if skewed and num_edges:
            dst = skewed_index(rows, num_edges, index_dtype, device, g)
        else:
            dst = rand_index(rows, num_edges, index_dtype, device, g)
        return feats, src, dst

    def scores64(self, feats, src, dst, negative_slope=0.2):
        """The float64 scores [E, H]."""
        f = [None if t is None else t.detach().double() for t in feats]
        src, dst = src.long(), dst.long()
        if self is GAT:
            z = f[1][src] + f[2][dst] + (0 if f[3] is None else f[3])
            return torch.nn.functional.leaky_relu(z, negative_slope)
        m = f[0][src] + f[1][dst] + (0 if f[3] is None else f[3])
        return (f[2] * torch.nn.functional.leaky_relu(m, negative_slope)).sum(-1)


GAT = Kind("gat", edgedot.gat_attention, edgedot.gat_attention_reference, GAT_OP, GAT_BACKWARD_OP,
           ("x", "a_src", "a_dst", "a_edge"), "gat_backward")
GATV2 = Kind("gatv2", edgedot.gatv2_attention, edgedot.gatv2_attention_reference, GATV2_OP, GATV2_BACKWARD_OP,
             ("x_src", "x_dst", "att", "edge_feat"), "gatv2_backward")
KINDS = [GAT, GATV2]
kinds = pytest.mark.parametrize("kind", KINDS, ids=repr)


@pytest.fixture
def small_chunks(monkeypatch):
    """Makes the CPU path walk a few dozen edges per chunk, so every pass spans many chunks."""
    walk_in_chunks(monkeypatch)


def _leaves(feats, dtype=None, requires_grad=True):
    # detach() keeps the strides (clone() would make a slice contiguous).
    return [None if t is None else t.detach().to(dtype or t.dtype).requires_grad_(requires_grad) for t in feats]


def _present(leaves):
    return [t for t in leaves if t is not None]


def check(kind, feats, src, dst, grad=True, ref_kwargs=None, **kwargs):
    """The function against the float64 reference with the tolerance rule (yardstick: the
    reference in the inputs' dtype): output, alpha and, with ``grad``, every gradient."""
    dtype, ref_kwargs = feats[0].dtype, dict(ref_kwargs or {})
    if "negative_slope" in kwargs:
        ref_kwargs["negative_slope"] = kwargs["negative_slope"]
    leaves = _leaves(feats, requires_grad=grad)
    names = list(kind.names) + ["src_idx", "dst_idx"]
    copies = snapshot(*feats, src, dst)
    out, alpha = kind.call(kind.fn, leaves, src, dst, return_attention=True, **kwargs)
    low_leaves, leaves64 = _leaves(feats, requires_grad=grad), _leaves(feats, torch.float64, grad)
    low_out, low_alpha = kind.call(kind.ref, low_leaves, src, dst, **ref_kwargs)
    out64, alpha64 = kind.call(kind.ref, leaves64, src, dst, **ref_kwargs)
    scores = kind.scores64(feats, src, dst, kwargs.get("negative_slope", 0.2))
    condition = max(1.0, scores.abs().max().item()) if scores.numel() else 1.0
    num_dst = feats[2].shape[0] if kind is GAT else feats[1].shape[0]
    assert out.shape == (num_dst,) + tuple(feats[0].shape[1:]) and out.is_contiguous()
    assert not alpha.requires_grad
    assert_accurate(out, low_out, out64, dtype, "out", condition)
    assert_accurate(alpha, low_alpha, alpha64, dtype, "alpha", condition)
    if not grad:
        return out, alpha, None
    grad_out = rand_feat(out.shape, dtype, out.device, gen(99))
    grad_out_copy = grad_out.clone()
    grads = torch.autograd.grad(out, _present(leaves), grad_out)
    assert_unchanged(leaves + [src, dst, grad_out], copies + [grad_out_copy], names + ["grad_out"])
    if src.numel() == 0:  # the reference does not depend on its inputs at all then
        for g, leaf in zip(grads, _present(leaves)):
            assert torch.equal(g, torch.zeros_like(leaf))
        return out, alpha, grads
    low_grads = torch.autograd.grad(low_out, _present(low_leaves), grad_out, allow_unused=True)
    grads64 = torch.autograd.grad(out64, _present(leaves64), grad_out.double(), allow_unused=True)
    for name, g, low, g64, leaf in zip(kind.names, grads, low_grads, grads64, _present(leaves)):
        low = torch.zeros_like(leaf) if low is None else low
        g64 = torch.zeros_like(leaf, dtype=torch.float64) if g64 is None else g64
        assert_accurate(g, low, g64, dtype, "d" + name, condition)
    return out, alpha, grads


# ------------------------------------------------------------------------------ forward + backward


@pytest.mark.parametrize("edge", [False, True], ids=["noedge", "edge"])
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("dtype", FEAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("device", DEVICES)
@kinds
def test_dtypes(kind, device, dtype, index_dtype, edge, small_chunks):
    check(kind, *kind.make(dtype=dtype, device=device, index_dtype=index_dtype, edge=edge))


@pytest.mark.parametrize("shape", [
    dict(heads=1, dim=1), dict(heads=4, dim=8), dict(heads=2, dim=64),
    dict(num_src=5, num_dst=60, num_edges=150), dict(num_src=200, num_dst=3, num_edges=90),
    dict(num_src=1, num_dst=1, num_edges=7, dim=3), dict(heads=2, dim=5, num_edges=1)],
    ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
@pytest.mark.parametrize("device", DEVICES)
@kinds
def test_shapes(kind, device, shape, small_chunks):
    """Bipartite graphs (Ns != Nd either way), one head, one channel, one edge."""
    check(kind, *kind.make(device=device, edge=True, **shape))


@pytest.mark.cpu_only
@kinds
def test_cpu_large_chunks(kind):
    """Chunks whose sums of rows are sparse products (9000 edges of 2 x 12, the CPU path's default
    chunks): against float64, and the same bits on a second run."""
    feats, src, dst = kind.make(num_src=3000, num_dst=5000, num_edges=9000, heads=2, dim=12, edge=True)
    first, second = check(kind, feats, src, dst), check(kind, feats, src, dst)
    assert torch.equal(first[0], second[0])
    for a, b in zip(first[2], second[2]):
        assert torch.equal(a, b)


@pytest.mark.cpu_only
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("dtype", FEAT_DTYPES, ids=dtype_id)
@kinds
def test_cpu_one_chunk_keeps_rows_and_agrees_with_chunks(kind, dtype, index_dtype, monkeypatch):
    """A problem of one chunk keeps the forward's per-edge tensors for the backward (built once a
    step); the same problem in chunks recomputes them. Both against float64, dropout included,
    each the same bits on a second run, and the two paths within rounding of each other."""
    feats, src, dst = kind.make(dtype=dtype, index_dtype=index_dtype, edge=True)
    edges = getattr(cpu_gat, f"_{kind.name}_edges")
    built = []
    monkeypatch.setattr(cpu_gat, f"_{kind.name}_edges", lambda *a: built.append(1) or edges(*a))

    def run():
        generator = torch.Generator().manual_seed(3)
        keep = dropout_keep(next_dropout_state("cpu", generator), src.shape[0], feats[0].shape[1], 0.3)
        out, alpha, grads = check(kind, feats, src, dst, dropout_p=0.3, generator=generator,
                                  ref_kwargs={"keep": keep, "dropout_p": 0.3})
        return (out, alpha) + grads

    assert_one_chunk_path_kept(run, built, monkeypatch, PATHS_AGREE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=dtype_id)
@kinds
def test_cpu_one_chunk_bound(kind, dtype, monkeypatch):
    """Per-edge tensors of at most ONE_PASS_BYTES in the accumulation dtype take the one-pass
    path; one edge more, the chunks (bounded memory)."""
    monkeypatch.setattr(cpu_attention, "ONE_PASS_BYTES", 300 * 3 * 16 * 4)  # 300 edges of 3 x 16 float32
    edges_at_bound = 300 if dtype == torch.float32 else 150
    edges = getattr(cpu_gat, f"_{kind.name}_edges")
    built = []
    monkeypatch.setattr(cpu_gat, f"_{kind.name}_edges", lambda *a: built.append(1) or edges(*a))
    check(kind, *kind.make(num_edges=edges_at_bound, dtype=dtype, edge=True))
    assert len(built) == 1
    check(kind, *kind.make(num_edges=edges_at_bound + 1, dtype=dtype, edge=True))
    assert len(built) == 1


@pytest.mark.parametrize("negative_slope", [0.0, 0.01, 0.7, -0.3, 2.5])
@pytest.mark.parametrize("device", DEVICES)
@kinds
def test_negative_slope(kind, device, negative_slope):
    check(kind, *kind.make(device=device, dtype=torch.float64, edge=True), negative_slope=negative_slope)


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("device", DEVICES)
@kinds
def test_no_edges(kind, device, index_dtype):
    feats, src, dst = kind.make(num_edges=0, device=device, index_dtype=index_dtype, edge=True)
    out, alpha, grads = check(kind, feats, src, dst)
    assert torch.equal(out, torch.zeros_like(out)) and alpha.shape == (0, feats[0].shape[1])
    assert grads[3].shape == feats[3].shape
    _, lse, _, _ = kind.op(*feats, src, dst, *(None,) * 4, 0.2, 0.0, None, False, True)
    assert (lse == -math.inf).all() and lse.dtype == torch.float32


@pytest.mark.parametrize("device", DEVICES)
@kinds
def test_zero_in_degree_self_loops_duplicates(kind, device):
    """Nodes without incoming edges get exact zeros, lse -inf and zero gradients; self-loops and
    repeated edges count once per copy."""
    src = torch.tensor([0, 1, 1, 1, 2, 3, 3, 5, 5, 0], device=device)
    dst = torch.tensor([0, 1, 1, 2, 2, 3, 0, 5, 0, 0], device=device)  # node 4 receives nothing
    feats, _, _ = kind.make(num_src=6, num_dst=6, num_edges=10, heads=2, dim=8, device=device, seed=1)
    out, alpha, grads = check(kind, feats, src, dst)
    assert torch.equal(out[4], torch.zeros_like(out[4]))
    dst_grad = grads[2] if kind is GAT else grads[1]
    assert torch.equal(dst_grad[4], torch.zeros_like(dst_grad[4]))
    assert torch.equal(grads[0][4], torch.zeros_like(grads[0][4]))  # node 4 sends nothing either
    torch.testing.assert_close(alpha[dst == 3], torch.ones_like(alpha[dst == 3]))
    torch.testing.assert_close(alpha[dst == 1], torch.full_like(alpha[dst == 1], 0.5))
    torch.testing.assert_close(out[1], feats[0][1])
    _, lse, _, _ = kind.op(*feats[:3], None, src, dst, *(None,) * 4, 0.2, 0.0, None, False, True)
    assert (lse[4] == -math.inf).all() and torch.isfinite(lse[:4]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("offset", [1e4, -1e4])
@pytest.mark.parametrize("device", DEVICES)
def test_gat_large_logits(device, offset, dtype):
    """Scores around +-1e4 with O(1) spread: exp() without the running maximum overflows or
    underflows to 0/0."""
    feats, src, dst = GAT.make(device=device, dtype=torch.float64)
    feats[2] = feats[2] + offset
    out, alpha, _ = check(GAT, [t if t is None else t.to(dtype) for t in feats], src, dst)
    sums = torch.zeros(feats[2].shape, dtype=torch.float64, device=device).index_add_(0, dst.long(), alpha.double())
    has_edges = torch.bincount(dst.long(), minlength=feats[2].shape[0]) > 0
    torch.testing.assert_close(sums[has_edges], torch.ones_like(sums[has_edges]), rtol=0, atol=2e-2)


@pytest.mark.parametrize("device", DEVICES)
@kinds
def test_hub(kind, device):
    """One destination with thousands of incoming edges (many CPU chunks), a source hub too, and
    a sparse rest."""
    feats, src, dst = kind.make(num_src=600, num_dst=40, num_edges=8000, heads=2, dim=16, device=device,
                                edge=True, skewed=False)
    src, dst = src.clone(), dst.clone()
    dst[:6000] = 3
    src[6000:7000] = 5
    check(kind, feats, src, dst)


@pytest.mark.parametrize("heads", [3, 5, 12])
@pytest.mark.parametrize("device", DEVICES)
def test_gatv2_att_grad_over_many_units(device, heads):
    """GATv2's att gradient is summed per team of the CUDA dst pass, a team serving one head in all
    its (destination, head) units: more units than teams, head counts that divide no block's team
    count, and a hub split into chunks; against float64, and the same bits on a second run."""
    n = 20_000 if device == "cuda" else 400
    feats, src, dst = GATV2.make(num_src=n, num_dst=n, num_edges=4 * n, heads=heads, dim=8, device=device,
                                 skewed=False)
    dst = dst.clone()
    dst[:n] = 7
    first, second = check(GATV2, feats, src, dst), check(GATV2, feats, src, dst)
    for a, b in zip(first[2], second[2]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@kinds
def test_strided_inputs(kind, device, small_chunks):
    """Every float input a non-contiguous view (slices of a fused projection, transposes): the
    same bits as the contiguous call, and right against the reference."""
    feats, src, dst = kind.make(device=device, edge=True, heads=3, dim=8)
    g = gen(4)

    def strided(t):
        if t.dim() == 3:  # [N, H, C] with unit stride along C: one slice of a wider tensor
            wide = rand_feat((t.shape[0], 2, t.shape[1], t.shape[2]), t.dtype, device, g)
            wide[:, 1] = t
            return wide[:, 1]
        wide = rand_feat((t.shape[1], t.shape[0]), t.dtype, device, g).t()  # [N, H] transposed
        wide.copy_(t)
        return wide

    views = [strided(t) for t in feats]
    assert not any(v.is_contiguous() for v in views)
    out, alpha, grads = check(kind, views, src, dst)
    leaves = _leaves(feats)
    want_out, want_alpha = kind.call(kind.fn, leaves, src, dst, return_attention=True)
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    torch.testing.assert_close(alpha, want_alpha, rtol=0, atol=0)
    grad_out = rand_feat(out.shape, out.dtype, device, gen(99))
    for a, b in zip(grads, torch.autograd.grad(want_out, leaves, grad_out)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@kinds
def test_gradcheck(kind):
    feats, src, dst = kind.make(num_src=7, num_dst=6, num_edges=18, heads=2, dim=2, dtype=torch.float64, edge=True)
    dst = dst.clone()
    dst[:3] = 0  # a duplicate-heavy node, and the last node keeps no edge
    leaves = [t.requires_grad_() for t in feats]
    assert torch.autograd.gradcheck(lambda *f: kind.call(kind.fn, list(f), src, dst, negative_slope=0.3), leaves)
    assert torch.autograd.gradcheck(lambda *f: kind.call(kind.fn, list(f) + [None], src, dst), leaves[:3])

    def dropped(*f):  # one mask for every evaluation: the same generator state each time
        return kind.call(kind.fn, list(f), src, dst, dropout_p=0.4, generator=torch.Generator().manual_seed(11))
    assert torch.autograd.gradcheck(dropped, leaves)


@pytest.mark.parametrize("device", DEVICES)
@kinds
def test_source_side_gradients_skipped(kind, device, monkeypatch):
    """Without a gradient on the source side, the backward asks for none (src_grad False) and
    the other gradients equal the full backward's."""
    feats, src, dst = kind.make(device=device, edge=True)
    seen = []
    real = getattr(cpu_gat, kind.cpu_backward)
    monkeypatch.setattr(cpu_gat, kind.cpu_backward, lambda *a, **kw: seen.append(a[-1]) or real(*a, **kw))
    grad_out = rand_feat((29, 3, 16), torch.float32, device, gen(5))
    dst_side = [1, 2, 3] if kind is GATV2 else [2, 3]
    leaves = _leaves(feats, requires_grad=False)
    for i in dst_side:
        leaves[i].requires_grad_()
    out = kind.call(kind.fn, leaves, src, dst)
    partial = torch.autograd.grad(out, [leaves[i] for i in dst_side], grad_out)
    full_leaves = _leaves(feats)
    out = kind.call(kind.fn, full_leaves, src, dst)
    full = torch.autograd.grad(out, full_leaves, grad_out)
    if device == "cpu":
        assert seen == [False, True]
    for i, g in zip(dst_side, partial):
        assert torch.equal(g, full[i]), kind.names[i]


# ------------------------------------------------------------------------------ non-finite scores


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("device", DEVICES)
@kinds
def test_non_finite_scores(kind, device, dtype):
    """The rule of graph_attention: a destination whose every score is -inf (node 0) or NaN
    (node 2) gets NaN output and lse; a -inf edge into a node with finite scores (edge 4 into
    node 1) has alpha 0 and adds nothing to any gradient; a node without edges (3) gets zeros and
    lse -inf. Gradients are finite wherever the output is."""
    heads, dim = 2, 4
    src = torch.tensor([0, 1, 2, 3, 4, 5, 6, 2], device=device)
    dst = torch.tensor([0, 0, 1, 1, 1, 2, 2, 1], device=device)
    feats, _, _ = kind.make(num_src=7, num_dst=4, num_edges=8, heads=heads, dim=dim, dtype=torch.float64,
                            device=device, edge=True, seed=17)
    if kind is GAT:
        feats[2][0] = -math.inf
        feats[2][2] = math.nan
        feats[3][4] = -math.inf
    else:
        feats[2] = feats[2].abs()  # att > 0: a -inf channel makes a -inf score
        feats[1][0, :, 1] = -math.inf
        feats[1][2, :, 0] = math.nan
        feats[3][4, :, 2] = -math.inf
    feats = [t.to(dtype) for t in feats]
    out, lse, alpha, _ = kind.op(*feats, src, dst, *(None,) * 4, 0.2, 0.0, None, True, True)
    assert torch.isnan(out[[0, 2]]).all() and torch.isnan(lse[[0, 2]]).all()
    assert torch.isfinite(out[1]).all() and torch.isfinite(lse[1]).all()
    assert torch.equal(out[3], torch.zeros_like(out[3])) and (lse[3] == -math.inf).all()
    assert (alpha[4] == 0).all() and torch.isfinite(alpha[[2, 3, 7]]).all()

    leaves = _leaves(feats)
    finite_rows = torch.tensor([1, 3], device=device)
    grad_out = rand_feat((2, heads, dim), dtype, device, gen(3))
    got = kind.call(kind.fn, leaves, src, dst)
    assert torch.equal(torch.isnan(got), torch.isnan(out))
    grads = torch.autograd.grad(got[finite_rows], leaves, grad_out)
    leaves64 = _leaves(feats, torch.float64)
    out64, alpha64 = kind.call(kind.ref, leaves64, src, dst)
    assert torch.equal(torch.isnan(out64), torch.isnan(out)) and (alpha64[4] == 0).all()
    want = torch.autograd.grad(out64[finite_rows], leaves64, grad_out.double())
    live_src, live_edges = torch.tensor([2, 3, 4], device=device), torch.tensor([2, 3, 4, 7], device=device)
    rows = {"x": live_src, "a_src": live_src, "a_dst": finite_rows, "a_edge": live_edges,
            "x_src": live_src, "x_dst": finite_rows, "edge_feat": live_edges}
    tol = {torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, 2e-2)
    for name, got_grad, want_grad in zip(kind.names, grads, want):
        if name == "att":
            continue  # a sum over every edge, those into NaN destinations included
        r = rows[name]
        assert torch.isfinite(got_grad[r]).all() and torch.isfinite(want_grad[r]).all(), name
        # Relative to max(1, the gradient's size): a_dst's sums over a node's edges nearly cancel.
        error = torch.linalg.vector_norm((got_grad[r] - want_grad[r]).double()).item()
        assert error < tol * max(1.0, torch.linalg.vector_norm(want_grad[r]).item()), name
    # The dead edge's source (4 sends only edge 4) and the dead edge get exactly nothing.
    assert torch.equal(grads[0][4], torch.zeros_like(grads[0][4]))
    assert torch.equal(grads[3][4], torch.zeros_like(grads[3][4]))
    if kind is GAT:
        assert torch.equal(grads[1][4], torch.zeros_like(grads[1][4]))


# ------------------------------------------------------------------------------ dropout


@pytest.mark.parametrize("p", [0.3, 1.0])
@pytest.mark.parametrize("device", DEVICES)
@kinds
def test_dropout_matches_reference_with_mask(kind, device, p, small_chunks):
    """The output and every gradient equal the reference's under the mask dropout_keep gives for
    the state next_dropout_state tells (graph_attention's mask): the backward regenerates it."""
    feats, src, dst = kind.make(device=device, edge=True)
    generator = torch.Generator(device).manual_seed(21)
    state = next_dropout_state(device, generator)
    keep = dropout_keep(state, src.shape[0], feats[0].shape[1], p, device)
    out, _, _ = check(kind, feats, src, dst, dropout_p=p, generator=generator,
                      ref_kwargs={"keep": keep, "dropout_p": p})
    if p == 1.0:
        assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("device", DEVICES)
@kinds
def test_dropout_reproducible_from_generator(kind, device):
    feats, src, dst = kind.make(device=device)
    runs = [kind.call(kind.fn, feats, src, dst, dropout_p=0.5, generator=torch.Generator(device).manual_seed(s))
            for s in (5, 5, 6)]
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    torch.manual_seed(8)
    a = kind.call(kind.fn, feats, src, dst, dropout_p=0.5)
    torch.manual_seed(8)
    b = kind.call(kind.fn, feats, src, dst, dropout_p=0.5)
    c = kind.call(kind.fn, feats, src, dst, dropout_p=0.5)  # the default generator moved on
    assert torch.equal(a, b) and not torch.equal(a, c)
    state = next_dropout_state(device)  # dropout_p=0 draws nothing and equals the plain call
    assert torch.equal(kind.call(kind.fn, feats, src, dst, dropout_p=0.0), kind.call(kind.fn, feats, src, dst))
    assert torch.equal(state, next_dropout_state(device))


def _dropout_reference(kind, feats, src, dst, keep, p, grad_out):
    """float64 reference output and gradients of the present float inputs under mask ``keep``."""
    leaves = _leaves(feats, torch.float64)
    out, _ = kind.call(kind.ref, leaves, src, dst, keep=keep, dropout_p=p)
    return out, torch.autograd.grad(out, _present(leaves), grad_out.double())


def _op_backward(kind, feats, src, dst, out, lse, p, rng_state, grad_out):
    grads = kind.backward_op(grad_out, *feats, out, lse, src, dst, *(None,) * 4, 0.2, p, rng_state, True, True)
    return [g for g, t in zip(grads, feats) if t is not None]


@pytest.mark.parametrize("device", DEVICES)
@kinds
def test_op_state_drawn_and_read_back(kind, device):
    """The forward op returns the rng_state it drew (what next_dropout_state said, on the inputs'
    device); the backward takes its mask from that state, not from the generator, which has moved
    on; another state gives other gradients; without dropout the state is empty."""
    feats, src, dst = kind.make(device=device, edge=True, dtype=torch.float64)
    p = 0.4
    generator = torch.Generator(device).manual_seed(31)
    state = next_dropout_state(device, generator)
    out, lse, _, rng_state = kind.op(*feats, src, dst, *(None,) * 4, 0.2, p, generator, False, True)
    assert rng_state.dtype == torch.int64 and rng_state.shape == (2,) and rng_state.device == out.device
    assert torch.equal(rng_state.cpu(), state)
    kind.op(*feats, src, dst, *(None,) * 4, 0.2, p, generator, False, True)  # the generator moves on
    assert not torch.equal(next_dropout_state(device, generator), state)
    keep = dropout_keep(rng_state, src.shape[0], feats[0].shape[1], p)
    assert keep.device == out.device and 0 < keep.float().mean().item() < 1
    grad_out = rand_feat(out.shape, torch.float64, device, gen(4))
    out64, grads64 = _dropout_reference(kind, feats, src, dst, keep, p, grad_out)
    assert rel_error(out, out64) <= 1e-12
    for g, g64 in zip(_op_backward(kind, feats, src, dst, out, lse, p, rng_state, grad_out), grads64):
        assert rel_error(g, g64) <= 1e-12
    other = rng_state + torch.tensor([0, 4], device=rng_state.device)
    same = _op_backward(kind, feats, src, dst, out, lse, p, rng_state, grad_out)[0]
    assert not torch.equal(_op_backward(kind, feats, src, dst, out, lse, p, other, grad_out)[0], same)
    *_, no_state = kind.op(*feats, src, dst, *(None,) * 4, 0.2, 0.0, None, False, True)
    assert no_state.dtype == torch.int64 and no_state.shape == (0,)


@kinds
def test_op_dropout_state_errors(kind):
    """The ops are tagged random; the backward with dropout needs the forward's state."""
    assert torch.Tag.nondeterministic_seeded in kind.op.tags
    feats, src, dst = kind.make(edge=True)
    out, lse, _, _ = kind.op(*feats, src, dst, *(None,) * 4, 0.2, 0.5, None, False, True)
    with raises_checked(ValueError, match="rng_state"):
        _op_backward(kind, feats, src, dst, out, lse, 0.5, None, torch.ones_like(out))


# ------------------------------------------------------------------------------ dst_ptr and plans


def _sorted_graph(kind, device, index_dtype=torch.int64, num_edges=500, seed=1):
    feats, src, dst = kind.make(num_src=40, num_dst=30, num_edges=num_edges, heads=2, dim=8, device=device,
                                index_dtype=index_dtype, edge=True, seed=seed)
    dst, order = torch.sort(dst, stable=True)
    return [feats[0], feats[1], feats[2], feats[3][order]], src[order], dst


@pytest.mark.parametrize("ptr_dtype", INDEX_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("device", DEVICES)
@kinds
def test_dst_ptr_and_plan_match_plain_call(kind, device, index_dtype, ptr_dtype):
    """Edges given sorted with their pointer, or a plan: the outputs and gradients of the plain
    call (bitwise), dropout included."""
    feats, src, dst = _sorted_graph(kind, device, index_dtype)
    ptr = edgedot.index_to_ptr(dst, 30).to(ptr_dtype)
    plan = edgedot.EdgePlan(src, dst, 40, 30)
    grad_out = rand_feat((30, 2, 8), torch.float32, device, gen(2))
    results = []
    for kwargs in ({}, {"dst_ptr": ptr}, {"plan": plan}):
        leaves = _leaves(feats)
        out, alpha = kind.call(kind.fn, leaves, src, dst, dropout_p=0.2, return_attention=True,
                               generator=torch.Generator(device).manual_seed(3), **kwargs)
        results.append((out, alpha) + torch.autograd.grad(out, leaves, grad_out))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)
    assert (results[0][0][-1] == 0).all(), "the last node has no edges"
    empty = src[:0]
    no_edges = [feats[0], feats[1], feats[2], feats[3][:0]]
    out = kind.call(kind.fn, no_edges, empty, empty, dst_ptr=torch.zeros(31, dtype=torch.int64, device=device))
    assert (out == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@kinds
def test_dst_ptr_errors(kind, device):
    feats, src, dst = _sorted_graph(kind, device, num_edges=60, seed=5)
    ptr = edgedot.index_to_ptr(dst, 30)

    def call(p, d=dst, **kwargs):
        return kind.call(kind.fn, feats, src, d, dst_ptr=p, **kwargs)

    with raises_checked(TypeError, match="dst_ptr"):
        call(ptr.float())
    with raises_checked(TypeError, match="dst_ptr"):
        call([0] * 31)
    with raises_checked(ValueError, match="dst_ptr"):
        call(ptr[:-1])
    bad = ptr.clone()
    bad[-1] -= 1
    with raises_checked(ValueError, match="dst_ptr must rise from 0"):
        call(bad)
    shuffled = dst[torch.randperm(60, generator=gen(6)).to(device)]
    with raises_checked(ValueError, match="dst_ptr disagrees with dst_idx"):
        call(ptr, shuffled)
    with raises_checked(ValueError, match="plan or dst_ptr"):
        call(ptr, plan=edgedot.EdgePlan(src, dst, 40, 30))
    if device == "cpu":  # the CPU checks whatever check_indices says
        with raises_checked(ValueError, match="dst_ptr disagrees"):
            call(ptr, shuffled, check_indices=False)


# ------------------------------------------------------------------------------ custom ops


def _op_args(kind, device, dtype=torch.float32, edge=False, dropout_p=0.0, return_attention=False, plan=False):
    feats, src, dst = kind.make(num_edges=120, heads=2, dim=6, dtype=dtype, device=device, edge=edge,
                                index_dtype=torch.int32)
    feats = [t if t is None else t.requires_grad_() for t in feats]
    groups = (None,) * 4
    if plan:
        num_src, num_dst = feats[0].shape[0], (feats[2] if kind is GAT else feats[1]).shape[0]
        p = edgedot.EdgePlan(src, dst, num_src, num_dst)
        groups = (p.dst, p.offsets("dst"), p.src, p.offsets("src"))
    generator = torch.Generator(device).manual_seed(1234) if dropout_p else None
    return (*feats, src, dst, *groups, 0.2, dropout_p, generator, return_attention, True)


OP_CASES = [dict(), dict(edge=True, dropout_p=0.25, return_attention=True),
            dict(dtype=torch.float64, edge=True, plan=True, dropout_p=0.5), dict(dtype=torch.bfloat16, plan=True)]


@pytest.mark.parametrize("case", OP_CASES, ids=lambda c: "-".join(
    f"{k}={dtype_id(v) if isinstance(v, torch.dtype) else v}" for k, v in c.items()) or "plain")
@pytest.mark.parametrize("device", DEVICES)
@kinds
def test_opcheck(kind, device, case):
    # With dropout every run draws a new state, so eager and traced runs differ: test_compile_fullgraph
    # compares them from one seed of the default generator instead.
    utils = ("test_schema", "test_autograd_registration", "test_faketensor") + \
        (() if case.get("dropout_p") else ("test_aot_dispatch_dynamic",))
    torch.library.opcheck(kind.op, _op_args(kind, device, **case), test_utils=utils)


@pytest.mark.parametrize("device", DEVICES)
@kinds
def test_opcheck_backward(kind, device):
    args = _op_args(kind, device, edge=True, dropout_p=0.3)
    feats = [t.detach() for t in args[:4]]
    out, lse, _, rng_state = (t.detach() for t in kind.op(*args))
    grad_out = torch.randn_like(out)
    for edge_grad, src_grad in ((True, True), (True, False), (False, False)):
        torch.library.opcheck(kind.backward_op, (grad_out, *feats, out, lse, *args[4:10], 0.2, 0.3, rng_state,
                                                 edge_grad, src_grad))
        grads = kind.backward_op(grad_out, *feats, out, lse, *args[4:10], 0.2, 0.3, rng_state, edge_grad, src_grad)
        assert (grads[3].shape == feats[3].shape) == edge_grad
        assert (grads[0].shape == feats[0].shape) == src_grad


def _loss(kind, feats, src, dst, plan, dropout_p):
    out = kind.call(kind.fn, feats, src, dst, plan=plan, dropout_p=dropout_p)
    return (out.float().sin() * out.float()).sum(), out


@pytest.mark.parametrize("device", DEVICES)
@kinds
def test_compile_fullgraph(kind, device):
    """torch.compile(fullgraph=True) of forward + backward matches eager, with a plan, and with
    dropout drawing from the default generator."""
    torch._dynamo.reset()
    feats, src, dst = kind.make(device=device, edge=True, dim=8)
    leaves = [t.requires_grad_() for t in feats]
    num_dst = (feats[2] if kind is GAT else feats[1]).shape[0]
    plan = edgedot.EdgePlan(src, dst, feats[0].shape[0], num_dst)
    compiled = torch.compile(lambda *a: _loss(kind, *a), fullgraph=True, backend="aot_eager")
    for use_plan, p in ((None, 0.0), (plan, 0.0), (None, 0.5)):
        torch.manual_seed(3)
        loss_c, out_c = compiled(leaves, src, dst, use_plan, p)
        torch.manual_seed(3)
        loss_e, out_e = _loss(kind, leaves, src, dst, use_plan, p)
        torch.testing.assert_close(out_c, out_e)
        for gc, ge in zip(torch.autograd.grad(loss_c, leaves), torch.autograd.grad(loss_e, leaves)):
            torch.testing.assert_close(gc, ge)


class _ExtensionOnCPU:
    """Stands in for the CUDA extension's GAT functions: checks the groupings it is handed
    against their definition, then computes with the CPU implementation, drawing the dropout
    state from the generator (forward) and reading it from rng_state (backward) as the CPU op
    does."""

    def __init__(self, src, dst, num_src, num_dst):
        self.want = {"dst": edgedot.runtime.plan.build_side(dst, src, num_dst, num_src),
                     "src": edgedot.runtime.plan.build_side(src, dst, num_src, num_dst)}
        self.rows = {"dst": num_dst, "src": num_src}
        self.src, self.dst = src, dst
        self.calls = []

    def _check(self, side, group, offsets):
        assert torch.equal(group, self.want[side]), side
        rows = group[group.shape[0] // 2:] >> 32
        want = torch.tensor([int((rows < r).sum()) for r in range(self.rows[side] + 1)])
        assert offsets.dtype == torch.int64 and torch.equal(offsets, want), side

    def _forward(self, impl, a, b, c, edge, src, dst, dst_group, dst_offsets, slope, p, generator,
                 return_attention):
        assert torch.equal(src, self.src) and torch.equal(dst, self.dst) and src.is_contiguous()
        self._check("dst", dst_group, dst_offsets)
        assert isinstance(generator, torch.Generator) and isinstance(slope, float) and isinstance(p, float)
        self.calls.append(impl.__name__)
        rng_state = dropout.draw_cpu(generator)
        out = impl(a, b, c, edge, self.src, self.dst, slope, p, dropout.recorded_key(rng_state, p), return_attention)
        return (*out[:3], rng_state)

    def _backward(self, impl, grad_out, a, b, c, edge, out, lse, src, dst, dst_group, dst_offsets, src_group,
                  src_offsets, slope, p, rng_state, edge_grad, src_grad):
        assert torch.equal(src, self.src) and torch.equal(dst, self.dst)
        self._check("dst", dst_group, dst_offsets)
        if src_grad:
            self._check("src", src_group, src_offsets)
        self.calls.append((impl.__name__, src_grad))
        return impl(grad_out, a, b, c, edge, out, lse, self.src, self.dst, slope, p,
                    dropout.recorded_key(rng_state, p), edge_grad, src_grad)

    def gat_forward(self, *args):
        return self._forward(cpu_gat.gat_forward, *args)

    def gatv2_forward(self, *args):
        return self._forward(cpu_gat.gatv2_forward, *args)

    def gat_backward(self, *args):
        assert args[-1] is True  # the records, where they fit
        return self._backward(cpu_gat.gat_backward, *args[:-1])

    def gatv2_backward(self, *args):
        assert args[-1] is True  # the records, where they fit
        return self._backward(cpu_gat.gatv2_backward, *args[:-1])


@pytest.mark.parametrize("use_plan", [False, True], ids=["noplan", "plan"])
@kinds
def test_cuda_implementation_wiring(kind, monkeypatch, use_plan):
    """The CUDA implementations hand the extension the arguments of the interface (groupings
    built, or the plan's; the generator; the forward's rng_state to the backward; contiguous
    indices) and its results through unchanged: run on CPU tensors with the extension replaced by
    the CPU implementation."""
    feats, src, dst = kind.make(edge=True, dim=8, index_dtype=torch.int32)
    num_src, num_dst = feats[0].shape[0], (feats[2] if kind is GAT else feats[1]).shape[0]
    ext = _ExtensionOnCPU(src, dst, num_src, num_dst)
    monkeypatch.setattr(gat_ops, "cuda_module", lambda: ext)
    monkeypatch.setattr(attention_ops, "cuda_module", lambda: pytest.fail("CPU tensors never build on CUDA"))
    groups = (None,) * 4
    if use_plan:
        plan = edgedot.EdgePlan(src, dst, num_src, num_dst)
        groups = (plan.dst, plan.offsets("dst"), plan.src, plan.offsets("src"))
    forward = gat_ops._gat_forward_cuda if kind is GAT else gat_ops._gatv2_forward_cuda
    backward = gat_ops._gat_backward_cuda if kind is GAT else gat_ops._gatv2_backward_cuda
    got = forward(*feats, src, dst, *groups, 0.3, 0.2, torch.Generator().manual_seed(5), True, True)
    want = kind.op(*feats, src, dst, *(None,) * 4, 0.3, 0.2, torch.Generator().manual_seed(5), True, True)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    out, lse, _, rng_state = got
    grad_out = torch.randn_like(out)
    for src_grad in (True, False):
        got = backward(grad_out, *feats, out, lse, src, dst, *groups, 0.3, 0.2, rng_state, True, src_grad)
        want = kind.backward_op(grad_out, *feats, out, lse, src, dst, *(None,) * 4, 0.3, 0.2, rng_state, True,
                                src_grad)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    assert [c if isinstance(c, str) else c[1] for c in ext.calls] == [f"{kind.name}_forward", True, False]


# ------------------------------------------------------------------------------ errors


def _bad_cases(kind):
    """name -> (change to the keyword arguments, exception, message pattern)."""
    f = kind.names
    cases = {
        "first_list": (lambda a: a.update({f[0]: [1.0]}), TypeError, f"{f[0]} must be a tensor"),
        "first_2d": (lambda a: a.update({f[0]: a[f[0]][:, 0]}), ValueError, f"{f[0]} must be 3-D"),
        "first_int": (lambda a: a.update({f[0]: a[f[0]].int()}), TypeError, f"{f[0]} must be float"),
        "zero_heads": (lambda a: a.update({f[0]: a[f[0]][:, :0]}), ValueError, "at least one head"),
        "second_dtype": (lambda a: a.update({f[1]: a[f[1]].double()}), TypeError, f"{f[1]} is torch.float64"),
        "third_dtype": (lambda a: a.update({f[2]: a[f[2]].half()}), TypeError, f"{f[2]} is torch.float16"),
        "third_list": (lambda a: a.update({f[2]: 0.5}), TypeError, f"{f[2]} must be a tensor"),
        "edge_shape": (lambda a: a.update({f[3]: a[f[3]][1:]}), ValueError, f"{f[3]} must be"),
        "edge_dtype": (lambda a: a.update({f[3]: a[f[3]].double()}), TypeError, f"{f[3]} is"),
        "edge_list": (lambda a: a.update({f[3]: [0]}), TypeError, f"{f[3]} must be a tensor"),
        "src_float": (lambda a: a.update(src_idx=a["src_idx"].float()), TypeError, "src_idx must be int32"),
        "dst_2d": (lambda a: a.update(dst_idx=a["dst_idx"][None]), ValueError, "dst_idx must be 1-D"),
        "lengths": (lambda a: a.update(dst_idx=a["dst_idx"][1:]), ValueError, "same length"),
        "slope_str": (lambda a: a.update(negative_slope="0.2"), TypeError, "negative_slope"),
        "slope_inf": (lambda a: a.update(negative_slope=math.inf), ValueError, "negative_slope"),
        "slope_bool": (lambda a: a.update(negative_slope=True), TypeError, "negative_slope"),
        "dropout_high": (lambda a: a.update(dropout_p=1.5), ValueError, "dropout_p"),
        "dropout_type": (lambda a: a.update(dropout_p=None), TypeError, "dropout_p"),
        "generator": (lambda a: a.update(dropout_p=0.1, generator=3), TypeError, "generator"),
        "plan_type": (lambda a: a.update(plan="plan"), TypeError, "plan"),
        "plan_graph": (lambda a: a.update(plan=edgedot.EdgePlan(a["src_idx"][:10], a["dst_idx"][:10], 37, 29)),
                       ValueError, "plan was built"),
        "check_indices": (lambda a: a.update(check_indices=None), TypeError, "check_indices"),
        "return_attention": (lambda a: a.update(return_attention=1), TypeError, "return_attention"),
        "device": (lambda a: a.update({f[1]: a[f[1]].to("meta")}), ValueError, f"{f[1]} is on meta"),
    }
    if kind is GAT:
        cases.update({
            "a_src_rows": (lambda a: a.update(a_src=a["a_src"][1:]), ValueError, "a_src must be"),
            "a_src_3d": (lambda a: a.update(a_src=a["a_src"][..., None]), ValueError, "a_src must be"),
            "a_dst_heads": (lambda a: a.update(a_dst=a["a_dst"][:, :1]), ValueError, "a_dst must be"),
        })
    else:
        cases.update({
            "x_dst_channels": (lambda a: a.update(x_dst=a["x_dst"][..., :3]), ValueError, "x_dst must be"),
            "x_dst_2d": (lambda a: a.update(x_dst=a["x_dst"][:, 0]), ValueError, "x_dst must be 3-D"),
            "att_shape": (lambda a: a.update(att=a["att"][None]), ValueError, "att must be"),
            "edge_feat_2d": (lambda a: a.update(edge_feat=a["edge_feat"][:, 0]), ValueError, "edge_feat must be"),
        })
    return cases


@pytest.mark.parametrize("case", sorted(_bad_cases(GAT)))
@pytest.mark.parametrize("device", DEVICES)
def test_gat_bad_inputs(device, case):
    _check_bad(GAT, device, case)


@pytest.mark.parametrize("case", sorted(_bad_cases(GATV2)))
@pytest.mark.parametrize("device", DEVICES)
def test_gatv2_bad_inputs(device, case):
    _check_bad(GATV2, device, case)


def _check_bad(kind, device, case):
    change, error, pattern = _bad_cases(kind)[case]
    feats, src, dst = kind.make(num_edges=20, heads=2, dim=4, device=device, edge=True)
    args = dict(zip(kind.names, feats), src_idx=src, dst_idx=dst)
    change(args)
    names = kind.names
    with raises_checked(error, match=pattern):
        kind.fn(args.pop(names[0]), args.pop(names[1]), args.pop(names[2]), **args)


@pytest.mark.parametrize("name, value", [("src_idx", 37), ("src_idx", -1), ("dst_idx", 29), ("dst_idx", -5)])
@pytest.mark.parametrize("device", DEVICES)
@kinds
def test_out_of_range_index(kind, device, name, value):
    feats, src, dst = kind.make(device=device)
    leaves = _leaves(feats)
    bad = {"src_idx": src.clone(), "dst_idx": dst.clone()}
    bad[name][7] = value
    with raises_checked(IndexError, match=name):
        kind.call(kind.fn, leaves, bad["src_idx"], bad["dst_idx"])
    assert leaves[0].grad is None
    bad[name][7] = 0  # still usable, and the same tensor fixed in place is checked again
    check(kind, feats, bad["src_idx"], bad["dst_idx"], grad=False)
    bad[name][7] = value
    with raises_checked(IndexError, match=name):
        kind.call(kind.fn, leaves, bad["src_idx"], bad["dst_idx"])
    if device == "cpu":  # the CPU always checks
        with raises_checked(IndexError, match=name):
            kind.call(kind.fn, leaves, bad["src_idx"], bad["dst_idx"], check_indices=False)


# ------------------------------------------------------------------------------ PyG's layers


def _pyg_graph(num_src, num_dst, num_edges, device, g):
    return torch.stack([rand_index(num_src, num_edges, device=device, g=g),
                        rand_index(num_dst - 1, num_edges, device=device, g=g)])


@pytest.mark.parametrize("bipartite", [False, True], ids=["homogeneous", "bipartite"])
@pytest.mark.parametrize("edge_dim", [None, 3])
@pytest.mark.parametrize("device", DEVICES)
def test_matches_pyg_gatconv(device, edge_dim, bipartite):
    """PyG's GATConv (float64, no self-loops, no bias) from our attention on its projections:
    output and every parameter gradient."""
    pyg_conv = pytest.importorskip("torch_geometric.nn.conv")
    g = gen(30)
    heads, channels, num_src, num_dst = 3, 5, 23, 17 if bipartite else 23
    torch.manual_seed(0)
    in_channels = (6, 4) if bipartite else 6
    conv = pyg_conv.GATConv(in_channels, channels, heads=heads, add_self_loops=False, bias=False,
                           edge_dim=edge_dim).to(device, torch.float64)
    x_src = rand_feat((num_src, 6), torch.float64, device, g)
    x_dst = rand_feat((num_dst, 4), torch.float64, device, g) if bipartite else x_src
    edge_index = _pyg_graph(num_src, num_dst, 120, device, g)
    edge_attr = rand_feat((120, edge_dim), torch.float64, device, g) if edge_dim else None
    grad_out = rand_feat((num_dst, heads * channels), torch.float64, device, g)
    want = conv((x_src, x_dst) if bipartite else x_src, edge_index, edge_attr)
    want_grads = torch.autograd.grad(want, list(conv.parameters()), grad_out)

    lin_src, lin_dst = (conv.lin_src, conv.lin_dst) if bipartite else (conv.lin, conv.lin)
    x = lin_src(x_src).view(-1, heads, channels)
    a_src = (x * conv.att_src).sum(-1)
    a_dst = (lin_dst(x_dst).view(-1, heads, channels) * conv.att_dst).sum(-1)
    a_edge = None
    if edge_dim:
        a_edge = (conv.lin_edge(edge_attr).view(-1, heads, channels) * conv.att_edge).sum(-1)
    got = edgedot.gat_attention(x, a_src, a_dst, edge_index[0], edge_index[1], a_edge=a_edge,
                                negative_slope=conv.negative_slope).reshape(num_dst, heads * channels)
    got_grads = torch.autograd.grad(got, list(conv.parameters()), grad_out)
    assert rel_error(got, want) < 1e-10
    for (name, _), a, b in zip(conv.named_parameters(), got_grads, want_grads):
        assert rel_error(a, b) < 1e-10, name


@pytest.mark.parametrize("edge_dim", [None, 3])
@pytest.mark.parametrize("device", DEVICES)
def test_matches_pyg_gatv2conv(device, edge_dim):
    """PyG's GATv2Conv (float64, separate source and target weights, no self-loops, no bias)
    from our attention on its projections: output and every parameter gradient."""
    pyg_conv = pytest.importorskip("torch_geometric.nn.conv")
    g = gen(31)
    heads, channels, num_nodes = 2, 6, 25
    torch.manual_seed(0)
    conv = pyg_conv.GATv2Conv(5, channels, heads=heads, add_self_loops=False, bias=False, edge_dim=edge_dim,
                             negative_slope=0.15).to(device, torch.float64)
    x = rand_feat((num_nodes, 5), torch.float64, device, g)
    edge_index = _pyg_graph(num_nodes, num_nodes, 140, device, g)
    edge_attr = rand_feat((140, edge_dim), torch.float64, device, g) if edge_dim else None
    grad_out = rand_feat((num_nodes, heads * channels), torch.float64, device, g)
    want = conv(x, edge_index, edge_attr)
    want_grads = torch.autograd.grad(want, list(conv.parameters()), grad_out)

    x_src = conv.lin_l(x).view(-1, heads, channels)
    x_dst = conv.lin_r(x).view(-1, heads, channels)
    edge_feat = conv.lin_edge(edge_attr).view(-1, heads, channels) if edge_dim else None
    got = edgedot.gatv2_attention(x_src, x_dst, conv.att.view(heads, channels), edge_index[0], edge_index[1],
                                  edge_feat=edge_feat, negative_slope=0.15).reshape(num_nodes, heads * channels)
    got_grads = torch.autograd.grad(got, list(conv.parameters()), grad_out)
    assert rel_error(got, want) < 1e-10
    for (name, _), a, b in zip(conv.named_parameters(), got_grads, want_grads):
        assert rel_error(a, b) < 1e-10, name


# ------------------------------------------------------------------------------ CUDA only


@requires_cuda
@pytest.mark.parametrize("edge", [False, True], ids=["noedge", "edge"])
@pytest.mark.parametrize("dtype", FEAT_DTYPES, ids=dtype_id)
@kinds
def test_cuda_matches_cpu(kind, dtype, edge, monkeypatch):
    """The CUDA kernels and the CPU path agree (to the accumulation's rounding), dropout mask
    included (the CPU made to draw the CUDA generator's state), and repeated CUDA calls are
    bitwise identical (poisoned memory in between)."""
    feats, src, dst = kind.make(num_src=900, num_dst=700, num_edges=6000, heads=4, dim=32, dtype=dtype, edge=edge,
                                index_dtype=torch.int32)
    dst = dst.clone()
    dst[:2500] = 11  # a hub split into chunks on CUDA
    grad_out = rand_feat((700, 4, 32), dtype, "cpu", gen(7))
    state = next_dropout_state("cuda", torch.Generator("cuda").manual_seed(9))
    monkeypatch.setattr(dropout, "draw_cpu", lambda generator=None: state.clone())

    def run(device):
        leaves = [t if t is None else t.to(device).requires_grad_() for t in feats]
        out, alpha = kind.call(kind.fn, leaves, src.to(device), dst.to(device), dropout_p=0.25,
                               generator=torch.Generator(device).manual_seed(9), return_attention=True)
        grads = torch.autograd.grad(out, _present(leaves), grad_out.to(device))
        return [t.cpu() for t in (out, alpha) + grads]

    cpu = run("cpu")
    fill_cuda_cache_with_nan()
    first = run("cuda")
    fill_cuda_cache_with_nan()
    second = run("cuda")
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    for name, c, a, b in zip(("out", "alpha") + kind.names, cpu, first, second):
        assert torch.equal(a, b), f"{name}: CUDA calls differ"
        assert torch.isfinite(a).all(), name
        assert rel_error(a, c) <= tol, f"{name}: CUDA vs CPU {rel_error(a, c):.3e}"


@requires_cuda
@kinds
def test_cuda_dropout_state_and_mask(kind):
    """The CUDA forward draws the generator's (seed, offset), moves it on by OFFSET_STEP and
    returns it; output and gradients follow the public reproduction of its mask."""
    feats, src, dst = kind.make(num_src=300, num_dst=200, num_edges=6000, heads=4, dim=32, device="cuda",
                                edge=True)
    p = 0.3
    generator = torch.Generator("cuda").manual_seed(77)
    state = next_dropout_state("cuda", generator)
    assert torch.equal(state, torch.tensor([77, 0]))
    out, lse, _, rng_state = kind.op(*feats, src, dst, *(None,) * 4, 0.2, p, generator, False, True)
    assert generator.get_offset() == dropout.OFFSET_STEP
    assert torch.equal(rng_state.cpu(), state)
    keep = dropout_keep(state, src.shape[0], 4, p, "cuda")
    grad_out = rand_feat(out.shape, torch.float32, "cuda", gen(9))
    out64, grads64 = _dropout_reference(kind, feats, src, dst, keep, p, grad_out)
    assert rel_error(out, out64) <= 1e-5
    for g, g64 in zip(_op_backward(kind, feats, src, dst, out, lse, p, rng_state, grad_out), grads64):
        assert rel_error(g, g64) <= 1e-5


@requires_cuda
@kinds
def test_cuda_dropout_never_syncs(kind):
    """Forward and backward with dropout (plan given, indices unchecked) wait for nothing."""
    feats, src, dst = kind.make(num_src=300, num_dst=200, num_edges=6000, heads=4, dim=32, device="cuda",
                                edge=True)
    num_dst = (feats[2] if kind is GAT else feats[1]).shape[0]
    plan = edgedot.EdgePlan(src, dst, feats[0].shape[0], num_dst)
    leaves = _leaves(feats)
    grad_out = torch.randn(num_dst, 4, 32, device="cuda")

    def step(generator=None):
        out = kind.call(kind.fn, leaves, src, dst, dropout_p=0.2, plan=plan, check_indices=False,
                        generator=generator)
        return torch.autograd.grad(out, leaves, grad_out)
    step()  # loads the extension, builds the plan's offsets
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        step(torch.Generator("cuda").manual_seed(1))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


@requires_cuda
@kinds
def test_cuda_graph_replays_draw_new_masks(kind):
    """Forward and backward with dropout captured in a CUDA graph: each replay draws the state the
    default generator holds then, and its output and gradients follow that replay's mask."""
    feats, src, dst = kind.make(num_src=300, num_dst=200, num_edges=6000, heads=4, dim=32, device="cuda",
                                edge=True)
    p = 0.35
    num_dst = (feats[2] if kind is GAT else feats[1]).shape[0]
    plan = edgedot.EdgePlan(src, dst, feats[0].shape[0], num_dst)
    leaves = _leaves(feats)
    grad_out = torch.randn(num_dst, 4, 32, device="cuda")

    def step():
        out = kind.call(kind.fn, leaves, src, dst, dropout_p=p, plan=plan, check_indices=False)
        return (out,) + torch.autograd.grad(out, leaves, grad_out)
    graph, static = capture_graph(step)
    outs = []
    for replay in range(3):
        state = next_dropout_state("cuda")
        graph.replay()
        torch.cuda.synchronize()
        # One draw a replay: the generator moves on by one step (else the masks are not the state's).
        after = next_dropout_state("cuda")
        assert after[0] == state[0] and after[1] - state[1] == dropout.OFFSET_STEP, (replay, state, after)
        keep = dropout_keep(state, src.shape[0], 4, p, "cuda")
        out64, grads64 = _dropout_reference(kind, feats, src, dst, keep, p, grad_out)
        assert rel_error(static[0], out64) <= 1e-5, (replay, state, rel_error(static[0], out64))
        for g, g64 in zip(static[1:], grads64):
            assert rel_error(g, g64) <= 1e-5, (replay, state)
        outs.append(static[0].clone())
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[1], outs[2])


@requires_cuda
@kinds
def test_cuda_channel_limit(kind):
    feats, src, dst = kind.make(device="cuda", dim=257)
    with raises_checked(ValueError, match="at most 256"):
        kind.call(kind.fn, feats, src, dst)


@pytest.mark.gpu_memory_heavy
@requires_cuda
@kinds
def test_cuda_hub_million_edges(kind):
    """A destination with a million incoming edges and a source with 300k outgoing ones."""
    num_edges = 1 << 20
    feats, src, dst = kind.make(num_src=100_000, num_dst=1000, num_edges=num_edges, heads=4, dim=32, device="cuda",
                                skewed=False, index_dtype=torch.int32)
    src, dst = src.clone(), dst.clone()
    dst[: num_edges - 10_000] = 17
    src[: 300_000] = 4
    fill_cuda_cache_with_nan()
    check(kind, feats, src, dst)


@requires_cuda
@pytest.mark.parametrize("dtype", FEAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", ["plain", "edge_feat", "dropout", "hub", "dst_ptr"])
@kinds
def test_cuda_records_give_the_recomputed_gradients(kind, case, dtype, monkeypatch):
    """The source pass from the destination pass's records gives the gradients of the source pass
    that recomputes them, bit for bit (whether the records fit in memory must not change a
    result): edge features, dropout, a hub whose rows are split into chunks, edges given grouped."""
    feats, src, dst = kind.make(num_src=300, num_dst=200, num_edges=40_000 if case == "hub" else 3_000, heads=4, dim=32,
                                dtype=dtype, device="cuda", edge=case == "edge_feat")
    num_dst = (feats[2] if kind is GAT else feats[1]).shape[0]
    src, dst, kwargs = records_case_graph(case, src, dst, num_dst)
    grad_out = rand_feat((num_dst, 4, 32), dtype, "cuda", gen(5))

    def run():
        leaves = _leaves(feats)
        if case == "dropout":
            kwargs["generator"] = torch.Generator("cuda").manual_seed(11)
        out = kind.call(kind.fn, leaves, src, dst, dropout_p=0.3 if case == "dropout" else 0.0, **kwargs)
        return (out,) + torch.autograd.grad(out, _present(leaves), grad_out)

    assert_records_change_nothing(run, monkeypatch)


@requires_cuda
@kinds
def test_cuda_memory_stays_below_edge_features(kind):
    """Forward + backward allocate nothing of E x H x C (the reference gathers several)."""
    num_edges, heads, dim = 1 << 21, 4, 64
    feats, src, dst = kind.make(num_src=20_000, num_dst=20_000, num_edges=num_edges, heads=heads, dim=dim,
                                device="cuda", index_dtype=torch.int32)
    leaves = [t.requires_grad_() for t in feats[:3]] + [None]
    kind.call(kind.fn, leaves, src, dst).sum().backward()  # build and warm up
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    kind.call(kind.fn, leaves, src, dst).sum().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert peak < num_edges * heads * dim * 4 // 4, f"peak {peak} bytes"


@requires_cuda
@kinds
def test_cuda_unchecked_out_of_range(kind):
    """check_indices=False never waits: an out-of-range source makes its destination NaN, an
    out-of-range destination drops its edge (graph_attention's rule); the process stays usable."""
    feats, src, dst = kind.make(device="cuda")
    src_bad, dst_bad = src.clone(), dst.clone()
    src_bad[3] = 10**6
    dst_bad[5] = -7
    out = kind.call(kind.fn, feats, src_bad, dst, check_indices=False)
    nan_rows = torch.isnan(out).flatten(1).any(1)
    assert nan_rows[dst[3]] and nan_rows.sum() == 1
    out = kind.call(kind.fn, feats, src, dst_bad, check_indices=False)
    keep = torch.arange(src.shape[0], device="cuda") != 5
    ref, _ = kind.call(kind.ref, feats, src[keep], dst[keep])
    torch.testing.assert_close(out, ref)
    torch.cuda.synchronize()
    check(kind, feats, src, dst)
