"""Fused GAT and GATv2 attention (PyG's ``GATConv`` and ``GATv2Conv`` message passing):
:func:`gat_attention`, :func:`gatv2_attention`. The softmax over each node's incoming edges and
the weighted sum of source features in one pass, with nothing of ``E x H x C`` materialised. Below
them, the custom operators (schemas, per-device implementations, fake tensors, autograd; the
pattern of :mod:`edgedot.ops.attention`).

``edgedot::gat_attention``              forward: ``(out, lse, alpha, rng_state)``.
``edgedot::gat_attention_backward``     ``(dx, da_src, da_dst, da_edge)`` by recomputation from ``lse``.
``edgedot::gatv2_attention``            forward: ``(out, lse, alpha, rng_state)``.
``edgedot::gatv2_attention_backward``   ``(dx_src, dx_dst, datt, d_edge_feat)``.

Groupings, offsets, ``generator``, ``rng_state`` and ``lse``'s dtype mean what they mean for
``edgedot::graph_attention``: dropout follows :mod:`edgedot.runtime.dropout`, with graph
attention's mask (head ``h`` of edge ``e`` is element ``e * heads + h``). ``src_grad`` False (no
gradient wanted on the source-side tensors) returns those outputs as empty ``[0]`` tensors, and
the CUDA backward then skips its source-side pass and the grouping by source; ``a_edge_grad`` /
``edge_feat_grad`` False does the same for the edge tensor's gradient.
"""

import math
import numbers

import torch

from ..cpu import gat as cpu_gat
from ..runtime import dropout, eager
from ..runtime.build import cuda_module
from ..runtime.checks import FEATURE_DTYPES, check_indices_pair
from . import attention as attention_ops
from .attention import (CUDA_MAX_DIM, MAX_ATTENTION_ROWS, MAX_EDGES, _grouping, backward_groupings, check_options,
                        check_residual, cuda_autograd, draw_cpu, edge_groupings, forward_fake, setup_context)
from .attention import _check_graph as _check_edges
from .node_logits import gat_node_logit_sides

__all__ = ["gat_attention", "gatv2_attention", "gat_attention_op", "gat_attention_backward_op", "gatv2_attention_op",
           "gatv2_attention_backward_op", "check_gat_inputs", "check_gatv2_inputs"]

# ------------------------------------------------------------------------------ the public functions

# The arguments both functions take, as their docstrings describe them.
_OPTIONS = """dropout_p: dropout on ``alpha`` without renormalisation (PyG's semantics), as in
            :func:`edgedot.graph_attention`: each call draws a state ``(seed, offset)`` from
            ``generator`` and the mask is a hash of the state, the edge and the head, regenerated
            in the backward from the state the forward recorded instead of stored.
            :func:`edgedot.ops.attention.next_dropout_state` tells the state a call will draw,
            :func:`edgedot.ops.attention.dropout_keep` the mask of a state. On CUDA dropout adds no
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
        check_indices: raise ``IndexError`` naming the index tensor if an index is out of range,
            as :func:`edgedot.graph_attention` does (on CUDA without a wait for the device: the
            error is raised by a later edgedot call, at the latest by
            :func:`edgedot.wait_for_checks`; the CPU checks during the call).
        return_attention: also return ``alpha`` ``[E, H]`` (before dropout, not differentiable).
        residual: """ + attention_ops.RESIDUAL_DOC


def _with_options(function):
    """``function`` with the shared arguments written into its docstring (absent under ``-OO``)."""
    if function.__doc__:
        function.__doc__ = function.__doc__.replace("{options}", _OPTIONS)
    return function


@_with_options
def gat_attention(x, a_src, a_dst, src_idx, dst_idx, *, a_edge=None, negative_slope=0.2, dropout_p=0.0,
                  generator=None, plan=None, dst_ptr=None, check_indices=True, return_attention=False, residual=None):
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
        ``a_dst``, ``a_edge`` and ``residual``; ``(out, alpha)`` with ``return_attention=True``.

    A node without incoming edges gets zeros. A node whose every score is ``-inf`` or NaN gets
    NaN; an edge of weight exactly 0 adds nothing to any gradient, so the gradients are finite
    wherever the output is. Bitwise reproducible (no float atomics); the backward recomputes the
    scores from a per-node log-sum-exp, keeping only ``O(Nd * H)`` floats from the forward.
    """
    check_gat_inputs(x, a_src, a_dst, a_edge, src_idx, dst_idx)
    residual = check_residual(residual, x, a_dst.shape[0], x.shape[1], x.shape[2])
    return _attend(gat_attention_op, (x, a_src, a_dst, a_edge), a_dst, src_idx, dst_idx, negative_slope, dropout_p,
                   generator, plan, dst_ptr, check_indices, return_attention, residual)


@_with_options
def gatv2_attention(x_src, x_dst, att, src_idx, dst_idx, *, edge_feat=None, negative_slope=0.2, dropout_p=0.0,
                    generator=None, plan=None, dst_ptr=None, check_indices=True, return_attention=False,
                    residual=None):
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
        ``att``, ``edge_feat`` and ``residual``; ``(out, alpha)`` with ``return_attention=True``.

    Non-finite scores, reproducibility and memory as in :func:`gat_attention`.
    """
    check_gatv2_inputs(x_src, x_dst, att, edge_feat, src_idx, dst_idx)
    residual = check_residual(residual, x_src, x_dst.shape[0], x_src.shape[1], x_src.shape[2])
    return _attend(gatv2_attention_op, (x_src, x_dst, att, edge_feat), x_dst, src_idx, dst_idx, negative_slope,
                   dropout_p, generator, plan, dst_ptr, check_indices, return_attention, residual)


def gat_layer_attention(x, att_src, att_dst, src_idx, dst_idx, *, a_edge=None, negative_slope=0.2, dropout_p=0.0,
                        generator=None, plan=None, dst_ptr=None, check_indices=True, return_attention=False,
                        residual=None):
    """:func:`gat_attention` over one ``x`` ``[N, H, C]`` for both sides with its own logits:
    ``a_src, a_dst = gat_node_logit_sides(x, att_src, att_dst)`` (``GATConv`` on one node set);
    the same outputs and gradients, in ``x``, ``att_src``, ``att_dst`` (each of ``H * C``
    elements, any shape), ``a_edge`` and ``residual``. The options and ``residual`` are
    :func:`gat_attention`'s. Float tensors of different dtypes are computed in their promoted
    dtype, as PyG's layer computes them under autocast (``x`` in the autocast dtype, the attention
    vectors float32).

    On CUDA in plain eager autograd, with every float tensor of ``x``'s dtype, the logits and the
    attention are one autograd node (csrc/attention/autograd.cpp, ``GatLayerFunction``): no op
    call between them, and the backward adds the logits' ``dx`` into the attention's inside the
    logits' kernel, rounded once. Elsewhere it is the two ops."""
    if not _one_node(x, att_src, att_dst, a_edge, src_idx, dst_idx, residual):
        a_src, a_dst = gat_node_logit_sides(x, att_src, att_dst)  # in the promoted dtype
        dtype = a_src.dtype
        for t in (a_edge, residual):
            if isinstance(t, torch.Tensor) and t.dtype in FEATURE_DTYPES:
                dtype = torch.promote_types(dtype, t.dtype)
        a_edge, residual = (t.to(dtype) if isinstance(t, torch.Tensor) else t for t in (a_edge, residual))
        return gat_attention(x.to(dtype), a_src.to(dtype), a_dst.to(dtype), src_idx, dst_idx, a_edge=a_edge,
                             negative_slope=negative_slope,
                             dropout_p=dropout_p, generator=generator, plan=plan, dst_ptr=dst_ptr,
                             check_indices=check_indices, return_attention=return_attention, residual=residual)
    _check_layer_inputs(x, att_src, att_dst, a_edge, src_idx, dst_idx)
    residual = check_residual(residual, x, x.shape[0], x.shape[1], x.shape[2])
    _check_slope(negative_slope)
    check_options(x.device, dropout_p, generator, plan, check_indices, return_attention)
    groups, check_indices = edge_groupings(plan, dst_ptr, x, x, src_idx, dst_idx, check_indices, [x, att_src])
    if check_indices:
        _check_edges(x, x, src_idx, dst_idx, groups[0], groups[1])
    out, _, alpha, _ = cuda_module().gat_layer_attention_autograd(
        x, att_src, att_dst, a_edge, src_idx, dst_idx, *groups, float(negative_slope), float(dropout_p), generator,
        return_attention, attention_ops.BACKWARD_RECORDS, residual)
    return (out, alpha) if return_attention else out


def _one_node(x, att_src, att_dst, a_edge, src_idx, dst_idx, residual):
    """Whether :func:`gat_layer_attention` takes its one C++ node: tensors (else the two ops'
    checks name the argument) of one float dtype on CUDA, a gradient wanted, plain eager."""
    tensors = (x, att_src, att_dst, src_idx, dst_idx) + tuple(t for t in (a_edge, residual) if t is not None)
    if not all(isinstance(t, torch.Tensor) for t in tensors) or not x.is_cuda or not torch.is_grad_enabled():
        return False
    floats = tensors[:3] + tensors[5:]
    return (all(t.dtype == x.dtype for t in floats) and any(t.requires_grad for t in floats)
            and eager.plain_eager(*tensors))


def _check_layer_inputs(x, att_src, att_dst, a_edge, src_idx, dst_idx):
    """:func:`check_gat_inputs` with ``att_src`` and ``att_dst`` in the place of the logits."""
    _check_features("x", x)
    if x.dtype not in FEATURE_DTYPES:
        raise TypeError(f"x must be float32, float64, float16 or bfloat16, got {x.dtype}")
    heads, channels = x.shape[1], x.shape[2]
    for name, att in (("att_src", att_src), ("att_dst", att_dst)):
        if att.numel() != heads * channels:
            raise ValueError(f"{name} must hold H x C = {heads} x {channels} elements, got shape {tuple(att.shape)}")
    check_indices_pair(src_idx, dst_idx)
    if a_edge is not None:
        _check_shape("a_edge", a_edge, (src_idx.shape[0], heads), "[E, H]")
    _check_graph("x", (("x", x), ("att_src", att_src), ("att_dst", att_dst), ("a_edge", a_edge)), src_idx, dst_idx,
                 x.shape[0], x.shape[0], channels)


def _attend(op, tensors, dst_rows, src_idx, dst_idx, negative_slope, dropout_p, generator, plan, dst_ptr,
            check_indices, return_attention, residual):
    """The options' checks, the edges' groupings and the call of ``op`` on ``tensors`` (checked
    already; the first is the source features, ``dst_rows`` has a row per destination)."""
    _check_slope(negative_slope)
    check_options(tensors[0].device, dropout_p, generator, plan, check_indices, return_attention)
    groups, check_indices = edge_groupings(plan, dst_ptr, tensors[0], dst_rows, src_idx, dst_idx, check_indices,
                                           [tensors[i] for i in _SOURCE_INPUTS[op]])
    out, _, alpha, _ = eager.call(op, _EAGER_FUNCTIONS[op], *tensors, src_idx, dst_idx, *groups,
                                  float(negative_slope), float(dropout_p), generator, return_attention, check_indices,
                                  residual=residual)
    return (out, alpha) if return_attention else out


def _check_slope(negative_slope):
    if isinstance(negative_slope, bool) or not isinstance(negative_slope, numbers.Real):
        raise TypeError(f"negative_slope must be a real number, got {type(negative_slope).__name__}")
    if not math.isfinite(negative_slope):
        raise ValueError(f"negative_slope must be finite, got {negative_slope}")


# ------------------------------------------------------------------------------ the custom operators

_lib = torch.library.Library("edgedot", "FRAGMENT")
_TAIL = ("Tensor src_idx, Tensor dst_idx, Tensor? dst_group, Tensor? dst_offsets, Tensor? src_group, "
         "Tensor? src_offsets, float negative_slope, float dropout_p")
_FORWARD_TAIL = (f"{_TAIL}, Generator? generator, bool return_attention, bool check_indices) "
                 f"-> (Tensor out, Tensor lse, Tensor alpha, Tensor rng_state)")
# The forwards draw when they run: no compiler pass may merge two calls or recompute one.
_SEEDED = (torch.Tag.nondeterministic_seeded,)
_lib.define(f"gat_attention(Tensor x, Tensor a_src, Tensor a_dst, Tensor? a_edge, {_FORWARD_TAIL}", tags=_SEEDED)
_lib.define(f"gat_attention_backward(Tensor grad_out, Tensor x, Tensor a_src, Tensor a_dst, Tensor? a_edge, "
            f"Tensor out, Tensor lse, {_TAIL}, Tensor? rng_state, bool a_edge_grad, bool src_grad) "
            f"-> (Tensor dx, Tensor da_src, Tensor da_dst, Tensor da_edge)")
_lib.define(f"gatv2_attention(Tensor x_src, Tensor x_dst, Tensor att, Tensor? edge_feat, {_FORWARD_TAIL}",
            tags=_SEEDED)
_lib.define(f"gatv2_attention_backward(Tensor grad_out, Tensor x_src, Tensor x_dst, Tensor att, Tensor? edge_feat, "
            f"Tensor out, Tensor lse, {_TAIL}, Tensor? rng_state, bool edge_feat_grad, bool src_grad) "
            f"-> (Tensor dx_src, Tensor dx_dst, Tensor datt, Tensor d_edge_feat)")

gat_attention_op = torch.ops.edgedot.gat_attention.default
gat_attention_backward_op = torch.ops.edgedot.gat_attention_backward.default
gatv2_attention_op = torch.ops.edgedot.gatv2_attention.default
gatv2_attention_backward_op = torch.ops.edgedot.gatv2_attention_backward.default


def _check_tensors(named):
    for name, t in named:
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")


def _check_dtype(name, t, dtype_of, first):
    if t.dtype not in FEATURE_DTYPES:
        raise TypeError(f"{name} must be float32, float64, float16 or bfloat16, got {t.dtype}")
    if t.dtype != dtype_of.dtype:
        raise TypeError(f"{first} is {dtype_of.dtype} but {name} is {t.dtype}; they must match")


def _check_shape(name, t, want, layout):
    if tuple(t.shape) != tuple(want):
        raise ValueError(f"{name} must be {layout} = {list(want)}, got shape {tuple(t.shape)}")


def _check_features(name, t):
    """A ``[N, H, C]`` node feature tensor with at least one head and one channel."""
    if t.dim() != 3:
        raise ValueError(f"{name} must be 3-D [N, H, C], got shape {tuple(t.shape)}")
    if 0 in t.shape[1:]:
        raise ValueError(f"{name} needs at least one head and one channel, got shape {tuple(t.shape)}")


def _check_graph(first, tensors, src_idx, dst_idx, num_src, num_dst, channels):
    """Devices and sizes: the checks both operators share."""
    device = tensors[0][1].device
    for name, t in tensors[1:] + (("src_idx", src_idx), ("dst_idx", dst_idx)):
        if t is not None and t.device != device:
            raise ValueError(f"{first} is on {device} but {name} is on {t.device}; all inputs must share a device")
    if device.type == "cuda" and channels > CUDA_MAX_DIM:
        raise ValueError(f"on CUDA, {first} takes at most {CUDA_MAX_DIM} channels per head, got C={channels}")
    if src_idx.shape[0] >= MAX_EDGES:
        raise ValueError(f"src_idx has {src_idx.shape[0]} edges; at most {MAX_EDGES - 1} are supported")
    for side, rows in (("source", num_src), ("destination", num_dst)):
        if rows > MAX_ATTENTION_ROWS:
            raise ValueError(f"{rows} {side} nodes; at most {MAX_ATTENTION_ROWS} are supported")


def check_gat_inputs(x, a_src, a_dst, a_edge, src_idx, dst_idx):
    """Raises TypeError / ValueError naming the first malformed tensor argument of
    :func:`edgedot.gat_attention`."""
    _check_tensors((("x", x), ("a_src", a_src), ("a_dst", a_dst), ("src_idx", src_idx), ("dst_idx", dst_idx),
                    ("a_edge", a_edge)))
    _check_features("x", x)
    if x.dtype not in FEATURE_DTYPES:
        raise TypeError(f"x must be float32, float64, float16 or bfloat16, got {x.dtype}")
    num_src, heads = x.shape[0], x.shape[1]
    _check_shape("a_src", a_src, (num_src, heads), "[Ns, H]")
    if a_dst.dim() != 2 or a_dst.shape[1] != heads:
        raise ValueError(f"a_dst must be [Nd, H] with H={heads}, got shape {tuple(a_dst.shape)}")
    check_indices_pair(src_idx, dst_idx)
    if a_edge is not None:
        _check_shape("a_edge", a_edge, (src_idx.shape[0], heads), "[E, H]")
    for name, t in (("a_src", a_src), ("a_dst", a_dst), ("a_edge", a_edge)):
        if t is not None:
            _check_dtype(name, t, x, "x")
    _check_graph("x", (("x", x), ("a_src", a_src), ("a_dst", a_dst), ("a_edge", a_edge)), src_idx, dst_idx,
                 num_src, a_dst.shape[0], x.shape[2])


def check_gatv2_inputs(x_src, x_dst, att, edge_feat, src_idx, dst_idx):
    """Raises TypeError / ValueError naming the first malformed tensor argument of
    :func:`edgedot.gatv2_attention`."""
    _check_tensors((("x_src", x_src), ("x_dst", x_dst), ("att", att), ("src_idx", src_idx), ("dst_idx", dst_idx),
                    ("edge_feat", edge_feat)))
    for name, t in (("x_src", x_src), ("x_dst", x_dst)):
        _check_features(name, t)
    if x_src.dtype not in FEATURE_DTYPES:
        raise TypeError(f"x_src must be float32, float64, float16 or bfloat16, got {x_src.dtype}")
    heads, channels = x_src.shape[1], x_src.shape[2]
    if tuple(x_dst.shape[1:]) != (heads, channels):
        raise ValueError(f"x_dst must be [Nd, H, C] with H={heads}, C={channels} (as x_src), got shape "
                         f"{tuple(x_dst.shape)}")
    _check_shape("att", att, (heads, channels), "[H, C]")
    check_indices_pair(src_idx, dst_idx)
    if edge_feat is not None:
        _check_shape("edge_feat", edge_feat, (src_idx.shape[0], heads, channels), "[E, H, C]")
    for name, t in (("x_dst", x_dst), ("att", att), ("edge_feat", edge_feat)):
        if t is not None:
            _check_dtype(name, t, x_src, "x_src")
    _check_graph("x_src", (("x_src", x_src), ("x_dst", x_dst), ("att", att), ("edge_feat", edge_feat)), src_idx,
                 dst_idx, x_src.shape[0], x_dst.shape[0], channels)


def _check_options(x, negative_slope, dropout_p, generator):
    if not math.isfinite(negative_slope):
        raise ValueError(f"negative_slope must be finite, got {negative_slope}")
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p must lie in [0, 1], got {dropout_p}")
    dropout.check_generator(generator, x.device)


def _check_gat(x, a_src, a_dst, a_edge, src_idx, dst_idx, negative_slope, dropout_p, generator=None):
    check_gat_inputs(x, a_src, a_dst, a_edge, src_idx, dst_idx)
    _check_options(x, negative_slope, dropout_p, generator)


def _check_gatv2(x_src, x_dst, att, edge_feat, src_idx, dst_idx, negative_slope, dropout_p, generator=None):
    check_gatv2_inputs(x_src, x_dst, att, edge_feat, src_idx, dst_idx)
    _check_options(x_src, negative_slope, dropout_p, generator)


# ------------------------------------------------------------------------------ GAT


def _backward_on_cpu(cpu_backward, grad_out, feat, a, b, edge, out, lse, src_idx, dst_idx, negative_slope,
                     dropout_p, rng_state, edge_grad, src_grad, kept=None):
    """A CPU backward (``cpu_backward``: :func:`edgedot.cpu.gat.gat_backward` or
    ``gatv2_backward``), arguments checked; ``kept``: what the forward kept, if anything."""
    return cpu_backward(grad_out, feat, a, b, edge, out, lse, src_idx, dst_idx, negative_slope, dropout_p,
                        dropout.recorded_key(rng_state, dropout_p), edge_grad, src_grad, kept=kept)


def _forward_on_cpu(cpu_forward, feat, a, b, edge, src_idx, dst_idx, negative_slope, dropout_p, generator,
                    return_attention):
    """A CPU forward (``cpu_forward``: :func:`edgedot.cpu.gat.gat_forward` or ``gatv2_forward``),
    arguments and graph checked: ``((out, lse, alpha, rng_state), kept)``, ``kept`` what the CPU
    backward may take instead of recomputing (or None)."""
    rng_state, key = draw_cpu(feat, dropout_p, generator)
    out, lse, alpha, kept = cpu_forward(feat, a, b, edge, src_idx, dst_idx, negative_slope, dropout_p, key,
                                        return_attention)
    return (out, lse, alpha, rng_state), kept


# The forwards' checks of the graph: the CPU's, every call (check_indices only spares CUDA a wait),
# and the eager CUDA call's where check_indices; the destination rows are a_dst's (GAT) and
# x_dst's (GATv2).
def _gat_check_call_graph(x, a_src, a_dst, a_edge, src_idx, dst_idx, dst_group, dst_offsets, *_):
    _check_edges(a_dst, x, src_idx, dst_idx, dst_group, dst_offsets)


def _gatv2_check_call_graph(x_src, x_dst, att, edge_feat, src_idx, dst_idx, dst_group, dst_offsets, *_):
    _check_edges(x_dst, x_src, src_idx, dst_idx, dst_group, dst_offsets)


def _gat_forward_on_cpu(x, a_src, a_dst, a_edge, src_idx, dst_idx, dst_group, dst_offsets, src_group, src_offsets,
                        negative_slope, dropout_p, generator, return_attention, check_indices):
    return _forward_on_cpu(cpu_gat.gat_forward, x, a_src, a_dst, a_edge, src_idx, dst_idx, negative_slope, dropout_p,
                           generator, return_attention)


@torch.library.impl(_lib, "gat_attention", "CPU")
def _gat_forward_cpu(x, a_src, a_dst, a_edge, src_idx, dst_idx, dst_group, dst_offsets, src_group, src_offsets,
                     negative_slope, dropout_p, generator, return_attention, check_indices):
    if not eager.arguments_checked():
        _check_gat(x, a_src, a_dst, a_edge, src_idx, dst_idx, negative_slope, dropout_p, generator)
    _gat_check_call_graph(x, a_src, a_dst, a_edge, src_idx, dst_idx, dst_group, dst_offsets)
    return _gat_forward_on_cpu(x, a_src, a_dst, a_edge, src_idx, dst_idx, dst_group, dst_offsets, src_group,
                               src_offsets, negative_slope, dropout_p, generator, return_attention, check_indices)[0]


@torch.library.impl(_lib, "gat_attention", "CUDA")
def _gat_forward_cuda(x, a_src, a_dst, a_edge, src_idx, dst_idx, dst_group, dst_offsets, src_group, src_offsets,
                      negative_slope, dropout_p, generator, return_attention, check_indices):
    if not eager.arguments_checked():
        _check_gat(x, a_src, a_dst, a_edge, src_idx, dst_idx, negative_slope, dropout_p, generator)
    if check_indices:
        _check_edges(a_dst, x, src_idx, dst_idx, dst_group, dst_offsets)
    dst_group, dst_offsets = _grouping(dst_group, dst_offsets, dst_idx, src_idx, a_dst.shape[0], x.shape[0])
    # The extension draws the dropout state from the CUDA generator (no wait for the device).
    return cuda_module().gat_forward(x, a_src, a_dst, a_edge, src_idx.contiguous(), dst_idx.contiguous(), dst_group,
                                     dst_offsets, negative_slope, dropout_p, generator, return_attention)


@torch.library.register_fake("edgedot::gat_attention")
def _gat_forward_fake(x, a_src, a_dst, a_edge, src_idx, dst_idx, dst_group, dst_offsets, src_group, src_offsets,
                      negative_slope, dropout_p, generator, return_attention, check_indices):
    _check_gat(x, a_src, a_dst, a_edge, src_idx, dst_idx, negative_slope, dropout_p, generator)
    return forward_fake(x, a_dst.shape[0], x.shape[2], src_idx.shape[0], dropout_p, return_attention)


@torch.library.impl(_lib, "gat_attention_backward", "CPU")
def _gat_backward_cpu(grad_out, x, a_src, a_dst, a_edge, out, lse, src_idx, dst_idx, dst_group, dst_offsets,
                      src_group, src_offsets, negative_slope, dropout_p, rng_state, a_edge_grad, src_grad):
    if not eager.arguments_checked():
        _check_gat(x, a_src, a_dst, a_edge, src_idx, dst_idx, negative_slope, dropout_p)
    return _backward_on_cpu(cpu_gat.gat_backward, grad_out, x, a_src, a_dst, a_edge, out, lse, src_idx, dst_idx,
                            negative_slope, dropout_p, rng_state, a_edge_grad, src_grad)


@torch.library.impl(_lib, "gat_attention_backward", "CUDA")
def _gat_backward_cuda(grad_out, x, a_src, a_dst, a_edge, out, lse, src_idx, dst_idx, dst_group, dst_offsets,
                       src_group, src_offsets, negative_slope, dropout_p, rng_state, a_edge_grad, src_grad):
    if not eager.arguments_checked():
        _check_gat(x, a_src, a_dst, a_edge, src_idx, dst_idx, negative_slope, dropout_p)
    # The grouping by source serves the source-side gradients alone.
    dst_group, dst_offsets, src_group, src_offsets = backward_groupings(
        dst_group, dst_offsets, src_group, src_offsets, src_idx, dst_idx, x.shape[0], a_dst.shape[0], src_grad)
    return cuda_module().gat_backward(grad_out, x, a_src, a_dst, a_edge, out, lse, src_idx.contiguous(),
                                      dst_idx.contiguous(), dst_group, dst_offsets, src_group, src_offsets,
                                      negative_slope, dropout_p, rng_state, a_edge_grad, src_grad,
                                      attention_ops.BACKWARD_RECORDS)


@torch.library.register_fake("edgedot::gat_attention_backward")
def _gat_backward_fake(grad_out, x, a_src, a_dst, a_edge, out, lse, src_idx, dst_idx, dst_group, dst_offsets,
                       src_group, src_offsets, negative_slope, dropout_p, rng_state, a_edge_grad, src_grad):
    _check_gat(x, a_src, a_dst, a_edge, src_idx, dst_idx, negative_slope, dropout_p)
    da_edge = x.new_empty((src_idx.shape[0], x.shape[1]) if a_edge_grad else (0,))
    dx, da_src = (x.new_empty(x.shape), x.new_empty(a_src.shape)) if src_grad else (x.new_empty(0), x.new_empty(0))
    return dx, da_src, x.new_empty(a_dst.shape), da_edge


# ------------------------------------------------------------------------------ GATv2


def _gatv2_forward_on_cpu(x_src, x_dst, att, edge_feat, src_idx, dst_idx, dst_group, dst_offsets, src_group,
                          src_offsets, negative_slope, dropout_p, generator, return_attention, check_indices):
    return _forward_on_cpu(cpu_gat.gatv2_forward, x_src, x_dst, att, edge_feat, src_idx, dst_idx, negative_slope,
                           dropout_p, generator, return_attention)


@torch.library.impl(_lib, "gatv2_attention", "CPU")
def _gatv2_forward_cpu(x_src, x_dst, att, edge_feat, src_idx, dst_idx, dst_group, dst_offsets, src_group,
                       src_offsets, negative_slope, dropout_p, generator, return_attention, check_indices):
    if not eager.arguments_checked():
        _check_gatv2(x_src, x_dst, att, edge_feat, src_idx, dst_idx, negative_slope, dropout_p, generator)
    _gatv2_check_call_graph(x_src, x_dst, att, edge_feat, src_idx, dst_idx, dst_group, dst_offsets)
    return _gatv2_forward_on_cpu(x_src, x_dst, att, edge_feat, src_idx, dst_idx, dst_group, dst_offsets, src_group,
                                 src_offsets, negative_slope, dropout_p, generator, return_attention,
                                 check_indices)[0]


@torch.library.impl(_lib, "gatv2_attention", "CUDA")
def _gatv2_forward_cuda(x_src, x_dst, att, edge_feat, src_idx, dst_idx, dst_group, dst_offsets, src_group,
                        src_offsets, negative_slope, dropout_p, generator, return_attention, check_indices):
    if not eager.arguments_checked():
        _check_gatv2(x_src, x_dst, att, edge_feat, src_idx, dst_idx, negative_slope, dropout_p, generator)
    if check_indices:
        _check_edges(x_dst, x_src, src_idx, dst_idx, dst_group, dst_offsets)
    dst_group, dst_offsets = _grouping(dst_group, dst_offsets, dst_idx, src_idx, x_dst.shape[0], x_src.shape[0])
    return cuda_module().gatv2_forward(x_src, x_dst, att, edge_feat, src_idx.contiguous(), dst_idx.contiguous(),
                                       dst_group, dst_offsets, negative_slope, dropout_p, generator, return_attention)


@torch.library.register_fake("edgedot::gatv2_attention")
def _gatv2_forward_fake(x_src, x_dst, att, edge_feat, src_idx, dst_idx, dst_group, dst_offsets, src_group,
                        src_offsets, negative_slope, dropout_p, generator, return_attention, check_indices):
    _check_gatv2(x_src, x_dst, att, edge_feat, src_idx, dst_idx, negative_slope, dropout_p, generator)
    return forward_fake(x_src, x_dst.shape[0], x_src.shape[2], src_idx.shape[0], dropout_p, return_attention)


@torch.library.impl(_lib, "gatv2_attention_backward", "CPU")
def _gatv2_backward_cpu(grad_out, x_src, x_dst, att, edge_feat, out, lse, src_idx, dst_idx, dst_group, dst_offsets,
                        src_group, src_offsets, negative_slope, dropout_p, rng_state, edge_feat_grad, src_grad):
    if not eager.arguments_checked():
        _check_gatv2(x_src, x_dst, att, edge_feat, src_idx, dst_idx, negative_slope, dropout_p)
    return _backward_on_cpu(cpu_gat.gatv2_backward, grad_out, x_src, x_dst, att, edge_feat, out, lse, src_idx,
                            dst_idx, negative_slope, dropout_p, rng_state, edge_feat_grad, src_grad)


@torch.library.impl(_lib, "gatv2_attention_backward", "CUDA")
def _gatv2_backward_cuda(grad_out, x_src, x_dst, att, edge_feat, out, lse, src_idx, dst_idx, dst_group, dst_offsets,
                         src_group, src_offsets, negative_slope, dropout_p, rng_state, edge_feat_grad, src_grad):
    if not eager.arguments_checked():
        _check_gatv2(x_src, x_dst, att, edge_feat, src_idx, dst_idx, negative_slope, dropout_p)
    dst_group, dst_offsets, src_group, src_offsets = backward_groupings(
        dst_group, dst_offsets, src_group, src_offsets, src_idx, dst_idx, x_src.shape[0], x_dst.shape[0], src_grad)
    return cuda_module().gatv2_backward(grad_out, x_src, x_dst, att, edge_feat, out, lse, src_idx.contiguous(),
                                        dst_idx.contiguous(), dst_group, dst_offsets, src_group, src_offsets,
                                        negative_slope, dropout_p, rng_state, edge_feat_grad, src_grad,
                                        attention_ops.BACKWARD_RECORDS)


@torch.library.register_fake("edgedot::gatv2_attention_backward")
def _gatv2_backward_fake(grad_out, x_src, x_dst, att, edge_feat, out, lse, src_idx, dst_idx, dst_group, dst_offsets,
                         src_group, src_offsets, negative_slope, dropout_p, rng_state, edge_feat_grad, src_grad):
    _check_gatv2(x_src, x_dst, att, edge_feat, src_idx, dst_idx, negative_slope, dropout_p)
    d_edge_feat = x_src.new_empty((src_idx.shape[0],) + tuple(x_src.shape[1:]) if edge_feat_grad else (0,))
    dx_src = x_src.new_empty(x_src.shape) if src_grad else x_src.new_empty(0)
    return dx_src, x_dst.new_empty(x_dst.shape), att.new_empty(att.shape), d_edge_feat


# ------------------------------------------------------------------------------ autograd

# Positions of the forward ops' differentiable arguments: GAT (x, a_src, a_dst, a_edge), GATv2
# (x_src, x_dst, att, edge_feat); the first (and for GAT the second) are the source side.
_NUM_INPUTS = 15


def _make_backward(backward_op, cpu_backward, source_inputs):
    """The autograd formula of a forward op whose inputs ``source_inputs`` (positions) are the
    source-side tensors; ``cpu_backward`` (the name of the :mod:`edgedot.cpu.gat` function) takes
    what an eager CPU forward kept."""
    def backward(ctx, grad_out, grad_lse, grad_alpha, grad_rng_state):
        if grad_out is None:  # out's gradient is undefined: so are the inputs'
            return (None,) * _NUM_INPUTS
        (feat, a, b, edge, out, lse, src_idx, dst_idx, dst_group, dst_offsets, src_group, src_offsets,
         rng_state) = ctx.saved_tensors
        needs = ctx.needs_input_grad
        edge_grad, src_grad = bool(needs[3]), any(needs[i] for i in source_inputs)
        kept = eager.take_kept(ctx)
        if kept is not None and not torch.is_grad_enabled():  # (create_graph: the op, whose autograd raises)
            grads = _backward_on_cpu(getattr(cpu_gat, cpu_backward), grad_out, feat, a, b, edge, out, lse, src_idx,
                                     dst_idx, ctx.score_arg, ctx.dropout_p, rng_state, edge_grad, src_grad, kept)
        else:
            grads = backward_op(grad_out, feat, a, b, edge, out, lse, src_idx, dst_idx, dst_group, dst_offsets,
                                src_group, src_offsets, ctx.score_arg, ctx.dropout_p, rng_state, edge_grad, src_grad)
        d_feat, d_a, d_b, d_edge = grads
        return (d_feat if needs[0] else None, d_a if needs[1] else None, d_b if needs[2] else None,
                d_edge if needs[3] else None) + (None,) * (_NUM_INPUTS - 4)
    return backward


# The forward ops' source-side inputs (positions): their gradients walk the edges by source.
_SOURCE_INPUTS = {gat_attention_op: (0, 1), gatv2_attention_op: (0,)}

eager.first_order_only(gat_attention_backward_op, "gat_attention")
eager.first_order_only(gatv2_attention_backward_op, "gatv2_attention")

# The forward ops' autograd, and the autograd.Function each takes in eager calls.
_EAGER_FUNCTIONS = {
    op: eager.register_autograd(op, name, _make_backward(backward_op, cpu_backward, _SOURCE_INPUTS[op]),
                                setup_context, cpu_forward, check_graph, cuda_autograd(cuda_name, check_graph))
    for name, op, backward_op, cpu_forward, check_graph, cpu_backward, cuda_name in (
        ("GatAttentionFunction", gat_attention_op, gat_attention_backward_op, _gat_forward_on_cpu,
         _gat_check_call_graph, "gat_backward", "gat_attention_autograd"),
        ("Gatv2AttentionFunction", gatv2_attention_op, gatv2_attention_backward_op, _gatv2_forward_on_cpu,
         _gatv2_check_call_graph, "gatv2_backward", "gatv2_attention_autograd"))}
