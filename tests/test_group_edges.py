"""The extension's ``group_edges`` (one radix sort and one kernel) against the tensor operations
of ``edgedot.runtime.plan.build_side`` and ``group_offsets``, bit for bit, and graph attention with the
grouping it builds against the EdgePlan's. The kernel tests need a GPU."""

import pytest
import torch

import edgedot
from edgedot.ops import attention as attention_ops
from edgedot.runtime.build import cuda_module
from edgedot.runtime.plan import build_side, group_offsets
from utils import INDEX_DTYPES, dtype_id, fill_cuda_cache_with_nan, gen, rand_feat, requires_cuda

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


@requires_cuda
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("num_rows", [1, 7, 1000, 200000])
@pytest.mark.parametrize("num_edges", [0, 1, 5, 100003])
@pytest.mark.parametrize("dtype", INDEX_DTYPES, ids=dtype_id)
def test_matches_build_side(dtype, num_edges, num_rows, pattern):
    g = gen(num_edges * 7 + num_rows + PATTERNS.index(pattern))
    row_idx, other_idx = _indices(pattern, num_edges, num_rows, dtype, g)
    _check(row_idx, other_idx, num_rows, NUM_OTHER)


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
