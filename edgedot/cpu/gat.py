"""CPU implementation of GAT and GATv2 attention: the chunked segment softmax of
:mod:`edgedot.cpu.attention` with their scores, so extra memory stays bounded whatever E is and every sum
is in edge order (deterministic). The backward recomputes the scores from the saved log-sum-exp.
"""

import torch
import torch.nn.functional as F

from .attention import RowSums, _gather, acc_dtype, softmax_forward, softmax_grads


def _leaky_relu(z, slope):
    # z > 0 ? z : slope * z, as the kernels write it (NaN stays NaN), in one pass.
    return F.leaky_relu(z, slope)


def _slope_grad(grad, z, slope):
    """``grad * leaky_relu'(z)``, the derivative taken as ``slope`` at 0 (z > 0 ? grad : grad *
    slope, in one pass)."""
    return torch.ops.aten.leaky_relu_backward(grad, z, slope, False)


def _values(x, acc):
    def values(start, stop, src):
        return _gather(x, src, acc)
    return values


def _gat_score(a_src, a_dst, a_edge, slope, acc):
    """Chunk scores ``leaky_relu(a_src[s] + a_dst[n] + a_edge[e])`` and ``z``, their argument."""
    def score(start, stop, src, dst):
        z = _gather(a_src, src, acc) + _gather(a_dst, dst, acc)
        if a_edge is not None:
            z = z + a_edge[start:stop].to(acc)
        return _leaky_relu(z, slope), z
    return score


def _gatv2_score(x_src, x_dst, att, edge_feat, slope, acc):
    """Chunk scores ``<att, leaky_relu(m)>`` and ``(m, leaky_relu(m))``, ``m = x_src[s] + x_dst[n]
    + edge_feat[e]``."""
    att = att.to(acc).contiguous()  # its layout would steer the order of the sum over channels

    def score(start, stop, src, dst):
        m = _gather(x_src, src, acc).add_(_gather(x_dst, dst, acc))
        if edge_feat is not None:
            m += edge_feat[start:stop].to(acc)
        act = _leaky_relu(m, slope)
        return (act * att).sum(-1), (m, act)
    return score


def _scores_only(score):
    return lambda start, stop, src, dst: score(start, stop, src, dst)[0]


def gat_forward(x, a_src, a_dst, a_edge, src_idx, dst_idx, negative_slope, dropout_p, key, return_attention):
    """Returns ``(out [Nd, H, C] in x's dtype, lse [Nd, H] in the accumulation dtype, alpha [E, H]
    in x's dtype or an empty ``[0]`` tensor)``; ``key`` is the dropout mask's
    (:func:`edgedot.runtime.dropout.key`)."""
    acc = acc_dtype(x.dtype)
    score = _gat_score(a_src, a_dst, a_edge, negative_slope, acc)
    return softmax_forward(_scores_only(score), _values(x, acc), src_idx, dst_idx,
                           (a_dst.shape[0], x.shape[1], x.shape[2]), x.shape[2], dropout_p, key, return_attention,
                           x.dtype)


def gatv2_forward(x_src, x_dst, att, edge_feat, src_idx, dst_idx, negative_slope, dropout_p, key,
                  return_attention):
    """Returns ``(out [Nd, H, C], lse [Nd, H], alpha [E, H] or empty)`` as :func:`gat_forward`."""
    acc = acc_dtype(x_src.dtype)
    score = _gatv2_score(x_src, x_dst, att, edge_feat, negative_slope, acc)
    return softmax_forward(_scores_only(score), _values(x_src, acc), src_idx, dst_idx, tuple(x_dst.shape),
                           x_src.shape[2], dropout_p, key, return_attention, x_src.dtype)


def _empty(like):
    return like.new_empty((0,))


def gat_backward(grad_out, x, a_src, a_dst, a_edge, out, lse, src_idx, dst_idx, negative_slope, dropout_p, key,
                 a_edge_grad, src_grad):
    """Returns ``(dx, da_src, da_dst, da_edge)`` in x's dtype; ``dx`` and ``da_src`` are empty
    ``[0]`` tensors unless ``src_grad``, ``da_edge`` unless ``a_edge_grad``."""
    acc = acc_dtype(x.dtype)
    num_src, heads, dim = x.shape
    dx = torch.zeros((num_src, heads, dim), dtype=acc) if src_grad else None
    da_src = torch.zeros((num_src, heads), dtype=acc) if src_grad else None
    da_dst = torch.zeros((a_dst.shape[0], heads), dtype=acc)
    da_edge = x.new_empty((src_idx.shape[0], heads) if a_edge_grad else (0,))
    score = _gat_score(a_src, a_dst, a_edge, negative_slope, acc)
    for start, stop, src, dst, ds, _, kept, grads, z in softmax_grads(
            grad_out, out, lse.to(acc), score, _values(x, acc), src_idx, dst_idx, dim, dropout_p, key):
        dz = _slope_grad(ds, z, negative_slope)
        RowSums(dst).add(da_dst, dz)
        if src_grad:
            to_src = RowSums(src)
            to_src.add(da_src, dz)
            to_src.add(dx, kept[..., None] * grads)
        if a_edge_grad:
            da_edge[start:stop] = dz
    if not src_grad:
        return _empty(x), _empty(x), da_dst.to(x.dtype), da_edge
    return dx.to(x.dtype), da_src.to(x.dtype), da_dst.to(x.dtype), da_edge


def gatv2_backward(grad_out, x_src, x_dst, att, edge_feat, out, lse, src_idx, dst_idx, negative_slope, dropout_p,
                   key, edge_feat_grad, src_grad):
    """Returns ``(dx_src, dx_dst, datt, d_edge_feat)`` in the inputs' dtype; ``dx_src`` is an
    empty ``[0]`` tensor unless ``src_grad``, ``d_edge_feat`` unless ``edge_feat_grad``."""
    dtype = x_src.dtype
    acc = acc_dtype(dtype)
    num_src, heads, dim = x_src.shape
    att_acc = att.to(acc).contiguous()
    dx_src = torch.zeros((num_src, heads, dim), dtype=acc) if src_grad else None
    dx_dst = torch.zeros(x_dst.shape, dtype=acc)
    datt = torch.zeros((heads, dim), dtype=acc)
    d_edge_feat = x_src.new_empty((src_idx.shape[0], heads, dim) if edge_feat_grad else (0,))
    score = _gatv2_score(x_src, x_dst, att, edge_feat, negative_slope, acc)
    for start, stop, src, dst, ds, dead, kept, grads, (m, act) in softmax_grads(
            grad_out, out, lse.to(acc), score, _values(x_src, acc), src_idx, dst_idx, dim, dropout_p, key):
        if dead.any():
            act = act.masked_fill(dead[..., None], 0)  # ds is 0 there; 0 * an infinite m would be NaN
        dm = _slope_grad(ds[..., None] * att_acc, m, negative_slope)
        # Summed per chunk, chunks in order: deterministic.
        datt += (ds[..., None] * act).sum(0)
        RowSums(dst).add(dx_dst, dm)
        if src_grad:
            RowSums(src).add(dx_src, kept[..., None] * grads + dm)
        if edge_feat_grad:
            d_edge_feat[start:stop] = dm
    dx_src = dx_src.to(dtype) if src_grad else _empty(x_src)
    return dx_src, dx_dst.to(dtype), datt.to(dtype), d_edge_feat
