"""The public entry point, :func:`edge_dot`."""

import torch

from .ops import edge_dot_op

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
        check_indices: raise ``IndexError`` (CUDA: ``RuntimeError`` naming the index tensor) if
            an index is out of range. On CUDA the check waits for the kernel to finish; with
            ``False`` the call is fully asynchronous and out-of-range edges yield NaN instead.
            Inside CUDA-graph capture the wait is skipped. Out-of-range indices are never read.

    Returns:
        ``[E]`` if both feature tensors are 2-D, else ``[E, H]``, in the features' dtype.
        Differentiable with respect to both feature tensors.
    """
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    if plan is None:
        src_plan = dst_plan = None
    else:
        plan.check_matches(src_feat, dst_feat, src_idx)
        src_plan, dst_plan = plan.src, plan.dst
    return edge_dot_op(src_feat, dst_feat, src_idx, dst_idx, src_plan, dst_plan, deterministic, check_indices)
