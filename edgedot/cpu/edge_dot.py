"""CPU implementation: chunks of edges, so extra memory stays bounded whatever E is."""

import math

import torch

from ..runtime.checks import heads_of
from .attention import RowSums, _gather, acc_dtype, in_dtype

# Elements of one gathered chunk ([chunk, H, D]); bounds the extra memory to a few MB. 2 MB of
# float32 a chunk ran faster than 4 MB on 2 cores: forward + grad of 16,384 edges of 128 floats
# 3.6 + 3.1 ms at 4 MB, 1.3 + 1.4 at 2 MB (with the products in place); 20,000 of 1,000 floats
# 19 + 20 against 12 + 14 (NOTES.md, 2026-12-04).
CHUNK_ELEMENTS = 1 << 19


# grad_rows sums a side's rows with the attention paths' RowSums (cpu/attention.py): int64
# index_add_ (scatter_add_), a sparse product or flat views, each adding a row's terms in edge
# order. The recorded path (recorded_forward) leaves its sums to autograd: below this many
# elements it gathers by indexing, whose backward sums by index_put_, serially there and at half
# of index_add_'s fixed cost (2 cores, 200 edges of 16 floats: 12 against 24 µs). From this many
# (ATen's GRAIN_SIZE) index_put_ adds float32 in parallel by atomics, each run rounding its own
# way; there the recorded path gathers by index_select with an int64 index, whose backward runs
# index_add_ as scatter_add_ (by int32 it adds one row at a time: forward + backward on 100,000
# edges of 4 x 32 floats, 52.9 -> 24.3 ms on 2 cores). Every one of these sums gives the same bits.
PARALLEL_ACCUMULATE_ELEMENTS = 1 << 15


# Tables small beside their edges take every pair's product from one GEMM, the edges' entries then
# picked from it (:func:`all_pairs_pay`): pairs * (D + PAIR_ROW_COST) <= PAIRS_PER_EDGE * E * D,
# about two thirds of the break-even of forward + backward (2 cores, float32: the pairs' matrix
# costs about 35 products' time a pair, and the GEMM runs about 100 times as many products a
# second as the gathers; docs/performance.md, CPU). At most MAX_PAIRS pairs (the matrix, and the
# backward's matrix of gradients, are that large), and fewer edges than
# PARALLEL_ACCUMULATE_ELEMENTS (the backward sums by index_put_).
PAIR_ROW_COST = 32
PAIRS_PER_EDGE = 64
MAX_PAIRS = 1 << 22


def all_pairs_pay(src_feat, dst_feat, num_edges):
    """Whether a problem's forward takes :func:`pair_products`: tables ``[N, D]`` (no heads) whose
    every pair of rows costs less to multiply by one GEMM than the edges' rows cost to gather, and
    for half types small enough to widen whole. The shapes alone decide, so that the output's bits
    follow the problem, not the grad mode or the values; :func:`pairs_backward` decides the backward."""
    if src_feat.dim() != 2 or dst_feat.dim() != 2 or not 0 < num_edges < PARALLEL_ACCUMULATE_ELEMENTS:
        return False
    dim = src_feat.shape[1]
    pairs = src_feat.shape[0] * dst_feat.shape[0]
    if pairs > MAX_PAIRS or pairs * (dim + PAIR_ROW_COST) > PAIRS_PER_EDGE * num_edges * dim:
        return False
    return src_feat.dtype in (torch.float32, torch.float64) or src_feat.numel() + dst_feat.numel() <= CHUNK_ELEMENTS


def pairs_backward(src_feat, dst_feat):
    """Whether the gradients of an :func:`all_pairs_pay` problem take the pairs' GEMMs too: only for
    finite tables. Those GEMMs multiply every row by the gradients of all its pairs, zeros
    included, so an infinite or NaN row would make every row's gradient NaN, where only its edges'
    should be; such tables' gradients take the gathers' sums (:func:`grad_rows`)."""
    # A table's sum is finite only if every element is (one that overflows leaves the problem to
    # the gathers); 4 µs for two small tables, where isfinite(...).all() takes 17.
    acc = acc_dtype(src_feat.dtype)
    return math.isfinite(src_feat.detach().sum(dtype=acc).item()) \
        and math.isfinite(dst_feat.detach().sum(dtype=acc).item())


def _refuse_negative(*indices):
    # Indexing reads a negative index from the end: refused here (one past the rows it refuses itself).
    for idx in indices:
        if idx.numel() and idx.min().item() < 0:
            raise IndexError("negative index")


def pair_products(src_feat, dst_feat, src_idx, dst_idx):
    """:func:`forward` of an :func:`all_pairs_pay` problem, ``[E]``, as differentiable ATen ops
    (autograd records them, as :func:`recorded_forward`'s): the products of every pair of rows, one
    GEMM in the accumulation dtype (half types widened first), then each edge's entry by indexing,
    which refuses an index outside the table before reading it (an ``IndexError``) and keeps the
    indices for its backward (written in place before the backward, they make it raise). That
    backward sums the edges' gradients into the matrix of pairs by ``index_put_`` (serially, in
    edge order) and multiplies it by each table; :func:`grad_rows` does the same, for the same
    bits."""
    _refuse_negative(src_idx, dst_idx)
    dtype, acc = src_feat.dtype, acc_dtype(src_feat.dtype)
    # Contiguous tables: autograd's GEMMs for the gradients follow the tables' layout, and so would
    # their bits.
    pairs = in_dtype(src_feat, acc).contiguous().mm(in_dtype(dst_feat, acc).contiguous().t())
    return in_dtype(pairs[src_idx, dst_idx], dtype)


def _pair_grad(grad_out, row_feat, other_feat, row_idx, other_idx):
    """:func:`grad_rows` of an :func:`all_pairs_pay` problem: the edges' gradients summed into the
    ``[rows, other rows]`` matrix, times the other table (:func:`pair_products`' backward)."""
    _refuse_negative(row_idx, other_idx)
    acc = acc_dtype(row_feat.dtype)
    grads = torch.zeros((row_feat.shape[0], other_feat.shape[0]), dtype=acc)
    grads.index_put_((row_idx, other_idx), in_dtype(grad_out, acc), accumulate=True)
    return in_dtype(grads.mm(in_dtype(other_feat, acc).contiguous()), row_feat.dtype)


def _as_3d(feat):
    return feat.unsqueeze(1) if feat.dim() == 2 else feat


def _row_elements(feat):
    return feat.shape[-1] if feat.dim() == 2 else feat.shape[1] * feat.shape[2]


def _times(fresh, other):
    """``fresh * other`` for ``[n, heads, ...]`` tensors, in place in ``fresh`` (a tensor of the
    caller's own) where it has the product's heads, which spares a chunk-sized allocation."""
    return fresh.mul_(other) if fresh.shape[1] >= other.shape[1] else fresh * other


def _edge_chunks(num_edges, heads, dim):
    step = max(1, CHUNK_ELEMENTS // max(1, heads * dim))
    for start in range(0, num_edges, step):
        yield start, min(start + step, num_edges)


def one_chunk(num_edges, heads, dim):
    """Whether a problem's gathered rows fit one chunk."""
    return num_edges * heads * dim <= CHUNK_ELEMENTS


def forward(src_feat, dst_feat, src_idx, dst_idx, out_shape):
    """out[e, h] = <src_feat[src_idx[e], h], dst_feat[dst_idx[e], h]>, accumulated in float32 or wider."""
    if all_pairs_pay(src_feat, dst_feat, src_idx.shape[0]):
        return pair_products(src_feat, dst_feat, src_idx, dst_idx).view(out_shape)
    return gathered_forward(src_feat, dst_feat, src_idx, dst_idx, out_shape)


def gathered_forward(src_feat, dst_feat, src_idx, dst_idx, out_shape):
    """:func:`forward` of a problem that does not take :func:`pair_products`: the edges' rows
    gathered, a chunk of edges at a time."""
    acc = acc_dtype(src_feat.dtype)
    num_edges, dim = src_idx.shape[0], src_feat.shape[-1]
    heads = max(heads_of(src_feat), heads_of(dst_feat))
    if one_chunk(num_edges, heads, dim):  # no slices, no copy into out
        if src_feat.shape[1:] != dst_feat.shape[1:]:  # one side has one head
            src_feat, dst_feat = _as_3d(src_feat), _as_3d(dst_feat)
        s, d = _gather(src_feat, src_idx, acc), _gather(dst_feat, dst_idx, acc)
        wide, narrow = (s, d) if s.dim() == 2 or s.shape[1] >= d.shape[1] else (d, s)
        out = wide.mul_(narrow).sum(-1)
        return in_dtype(out, src_feat.dtype).view(out_shape)
    src, dst = _as_3d(src_feat), _as_3d(dst_feat)
    out = torch.empty((num_edges, heads), dtype=src_feat.dtype)
    for start, stop in _edge_chunks(num_edges, heads, dim):
        s = _gather(src, src_idx[start:stop], acc)
        d = _gather(dst, dst_idx[start:stop], acc)
        wide, narrow = (s, d) if s.shape[1] >= d.shape[1] else (d, s)  # (one side may have one head)
        out[start:stop] = _times(wide, narrow).sum(-1).to(out.dtype)
    return out.reshape(out_shape)


def recordable(src_feat, dst_feat, num_edges, heads):
    """Whether :func:`recorded_forward` serves a problem that does not take :func:`pair_products`:
    its gathered rows fit one chunk, and for half types its tables too (they are widened whole)."""
    if not one_chunk(num_edges, heads, src_feat.shape[-1]):
        return False
    return src_feat.dtype in (torch.float32, torch.float64) or src_feat.numel() + dst_feat.numel() <= CHUNK_ELEMENTS


def recorded_forward(src_feat, dst_feat, src_idx, dst_idx):
    """:func:`forward` of a :func:`recordable` problem as differentiable ATen ops, for autograd to
    record: its backward then runs as C++ nodes, with no Python, as eager PyTorch's does (a Python
    ``autograd.Function`` costs a small graph more than its arithmetic). Outputs and gradients
    have :func:`forward`'s and :func:`grad_rows`'s bits: the same products and sums, in the same
    dtype (half types' tables widened to float32 first, so that their gradients too are summed in
    float32 and rounded once), whose backward sums by ``index_put_`` (indexing's) or ``index_add_``
    (``index_select``'s) as :func:`grad_rows` does. Its gathers refuse an index outside the table
    before reading it (an ``IndexError``). The output has :func:`forward`'s shape."""
    dtype, acc = src_feat.dtype, acc_dtype(src_feat.dtype)
    if dtype != acc:
        src_feat, dst_feat = src_feat.to(acc), dst_feat.to(acc)
    if src_feat.shape[1:] != dst_feat.shape[1:]:
        src_feat, dst_feat = _as_3d(src_feat), _as_3d(dst_feat)
    serial = src_idx.shape[0] * max(_row_elements(src_feat), _row_elements(dst_feat)) < PARALLEL_ACCUMULATE_ELEMENTS
    out = (_recorded_gather(src_feat, src_idx, serial) * _recorded_gather(dst_feat, dst_idx, serial)).sum(-1)
    return in_dtype(out, dtype)


def _recorded_gather(feat, idx, serial):
    # Indexing's backward sums serially (index_add_'s fixed cost is twice its own on small sums),
    # in edge order as index_add_ does. Its rows keep a strided table's strides, and the sums'
    # order would change with them: only a contiguous table is indexed.
    if serial and feat.is_contiguous():
        _refuse_negative(idx)
        return feat[idx]
    return feat.index_select(0, in_dtype(idx, torch.int64))  # (its backward's index_add_: see above)


def grad_rows(grad_out, row_feat, other_feat, row_idx, other_idx):
    """Gradient of the output with respect to ``row_feat`` (the side indexed by ``row_idx``)."""
    if all_pairs_pay(row_feat, other_feat, row_idx.shape[0]) and pairs_backward(row_feat, other_feat):
        return _pair_grad(grad_out, row_feat, other_feat, row_idx, other_idx)
    acc = acc_dtype(row_feat.dtype)
    if row_feat.shape[1:] == other_feat.shape[1:] and one_chunk(row_idx.shape[0], 1, _row_elements(row_feat)):
        # One chunk, both sides alike: [E, D] or [E, H, D] as given.
        grad = grad_out.unsqueeze(-1)
        contrib = _gather(other_feat, other_idx, acc).mul_(in_dtype(grad, acc))
        result = torch.zeros(row_feat.shape, dtype=acc)
        RowSums(row_idx).add(result, contrib)
        return in_dtype(result, row_feat.dtype)
    other = _as_3d(other_feat)
    row_heads = heads_of(row_feat)
    heads = max(row_heads, other.shape[1])
    grad = grad_out.reshape(-1, heads)
    result = torch.zeros((row_feat.shape[0], row_heads, row_feat.shape[-1]), dtype=acc)
    for start, stop in _edge_chunks(row_idx.shape[0], heads, other.shape[2]):
        contrib = _times(_gather(other, other_idx[start:stop], acc), in_dtype(grad[start:stop, :, None], acc))
        if row_heads == 1 and heads > 1:
            contrib = contrib.sum(1, keepdim=True)
        RowSums(row_idx[start:stop]).add(result, contrib)
    return result.to(row_feat.dtype).reshape(row_feat.shape)
