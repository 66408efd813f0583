"""Edges given grouped by destination: a CSR pointer (``graph_attention``'s ``dst_ptr``) instead of
a per-call sort."""

import torch

from ._checks import TensorMemo

__all__ = ["index_to_ptr", "check_dst_ptr"]

# Pointers already found to agree with an index tensor; the fact is that tensor's identity.
_agreeing_pointers = TensorMemo()


def index_to_ptr(idx, num_rows):
    """The CSR pointer of an index sorted in non-decreasing order: int64 ``[num_rows + 1]``,
    ``ptr[r]`` = the first position whose index is ``>= r`` (one search, no sort, no host
    synchronisation; PyG's ``index2ptr``). For ``graph_attention(..., dst_ptr=index_to_ptr(dst_idx,
    Nd))`` when ``dst_idx`` is sorted, which ``graph_attention`` then checks."""
    if not isinstance(idx, torch.Tensor) or idx.dim() != 1 or idx.dtype not in (torch.int32, torch.int64):
        raise TypeError("idx must be a 1-D int32 or int64 tensor")
    if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows < 0:
        raise ValueError(f"num_rows must be a non-negative int, got {num_rows!r}")
    rows = torch.arange(num_rows + 1, device=idx.device, dtype=idx.dtype)
    return torch.searchsorted(idx, rows)


def _identity(t):
    return (t.data_ptr(), t._version, tuple(t.shape), t.dtype, t.device)


def check_dst_ptr(dst_ptr, dst_idx, num_dst, validate):
    """``dst_ptr`` as int64, after checking its type and shape (ValueError / TypeError naming it)
    and, with ``validate``, that it is ``dst_idx``'s CSR pointer: it starts at 0, ends at E, never
    decreases, and edge i lies in the range of its destination ``dst_idx[i]`` (one wait for the
    device, remembered until either tensor changes)."""
    if not isinstance(dst_ptr, torch.Tensor):
        raise TypeError(f"dst_ptr must be a tensor or None, got {type(dst_ptr).__name__}")
    if dst_ptr.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"dst_ptr must be int32 or int64, got {dst_ptr.dtype}")
    if dst_ptr.dim() != 1 or dst_ptr.shape[0] != num_dst + 1:
        raise ValueError(f"dst_ptr must be 1-D [num_dst + 1] = [{num_dst + 1}], got shape {tuple(dst_ptr.shape)}")
    if dst_ptr.device != dst_idx.device:
        raise ValueError(f"dst_ptr is on {dst_ptr.device} but dst_idx is on {dst_idx.device}")
    ptr = dst_ptr.to(torch.int64).contiguous()
    if not validate or _agreeing_pointers.get(dst_ptr) == _identity(dst_idx):
        return ptr
    if dst_idx.is_cuda and torch.cuda.is_current_stream_capturing():
        return ptr  # nothing may wait during capture; the kernels turn a wrong pointer into NaN
    num_edges = dst_idx.shape[0]
    # One wait: every condition in one tensor, read once.
    rows = torch.searchsorted(ptr, torch.arange(num_edges, device=ptr.device), right=True) - 1
    ok = (ptr[0] == 0) & (ptr[-1] == num_edges) & (ptr[1:] >= ptr[:-1]).all() & (rows == dst_idx).all()
    if not bool(ok):
        if int(ptr[0]) != 0 or int(ptr[-1]) != num_edges or not bool((ptr[1:] >= ptr[:-1]).all()):
            raise ValueError(f"dst_ptr must rise from 0 to E={num_edges} without decreasing (a CSR pointer by "
                             f"destination)")
        bad = int(torch.nonzero(rows != dst_idx)[0, 0])
        raise ValueError(f"dst_ptr disagrees with dst_idx: edge {bad} has destination {int(dst_idx[bad])} but lies "
                         f"in the range of node {int(rows[bad])} (are the edges sorted by destination?)")
    _agreeing_pointers.put(dst_ptr, _identity(dst_idx))
    return ptr
