"""What a rank of a sharded edge list needs from the others: pure tensor functions, no processes.

A table of ``offsets[-1]`` rows is split over ``P`` ranks: rank ``r`` owns the global rows
``[offsets[r], offsets[r + 1])``. A rank's edges name global rows of any owner. For each side it
needs every remote row its edges name once (``side_requests``: the unique remote rows, sorted,
hence grouped by owner, and how many each owner must send); its edges then index a compacted
table of the local rows they touch followed by the received rows (``compact_side``).

:class:`edgedot.distributed.ShardedEdgeDot` builds its exchange plan with these functions, and
``scripts/scaling_model.py`` computes every rank's requests of one large graph in one process
with the same code (``request_matrix``).
"""

import torch

__all__ = ["as_offsets", "owner_of", "side_requests", "compact_side", "request_matrix"]


def as_offsets(offsets, world_size, name):
    """``offsets`` as a CPU int64 tensor of ``world_size + 1`` non-decreasing entries from 0.

    Accepts a sequence of ints or a 1-D integer tensor; raises TypeError / ValueError naming
    ``name`` otherwise."""
    if isinstance(offsets, torch.Tensor):
        if offsets.dtype.is_floating_point or offsets.dtype.is_complex or offsets.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got {offsets.dtype}")
        if offsets.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(offsets.shape)}")
        result = offsets.detach().to("cpu", torch.int64)
    else:
        try:
            values = list(offsets)
        except TypeError:
            raise TypeError(f"{name} must be a sequence of ints or a 1-D tensor, "
                            f"got {type(offsets).__name__}") from None
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise TypeError(f"{name} must hold ints")
        result = torch.tensor(values, dtype=torch.int64)
    if result.numel() != world_size + 1:
        raise ValueError(f"{name} must have world_size + 1 = {world_size + 1} entries, got {result.numel()}")
    if int(result[0]) != 0:
        raise ValueError(f"{name} must start at 0, got {int(result[0])}")
    if bool((result[1:] < result[:-1]).any()):
        raise ValueError(f"{name} must be non-decreasing, got {result.tolist()}")
    return result


def owner_of(rows, offsets):
    """The rank owning each global row: the ``r`` with ``offsets[r] <= row < offsets[r + 1]``
    (empty shards own nothing). ``rows`` must lie in ``[0, offsets[-1])``."""
    offsets = offsets.to(rows.device)
    return torch.searchsorted(offsets, rows.long(), right=True) - 1


def side_requests(idx, offsets, rank):
    """The remote rows one side of ``rank``'s edges needs.

    Args:
        idx: this rank's 1-D global row ids of one side (int32 or int64), all in range.
        offsets: CPU int64 row offsets (``as_offsets``).
        rank: this rank.

    Returns:
        ``(rows, counts)``: ``rows`` the unique global ids outside ``rank``'s own range, sorted
        (so grouped by owner in rank order), int64 on ``idx``'s device; ``counts`` a CPU int64
        tensor of ``P`` entries, how many of them each rank owns (0 at ``rank`` itself).
    """
    lo, hi = int(offsets[rank]), int(offsets[rank + 1])
    idx = idx.long()
    rows = torch.unique(idx[(idx < lo) | (idx >= hi)])
    bounds = torch.searchsorted(rows, offsets.to(rows.device)).cpu()
    return rows, bounds[1:] - bounds[:-1]


def compact_side(idx, lo, hi, remote_rows):
    """Indices of some edges into the compacted table ``[touched local rows ; remote rows]``.

    Args:
        idx: global row ids of one side of the edges, all in range.
        lo, hi: this rank's own rows ``[lo, hi)``.
        remote_rows: sorted unique remote ids covering every remote entry of ``idx``
            (``side_requests``), in the order the table holds them after the local rows.

    Returns:
        ``(touched, compact)``: ``touched`` the sorted unique local row ids (``- lo``, int64)
        these edges name; ``compact`` each edge's row in the table, int64.
    """
    idx = idx.long()
    local = (idx >= lo) & (idx < hi)
    touched = torch.unique(idx[local]) - lo
    at_local = torch.searchsorted(touched, idx - lo)
    at_remote = torch.searchsorted(remote_rows, idx) + touched.numel()
    return touched, torch.where(local, at_local, at_remote)


def request_matrix(rank_indices, offsets):
    """``R[r, q]``: how many unique rows rank ``r`` needs from rank ``q`` for one side, given
    every rank's indices of that side (a list of ``P`` tensors). The diagonal is 0; row sums are
    the unique remote rows of each rank, column sums the rows each rank sends."""
    return torch.stack([side_requests(idx, offsets, r)[1] for r, idx in enumerate(rank_indices)])
