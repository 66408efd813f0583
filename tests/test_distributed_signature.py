"""ShardedEdgeDot when one rank alone changes its shards' dtype or shape between two calls.

Every rank must take the same path through a call: a rank that agreed on a signature once and a
rank that changed it must still meet in the same collectives, so the change raises a clear error
on every rank instead of leaving the others waiting until the process group's timeout. Runs 2
gloo processes on the CPU; a dead line (and a short collective timeout inside the workers) turns
a hang into a failure."""

import datetime
import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import edgedot
from edgedot.distributed import ShardedEdgeDot

WORLD_SIZE = 2
TIME_LIMIT_S = 240  # the whole group, process start-up included (as tests/test_distributed.py)
COLLECTIVE_TIMEOUT_S = 30  # a collective that no other rank joins fails within this


def _run_group(case):
    """Runs ``case(rank, world_size)`` on ``WORLD_SIZE`` spawned processes; fails if any raises or
    if they are not all done within ``TIME_LIMIT_S`` (then kills them)."""
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_worker, args=(case, os.path.join(tmp, "rendezvous")), nprocs=WORLD_SIZE,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + TIME_LIMIT_S
        try:
            while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    pytest.fail(f"{WORLD_SIZE} processes did not finish within {TIME_LIMIT_S} s: a rank is blocked")
        finally:
            for process in ctx.processes:
                if process.is_alive():
                    process.kill()


def _worker(rank, case, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        case(rank, WORLD_SIZE)
    finally:
        dist.destroy_process_group()


def _setting(rank, world_size):
    """A plan whose edges need rows of every other rank (both sides exchange), the whole table and
    this rank's rows of it."""
    num = 12
    off = [num * r // world_size for r in range(world_size + 1)]
    idx = torch.arange(num)
    plan = ShardedEdgeDot(idx, idx.flip(0), off, off)
    table = torch.arange(num * 4, dtype=torch.float64).view(num, 4) / 7
    want = edgedot.edge_dot(table, table, idx, idx.flip(0))
    return plan, table[off[rank]:off[rank + 1]], want


def _expect_on_every_rank(call, error, message):
    with pytest.raises(error) as info:
        call()
    assert message in str(info.value), str(info.value)


def _case_one_rank_changes(rank, world_size):
    plan, shard, want = _setting(rank, world_size)
    last = world_size - 1
    # Every rank agrees on float32 [rows, 4], twice.
    for _ in range(2):
        torch.testing.assert_close(plan(shard.float(), shard.float()), want.float())
    # The last rank alone switches to float64, then to [rows, 2, 2], then passes a shard of the
    # wrong row count: every rank raises, none waits.
    changes = [
        (lambda: shard, TypeError, "src_shard dtype differs between ranks"),
        (lambda: shard.float().view(-1, 2, 2), ValueError, "src_shard feature shape (all but the rows) differs"),
        (lambda: torch.cat([shard.float(), shard.float()[:1]]), ValueError, None),
    ]
    for changed, error, message in changes:
        mine = changed() if rank == last else shard.float()
        if message is None:  # refused on the last rank; the others name it
            message = "src_shard has" if rank == last else f"rank {last} refused its arguments"
        _expect_on_every_rank(lambda: plan(mine, mine), error, message)
        # The group and the plan still work, on the signature every rank had agreed on.
        torch.testing.assert_close(plan(shard.float(), shard.float()), want.float())
    # Every rank changing together is fine, forward and backward.
    src = shard.clone().requires_grad_(True)
    out = plan(src, shard)
    torch.testing.assert_close(out, want)
    out.sum().backward()
    assert src.grad is not None and src.grad.shape == src.shape


def _case_one_rank_changes_without_exchange(rank, world_size):
    """All edges local: the calls exchange no rows, so only the agreement itself can meet."""
    num = 8
    off = [num * r // world_size for r in range(world_size + 1)]
    idx = torch.arange(off[rank], off[rank + 1])
    plan = ShardedEdgeDot(idx, idx, off, off)
    shard = torch.randn(off[rank + 1] - off[rank], 3, dtype=torch.float64)
    want = (shard * shard).sum(-1)
    torch.testing.assert_close(plan(shard, shard), want)
    mine = shard.half() if rank == 0 else shard
    _expect_on_every_rank(lambda: plan(mine, mine), TypeError, "src_shard dtype differs between ranks")
    torch.testing.assert_close(plan(shard, shard), want)


@pytest.mark.parametrize("case", [_case_one_rank_changes, _case_one_rank_changes_without_exchange])
def test_one_rank_changing_its_shards_raises_on_every_rank(case):
    _run_group(case)
