"""Pure-PyTorch edge dot product: the test oracle and the benchmark's eager baseline.

It materialises two [E, ..., D] gathers, which is exactly what edgedot avoids; use it for
checking results, not for speed.
"""

import torch

__all__ = ["edge_dot_reference", "graph_attention_reference", "gat_attention_reference",
           "gatv2_attention_reference", "agnn_attention_reference"]


def edge_dot_reference(src_feat, dst_feat, src_idx, dst_idx):
    """``(src_feat[src_idx] * dst_feat[dst_idx]).sum(-1)`` with heads broadcast.

    Accepts the same shapes as :func:`edgedot.edge_dot`: features ``[N, D]`` or ``[N, H, D]``
    (a head dimension of 1 broadcasts). Computes in the features' dtype, like the seed's model.
    """
    if src_feat.dim() != dst_feat.dim():  # a 2-D side is one head: [N, D] -> [N, 1, D]
        src_feat = src_feat.unsqueeze(1) if src_feat.dim() == 2 else src_feat
        dst_feat = dst_feat.unsqueeze(1) if dst_feat.dim() == 2 else dst_feat
    src = src_feat[src_idx.long()]
    dst = dst_feat[dst_idx.long()]
    return (src * dst).sum(dim=-1)


def graph_attention_reference(q, k, v, src_idx, dst_idx, *, scale=None, edge_feat=None, keep=None,
                              dropout_p=0.0):
    """Unfused graph attention, the oracle of :func:`edgedot.graph_attention`.

    ``score[e, h] = scale * <q[dst[e], h], k[src[e], h] + edge_feat[e, h]>``, softmax over the
    edges of each destination and head, ``out[n, h] = sum_e alpha'[e, h] * (v[src[e], h] +
    edge_feat[e, h])`` with ``alpha' = alpha * keep / (1 - dropout_p)`` (``keep``: an optional
    bool ``[E, H]`` mask). Gathers ``[E, H, D]`` tensors and computes in the inputs' dtype (pass
    float64 inputs for an oracle).

    A destination whose every score is ``-inf`` or NaN gets NaN; an edge with a ``-inf`` score
    adds nothing to any gradient (the rule of :func:`edgedot.graph_attention`).

    Returns ``(out [Nd, H, Dv], alpha [E, H])``, unlike :func:`edgedot.graph_attention`, which
    returns ``out`` alone unless ``return_attention=True``; ``alpha`` before dropout;
    differentiable.
    """
    src, dst = src_idx.long(), dst_idx.long()
    num_dst = q.shape[0]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    key, value = k[src], v[src]
    if edge_feat is not None:
        key, value = key + edge_feat, value + edge_feat
    query = q[dst]
    score = scale * (query * key).sum(-1)
    dead = (score == float("-inf")).detach()
    if dead.any():
        # Recomputed from zeroed rows, so that autograd's 0 * (infinite key) gives 0, not NaN.
        query = query.masked_fill(dead[..., None], 0)
        safe_key = key.masked_fill(dead[..., None], 0)
        score = (scale * (query * safe_key).sum(-1)).masked_fill(dead, float("-inf"))
    return _softmax_aggregate(score, value, dst, num_dst, keep, dropout_p)


def _softmax_aggregate(score, value, dst, num_dst, keep, dropout_p):
    """Softmax of ``score`` [E, H] over the edges of each destination and the sum of
    ``alpha' * value`` [E, H, C] into it: ``(out [num_dst, H, C], alpha [E, H])``."""
    heads = score.shape[1]
    # The per-destination maximum only keeps exp() in range; softmax does not depend on it.
    top = torch.full((num_dst, heads), float("-inf"), dtype=score.dtype, device=score.device)
    top = top.scatter_reduce(0, dst[:, None].expand(-1, heads), score.detach(), "amax").detach()
    weight = torch.exp(score - top[dst])
    total = torch.zeros_like(top).index_add(0, dst, weight)
    alpha = weight / total[dst]
    kept = alpha
    if keep is not None:
        kept = alpha * keep / (1 - dropout_p) if dropout_p < 1 else torch.zeros_like(alpha)
    out = torch.zeros((num_dst, heads, value.shape[-1]), dtype=value.dtype, device=value.device)
    return out.index_add(0, dst, kept[..., None] * value), alpha


def gat_attention_reference(x, a_src, a_dst, src_idx, dst_idx, *, a_edge=None, negative_slope=0.2, keep=None,
                            dropout_p=0.0):
    """Unfused GAT attention, the oracle of :func:`edgedot.gat_attention`.

    ``score[e, h] = leaky_relu(a_src[src[e], h] + a_dst[dst[e], h] + a_edge[e, h])``, softmax
    over the edges of each destination and head, ``out[n, h] = sum_e alpha'[e, h] * x[src[e], h]``
    with ``alpha' = alpha * keep / (1 - dropout_p)`` (``keep``: an optional bool ``[E, H]``
    mask). Gathers ``[E, H, C]`` and computes in the inputs' dtype (pass float64 inputs for an
    oracle). Non-finite scores follow :func:`edgedot.gat_attention`'s rule.

    Returns ``(out [Nd, H, C], alpha [E, H])``, ``alpha`` before dropout; differentiable.
    """
    src, dst = src_idx.long(), dst_idx.long()
    z = a_src[src] + a_dst[dst]
    if a_edge is not None:
        z = z + a_edge
    score = torch.nn.functional.leaky_relu(z, negative_slope)
    dead = (score == float("-inf")).detach()
    if dead.any():
        # Recomputed from zeroed entries, so that the edges of weight 0 pass no gradient at all.
        score = torch.nn.functional.leaky_relu(z.masked_fill(dead, 0), negative_slope).masked_fill(dead, float("-inf"))
    return _softmax_aggregate(score, x[src], dst, a_dst.shape[0], keep, dropout_p)


def gatv2_attention_reference(x_src, x_dst, att, src_idx, dst_idx, *, edge_feat=None, negative_slope=0.2, keep=None,
                              dropout_p=0.0):
    """Unfused GATv2 attention, the oracle of :func:`edgedot.gatv2_attention`.

    ``m[e, h] = x_src[src[e], h] + x_dst[dst[e], h] + edge_feat[e, h]``, ``score[e, h] =
    <att[h], leaky_relu(m[e, h])>``, softmax over the edges of each destination and head,
    ``out[n, h] = sum_e alpha'[e, h] * x_src[src[e], h]`` (dropout as in
    :func:`gat_attention_reference`). Gathers ``[E, H, C]`` tensors and computes in the inputs'
    dtype. Returns ``(out [Nd, H, C], alpha [E, H])``, ``alpha`` before dropout; differentiable.
    """
    src, dst = src_idx.long(), dst_idx.long()
    value = x_src[src]
    m = value + x_dst[dst]
    if edge_feat is not None:
        m = m + edge_feat
    score = (att * torch.nn.functional.leaky_relu(m, negative_slope)).sum(-1)
    dead = (score == float("-inf")).detach()
    if dead.any():
        m = m.masked_fill(dead[..., None], 0)
        score = (att * torch.nn.functional.leaky_relu(m, negative_slope)).sum(-1).masked_fill(dead, float("-inf"))
    return _softmax_aggregate(score, value, dst, x_dst.shape[0], keep, dropout_p)


def agnn_attention_reference(x, beta, src_idx, dst_idx):
    """Unfused AGNN attention, the oracle of :func:`edgedot.agnn_attention` (PyG's ``AGNNConv``).

    ``x_norm = F.normalize(x, p=2, dim=-1)``, ``score[e, h] = beta[h] * <x_norm[dst[e], h],
    x_norm[src[e], h]>``, softmax over the edges of each destination and head, ``out[n, h] =
    sum_e alpha[e, h] * x[src[e], h]``. ``x`` ``[N, C]`` or ``[N, H, C]``, ``beta`` ``[1]`` or
    ``[H]``. Gathers ``[E, H, C]`` tensors and computes in the inputs' dtype (pass float64 inputs
    for an oracle).

    Returns ``(out, alpha)`` shaped like ``x`` and ``[E, H]`` (``[E]`` for a 2-D ``x``);
    differentiable.
    """
    flat = x.dim() == 2
    x = x.unsqueeze(1) if flat else x
    src, dst = src_idx.long(), dst_idx.long()
    x_norm = torch.nn.functional.normalize(x, p=2.0, dim=-1)
    score = beta * (x_norm[dst] * x_norm[src]).sum(-1)
    out, alpha = _softmax_aggregate(score, x[src], dst, x.shape[0], None, 0.0)
    return (out.squeeze(1), alpha.squeeze(1)) if flat else (out, alpha)
