"""CPU implementation of AGNN attention: the chunked segment softmax of :mod:`edgedot.cpu.attention`
with the cosine score ``beta[h] * <x_norm[n, h], x_norm[s, h]>``, so extra memory stays bounded
whatever E is and every sum is in edge order (deterministic). The backward recomputes the scores
from the saved log-sum-exp.
"""

import torch

from .attention import RowSums, _gather, acc_dtype, softmax_forward, softmax_grads


def _beta(beta, like, acc):
    """``beta`` as the kernels read it: rounded to the features' dtype, one value per head."""
    return beta.reshape(-1).to(like.dtype).to(acc).expand(like.shape[1])


def _score(x_norm, beta, acc):
    """Chunk scores ``beta * <x_norm[n], x_norm[s]>`` and ``(x_norm[n], x_norm[s], dot)``."""
    def score(start, stop, src, dst):
        rows_dst, rows_src = _gather(x_norm, dst, acc), _gather(x_norm, src, acc)
        dot = (rows_dst * rows_src).sum(-1)
        return beta * dot, (rows_dst, rows_src, dot)
    return score


def _values(x, acc):
    def values(start, stop, src):
        return _gather(x, src, acc)
    return values


def forward(x_norm, x, beta, src_idx, dst_idx, return_attention):
    """Returns ``(out [N, H, C] in x's dtype, lse [N, H] in the accumulation dtype, alpha [E, H]
    in x's dtype or an empty ``[0]`` tensor)``."""
    acc = acc_dtype(x.dtype)
    score = _score(x_norm, _beta(beta, x, acc), acc)
    return softmax_forward(lambda *rows: score(*rows)[0], _values(x, acc), src_idx, dst_idx, tuple(x.shape),
                           x.shape[2], 0.0, None, return_attention, x.dtype)


def backward(grad_out, x_norm, x, beta, out, lse, src_idx, dst_idx):
    """Returns ``(d_x_norm, dx)`` in x's dtype and ``d_beta`` ``[H]`` in the accumulation dtype."""
    acc = acc_dtype(x.dtype)
    heads = x.shape[1]
    beta = _beta(beta, x, acc)
    d_x_norm = torch.zeros(x_norm.shape, dtype=acc)
    dx = torch.zeros(x.shape, dtype=acc)
    d_beta = torch.zeros(heads, dtype=acc)
    for _, _, src, dst, ds, dead, kept, grads, (rows_dst, rows_src, dot) in softmax_grads(
            grad_out, out, lse.to(acc), _score(x_norm, beta, acc), _values(x, acc), src_idx, dst_idx, x.shape[2],
            0.0, None):
        d_beta += (ds * dot).sum(0)  # per chunk, chunks in order: deterministic
        d_dot = ds * beta
        if dead is not None:
            d_dot = d_dot.masked_fill(dead, 0)  # ds is 0 there; 0 * an infinite beta would be NaN
        # The chunk's rows are its own, read by nothing after: their products are taken in place.
        d_dot = d_dot[..., None]
        RowSums(dst).add(d_x_norm, rows_src.mul_(d_dot))
        to_src = RowSums(src)
        to_src.add(d_x_norm, rows_dst.mul_(d_dot))
        to_src.add(dx, grads.mul_(kept[..., None]))
    return d_x_norm.to(x.dtype), dx.to(x.dtype), d_beta
