"""Forward pass of edgedot.edge_dot against the float64 reference (tolerance rule in utils)."""


import pytest
import torch

import edgedot
from utils import (DEVICES, FEAT_DTYPES, INDEX_DTYPES, assert_accurate, check_forward, dtype_id,
                   fill_cuda_cache_with_nan, gen, rand_feat, rand_index, reference, reference64,
                   requires_cuda, skewed_index)

DIMS = [1, 3, 33, 128, 129, 1000]
EDGES = [0, 1, 37, 4096]


def num_nodes(kind, dim, device):
    """(num_src, num_dst): 'small' has many edges per row, 'large' many rows (bounded memory)."""
    if kind == "small":
        return 3, 5
    budget = 500_000 if device == "cpu" else 16_000_000
    n = max(64, min(100_000, budget // dim))
    return n, n + 17


@pytest.mark.parametrize("nodes", ["small", "large"])
@pytest.mark.parametrize("num_edges", EDGES)
@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("dtype", FEAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("device", DEVICES)
def test_forward_matrix(device, dtype, index_dtype, dim, num_edges, nodes):
    g = gen(dim * 100_003 + num_edges * 11 + (nodes == "large"))  # the same inputs in every process
    num_src, num_dst = num_nodes(nodes, dim, device)
    src = rand_feat((num_src, dim), dtype, device, g)
    dst = rand_feat((num_dst, dim), dtype, device, g)
    src_idx = rand_index(num_src, num_edges, index_dtype, device, g)
    dst_idx = rand_index(num_dst, num_edges, index_dtype, device, g)
    out = check_forward(src, dst, src_idx, dst_idx)
    assert out.shape == (num_edges,)


# (src shape after N, dst shape after N, expected output shape after E)
HEAD_CASES = {
    "HD_x_HD": ((4, 16), (4, 16), (4,)),
    "1D_x_HD": ((1, 16), (4, 16), (4,)),
    "HD_x_1D": ((4, 16), (1, 16), (4,)),
    "HD_x_D": ((4, 16), (16,), (4,)),
    "D_x_HD": ((16,), (4, 16), (4,)),
    "1D_x_1D": ((1, 16), (1, 16), (1,)),
    "D_x_1D": ((16,), (1, 16), (1,)),
    "H8_D33": ((8, 33), (8, 33), (8,)),
    "1D_x_H3_D129": ((1, 129), (3, 129), (3,)),
}


@pytest.mark.parametrize("case", list(HEAD_CASES))
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("dtype", FEAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("device", DEVICES)
def test_forward_heads(device, dtype, index_dtype, case):
    src_shape, dst_shape, out_shape = HEAD_CASES[case]
    g = gen(1)
    num_src, num_dst, num_edges = 50, 70, 300
    src = rand_feat((num_src, *src_shape), dtype, device, g)
    dst = rand_feat((num_dst, *dst_shape), dtype, device, g)
    src_idx = rand_index(num_src, num_edges, index_dtype, device, g)
    dst_idx = rand_index(num_dst, num_edges, index_dtype, device, g)
    out = check_forward(src, dst, src_idx, dst_idx)
    assert out.shape == (num_edges, *out_shape)
    # Each head is an independent [N, D] problem: compare head by head with the 2-D path.
    s3 = src if src.dim() == 3 else src.unsqueeze(1)
    d3 = dst if dst.dim() == 3 else dst.unsqueeze(1)
    for h in range(out_shape[0]):
        s_h = s3[:, h if s3.shape[1] > 1 else 0]
        d_h = d3[:, h if d3.shape[1] > 1 else 0]
        assert_accurate(out[:, h].contiguous(), reference(s_h, d_h, src_idx, dst_idx),
                        reference64(s_h, d_h, src_idx, dst_idx), dtype, what=f"head {h}")


@pytest.mark.parametrize("dtype", FEAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["2d", "heads", "broadcast"])
def test_forward_empty(device, dtype, case):
    src = rand_feat((4, 3, 8) if case != "2d" else (4, 8), dtype, device)
    dst = rand_feat((6, 3, 8) if case == "heads" else (6, 8), dtype, device)
    for index_dtype in INDEX_DTYPES:
        idx = torch.empty(0, dtype=index_dtype, device=device)
        out = edgedot.edge_dot(src, dst, idx, idx)
        assert out.shape == ((0,) if case == "2d" else (0, 3))
        assert out.dtype == dtype
        assert out.device.type == torch.device(device).type


def _strided_cases(device, dtype, g):
    """(name, src_feat, dst_feat, src_idx, dst_idx), all with some non-contiguous argument."""
    num_src, num_dst, dim, num_edges = 40, 30, 33, 500
    big_s = rand_feat((num_src, 2 * dim + 5), dtype, device, g)
    big_d = rand_feat((num_dst, 2 * dim + 5), dtype, device, g)
    s_idx = rand_index(num_src, 2 * num_edges, torch.int64, device, g)
    d_idx = rand_index(num_dst, 2 * num_edges, torch.int64, device, g)
    src = rand_feat((num_src, dim), dtype, device, g)
    dst = rand_feat((num_dst, dim), dtype, device, g)
    e_s, e_d = s_idx[:num_edges], d_idx[:num_edges]
    edge_index = torch.stack([e_s, e_d])  # [2, E]: rows are contiguous views
    edge_index_t = torch.stack([e_s, e_d], dim=1)  # [E, 2]: columns have stride 2
    heads_s = rand_feat((4, num_src, dim), dtype, device, g).transpose(0, 1)  # [N, H, D], strided
    heads_d = rand_feat((num_dst, 4, 2 * dim), dtype, device, g)[..., ::2]
    return [
        ("step_slice_last_dim", big_s[:, ::2][:, :dim], big_d[:, 1::2][:, :dim], e_s, e_d),
        ("prefix_slice_row_stride", big_s[:, :dim], big_d[:, 3:3 + dim], e_s, e_d),
        ("column_major", src.t().contiguous().t(), dst.t().contiguous().t(), e_s, e_d),
        ("row_slice_offset", big_s[5:, :dim], big_d[2:, :dim],
         e_s.clamp(max=num_src - 6), e_d.clamp(max=num_dst - 3)),
        ("expanded_rows", src[:1].expand(num_src, dim), dst, e_s, e_d),
        ("strided_index", src, dst, s_idx[::2], d_idx[1::2]),
        ("edge_index_rows", src, dst, edge_index[0], edge_index[1]),
        ("edge_index_columns", src, dst, edge_index_t[:, 0], edge_index_t[:, 1]),
        ("int32_strided_index", src, dst, s_idx.int()[::2], d_idx.int()[::2]),
        ("heads_transposed", heads_s, heads_d, e_s, e_d),
        ("heads_broadcast_strided", big_s[:, None, :dim], heads_d, e_s, e_d),
    ]


@pytest.mark.parametrize("dtype", FEAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("device", DEVICES)
def test_forward_non_contiguous(device, dtype):
    cases = _strided_cases(device, dtype, gen(2))
    assert any(not c[1].is_contiguous() for c in cases)
    for name, src, dst, src_idx, dst_idx in cases:
        before = [t.clone() for t in (src, dst, src_idx, dst_idx)]
        out = edgedot.edge_dot(src, dst, src_idx, dst_idx)
        expect = edgedot.edge_dot(src.contiguous(), dst.contiguous(), src_idx.contiguous(),
                                  dst_idx.contiguous())
        try:
            assert_accurate(out, reference(src, dst, src_idx, dst_idx),
                            reference64(src, dst, src_idx, dst_idx), dtype)
            # A strided view must give the same numbers as its contiguous copy.
            torch.testing.assert_close(out, expect, rtol=1e-6 if dtype == torch.float32 else None,
                                       atol=1e-6 if dtype == torch.float32 else None)
        except AssertionError as e:
            raise AssertionError(f"case {name}: {e}") from None
        for b, t in zip(before, (src, dst, src_idx, dst_idx)):
            assert torch.equal(b, t), f"case {name}: an input was modified"


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("dtype", FEAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("device", DEVICES)
def test_forward_skewed_graph(device, dtype, index_dtype):
    g = gen(3)
    big = device == "cuda"
    num_src, num_dst = (20_000, 15_000) if big else (2_000, 1_500)
    num_edges = 1 << 20 if big else 20_000
    dim = 64
    src = rand_feat((num_src, dim), dtype, device, g)
    dst = rand_feat((num_dst, 2, dim), dtype, device, g)
    hot = {7: num_edges // 4, 11: 3 * 256 + 1}
    src_idx = skewed_index(num_src, num_edges, index_dtype, device, g, hot=hot)
    dst_idx = skewed_index(num_dst, num_edges, index_dtype, device, g)
    assert torch.bincount(src_idx.long()).max() >= num_edges // 4
    check_forward(src, dst, src_idx, dst_idx)


@pytest.mark.parametrize("device", DEVICES)
def test_forward_repeatable_and_options_agree(device):
    """Forward is run-to-run bitwise identical; deterministic/check_indices/plan don't change it."""
    g = gen(4)
    src, dst = rand_feat((300, 4, 40), torch.float32, device, g), rand_feat((200, 40), torch.float32, device, g)
    src_idx = skewed_index(300, 5000, torch.int64, device, g, hot={3: 1000})
    dst_idx = rand_index(200, 5000, torch.int32, device, g)
    first = edgedot.edge_dot(src, dst, src_idx, dst_idx)
    plan = edgedot.EdgePlan(src_idx, dst_idx, 300, 200)
    for kwargs in [{}, {"deterministic": True}, {"deterministic": False}, {"check_indices": False},
                   {"plan": plan}, {"plan": plan, "deterministic": True}]:
        again = edgedot.edge_dot(src, dst, src_idx, dst_idx, **kwargs)
        assert torch.equal(first, again), kwargs
    check_forward(src, dst, src_idx, dst_idx)


@pytest.mark.parametrize("device", DEVICES)
def test_forward_no_grad_and_output_is_fresh(device):
    g = gen(5)
    src = rand_feat((10, 8), torch.float32, device, g, requires_grad=True)
    dst = rand_feat((12, 8), torch.float32, device, g, requires_grad=True)
    idx_s, idx_d = rand_index(10, 20, device=device, g=g), rand_index(12, 20, device=device, g=g)
    with torch.no_grad():
        out = edgedot.edge_dot(src, dst, idx_s, idx_d)
    assert not out.requires_grad
    out2 = edgedot.edge_dot(src, dst, idx_s, idx_d)
    assert out2.requires_grad
    assert out.data_ptr() != out2.data_ptr()
    out.fill_(123.0)  # writing to one output must not affect inputs or other outputs
    torch.testing.assert_close(out2.detach(), reference(src, dst, idx_s, idx_d).detach())


def test_reference_mixed_2d_and_3d():
    """edge_dot_reference documents that a 2-D side broadcasts like [N, 1, D]."""
    g = gen(6)
    src, dst = rand_feat((5, 4, 8), g=g), rand_feat((6, 8), g=g)
    for num_edges in (4, 7):  # E == H is the silent case, E != H the crashing one
        s, d = rand_index(5, num_edges, g=g), rand_index(6, num_edges, g=g)
        expect = (src[s] * dst[d].unsqueeze(1)).sum(-1)
        torch.testing.assert_close(edgedot.edge_dot_reference(src, dst, s, d), expect)
        torch.testing.assert_close(edgedot.edge_dot_reference(dst, src, d, s), expect)


# ----------------------------------------------------------------------------------- CUDA only


@requires_cuda
@pytest.mark.parametrize("dtype", FEAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", ["2d", "heads", "broadcast", "empty_rows"])
def test_cuda_output_fully_written(dtype, case):
    """With the caching allocator full of NaN, every output element must still be written."""
    g = gen(7)
    num_edges = 100_003
    src = rand_feat((3000, *((4, 72) if case != "2d" else (72,))), dtype, "cuda", g)
    dst = rand_feat((2000, *((4, 72) if case == "heads" else (72,))), dtype, "cuda", g)
    src_idx = rand_index(3000 if case != "empty_rows" else 10, num_edges, torch.int32, "cuda", g)
    dst_idx = rand_index(2000, num_edges, torch.int64, "cuda", g)
    for _ in range(2):
        fill_cuda_cache_with_nan()
        out = edgedot.edge_dot(src, dst, src_idx, dst_idx)
        torch.cuda.synchronize()
        assert not torch.isnan(out).any()
        assert_accurate(out, reference(src, dst, src_idx, dst_idx),
                        reference64(src, dst, src_idx, dst_idx), dtype)


@requires_cuda
@pytest.mark.parametrize("dtype", FEAT_DTYPES, ids=dtype_id)
@pytest.mark.gpu_memory_heavy
@pytest.mark.parametrize("dim", [1, 64, 128, 256, 1000, 4096])
def test_cuda_large(dtype, dim):
    g = gen(8)
    num_edges = min(1 << 21, (1 << 28) // dim)
    num_src, num_dst = min(200_000, (1 << 27) // dim), min(150_000, (1 << 27) // dim)
    src = rand_feat((num_src, dim), dtype, "cuda", g)
    dst = rand_feat((num_dst, dim), dtype, "cuda", g)
    src_idx = rand_index(num_src, num_edges, torch.int64, "cuda", g)
    dst_idx = skewed_index(num_dst, num_edges, torch.int32, "cuda", g)
    check_forward(src, dst, src_idx, dst_idx)


@requires_cuda
@pytest.mark.parametrize("order", ["shuffled", "sorted"])
@pytest.mark.parametrize("dim, heads", [(2, 1), (16, 1), (33, 3), (64, 1), (64, 2), (200, 1)])
@pytest.mark.parametrize("dtype", FEAT_DTYPES, ids=dtype_id)
def test_cuda_tiles_of_items(dtype, dim, heads, order):
    """Enough (edge, head) items for every warp to take tiles of 32 of them, the last tile cut
    short, with groups of 1 to 16 lanes per item (dim) and items of several heads."""
    g = gen(dim * 7 + heads)
    num_edges = 150_001
    src = rand_feat((6000, heads, dim), dtype, "cuda", g)
    dst = rand_feat((5000, heads, dim), dtype, "cuda", g)
    src_idx = rand_index(6000, num_edges, torch.int64, "cuda", g)
    dst_idx = rand_index(5000, num_edges, torch.int32, "cuda", g)
    if order == "sorted":
        src_idx = torch.sort(src_idx).values
    fill_cuda_cache_with_nan()
    out = check_forward(src, dst, src_idx, dst_idx)
    assert out.shape == (num_edges, heads)


@requires_cuda
def test_cuda_side_stream():
    """Work issued on a side stream is ordered on that stream (no use of the default stream)."""
    g = gen(9)
    src, dst = rand_feat((5000, 128), device="cuda", g=g), rand_feat((4000, 128), device="cuda", g=g)
    src_idx = rand_index(5000, 1 << 20, device="cuda", g=g)
    dst_idx = rand_index(4000, 1 << 20, device="cuda", g=g)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(10_000_000)  # keeps the side stream busy: a kernel racing it reads early
        scaled = src * 2
        out = edgedot.edge_dot(scaled, dst, src_idx, dst_idx)
    torch.cuda.current_stream().wait_stream(stream)
    assert_accurate(out, reference(2 * src, dst, src_idx, dst_idx),
                    reference64(2 * src, dst, src_idx, dst_idx), torch.float32)
