"""CPU implementation of graph attention: chunks of edges, so extra memory stays bounded whatever
E is, and every sum is an in-order ``index_add_`` (deterministic).

Forward in two passes over the edges: the maximum score of each (destination, head), then the
sum of ``exp(score - max)`` and the weighted values. The backward recomputes the scores from the
saved log-sum-exp (FlashAttention's recomputation), so nothing of ``E x H`` is kept between
passes.
"""

import torch

from ..runtime import dropout

# Elements of one gathered chunk ([chunk, H, D]); a pass holds a few such chunks at once.
CHUNK_ELEMENTS = 1 << 18
# Scores ([E, H]) the forward keeps from its first pass for its second, rather than computing them
# again, up to this many elements (the chunks bound the memory of larger graphs).
KEPT_SCORE_ELEMENTS = 1 << 25

def acc_dtype(dtype):
    """The accumulation dtype: float64 for float64, float32 for everything else."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunks(num_edges, heads, dim):
    step = max(1, CHUNK_ELEMENTS // max(1, heads * dim))
    for start in range(0, num_edges, step):
        yield start, min(start + step, num_edges)


def _rows(idx, start, stop):
    # index_add_ adds int32-indexed rows in a serial loop, in edge order; with int64 it takes a
    # multi-threaded scatter path that measured 3x slower on one thread and up to 100x slower
    # on busy cores. Rows fit in int32 (checked by the caller).
    return idx[start:stop].to(torch.int32)


def keep_mask(key, start, stop, heads, p, device):
    """The dropout mask of edges ``start..stop`` (bool ``[stop - start, heads]``) under the key
    of a call (:func:`edgedot.runtime.dropout.key`): head ``h`` of edge ``e`` is element ``e * heads + h``."""
    return dropout.keep_mask(key, start * heads, (stop - start) * heads, p, device).reshape(stop - start, heads)


def _kept(alpha, key, start, stop, p):
    """``alpha * keep / (1 - p)`` for the chunk: dropout without renormalisation."""
    if p == 0:
        return alpha
    if p >= 1:
        return torch.zeros_like(alpha)
    return alpha * keep_mask(key, start, stop, alpha.shape[1], p, alpha.device) / (1 - p)


def _gather(table, idx, acc):
    return table.index_select(0, idx).to(acc)


def _keys(k, edge_feat, src, start, stop, acc):
    keys = _gather(k, src, acc)
    return keys if edge_feat is None else keys + edge_feat[start:stop].to(acc)


def softmax_forward(score, values, src_idx, dst_idx, out_shape, width, dropout_p, key, return_attention, dtype):
    """The softmax over each destination's incoming edges and the weighted sum of values, in
    chunks of edges: ``score(start, stop, src, dst)`` gives the chunk's ``[stop - start, H]``
    scores and ``values(start, stop, src)`` its ``[stop - start, H, dim_v]`` values, both in the
    accumulation dtype (``src``, ``dst``: the chunk's int32 rows); ``width`` sizes the chunks (the
    widest per-edge rows the callbacks gather). Returns ``(out [num_dst, H, dim_v] = out_shape in
    dtype, lse [num_dst, H] in the accumulation dtype, alpha [E, H] in dtype or an empty ``[0]``
    tensor)``."""
    acc = acc_dtype(dtype)
    num_dst, heads, dim_v = out_shape
    num_edges = src_idx.shape[0]
    chunks = list(_chunks(num_edges, heads, width))

    def rows(start, stop):
        return _rows(src_idx, start, stop), _rows(dst_idx, start, stop)

    kept_scores = [] if num_edges * heads <= KEPT_SCORE_ELEMENTS else None
    top = torch.full((num_dst, heads), float("-inf"), dtype=acc)
    for start, stop in chunks:
        src, dst = rows(start, stop)
        scores = score(start, stop, src, dst)
        top.scatter_reduce_(0, dst.long()[:, None].expand(-1, heads), scores, "amax")
        if kept_scores is not None:
            kept_scores.append(scores)

    total = torch.zeros((num_dst, heads), dtype=acc)
    weighted = torch.zeros((num_dst, heads, dim_v), dtype=acc)
    alpha = torch.empty((num_edges, heads), dtype=acc) if return_attention else None
    for chunk, (start, stop) in enumerate(chunks):
        src, dst = rows(start, stop)
        scores = kept_scores[chunk] if kept_scores is not None else score(start, stop, src, dst)
        weight = torch.exp(scores - top.index_select(0, dst))
        total.index_add_(0, dst, weight)
        if alpha is not None:
            alpha[start:stop] = weight
        weighted.index_add_(0, dst, _kept(weight, key, start, stop, dropout_p)[..., None] * values(start, stop, src))

    # Nodes without incoming edges: total 0, lse = -inf + log(0) = -inf, output zeros. Nodes whose
    # every score is -inf or NaN: top -inf or NaN, so total, lse and output are NaN.
    lse = top + torch.log(total)
    divisor = torch.where(total > 0, total, torch.ones_like(total))
    out = (weighted / divisor[..., None]).to(dtype)
    if alpha is None:
        return out, lse, torch.empty((0,), dtype=dtype)
    for start, stop in chunks:
        alpha[start:stop] /= divisor.index_select(0, _rows(dst_idx, start, stop))
    return out, lse, alpha.to(dtype)


def softmax_grads(grad_out, out, lse, score, values, src_idx, dst_idx, width, dropout_p, key):
    """The backward of :func:`softmax_forward` up to the scores, recomputed from ``lse``: yields
    per chunk of edges ``(start, stop, src, dst, ds, dead, kept, grads, extra)`` with ``ds`` the
    gradient of the chunk's scores (0 on edges of weight exactly 0, which add nothing even where a
    value is infinite), ``dead`` those edges, ``kept`` the weights after dropout, ``grads`` =
    ``grad_out`` of each edge's destination; ``score(start, stop, src, dst)`` returns ``(scores,
    extra)``; ``width`` sizes the chunks as in :func:`softmax_forward`."""
    acc = lse.dtype
    dout = grad_out.to(acc)
    delta = (dout * out.to(acc)).sum(-1)
    for start, stop in _chunks(src_idx.shape[0], out.shape[1], width):
        src, dst = _rows(src_idx, start, stop), _rows(dst_idx, start, stop)
        scores, extra = score(start, stop, src, dst)
        alpha = torch.exp(scores - lse.index_select(0, dst))
        grads = dout.index_select(0, dst)
        dp = (grads * values(start, stop, src)).sum(-1)
        # d score = alpha * (dp * keep / (1 - p) - delta).
        ds = (_kept(dp, key, start, stop, dropout_p) - delta.index_select(0, dst)) * alpha
        dead = alpha == 0
        if dead.any():
            ds = ds.masked_fill(dead, 0)
        yield start, stop, src, dst, ds, dead, _kept(alpha, key, start, stop, dropout_p), grads, extra


def forward(q, k, v, edge_feat, src_idx, dst_idx, scale, dropout_p, key, return_attention):
    """``key``: the dropout mask's (:func:`edgedot.runtime.dropout.key`). Returns ``(out [Nd, H, Dv] in q's dtype, lse [Nd, H] in the accumulation dtype,
    alpha [E, H] in q's dtype or an empty ``[0]`` tensor)``."""
    acc = acc_dtype(q.dtype)
    num_dst, heads, dim = q.shape

    def score(start, stop, src, dst):
        return scale * (_gather(q, dst, acc) * _keys(k, edge_feat, src, start, stop, acc)).sum(-1)

    return softmax_forward(score, _values(v, edge_feat, acc), src_idx, dst_idx, (num_dst, heads, v.shape[-1]),
                           max(dim, v.shape[-1]), dropout_p, key, return_attention, q.dtype)


def _values(v, edge_feat, acc):
    def values(start, stop, src):
        gathered = _gather(v, src, acc)
        return gathered if edge_feat is None else gathered + edge_feat[start:stop].to(acc)
    return values


def backward(grad_out, q, k, v, edge_feat, out, lse, src_idx, dst_idx, scale, dropout_p, key, edge_feat_grad):
    """Returns ``(dq, dk, dv, d_edge_feat)`` in the inputs' dtype, ``d_edge_feat`` an empty
    ``[0]`` tensor unless ``edge_feat_grad``."""
    acc = acc_dtype(q.dtype)
    num_dst, heads, dim = q.shape
    num_src, dim_v = k.shape[0], v.shape[-1]
    num_edges = src_idx.shape[0]
    dq = torch.zeros((num_dst, heads, dim), dtype=acc)
    dk = torch.zeros((num_src, heads, dim), dtype=acc)
    dv = torch.zeros((num_src, heads, dim_v), dtype=acc)
    d_edge_feat = q.new_empty((num_edges, heads, dim) if edge_feat_grad else (0,))

    def score(start, stop, src, dst):
        queries, keys = _gather(q, dst, acc), _keys(k, edge_feat, src, start, stop, acc)
        return scale * (queries * keys).sum(-1), (queries, keys)

    for start, stop, src, dst, ds, dead, kept, grads, (queries, keys) in softmax_grads(
            grad_out, out, lse.to(acc), score, _values(v, edge_feat, acc), src_idx, dst_idx, max(dim, dim_v),
            dropout_p, key):
        ds = scale * ds
        if dead.any():
            keys = keys.masked_fill(dead[..., None], 0)  # 0 * an infinite key would be NaN
        dq.index_add_(0, dst, ds[..., None] * keys)
        d_keys = ds[..., None] * queries
        dk.index_add_(0, src, d_keys)
        d_values = kept[..., None] * grads
        dv.index_add_(0, src, d_values)
        if edge_feat_grad:
            d_edge_feat[start:stop] = d_keys + d_values
    return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype), d_edge_feat
