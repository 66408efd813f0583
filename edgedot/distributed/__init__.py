"""Edge dot products past one GPU: feature tables sharded by rows over a ``torch.distributed``
process group (NCCL between GPUs, gloo on CPU), see :class:`ShardedEdgeDot`."""

from .sharded import ShardedEdgeDot

__all__ = ["ShardedEdgeDot"]
