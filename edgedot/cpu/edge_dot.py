"""CPU implementation: chunks of edges, so extra memory stays bounded whatever E is."""

import torch

from ..runtime.checks import heads_of

# Elements of one gathered chunk ([chunk, H, D]); bounds the extra memory to a few MB. 2 MB of
# float32 a chunk ran faster than 4 MB on 2 cores: forward + grad of 16,384 edges of 128 floats
# 3.6 + 3.1 ms at 4 MB, 1.3 + 1.4 at 2 MB (with the products in place); 20,000 of 1,000 floats
# 19 + 20 against 12 + 14 (NOTES.md, 2026-12-04).
CHUNK_ELEMENTS = 1 << 19


def _acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _as_3d(feat):
    return feat.unsqueeze(1) if feat.dim() == 2 else feat


def _times(fresh, other):
    """``fresh * other`` for ``[n, heads, ...]`` tensors, in place in ``fresh`` (a tensor of the
    caller's own) where it has the product's heads, which spares a chunk-sized allocation."""
    return fresh.mul_(other) if fresh.shape[1] >= other.shape[1] else fresh * other


def _edge_chunks(num_edges, heads, dim):
    step = max(1, CHUNK_ELEMENTS // max(1, heads * dim))
    for start in range(0, num_edges, step):
        yield start, min(start + step, num_edges)


def forward(src_feat, dst_feat, src_idx, dst_idx, out_shape):
    """out[e, h] = <src_feat[src_idx[e], h], dst_feat[dst_idx[e], h]>, accumulated in float32 or wider."""
    acc = _acc_dtype(src_feat.dtype)
    src, dst = _as_3d(src_feat), _as_3d(dst_feat)
    heads = max(src.shape[1], dst.shape[1])
    out = torch.empty((src_idx.shape[0], heads), dtype=src_feat.dtype)
    for start, stop in _edge_chunks(src_idx.shape[0], heads, src.shape[2]):
        s = src.index_select(0, src_idx[start:stop]).to(acc)
        d = dst.index_select(0, dst_idx[start:stop]).to(acc)
        wide, narrow = (s, d) if s.shape[1] >= d.shape[1] else (d, s)  # (one side may have one head)
        out[start:stop] = _times(wide, narrow).sum(-1).to(out.dtype)
    return out.reshape(out_shape)


def grad_rows(grad_out, row_feat, other_feat, row_idx, other_idx):
    """Gradient of the output with respect to ``row_feat`` (the side indexed by ``row_idx``)."""
    acc = _acc_dtype(row_feat.dtype)
    other = _as_3d(other_feat)
    row_heads = heads_of(row_feat)
    heads = max(row_heads, other.shape[1])
    grad = grad_out.reshape(-1, heads)
    result = torch.zeros((row_feat.shape[0], row_heads, row_feat.shape[-1]), dtype=acc)
    for start, stop in _edge_chunks(row_idx.shape[0], heads, other.shape[2]):
        contrib = _times(other.index_select(0, other_idx[start:stop]).to(acc), grad[start:stop, :, None].to(acc))
        if row_heads == 1 and heads > 1:
            contrib = contrib.sum(1, keepdim=True)
        result.index_add_(0, row_idx[start:stop], contrib)
    return result.to(row_feat.dtype).reshape(row_feat.shape)
