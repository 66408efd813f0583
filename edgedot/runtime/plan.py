"""Edge groupings for deterministic, atomic-free backward passes.

A gradient row ``grad[n]`` sums one term per edge whose index is ``n``. Sorting the edges by that
index makes every row a contiguous run, which one thread group reduces in registers and writes
once: no float atomics, so the result is bitwise reproducible. The reduction walks the sorted
edges in chunks; a hot row of a power-law graph spans many chunks, whose partial sums are added
in chunk order.

The plan is built with plain tensor operations of static size (no host synchronisation), so it
also works inside ``torch.compile``; it costs 16 bytes per edge and side, never O(E * D).
"""

import torch

from .checks import TensorMemo, check_index_range, check_indices_pair

__all__ = ["EdgePlan", "build_side", "group_offsets", "MAX_ROWS"]

# Rows of either side a plan can index: each sorted edge packs its two rows in 32 bits each.
MAX_ROWS = 2**31 - 1


def build_side(row_idx, other_idx, num_rows, num_other):
    """Groups the edges by ``row_idx`` for one gradient, packed in one int64 tensor of 2E:

    ``order`` [E]
        edge ids sorted by row (stable, so ties keep edge order).
    ``row_other`` [E]
        each sorted edge's row in the high 32 bits and its other row in the low 32 bits
        (``row << 32 | other & 0xffffffff``). An out-of-range row becomes ``num_rows`` and sorts
        past the last row; an out-of-range other row becomes -1. Both then add nothing.

    ``num_rows`` and ``num_other`` must be at most MAX_ROWS.
    """
    if not (0 <= num_rows <= MAX_ROWS and 0 <= num_other <= MAX_ROWS):
        raise ValueError(f"an EdgePlan indexes at most {MAX_ROWS} rows a side, got {num_rows} and {num_other}")
    rows_ok = (row_idx >= 0) & (row_idx < num_rows)
    keys = torch.where(rows_ok, row_idx, torch.full_like(row_idx, num_rows)).to(torch.int32)
    sorted_rows, order = torch.sort(keys, stable=True)
    other = other_idx[order].long()
    other = torch.where((other >= 0) & (other < num_other), other, torch.full_like(other, -1))
    row_other = (sorted_rows.long() << 32) | (other & 0xFFFFFFFF)
    return torch.cat([order, row_other])


def group_offsets(packed, num_rows):
    """Where each row's run starts in a ``build_side`` grouping: int64 ``[num_rows + 1]``,
    ``offsets[r]`` = the first sorted position whose row is ``>= r``. Edges with an out-of-range
    row lie past ``offsets[num_rows]``."""
    rows = packed[packed.shape[0] // 2:] >> 32
    return torch.searchsorted(rows, torch.arange(num_rows + 1, device=packed.device, dtype=torch.int64))


def check_plan_layout(packed, num_edges, device):
    """Raises ValueError unless ``packed`` has the layout of ``build_side`` for ``num_edges`` edges."""
    size = 2 * num_edges
    if packed.dtype != torch.int64 or packed.dim() != 1 or packed.numel() != size or not packed.is_contiguous():
        raise ValueError(
            f"plan does not match this graph: expected a contiguous int64 tensor of {size} elements "
            f"for E={num_edges} (see edgedot.EdgePlan), got {packed.dtype} of shape {tuple(packed.shape)}")
    if packed.device != device:
        raise ValueError(f"plan is on {packed.device} but the features are on {device}")


def _known_graph(src_idx, dst_idx):
    """A memo of the index tensors a plan is known to hold (see :meth:`EdgePlan.check_matches`):
    the sides (``"src"``, ``"dst"``; both for one tensor passed as both) each one holds."""
    known = TensorMemo()
    known.put(src_idx, frozenset({"src"}))
    known.put(dst_idx, (known.get(dst_idx) or frozenset()) | {"dst"})
    return known


class EdgePlan:
    """Row groupings of a static graph, built once and reused by every backward pass.

    Pass it as ``edge_dot(..., plan=plan)``: the backward then reduces each gradient row without
    atomics (deterministic, and usually faster) and without re-sorting the edges each step.

    Args:
        src_idx, dst_idx: the graph's 1-D int32/int64 index tensors, exactly as later passed to
            :func:`edgedot.edge_dot`.
        num_src, num_dst: the number of rows of ``src_feat`` and ``dst_feat``.

    Raises IndexError if an index lies outside its range, and ValueError for more than
    MAX_ROWS rows on a side.

    A call that takes the plan raises ``ValueError`` naming ``plan`` unless it is given the
    plan's graph (:meth:`check_matches`): the same sizes and device, and the same edges in the
    same order. The index tensors the plan was built from (or views of them, such as
    ``edge_index[0]`` made anew each call) pass without a look at their content while PyTorch's
    version counter says they are unchanged, on CUDA; other tensors, and every call on the CPU,
    are compared with the plan's graph (one pass over the edges; on CUDA one wait for the
    device, after which the new tensors are known too). On CUDA, a write that bypasses the
    version counter (``.data``, DLPack) is not seen: rebuild the plan after one. Under
    ``torch.compile`` only the sizes are checked; during CUDA-graph capture, tensors other than
    the known ones are refused (nothing may wait there).
    """

    def __init__(self, src_idx, dst_idx, num_src, num_dst):
        check_indices_pair(src_idx, dst_idx)
        check_index_range("src_idx", src_idx, num_src)
        check_index_range("dst_idx", dst_idx, num_dst)
        self.num_edges = src_idx.shape[0]
        self.num_src = int(num_src)
        self.num_dst = int(num_dst)
        self.device = src_idx.device
        self.src = build_side(src_idx, dst_idx, self.num_src, self.num_dst)
        self.dst = build_side(dst_idx, src_idx, self.num_dst, self.num_src)
        self._offsets = {}
        self._known = _known_graph(src_idx, dst_idx)

    def offsets(self, side):
        """``group_offsets`` of the ``"src"`` or ``"dst"`` grouping, computed on first use and kept."""
        offsets = self._offsets.get(side)
        if offsets is None:
            if side not in ("src", "dst"):
                raise ValueError(f"side must be 'src' or 'dst', got {side!r}")
            packed, num_rows = (self.src, self.num_src) if side == "src" else (self.dst, self.num_dst)
            offsets = self._offsets[side] = group_offsets(packed, num_rows)
        return offsets

    def check_matches(self, src_feat, dst_feat, src_idx, dst_idx):
        """Raises ValueError unless the plan was built for this graph: these sizes and device,
        and ``src_idx``, ``dst_idx`` holding the plan's edges in its order (see the class)."""
        got = (src_idx.shape[0], src_feat.shape[0], dst_feat.shape[0])
        want = (self.num_edges, self.num_src, self.num_dst)
        if got != want:
            raise ValueError(
                f"plan was built for (E, num_src, num_dst)={want}, but the inputs have {got}")
        if src_idx.device != self.device:
            raise ValueError(f"plan is on {self.device} but src_idx is on {src_idx.device}")
        if torch.compiler.is_compiling():
            return
        remember = src_idx.is_cuda
        if remember and "src" in (self._known.get(src_idx) or ()) and "dst" in (self._known.get(dst_idx) or ()):
            return
        if remember and torch.cuda.is_current_stream_capturing():
            raise ValueError("plan cannot be checked against index tensors other than those it was built from "
                             "during CUDA-graph capture (nothing may wait there): pass those, or rebuild the plan")
        if not self._holds(src_idx, dst_idx):
            raise ValueError("plan was built for another graph: src_idx and dst_idx hold other edges (or the same "
                             "edges in another order) than the plan; build an EdgePlan of this graph")
        if remember:
            self._known = _known_graph(src_idx, dst_idx)

    def _holds(self, src_idx, dst_idx):
        """Whether ``src_idx``, ``dst_idx`` are the plan's graph: its grouping by destination
        lists every edge (a permutation) with both its rows, so it spells the graph out (one
        pass; a wait on CUDA)."""
        if dst_idx.device != self.device:
            return False
        num_edges = self.num_edges
        order, row_other = self.dst[:num_edges], self.dst[num_edges:]
        same = (dst_idx.index_select(0, order).long() == row_other >> 32) & \
            (src_idx.index_select(0, order).long() == row_other & 0xFFFFFFFF)
        return bool(same.all())

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_known"] = None  # weak references: a copy checks its indices once
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._known = TensorMemo()

    def to(self, device):
        """A copy of the plan on ``device``."""
        plan = object.__new__(EdgePlan)
        plan.__dict__.update(self.__dict__)
        plan.src = self.src.to(device)
        plan.dst = self.dst.to(device)
        plan._offsets = {side: offsets.to(device) for side, offsets in self._offsets.items()}
        plan.device = plan.src.device  # "cuda" resolved to the current device's index
        plan._known = TensorMemo()  # the indices on the new device are checked once
        return plan

    def __repr__(self):
        return (f"EdgePlan(num_edges={self.num_edges}, num_src={self.num_src}, "
                f"num_dst={self.num_dst}, device={self.device})")
