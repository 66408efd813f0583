"""Edges given grouped by destination: a CSR pointer (``graph_attention``'s ``dst_ptr``) instead of
a per-call sort."""

import torch

__all__ = ["index_to_ptr", "check_dst_ptr"]

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


def check_dst_ptr(dst_ptr, dst_idx, num_dst):
    """Checks ``dst_ptr``'s type, dtype, shape and device (TypeError / ValueError naming it) and
    returns it as given. Whether it is ``dst_idx``'s CSR pointer is checked with the indices' ranges
    by the op (:func:`edgedot.runtime.checks.check_graph`, one wait for a new graph)."""
    if not isinstance(dst_ptr, torch.Tensor):
        raise TypeError(f"dst_ptr must be a tensor or None, got {type(dst_ptr).__name__}")
    if dst_ptr.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"dst_ptr must be int32 or int64, got {dst_ptr.dtype}")
    if dst_ptr.dim() != 1 or dst_ptr.shape[0] != num_dst + 1:
        raise ValueError(f"dst_ptr must be 1-D [num_dst + 1] = [{num_dst + 1}], got shape {tuple(dst_ptr.shape)}")
    if dst_ptr.device != dst_idx.device:
        raise ValueError(f"dst_ptr is on {dst_ptr.device} but dst_idx is on {dst_idx.device}")
    return dst_ptr
