"""CPU implementation of graph attention: chunks of edges, so extra memory stays bounded whatever
E is, and every sum is in edge order (:class:`RowSums`; deterministic).

Forward in two passes over the edges: the maximum score of each (destination, head), then the
sum of ``exp(score - max)`` and the weighted values. The backward recomputes the scores from the
saved log-sum-exp (FlashAttention's recomputation), so nothing of ``E x H`` is kept between
passes.

Problems whose per-edge rows are small enough (:func:`one_pass`) take one pass each way instead:
the forward keeps its per-edge tensors (:class:`EdgeSoftmax` and the op's own) for the backward,
which an eager call hands over (``kept``); a backward without them recomputes them with the
forward's own operations, so both give the same bits.
"""

import warnings
from typing import NamedTuple, Optional

import torch

from ..runtime import dropout

# Elements of one gathered chunk ([chunk, H, D]); a pass holds a few such chunks at once.
CHUNK_ELEMENTS = 1 << 21
# Bytes of one per-edge tensor ([E, H, D] in the accumulation dtype) up to which a problem takes one
# pass each way (:func:`one_pass`), its forward keeping a few such tensors for the backward. glibc
# maps a block larger than 32 MiB afresh on every allocation, and past about that size the new
# pages' faults cost more than the chunks' recomputation (NOTES.md's run log, CPU).
ONE_PASS_BYTES = 32 << 20
# Scores ([E, H]) the forward keeps from its first pass for its second, rather than computing them
# again, up to this many elements (the chunks bound the memory of larger graphs).
KEPT_SCORE_ELEMENTS = 1 << 25


def in_dtype(t, dtype):
    """``t.to(dtype)``, without the call where ``t`` has that dtype already (a call that copies
    nothing still costs about a microsecond, and small problems make a dozen)."""
    return t if t.dtype == dtype else t.to(dtype)


def acc_dtype(dtype):
    """The accumulation dtype: float64 for float64, float32 for everything else."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunks(num_edges, heads, dim):
    step = max(1, CHUNK_ELEMENTS // max(1, heads * dim))
    for start in range(0, num_edges, step):
        yield start, min(start + step, num_edges)


def _rows(idx, start, stop):
    # A chunk's rows as int32 (they fit: checked by the caller), the dtype the sparse matrices and
    # gathers take; RowSums converts to int64 where its scatter path wants it.
    return in_dtype(idx[start:stop], torch.int32)


def keep_mask(key, start, stop, heads, p, device):
    """The dropout mask of edges ``start..stop`` (bool ``[stop - start, heads]``) under the key
    of a call (:func:`edgedot.runtime.dropout.key`): head ``h`` of edge ``e`` is element ``e * heads + h``."""
    return dropout.keep_mask(key, start * heads, (stop - start) * heads, p, device).reshape(stop - start, heads)


def _dropped(t, mask, p):
    """``t * mask / (1 - p)``: dropout without renormalisation, ``mask`` from :func:`keep_mask`
    (None where ``p`` is 0 or at least 1, which need none)."""
    if p == 0:
        return t
    if p >= 1:
        return torch.zeros_like(t)
    return t * mask / (1 - p)


def _mask(key, start, stop, heads, p):
    """The chunk's :func:`keep_mask` where dropout needs one (``0 < p < 1``), else None."""
    return keep_mask(key, start, stop, heads, p, "cpu") if 0 < p < 1 else None


def _kept(alpha, key, start, stop, p):
    """``alpha * keep / (1 - p)`` for the chunk: dropout without renormalisation."""
    return _dropped(alpha, _mask(key, start, stop, alpha.shape[1], p), p)


# index_add_ by an int32 index spends about the same time on a row whatever its width (it sets up
# an elementwise add for each): it serves only what the paths below cannot take (a strided table,
# or one of 2**31 elements or more).
# At least FLAT_MIN_ROWS rows of at most FLAT_ROW_ELEMENTS elements are added one element at a
# time through flat views (4096 rows of 8 floats: 182 us by rows, 58 us flat; of 64 floats 295
# against 405, on 2 cores; the flat indices cost a few small ops).
# A chunk of at least SPARSE_MIN_ROWS rows, and of at least half as many rows as the table, is
# summed as a product with the sparse 0/1 matrix of its rows' destinations (CSR, each row of the
# table adding its entries in edge order): 32768 rows of 64 floats into 19717, 2631 us by rows,
# 655 us so. Its cost grows with the rows of the table, hence the second bound, and for rows of
# at least WIDE_ROW_ELEMENTS a third: at least SPARSE_WIDE_ROWS_PER_ROW rows per row of the table.
# Everything else is added with an int64 index: index_add_ then runs scatter_add_, whose CPU
# kernel adds each row's elements in index order (the same bits as the serial loop; for larger
# problems it sorts the index stably by radix, then adds each row of the table in one thread):
# 40960 rows of 128 floats into 16384, 2720 us by the sparse product, 1830 so; 8000 rows of 64
# into 16000, 638 us by rows, 217 so (torch 2.13, 2 cores). Rows narrower than
# NARROW_ROW_ELEMENTS, SERIAL_ELEMENTS elements in all at most, take it before the flat views
# (250 rows of 4 floats, 12.4 us by rows, 3.7 us so; 13264 rows of 2, 552 against 38, flat 56), as
# do rows of up to SCATTER_ROW_ELEMENTS where the index is int64 already (converting an int32
# index, about 5 us, would eat the gain of a few rows).
NARROW_ROW_ELEMENTS = 16
SCATTER_ROW_ELEMENTS = 256
SERIAL_ELEMENTS = 1 << 15
FLAT_ROW_ELEMENTS = 16
FLAT_MIN_ROWS = 512
SPARSE_MIN_ROWS = 8192
WIDE_ROW_ELEMENTS = 128
SPARSE_WIDE_ROWS_PER_ROW = 4
# torch.sort sorts integer tensors of at least this many elements by radix (246 us for 32768 on 2
# cores) and shorter ones by comparisons (1512 us for 32767): shorter indices are padded to it.
_RADIX_SORT_ELEMENTS = 1 << 15


class RowSums:
    """Sums of a chunk's per-edge rows into the rows of tables by one index ``idx`` (int32 or int64,
    as the edges came): :meth:`add` is ``out.index_add_(0, idx, rows)``, each row of ``out`` adding
    its edges in edge order (deterministic). The index in the other dtype and its sparse matrix
    are built once, for the first sum that takes them, and serve the chunk's other sums by the
    same index."""

    def __init__(self, idx):
        self.idx = idx
        self._converted = None
        self._matrix = None

    def index(self, dtype):
        """``idx`` as ``dtype`` (int32 or int64), converted at most once."""
        if self.idx.dtype == dtype:
            return self.idx
        if self._converted is None:
            self._converted = self.idx.to(dtype)
        return self._converted

    def _sparse(self, num_rows, dtype):
        """The ``[num_rows, len(idx)]`` CSR matrix with a 1 at ``(idx[i], i)``, each row's entries
        in the order of ``i``."""
        if self._matrix is None or self._matrix.shape[0] != num_rows or self._matrix.dtype != dtype:
            idx = self.index(torch.int32)
            count = idx.shape[0]
            if bool((idx[1:] >= idx[:-1]).all()):  # edges grouped by this index already (a mini-batch's
                order = torch.arange(count)        # destinations): the stable sort's order, for an eighth of its cost
            else:
                keys = idx
                if count < _RADIX_SORT_ELEMENTS:  # padding keys (num_rows) sort last, and are dropped
                    keys = torch.cat([idx, idx.new_full((_RADIX_SORT_ELEMENTS - count,), num_rows)])
                order = torch.sort(keys, stable=True).indices[:count]
            crow = torch.zeros(num_rows + 1, dtype=torch.int64)
            torch.cumsum(torch.bincount(idx, minlength=num_rows), 0, out=crow[1:])
            with warnings.catch_warnings():  # PyTorch calls its sparse CSR layout beta, once a process
                warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta state")
                self._matrix = torch.sparse_csr_tensor(crow, order, torch.ones(count, dtype=dtype),
                                                       (num_rows, count), check_invariants=False)
        return self._matrix

    def add(self, out, rows):
        """``out.index_add_(0, idx, rows)`` for a contiguous ``out``, in edge order."""
        count, num_rows = self.idx.shape[0], out.shape[0]
        width = out.numel() // num_rows if out.dim() > 1 and num_rows > 0 else 0
        if width == 0 or not out.is_contiguous() or out.numel() >= 2**31:
            out.index_add_(0, self.index(torch.int32), rows)
        elif count * width <= SERIAL_ELEMENTS and (width < NARROW_ROW_ELEMENTS or (
                width <= SCATTER_ROW_ELEMENTS and self.idx.dtype == torch.int64)):
            out.index_add_(0, self.index(torch.int64), rows)
        elif width <= FLAT_ROW_ELEMENTS and count >= FLAT_MIN_ROWS:
            flat = (self.index(torch.int32)[:, None] * width + torch.arange(width, dtype=torch.int32)).reshape(-1)
            out.view(-1).index_add_(0, flat, rows.reshape(-1))
        elif count >= SPARSE_MIN_ROWS and 2 * count >= num_rows and (
                width < WIDE_ROW_ELEMENTS or count >= SPARSE_WIDE_ROWS_PER_ROW * num_rows):
            out.view(num_rows, width).addmm_(self._sparse(num_rows, rows.dtype), rows.reshape(count, width))
        else:
            out.index_add_(0, self.index(torch.int64), rows)


def _gather(table, idx, acc):
    return in_dtype(table.index_select(0, idx), acc)


def _keys(k, edge_feat, src, start, stop, acc):
    keys = _gather(k, src, acc)
    return keys if edge_feat is None else keys + in_dtype(edge_feat[start:stop], acc)


def _lse_and_divisor(top, total):
    """The log-sum-exp of each (destination, head) from its maximum score and its sum of
    ``exp(score - max)``, and the sum where positive, else 1 (what the weights are divided by)."""
    # Nodes without incoming edges: total 0, lse = -inf + log(0) = -inf, output zeros. Nodes whose
    # every score is -inf or NaN: top -inf or NaN, so total, lse and output are NaN.
    return top + torch.log(total), torch.where(total > 0, total, torch.ones_like(total))


def _score_grads(dp, delta, alpha):
    """``(ds, dead)``: the scores' gradient ``alpha * (dp - delta)`` (``dp`` after dropout,
    ``delta`` at each edge's destination), 0 on the edges of weight exactly 0, and those edges
    (None where there is none)."""
    ds = (dp - delta) * alpha
    dead = alpha == 0
    if dead.any():
        return ds.masked_fill(dead, 0), dead
    return ds, None


def one_pass(num_edges, heads, width, dtype):
    """Whether a problem of per-edge rows ``[num_edges, heads, width]`` (inputs of ``dtype``) takes
    one pass each way: the forward then keeps its per-edge tensors for the backward (memory of a
    few such rows, as PyG's layers keep)."""
    return num_edges * heads * width * acc_dtype(dtype).itemsize <= ONE_PASS_BYTES


class EdgeSoftmax(NamedTuple):
    """The softmax over every edge at once (:func:`edge_softmax`), as the backward takes it."""
    src: torch.Tensor  # the edges' indices, as given
    dst: torch.Tensor
    alpha: torch.Tensor  # [E, H], in the accumulation dtype
    dropped: torch.Tensor  # alpha after dropout
    mask: Optional[torch.Tensor]  # the dropout mask, None where p is 0 or at least 1
    dropout_p: float
    to_dst: RowSums  # sums into the destinations' rows


def edge_softmax(scores, src_idx, dst_idx, num_dst, dropout_p, key):
    """The softmax of ``scores`` ``[E, H]`` (accumulation dtype) over each destination's edges,
    every edge at once: ``(lse [num_dst, H], EdgeSoftmax)``, the indices as given (int32 or int64:
    :class:`RowSums` takes either). The operations of :func:`softmax_forward`'s passes, so
    ``alpha`` has its bits."""
    heads = scores.shape[1]
    top = torch.full((num_dst, heads), float("-inf"), dtype=scores.dtype)
    to_dst = RowSums(dst_idx)
    top.scatter_reduce_(0, to_dst.index(torch.int64)[:, None].expand(-1, heads), scores, "amax")
    weight = torch.exp(scores - top.index_select(0, dst_idx))
    total = torch.zeros((num_dst, heads), dtype=scores.dtype)
    to_dst.add(total, weight)
    # An edge's node has a total of at least 1 (its top edge adds exp(0)) or NaN (amax keeps NaN):
    # dividing by it is dividing by softmax_forward's divisor, without the where.
    alpha = weight.div_(total.index_select(0, dst_idx))
    lse = top + torch.log(total)
    mask = _mask(key, 0, src_idx.shape[0], heads, dropout_p)
    return lse, EdgeSoftmax(src_idx, dst_idx, alpha, _dropped(alpha, mask, dropout_p), mask, dropout_p, to_dst)


def weighted_sum(softmax, values, num_dst, dtype):
    """``out`` ``[num_dst, H, Dv]`` in ``dtype``: each destination's sum of its edges' ``values``
    ``[E, H, Dv]`` weighted by ``alpha`` after dropout."""
    out = torch.zeros((num_dst,) + tuple(values.shape[1:]), dtype=values.dtype)
    softmax.to_dst.add(out, softmax.dropped[..., None] * values)
    return in_dtype(out, dtype)


def returned_alpha(softmax, dtype, return_attention):
    """The forward's ``alpha`` output: a copy in ``dtype`` (the backward keeps its own), or an
    empty ``[0]`` tensor unless ``return_attention``."""
    if not return_attention:
        return torch.empty((0,), dtype=dtype)
    return softmax.alpha.to(dtype, copy=True)


def edge_softmax_grads(grad_out, out, softmax, values):
    """The backward of :func:`edge_softmax` and :func:`weighted_sum` up to the scores: ``(ds,
    dead, grads)`` as :func:`softmax_grads` yields them for a chunk. Consumes ``values`` (the
    per-edge rows the forward kept, read by nothing after this)."""
    alpha = softmax.alpha
    dout = in_dtype(grad_out, alpha.dtype)
    grads = dout.index_select(0, softmax.dst)
    dp = _dropped(values.mul_(grads).sum(-1), softmax.mask, softmax.dropout_p)
    delta = (dout * in_dtype(out, alpha.dtype)).sum(-1)
    ds, dead = _score_grads(dp, delta.index_select(0, softmax.dst), alpha)
    return ds, dead, grads


def softmax_forward(score, values, src_idx, dst_idx, out_shape, width, dropout_p, key, return_attention, dtype):
    """The softmax over each destination's incoming edges and the weighted sum of values, in
    chunks of edges: ``score(start, stop, src, dst)`` gives the chunk's ``[stop - start, H]``
    scores and ``values(start, stop, src)`` its ``[stop - start, H, dim_v]`` values (a new tensor,
    which the pass consumes), both in the accumulation dtype (``src``, ``dst``: the chunk's int32
    rows); ``width`` sizes the chunks (the widest per-edge rows the callbacks gather). Returns
    ``(out [num_dst, H, dim_v] = out_shape in dtype, lse [num_dst, H] in the accumulation dtype,
    alpha [E, H] in dtype or an empty ``[0]`` tensor)``."""
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
        to_dst = RowSums(dst)
        to_dst.add(total, weight)
        if alpha is not None:
            alpha[start:stop] = weight
        to_dst.add(weighted, values(start, stop, src).mul_(_kept(weight, key, start, stop, dropout_p)[..., None]))

    lse, divisor = _lse_and_divisor(top, total)
    out = in_dtype(weighted / divisor[..., None], dtype)
    if alpha is None:
        return out, lse, torch.empty((0,), dtype=dtype)
    for start, stop in chunks:
        alpha[start:stop] /= divisor.index_select(0, _rows(dst_idx, start, stop))
    return out, lse, in_dtype(alpha, dtype)


def softmax_grads(grad_out, out, lse, score, values, src_idx, dst_idx, width, dropout_p, key):
    """The backward of :func:`softmax_forward` up to the scores, recomputed from ``lse``: yields
    per chunk of edges ``(start, stop, src, dst, ds, dead, kept, grads, extra)`` with ``ds`` the
    gradient of the chunk's scores (0 on edges of weight exactly 0, which add nothing even where a
    value is infinite), ``dead`` those edges (None where there is none), ``kept`` the weights
    after dropout, ``grads`` = ``grad_out`` of each edge's destination (a new tensor the caller
    may overwrite); ``score(start, stop, src, dst)`` returns ``(scores, extra)``; ``values`` and
    ``width`` as in :func:`softmax_forward`."""
    acc = lse.dtype
    dout = in_dtype(grad_out, acc)
    delta = (dout * in_dtype(out, acc)).sum(-1)
    for start, stop in _chunks(src_idx.shape[0], out.shape[1], width):
        src, dst = _rows(src_idx, start, stop), _rows(dst_idx, start, stop)
        scores, extra = score(start, stop, src, dst)
        alpha = torch.exp(scores - lse.index_select(0, dst))
        grads = dout.index_select(0, dst)
        dp = values(start, stop, src).mul_(grads).sum(-1)
        mask = _mask(key, start, stop, alpha.shape[1], dropout_p)
        ds, dead = _score_grads(_dropped(dp, mask, dropout_p), delta.index_select(0, dst), alpha)
        yield start, stop, src, dst, ds, dead, _dropped(alpha, mask, dropout_p), grads, extra


class AttentionEdges(NamedTuple):
    """What a one-chunk forward keeps for its backward: the softmax and the gathered rows, in the
    accumulation dtype."""
    softmax: EdgeSoftmax
    queries: torch.Tensor  # [E, H, D]: q of each edge's destination
    keys: torch.Tensor  # k of its source, plus its edge features
    values: torch.Tensor  # v of its source, plus its edge features


def _attention_edges(q, k, v, edge_feat, src_idx, dst_idx, scale, dropout_p, key):
    """The one-chunk forward's ``(lse, AttentionEdges)``."""
    acc = acc_dtype(q.dtype)
    queries, keys, values = _gather(q, dst_idx, acc), _gather(k, src_idx, acc), _gather(v, src_idx, acc)
    if edge_feat is not None:
        feat = in_dtype(edge_feat, acc)
        keys, values = keys + feat, values + feat
    lse, softmax = edge_softmax(scale * (queries * keys).sum(-1), src_idx, dst_idx, q.shape[0], dropout_p, key)
    return lse, AttentionEdges(softmax, queries, keys, values)


def forward(q, k, v, edge_feat, src_idx, dst_idx, scale, dropout_p, key, return_attention):
    """``key``: the dropout mask's (:func:`edgedot.runtime.dropout.key`). Returns ``(out [Nd, H,
    Dv] in q's dtype, lse [Nd, H] in the accumulation dtype, alpha [E, H] in q's dtype or an empty
    ``[0]`` tensor, kept)``: ``kept`` the :class:`AttentionEdges` of a one-chunk problem, for
    :func:`backward`, else None."""
    acc = acc_dtype(q.dtype)
    num_dst, heads, dim = q.shape
    if one_pass(src_idx.shape[0], heads, max(dim, v.shape[-1]), q.dtype):
        lse, kept = _attention_edges(q, k, v, edge_feat, src_idx, dst_idx, scale, dropout_p, key)
        out = weighted_sum(kept.softmax, kept.values, num_dst, q.dtype)
        return out, lse, returned_alpha(kept.softmax, q.dtype, return_attention), kept

    def score(start, stop, src, dst):
        return scale * (_gather(q, dst, acc) * _keys(k, edge_feat, src, start, stop, acc)).sum(-1)

    return softmax_forward(score, _values(v, edge_feat, acc), src_idx, dst_idx, (num_dst, heads, v.shape[-1]),
                           max(dim, v.shape[-1]), dropout_p, key, return_attention, q.dtype) + (None,)


def _values(v, edge_feat, acc):
    def values(start, stop, src):
        gathered = _gather(v, src, acc)
        return gathered if edge_feat is None else gathered + in_dtype(edge_feat[start:stop], acc)
    return values


def backward(grad_out, q, k, v, edge_feat, out, lse, src_idx, dst_idx, scale, dropout_p, key, edge_feat_grad,
             kept=None):
    """Returns ``(dq, dk, dv, d_edge_feat)`` in the inputs' dtype, ``d_edge_feat`` an empty
    ``[0]`` tensor unless ``edge_feat_grad``; ``kept``: what :func:`forward` kept, if anything (a
    one-chunk problem without it recomputes it)."""
    acc = acc_dtype(q.dtype)
    num_dst, heads, dim = q.shape
    num_src, dim_v = k.shape[0], v.shape[-1]
    num_edges = src_idx.shape[0]
    dq = torch.zeros((num_dst, heads, dim), dtype=acc)
    dk = torch.zeros((num_src, heads, dim), dtype=acc)
    dv = torch.zeros((num_src, heads, dim_v), dtype=acc)
    if kept is None and one_pass(num_edges, heads, max(dim, dim_v), q.dtype):
        kept = _attention_edges(q, k, v, edge_feat, src_idx, dst_idx, scale, dropout_p, key)[1]
    if kept is not None:
        softmax = kept.softmax
        ds, dead, grads = edge_softmax_grads(grad_out, out, softmax, kept.values)
        d_keys, d_values = _add_grads(dq, dk, dv, softmax.to_dst, RowSums(softmax.src), scale * ds, dead,
                                      kept.queries, kept.keys, softmax.dropped, grads)
        d_edge_feat = in_dtype(d_keys + d_values, q.dtype) if edge_feat_grad else q.new_empty((0,))
        return in_dtype(dq, q.dtype), in_dtype(dk, q.dtype), in_dtype(dv, q.dtype), d_edge_feat
    d_edge_feat = q.new_empty((num_edges, heads, dim) if edge_feat_grad else (0,))

    def score(start, stop, src, dst):
        queries, keys = _gather(q, dst, acc), _keys(k, edge_feat, src, start, stop, acc)
        return scale * (queries * keys).sum(-1), (queries, keys)

    for start, stop, src, dst, ds, dead, kept, grads, (queries, keys) in softmax_grads(
            grad_out, out, in_dtype(lse, acc), score, _values(v, edge_feat, acc), src_idx, dst_idx,
            max(dim, dim_v), dropout_p, key):
        d_keys, d_values = _add_grads(dq, dk, dv, RowSums(dst), RowSums(src), scale * ds, dead, queries, keys,
                                      kept, grads)
        if edge_feat_grad:
            d_edge_feat[start:stop] = d_keys + d_values
    return in_dtype(dq, q.dtype), in_dtype(dk, q.dtype), in_dtype(dv, q.dtype), d_edge_feat


def _add_grads(dq, dk, dv, to_dst, to_src, ds, dead, queries, keys, dropped, grads):
    """Adds a chunk's terms of ``dq``, ``dk``, ``dv`` (``ds``: its scores' gradient, scale
    included; ``dead``: its edges of weight 0, or None); returns the keys' and values' per-edge
    gradients, computed in place of ``queries`` and ``grads`` (``keys`` is consumed too: the
    per-edge rows are the chunk's own, and fresh allocations of them cost page faults)."""
    ds = ds[..., None]
    if dead is not None:
        keys.masked_fill_(dead[..., None], 0)  # 0 * an infinite key would be NaN
    to_dst.add(dq, keys.mul_(ds))
    d_keys, d_values = queries.mul_(ds), grads.mul_(dropped[..., None])
    to_src.add(dk, d_keys)
    to_src.add(dv, d_values)
    return d_keys, d_values
