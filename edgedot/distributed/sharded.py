"""ShardedEdgeDot: edge dot products over feature tables split by rows across the ranks of a
``torch.distributed`` group.

Each rank keeps its slice of the src and dst tables and a list of edges that name global rows.
Built once per graph (collectively), the plan knows which remote rows each rank needs, from
whom, and where they go: every call then moves only those rows, once each, by
``all_to_all_single`` with split sizes fixed in the plan, and the local work runs on the
single-GPU kernels. Each call starts with one small all_reduce by which every rank agrees on the
shards' dtype and feature shape (on NCCL the host waits for it: one synchronisation per call).
"""

import math

import torch
import torch.distributed as dist

from ..ops.edge_dot import edge_dot, edge_dot_grad_op
from ..runtime.checks import (FEATURE_DTYPES, check_feature, check_index_range, check_indices_pair, heads_of,
                              output_shape)
from ..runtime.plan import build_side
from .plan import as_offsets, compact_side, side_requests

__all__ = ["ShardedEdgeDot"]

# Outcome of a rank's own argument checks at plan build, agreed by all ranks before any exchange
# of variable size, so that every rank raises instead of waiting for one that did.
_OK, _TYPE_ERROR, _VALUE_ERROR, _BAD_SRC_INDEX, _BAD_DST_INDEX = 0, 1, 2, 3, 4


class _Side:
    """The exchange plan of one table (src or dst) on this rank."""

    def __init__(self, name, offsets, rank):
        self.name = name
        self.offsets = offsets
        self.lo, self.hi = int(offsets[rank]), int(offsets[rank + 1])
        self.rows = self.hi - self.lo

    def owns(self, idx):
        return (idx >= self.lo) & (idx < self.hi)


class ShardedEdgeDot:
    """Edge dot products ``<src[s], dst[d]>`` over tables sharded by rows across a process group.

    Built once per static graph, collectively, on every rank of ``group``; then called as
    ``plan(src_shard, dst_shard)`` on every rank, forward and backward.

    Args:
        src_idx, dst_idx: this rank's edges as global row ids, 1-D int32 or int64 of equal length
            (any owners, any order; a rank may have none), on the device its shards will be on.
        src_row_offsets, dst_row_offsets: ``P + 1`` non-decreasing ints from 0 (a sequence or a
            1-D integer tensor), equal on every rank: rank ``r`` owns global rows
            ``[offsets[r], offsets[r + 1])`` of that table. Shards may be uneven or empty.
        group: the process group (default: the world). With NCCL, the tensors must be on the
            rank's current CUDA device; gloo takes CPU and CUDA tensors.

    Raises, on every rank alike: IndexError if any rank's index lies outside
    ``[0, offsets[-1])``; TypeError / ValueError if any rank's arguments are malformed or the
    offsets differ between ranks. No rank is left waiting.

    The plan exchanges each remote row a rank's edges need exactly once per side and call, and
    each receiving rank sends back one summed gradient row per row it received. Gradients reach
    the owners' shards summed over every rank's edges, in a fixed order (bitwise reproducible).
    """

    def __init__(self, src_idx, dst_idx, src_row_offsets, dst_row_offsets, *, group=None):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("ShardedEdgeDot needs an initialised torch.distributed process group")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = size = dist.get_world_size(group)
        self._control = _control_device(group)

        code, error, offsets = _OK, None, None
        try:
            check_indices_pair(src_idx, dst_idx)
            offsets = (as_offsets(src_row_offsets, size, "src_row_offsets"),
                       as_offsets(dst_row_offsets, size, "dst_row_offsets"))
            for code, name, idx, table in ((_BAD_SRC_INDEX, "src_idx", src_idx, offsets[0]),
                                           (_BAD_DST_INDEX, "dst_idx", dst_idx, offsets[1])):
                check_index_range(name, idx, int(table[-1]))
            code = _OK
        except IndexError as exc:
            error = exc
        except TypeError as exc:
            code, error = _TYPE_ERROR, exc
        except ValueError as exc:
            code, error = _VALUE_ERROR, exc
        except Exception as exc:  # whatever stops this rank must stop the others too
            code, error = _VALUE_ERROR, exc
        differ = "differ between ranks of the group"
        self._agree(code, error, _equal_on_every_rank(
            ("src_row_offsets", size + 1, None if offsets is None else offsets[0], differ, ValueError),
            ("dst_row_offsets", size + 1, None if offsets is None else offsets[1], differ, ValueError)))

        self.device = src_idx.device
        self._src = _Side("src", offsets[0], self.rank)
        self._dst = _Side("dst", offsets[1], self.rank)
        self._build(src_idx.long(), dst_idx.long())
        self._bytes = dict.fromkeys(("forward_bytes_sent", "forward_bytes_received",
                                     "backward_bytes_sent", "backward_bytes_received"), 0)

    def _agree(self, code, error, must_match):
        """One all_reduce (MAX) of every rank's outcome code and of values that must be equal on
        every rank, with their negations (``must_match``: :func:`_equal_on_every_rank`): raises on
        every rank if any rank failed (this rank its own error, the others one naming that rank)
        or the values differ."""
        size = self.world_size
        fields, values = must_match
        vec = torch.zeros(size + 2 * values.numel(), dtype=torch.int64)
        vec[self.rank] = code
        vec[size:] = torch.cat([values, -values])
        vec = vec.to(self._control)
        dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=self.group)
        vec = vec.cpu()
        if error is not None:
            raise error
        codes = vec[:size]
        if bool((codes != _OK).any()):
            rank = int(torch.nonzero(codes)[0])
            what = int(codes[rank])
            if what in (_BAD_SRC_INDEX, _BAD_DST_INDEX):
                name = "src_idx" if what == _BAD_SRC_INDEX else "dst_idx"
                raise IndexError(f"{name} on rank {rank} holds an index outside its table (see the error there)")
            kind = TypeError if what == _TYPE_ERROR else ValueError
            raise kind(f"ShardedEdgeDot: rank {rank} refused its arguments (see the error there)")
        highest, negated_lowest = vec[size:].split(values.numel())
        start = 0
        for name, length, message, kind in fields:
            stop = start + length
            if not torch.equal(highest[start:stop], -negated_lowest[start:stop]):
                raise kind(f"{name} {message}")
            start = stop

    def _build(self, src_idx, dst_idx):
        """Requests, the row-id exchange and the compacted indices of both sides."""
        size, device = self.world_size, self.device
        src, dst = self._src, self._dst
        edge_local = src.owns(src_idx) & dst.owns(dst_idx)
        self._pos_local = torch.nonzero(edge_local).flatten()
        self._pos_remote = torch.nonzero(~edge_local).flatten()
        self.num_edges = src_idx.shape[0]
        self.num_local_edges = self._pos_local.numel()
        self.num_remote_edges = self._pos_remote.numel()
        # Scores come out local edges first: this order puts them back in the given order.
        self._merge_order = torch.argsort(torch.cat([self._pos_local, self._pos_remote]))

        requests = [side_requests(idx, side.offsets, self.rank) for side, idx in ((src, src_idx), (dst, dst_idx))]
        fetch = torch.stack([requests[0][1], requests[1][1]], dim=1).reshape(-1)
        serve = torch.empty_like(fetch, device=self._control)
        dist.all_to_all_single(serve, fetch.to(self._control), group=self.group)
        serve = serve.cpu().view(size, 2)
        totals = fetch.view(size, 2).sum(0).to(self._control)
        dist.all_reduce(totals, group=self.group)  # rows fetched over all ranks, per side
        totals = totals.cpu()

        for s, (side, idx) in enumerate(((src, src_idx), (dst, dst_idx))):
            rows, fetch_counts = requests[s]
            side.exchange = bool(totals[s] > 0)
            side.fetch_counts = fetch_counts.tolist()
            side.serve_counts = serve[:, s].tolist()
            side.num_fetch, side.num_serve = sum(side.fetch_counts), sum(side.serve_counts)
            served = torch.empty(side.num_serve, dtype=torch.int64, device=self._control)
            if side.exchange:
                dist.all_to_all_single(served, rows.to(self._control), side.serve_counts, side.fetch_counts,
                                       group=self.group)
            side.serve_rows = served.to(device) - side.lo
            side.touched, table_idx = compact_side(idx[self._pos_remote], side.lo, side.hi, rows)
            side.num_touched = side.touched.numel()
            side.table_rows = side.num_touched + side.num_fetch
            side.local_idx = idx[self._pos_local] - side.lo
            side.table_idx = table_idx
            # The rows each received gradient goes to: touched rows' table gradients, then the
            # rows served to each rank in rank order.
            side.reduce_rows = torch.cat([side.touched, side.serve_rows])

        index_dtype = torch.int32 if max(src.table_rows, dst.table_rows, src.rows, dst.rows,
                                         src.reduce_rows.numel(), dst.reduce_rows.numel()) < 2**31 else torch.int64
        for side in (src, dst):
            for attr in ("local_idx", "table_idx", "reduce_rows"):
                setattr(side, attr, getattr(side, attr).to(index_dtype))
            side.reduce_other = torch.arange(side.reduce_rows.numel(), dtype=index_dtype, device=device)
        # On CUDA the gradients take the single-GPU plan kernels: deterministic, no sort per call
        # (the CPU reduction adds in edge order, deterministic as it is).
        for side, other in ((src, dst), (dst, src)):
            side.local_plan = side.table_plan = side.reduce_plan = None
            if device.type == "cuda":
                side.local_plan = build_side(side.local_idx, other.local_idx, side.rows, other.rows)
                side.table_plan = build_side(side.table_idx, other.table_idx, side.table_rows, other.table_rows)
                side.reduce_plan = build_side(side.reduce_rows, side.reduce_other, side.rows,
                                              side.reduce_rows.numel())

    def __call__(self, src_shard, dst_shard):
        """This rank's edge scores, ``[E_r]`` or ``[E_r, H]``, in its edges' order.

        ``src_shard`` ``[rows, D]`` or ``[rows, H, D]`` holds this rank's rows of the src table
        (``src_row_offsets[r + 1] - src_row_offsets[r]`` of them), likewise ``dst_shard``;
        dtypes and head broadcasting as in :func:`edgedot.edge_dot`, and the same feature shape
        and dtype on every rank. Collective: every rank calls it, and every rank runs the
        backward when any does (with shards that require gradients on every rank).

        Every call first agrees on the shards with every rank (one small all_reduce): a dtype
        or feature shape that differs between ranks, or shards refused on any rank, raise on
        every rank, naming the argument, also when one rank alone changes its shards between
        two calls. The agreement runs on every call because no rank can tell by itself whether
        another rank changed: a rank skipping it while another ran it would leave both waiting
        in different collectives.
        """
        self._agree_on_shards(src_shard, dst_shard)
        return _ShardedEdgeDotFunction.apply(self, src_shard, dst_shard)

    def _agree_on_shards(self, src_shard, dst_shard):
        """Checks the shards here and agrees with every rank on their dtype and feature shape:
        shards of equal row bytes but another dtype or width on one rank would be exchanged
        without error and corrupt every result, and shards of other row bytes would leave the
        exchange waiting. Collective, on every call: raises on every rank alike."""
        code, error = _OK, None
        try:
            self._check_shards(src_shard, dst_shard)
        except TypeError as exc:
            code, error = _TYPE_ERROR, exc
        except ValueError as exc:
            code, error = _VALUE_ERROR, exc
        ok = error is None
        dtype_differs = "dtype differs between ranks of the group"
        shape_differs = "feature shape (all but the rows) differs between ranks of the group"
        self._agree(code, error, _equal_on_every_rank(
            ("src_shard", 1, _dtype_code(src_shard) if ok else None, dtype_differs, TypeError),
            ("dst_shard", 1, _dtype_code(dst_shard) if ok else None, dtype_differs, TypeError),
            ("src_shard", 3, _feature_shape(src_shard) if ok else None, shape_differs, ValueError),
            ("dst_shard", 3, _feature_shape(dst_shard) if ok else None, shape_differs, ValueError)))

    def stats(self):
        """Exchange sizes of this rank: ``remote_src_rows`` / ``remote_dst_rows`` (unique remote
        rows received per call), ``served_src_rows`` / ``served_dst_rows`` (rows sent to other
        ranks per call), the local and remote-touching edge counts, and the bytes sent and
        received by the last forward and the last backward."""
        return {
            "remote_src_rows": self._src.num_fetch,
            "remote_dst_rows": self._dst.num_fetch,
            "served_src_rows": self._src.num_serve,
            "served_dst_rows": self._dst.num_serve,
            "local_edges": self.num_local_edges,
            "remote_edges": self.num_remote_edges,
            **self._bytes,
        }

    def _check_shards(self, src_shard, dst_shard):
        for name, shard, side in (("src_shard", src_shard, self._src), ("dst_shard", dst_shard, self._dst)):
            check_feature(name, shard, rows="rows")
            if shard.device != self.device:
                raise ValueError(f"{name} is on {shard.device} but the plan's edges are on {self.device}")
            if shard.shape[0] != side.rows:
                raise ValueError(
                    f"{name} has {shard.shape[0]} rows but {side.name}_row_offsets give rank {self.rank} "
                    f"{side.rows} rows ([{side.lo}, {side.hi}))")
        if src_shard.dtype != dst_shard.dtype:
            raise TypeError(f"src_shard is {src_shard.dtype} but dst_shard is {dst_shard.dtype}; they must match")
        if src_shard.shape[-1] != dst_shard.shape[-1]:
            raise ValueError(f"feature sizes differ: src_shard has D={src_shard.shape[-1]}, "
                             f"dst_shard has D={dst_shard.shape[-1]}")
        src_heads, dst_heads = heads_of(src_shard), heads_of(dst_shard)
        if src_heads != dst_heads and 1 not in (src_heads, dst_heads):
            raise ValueError(
                f"head counts differ: src_shard has H={src_heads}, dst_shard has H={dst_heads} (one may be 1)")

    def _exchange(self, output, send, side, forward):
        """Starts one side's all_to_all_single (rows out in the forward, gradients back in the
        backward), or nothing when no rank of the group needs that side's remote rows."""
        if not side.exchange:
            return None
        receive, give = (side.fetch_counts, side.serve_counts) if forward else (side.serve_counts, side.fetch_counts)
        return dist.all_to_all_single(output, send, receive, give, group=self.group, async_op=True)

    def _forward(self, src_shard, dst_shard):
        pending, tables = [], []
        for side, shard in ((self._src, src_shard), (self._dst, dst_shard)):
            table = shard.new_empty((side.table_rows,) + tuple(shard.shape[1:]))
            send = shard.index_select(0, side.serve_rows)
            pending.append((self._exchange(table[side.num_touched:], send, side, True), send))
            torch.index_select(shard, 0, side.touched, out=table[:side.num_touched])
            tables.append(table)
        # Edges whose rows are all local run while the remote rows are in flight.
        local = remote = None
        if self.num_local_edges:
            local = edge_dot(src_shard, dst_shard, self._src.local_idx, self._dst.local_idx, check_indices=False)
        for work, _ in pending:
            if work is not None:
                work.wait()
        if self.num_remote_edges:
            remote = edge_dot(tables[0], tables[1], self._src.table_idx, self._dst.table_idx, check_indices=False)
        self._count_bytes("forward", src_shard, dst_shard)
        if local is None and remote is None:
            return src_shard.new_empty(output_shape(src_shard, dst_shard, 0)), tables
        if remote is None or local is None:
            return (local if remote is None else remote), tables
        return torch.cat([local, remote]).index_select(0, self._merge_order), tables

    def _backward(self, grad_out, shards, tables, needs):
        grad_out = grad_out.contiguous()
        grad_local = grad_out.index_select(0, self._pos_local) if self.num_remote_edges else grad_out
        grad_remote = grad_out.index_select(0, self._pos_remote) if self.num_local_edges else grad_out
        sides = (self._src, self._dst)
        pending, table_grads = [], []
        for s in (0, 1):
            side, other, shard = sides[s], sides[1 - s], shards[s]
            if self.num_remote_edges:
                table_grad = edge_dot_grad_op(grad_remote, tables[s], tables[1 - s], side.table_idx,
                                              other.table_idx, side.table_plan, "sort")
            else:
                table_grad = tables[s].new_zeros(tables[s].shape)
            returned = shard.new_empty((side.num_serve,) + tuple(shard.shape[1:]))
            pending.append((self._exchange(returned, table_grad[side.num_touched:], side, False), returned))
            table_grads.append(table_grad)
        # The local edges' gradients run while the received rows' gradients travel back.
        grads = []
        for s in (0, 1):
            side, other, shard = sides[s], sides[1 - s], shards[s]
            grads.append(None)
            if needs[s] and self.num_local_edges:
                grads[s] = edge_dot_grad_op(grad_local, shard, shards[1 - s], side.local_idx, other.local_idx,
                                            side.local_plan, "sort")
        for s in (0, 1):
            side, shard = sides[s], shards[s]
            work, returned = pending[s]
            if work is not None:
                work.wait()
            if not needs[s]:
                grads[s] = None
                continue
            if side.reduce_rows.numel():
                # Every row's gradient from the touched table rows and from each rank it served,
                # summed by the single-GPU reduction in one fixed order.
                terms = torch.cat([table_grads[s][:side.num_touched], returned])
                ones = terms.new_ones(output_shape(shard, terms, terms.shape[0]))
                summed = edge_dot_grad_op(ones, shard, terms, side.reduce_rows, side.reduce_other,
                                          side.reduce_plan, "sort")
                grads[s] = summed if grads[s] is None else grads[s] + summed
            if grads[s] is None:
                grads[s] = torch.zeros_like(shard)
        self._count_bytes("backward", *shards)
        return grads

    def _count_bytes(self, phase, src_shard, dst_shard):
        sent = received = 0
        for side, shard in ((self._src, src_shard), (self._dst, dst_shard)):
            if not side.exchange:
                continue
            row_bytes = math.prod(shard.shape[1:]) * shard.element_size()
            out_rows, in_rows = (side.num_serve, side.num_fetch) if phase == "forward" else (side.num_fetch, side.num_serve)
            sent += out_rows * row_bytes
            received += in_rows * row_bytes
        self._bytes[f"{phase}_bytes_sent"] = sent
        self._bytes[f"{phase}_bytes_received"] = received

    def __repr__(self):
        return (f"ShardedEdgeDot(rank={self.rank}, world_size={self.world_size}, edges={self.num_edges}, "
                f"remote_src_rows={self._src.num_fetch}, remote_dst_rows={self._dst.num_fetch}, "
                f"device={self.device})")


class _ShardedEdgeDotFunction(torch.autograd.Function):
    """Autograd of :class:`ShardedEdgeDot`; the backward is collective like the forward."""

    @staticmethod
    def forward(ctx, plan, src_shard, dst_shard):
        out, tables = plan._forward(src_shard, dst_shard)
        ctx.plan = plan
        ctx.save_for_backward(src_shard, dst_shard, *tables)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        src_shard, dst_shard, src_table, dst_table = ctx.saved_tensors
        grad_src, grad_dst = ctx.plan._backward(grad_out, (src_shard, dst_shard), (src_table, dst_table),
                                                ctx.needs_input_grad[1:])
        return None, grad_src, grad_dst


def _equal_on_every_rank(*fields):
    """``(fields, values)`` for :meth:`ShardedEdgeDot._agree`. Each field is ``(name, length,
    value, message, exception)``: ``value`` a tensor of ``length`` integers that must be equal on
    every rank, or None where this rank could not compute it (its own error is raised instead);
    ``exception(f"{name} {message}")`` is raised when it differs. ``length`` is the same on every
    rank, so the ranks' vectors line up whatever failed."""
    values = torch.cat([torch.zeros(length, dtype=torch.int64) if value is None else value.to(torch.int64)
                        for _, length, value, _, _ in fields])
    return [(name, length, message, kind) for name, length, _, message, kind in fields], values


def _dtype_code(shard):
    return torch.tensor([FEATURE_DTYPES.index(shard.dtype)])


def _feature_shape(shard):
    """``[dim, H, D]`` of a shard (``H`` 0 for a 2-D one): what must match across ranks."""
    return torch.tensor([shard.dim(), shard.shape[1] if shard.dim() == 3 else 0, shard.shape[-1]])


def _control_device(group):
    """Where the plan's small exchanges run: the current CUDA device under NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
