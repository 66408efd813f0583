"""edgedot.agnn_attention (its custom ops, CPU and CUDA) against its float64 reference, and
edgedot.nn.AGNNConv against PyG's AGNNConv."""

import math

import pytest
import torch
import torch.nn.functional as F

import edgedot
from edgedot.cpu import agnn as cpu_agnn
from edgedot.cpu import attention as cpu_attention
from edgedot.ops import agnn as agnn_ops
from edgedot.ops import attention as attention_ops
from utils import (DEVICES, FEAT_DTYPES, INDEX_DTYPES, assert_accurate, assert_records_change_nothing,
                   assert_unchanged, dtype_id, fill_cuda_cache_with_nan, gen, raises_checked, rand_feat, rand_index,
                   rel_error, requires_cuda, skewed_index, snapshot, walk_in_chunks)

OP = torch.ops.edgedot.agnn_attention.default
BACKWARD_OP = torch.ops.edgedot.agnn_attention_backward.default


@pytest.fixture
def small_chunks(monkeypatch):
    """Makes the CPU path walk a few dozen edges per chunk, so every pass spans many chunks."""
    walk_in_chunks(monkeypatch)


def make(num_nodes=40, num_edges=300, heads=3, dim=16, dtype=torch.float32, device="cpu", index_dtype=torch.int64,
         seed=0, per_head_beta=True):
    """(x, beta, src_idx, dst_idx): x ``[N, H, C]`` (``[N, C]`` for ``heads=None``), beta of both
    signs (``[H]``, or ``[1]``), power-law destinations (a hub), the last node without in-edges."""
    g = gen(seed)
    x = rand_feat((num_nodes,) + ((heads,) if heads else ()) + (dim,), dtype, device, g)
    beta = (rand_feat(((heads or 1) if per_head_beta else 1,), torch.float64, device, g) * 2).to(dtype)
    src = rand_index(num_nodes, num_edges, index_dtype, device, g)
    dst = skewed_index(max(num_nodes - 1, 1), num_edges, index_dtype, device, g) if num_edges else src
    return x, beta, src, dst


def check(x, beta, src, dst, grad=True, **kwargs):
    """agnn_attention against the float64 reference with the tolerance rule (yardstick: the
    reference in the inputs' dtype): output, alpha and, with ``grad``, the gradients of x and beta.
    Returns (out, alpha, (dx, dbeta) or None)."""
    dtype = x.dtype
    leaves = [t.detach().requires_grad_(grad) for t in (x, beta)]  # detach() keeps the strides
    copies = snapshot(x, beta, src, dst)
    out, alpha = edgedot.agnn_attention(*leaves, src, dst, return_attention=True, **kwargs)
    low = [t.detach().to(dtype).requires_grad_(grad) for t in (x, beta)]
    leaves64 = [t.detach().double().requires_grad_(grad) for t in (x, beta)]
    low_out, low_alpha = edgedot.agnn_attention_reference(*low, src, dst)
    out64, alpha64 = edgedot.agnn_attention_reference(*leaves64, src, dst)
    condition = max(1.0, beta.detach().double().abs().max().item())  # |score| <= |beta|
    assert out.shape == x.shape and out.is_contiguous() and not alpha.requires_grad
    assert alpha.shape == (src.shape[0],) + tuple(x.shape[1:-1])
    assert_accurate(out, low_out, out64, dtype, "out", condition)
    assert_accurate(alpha, low_alpha, alpha64, dtype, "alpha", condition)
    if not grad:
        return out, alpha, None
    grad_out = rand_feat(out.shape, dtype, x.device, gen(99))
    grad_out_copy = grad_out.clone()
    grads = torch.autograd.grad(out, leaves, grad_out)
    assert_unchanged(leaves + [src, dst, grad_out], copies + [grad_out_copy],
                     ["x", "beta", "src_idx", "dst_idx", "grad_out"])
    assert grads[0].dtype == x.dtype and grads[1].dtype == beta.dtype and grads[1].shape == beta.shape
    if src.numel() == 0:  # the reference does not depend on its inputs at all then
        for g, leaf in zip(grads, leaves):
            assert torch.equal(g, torch.zeros_like(leaf))
        return out, alpha, grads
    low_grads = torch.autograd.grad(low_out, low, grad_out)
    grads64 = torch.autograd.grad(out64, leaves64, grad_out.double())
    conditions = (condition, condition * _beta_grad_condition(x, beta, out64, alpha64, grad_out, src, dst))
    for name, g, lo, g64, cond in zip(("dx", "dbeta"), grads, low_grads, grads64, conditions):
        assert_accurate(g, lo, g64, dtype, name, cond)
    return out, alpha, grads


def _beta_grad_condition(x, beta, out64, alpha64, grad_out, src, dst):
    """The condition number of beta's gradient, a sum over the edges of ds * cos: the sum of the
    terms' magnitudes over the magnitude of their sum (large where they cancel; when the gradient
    is exactly zero, as on a graph of one node, only an absolute error is meaningful)."""
    flat = x.dim() == 2
    x64, out64, g64 = (t.detach().double() for t in (x, out64, grad_out))
    alpha64 = alpha64.detach().double()
    if flat:
        x64, out64, g64, alpha64 = x64.unsqueeze(1), out64.unsqueeze(1), g64.unsqueeze(1), alpha64.unsqueeze(1)
    src, dst = src.long(), dst.long()
    xn = F.normalize(x64, dim=-1)
    cos = (xn[dst] * xn[src]).sum(-1)
    dp, delta = (g64[dst] * x64[src]).sum(-1), (g64[dst] * out64[dst]).sum(-1)
    terms, sizes = alpha64 * (dp - delta) * cos, alpha64 * (dp.abs() + delta.abs()) * cos.abs()
    if beta.numel() == 1:  # one beta: one sum over the heads too
        terms, sizes = terms.sum(1, keepdim=True), sizes.sum(1, keepdim=True)
    # ds = alpha * (dp - delta) cancels too: on a graph of one node it is rounding noise.
    return max(1.0, (sizes.sum(0) / terms.sum(0).abs().clamp_min(1e-300)).max().item())


# ------------------------------------------------------------------------------ the op


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("heads", [None, 3], ids=["2d", "h3"])
@pytest.mark.parametrize("dtype", FEAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("device", DEVICES)
def test_matches_reference(device, dtype, heads, index_dtype, small_chunks):
    check(*make(heads=heads, dtype=dtype, device=device, index_dtype=index_dtype))


@pytest.mark.parametrize("shape", [
    dict(heads=1, dim=1), dict(heads=1, dim=7), dict(heads=3, dim=33), dict(heads=3, dim=7, per_head_beta=False),
    dict(heads=None, dim=33, per_head_beta=False), dict(num_nodes=1, num_edges=5, dim=3), dict(num_edges=1)],
    ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
@pytest.mark.parametrize("device", DEVICES)
def test_shapes(device, shape):
    """Odd channel counts, one beta for several heads, one node, one edge (float64)."""
    check(*make(dtype=torch.float64, device=device, **shape))


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("device", DEVICES)
def test_no_edges(device, index_dtype):
    x, beta, src, dst = make(num_edges=0, device=device, index_dtype=index_dtype)
    out, alpha, _ = check(x, beta, src, dst)
    assert torch.equal(out, torch.zeros_like(out)) and alpha.shape == (0, 3)
    _, lse, _ = OP(F.normalize(x, dim=-1), x, beta, src, dst, *(None,) * 4, False, True)
    assert (lse == -math.inf).all() and lse.dtype == torch.float32


@pytest.mark.parametrize("device", DEVICES)
def test_zero_in_degree_and_self_loops(device):
    """A node without in-edges gets exact zeros and sends no gradient; a node whose only in-edge
    is its self-loop gets its own features; duplicate edges count once per copy."""
    src = torch.tensor([0, 1, 1, 2, 3, 3, 5, 5, 0], device=device)
    dst = torch.tensor([0, 1, 2, 2, 3, 0, 2, 0, 0], device=device)  # node 4 receives nothing, 5 sends only
    x, beta, _, _ = make(num_nodes=6, dtype=torch.float64, device=device, seed=1)
    out, alpha, (dx, _) = check(x, beta, src, dst)
    assert torch.equal(out[4], torch.zeros_like(out[4])) and torch.equal(out[5], torch.zeros_like(out[5]))
    assert torch.equal(dx[4], torch.zeros_like(dx[4]))  # neither receives nor sends
    torch.testing.assert_close(out[1], x[1])
    torch.testing.assert_close(out[3], x[3])
    torch.testing.assert_close(alpha[dst == 1], torch.ones_like(alpha[dst == 1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=dtype_id)
@pytest.mark.parametrize("device", DEVICES)
def test_hub(device, dtype):
    """One node with 3000 in-edges (many CPU chunks, several CUDA chunks), a source hub, a sparse
    rest, and a large beta (peaked softmax)."""
    x, beta, src, dst = make(num_nodes=500, num_edges=5000, heads=2, dim=24, dtype=dtype, device=device)
    src, dst = src.clone(), dst.clone()
    dst[:3000] = 7
    src[3000:3800] = 9
    check(x, beta * 4, src, dst)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_x(device, small_chunks):
    """A non-contiguous x (one slice of a wider tensor): the contiguous call's bits, and right."""
    x, beta, src, dst = make(device=device)
    wide = rand_feat((x.shape[0], 2) + tuple(x.shape[1:]), x.dtype, device, gen(4))
    wide[:, 1] = x
    view = wide[:, 1]
    assert not view.is_contiguous()
    out, alpha, grads = check(view, beta, src, dst)
    leaves = [t.detach().requires_grad_() for t in (x, beta)]
    want_out, want_alpha = edgedot.agnn_attention(*leaves, src, dst, return_attention=True)
    want = torch.autograd.grad(want_out, leaves, rand_feat(out.shape, x.dtype, device, gen(99)))
    for a, b in zip((out, alpha) + tuple(grads), (want_out, want_alpha) + want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_half_x_with_float32_beta(device):
    """bfloat16 / float16 features beside a float32 beta (PyG's parameter under autocast): output
    and dx in x's dtype, dbeta float32, all close to float64."""
    for dtype in (torch.bfloat16, torch.float16):
        x, beta, src, dst = make(heads=2, dtype=dtype, device=device)
        beta = beta.float().requires_grad_()
        x = x.requires_grad_()
        out = edgedot.agnn_attention(x, beta, src, dst)
        grad_out = rand_feat(out.shape, dtype, device, gen(5))
        dx, dbeta = torch.autograd.grad(out, (x, beta), grad_out)
        assert out.dtype == dx.dtype == dtype and dbeta.dtype == torch.float32
        x64, beta64 = x.detach().double().requires_grad_(), beta.detach().double().requires_grad_()
        out64, _ = edgedot.agnn_attention_reference(x64, beta64, src, dst)
        dx64, dbeta64 = torch.autograd.grad(out64, (x64, beta64), grad_out.double())
        for name, a, b in (("out", out, out64), ("dx", dx, dx64), ("dbeta", dbeta, dbeta64)):
            assert rel_error(a, b) < 3e-2, name


def test_gradcheck():
    x, beta, src, dst = make(num_nodes=7, num_edges=18, heads=2, dim=3, dtype=torch.float64)
    dst = dst.clone()
    dst[:3] = 0
    x, beta = x.requires_grad_(), beta.requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: edgedot.agnn_attention(a, b, src, dst), (x, beta))
    one = beta[:1].detach().requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: edgedot.agnn_attention(a, b, src, dst), (x, one))
    flat = x[:, 0].detach().requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: edgedot.agnn_attention(a, b, src, dst), (flat, one))


@pytest.mark.parametrize("ptr_dtype", INDEX_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("device", DEVICES)
def test_dst_ptr_and_plan_match_plain_call(device, ptr_dtype):
    """Edges given sorted with their pointer, or a plan: the plain call's outputs and gradients,
    bitwise."""
    x, beta, src, dst = make(device=device, index_dtype=torch.int32)
    dst, order = torch.sort(dst, stable=True)
    src = src[order]
    ptr = edgedot.index_to_ptr(dst, 40).to(ptr_dtype)
    grad_out = rand_feat(x.shape, x.dtype, device, gen(2))
    results = []
    for kwargs in ({}, {"dst_ptr": ptr}, {"plan": edgedot.EdgePlan(src, dst, 40, 40)}):
        leaves = [t.detach().requires_grad_() for t in (x, beta)]
        out, alpha = edgedot.agnn_attention(*leaves, src, dst, return_attention=True, **kwargs)
        results.append((out, alpha) + torch.autograd.grad(out, leaves, grad_out))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)
    bad = ptr.clone()
    bad[-1] -= 1
    with raises_checked(ValueError, match="dst_ptr"):
        edgedot.agnn_attention(x, beta, src, dst, dst_ptr=bad)


# ------------------------------------------------------------------------------ custom ops


def _op_args(device, dtype=torch.float32, beta_dtype=None, heads=2, per_head_beta=True, return_attention=False,
             plan=False):
    x, beta, src, dst = make(num_edges=120, heads=heads, dim=6, dtype=dtype, device=device,
                             index_dtype=torch.int32, per_head_beta=per_head_beta)
    beta = beta.to(beta_dtype or dtype).requires_grad_()
    x_norm = F.normalize(x, dim=-1).requires_grad_()
    groups = (None,) * 4
    if plan:
        p = edgedot.EdgePlan(src, dst, 40, 40)
        groups = (p.dst, p.offsets("dst"), p.src, p.offsets("src"))
    return (x_norm, x.requires_grad_(), beta, src, dst, *groups, return_attention, True)


OP_CASES = [dict(), dict(return_attention=True, plan=True), dict(dtype=torch.float64, per_head_beta=False),
            dict(dtype=torch.bfloat16, beta_dtype=torch.float32, return_attention=True)]


@pytest.mark.parametrize("case", OP_CASES, ids=lambda c: "-".join(
    f"{k}={dtype_id(v) if isinstance(v, torch.dtype) else v}" for k, v in c.items()) or "plain")
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device, case):
    torch.library.opcheck(OP, _op_args(device, **case))


@pytest.mark.parametrize("per_head_beta", [True, False], ids=["beta_h", "beta_1"])
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_backward(device, per_head_beta):
    args = _op_args(device, per_head_beta=per_head_beta)
    x_norm, x, beta = (t.detach() for t in args[:3])
    out, lse, _ = (t.detach() for t in OP(*args))
    grad_out = torch.randn_like(out)
    torch.library.opcheck(BACKWARD_OP, (grad_out, x_norm, x, beta, out, lse, *args[3:9]))
    grads = BACKWARD_OP(grad_out, x_norm, x, beta, out, lse, *args[3:9])
    assert [g.shape for g in grads] == [x_norm.shape, x.shape, beta.shape]


def test_compile_fullgraph():
    """torch.compile(fullgraph=True) of forward + backward matches eager, with and without a plan."""
    torch._dynamo.reset()
    x, beta, src, dst = make(dim=8)
    leaves = [x.requires_grad_(), beta.requires_grad_()]
    plan = edgedot.EdgePlan(src, dst, 40, 40)

    def loss(x, beta, plan):
        out = edgedot.agnn_attention(x, beta, src, dst, plan=plan)
        return (out.sin() * out).sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    for p in (None, plan):
        got, want = compiled(*leaves, p), loss(*leaves, p)
        torch.testing.assert_close(got, want)
        for a, b in zip(torch.autograd.grad(got, leaves), torch.autograd.grad(want, leaves)):
            torch.testing.assert_close(a, b)


class _ExtensionOnCPU:
    """Stands in for the CUDA extension's AGNN functions: checks the groupings it is handed
    against their definition, then computes with the CPU implementation, returning d_beta per
    head in the accumulation dtype as the extension does."""

    def __init__(self, src, dst, num_nodes):
        self.want = {"dst": edgedot.runtime.plan.build_side(dst, src, num_nodes, num_nodes),
                     "src": edgedot.runtime.plan.build_side(src, dst, num_nodes, num_nodes)}
        self.num_nodes, self.src, self.dst = num_nodes, src, dst
        self.calls = []

    def _check(self, side, group, offsets):
        assert torch.equal(group, self.want[side]), side
        rows = group[group.shape[0] // 2:] >> 32
        want = torch.tensor([int((rows < r).sum()) for r in range(self.num_nodes + 1)])
        assert offsets.dtype == torch.int64 and torch.equal(offsets, want), side

    def agnn_forward(self, x_norm, x, beta, src, dst, dst_group, dst_offsets, return_attention):
        assert torch.equal(src, self.src) and torch.equal(dst, self.dst) and src.is_contiguous()
        self._check("dst", dst_group, dst_offsets)
        self.calls.append("forward")
        return cpu_agnn.forward(x_norm, x, beta, src, dst, return_attention)

    def agnn_backward(self, grad_out, x_norm, x, beta, out, lse, src, dst, dst_group, dst_offsets, src_group,
                      src_offsets, records):
        assert records is True  # the records, where they fit
        self._check("dst", dst_group, dst_offsets)
        self._check("src", src_group, src_offsets)
        self.calls.append("backward")
        return cpu_agnn.backward(grad_out, x_norm, x, beta, out, lse, src, dst)


@pytest.mark.parametrize("use_plan", [False, True], ids=["noplan", "plan"])
def test_cuda_implementation_wiring(monkeypatch, use_plan):
    """The CUDA implementations hand the extension the interface's arguments (groupings built,
    or the plan's; the source grouping to the backward; contiguous indices) and its results
    through, d_beta brought to beta's shape and dtype: run on CPU tensors with the extension
    replaced by the CPU implementation."""
    args = _op_args("cpu", dtype=torch.bfloat16, beta_dtype=torch.float32, per_head_beta=False, plan=use_plan)
    x_norm, x, beta, src, dst = (t.detach() for t in args[:5])
    ext = _ExtensionOnCPU(src, dst, 40)
    monkeypatch.setattr(agnn_ops, "cuda_module", lambda: ext)
    monkeypatch.setattr(attention_ops, "cuda_module", lambda: pytest.fail("CPU tensors never build on CUDA"))
    groups = args[5:9]
    got = agnn_ops._forward_cuda(x_norm, x, beta, src, dst, *groups, True, True)
    want = OP(x_norm, x, beta, src, dst, *(None,) * 4, True, True)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    out, lse, _ = got
    grad_out = torch.randn_like(out)
    got = agnn_ops._backward_cuda(grad_out, x_norm, x, beta, out, lse, src, dst, *groups)
    want = BACKWARD_OP(grad_out, x_norm, x, beta, out, lse, src, dst, *(None,) * 4)
    assert got[2].shape == (1,) and got[2].dtype == torch.float32
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert ext.calls == ["forward", "backward"]


# ------------------------------------------------------------------------------ errors

def _bad_cases():
    """name -> (change to the keyword arguments, exception, message pattern)."""
    return {
        "x_list": (lambda a: a.update(x=[1.0]), TypeError, "x must be a tensor"),
        "x_4d": (lambda a: a.update(x=a["x"][..., None]), ValueError, r"x must be \[N, C\] or \[N, H, C\]"),
        "x_int": (lambda a: a.update(x=a["x"].int()), TypeError, "x must be float"),
        "x_no_channels": (lambda a: a.update(x=a["x"][..., :0]), ValueError, "at least one head"),
        "beta_list": (lambda a: a.update(beta=[1.0]), TypeError, "beta must be a tensor"),
        "beta_int": (lambda a: a.update(beta=a["beta"].long()), TypeError, "beta must be float"),
        "beta_heads": (lambda a: a.update(beta=a["beta"][:2]), ValueError, r"beta must be \[1\] or \[H\]"),
        "beta_scalar": (lambda a: a.update(beta=a["beta"][0]), ValueError, r"beta must be \[1\] or \[H\]"),
        "beta_device": (lambda a: a.update(beta=a["beta"].to("meta")), ValueError, "beta is on meta"),
        "src_float": (lambda a: a.update(src_idx=a["src_idx"].float()), TypeError, "src_idx must be int32"),
        "lengths": (lambda a: a.update(dst_idx=a["dst_idx"][1:]), ValueError, "same length"),
        "src_range": (lambda a: a["src_idx"].__setitem__(3, 40), IndexError, "src_idx"),
        "dst_range": (lambda a: a["dst_idx"].__setitem__(3, -1), IndexError, "dst_idx"),
        "plan_type": (lambda a: a.update(plan="plan"), TypeError, "plan"),
        "plan_graph": (lambda a: a.update(plan=edgedot.EdgePlan(a["src_idx"][:10], a["dst_idx"][:10], 40, 40)),
                       ValueError, "plan was built"),
        "dst_ptr_dtype": (lambda a: a.update(dst_ptr=torch.zeros(41, device=a["x"].device)), TypeError, "dst_ptr"),
        "check_indices": (lambda a: a.update(check_indices=None), TypeError, "check_indices"),
        "return_attention": (lambda a: a.update(return_attention=1), TypeError, "return_attention"),
    }


@pytest.mark.parametrize("case", sorted(_bad_cases()))
@pytest.mark.parametrize("device", DEVICES)
def test_bad_inputs(device, case):
    change, error, pattern = _bad_cases()[case]
    x, beta, src, dst = make(num_edges=20, device=device)
    args = dict(x=x, beta=beta, src_idx=src.clone(), dst_idx=dst.clone())
    change(args)
    with raises_checked(error, match=pattern):
        edgedot.agnn_attention(args.pop("x"), args.pop("beta"), **args)


def test_op_checks_x_norm():
    x_norm, x, beta, src, dst = _op_args("cpu")[:5]
    with raises_checked(ValueError, match="x_norm must be"):
        OP(x_norm[:, :1], x, beta, src, dst, *(None,) * 4, False, True)
    with raises_checked(TypeError, match="x_norm is torch.float64"):
        OP(x_norm.double(), x, beta, src, dst, *(None,) * 4, False, True)


# ------------------------------------------------------------------------------ CUDA only


@requires_cuda
@pytest.mark.parametrize("heads", [4, 1, None], ids=["h4", "h1", "2d"])
@pytest.mark.parametrize("dtype", FEAT_DTYPES, ids=dtype_id)
def test_cuda_matches_cpu_and_repeats(dtype, heads):
    """The CUDA kernels and the CPU path agree (to the accumulation's rounding), and repeated
    CUDA calls are bitwise identical (poisoned memory in between), a hub of more chunks than one
    warp merges included; one head and a 2-D ``x`` (the layer's) too."""
    x, beta, src, dst = make(num_nodes=900, num_edges=14_000, heads=heads, dim=32, dtype=dtype,
                             index_dtype=torch.int32)
    dst = dst.clone()
    dst[:10_000] = 11
    grad_out = rand_feat(x.shape, dtype, "cpu", gen(7))

    def run(device):
        leaves = [x.to(device).requires_grad_(), beta.float().to(device).requires_grad_()]
        out, alpha = edgedot.agnn_attention(*leaves, src.to(device), dst.to(device), return_attention=True)
        return [t.cpu() for t in (out, alpha) + torch.autograd.grad(out, leaves, grad_out.to(device))]

    cpu = run("cpu")
    fill_cuda_cache_with_nan()
    first = run("cuda")
    fill_cuda_cache_with_nan()
    second = run("cuda")
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    for name, c, a, b in zip(("out", "alpha", "dx", "dbeta"), cpu, first, second):
        assert torch.equal(a, b), f"{name}: CUDA calls differ"
        assert torch.isfinite(a).all(), name
        assert rel_error(a, c) <= tol, f"{name}: CUDA vs CPU {rel_error(a, c):.3e}"


@requires_cuda
@pytest.mark.parametrize("dtype", FEAT_DTYPES, ids=dtype_id)
def test_cuda_records_give_the_recomputed_gradients(dtype, monkeypatch):
    """The source pass from the destination pass's records gives the gradients of the source pass
    that recomputes them, bit for bit, per-head betas and a chunked hub included."""
    x, beta, src, dst = make(num_nodes=900, num_edges=14_000, heads=4, dim=32, dtype=dtype, device="cuda")
    dst = dst.clone()
    dst[:10_000] = 11
    grad_out = rand_feat(x.shape, dtype, "cuda", gen(7))

    def run():
        leaves = [x.detach().requires_grad_(), beta.float().requires_grad_()]
        out = edgedot.agnn_attention(*leaves, src, dst)
        return (out,) + torch.autograd.grad(out, leaves, grad_out)

    assert_records_change_nothing(run, monkeypatch)


@pytest.mark.gpu_memory_heavy
@requires_cuda
def test_cuda_hub_large():
    """A node with 300k in-edges and a source with 100k out-edges (float32, int32)."""
    num_edges = 1 << 19
    x, beta, src, dst = make(num_nodes=50_000, num_edges=num_edges, heads=2, dim=32, device="cuda",
                             index_dtype=torch.int32)
    src, dst = src.clone(), dst.clone()
    dst[:300_000] = 17
    src[300_000:400_000] = 4
    fill_cuda_cache_with_nan()
    check(x, beta, src, dst)


@requires_cuda
def test_cuda_channel_limit():
    x, beta, src, dst = make(device="cuda", dim=257)
    with raises_checked(ValueError, match="at most 256"):
        edgedot.agnn_attention(x, beta, src, dst)


# ------------------------------------------------------------------------------ the layer vs PyG's

try:
    import torch_geometric  # noqa: F401
    HAVE_PYG = True
except ImportError:
    HAVE_PYG = False
# The layer's tests (the op's run without PyG).
requires_pyg = pytest.mark.skipif(not HAVE_PYG, reason="needs torch_geometric")


def _pyg_agnn():
    from torch_geometric.nn.conv.agnn_conv import AGNNConv
    return AGNNConv


def _pyg_helpers():
    """test_pyg_integration's graphs and checks (that module needs PyG to import)."""
    import test_pyg_integration
    return test_pyg_integration


TOL = 1e-10


def _pair(device="cpu", beta=0.7, **options):
    """PyG's layer and ours with the same beta (PyG's state dict loaded into ours), float64."""
    theirs = _pyg_agnn()(**options).to(device, torch.float64)
    if theirs.requires_grad:
        theirs.beta.data.fill_(beta)
    ours = edgedot.nn.AGNNConv(**options).to(device, torch.float64)
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


def _run(layer, x, edge_index):
    x = x.detach().requires_grad_()
    out = layer(x, edge_index)
    leaves = [x] + list(layer.parameters())
    # Drawn in float64 and cast: a float32 draw is another sequence, so layers of different dtypes
    # would be given unrelated output gradients.
    grad_out = rand_feat(out.shape, torch.float64, out.device, gen(1)).to(out.dtype)
    grads = torch.autograd.grad(out, leaves, grad_out)
    return out, grads


def _assert_same(ours, theirs, tol=TOL):
    (out, grads), (out_p, grads_p) = ours, theirs
    assert out.shape == out_p.shape and out.dtype == out_p.dtype
    assert rel_error(out, out_p) <= tol, f"out {rel_error(out, out_p):.2e}"
    assert len(grads) == len(grads_p)
    for name, a, b in zip(("x", "beta"), grads, grads_p):
        assert rel_error(a, b) <= tol, f"grad {name} {rel_error(a, b):.2e}"


@requires_pyg
@pytest.mark.parametrize("options", [dict(), dict(requires_grad=False), dict(add_self_loops=False),
                                     dict(requires_grad=False, add_self_loops=False),
                                     dict(flow="target_to_source")],
                         ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "default")
@pytest.mark.parametrize("device", DEVICES)
def test_layer_matches_pyg(device, options):
    """float64 outputs and gradients (x, beta) equal PyG's layer's, on a graph with self-loops,
    duplicates, a hub and a node without in-edges."""
    theirs, ours = _pair(device, **options)
    assert len(list(ours.parameters())) == (0 if options.get("requires_grad") is False else 1)
    g = gen(2)
    x = rand_feat((30, 16), torch.float64, device, g)
    edge_index = _pyg_helpers()._graph(30, 30, 120, device, g)
    _assert_same(_run(ours, x, edge_index), _run(theirs, x, edge_index))


@requires_pyg
def test_layer_adjacency_forms():
    """Every adjacency form PyG takes (EdgeIndex, torch.sparse COO / CSR / CSC) gives PyG's
    output and gradients, with and without self-loop handling (PyG's error for a CSC adj_t with
    it)."""
    g = gen(11)
    x = rand_feat((9, 5), torch.float64, g=g)
    edge_index = _pyg_helpers()._simple_graph(9, 9, 30, "cpu", g)
    for loops in (True, False):
        theirs, ours = _pair(add_self_loops=loops)
        for name, (adj, order) in _pyg_helpers()._forms(edge_index, 9, 9).items():
            if name == "csc" and loops:  # PyG's self-loop utilities refuse a CSC adj_t: so do we
                for layer in (ours, theirs):
                    with raises_checked(ValueError, match="sparse_csc"):
                        layer(x, adj)
                continue
            # PyG sizes an EdgeIndex without a sparse size by its largest index and refuses a CSC
            # adj_t: it gets the same edges as a plain tensor there.
            theirs_adj = edge_index[:, order] if name in ("edge_index_no_size", "csc") else adj
            _assert_same(_run(ours, x, adj), _run(theirs, x, theirs_adj))


@requires_pyg
def test_layer_state_dict_both_ways():
    """PyG's state dict loads into ours and ours into PyG's (strictly), with beta a parameter
    or a buffer; repr and reset_parameters as PyG's."""
    for requires_grad in (True, False):
        theirs, ours = _pair(requires_grad=requires_grad, beta=2.5)
        assert ours.state_dict().keys() == theirs.state_dict().keys() == {"beta"}
        assert torch.equal(ours.beta, theirs.beta) and isinstance(ours.beta, torch.nn.Parameter) == requires_grad
        fresh = _pyg_agnn()(requires_grad=requires_grad).double()
        fresh.load_state_dict(ours.state_dict())
        assert torch.equal(fresh.beta, ours.beta)
        ours.reset_parameters()
        assert ours.beta.item() == 1.0 and repr(ours) == repr(theirs) == "AGNNConv()"


def _propagate_refused(*args, **kwargs):
    raise AssertionError("PyG's propagate ran instead of the fused kernel")


@requires_pyg
def test_layer_path_choice(monkeypatch):
    """The fused kernel by default; PyG's exact path (same numbers) with a message hook, in
    explain mode (its edge mask gets a gradient) and with another aggregation."""
    g = gen(14)
    theirs, ours = _pair()
    x = rand_feat((10, 6), torch.float64, g=g)
    edge_index = _pyg_helpers()._graph(10, 10, 35, "cpu", g)
    expected = theirs(x, edge_index)
    monkeypatch.setattr(ours, "propagate", _propagate_refused)
    assert rel_error(ours(x, edge_index), expected) <= TOL
    monkeypatch.undo()

    seen = []
    handle = ours.register_message_forward_hook(lambda module, inputs, out: seen.append(out.shape))
    assert rel_error(ours(x, edge_index), expected) <= TOL
    assert len(seen) == 1
    handle.remove()

    ours.explain = theirs.explain = True
    mask = torch.rand(35, dtype=torch.float64, generator=g).requires_grad_()
    ours._edge_mask = theirs._edge_mask = mask
    ours._loop_mask = theirs._loop_mask = edge_index[0] != edge_index[1]
    masked = ours(x, edge_index)
    assert rel_error(masked, theirs(x, edge_index)) <= TOL
    (grad,) = torch.autograd.grad(masked.square().sum(), mask)
    assert grad.abs().sum() > 0
    ours.explain = theirs.explain = False

    mean_theirs, mean_ours = _pair(aggr="mean")
    assert rel_error(mean_ours(x, edge_index), mean_theirs(x, edge_index)) <= TOL


@requires_pyg
def test_layer_torchscript():
    """torch.jit.script of the layer: the fused op on a [2, E] tensor gives the eager module's
    bits; PyG's numbers either way."""
    g = gen(18)
    x, edge_index = rand_feat((10, 6), torch.float64, g=g), _pyg_helpers()._graph(10, 10, 35, "cpu", g)
    for loops in (True, False):
        theirs, ours = _pair(add_self_loops=loops)
        scripted = torch.jit.script(ours)
        assert torch.equal(scripted(x, edge_index), ours(x, edge_index))
        assert rel_error(scripted(x, edge_index), theirs(x, edge_index)) <= TOL


@requires_pyg
def test_layer_compile():
    """torch.compile of a training step matches eager (whole-graph without self-loop handling,
    whose edge count depends on the data)."""
    g = gen(8)
    x, edge_index = rand_feat((20, 6), torch.float64, g=g), _pyg_helpers()._graph(20, 20, 80, "cpu", g)
    for loops in (False, True):
        torch._dynamo.reset()
        _, ours = _pair(add_self_loops=loops)

        def step(x):
            return ours(x, edge_index).square().sum()

        eager = torch.autograd.grad(step(x), list(ours.parameters()))
        compiled = torch.compile(step, fullgraph=not loops, backend="aot_eager")
        for a, b in zip(torch.autograd.grad(compiled(x), list(ours.parameters())), eager):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@requires_pyg
def test_layer_autocast():
    """Under CPU autocast (bfloat16): x from a Linear (bfloat16) beside the float32 beta, and a
    float32 x; the output has PyG's dtype and is close to PyG's, beta gets a gradient."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 16)
    theirs, ours = _pyg_agnn()(), edgedot.nn.AGNNConv()
    theirs.beta.data.fill_(1.5)
    ours.load_state_dict(theirs.state_dict())
    g = gen(3)
    x = rand_feat((40, 8), g=g)
    edge_index = _pyg_helpers()._graph(40, 40, 200, "cpu", g)
    for features in (lin, torch.nn.Identity()):
        results = []
        for layer in (ours, theirs):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = layer(features(x), edge_index)
            (dbeta,) = torch.autograd.grad(out.float().square().sum(), layer.beta)
            results.append((out, dbeta))
        (out, dbeta), (out_p, dbeta_p) = results
        assert out.dtype == out_p.dtype == torch.float32
        assert rel_error(out, out_p) < 2e-2 and rel_error(dbeta, dbeta_p) < 5e-2


@requires_pyg
def test_layer_bad_x():
    _, ours = _pair()
    edge_index = torch.tensor([[0, 1], [1, 0]])
    with raises_checked(ValueError, match=r"x must be \[N, F\]"):
        ours(torch.randn(2, 2, 3, dtype=torch.float64), edge_index)


@requires_pyg
def test_gnn_explainer_gets_edge_gradients():
    _pyg_helpers().check_gnn_explainer_edge_mask(lambda *args, **kwargs: edgedot.nn.AGNNConv())


@requires_pyg
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_cuda_layer_matches_pyg(dtype):
    """The layer on CUDA in float32 and bfloat16 (beta kept float32, as under autocast) against
    PyG's float64 layer."""
    theirs, ours = _pair("cuda")
    ours.float()
    g = gen(4)
    x = rand_feat((3000, 32), torch.float64, "cuda", g)
    edge_index = _pyg_helpers()._graph(3000, 3000, 40_000, "cuda", g, torch.int32)
    ref, ref_grads = _run(theirs, x, edge_index.long())
    out, grads = _run(ours, x.to(dtype), edge_index)
    assert out.dtype == torch.float32
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert rel_error(out, ref) < tol
    for a, b in zip(grads, ref_grads):
        assert rel_error(a, b) < tol
