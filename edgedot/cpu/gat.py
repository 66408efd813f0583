"""CPU implementation of GAT and GATv2 attention: the chunked segment softmax of
:mod:`edgedot.cpu.attention` with their scores, so extra memory stays bounded whatever E is and every sum
is in edge order (deterministic). The backward recomputes the scores from the saved log-sum-exp;
a one-chunk problem keeps its per-edge tensors instead (:class:`GatEdges`, :class:`Gatv2Edges`).
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .attention import (EdgeSoftmax, RowSums, _gather, acc_dtype, edge_softmax, edge_softmax_grads, in_dtype,
                        one_pass, returned_alpha, softmax_forward, softmax_grads, weighted_sum)


def _leaky_relu(z, slope):
    # z > 0 ? z : slope * z, as the kernels write it (NaN stays NaN), in one pass.
    return F.leaky_relu(z, slope)


def _slope_grad(grad, z, slope, in_place=False):
    """``grad * leaky_relu'(z)``, the derivative taken as ``slope`` at 0 (z > 0 ? grad : grad *
    slope, in one pass); with ``in_place``, written over ``grad``."""
    if in_place:
        return torch.ops.aten.leaky_relu_backward.grad_input(grad, z, slope, False, grad_input=grad)
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
            z = z + in_dtype(a_edge[start:stop], acc)
        return _leaky_relu(z, slope), z
    return score


def _gatv2_score(x_src, x_dst, att, edge_feat, slope, acc):
    """Chunk scores ``<att, leaky_relu(m)>`` and ``(m, leaky_relu(m))``, ``m = x_src[s] + x_dst[n]
    + edge_feat[e]``."""
    att = in_dtype(att, acc).contiguous()  # its layout would steer the order of the sum over channels

    def score(start, stop, src, dst):
        m = _gather(x_src, src, acc).add_(_gather(x_dst, dst, acc))
        if edge_feat is not None:
            m += in_dtype(edge_feat[start:stop], acc)
        act = _leaky_relu(m, slope)
        return (act * att).sum(-1), (m, act)
    return score


def _scores_only(score):
    return lambda start, stop, src, dst: score(start, stop, src, dst)[0]


class GatEdges(NamedTuple):
    """What a one-chunk GAT forward keeps for its backward (accumulation dtype)."""
    softmax: EdgeSoftmax
    z: torch.Tensor  # [E, H]: the leaky ReLU's argument
    values: torch.Tensor  # [E, H, C]: x of each edge's source


class Gatv2Edges(NamedTuple):
    """What a one-chunk GATv2 forward keeps for its backward (accumulation dtype)."""
    softmax: EdgeSoftmax
    m: torch.Tensor  # [E, H, C]: x_src[s] + x_dst[n] + edge_feat[e]
    act: torch.Tensor  # leaky_relu(m)
    values: torch.Tensor  # x_src of each edge's source


def _gat_edges(x, a_src, a_dst, a_edge, src_idx, dst_idx, negative_slope, dropout_p, key):
    """The one-chunk GAT forward's ``(lse, GatEdges)``."""
    acc = acc_dtype(x.dtype)
    scores, z = _gat_score(a_src, a_dst, a_edge, negative_slope, acc)(0, src_idx.shape[0], src_idx, dst_idx)
    lse, softmax = edge_softmax(scores, src_idx, dst_idx, a_dst.shape[0], dropout_p, key)
    return lse, GatEdges(softmax, z, _gather(x, src_idx, acc))


def _gatv2_edges(x_src, x_dst, att, edge_feat, src_idx, dst_idx, negative_slope, dropout_p, key):
    """The one-chunk GATv2 forward's ``(lse, Gatv2Edges)``: the source rows gathered once, for
    the scores and as the values."""
    acc = acc_dtype(x_src.dtype)
    values = _gather(x_src, src_idx, acc)
    m = _gather(x_dst, dst_idx, acc).add_(values)
    if edge_feat is not None:
        m += in_dtype(edge_feat, acc)
    act = _leaky_relu(m, negative_slope)
    lse, softmax = edge_softmax((act * in_dtype(att, acc).contiguous()).sum(-1), src_idx, dst_idx, x_dst.shape[0],
                                dropout_p, key)
    return lse, Gatv2Edges(softmax, m, act, values)


def gat_forward(x, a_src, a_dst, a_edge, src_idx, dst_idx, negative_slope, dropout_p, key, return_attention):
    """Returns ``(out [Nd, H, C] in x's dtype, lse [Nd, H] in the accumulation dtype, alpha [E, H]
    in x's dtype or an empty ``[0]`` tensor, kept)``; ``key`` is the dropout mask's
    (:func:`edgedot.runtime.dropout.key`); ``kept`` the :class:`GatEdges` of a one-chunk problem,
    for :func:`gat_backward`, else None."""
    acc = acc_dtype(x.dtype)
    num_dst, heads, dim = a_dst.shape[0], x.shape[1], x.shape[2]
    if one_pass(src_idx.shape[0], heads, dim, x.dtype):
        lse, kept = _gat_edges(x, a_src, a_dst, a_edge, src_idx, dst_idx, negative_slope, dropout_p, key)
        out = weighted_sum(kept.softmax, kept.values, num_dst, x.dtype)
        return out, lse, returned_alpha(kept.softmax, x.dtype, return_attention), kept
    score = _gat_score(a_src, a_dst, a_edge, negative_slope, acc)
    return softmax_forward(_scores_only(score), _values(x, acc), src_idx, dst_idx, (num_dst, heads, dim), dim,
                           dropout_p, key, return_attention, x.dtype) + (None,)


def gatv2_forward(x_src, x_dst, att, edge_feat, src_idx, dst_idx, negative_slope, dropout_p, key,
                  return_attention):
    """Returns ``(out [Nd, H, C], lse [Nd, H], alpha [E, H] or empty, kept)`` as
    :func:`gat_forward`, ``kept`` a :class:`Gatv2Edges` or None."""
    acc = acc_dtype(x_src.dtype)
    if one_pass(src_idx.shape[0], x_src.shape[1], x_src.shape[2], x_src.dtype):
        lse, kept = _gatv2_edges(x_src, x_dst, att, edge_feat, src_idx, dst_idx, negative_slope, dropout_p, key)
        out = weighted_sum(kept.softmax, kept.values, x_dst.shape[0], x_src.dtype)
        return out, lse, returned_alpha(kept.softmax, x_src.dtype, return_attention), kept
    score = _gatv2_score(x_src, x_dst, att, edge_feat, negative_slope, acc)
    return softmax_forward(_scores_only(score), _values(x_src, acc), src_idx, dst_idx, tuple(x_dst.shape),
                           x_src.shape[2], dropout_p, key, return_attention, x_src.dtype) + (None,)


def _empty(like):
    return like.new_empty((0,))


def _add_gat_grads(dx, da_src, da_dst, to_dst, to_src, ds, z, dropped, grads, negative_slope):
    """Adds a chunk's terms of ``da_dst`` and (where ``dx`` is not None) ``dx`` and ``da_src``;
    returns the per-edge gradient of the logits."""
    dz = _slope_grad(ds, z, negative_slope)
    to_dst.add(da_dst, dz)
    if dx is not None:
        to_src.add(da_src, dz)
        to_src.add(dx, grads.mul_(dropped[..., None]))  # grads: the chunk's own rows, read once
    return dz


def gat_backward(grad_out, x, a_src, a_dst, a_edge, out, lse, src_idx, dst_idx, negative_slope, dropout_p, key,
                 a_edge_grad, src_grad, kept=None):
    """Returns ``(dx, da_src, da_dst, da_edge)`` in x's dtype; ``dx`` and ``da_src`` are empty
    ``[0]`` tensors unless ``src_grad``, ``da_edge`` unless ``a_edge_grad``; ``kept``: what
    :func:`gat_forward` kept, if anything (a one-chunk problem without it recomputes it)."""
    acc = acc_dtype(x.dtype)
    num_src, heads, dim = x.shape
    dx = torch.zeros((num_src, heads, dim), dtype=acc) if src_grad else None
    da_src = torch.zeros((num_src, heads), dtype=acc) if src_grad else None
    da_dst = torch.zeros((a_dst.shape[0], heads), dtype=acc)
    if kept is None and one_pass(src_idx.shape[0], heads, dim, x.dtype):
        kept = _gat_edges(x, a_src, a_dst, a_edge, src_idx, dst_idx, negative_slope, dropout_p, key)[1]
    if kept is not None:
        softmax = kept.softmax
        ds, _, grads = edge_softmax_grads(grad_out, out, softmax, kept.values)
        dz = _add_gat_grads(dx, da_src, da_dst, softmax.to_dst, RowSums(softmax.src), ds, kept.z, softmax.dropped,
                            grads, negative_slope)
        da_edge = in_dtype(dz, x.dtype) if a_edge_grad else x.new_empty((0,))
    else:
        da_edge = x.new_empty((src_idx.shape[0], heads) if a_edge_grad else (0,))
        score = _gat_score(a_src, a_dst, a_edge, negative_slope, acc)
        for start, stop, src, dst, ds, _, dropped, grads, z in softmax_grads(
                grad_out, out, in_dtype(lse, acc), score, _values(x, acc), src_idx, dst_idx, dim, dropout_p, key):
            dz = _add_gat_grads(dx, da_src, da_dst, RowSums(dst), RowSums(src), ds, z, dropped, grads,
                                negative_slope)
            if a_edge_grad:
                da_edge[start:stop] = dz
    if not src_grad:
        return _empty(x), _empty(x), in_dtype(da_dst, x.dtype), da_edge
    return in_dtype(dx, x.dtype), in_dtype(da_src, x.dtype), in_dtype(da_dst, x.dtype), da_edge


def _add_gatv2_grads(dx_src, dx_dst, datt, to_dst, to_src, ds, dead, m, act, att, dropped, grads, negative_slope):
    """Adds a chunk's terms of ``dx_dst``, ``datt`` and (where ``dx_src`` is not None)
    ``dx_src``; returns the per-edge gradient of ``m``."""
    # act and grads are the chunk's own rows, read by nothing after: their products are taken in
    # place (fresh allocations of per-edge rows cost page faults).
    ds = ds[..., None]
    if dead is not None:
        act.masked_fill_(dead[..., None], 0)  # ds is 0 there; 0 * an infinite m would be NaN
    dm = _slope_grad(ds * att, m, negative_slope, in_place=True)
    # Summed per chunk, chunks in order: deterministic.
    datt += act.mul_(ds).sum(0)
    to_dst.add(dx_dst, dm)
    if dx_src is not None:
        to_src.add(dx_src, grads.mul_(dropped[..., None]).add_(dm))
    return dm


def gatv2_backward(grad_out, x_src, x_dst, att, edge_feat, out, lse, src_idx, dst_idx, negative_slope, dropout_p,
                   key, edge_feat_grad, src_grad, kept=None):
    """Returns ``(dx_src, dx_dst, datt, d_edge_feat)`` in the inputs' dtype; ``dx_src`` is an
    empty ``[0]`` tensor unless ``src_grad``, ``d_edge_feat`` unless ``edge_feat_grad``;
    ``kept``: what :func:`gatv2_forward` kept, if anything (a one-chunk problem without it
    recomputes it)."""
    dtype = x_src.dtype
    acc = acc_dtype(dtype)
    num_src, heads, dim = x_src.shape
    att_acc = in_dtype(att, acc).contiguous()
    dx_src = torch.zeros((num_src, heads, dim), dtype=acc) if src_grad else None
    dx_dst = torch.zeros(x_dst.shape, dtype=acc)
    datt = torch.zeros((heads, dim), dtype=acc)
    if kept is None and one_pass(src_idx.shape[0], heads, dim, dtype):
        kept = _gatv2_edges(x_src, x_dst, att, edge_feat, src_idx, dst_idx, negative_slope, dropout_p, key)[1]
    if kept is not None:
        softmax = kept.softmax
        ds, dead, grads = edge_softmax_grads(grad_out, out, softmax, kept.values)
        dm = _add_gatv2_grads(dx_src, dx_dst, datt, softmax.to_dst, RowSums(softmax.src), ds, dead, kept.m, kept.act,
                              att_acc, softmax.dropped, grads, negative_slope)
        d_edge_feat = in_dtype(dm, dtype) if edge_feat_grad else x_src.new_empty((0,))
    else:
        d_edge_feat = x_src.new_empty((src_idx.shape[0], heads, dim) if edge_feat_grad else (0,))
        score = _gatv2_score(x_src, x_dst, att, edge_feat, negative_slope, acc)
        for start, stop, src, dst, ds, dead, dropped, grads, (m, act) in softmax_grads(
                grad_out, out, in_dtype(lse, acc), score, _values(x_src, acc), src_idx, dst_idx, dim, dropout_p,
                key):
            dm = _add_gatv2_grads(dx_src, dx_dst, datt, RowSums(dst), RowSums(src), ds, dead, m, act, att_acc, dropped,
                                  grads, negative_slope)
            if edge_feat_grad:
                d_edge_feat[start:stop] = dm
    dx_src = in_dtype(dx_src, dtype) if src_grad else _empty(x_src)
    return dx_src, in_dtype(dx_dst, dtype), in_dtype(datt, dtype), d_edge_feat
