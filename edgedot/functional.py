"""The public entry point, :func:`edge_dot`."""

import torch

from .runtime.checks import check_tensors
from .ops import EagerCUDAEdgeDot, edge_dot_op, forward_cuda

_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor

__all__ = ["edge_dot"]


def edge_dot(src_feat, dst_feat, src_idx, dst_idx, *, plan=None, deterministic=None, check_indices=True):
    """Edge-wise dot products: ``out[e] = <src_feat[src_idx[e]], dst_feat[dst_idx[e]]>``.

    Args:
        src_feat: ``[Ns, D]`` or ``[Ns, H, D]`` features of the source nodes.
        dst_feat: ``[Nd, D]`` or ``[Nd, H, D]`` features of the destination nodes; a head count
            of 1 on one side broadcasts against ``H`` on the other. Same dtype as ``src_feat``
            (float32, float64, float16 or bfloat16; half types accumulate in float32).
        src_idx, dst_idx: 1-D int32 or int64 tensors of length ``E``, read as they are.
        plan: an :class:`edgedot.EdgePlan` of this graph. The backward then reduces each
            gradient row without atomics: deterministic, and no re-sorting per step.
        deterministic: bitwise-reproducible gradients. ``None`` (default) follows
            ``torch.are_deterministic_algorithms_enabled()``. Without a plan this sorts the
            edges in every backward pass.
        check_indices: raise ``IndexError`` naming the index tensor if an index is out of range.
            On CUDA the check waits for the kernel to finish; an index tensor found in range is
            remembered until it is modified in place, so repeated calls on one graph skip the
            wait. With ``False`` the call is always asynchronous and out-of-range edges yield
            NaN. Inside CUDA-graph capture the wait is skipped. Out-of-range indices are never
            read.

    Returns:
        ``[E]`` if both feature tensors are 2-D, else ``[E, H]``, in the features' dtype.
        Differentiable with respect to both feature tensors.
    """
    eager_cuda = _eager_cuda(src_feat, dst_feat, src_idx, dst_idx)
    if eager_cuda and plan is None and not (torch.is_grad_enabled()
                                            and (src_feat.requires_grad or dst_feat.requires_grad)):
        return forward_cuda(src_feat, dst_feat, src_idx, dst_idx, check_indices)
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    if plan is None:
        src_plan = dst_plan = None
    else:
        check_tensors(src_feat, dst_feat, src_idx, dst_idx)
        plan.check_matches(src_feat, dst_feat, src_idx)
        src_plan, dst_plan = plan.src, plan.dst
    args = (src_feat, dst_feat, src_idx, dst_idx, src_plan, dst_plan, deterministic, check_indices)
    if eager_cuda:
        return EagerCUDAEdgeDot.apply(*args)
    # Every implementation checks its inputs; a non-tensor must be named before the dispatcher
    # refuses it in its own words.
    check_tensors(src_feat, dst_feat, src_idx, dst_idx)
    return edge_dot_op(*args)


def _eager_cuda(src_feat, dst_feat, src_idx, dst_idx):
    # Plain CUDA tensors outside tracing skip the dispatcher; fake, functorch-wrapped or other
    # subclassed tensors, and torch.compile, go through the registered op.
    return (type(src_feat) in _PLAIN and type(dst_feat) in _PLAIN and type(src_idx) in _PLAIN
            and type(dst_idx) in _PLAIN and src_feat.is_cuda and not torch.compiler.is_compiling()
            and not _is_wrapped(src_feat) and not _is_wrapped(dst_feat))


_PLAIN = (torch.Tensor, torch.nn.Parameter)
