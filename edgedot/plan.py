"""Edge groupings for deterministic, atomic-free backward passes.

A gradient row ``grad[n]`` sums one term per edge whose index is ``n``. Sorting the edges by that
index makes every row a contiguous run, which one thread group reduces in registers and writes
once: no float atomics, so the result is bitwise reproducible. Rows longer than a piece (at
most PIECE_LEN edges; the hot rows of power-law graphs) are cut into pieces reduced in parallel
into a small workspace, then summed in a fixed order.

The plan is built with plain tensor operations of static size (no host synchronisation), so it
also works inside ``torch.compile``; it costs O(E + N) integers and never O(E * D).
"""

import torch

from ._checks import check_index_range, check_indices_pair

__all__ = ["EdgePlan", "PIECE_LEN", "build_side", "piece_len"]

# Edges one thread group reduces serially at most; longer rows are split. Large enough that
# splits are rare on ordinary graphs, small enough that a hot row does not serialise the kernel.
PIECE_LEN = 256
# Small graphs use shorter pieces, so that about this many pieces keep every SM busy.
TARGET_PIECES = 1 << 16


def piece_len(num_edges):
    """Longest piece for a graph of ``num_edges`` edges: between 8 and PIECE_LEN."""
    return max(8, min(PIECE_LEN, num_edges // TARGET_PIECES))


def num_pieces(num_edges, num_rows):
    """The static piece count P of a plan side: a piece per row, plus room for every split."""
    return num_rows + num_edges // piece_len(num_edges)


def build_side(row_idx, other_idx, num_rows):
    """Groups the edges by ``row_idx`` for one gradient, packed in one int64 tensor.

    The packed tensor concatenates, in this order (``P = num_rows + E // piece_len(E)``):

    ``order`` [E]
        edge ids sorted by row (stable, so ties keep edge order).
    ``other_sorted`` [E]
        ``other_idx[order]``: the other side's row for each sorted edge.
    ``piece_row``, ``piece_begin``, ``piece_end`` [P]
        piece ``p`` reduces sorted positions ``[piece_begin[p], piece_end[p])`` of row
        ``piece_row[p]``; every row has at least one piece (an empty one writes zeros), and
        ``piece_row`` is -1 on the unused tail of the static size ``P``.
    ``piece_slot`` [P]
        -1 when the piece is its row's only one (written directly), else its workspace slot.
    ``row_slot_begin``, ``row_pieces`` [num_rows]
        first workspace slot and piece count of each row; a row of several pieces is summed
        from its slots in slot order.
    """
    device = row_idx.device
    num_edges = row_idx.shape[0]
    length = piece_len(num_edges)
    # 32-bit keys sort in half the radix passes of 64-bit ones. Out-of-range indices (possible
    # with check_indices=False) become num_rows first, so no cast can wrap them onto a real row:
    # they sort past the last row and belong to no piece.
    key_dtype = torch.int32 if num_rows < 2**31 - 1 else torch.int64
    in_range = (row_idx >= 0) & (row_idx < num_rows)
    keys = torch.where(in_range, row_idx, torch.full_like(row_idx, num_rows)).to(key_dtype)
    sorted_rows, order = torch.sort(keys, stable=True)
    other_sorted = other_idx[order].long()
    row_ptr = torch.searchsorted(sorted_rows, torch.arange(num_rows + 1, device=device, dtype=key_dtype))
    degree = row_ptr[1:] - row_ptr[:-1]
    row_pieces = ((degree + length - 1) // length).clamp_(min=1)
    pieces_end = torch.cumsum(row_pieces, 0)
    pieces_begin = pieces_end - row_pieces

    piece = torch.arange(num_pieces(num_edges, num_rows), device=device)
    row = torch.searchsorted(pieces_end, piece, right=True)
    used = row < num_rows
    row_c = row.clamp(max=max(num_rows - 1, 0))
    k = piece - pieces_begin[row_c] if num_rows else piece
    if num_rows:
        piece_begin = row_ptr[row_c] + k * length
        piece_end = torch.minimum(piece_begin + length, row_ptr[row_c + 1])
    else:
        piece_begin = piece_end = torch.zeros_like(piece)

    split = row_pieces > 1
    row_slots = torch.where(split, row_pieces, torch.zeros_like(row_pieces))
    row_slot_begin = torch.cumsum(row_slots, 0) - row_slots
    if num_rows:
        piece_slot = torch.where(split[row_c] & used, row_slot_begin[row_c] + k, torch.full_like(piece, -1))
    else:
        piece_slot = torch.full_like(piece, -1)
    piece_row = torch.where(used, row, torch.full_like(row, -1))
    return torch.cat([order, other_sorted, piece_row, piece_begin, piece_end, piece_slot, row_slot_begin, row_pieces])


def check_plan_layout(packed, num_edges, num_rows, device):
    """Raises ValueError unless ``packed`` has the layout of ``build_side`` for this graph."""
    size = 2 * num_edges + 4 * num_pieces(num_edges, num_rows) + 2 * num_rows
    if packed.dtype != torch.int64 or packed.dim() != 1 or packed.numel() != size or not packed.is_contiguous():
        raise ValueError(
            f"plan does not match this graph: expected a contiguous int64 tensor of {size} elements "
            f"for E={num_edges} and {num_rows} rows (see edgedot.EdgePlan), got {packed.dtype} "
            f"of shape {tuple(packed.shape)}")
    if packed.device != device:
        raise ValueError(f"plan is on {packed.device} but the features are on {device}")


class EdgePlan:
    """Row groupings of a static graph, built once and reused by every backward pass.

    Pass it as ``edge_dot(..., plan=plan)``: the backward then reduces each gradient row without
    atomics (deterministic, and usually faster) and without re-sorting the edges each step.

    Args:
        src_idx, dst_idx: the graph's 1-D int32/int64 index tensors, exactly as later passed to
            :func:`edgedot.edge_dot`.
        num_src, num_dst: the number of rows of ``src_feat`` and ``dst_feat``.

    Raises IndexError if an index lies outside its range.
    """

    def __init__(self, src_idx, dst_idx, num_src, num_dst):
        check_indices_pair(src_idx, dst_idx)
        check_index_range("src_idx", src_idx, num_src)
        check_index_range("dst_idx", dst_idx, num_dst)
        self.num_edges = src_idx.shape[0]
        self.num_src = int(num_src)
        self.num_dst = int(num_dst)
        self.device = src_idx.device
        self.src = build_side(src_idx, dst_idx, self.num_src)
        self.dst = build_side(dst_idx, src_idx, self.num_dst)

    def check_matches(self, src_feat, dst_feat, src_idx):
        """Raises ValueError unless the plan was built for a graph of these sizes and device."""
        got = (src_idx.shape[0], src_feat.shape[0], dst_feat.shape[0])
        want = (self.num_edges, self.num_src, self.num_dst)
        if got != want:
            raise ValueError(
                f"plan was built for (E, num_src, num_dst)={want}, but the inputs have {got}")
        if src_idx.device != self.device:
            raise ValueError(f"plan is on {self.device} but src_idx is on {src_idx.device}")

    def to(self, device):
        """A copy of the plan on ``device``."""
        plan = object.__new__(EdgePlan)
        plan.__dict__.update(self.__dict__)
        plan.src = self.src.to(device)
        plan.dst = self.dst.to(device)
        plan.device = plan.src.device  # "cuda" resolved to the current device's index
        return plan

    def __repr__(self):
        return (f"EdgePlan(num_edges={self.num_edges}, num_src={self.num_src}, "
                f"num_dst={self.num_dst}, device={self.device})")
