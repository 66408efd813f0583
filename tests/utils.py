"""Shared test matrix and helpers for the edgedot test suite.

Accuracy rule (as in flash-attention's tests): edgedot's error against a float64 oracle must be
at most twice the error that PyTorch's own reference (``edgedot.edge_dot_reference``) makes when
it computes in the same low precision, plus a tiny per-dtype floor so that a yardstick error of
(almost) zero does not demand bit-exactness. For forward outputs the floor scales with the dot
products' cancellation (``dot_condition``).
"""

import contextlib

import pytest
import torch

import edgedot

HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
FEAT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INDEX_DTYPES = [torch.int32, torch.int64]

requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
requires_2_gpus = pytest.mark.skipif(
    not HAS_CUDA or torch.cuda.device_count() < 2, reason="needs two CUDA devices")

# Floors of the tolerance rule (relative error), about one ulp of the output dtype or less.
FLOORS = {
    torch.float64: 1e-12,
    torch.float32: 1e-6,
    torch.float16: 1e-3,
    torch.bfloat16: 8e-3,
}

# Edges in the longest chunk the sorted reduction walks (kMaxChunkEdges in
# edgedot/csrc/backward_sorted.cu): a row longer than this spans several chunks at any graph size.
CHUNK_EDGES = 256


@contextlib.contextmanager
def raises_checked(expected, match=None):
    """``pytest.raises`` around the block, which ends with :func:`edgedot.wait_for_checks`: a CUDA
    call reports a bad graph when its check is read (a later call, or that function), not during
    the call; the CPU reports it in the call."""
    with pytest.raises(expected, match=match) as info:
        yield info
        edgedot.wait_for_checks()


def dtype_id(dtype):
    return str(dtype).replace("torch.", "")


def gen(seed=0):
    """A seeded CPU generator: every test draws fresh, reproducible inputs."""
    return torch.Generator().manual_seed(seed)


def _device_generator(g, device):
    """A generator on ``device`` seeded from ``g`` (draws big CUDA inputs on the GPU)."""
    seed = int(torch.randint(0, 2**62, (1,), generator=g))
    return torch.Generator(device=device).manual_seed(seed)


def rand_feat(shape, dtype=torch.float32, device="cpu", g=None, requires_grad=False):
    """Standard-normal features (never zeros), drawn with a seeded generator, cast, on ``device``."""
    g = g if g is not None else gen()
    device = torch.device(device)
    base = torch.float64 if dtype == torch.float64 else torch.float32
    x = torch.randn(*shape, generator=_device_generator(g, device), dtype=base, device=device)
    # A randn value is zero with probability 0, but a half cast could flush a tiny one to 0.
    x = torch.where(x.abs() < 1e-3, torch.full_like(x, 1e-3), x)
    return x.to(dtype).requires_grad_(requires_grad)


def rand_index(num_rows, num_edges, dtype=torch.int64, device="cpu", g=None):
    g = g if g is not None else gen()
    device = torch.device(device)
    return torch.randint(0, num_rows, (num_edges,), generator=_device_generator(g, device),
                         device=device).to(dtype)


def skewed_index(num_rows, num_edges, dtype=torch.int64, device="cpu", g=None, alpha=1.3, hot=None):
    """Power-law indices: a few rows get most edges (rank r drawn with weight 1/(r+1)^alpha).

    ``hot``: optional dict {row: count} of rows forced to exactly-at-least that many edges.
    Rows are shuffled so the hot rows are not simply the first ones.
    """
    g = g if g is not None else gen()
    weights = 1.0 / torch.arange(1, num_rows + 1, dtype=torch.float64) ** alpha
    ranks = torch.multinomial(weights, num_edges, replacement=True, generator=g)
    perm = torch.randperm(num_rows, generator=g)
    idx = perm[ranks]
    if hot:
        pos = 0
        shuffle = torch.randperm(num_edges, generator=g)
        for row, count in hot.items():
            idx[shuffle[pos:pos + count]] = row
            pos += count
        assert pos <= num_edges
    return idx.to(dtype=dtype, device=device)


def as_broadcastable(src_feat, dst_feat):
    """Makes a 2-D side [N, 1, D] when the other side has heads ([N, H, D])."""
    if src_feat.dim() == 2 and dst_feat.dim() == 3:
        src_feat = src_feat.unsqueeze(1)
    if dst_feat.dim() == 2 and src_feat.dim() == 3:
        dst_feat = dst_feat.unsqueeze(1)
    return src_feat, dst_feat


def reference(src_feat, dst_feat, src_idx, dst_idx):
    """PyTorch's reference in the inputs' own dtype (the yardstick of the tolerance rule)."""
    s, d = as_broadcastable(src_feat, dst_feat)
    return edgedot.edge_dot_reference(s, d, src_idx, dst_idx)


def reference64(src_feat, dst_feat, src_idx, dst_idx):
    """The float64 oracle: the reference on inputs upcast to float64."""
    return reference(src_feat.detach().double(), dst_feat.detach().double(), src_idx, dst_idx)


def snapshot(*tensors):
    """Copies of ``tensors`` (None kept), for :func:`assert_unchanged`."""
    return [None if t is None else t.detach().clone() for t in tensors]


def assert_unchanged(tensors, copies, names):
    """Each tensor still holds its copy's values, bit for bit (NaN where the copy has NaN): the
    call read its inputs without writing into them (the CPU passes take products in place of
    rows of their own)."""
    for t, copy, name in zip(tensors, copies, names):
        if t is not None:
            same = t == copy
            if t.is_floating_point():
                same |= t.isnan() & copy.isnan()
            assert bool(same.all()), f"{name} was written by the call"


def rel_error(out, ref):
    """||out - ref|| / ||ref||, in float64; 0 for empty tensors, absolute error when ref is 0."""
    out = out.detach().to(torch.float64).cpu()
    ref = ref.detach().to(torch.float64).cpu()
    assert out.shape == ref.shape, (out.shape, ref.shape)
    if ref.numel() == 0:
        return 0.0
    num = torch.linalg.vector_norm(out - ref).item()
    den = torch.linalg.vector_norm(ref).item()
    return num / den if den > 0 else num


def close_or_zero(a, b, tol):
    """``(||a - b|| <= tol * max(||b||, 1), ||a - b||)``: relative, except for values that are zero
    in exact arithmetic (a shift shared by all of a node's scores, as a bias, gets no gradient)."""
    err = torch.linalg.vector_norm((a - b).double()).item()
    return err <= tol * max(torch.linalg.vector_norm(b.double()).item(), 1.0), err


def assert_grads_close(grads, grads_p, tol):
    """Two dicts of gradients (None where a tensor got none) name the same tensors and agree by
    :func:`close_or_zero`."""
    assert grads.keys() == grads_p.keys()
    for name in grads:
        a, b = grads[name], grads_p[name]
        assert (a is None) == (b is None), name
        if a is not None:
            ok, err = close_or_zero(a, b, tol)
            assert ok, f"grad {name}: {err:.2e}"


def tolerance(dtype, ref_lowp, ref64, condition=1.0):
    """max(2 * error of PyTorch's reference in ``dtype``, floor * condition)."""
    return max(2.0 * rel_error(ref_lowp, ref64), FLOORS[dtype] * condition)


def dot_condition(src_feat, dst_feat, src_idx, dst_idx, ref64):
    """||sum |s_i d_i| || / ||sum s_i d_i|| over the edges (>= 1): the cancellation in the dot
    products. A float dot product's error is bounded relative to the sum of its terms' magnitudes,
    not to its result, so a few edges that happen to cancel (one edge of D=3, say) need the floor
    scaled by this; PyTorch's own error there may be zero by luck."""
    ref_norm = torch.linalg.vector_norm(ref64).item()
    if ref_norm == 0:
        return 1.0
    terms = reference64(src_feat.abs(), dst_feat.abs(), src_idx, dst_idx)
    return max(1.0, torch.linalg.vector_norm(terms).item() / ref_norm)


def assert_accurate(out, ref_lowp, ref64, dtype, what="output", condition=1.0):
    """The tolerance rule, plus: no NaN/inf, same shape/dtype/device as PyTorch's result."""
    assert out.shape == ref_lowp.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref_lowp.shape)}"
    assert out.dtype == dtype, f"{what}: dtype {out.dtype} != {dtype}"
    assert out.device == ref_lowp.device, f"{what}: device {out.device} != {ref_lowp.device}"
    assert torch.isfinite(out).all(), f"{what}: non-finite values"
    err = rel_error(out, ref64)
    tol = tolerance(dtype, ref_lowp, ref64, condition)
    if err > tol and rel_error(ref_lowp, ref64) > 1:
        # Zero in exact arithmetic (PyTorch's own result is all rounding: a gradient whose terms
        # cancel, as q's with a single key): rounding of the same size is right, which a relative
        # bound cannot tell; the floor then bounds the absolute error, as close_or_zero does.
        err, tol = torch.linalg.vector_norm((out - ref64).double()).item(), FLOORS[dtype] * condition
    assert err <= tol, f"{what}: relative error {err:.3e} > tolerance {tol:.3e} ({dtype_id(dtype)})"


def check_forward(src_feat, dst_feat, src_idx, dst_idx, **kwargs):
    """Runs edge_dot and checks it against the reference with the tolerance rule."""
    out = edgedot.edge_dot(src_feat, dst_feat, src_idx, dst_idx, **kwargs)
    ref64 = reference64(src_feat, dst_feat, src_idx, dst_idx)
    assert_accurate(out, reference(src_feat, dst_feat, src_idx, dst_idx), ref64, src_feat.dtype,
                    condition=dot_condition(src_feat, dst_feat, src_idx, dst_idx, ref64))
    return out


def reference_grads(src_feat, dst_feat, src_idx, dst_idx, grad_out, dtype=None):
    """Autograd gradients of the reference w.r.t. both features, computed in ``dtype``."""
    dtype = dtype or src_feat.dtype
    s = src_feat.detach().to(dtype).requires_grad_(True)
    d = dst_feat.detach().to(dtype).requires_grad_(True)
    out = reference(s, d, src_idx, dst_idx)
    gs, gd = torch.autograd.grad(out, (s, d), grad_out.to(dtype), allow_unused=True)
    gs = torch.zeros_like(s) if gs is None else gs
    gd = torch.zeros_like(d) if gd is None else gd
    return gs, gd


def scatter_grads(src_feat, dst_feat, src_idx, dst_idx, grad_out):
    """Both gradients as a scatter-add computes them in the features' dtype: per-edge terms
    added into each row one after another, in edge order (``index_add_`` on the CPU).

    The yardstick of edgedot's atomic backward, which also adds per-edge terms into each row, in
    an order the hardware picks; PyTorch's autograd of the reference sorts the edges first and
    sums each row's terms in a way that is more accurate on rows with very many edges. The CPU
    keeps the yardstick deterministic (CUDA's index_add_ adds with atomics, in varying order)."""
    s, d = (f.detach().cpu() if f.dim() == 3 else f.detach().cpu().unsqueeze(1) for f in (src_feat, dst_feat))
    g = grad_out.detach().cpu().reshape(grad_out.shape[0], -1, 1).to(s.dtype)
    grads = []
    for rows, other, row_idx, other_idx in ((s, d, src_idx, dst_idx), (d, s, dst_idx, src_idx)):
        terms = g * other[other_idx.cpu().long()]
        if rows.shape[1] == 1:
            terms = terms.sum(dim=1, keepdim=True)
        grads.append(torch.zeros_like(rows).index_add_(0, row_idx.cpu().long(), terms))
    return (grads[0].reshape(src_feat.shape).to(src_feat.device),
            grads[1].reshape(dst_feat.shape).to(dst_feat.device))


def edgedot_grads(src_feat, dst_feat, src_idx, dst_idx, grad_out, **kwargs):
    s = src_feat.detach().clone().requires_grad_(True)
    d = dst_feat.detach().clone().requires_grad_(True)
    out = edgedot.edge_dot(s, d, src_idx, dst_idx, **kwargs)
    gs, gd = torch.autograd.grad(out, (s, d), grad_out)
    return gs, gd


def check_backward(src_feat, dst_feat, src_idx, dst_idx, grad_out, yardstick=reference_grads, **kwargs):
    """edgedot's gradients vs float64 autograd of the reference, with the tolerance rule;
    ``yardstick`` computes the low-precision gradients whose error sets the tolerance."""
    dtype = src_feat.dtype
    gs, gd = edgedot_grads(src_feat, dst_feat, src_idx, dst_idx, grad_out, **kwargs)
    ls, ld = yardstick(src_feat, dst_feat, src_idx, dst_idx, grad_out)
    rs, rd = reference_grads(src_feat, dst_feat, src_idx, dst_idx, grad_out, torch.float64)
    assert gs.shape == src_feat.shape and gd.shape == dst_feat.shape
    assert_accurate(gs, ls, rs, dtype, what="grad src_feat")
    assert_accurate(gd, ld, rd, dtype, what="grad dst_feat")
    return gs, gd


def fill_cuda_cache_with_nan(device="cuda"):
    """Poisons the caching allocator: the next allocations reuse NaN-filled memory, so any output
    element a kernel forgets to write shows up as NaN instead of a lucky zero.

    Covers the small pool (blocks <= 1 MiB) and the large pool."""
    torch.cuda.synchronize(device)
    sizes = [512] * 64 + [1 << 14] * 16 + [1 << 20] * 8 + [8 << 20, 64 << 20, 256 << 20]
    poison = [torch.full((n // 4,), float("nan"), dtype=torch.float32, device=device) for n in sizes]
    torch.cuda.synchronize(device)
    del poison  # the blocks go back to the cache, still full of NaN


# Relative difference allowed between the CPU's one-chunk and chunked paths (two roundings).
PATHS_AGREE = {torch.float64: 1e-11, torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 5e-2}


def walk_in_chunks(monkeypatch, elements=1024):
    """Makes the CPU attention path walk ``elements`` per-edge elements a chunk and never take its
    one pass, so that every pass spans many chunks."""
    from edgedot.cpu import attention as cpu_attention
    monkeypatch.setattr(cpu_attention, "CHUNK_ELEMENTS", elements)
    monkeypatch.setattr(cpu_attention, "ONE_PASS_BYTES", 0)


def assert_one_chunk_path_kept(run, built, monkeypatch, tolerance):
    """``run()`` (a flat tuple of tensors: outputs and gradients) twice on the CPU's one-pass
    path, which builds its per-edge tensors once a step (``built`` counts the builds: the
    backward takes what its forward kept), then twice in chunks (:func:`walk_in_chunks`): each
    path the same bits on its second run, the two paths within ``tolerance`` of each other
    (relative error)."""
    one_pass = [run(), run()]
    assert len(built) == 2  # one forward each
    walk_in_chunks(monkeypatch)
    chunked = [run(), run()]
    assert len(built) == 2  # the chunked path builds nothing to keep
    for first, second in (one_pass, chunked):
        for a, b in zip(first, second):
            assert torch.equal(a, b)
    for a, b in zip(one_pass[0], chunked[0]):
        assert rel_error(a, b) <= tolerance



def records_case_graph(case, src, dst, num_dst):
    """(src, dst, extra keyword arguments) of a test of the backward's records: "hub" sends 30,000
    edges (of 40,000) into one destination, whose rows are split into chunks; "dst_ptr" gives the
    edges grouped by destination, with their pointer; other cases as given."""
    kwargs = {}
    if case == "hub":
        dst = dst.clone()
        dst[:30_000] = 7
    if case == "dst_ptr":
        order = torch.argsort(dst, stable=True)
        src, dst = src[order], dst[order]
        kwargs["dst_ptr"] = torch.searchsorted(dst, torch.arange(num_dst + 1, device=dst.device))
    return src, dst, kwargs


def assert_records_change_nothing(run, monkeypatch):
    """``run()`` (a flat tuple of tensors: outputs and gradients) with the CUDA backwards' records
    (``edgedot.ops.attention.BACKWARD_RECORDS``) and with their source passes recomputing instead:
    the same bits (whether the records fit in memory must not change a result)."""
    from edgedot.ops import attention as attention_ops

    results = []
    for records in (True, False):
        monkeypatch.setattr(attention_ops, "BACKWARD_RECORDS", records)
        results.append(run())
    for with_records, recomputed in zip(*results):
        assert torch.equal(with_records, recomputed)


def launched_kernels(fn):
    """Demangled names of the CUDA kernels ``fn()`` launches."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def count_graph_checks(monkeypatch):
    """A list that gets one ``(check_src, check_dst, check_ptr)`` entry per pass of
    :func:`edgedot.runtime.checks.check_graph` over a graph's tensors: on the CPU every call's
    (both ranges, and the pointer where given); on CUDA each launch of the device's check, its own
    or run by a grouping kernel (:func:`edgedot.runtime.checks.grouping_with_check`) or the GAT
    layers' self-loop kernel (:func:`edgedot.runtime.checks.self_looped_with_check`), with the
    parts no memo covered (a call whose graph is remembered adds none)."""
    from edgedot.runtime import checks
    calls = []
    cpu_flags, launch, grouping = checks.graph_flags, checks.launch_graph_check, checks.launch_grouping_check
    self_looped = checks.launch_self_looped_check

    def counted_cpu(src_idx, num_src, dst_idx, num_dst, dst_ptr, check_src, check_dst):
        calls.append((check_src, check_dst, dst_ptr is not None))
        return cpu_flags(src_idx, num_src, dst_idx, num_dst, dst_ptr, check_src, check_dst)

    def count(launched):
        if launched:
            calls.append(tuple(bool(launched & part)
                               for part in (checks.CHECKED_SRC, checks.CHECKED_DST, checks.CHECKED_PTR)))

    def counted_launch(*args):
        launched = launch(*args)
        count(launched)
        return launched

    def counted_grouping(*args):
        groups, launched = grouping(*args)
        count(launched)
        return groups, launched

    def counted_self_looped(*args):
        src, dst, launched = self_looped(*args)
        count(launched)
        return src, dst, launched

    monkeypatch.setattr(checks, "graph_flags", counted_cpu)
    monkeypatch.setattr(checks, "launch_graph_check", counted_launch)
    monkeypatch.setattr(checks, "launch_grouping_check", counted_grouping)
    monkeypatch.setattr(checks, "launch_self_looped_check", counted_self_looped)
    return calls


def capture_graph(step, warmups=2):
    """``step()`` warmed up on a side stream, then captured in a CUDA graph: ``(graph, outputs)``.
    Waits for the device after the capture: as capture begins, torch writes the default
    generator's graph-side state (its seed, offset 0) on the capture stream, in no order with a
    replay on another stream, so a first replay that overtakes that write draws offset 0's
    dropout mask (seen on a GPU shared by many processes; torch's own dropout alike)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    torch.cuda.synchronize()
    return graph, outputs
