"""Fused graph attention, :func:`graph_attention`: softmax attention of each destination node
over its incoming edges, without materialising anything of ``E x H x D``."""

import math
import numbers

import torch

from . import _cpu_attention
from ._attention_ops import build_grouping, check_inputs, graph_attention_op
from ._grouped import check_dst_ptr, index_to_ptr
from .plan import EdgePlan

__all__ = ["graph_attention", "dropout_keep", "draw_seed", "index_to_ptr"]


def graph_attention(q, k, v, src_idx, dst_idx, *, scale=None, edge_feat=None, dropout_p=0.0, generator=None,
                    plan=None, dst_ptr=None, deterministic=None, check_indices=True, return_attention=False):
    """Multi-head softmax attention over the edges of a graph (PyG's ``TransformerConv``).

    For each edge ``e`` from ``s = src_idx[e]`` to ``n = dst_idx[e]`` and head ``h``::

        score[e, h] = scale * <q[n, h], k[s, h] + edge_feat[e, h]>
        alpha[e, h] = softmax of score[:, h] over the edges into n
        out[n, h]   = sum over edges e into n of alpha[e, h] * (v[s, h] + edge_feat[e, h])

    A node without incoming edges gets zeros. The softmax keeps a running maximum, so logits of
    any size are safe. Non-finite scores, the same on every device: a node that has incoming
    edges but whose every score is ``-inf`` or NaN gets NaN (its log-sum-exp is NaN too); an edge
    whose ``alpha`` is exactly 0 (a ``-inf`` score into a node with a finite log-sum-exp) adds
    nothing to any gradient, so the gradients are finite wherever the output is. Nodes of any
    in-degree are fast: the edges of a hub are split into chunks walked in parallel, whose partial
    softmaxes are merged in a fixed order (reproducible). The backward recomputes the scores from a per-node log-sum-exp
    (FlashAttention-style): besides the output, only ``O(N * H)`` floats and the ``O(E)``
    integer groupings of the edges are kept for it.

    Args:
        q: ``[Nd, H, D]`` queries of the destination nodes.
        k: ``[Ns, H, D]`` keys of the source nodes.
        v: ``[Ns, H, Dv]`` values of the source nodes (``Dv`` may differ from ``D``; on CUDA
            both are at most 256).
            ``q``, ``k``, ``v`` share a dtype (float32, float64, float16 or bfloat16; half
            types accumulate in float32) and may be strided views (e.g. slices of one fused
            QKV projection).
        src_idx, dst_idx: 1-D int32 or int64 tensors of length ``E``, in any order, read as
            they are.
        scale: the logits' factor, ``1 / sqrt(D)`` by default.
        edge_feat: optional ``[E, H, D]`` edge features added to the keys and to the values
            (PyG's ``edge_dim``; needs ``Dv == D``).
        dropout_p: dropout on ``alpha`` without renormalisation (PyG's semantics); the mask is
            a hash of the seed, the edge and the head, regenerated in the backward instead of
            stored. Apply it only in training.
        generator: the ``torch.Generator`` the dropout seed is drawn from (default: torch's
            default generator). ``torch.compile`` cannot trace a generator argument: leave it
            None in compiled code.
        plan: an :class:`edgedot.EdgePlan` of this graph (``EdgePlan(src_idx, dst_idx, Ns,
            Nd)``): the edges' groupings by destination and by source are then built once
            instead of in every call.
        dst_ptr: for edges already sorted by destination (a CSC adjacency, PyG's ``NeighborLoader``
            output, a DGL block): int32/int64 ``[Nd + 1]`` CSR pointer, the edges into node ``n``
            being ``dst_ptr[n]`` to ``dst_ptr[n + 1] - 1`` (:func:`index_to_ptr` makes it from a
            sorted ``dst_idx``). The forward then needs no sort, and the backward sorts only by
            source, only when ``k`` or ``v`` needs a gradient. With ``check_indices`` it is
            checked against ``dst_idx`` (``ValueError`` naming ``dst_ptr``); without, a pointer
            that disagrees with ``dst_idx`` makes the destinations concerned NaN. Not together
            with ``plan``.
        deterministic: accepted for symmetry with :func:`edgedot.edge_dot`. Every path is
            bitwise reproducible already (no float atomics), with or without a plan.
        check_indices: raise ``IndexError`` naming the index tensor if an index is out of range.
            On CUDA the check waits for the device once per index tensor (remembered until it
            is modified in place); with ``False`` it never waits, an out-of-range source makes
            its destination's output NaN and an out-of-range destination drops its edge. The
            CPU always checks. Out-of-range indices are never read.
        return_attention: also return ``alpha`` ``[E, H]`` (before dropout, not differentiable).

    Returns:
        ``out`` ``[Nd, H, Dv]`` in the inputs' dtype, differentiable in ``q``, ``k``, ``v``
        and ``edge_feat``; ``(out, alpha)`` with ``return_attention=True``.
    """
    check_inputs(q, k, v, src_idx, dst_idx, edge_feat)
    scale = _check_scale(q, scale)
    check_options(dropout_p, generator, plan, check_indices, return_attention, deterministic)
    groups = edge_groupings(plan, dst_ptr, k, q, src_idx, dst_idx, check_indices)
    seed = draw_seed(generator) if dropout_p > 0 else None
    out, _, alpha = graph_attention_op(q, k, v, edge_feat, src_idx, dst_idx, *groups, float(scale), float(dropout_p),
                                       seed, return_attention, check_indices)
    return (out, alpha) if return_attention else out


def _check_scale(q, scale):
    """The scale, ``1 / sqrt(D)`` by default, after checking it."""
    if scale is None:
        return 1.0 / math.sqrt(q.shape[-1])
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return scale


def check_options(dropout_p, generator, plan, check_indices, return_attention, deterministic=None):
    """Checks the keyword arguments the attention functions share (TypeError / ValueError naming
    the argument)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a real number, got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p must lie in [0, 1], got {dropout_p}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    if plan is not None and not isinstance(plan, EdgePlan):
        raise TypeError(f"plan must be an edgedot.EdgePlan or None, got {type(plan).__name__}")
    for name, flag, optional in (("deterministic", deterministic, True), ("check_indices", check_indices, False),
                                 ("return_attention", return_attention, False)):
        if not isinstance(flag, bool) and not (optional and flag is None):
            raise TypeError(f"{name} must be a bool{' or None' if optional else ''}, got {type(flag).__name__}")


def edge_groupings(plan, dst_ptr, src_feat, dst_feat, src_idx, dst_idx, check_indices):
    """``(dst_group, dst_offsets, src_group, src_offsets)`` for an attention op, from ``plan`` or
    ``dst_ptr`` (checked here against the graph) or built on CUDA; ``src_feat`` / ``dst_feat``
    have one row per source / destination node."""
    if plan is not None:
        plan.check_matches(src_feat, dst_feat, src_idx)
    num_dst, is_cuda = dst_feat.shape[0], dst_feat.is_cuda
    if dst_ptr is not None:
        if plan is not None:
            raise ValueError("pass either plan or dst_ptr, not both")
        dst_ptr = check_dst_ptr(dst_ptr, dst_idx, num_dst, validate=check_indices or not is_cuda)
    if plan is not None and is_cuda:
        return plan.dst, plan.offsets("dst"), plan.src, plan.offsets("src")
    if dst_ptr is not None:
        return None, dst_ptr, None, None  # the edges as they are: no grouping to build
    if is_cuda:
        # Built here, so that the backward reuses it (the source grouping is built there).
        return build_grouping(dst_idx, src_idx, num_dst, src_feat.shape[0]) + (None, None)
    return None, None, None, None


def draw_seed(generator=None):
    """The dropout seed: a 0-d int64 CPU tensor drawn from ``generator`` (default: torch's
    default CPU generator). A call of :func:`graph_attention` with ``dropout_p > 0`` draws
    exactly this, so a generator in a known state gives a known mask (:func:`dropout_keep`)."""
    device = "cpu" if generator is None else generator.device
    seed = torch.randint(-2**63, 2**63 - 1, (), dtype=torch.int64, device=device, generator=generator)
    return seed.cpu()


def dropout_keep(seed, num_edges, heads, p, device="cpu"):
    """The dropout mask of :func:`graph_attention`: bool ``[num_edges, heads]``, True where
    ``alpha`` is kept. A hash of ``(seed, e * heads + h)``, the same on CPU and CUDA, so it does
    not depend on the order the edges are visited in; ``seed`` is an int or a 0-d tensor
    (:func:`draw_seed`)."""
    return _cpu_attention.keep_mask(int(seed), 0, num_edges, heads, p, device)
