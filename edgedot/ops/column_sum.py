"""Column sums ``x.sum(0)`` of a tall ``[rows, width]`` tensor as a custom operator, for the layers'
bias gradients: on CUDA a two-stage sum in an order fixed by the shape (bitwise reproducible;
1.6-4.4x faster than PyTorch's reduction for widths of 128-384 on an H200, NOTES.md's run log); on
the CPU PyTorch's own sum.

``edgedot::column_sum``   ``[width]`` in ``x``'s dtype, accumulated in float32 (float64 for float64).

:func:`linear` and :func:`add_bias` are ``F.linear`` and ``x + bias`` whose bias gradient is such
a sum; every other gradient is computed as PyTorch computes it. :func:`linear_sides` is
:func:`linear` split into equal column blocks, whose gradients join without a copy where the
attention ops wrote them into one buffer.
"""

import torch
import torch.nn.functional as F

from ..runtime import eager
from ..runtime.build import cuda_module
from ..runtime.checks import check_float_tensor

__all__ = ["column_sum", "linear", "linear_sides", "add_bias"]

_lib = torch.library.Library("edgedot", "FRAGMENT")
_lib.define("column_sum(Tensor x) -> Tensor")


def column_sum(x):
    """``x.sum(0)`` for a 2-D ``x`` (differentiable; see the module)."""
    _check(x)
    return eager.call(_column_sum_op, _ColumnSumFunction, x)


def _check(x):
    check_float_tensor("x", x, lambda t: t.dim() == 2, "2-D [rows, width]")


@torch.library.impl(_lib, "column_sum", "CPU")
def _column_sum_cpu(x):
    if not eager.arguments_checked():
        _check(x)
    return x.sum(0)


@torch.library.impl(_lib, "column_sum", "CUDA")
def _column_sum_cuda(x):
    if not eager.arguments_checked():
        _check(x)
    return cuda_module().column_sum(x)


@torch.library.register_fake("edgedot::column_sum")
def _column_sum_fake(x):
    _check(x)
    return x.new_empty(x.shape[1:])


def _setup_context(ctx, inputs, output):
    ctx.rows = inputs[0].shape[0]


def _backward(ctx, grad):
    return grad.unsqueeze(0).expand(ctx.rows, -1)


_column_sum_op = torch.ops.edgedot.column_sum.default
_ColumnSumFunction = eager.register_autograd(_column_sum_op, "ColumnSumFunction", _backward, _setup_context)


# Tensors the C++ nodes take as they are: subclasses keep PyTorch's ops (and their __torch_function__).
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _tall(x, bias, *others):
    """Whether the column sum pays: plain CUDA tensors with a bias, outside torch.compile's tracing
    (which keeps PyTorch's own ops to fuse) and functorch's transforms. There the extension's C++
    autograd nodes serve (csrc/common/linear_autograd.cpp): their backward runs no Python on
    autograd's device thread."""
    return (bias is not None and x.is_cuda and all(type(t) in _PLAIN for t in (x, bias) + others)
            and not torch.compiler.is_compiling() and not torch._C._are_functorch_transforms_active())


def add_bias(x, bias):
    """``x + bias`` for ``bias`` ``[F]`` broadcast along ``x``'s last dim ``F``; ``bias`` may be
    ``None`` (``x`` returned)."""
    if bias is None:
        return x
    if (not _tall(x, bias) or not torch.is_grad_enabled() or not bias.requires_grad or bias.dim() != 1
            or x.dim() == 0 or x.shape[-1] != bias.shape[0]):
        return x + bias
    return cuda_module().add_bias_autograd(x, bias)


def _extension_linear(x, weight, bias, *others):
    """Whether :func:`linear` (:func:`linear_sides`, ``others`` its further parameters) takes the
    extension's node (see :func:`_tall`)."""
    return not (x.dim() != 2 or not _tall(x, bias, weight, *others) or not torch.is_grad_enabled()
                or not bias.requires_grad or any(t.dtype == torch.float64 for t in (x, weight, bias) + others))


def _autocast_args(x, weight, bias):
    """``x``, ``weight`` and ``bias`` cast as autocast casts them for ``F.linear``."""
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        x, weight, bias = x.to(dtype), weight.to(dtype), bias.to(dtype)
    return x, weight, bias


def linear(x, weight, bias=None):
    """``F.linear(x, weight, bias)`` for a 2-D ``x``; under autocast ``x``, ``weight`` and ``bias`` are
    cast as autocast casts them for ``F.linear``."""
    if not _extension_linear(x, weight, bias):
        return F.linear(x, weight, bias)
    x, weight, bias = _autocast_args(x, weight, bias)
    with torch.autocast(x.device.type, enabled=False):
        return cuda_module().linear_autograd(x, weight, bias)


def linear_sides(x, weights, biases=None, heads=1):
    """``F.linear`` of a 2-D ``x`` by several weights of one shape ``[width, in]`` (``biases``: one
    ``[width]`` per weight, or None) as one GEMM: a list of one ``[rows, heads, width / heads]`` view
    per weight, the column blocks of one result (the projections of one input). Outputs and
    gradients are those of ``F.linear(x, torch.cat(weights), torch.cat(biases))`` viewed as
    ``[rows, sides, heads, width / heads]`` and unbound; where the blocks' gradients are the column
    blocks of one buffer (as :func:`edgedot.graph_attention` and :func:`edgedot.gatv2_attention`
    write them for such inputs) the GEMMs take that buffer without a copy. Under autocast ``x`` and
    the parameters are cast as autocast casts them for ``F.linear``."""
    weights, biases = list(weights), list(biases) if biases is not None else []
    if not _extension_linear(x, weights[0], biases[0] if biases else None, *weights[1:], *biases[1:]):
        _check_sides(weights, biases, heads)  # (the extension's node checks its own)
        bias = torch.cat(biases) if biases else None
        return list(F.linear(x, torch.cat(weights), bias).view(x.shape[0], len(weights), heads, -1).unbind(1))
    cast = torch.is_autocast_enabled(x.device.type)
    if cast:
        x = x.to(torch.get_autocast_dtype(x.device.type))
    with torch.autocast(x.device.type, enabled=False):
        return cuda_module().linear_sides_autograd(x, weights, biases, heads, cast)


def _check_sides(weights, biases, heads):
    """ValueError naming the argument of :func:`linear_sides` that does not fit the others."""
    shape = tuple(weights[0].shape)
    if len(shape) != 2 or any(tuple(w.shape) != shape for w in weights):
        raise ValueError(f"weights must share one 2-D shape [width, in], got {[tuple(w.shape) for w in weights]}")
    if not isinstance(heads, int) or heads < 1 or shape[0] % heads:
        raise ValueError(f"heads must be a positive divisor of the weights' width {shape[0]}, got {heads}")
    if biases and (len(biases) != len(weights) or any(tuple(b.shape) != shape[:1] for b in biases)):
        raise ValueError(f"biases must be one [{shape[0]}] per weight, got {[tuple(b.shape) for b in biases]}")
