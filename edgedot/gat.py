"""Fused GAT and GATv2 attention (PyG's ``GATConv`` and ``GATv2Conv`` message passing):
:func:`gat_attention`, :func:`gatv2_attention`. The softmax over each node's incoming edges and
the weighted sum of source features in one pass, with nothing of ``E x H x C`` materialised."""

import math
import numbers

from ._gat_ops import check_gat_inputs, check_gatv2_inputs, gat_attention_op, gatv2_attention_op
from .attention import check_options, edge_groupings

__all__ = ["gat_attention", "gatv2_attention"]

# The arguments both functions take, as their docstrings describe them.
_OPTIONS = """dropout_p: dropout on ``alpha`` without renormalisation (PyG's semantics), as in
            :func:`edgedot.graph_attention`: each call draws a state ``(seed, offset)`` from
            ``generator`` and the mask is a hash of the state, the edge and the head, regenerated
            in the backward from the state the forward recorded instead of stored.
            :func:`edgedot.attention.next_dropout_state` tells the state a call will draw,
            :func:`edgedot.attention.dropout_keep` the mask of a state. On CUDA dropout adds no
            wait for the device, and a call captured in a CUDA graph draws a new mask at each
            replay. Apply it only in training.
        generator: the ``torch.Generator`` dropout draws from, as in
            :func:`edgedot.graph_attention`: one of the inputs' device (``ValueError``
            otherwise), by default that device's default generator.
        plan: an :class:`edgedot.EdgePlan` of this graph (``EdgePlan(src_idx, dst_idx, Ns, Nd)``):
            the edges' groupings by destination and by source are then built once instead of in
            every call.
        dst_ptr: for edges already sorted by destination: int32/int64 ``[Nd + 1]`` CSR pointer
            (:func:`edgedot.index_to_ptr`); no sort in the forward. Checked against ``dst_idx``
            as in :func:`edgedot.graph_attention` (``ValueError`` naming ``dst_ptr``). Not
            together with ``plan``.
        check_indices: raise ``IndexError`` naming the index tensor if an index is out of range
            (on CUDA one wait per index tensor, remembered until it is modified in place; the
            CPU always checks).
        return_attention: also return ``alpha`` ``[E, H]`` (before dropout, not differentiable)."""


def _with_options(function):
    """``function`` with the shared arguments written into its docstring (absent under ``-OO``)."""
    if function.__doc__:
        function.__doc__ = function.__doc__.replace("{options}", _OPTIONS)
    return function


@_with_options
def gat_attention(x, a_src, a_dst, src_idx, dst_idx, *, a_edge=None, negative_slope=0.2, dropout_p=0.0,
                  generator=None, plan=None, dst_ptr=None, check_indices=True, return_attention=False):
    """GAT attention (PyG's ``GATConv``) over the edges of a graph.

    For each edge ``e`` from ``s = src_idx[e]`` to ``n = dst_idx[e]`` and head ``h``::

        score[e, h] = leaky_relu(a_src[s, h] + a_dst[n, h] + a_edge[e, h], negative_slope)
        alpha[e, h] = softmax of score[:, h] over the edges into n
        out[n, h]   = sum over edges e into n of alpha[e, h] * x[s, h]

    Args:
        x: ``[Ns, H, C]`` projected source features (on CUDA ``C`` is at most 256); may be a
            strided view.
        a_src: ``[Ns, H]`` per-source attention logits (``<x[s, h], att_src[h]>`` in GATConv).
        a_dst: ``[Nd, H]`` per-destination attention logits; ``Nd = a_dst.shape[0]``.
        src_idx, dst_idx: 1-D int32 or int64 tensors of length ``E``, in any order.
        a_edge: optional ``[E, H]`` per-edge logits (GATConv's ``edge_dim`` term).
            All float tensors share a dtype (float32, float64, float16 or bfloat16; half types
            accumulate in float32).
        negative_slope: the leaky ReLU's slope for negative arguments (finite; PyG's default 0.2).
        {options}

    Returns:
        ``out`` ``[Nd, H, C]`` in the inputs' dtype, differentiable in ``x``, ``a_src``,
        ``a_dst`` and ``a_edge``; ``(out, alpha)`` with ``return_attention=True``.

    A node without incoming edges gets zeros. A node whose every score is ``-inf`` or NaN gets
    NaN; an edge of weight exactly 0 adds nothing to any gradient, so the gradients are finite
    wherever the output is. Bitwise reproducible (no float atomics); the backward recomputes the
    scores from a per-node log-sum-exp, keeping only ``O(Nd * H)`` floats from the forward.
    """
    check_gat_inputs(x, a_src, a_dst, a_edge, src_idx, dst_idx)
    return _attend(gat_attention_op, (x, a_src, a_dst, a_edge), a_dst, src_idx, dst_idx, negative_slope, dropout_p,
                   generator, plan, dst_ptr, check_indices, return_attention)


@_with_options
def gatv2_attention(x_src, x_dst, att, src_idx, dst_idx, *, edge_feat=None, negative_slope=0.2, dropout_p=0.0,
                    generator=None, plan=None, dst_ptr=None, check_indices=True, return_attention=False):
    """GATv2 attention (PyG's ``GATv2Conv``) over the edges of a graph.

    For each edge ``e`` from ``s = src_idx[e]`` to ``n = dst_idx[e]`` and head ``h``::

        m[e, h]     = x_src[s, h] + x_dst[n, h] + edge_feat[e, h]                  (C channels)
        score[e, h] = sum over c of att[h, c] * leaky_relu(m[e, h, c], negative_slope)
        alpha[e, h] = softmax of score[:, h] over the edges into n
        out[n, h]   = sum over edges e into n of alpha[e, h] * x_src[s, h]

    The values are ``x_src`` without ``edge_feat``, as in PyG.

    Args:
        x_src: ``[Ns, H, C]`` projected source features (GATv2Conv's ``lin_l(x)``; on CUDA ``C``
            is at most 256).
        x_dst: ``[Nd, H, C]`` projected destination features (``lin_r(x)``); ``Nd =
            x_dst.shape[0]``.
        att: ``[H, C]`` attention vector.
        src_idx, dst_idx: 1-D int32 or int64 tensors of length ``E``, in any order.
        edge_feat: optional ``[E, H, C]`` projected edge features (``lin_edge(edge_attr)``).
            All float tensors share a dtype (float32, float64, float16 or bfloat16; half types
            accumulate in float32); features may be strided views.
        negative_slope: the leaky ReLU's slope for negative arguments (finite; PyG's default 0.2).
        {options}

    Returns:
        ``out`` ``[Nd, H, C]`` in the inputs' dtype, differentiable in ``x_src``, ``x_dst``,
        ``att`` and ``edge_feat``; ``(out, alpha)`` with ``return_attention=True``.

    Non-finite scores, reproducibility and memory as in :func:`gat_attention`.
    """
    check_gatv2_inputs(x_src, x_dst, att, edge_feat, src_idx, dst_idx)
    return _attend(gatv2_attention_op, (x_src, x_dst, att, edge_feat), x_dst, src_idx, dst_idx, negative_slope,
                   dropout_p, generator, plan, dst_ptr, check_indices, return_attention)


def _attend(op, tensors, dst_rows, src_idx, dst_idx, negative_slope, dropout_p, generator, plan, dst_ptr,
            check_indices, return_attention):
    """The options' checks, the edges' groupings and the call of ``op`` on ``tensors`` (checked
    already; the first is the source features, ``dst_rows`` has a row per destination)."""
    _check_slope(negative_slope)
    check_options(tensors[0].device, dropout_p, generator, plan, check_indices, return_attention)
    groups = edge_groupings(plan, dst_ptr, tensors[0], dst_rows, src_idx, dst_idx, check_indices)
    out, _, alpha, _ = op(*tensors, src_idx, dst_idx, *groups, float(negative_slope), float(dropout_p), generator,
                          return_attention, check_indices)
    return (out, alpha) if return_attention else out


def _check_slope(negative_slope):
    if isinstance(negative_slope, bool) or not isinstance(negative_slope, numbers.Real):
        raise TypeError(f"negative_slope must be a real number, got {type(negative_slope).__name__}")
    if not math.isfinite(negative_slope):
        raise ValueError(f"negative_slope must be finite, got {negative_slope}")
