"""GAT's per-node logits ``<x[n, h], att[h]>`` (``GATConv``'s ``(x * att).sum(-1)``) as custom
operators: on CUDA one pass over ``x`` forward and one backward, with ``att``'s gradient summed
in a fixed order; on the CPU PyTorch's own product and sum.

``att`` is ``[H, C]``, or ``[2, H, C]`` for a layer's source and destination sides over the same
features: both logits from one read of ``x``, and one ``dx`` (the two sides' terms added in the
kernel, not by autograd).

``edgedot::gat_node_logits``            ``[N, H]`` (``[2, N, H]`` for two sides) in the promoted
                                       dtype of ``x`` and ``att``.
``edgedot::gat_node_logits_backward``   ``(dx, datt)`` in ``x``'s and ``att``'s dtypes, each an
                                       empty ``[0]`` tensor unless wanted.

The result dtype is PyTorch's promotion of the two, as for ``(x * att).sum(-1)``: a float32 ``att``
beside bfloat16 features (autocast) gives float32 logits, as PyG's layer computes them.
"""

import torch

from ..runtime import eager
from ..runtime.build import cuda_module
from ..runtime.checks import FEATURE_DTYPES, check_feature

__all__ = ["gat_node_logits", "gat_node_logit_sides", "check_node_logits_inputs"]

_lib = torch.library.Library("edgedot", "FRAGMENT")
_lib.define("gat_node_logits(Tensor x, Tensor att) -> Tensor")
_lib.define("gat_node_logits_backward(Tensor grad, Tensor x, Tensor att, bool x_grad, bool att_grad) "
            "-> (Tensor, Tensor)")


def gat_node_logits(x, att):
    """``a[n, h] = <x[n, h], att[h]>`` for ``x`` ``[N, H, C]`` and ``att`` ``[H, C]``; for ``att``
    ``[2, H, C]``, ``a[k, n, h] = <x[n, h], att[k, h]>`` (differentiable in both; see the module)."""
    check_node_logits_inputs(x, att)
    return eager.call(_node_logits_op, _NodeLogitsFunction, x, att)


def gat_node_logit_sides(x, att_src, att_dst):
    """``(a_src, a_dst)``, the logits of two attention vectors over one ``x`` ``[N, H, C]`` (each
    ``att`` of ``H * C`` elements in any shape, e.g. a layer's ``[1, H, C]`` parameters): what
    ``gat_node_logits(x, torch.cat([att_src, att_dst]).view(2, H, C)).unbind(0)`` gives, with the same
    gradients. On CUDA in plain eager mode without that concatenation or the stacking of the two
    gradients in the backward."""
    check_feature("x", x)
    if x.dim() != 3:
        raise ValueError(f"x must be 3-D [N, H, C], got shape {tuple(x.shape)}")
    heads, dim = x.shape[1], x.shape[2]
    for name, att in (("att_src", att_src), ("att_dst", att_dst)):
        if not isinstance(att, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(att).__name__}")
        if att.dtype not in FEATURE_DTYPES:
            raise TypeError(f"{name} must be float32, float64, float16 or bfloat16, got {att.dtype}")
        if att.numel() != heads * dim:
            raise ValueError(f"{name} must hold H x C = {heads} x {dim} elements, got shape {tuple(att.shape)}")
        if att.device != x.device:
            raise ValueError(f"x is on {x.device} but {name} is on {att.device}; they must share a device")
    if x.is_cuda and eager.plain_eager(x, att_src, att_dst):
        a_src, a_dst = cuda_module().node_logits_sides_autograd(x, att_src, att_dst)
        return a_src, a_dst
    att = torch.cat([att_src.reshape(1, heads, dim), att_dst.reshape(1, heads, dim)])
    return gat_node_logits(x, att).unbind(0)


def check_node_logits_inputs(x, att):
    """TypeError / ValueError naming the malformed argument."""
    check_feature("x", x)
    if not isinstance(att, torch.Tensor):
        raise TypeError(f"att must be a tensor, got {type(att).__name__}")
    if att.dtype not in FEATURE_DTYPES:
        raise TypeError(f"att must be float32, float64, float16 or bfloat16, got {att.dtype}")
    if x.dim() != 3:
        raise ValueError(f"x must be 3-D [N, H, C], got shape {tuple(x.shape)}")
    if tuple(att.shape) not in (tuple(x.shape[1:]), (2,) + tuple(x.shape[1:])):
        raise ValueError(f"att must be [H, C] or [2, H, C] with [H, C] = {list(x.shape[1:])}, "
                         f"got shape {tuple(att.shape)}")
    if att.device != x.device:
        raise ValueError(f"x is on {x.device} but att is on {att.device}; they must share a device")


@torch.library.impl(_lib, "gat_node_logits", "CPU")
def _forward_cpu(x, att):
    if not eager.arguments_checked():
        check_node_logits_inputs(x, att)
    if att.dim() == 2:
        return (x * att).sum(-1)
    return torch.stack([(x * side).sum(-1) for side in att])


@torch.library.impl(_lib, "gat_node_logits", "CUDA")
def _forward_cuda(x, att):
    if not eager.arguments_checked():
        check_node_logits_inputs(x, att)
    return cuda_module().node_logits_forward(x, att)


@torch.library.register_fake("edgedot::gat_node_logits")
def _forward_fake(x, att):
    check_node_logits_inputs(x, att)
    return x.new_empty(att.shape[:-2] + x.shape[:2], dtype=torch.result_type(x, att))


@torch.library.impl(_lib, "gat_node_logits_backward", "CPU")
def _backward_cpu(grad, x, att, x_grad, att_grad):
    if not eager.arguments_checked():
        check_node_logits_inputs(x, att)
    sides = att.reshape(-1, *att.shape[-2:])  # [K, H, C]
    grads = grad.reshape(len(sides), *grad.shape[-2:]).unsqueeze(-1)  # [K, N, H, 1]
    dx = datt = None
    if x_grad:
        dx = grads[0] * sides[0]
        for g, side in zip(grads[1:], sides[1:]):
            dx = dx + g * side
    if att_grad:
        datt = torch.stack([(g * x).sum(0) for g in grads]).view(att.shape)
    dx = x.new_empty(0) if dx is None else dx.to(x.dtype)
    return dx, (att.new_empty(0) if datt is None else datt.to(att.dtype))


@torch.library.impl(_lib, "gat_node_logits_backward", "CUDA")
def _backward_cuda(grad, x, att, x_grad, att_grad):
    if not eager.arguments_checked():
        check_node_logits_inputs(x, att)
    return cuda_module().node_logits_backward(grad, x, att, x_grad, att_grad)


@torch.library.register_fake("edgedot::gat_node_logits_backward")
def _backward_fake(grad, x, att, x_grad, att_grad):
    check_node_logits_inputs(x, att)
    return (x.new_empty(x.shape) if x_grad else x.new_empty(0),
            att.new_empty(att.shape) if att_grad else att.new_empty(0))


def _setup_context(ctx, inputs, output):
    x, att = inputs
    ctx.save_for_backward(x, att)


def _backward(ctx, grad):
    x, att = ctx.saved_tensors
    x_grad, att_grad = ctx.needs_input_grad
    dx, datt = torch.ops.edgedot.gat_node_logits_backward(grad, x, att, x_grad, att_grad)
    return (dx if x_grad else None), (datt if att_grad else None)


def _backward_setup_context(ctx, inputs, output):
    grad, x, att, x_grad, att_grad = inputs
    ctx.save_for_backward(grad, x, att)
    ctx.wanted = (x_grad, att_grad)


def _backward_backward(ctx, ddx, ddatt):
    """The backward is linear in each of ``grad``, ``x`` and ``att``: its derivatives are the two
    ops again (``dx = sum_k grad[k] att[k]``, ``datt[k] = sum_n grad[k, n] x[n]``)."""
    grad, x, att = ctx.saved_tensors
    x_grad, att_grad = ctx.wanted
    ddx = ddx if x_grad else None  # an unwanted output is an empty placeholder
    ddatt = ddatt if att_grad else None
    needs = ctx.needs_input_grad
    dgrad = dx = datt = None
    if needs[0]:
        if ddx is not None:
            dgrad = gat_node_logits(ddx, att)
        if ddatt is not None:
            term = gat_node_logits(x, ddatt)
            dgrad = term if dgrad is None else dgrad + term
    if needs[1] and ddatt is not None:
        dx = torch.ops.edgedot.gat_node_logits_backward(grad, x, ddatt, True, False)[0]
    if needs[2] and ddx is not None:
        datt = torch.ops.edgedot.gat_node_logits_backward(grad, ddx, att, False, True)[1]
    return dgrad, dx, datt, None, None


torch.library.register_autograd("edgedot::gat_node_logits_backward", _backward_backward,
                                setup_context=_backward_setup_context)

_node_logits_op = torch.ops.edgedot.gat_node_logits.default
_NodeLogitsFunction = eager.register_autograd(_node_logits_op, "NodeLogitsFunction", _backward, _setup_context,
                                              cuda_call=lambda x, att: cuda_module().node_logits_autograd(x, att))
