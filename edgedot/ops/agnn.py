"""Fused AGNN attention (PyG's ``AGNNConv``): :func:`agnn_attention`, softmax attention of each node
over its incoming edges scored by a learned multiple of the cosine similarity, with nothing of
``E x H x C`` materialised; and the custom operators behind it (the pattern of
:mod:`edgedot.ops.attention`).

``edgedot::agnn_attention``           forward: ``(out, lse, alpha)``.
``edgedot::agnn_attention_backward``  ``(d_x_norm, dx, d_beta)`` by recomputation from ``lse``.

The operators take ``x_norm`` (``x`` normalised by the caller, so that autograd differentiates the
normalisation) and ``x``: graph attention with ``x_norm`` as queries and keys, ``x`` as values and
``beta`` as a per-head scale. Groupings, offsets and ``lse``'s dtype mean what they mean for
``edgedot::graph_attention``; AGNN has no dropout. ``beta`` may have another float dtype than
``x`` (PyG's float32 parameter beside half features under autocast): it is rounded to ``x``'s
dtype and its gradient comes back in its own dtype and shape.
"""

import torch
import torch.nn.functional as F

from ..cpu import agnn as cpu_agnn
from ..runtime import eager
from ..runtime.build import cuda_module
from ..runtime.checks import FEATURE_DTYPES, check_indices_pair
from . import attention as attention_ops
from .attention import _grouping, backward_groupings, check_options, edge_groupings, forward_fake
from .attention import _check_graph as _check_edges
from .gat import _check_dtype, _check_features, _check_graph, _check_shape, _check_tensors

__all__ = ["agnn_attention", "agnn_attention_op", "agnn_attention_backward_op", "check_agnn_inputs"]


def agnn_attention(x, beta, src_idx, dst_idx, *, plan=None, dst_ptr=None, check_indices=True,
                   return_attention=False):
    """AGNN attention (PyG's ``AGNNConv``) over the edges of a graph.

    With ``x_norm = F.normalize(x, p=2, dim=-1)``, for each edge ``e`` from ``s = src_idx[e]`` to
    ``n = dst_idx[e]`` and head ``h``::

        score[e, h] = beta[h] * <x_norm[n, h], x_norm[s, h]>
        alpha[e, h] = softmax of score[:, h] over the edges into n
        out[n, h]   = sum over edges e into n of alpha[e, h] * x[s, h]

    The normalisation runs in PyTorch (autograd differentiates it); the rest is one fused op.
    A node without incoming edges gets zeros. The graph is not bipartite: sources and
    destinations are the same ``N`` nodes.

    Args:
        x: ``[N, C]`` or ``[N, H, C]`` node features (float32, float64, float16 or bfloat16; half
            types accumulate in float32; on CUDA ``C`` is at most 256); may be a strided view.
        beta: ``[1]`` or ``[H]`` scale of the cosine scores (one for all heads, or one per head),
            a float tensor of any of those dtypes, rounded to ``x``'s dtype by the kernels (a
            float32 parameter beside bfloat16 features, as under autocast, is fine).
        src_idx, dst_idx: 1-D int32 or int64 tensors of length ``E``, in any order.
        plan: an :class:`edgedot.EdgePlan` of this graph (``EdgePlan(src_idx, dst_idx, N, N)``):
            the edges' groupings by destination and by source are built once instead of in every
            call.
        dst_ptr: for edges already sorted by destination: int32/int64 ``[N + 1]`` CSR pointer
            (:func:`edgedot.index_to_ptr`); no sort in the forward. Checked against ``dst_idx``
            as in :func:`edgedot.graph_attention` (``ValueError`` naming ``dst_ptr``). Not
            together with ``plan``.
        check_indices: raise ``IndexError`` naming the index tensor if an index is out of range,
            as :func:`edgedot.graph_attention` does (on CUDA without a wait for the device: the
            error is raised by a later edgedot call, at the latest by
            :func:`edgedot.wait_for_checks`; the CPU checks during the call).
        return_attention: also return ``alpha`` (not differentiable): ``[E, H]``, or ``[E]`` for
            a 2-D ``x``.

    Returns:
        ``out`` shaped like ``x``, in ``x``'s dtype, differentiable in ``x`` and ``beta``;
        ``(out, alpha)`` with ``return_attention=True``.

    Bitwise reproducible (no float atomics); the backward recomputes the scores from a per-node
    log-sum-exp, keeping only ``O(N * H)`` floats from the forward.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a tensor, got {type(x).__name__}")
    if x.dim() not in (2, 3):
        raise ValueError(f"x must be [N, C] or [N, H, C], got shape {tuple(x.shape)}")
    flat = x.dim() == 2
    x = x.unsqueeze(1) if flat else x
    check_agnn_inputs(x, x, beta, src_idx, dst_idx)
    check_options(x.device, 0.0, None, plan, check_indices, return_attention)
    groups, check_indices = edge_groupings(plan, dst_ptr, x, x, src_idx, dst_idx, check_indices, (x, beta))
    out, _, alpha = eager.call(agnn_attention_op, _AgnnAttentionFunction, F.normalize(x, p=2.0, dim=-1), x, beta,
                               src_idx, dst_idx, *groups, return_attention, check_indices)
    if flat:
        out, alpha = out.squeeze(1), alpha.squeeze(1) if return_attention else alpha
    return (out, alpha) if return_attention else out


def check_agnn_inputs(x_norm, x, beta, src_idx, dst_idx):
    """Raises TypeError / ValueError naming the first malformed tensor argument of the AGNN
    operators (``x`` ``[N, H, C]``, ``x_norm`` like it, ``beta`` ``[1]`` or ``[H]``)."""
    _check_tensors((("x", x), ("x_norm", x_norm), ("beta", beta), ("src_idx", src_idx), ("dst_idx", dst_idx)))
    _check_features("x", x)
    if x.dtype not in FEATURE_DTYPES:
        raise TypeError(f"x must be float32, float64, float16 or bfloat16, got {x.dtype}")
    if x_norm is not x:
        _check_shape("x_norm", x_norm, x.shape, "[N, H, C] as x")
        _check_dtype("x_norm", x_norm, x, "x")
    heads = x.shape[1]
    if beta.dtype not in FEATURE_DTYPES:
        raise TypeError(f"beta must be float32, float64, float16 or bfloat16, got {beta.dtype}")
    if beta.dim() != 1 or beta.shape[0] not in (1, heads):
        raise ValueError(f"beta must be [1] or [H] = [{heads}], got shape {tuple(beta.shape)}")
    check_indices_pair(src_idx, dst_idx)
    _check_graph("x", (("x", x), ("x_norm", x_norm), ("beta", beta)), src_idx, dst_idx, x.shape[0], x.shape[0],
                 x.shape[2])


# ------------------------------------------------------------------------------ the custom operators

_lib = torch.library.Library("edgedot", "FRAGMENT")
_GRAPH = ("Tensor src_idx, Tensor dst_idx, Tensor? dst_group, Tensor? dst_offsets, Tensor? src_group, "
          "Tensor? src_offsets")
_lib.define(f"agnn_attention(Tensor x_norm, Tensor x, Tensor beta, {_GRAPH}, bool return_attention, "
            f"bool check_indices) -> (Tensor out, Tensor lse, Tensor alpha)")
_lib.define(f"agnn_attention_backward(Tensor grad_out, Tensor x_norm, Tensor x, Tensor beta, Tensor out, "
            f"Tensor lse, {_GRAPH}) -> (Tensor d_x_norm, Tensor dx, Tensor d_beta)")

agnn_attention_op = torch.ops.edgedot.agnn_attention.default
agnn_attention_backward_op = torch.ops.edgedot.agnn_attention_backward.default


def _beta_grad(d_beta, beta):
    """The kernels' per-head ``d_beta`` (accumulation dtype) in ``beta``'s shape and dtype."""
    if beta.shape[0] != d_beta.shape[0]:
        d_beta = d_beta.sum(0, keepdim=True)  # one beta for every head
    return d_beta.to(beta.dtype)


@torch.library.impl(_lib, "agnn_attention", "CPU")
def _forward_cpu(x_norm, x, beta, src_idx, dst_idx, dst_group, dst_offsets, src_group, src_offsets,
                 return_attention, check_indices):
    if not eager.arguments_checked():
        check_agnn_inputs(x_norm, x, beta, src_idx, dst_idx)
    _check_edges(x, x, src_idx, dst_idx, dst_group, dst_offsets)  # always on the CPU
    return cpu_agnn.forward(x_norm, x, beta, src_idx, dst_idx, return_attention)


@torch.library.impl(_lib, "agnn_attention", "CUDA")
def _forward_cuda(x_norm, x, beta, src_idx, dst_idx, dst_group, dst_offsets, src_group, src_offsets,
                  return_attention, check_indices):
    if not eager.arguments_checked():
        check_agnn_inputs(x_norm, x, beta, src_idx, dst_idx)
    if check_indices:
        _check_edges(x, x, src_idx, dst_idx, dst_group, dst_offsets)
    dst_group, dst_offsets = _grouping(dst_group, dst_offsets, dst_idx, src_idx, x.shape[0], x.shape[0])
    return cuda_module().agnn_forward(x_norm, x, beta, src_idx.contiguous(), dst_idx.contiguous(), dst_group,
                                      dst_offsets, return_attention)


@torch.library.register_fake("edgedot::agnn_attention")
def _forward_fake(x_norm, x, beta, src_idx, dst_idx, dst_group, dst_offsets, src_group, src_offsets,
                  return_attention, check_indices):
    check_agnn_inputs(x_norm, x, beta, src_idx, dst_idx)
    return forward_fake(x, x.shape[0], x.shape[2], src_idx.shape[0], 0.0, return_attention)[:3]


@torch.library.impl(_lib, "agnn_attention_backward", "CPU")
def _backward_cpu(grad_out, x_norm, x, beta, out, lse, src_idx, dst_idx, dst_group, dst_offsets, src_group,
                  src_offsets):
    if not eager.arguments_checked():
        check_agnn_inputs(x_norm, x, beta, src_idx, dst_idx)
    d_x_norm, dx, d_beta = cpu_agnn.backward(grad_out, x_norm, x, beta, out, lse, src_idx, dst_idx)
    return d_x_norm, dx, _beta_grad(d_beta, beta)


@torch.library.impl(_lib, "agnn_attention_backward", "CUDA")
def _backward_cuda(grad_out, x_norm, x, beta, out, lse, src_idx, dst_idx, dst_group, dst_offsets, src_group,
                   src_offsets):
    if not eager.arguments_checked():
        check_agnn_inputs(x_norm, x, beta, src_idx, dst_idx)
    num_nodes = x.shape[0]
    dst_group, dst_offsets, src_group, src_offsets = backward_groupings(
        dst_group, dst_offsets, src_group, src_offsets, src_idx, dst_idx, num_nodes, num_nodes, True)
    d_x_norm, dx, d_beta = cuda_module().agnn_backward(grad_out, x_norm, x, beta, out, lse, src_idx.contiguous(),
                                                       dst_idx.contiguous(), dst_group, dst_offsets, src_group,
                                                       src_offsets, attention_ops.BACKWARD_RECORDS)
    return d_x_norm, dx, _beta_grad(d_beta, beta)


@torch.library.register_fake("edgedot::agnn_attention_backward")
def _backward_fake(grad_out, x_norm, x, beta, out, lse, src_idx, dst_idx, dst_group, dst_offsets, src_group,
                   src_offsets):
    check_agnn_inputs(x_norm, x, beta, src_idx, dst_idx)
    return x_norm.new_empty(x_norm.shape), x.new_empty(x.shape), beta.new_empty(beta.shape)


# ------------------------------------------------------------------------------ autograd

_NUM_INPUTS = 11


def _setup_context(ctx, inputs, output):
    x_norm, x, beta, src_idx, dst_idx, dst_group, dst_offsets, src_group, src_offsets = inputs[:9]
    out, lse, alpha = output
    # alpha is returned for inspection: the backward has no term for it.
    ctx.mark_non_differentiable(lse, alpha)
    ctx.set_materialize_grads(False)  # no zeros of E x H for alpha's absent gradient
    ctx.save_for_backward(x_norm, x, beta, out, lse, src_idx, dst_idx, dst_group, dst_offsets, src_group,
                          src_offsets)


def _backward(ctx, grad_out, grad_lse, grad_alpha):
    if grad_out is None:  # out's gradient is undefined: so are the inputs'
        return (None,) * _NUM_INPUTS
    x_norm, x, beta, out, lse, *graph = ctx.saved_tensors
    grads = agnn_attention_backward_op(grad_out, x_norm, x, beta, out, lse, *graph)
    return tuple(g if need else None for g, need in zip(grads, ctx.needs_input_grad[:3])) + \
        (None,) * (_NUM_INPUTS - 3)


eager.first_order_only(agnn_attention_backward_op, "agnn_attention")
_AgnnAttentionFunction = eager.register_autograd(agnn_attention_op, "AgnnAttentionFunction", _backward,
                                                 _setup_context)
