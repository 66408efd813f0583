"""Fused graph attention, :func:`graph_attention`: softmax attention of each destination node
over its incoming edges, without materialising anything of ``E x H x D``."""

import math
import numbers

import torch

from .cpu import attention as cpu_attention
from .runtime import dropout
from ._attention_ops import build_grouping, check_inputs, graph_attention_op
from .runtime.grouped import check_dst_ptr, index_to_ptr
from .runtime.plan import EdgePlan

__all__ = ["graph_attention", "dropout_keep", "next_dropout_state", "index_to_ptr"]


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
        dropout_p: dropout on ``alpha`` without renormalisation (PyG's semantics). Each call
            draws a state ``(seed, offset)`` from ``generator``; the mask is a hash of the
            state, the edge and the head (the same on CPU and CUDA, whatever the edge order),
            regenerated in the backward from the state the forward recorded instead of stored.
            :func:`next_dropout_state` tells the state a call will draw, :func:`dropout_keep`
            the mask of a state. On CUDA dropout adds no wait for the device, and a call
            captured in a CUDA graph draws a new mask at each replay. Apply it only in training.
        generator: the ``torch.Generator`` dropout draws from: one of the inputs' device (a CPU
            generator for CPU inputs, a CUDA generator of their device for CUDA inputs;
            ``ValueError`` otherwise), by default that device's default generator. On CUDA the
            state is the generator's Philox seed and offset, which each call moves on by 4, as
            torch's own dropout does; in a CUDA graph, a generator other than the default must
            be registered with the graph (``CUDAGraph.register_generator_state``). On CPU the
            seed is a 64-bit integer drawn from the generator and the offset is 0.
            ``torch.compile`` traces calls with the default generator (None), which draw when
            they run, as in eager mode; a generator object breaks the graph at the call (an
            error with ``fullgraph=True``).
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
            On CUDA the indices and ``dst_ptr`` are checked together, in one kernel and one
            wait for the device, for a graph not seen before; what is found is remembered
            until the tensors are modified in place (views such as ``edge_index[0]`` made anew
            each call included), so a graph passed again does not wait. With ``False`` it
            never waits, an out-of-range source makes its destination's output NaN and an
            out-of-range destination drops its edge. The CPU always checks. Out-of-range
            indices are never read.
        return_attention: also return ``alpha`` ``[E, H]`` (before dropout, not differentiable).

    Returns:
        ``out`` ``[Nd, H, Dv]`` in the inputs' dtype, differentiable in ``q``, ``k``, ``v``
        and ``edge_feat``; ``(out, alpha)`` with ``return_attention=True``.
    """
    check_inputs(q, k, v, src_idx, dst_idx, edge_feat)
    scale = _check_scale(q, scale)
    check_options(q.device, dropout_p, generator, plan, check_indices, return_attention, deterministic)
    groups = edge_groupings(plan, dst_ptr, k, q, src_idx, dst_idx, check_indices)
    out, _, alpha = graph_attention_op(q, k, v, edge_feat, src_idx, dst_idx, *groups, float(scale), float(dropout_p),
                                       generator, return_attention, check_indices)[:3]
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


def check_options(device, dropout_p, generator, plan, check_indices, return_attention, deterministic=None):
    """Checks the keyword arguments the attention functions share (TypeError / ValueError naming
    the argument); ``device`` is the inputs'."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a real number, got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p must lie in [0, 1], got {dropout_p}")
    dropout.check_generator(generator, device)
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
        dst_ptr = check_dst_ptr(dst_ptr, dst_idx, num_dst)
    if plan is not None and is_cuda:
        return plan.dst, plan.offsets("dst"), plan.src, plan.offsets("src")
    if dst_ptr is not None:
        return None, dst_ptr, None, None  # the edges as they are: no grouping to build
    if is_cuda:
        # Built here, so that the backward reuses it (the source grouping is built there).
        return build_grouping(dst_idx, src_idx, num_dst, src_feat.shape[0]) + (None, None)
    return None, None, None, None


def next_dropout_state(device="cpu", generator=None):
    """The dropout state ``(seed, offset)``, an int64 ``[2]`` CPU tensor, that the next call of
    :func:`graph_attention`, :func:`edgedot.gat_attention` or :func:`edgedot.gatv2_attention`
    with ``dropout_p > 0`` on ``device`` draws from ``generator`` (default: the device's default
    generator). Nothing is drawn: the generator stays as it is.
    Pass the state to :func:`dropout_keep` for the call's mask. Before a CUDA graph's replay it
    tells the state of the graph's first call with dropout."""
    return dropout.next_state(device, generator)


def dropout_keep(rng_state, num_edges, heads, p, device=None):
    """The dropout mask of a :func:`graph_attention` (or :func:`edgedot.gat_attention`,
    :func:`edgedot.gatv2_attention`) call that drew ``rng_state``: bool ``[num_edges, heads]``,
    True where ``alpha`` is kept (then scaled by ``1 / (1 - p)``).

    ``rng_state`` is :func:`next_dropout_state`'s tensor (taken before the call), or the
    ``(seed, offset)`` pair as ints. The mask is a hash of the state and ``e * heads + h``,
    the same on CPU and CUDA, so it does not depend on the order the edges are visited in.
    It is made on ``device`` (default: ``rng_state``'s device, or the CPU)."""
    seed, offset = dropout.state_pair(rng_state)
    if device is None:
        device = rng_state.device if isinstance(rng_state, torch.Tensor) else "cpu"
    for name, value in (("num_edges", num_edges), ("heads", heads)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < 0:
            raise ValueError(f"{name} must be non-negative, got {value}")
    if isinstance(p, bool) or not isinstance(p, numbers.Real):
        raise TypeError(f"p must be a real number, got {type(p).__name__}")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p must lie in [0, 1], got {p}")
    return cpu_attention.keep_mask(dropout.key(seed, offset), 0, num_edges, heads, p, device)
