"""ShardedEdgeDot on 2 and 3 processes over gloo, against single-process edge_dot on the whole
tables (float64): forward, both gradients, uneven and empty shards, a rank without edges, plan
reuse, heads, int32/int64, exact exchange counts, errors raised on every rank.

Each test spawns its processes once and runs every case in them (starting a process that imports
torch costs seconds); a time limit turns a hang into a failure."""

import os
import sys
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import edgedot
from edgedot.distributed import ShardedEdgeDot
from edgedot.distributed.plan import as_offsets, compact_side, request_matrix, side_requests
from utils import requires_cuda

TIME_LIMIT_S = 240
TOL = 1e-12


# ---------------------------------------------------------------- the plan builder, in-process

def test_side_requests_groups_unique_remote_rows_by_owner():
    offsets = as_offsets([0, 3, 3, 8, 10], 4, "offsets")
    idx = torch.tensor([9, 0, 5, 9, 2, 4, 7, 1, 5], dtype=torch.int32)
    rows, counts = side_requests(idx, offsets, 2)
    assert rows.tolist() == [0, 1, 2, 9]
    assert counts.tolist() == [3, 0, 0, 1]
    touched, compact = compact_side(idx, 3, 8, rows)
    assert touched.tolist() == [1, 2, 4]  # global rows 4, 5, 7
    table = touched.tolist() + rows.tolist()  # local ids, then global remote ids
    for e, row in enumerate(idx.tolist()):
        pos = int(compact[e])
        assert (table[pos] + 3 if pos < 3 else table[pos]) == row
    matrix = request_matrix([idx, idx[:0], idx, torch.tensor([0, 0])], offsets)
    assert matrix.tolist() == [[0, 0, 3, 1], [0, 0, 0, 0], [3, 0, 0, 1], [1, 0, 0, 0]]


@pytest.mark.parametrize("offsets, error", [
    ([0, 4], ValueError),           # wrong length
    ([1, 2, 4], ValueError),        # not from 0
    ([0, 3, 2], ValueError),        # decreasing
    ([0, 2.0, 4], TypeError),
    (torch.tensor([0.0, 1.0, 2.0]), TypeError),
    (5, TypeError),
])
def test_bad_offsets(offsets, error):
    with pytest.raises(error, match="offsets"):
        as_offsets(offsets, 2, "offsets")


# ---------------------------------------------------------------- processes

def _run_group(world_size, device):
    """Runs ``_worker`` on ``world_size`` spawned processes; fails on an error or past the limit."""
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_worker, args=(world_size, os.path.join(tmp, "rendezvous"), device),
                                 nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + TIME_LIMIT_S
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                for process in ctx.processes:
                    if process.is_alive():
                        process.kill()
                pytest.fail(f"{world_size} processes did not finish within {TIME_LIMIT_S} s (hang?)")


@pytest.mark.cpu_only
@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_edge_dot_gloo(world_size):
    _run_group(world_size, "cpu")


@requires_cuda
@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_edge_dot_cuda_over_gloo(world_size):
    # Builds (or loads) the CUDA extension here, outside the spawned processes' time limit.
    from edgedot.runtime.build import cuda_module
    cuda_module()
    _run_group(world_size, "cuda")


def _worker(rank, world_size, init_file, device):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    torch.use_deterministic_algorithms(True)
    try:
        for case in (_case_errors, _case_shard_signatures, _case_uneven_reuse, _case_heads, _case_same_table,
                     _case_local_edges, _case_float32, _case_subgroup):
            case(rank, world_size, device)
            dist.barrier()
    finally:
        dist.destroy_process_group()
    # Every case passed: leave without the interpreter's finalization, where gloo's threads once
    # aborted a rank after a passing run ("terminate called without an active exception", one CI
    # run of many on 2 busy cores). A failing case has raised above and is reported as before.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---------------------------------------------------------------- a global problem every rank knows

def _split(total, world_size, seed):
    """Uneven offsets over ``world_size`` ranks with rank 0's shard empty."""
    g = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randint(0, total + 1, (world_size - 2,), generator=g).tolist())
    return [0, 0] + cuts + [total]


def _problem(world_size, seed, num_src, num_dst, edges_per_rank, src_shape=(5,), dst_shape=(5,), hub=True):
    """Whole tables, every rank's edges (int32 on even ranks, int64 on odd ones, a hub row)
    and per-edge weights of the loss, drawn alike on every rank."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randn(num_src, *src_shape, generator=g, dtype=torch.float64)
    dst = torch.randn(num_dst, *dst_shape, generator=g, dtype=torch.float64)
    edges = []
    for r in range(world_size):
        count = edges_per_rank[r]
        s = torch.randint(0, num_src, (count,), generator=g)
        d = torch.randint(0, num_dst, (count,), generator=g)
        if hub:
            s[::3] = num_src // 2
        dtype = torch.int32 if r % 2 == 0 else torch.int64
        edges.append((s.to(dtype), d.to(dtype)))
    return src, dst, edges


def _weights(edges, heads, seed):
    g = torch.Generator().manual_seed(seed)
    shape = () if heads is None else (heads,)
    return [torch.randn(s.shape[0], *shape, generator=g, dtype=torch.float64) for s, _ in edges]


def _reference(src, dst, edges, weights):
    """Single-process edge_dot on the whole tables: every rank's scores and both gradients of
    sum_r <weights_r, scores_r>."""
    s = src.clone().requires_grad_(True)
    d = dst.clone().requires_grad_(True)
    src_idx = torch.cat([e[0].long() for e in edges])
    dst_idx = torch.cat([e[1].long() for e in edges])
    out = edgedot.edge_dot(s, d, src_idx, dst_idx)
    (out * torch.cat(weights)).sum().backward()
    return out.detach().split([e[0].shape[0] for e in edges]), s.grad, d.grad


def _rel(out, ref):
    out, ref = out.detach().cpu().double(), ref.detach().cpu().double()
    assert out.shape == ref.shape, (out.shape, ref.shape)
    den = torch.linalg.vector_norm(ref).item()
    num = torch.linalg.vector_norm(out - ref).item()
    return num / den if den else num


def _run_and_check(rank, world_size, device, src, dst, edges, src_off, dst_off, heads, seed, steps=1,
                   plan=None, dtype=torch.float64, tol=TOL, group=None):
    """Builds (or reuses) the plan, runs ``steps`` forward/backward steps with fresh features and
    weights, and checks this rank's scores and shard gradients against ``_reference``."""
    s_idx, d_idx = (t.to(device) for t in edges[rank])
    if plan is None:
        plan = ShardedEdgeDot(s_idx, d_idx, src_off, dst_off, group=group)
    for step in range(steps):
        g = torch.Generator().manual_seed(seed + step)
        src_step = src + 0.1 * step * torch.randn(src.shape, generator=g, dtype=torch.float64)
        dst_step = dst - 0.1 * step * torch.randn(dst.shape, generator=g, dtype=torch.float64)
        weights = _weights(edges, heads, seed + 1000 + step)
        ref_out, ref_gs, ref_gd = _reference(src_step, dst_step, edges, weights)
        lo_s, hi_s, lo_d, hi_d = src_off[rank], src_off[rank + 1], dst_off[rank], dst_off[rank + 1]
        src_shard = src_step[lo_s:hi_s].to(device, dtype).requires_grad_(True)
        dst_shard = dst_step[lo_d:hi_d].to(device, dtype).requires_grad_(True)
        out = plan(src_shard, dst_shard)
        assert out.dtype == dtype and out.device.type == torch.device(device).type
        assert _rel(out, ref_out[rank]) <= tol, ("forward", rank, _rel(out, ref_out[rank]))
        (out * weights[rank].to(device, dtype)).sum().backward()
        assert _rel(src_shard.grad, ref_gs[lo_s:hi_s]) <= tol, ("grad src", rank)
        assert _rel(dst_shard.grad, ref_gd[lo_d:hi_d]) <= tol, ("grad dst", rank)
    return plan, src_shard, dst_shard, weights[rank].to(device, dtype)


def _expected_counts(rank, edges, src_off, dst_off):
    """(remote src, remote dst, served src, served dst) unique row counts, from Python sets."""
    def remote(r, side, off):
        return {int(i) for i in edges[r][side].tolist() if not off[r] <= int(i) < off[r + 1]}
    world_size = len(edges)
    counts = []
    for side, off in ((0, src_off), (1, dst_off)):
        counts.append(len(remote(rank, side, off)))
    for side, off in ((0, src_off), (1, dst_off)):
        counts.append(sum(len({i for i in remote(q, side, off) if off[rank] <= i < off[rank + 1]})
                          for q in range(world_size) if q != rank))
    return counts


# ---------------------------------------------------------------- cases

def _case_uneven_reuse(rank, world_size, device):
    """Uneven shards (rank 0's src shard empty), the last-but-one rank without edges, a hub row,
    int32 and int64 ranks; one plan over three steps; exact stats; bitwise-repeatable gradients."""
    num_src, num_dst = 23, 17
    src_off, dst_off = _split(num_src, world_size, 1), [0] + sorted([5, 12][:world_size - 1]) + [num_dst]
    per_rank = {2: [40, 0], 3: [37, 0, 29]}[world_size]
    src, dst, edges = _problem(world_size, 10, num_src, num_dst, per_rank)
    plan, src_shard, dst_shard, w = _run_and_check(rank, world_size, device, src, dst, edges, src_off,
                                                   dst_off, None, 20, steps=3)
    stats = plan.stats()
    remote_src, remote_dst, served_src, served_dst = _expected_counts(rank, edges, src_off, dst_off)
    assert (stats["remote_src_rows"], stats["remote_dst_rows"]) == (remote_src, remote_dst), stats
    assert (stats["served_src_rows"], stats["served_dst_rows"]) == (served_src, served_dst), stats
    row = 5 * 8
    assert stats["forward_bytes_sent"] == (served_src + served_dst) * row, stats
    assert stats["forward_bytes_received"] == (remote_src + remote_dst) * row, stats
    assert stats["backward_bytes_sent"] == (remote_src + remote_dst) * row, stats
    assert stats["backward_bytes_received"] == (served_src + served_dst) * row, stats
    assert stats["local_edges"] + stats["remote_edges"] == per_rank[rank]
    # The same step twice: bitwise the same gradients.
    first = (src_shard.grad.clone(), dst_shard.grad.clone())
    for shard in (src_shard, dst_shard):
        shard.grad = None
    (plan(src_shard, dst_shard) * w).sum().backward()
    assert torch.equal(first[0], src_shard.grad) and torch.equal(first[1], dst_shard.grad)
    # Only the src table requires a gradient: the dst side's gradients still travel.
    src_only = src_shard.detach().requires_grad_(True)
    (plan(src_only, dst_shard.detach()) * w).sum().backward()
    assert torch.equal(src_only.grad, first[0])


def _case_heads(rank, world_size, device):
    """[rows, H, D] against [rows, 1, D], and [rows, D] against [rows, H, D]."""
    num_src, num_dst = 19, 14
    src_off, dst_off = _split(num_src, world_size, 2), _split(num_dst, world_size, 3)
    for src_shape, dst_shape in (((4, 3), (1, 3)), ((3,), (4, 3))):
        src, dst, edges = _problem(world_size, 30, num_src, num_dst, [25] * world_size, src_shape, dst_shape)
        plan, *_ = _run_and_check(rank, world_size, device, src, dst, edges, src_off, dst_off, 4, 40)
        remote_src, remote_dst, _, _ = _expected_counts(rank, edges, src_off, dst_off)
        bytes_in = remote_src * 8 * src[0].numel() + remote_dst * 8 * dst[0].numel()
        assert plan.stats()["forward_bytes_received"] == bytes_in


def _case_same_table(rank, world_size, device):
    """One table on both sides: plan(x, x) gets the summed gradient."""
    num = 21
    off = [0] + [num * (r + 1) // world_size for r in range(world_size)]
    x, _, edges = _problem(world_size, 50, num, num, [30] * world_size, (6,), (6,))
    s_idx, d_idx = (t.to(device) for t in edges[rank])
    plan = ShardedEdgeDot(s_idx, d_idx, torch.tensor(off), off)
    weights = _weights(edges, None, 51)
    xs = x.clone().requires_grad_(True)
    out = edgedot.edge_dot(xs, xs, torch.cat([e[0].long() for e in edges]), torch.cat([e[1].long() for e in edges]))
    (out * torch.cat(weights)).sum().backward()
    shard = x[off[rank]:off[rank + 1]].to(device).requires_grad_(True)
    got = plan(shard, shard)
    assert _rel(got, out.detach().split([30] * world_size)[rank]) <= TOL
    (got * weights[rank].to(device)).sum().backward()
    assert _rel(shard.grad, xs.grad[off[rank]:off[rank + 1]]) <= TOL


def _case_local_edges(rank, world_size, device):
    """Edges that need no remote row (no exchange at all), then edges kept with their dst row's
    owner (only the src side is exchanged)."""
    num_src, num_dst = 20, 16
    src_off = [0] + [num_src * (r + 1) // world_size for r in range(world_size)]
    dst_off = [0] + [num_dst * (r + 1) // world_size for r in range(world_size)]
    src, dst, _ = _problem(world_size, 60, num_src, num_dst, [0] * world_size)
    g = torch.Generator().manual_seed(61)
    local, by_dst = [], []
    for r in range(world_size):
        s = torch.randint(src_off[r], src_off[r + 1], (12,), generator=g)
        d = torch.randint(dst_off[r], dst_off[r + 1], (12,), generator=g)
        local.append((s, d))
        by_dst.append((torch.randint(0, num_src, (12,), generator=g), d))
    plan, *_ = _run_and_check(rank, world_size, device, src, dst, local, src_off, dst_off, None, 62)
    stats = plan.stats()
    assert stats["remote_edges"] == 0 and stats["forward_bytes_sent"] == stats["backward_bytes_received"] == 0
    plan, *_ = _run_and_check(rank, world_size, device, src, dst, by_dst, src_off, dst_off, None, 63)
    assert plan.stats()["remote_dst_rows"] == plan.stats()["served_dst_rows"] == 0


def _case_float32(rank, world_size, device):
    """float32 shards against the float64 reference, within float32 accuracy."""
    num_src, num_dst = 30, 25
    src_off, dst_off = _split(num_src, world_size, 4), _split(num_dst, world_size, 5)
    src, dst, edges = _problem(world_size, 70, num_src, num_dst, [40] * world_size, (2, 16), (2, 16))
    _run_and_check(rank, world_size, device, src, dst, edges, src_off, dst_off, 2, 71, dtype=torch.float32,
                   tol=1e-5)


def _case_subgroup(rank, world_size, device):
    """A plan over a subgroup (ranks 0 and the last): group ranks, not world ranks, own shards."""
    members = [0, world_size - 1]
    group = dist.new_group(members)
    if rank not in members:
        return
    num_src, num_dst = 15, 12
    src, dst, edges = _problem(2, 80, num_src, num_dst, [20, 26])
    _run_and_check(members.index(rank), 2, device, src, dst, edges, [0, 6, num_src], [0, 9, num_dst], None, 81,
                   group=group)


def _case_errors(rank, world_size, device):
    """Bad arguments on one rank raise on every rank, without a hang; the group stays usable."""
    num = 10
    off = [0] + [num * (r + 1) // world_size for r in range(world_size)]
    good = torch.arange(3, device=device)
    last = world_size - 1
    cases = [
        # (rank with the bad argument, its src_idx, dst_idx, src offsets, error, message on that rank)
        (last, good, torch.tensor([0, num, 1], device=device), off, IndexError, f"dst_idx holds {num}"),
        (0, torch.tensor([2, -1, 0], device=device), good, off, IndexError, "src_idx holds -1"),
        (0, good, good, off[:-1], ValueError, "src_row_offsets must have"),
        (last, good.float(), good, off, TypeError, "src_idx must be int32 or int64"),
        (0, good, good, [0] + [num] * world_size, ValueError, "differ between ranks"),
    ]
    for bad_rank, s_bad, d_bad, off_bad, error, message in cases:
        s, d, o = (s_bad, d_bad, off_bad) if rank == bad_rank else (good, good, off)
        with pytest.raises(error) as info:
            ShardedEdgeDot(s, d, o, off)
        if rank == bad_rank or "differ" in message:
            assert message in str(info.value), (rank, str(info.value))
        else:
            assert f"rank {bad_rank}" in str(info.value), (rank, str(info.value))
    plan = ShardedEdgeDot(good, good, off, off)
    shard = torch.zeros(off[rank + 1] - off[rank] + 1, 4, device=device, dtype=torch.float64)
    with pytest.raises(ValueError, match="src_shard has"):
        plan(shard, shard)
    rows = off[rank + 1] - off[rank]
    with pytest.raises(TypeError, match="src_shard is torch.float32"):
        plan(torch.zeros(rows, 4, device=device), torch.zeros(rows, 4, device=device, dtype=torch.float64))
    with pytest.raises(ValueError, match="feature sizes differ"):
        plan(torch.zeros(rows, 4, device=device), torch.zeros(rows, 3, device=device))


def _case_shard_signatures(rank, world_size, device):
    """Shards of equal row bytes but another dtype or width on one rank raise on every rank, naming
    the argument; so do shards one rank alone refuses. Every call agrees once: one small
    all_reduce, whatever the signature of the call before."""
    num = 10
    off = [0] + [num * (r + 1) // world_size for r in range(world_size)]
    rows = off[rank + 1] - off[rank]
    idx = torch.arange(num, device=device) % max(num, 1)
    plan = ShardedEdgeDot(idx, idx.flip(0), off, off)
    last = world_size - 1
    f32 = torch.zeros(rows, 4, device=device)
    cases = [
        # (both shards of the last rank: 16-byte rows like f32's, error, message on every rank)
        (torch.zeros(rows, 2, device=device, dtype=torch.float64), TypeError, "src_shard dtype differs"),
        (torch.zeros(rows, 8, device=device, dtype=torch.float16), TypeError, "src_shard dtype differs"),
        (torch.zeros(rows, 2, 2, device=device), ValueError, "src_shard feature shape"),
        (torch.zeros(rows + 1, 4, device=device), ValueError, None),  # refused on the last rank alone
    ]
    for bad, error, message in cases:
        with pytest.raises(error) as info:
            plan(*(bad, bad) if rank == last else (f32, f32))
        if message is not None:
            assert message in str(info.value), (rank, str(info.value))
        elif rank != last:
            assert f"rank {last}" in str(info.value), (rank, str(info.value))
    # The group is still usable, and each call runs exactly one agreement.
    reduces = []
    real_all_reduce = dist.all_reduce

    def counted(*args, **kwargs):
        reduces.append(args[0].numel())
        return real_all_reduce(*args, **kwargs)

    dist.all_reduce = counted
    try:
        src = torch.arange(num * 4, dtype=torch.float32, device=device).view(num, 4)
        want = edgedot.edge_dot(src, src, idx, idx.flip(0))
        for _ in range(3):
            got = plan(src[off[rank]:off[rank + 1]], src[off[rank]:off[rank + 1]])
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert len(reduces) == 3, reduces
        plan(src[off[rank]:off[rank + 1]].double(), src[off[rank]:off[rank + 1]].double())
        assert len(reduces) == 4, reduces
    finally:
        dist.all_reduce = real_all_reduce
