"""The extension's ``group_edges`` (one radix sort and one kernel; for a batch one wave of blocks
sorts, one cooperative kernel) and ``group_edges_both`` (the groupings by both ends from one sort)
against the tensor operations of ``edgedot.runtime.plan.build_side`` and ``group_offsets``, bit for
bit, and graph attention with the groupings it builds against the EdgePlan's. The kernel tests need
a GPU."""

import pytest
import torch

import edgedot
from edgedot.ops import attention as attention_ops
from edgedot.runtime.build import cuda_module
from edgedot.runtime.plan import build_side, group_offsets
from utils import INDEX_DTYPES, dtype_id, fill_cuda_cache_with_nan, gen, launched_kernels, rand_feat, requires_cuda

NUM_OTHER = 1000
PATTERNS = ["random", "sorted", "reversed", "one_row", "bad_rows", "bad_others"]


def _indices(pattern, num_edges, num_rows, dtype, g):
    """(row_idx, other_idx) on CUDA: rows in the given pattern, others in [0, NUM_OTHER) apart from
    the out-of-range values of "bad_others"."""
    rows = torch.randint(0, num_rows, (num_edges,), generator=g, dtype=torch.int64)
    others = torch.randint(0, NUM_OTHER, (num_edges,), generator=g, dtype=torch.int64)
    huge = torch.iinfo(dtype).max
    if pattern == "sorted":
        rows = rows.sort().values
    elif pattern == "reversed":
        rows = rows.sort(descending=True).values
    elif pattern == "one_row":
        rows.fill_(num_rows // 2)
    elif pattern in ("bad_rows", "bad_others"):
        values = (torch.tensor([-1, num_rows, huge, torch.iinfo(dtype).min]) if pattern == "bad_rows"
                  else torch.tensor([-1, NUM_OTHER, huge, torch.iinfo(dtype).min]))
        bad = torch.rand(num_edges, generator=g) < 0.3
        pick = values[torch.randint(0, 4, (num_edges,), generator=g)]
        if pattern == "bad_rows":
            rows = torch.where(bad, pick, rows)
        else:
            others = torch.where(bad, pick, others)
    return rows.to(dtype).cuda(), others.to(dtype).cuda()


def _check(row_idx, other_idx, num_rows, num_other):
    want_packed = build_side(row_idx, other_idx, num_rows, num_other)
    want_offsets = group_offsets(want_packed, num_rows)
    fill_cuda_cache_with_nan()  # an element the kernel leaves unwritten reads back as NaN bits
    packed, offsets = cuda_module().group_edges(row_idx, other_idx, num_rows, num_other)
    assert packed.dtype == offsets.dtype == torch.int64
    assert torch.equal(packed, want_packed)
    assert torch.equal(offsets, want_offsets)


def _check_both(row_idx, other_idx, num_rows, num_other):
    """group_edges_both against build_side by each end."""
    fill_cuda_cache_with_nan()
    got = cuda_module().group_edges_both(row_idx, other_idx, num_rows, num_other)
    for i, (rows, others, n, n_other) in enumerate(((row_idx, other_idx, num_rows, num_other),
                                                     (other_idx, row_idx, num_other, num_rows))):
        want = build_side(rows, others, n, n_other)
        assert torch.equal(got[2 * i], want), f"side {i}: packed"
        assert torch.equal(got[2 * i + 1], group_offsets(want, n)), f"side {i}: offsets"


@pytest.mark.gpu_memory_heavy
@requires_cuda
def test_both_sides_mixed_dtypes_strides_and_empty_sides():
    rows, others = _indices("bad_others", 2 * 5001, 300, torch.int64, gen(6))
    _check_both(rows[::2], others.int()[1::2], 300, NUM_OTHER)
    _check_both(others.int()[::2], rows[1::2], NUM_OTHER, 300)
    _check_both(rows, others, 0, NUM_OTHER)
    _check_both(rows, others, 300, 0)
    _check_both(rows, others, 2**24, 2**30)  # keys of both sides up to 2**24 + 2**30 + 1


@requires_cuda
def test_both_sides_hub_both_ways():
    """A hub on each side, and long runs of rows without edges."""
    g = gen(7)
    rows = torch.randint(0, 1000, (60000,), generator=g)
    others = torch.randint(0, 500, (60000,), generator=g)
    rows[::3] = 17
    others[1::2] = 499
    _check_both(rows.cuda(), others.cuda(), 300000, 200000)


@requires_cuda
@pytest.mark.parametrize("both", [False, True], ids=["one_side", "both_sides"])
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("num_rows", [1, 7, 1000, 200000])
@pytest.mark.parametrize("num_edges", [0, 1, 5, 100003])
@pytest.mark.parametrize("dtype", INDEX_DTYPES, ids=dtype_id)
def test_matches_build_side(dtype, num_edges, num_rows, pattern, both):
    """group_edges, and group_edges_both (by each end from one sort), against build_side."""
    g = gen(num_edges * 7 + num_rows + PATTERNS.index(pattern))
    row_idx, other_idx = _indices(pattern, num_edges, num_rows, dtype, g)
    (_check_both if both else _check)(row_idx, other_idx, num_rows, NUM_OTHER)


# The cooperative kernel's tiles: 512 threads x 8 keys up to 128 such tiles, else 512 x 16 keys, at
# most 128 of them.
SMALL_TILE_KEYS, TILE_KEYS = 4096, 8192
COOPERATIVE_MAX_KEYS = 128 * TILE_KEYS


@requires_cuda
@pytest.mark.parametrize("both", [False, True], ids=["one_side", "both_sides"])
@pytest.mark.parametrize("num_keys", [SMALL_TILE_KEYS - 2, SMALL_TILE_KEYS, SMALL_TILE_KEYS + 2,
                                      5 * SMALL_TILE_KEYS + 6, 128 * SMALL_TILE_KEYS, 128 * SMALL_TILE_KEYS + 2,
                                      75 * TILE_KEYS + 6, COOPERATIVE_MAX_KEYS, COOPERATIVE_MAX_KEYS + 2])
def test_tile_edges_and_past_the_one_launch_sort(num_keys, both):
    """Batches that end on, just before and just after a tile of the one-launch sort, fill its
    grid of small tiles or just pass it (large tiles then), fill its largest grid, or just pass it
    (CUB's sort then serves): the same groupings."""
    num_edges = num_keys // 2 if both else num_keys
    row_idx, other_idx = _indices("bad_rows", num_edges, 70000, torch.int64, gen(num_keys + both))
    (_check_both if both else _check)(row_idx, other_idx, 70000, NUM_OTHER)



@requires_cuda
@pytest.mark.parametrize("both", [False, True], ids=["one_side", "both_sides"])
@pytest.mark.parametrize("num_rows", [1000, 2**20 + 5000, 2**26])
def test_offsets_scanned_or_searched(num_rows, both):
    """The one-launch sort's offsets: a scan of the rows' counts where the rows are few against the
    keys (up to 4 x the keys + 2**20 of key space: the counting sort), binary searches past that
    (the radix sort); rows before the first key, between keys and past the last, and out-of-range
    rows."""
    g = gen(num_rows + both)
    rows = torch.randint(0, min(num_rows, 3000), (4000,), generator=g) * (num_rows // 3000 + 1)
    rows[::50] = num_rows + 7
    others = torch.randint(0, NUM_OTHER, (4000,), generator=g)
    (_check_both if both else _check)(rows.cuda(), others.cuda(), num_rows, NUM_OTHER)

# Rows up to which the one-launch grouping's counting sort ranks a row's entries; a longer row sends
# the batch to its radix sort (group_edges_cooperative.cu, kRankedRowMax).
RANKED_ROW_MAX = 512


@requires_cuda
@pytest.mark.parametrize("both", [False, True], ids=["one_side", "both_sides"])
@pytest.mark.parametrize("longest", [RANKED_ROW_MAX - 1, RANKED_ROW_MAX, RANKED_ROW_MAX + 1, 5000])
@pytest.mark.parametrize("side", ["row", "other", "out_of_range_row"])
def test_counting_sort_or_radix_by_the_longest_row(side, longest, both):
    """A mini-batch whose longest row (a hub among the rows, among the other ends, or the rows out of
    range, which sort as one row) holds just under, at or past the rows the counting sort ranks:
    the same groupings either way, hub entries spread over the whole batch in edge order."""
    g = gen(longest * 3 + both + len(side))
    num_edges = 40000
    rows = torch.randint(0, 20000, (num_edges,), generator=g)
    others = torch.randint(0, NUM_OTHER, (num_edges,), generator=g)
    rows[rows == 777] = 778
    others[others == 5] = 6
    hub = torch.randperm(num_edges, generator=g)[:longest]
    if side == "row":
        rows[hub] = 777
    elif side == "other":
        others[hub] = 5  # a row of the second side's grouping
    else:
        rows[hub] = -1
    (_check_both if both else _check)(rows.cuda(), others.cuda(), 20000, NUM_OTHER)


@requires_cuda
def test_a_mini_batch_groups_in_one_launch():
    """A sampled batch's groupings (both sides) take one kernel; a batch past the one-launch sort's
    tiles takes CUB's sort and the grouping kernel."""
    ext = cuda_module()
    rows, others = _indices("random", 163840, 16384, torch.int64, gen(11))
    names = launched_kernels(lambda: ext.group_edges_both(rows, others, 16384, NUM_OTHER))
    assert len(names) == 1 and "cooperative_grouping_kernel" in names[0], names
    rows, others = _indices("random", COOPERATIVE_MAX_KEYS, 16384, torch.int64, gen(12))
    names = launched_kernels(lambda: ext.group_edges_both(rows, others, 16384, NUM_OTHER))
    assert not any("cooperative_grouping_kernel" in name for name in names), names
    assert any("group_edges_kernel" in name for name in names), names


def _checked_groupings(row_idx, other_idx, num_rows, num_other, both):
    """group_edges_checked's (groupings, parts checked, flags), its memos cleared again."""
    ext = cuda_module()
    host_flags = torch.full((5,), 7, dtype=torch.int32, pin_memory=True)  # poisoned: the call zeroes them
    groups, launched = ext.group_edges_checked(row_idx, other_idx, num_rows, num_other, both, host_flags)
    torch.cuda.synchronize()
    ext.graph_check_forget(other_idx, row_idx, None, launched)
    return groups, launched, host_flags.clone()


@requires_cuda
@pytest.mark.parametrize("both", [False, True], ids=["one_side", "both_sides"])
@pytest.mark.parametrize("pattern", ["random", "bad_rows", "bad_others"])
@pytest.mark.parametrize("num_keys", [0, 1000, COOPERATIVE_MAX_KEYS + 2])
@pytest.mark.parametrize("dtype", INDEX_DTYPES, ids=dtype_id)
def test_checked_grouping_flags_what_the_check_flags(dtype, num_keys, pattern, both):
    """group_edges_checked: the groupings of group_edges / group_edges_both bit for bit, and, in the
    one-launch sort and past it (CUB's), the range flags graph_flags gives (row_idx as dst_idx)."""
    ext = cuda_module()
    num_rows = 700
    num_edges = num_keys // 2 if both else num_keys
    rows, others = _indices(pattern, num_edges, num_rows, dtype, gen(num_keys + 3 * both))
    groups, launched, flags = _checked_groupings(rows, others, num_rows, NUM_OTHER, both)
    want = (ext.group_edges_both if both else ext.group_edges)(rows, others, num_rows, NUM_OTHER)
    assert len(groups) == len(want) and all(torch.equal(a, b) for a, b in zip(groups, want))
    assert launched == 3  # src_idx's range and dst_idx's
    want_flags = ext.graph_flags(others, NUM_OTHER, rows, num_rows, None, True, True).cpu()
    assert torch.equal(flags, want_flags), (flags, want_flags)
    assert bool(flags.any()) == (pattern != "random" and num_edges > 0)


@requires_cuda
def test_checked_grouping_checks_only_what_no_memo_covers():
    """A graph whose ranges are remembered is grouped without a check (its flags untouched); one
    remembered side leaves the other's check to the kernel."""
    ext = cuda_module()
    rows, others = _indices("random", 5000, 300, torch.int32, gen(13))
    host_flags = torch.full((5,), 7, dtype=torch.int32, pin_memory=True)
    _, launched = ext.group_edges_checked(rows, others, 300, NUM_OTHER, True, host_flags)
    assert launched == 3
    torch.cuda.synchronize()
    assert not host_flags.any()
    host_flags.fill_(7)
    _, launched = ext.group_edges_checked(rows, others, 300, NUM_OTHER, True, host_flags)
    assert launched == 0 and (host_flags == 7).all()
    fresh_others = others.clone()
    fresh_others[17] = NUM_OTHER
    _, launched = ext.group_edges_checked(rows, fresh_others, 300, NUM_OTHER, False, host_flags)
    torch.cuda.synchronize()
    assert launched == 1 and host_flags.tolist() == [1, 0, 0, 0, 0]  # src_idx out of range
    ext.graph_check_forget(fresh_others, rows, None, launched)
    ext.graph_check_forget(others, rows, None, 3)


@requires_cuda
def test_mixed_dtypes_and_strided_indices():
    g = gen(1)
    rows, others = _indices("bad_rows", 2 * 5001, 300, torch.int64, g)
    _check(rows[::2], others.int()[1::2], 300, NUM_OTHER)
    _check(others.int()[::2], rows[1::2], NUM_OTHER, 300)


@requires_cuda
@pytest.mark.parametrize("num_edges", [0, 9])
def test_no_rows_and_no_others(num_edges):
    rows, others = _indices("random", num_edges, 5, torch.int32, gen(2))
    _check(rows, others, 0, NUM_OTHER)  # every row out of range: offsets == [0]
    _check(rows, others, 5, 0)  # every other row out of range: -1
    _check(rows, others, 2**24, 2**31 - 1)


@requires_cuda
def test_hub_and_empty_tail():
    """A hub row and a long run of rows without edges at the end (a sampled subgraph's last hop)."""
    g = gen(3)
    rows = torch.randint(0, 1000, (50000,), generator=g)
    rows[::3] = 17
    others = torch.randint(0, NUM_OTHER, (50000,), generator=g)
    _check(rows.cuda(), others.cuda(), 300000, NUM_OTHER)


@requires_cuda
def test_bad_arguments():
    rows = torch.zeros(4, dtype=torch.int64, device="cuda")
    with pytest.raises(ValueError, match="one length"):
        cuda_module().group_edges(rows, rows[1:], 3, 3)
    with pytest.raises(ValueError, match="num_rows"):
        cuda_module().group_edges(rows, rows, 2**31, 3)
    with pytest.raises(TypeError, match="other_idx"):
        cuda_module().group_edges(rows, rows.float(), 3, 3)
    with pytest.raises(ValueError, match="rows on both sides"):  # the two key ranges overflow int32
        cuda_module().group_edges_both(rows, rows, 2**30, 2**30)
    with pytest.raises(ValueError, match="one length"):
        cuda_module().group_edges_both(rows, rows[1:], 3, 3)


@requires_cuda
@pytest.mark.parametrize("dtype", INDEX_DTYPES, ids=dtype_id)
def test_build_grouping_uses_the_kernel(dtype, monkeypatch):
    rows, others = _indices("bad_rows", 1000, 50, dtype, gen(4))
    packed, offsets = attention_ops.build_grouping(rows, others, 50, NUM_OTHER)
    want = build_side(rows, others, 50, NUM_OTHER)
    assert torch.equal(packed, want) and torch.equal(offsets, group_offsets(want, 50))
    monkeypatch.setattr(attention_ops, "build_side", None)  # the tensor operations are not called
    attention_ops.build_grouping(rows, others, 50, NUM_OTHER)


@requires_cuda
@pytest.mark.parametrize("dtype", INDEX_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("max_edges", [attention_ops.BOTH_SIDES_MAX_EDGES, 999])
def test_build_grouping_both_sides(dtype, max_edges, monkeypatch):
    """Both groupings, from one sort or (past BOTH_SIDES_MAX_EDGES) from two."""
    monkeypatch.setattr(attention_ops, "BOTH_SIDES_MAX_EDGES", max_edges)
    rows, others = _indices("bad_rows", 1000, 50, dtype, gen(8))
    got = attention_ops.build_grouping(rows, others, 50, NUM_OTHER, both=True)
    for i, (r, o, n, n_other) in enumerate(((rows, others, 50, NUM_OTHER), (others, rows, NUM_OTHER, 50))):
        want = build_side(r, o, n, n_other)
        assert torch.equal(got[2 * i], want) and torch.equal(got[2 * i + 1], group_offsets(want, n))



@requires_cuda
@pytest.mark.parametrize("max_edges", [attention_ops.BOTH_SIDES_MAX_EDGES, 999])
@pytest.mark.parametrize("both", [False, True], ids=["one_side", "both_sides"])
def test_build_grouping_with_the_check(both, max_edges, monkeypatch):
    """check=True: the same groupings, in one sort and (past BOTH_SIDES_MAX_EDGES) in two; a bad
    index found by the grouping's kernel is reported at the latest by wait_for_checks, naming the
    argument (rows as dst_idx)."""
    monkeypatch.setattr(attention_ops, "BOTH_SIDES_MAX_EDGES", max_edges)
    rows, others = _indices("random", 1000, 50, torch.int64, gen(14))
    got = attention_ops.build_grouping(rows, others, 50, NUM_OTHER, both=both, check=True)
    want = attention_ops.build_grouping(rows, others, 50, NUM_OTHER, both=both)
    assert len(got) == len(want) == (4 if both else 2)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    edgedot.wait_for_checks()
    bad_rows = rows.clone()
    bad_rows[17] = 50
    attention_ops.build_grouping(bad_rows, others, 50, NUM_OTHER, both=both, check=True)
    with pytest.raises(IndexError, match="dst_idx"):
        edgedot.wait_for_checks()


def test_build_grouping_check_needs_the_extension():
    rows = torch.randint(0, 50, (100,), generator=gen(15))
    others = torch.randint(0, NUM_OTHER, (100,), generator=gen(16))
    with pytest.raises(ValueError, match="check"):
        attention_ops.build_grouping(rows, others, 50, NUM_OTHER, check=True)

def _groupings_built(monkeypatch):
    """The ``both`` argument of every grouping edge_groupings builds (with the graph's check in its
    kernel or without), recorded."""
    calls = []
    build = attention_ops.build_grouping

    def recording(*args, both=False, check=False):
        calls.append(both)
        return build(*args, both=both, check=check)
    monkeypatch.setattr(attention_ops, "build_grouping", recording)
    return calls


@requires_cuda
def test_forward_builds_the_source_grouping_only_for_source_gradients(monkeypatch):
    """A forward sorts by both ends where the backward will walk the edges by source (a gradient
    for k or v; for GAT's x or a_src; GATv2's x_src), else by destination alone."""
    g = gen(9)
    n, e, heads, dim = 300, 2000, 2, 16
    src, dst = (torch.randint(0, n, (e,), generator=g).cuda() for _ in range(2))
    q, k, v = (rand_feat((n, heads, dim), torch.float32, "cuda", g) for _ in range(3))
    a_src, a_dst = (rand_feat((n, heads), torch.float32, "cuda", g) for _ in range(2))
    att = rand_feat((heads, dim), torch.float32, "cuda", g)
    calls = _groupings_built(monkeypatch)
    cases = [(lambda t: edgedot.graph_attention(*t, src, dst), (q, k, v), [(1,), (2,)], [(0,), ()]),
             (lambda t: edgedot.gat_attention(*t, src, dst), (k, a_src, a_dst), [(0,), (1,)], [(2,)]),
             (lambda t: edgedot.gatv2_attention(*t, att, src, dst), (k, q), [(0,)], [(1,)])]
    for call, tensors, by_src, by_dst_alone in cases:
        for grads, want in [(w, True) for w in by_src] + [(w, False) for w in by_dst_alone]:
            calls.clear()
            call([t.detach().requires_grad_(i in grads) for i, t in enumerate(tensors)])
            assert calls == [want], (grads, calls)
        calls.clear()
        with torch.no_grad():
            call([t.detach().requires_grad_() for t in tensors])
        assert calls == [False]


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=dtype_id)
def test_attention_matches_plan_bitwise(dtype, index_dtype):
    g = gen(5)
    num_src, num_dst, num_edges, heads, dim = 700, 900, 20000, 4, 32
    src = torch.randint(0, num_src, (num_edges,), generator=g).to(index_dtype).cuda()
    dst = torch.randint(0, num_dst - 100, (num_edges,), generator=g).to(index_dtype).cuda()  # rows without edges
    q, k, v = (rand_feat((n, heads, dim), dtype, "cuda", g, requires_grad=True) for n in (num_dst, num_src, num_src))
    ef = rand_feat((num_edges, heads, dim), dtype, "cuda", g, requires_grad=True)
    grad_out = rand_feat((num_dst, heads, dim), dtype, "cuda", g)
    plan = edgedot.EdgePlan(src, dst, num_src, num_dst)
    results = []
    for use_plan in (False, True):
        out = edgedot.graph_attention(q, k, v, src, dst, edge_feat=ef, dropout_p=0.1,
                                      generator=torch.Generator("cuda").manual_seed(9), plan=plan if use_plan else None)
        grads = torch.autograd.grad(out, (q, k, v, ef), grad_out)
        results.append((out,) + grads)
    for a, b in zip(*results):
        assert torch.equal(a.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           b.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


@pytest.mark.parametrize("device_type", ["cpu", "meta"])
def test_build_grouping_off_cuda_is_build_side(device_type):
    """Off CUDA (and for tensors without data) the tensor operations build the grouping."""
    rows = torch.tensor([3, -1, 0, 3, 9, 1], device=device_type)
    others = torch.tensor([1, 2, 7, 0, 1, -4], device=device_type)
    packed, offsets = attention_ops.build_grouping(rows, others, 5, 4)
    if device_type == "cpu":
        want = build_side(rows, others, 5, 4)
        assert torch.equal(packed, want) and torch.equal(offsets, group_offsets(want, 5))
    assert packed.shape == (12,) and offsets.shape == (6,)
    got = attention_ops.build_grouping(rows, others, 5, 4, both=True)
    assert [t.shape for t in got] == [(12,), (6,), (12,), (5,)]
    if device_type == "cpu":
        want = build_side(others, rows, 4, 5)
        assert torch.equal(got[0], packed) and torch.equal(got[2], want)
        assert torch.equal(got[3], group_offsets(want, 4))
