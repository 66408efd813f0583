"""Scaling of ShardedEdgeDot on paper: the request matrices its plan builder computes for R-MAT
graphs, and the time an alpha-beta model predicts from them, next to 1.5D replication schemes.

One CPU process, no torch.distributed: for every rank of a partition it calls the plan's own
``edgedot.distributed.plan.side_requests`` on that rank's edges, as ``ShardedEdgeDot`` does at
build time, and reads off what each call would move.

Set-up modelled:
  * R-MAT graph (Graph500 parameters a, b, c, d = 0.57, 0.19, 0.19, 0.05; edge factor 16) on
    2^scale nodes, one table of N rows used as both src and dst, D features of float32.
  * Partitions of the nodes over P ranks: ``contiguous`` (equal id ranges of R-MAT's own ids,
    whose recursive structure keeps hubs at low ids and some locality), ``random`` (a random
    permutation, then equal ranges: balanced rows, no locality) and ``balanced`` (contiguous id
    ranges cut at equal edge counts: R-MAT's locality with balanced work; a light stand-in for a
    real partitioner such as METIS, which was not run).
  * Each edge lives on the rank owning its dst row (a rank scores the edges into its own nodes),
    so only src rows travel; the dst side's requests are empty by construction.
  * Alpha-beta: ranks in hosts of 8 GPUs; NVLink 450 GB/s per direction inside a host, 50 GB/s
    per GPU between hosts, a latency per peer exchanged with (--alpha-intra-us, --alpha-inter-us).
    An all-to-all takes, on each rank, the latency of its peers plus the slowest of its four
    streams (in/out, intra/inter); the step waits for the slowest rank.
  * Local work at the H200's copy bandwidth (4246 GB/s read + write, measured 2026-11-30): per
    edge two rows read, two int32 indices and one float32 score; the backward twice the
    forward's bytes (one pass per side). The send buffer's gather and the table's local rows
    add twice their bytes. edgedot's forward moved its bytes at 98-101% of that bandwidth on the
    large H200 cases (README), so these are upper bounds on the local time only where hot rows
    hit in cache.
  * The forward starts the exchange, runs the all-local edges meanwhile, then the edges that
    touch received rows: ``T = T_gather + max(T_comm, T_local_edges) + T_remote_edges``.
    Communication is hidden when the slowest rank's step takes within 1% of the time it would
    take without any exchange (the ranks' imbalance included); the backward alike, with
    ``T = T_gather + max(T_comm, 2 T_local_edges) + 2 T_remote_edges``.

1.5D schemes of Bharadwaj, Buluc and Demmel (IPDPS 2022, after Koanantakool et al. 2016), with
replication factor c (c^2 <= P, c | P), as we read their structure (constant factors are ours):
  * dense shifting: one dense matrix replicated c-fold ((c - 1) N D / P words in), the other
    shifted P / c^2 times in blocks of c N D / P words: N D / c words, P / c^2 + log2 c messages.
  * sparse shifting: both dense matrices replicated c-fold (2 (c - 1) N D / P words), the
    sparse blocks (12 bytes per nonzero: two int32 indices and the score) shifted: E / c
    nonzeros, P / c^2 + log2 c messages.
  Each takes the c that minimises its modelled time; their volume does not depend on the
  partition (they permute rows randomly for balance). Their local work is the same per edge.

Usage:
  python scripts/scaling_model.py --scales 20 22 --ranks 2 4 8 16 32 64 128 256 512 1024 \
      --json scaling.json > scaling_tables.md

Memory: about 40 bytes per edge (int32 src and dst, their sorted copies, one int64 sort index);
scale 24 (268M edges) needs about 11 GB, scale 26 (1.07B edges) about 43 GB.
"""

import argparse
import json
import math
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/scripts/", 1)[0])
from edgedot.distributed.plan import side_requests  # noqa: E402

RMAT = (0.57, 0.19, 0.19)
COPY_BW = 4246e9          # H200 copy bandwidth, read + write bytes per second
NVLINK_BW = 450e9         # per direction, inside a host
NET_BW = 50e9             # per GPU, between hosts
GPUS_PER_HOST = 8


def rmat(scale, edge_factor, seed, chunk=1 << 24):
    """R-MAT edges (src, dst) as int32, generated in chunks (no relabelling)."""
    g = torch.Generator().manual_seed(seed)
    num_edges = edge_factor << scale
    a, b, c = RMAT
    src = torch.empty(num_edges, dtype=torch.int32)
    dst = torch.empty(num_edges, dtype=torch.int32)
    for start in range(0, num_edges, chunk):
        n = min(chunk, num_edges - start)
        s = torch.zeros(n, dtype=torch.int32)
        d = torch.zeros(n, dtype=torch.int32)
        for level in range(scale):
            u = torch.rand(n, generator=g)
            s |= (u >= a + b).to(torch.int32) << level
            d |= (((u >= a) & (u < a + b)) | (u >= a + b + c)).to(torch.int32) << level
        src[start:start + n] = s
        dst[start:start + n] = d
    return src, dst


def partitions(src, dst, num_nodes, seed):
    """(name, src, dst sorted by dst, offsets_for(P)) per partition; node ids renumbered so that
    every partition is contiguous ranges of its ids."""
    order = torch.argsort(dst)
    natural = (src[order], dst[order])
    yield "contiguous", natural, lambda p: [num_nodes * r // p for r in range(p + 1)]

    def balanced(p):
        cuts = natural[1][torch.tensor([len(dst) * r // p for r in range(1, p)], dtype=torch.int64)].tolist()
        return [0] + [max(c_, 0) for c_ in cuts] + [num_nodes]
    yield "balanced", natural, balanced
    del natural, order

    g = torch.Generator().manual_seed(seed)
    relabel = torch.randperm(num_nodes, generator=g).to(torch.int32)
    s, d = relabel[src.long()], relabel[dst.long()]
    order = torch.argsort(d)
    yield "random", (s[order], d[order]), lambda p: [num_nodes * r // p for r in range(p + 1)]


def analyse(src_sorted, dst_sorted, offsets, row_bytes, args):
    """Per-rank request rows from the plan builder, and the model's times (seconds)."""
    p = len(offsets) - 1
    off = torch.tensor(offsets, dtype=torch.int64)
    bounds = torch.searchsorted(dst_sorted, off.to(torch.int32)).tolist()
    matrix = torch.zeros(p, p, dtype=torch.int64)
    edges = torch.zeros(p, dtype=torch.int64)
    local_edges = torch.zeros(p, dtype=torch.int64)
    for r in range(p):
        s = src_sorted[bounds[r]:bounds[r + 1]]
        _, counts = side_requests(s, off, r)
        matrix[r] = counts
        edges[r] = s.numel()
        local_edges[r] = int(((s >= offsets[r]) & (s < offsets[r + 1])).sum())
    recv_rows = matrix.sum(1)                  # unique remote rows each rank receives
    send_rows = matrix.sum(0)                  # rows each rank serves
    per_edge_rows = edges - local_edges        # remote rows if every edge fetched its own
    host = torch.arange(p) // GPUS_PER_HOST
    same = host[:, None] == host[None, :]
    alpha_intra, alpha_inter = args.alpha_intra_us * 1e-6, args.alpha_inter_us * 1e-6
    recv_intra = (matrix * same).sum(1) * row_bytes
    recv_inter = (matrix * ~same).sum(1) * row_bytes
    send_intra = (matrix * same).sum(0) * row_bytes
    send_inter = (matrix * ~same).sum(0) * row_bytes
    peers_intra = ((matrix > 0) & same).sum(1) + ((matrix > 0) & same).sum(0)
    peers_inter = ((matrix > 0) & ~same).sum(1) + ((matrix > 0) & ~same).sum(0)
    streams = torch.stack([recv_intra / NVLINK_BW, send_intra / NVLINK_BW,
                           recv_inter / NET_BW, send_inter / NET_BW]).amax(0)
    t_latency = (peers_intra * alpha_intra + peers_inter * alpha_inter) / 2
    t_comm = streams + t_latency
    edge_bytes = 2 * row_bytes + 12
    t_local_edges = local_edges * edge_bytes / COPY_BW
    t_remote_edges = (edges - local_edges) * edge_bytes / COPY_BW
    rows_owned = torch.tensor([offsets[r + 1] - offsets[r] for r in range(p)], dtype=torch.int64)
    t_gather = 2 * row_bytes * (send_rows + torch.minimum(rows_owned, edges - local_edges)) / COPY_BW
    t_forward = t_gather + torch.maximum(t_comm, t_local_edges) + t_remote_edges
    t_backward = t_gather + torch.maximum(t_comm, 2 * t_local_edges) + 2 * t_remote_edges

    num_nodes, num_edges = offsets[-1], int(edges.sum())
    avg = lambda t: float(t.double().mean())
    result = {
        "P": p,
        "edges_avg": avg(edges), "edges_max_over_avg": float(edges.max()) / max(avg(edges), 1),
        "local_edge_fraction": float(local_edges.sum()) / num_edges,
        "remote_rows_avg": avg(recv_rows), "remote_rows_max": int(recv_rows.max()),
        "dedup_ratio": float(per_edge_rows.sum()) / max(int(recv_rows.sum()), 1),
        "recv_max_over_avg": float(recv_rows.max()) / max(avg(recv_rows), 1e-12),
        "send_max_over_avg": float(send_rows.max()) / max(avg(send_rows), 1e-12),
        "recv_bytes_max": int(recv_rows.max()) * row_bytes, "send_bytes_max": int(send_rows.max()) * row_bytes,
        "t_comm_ms": 1e3 * float(t_comm.max()),
        "t_latency_ms": 1e3 * float(t_latency.max()),
        "comm_over_all_edges": float(t_comm.max()) / max(float((t_local_edges + t_remote_edges).max()), 1e-12),
        "t_local_edges_ms": 1e3 * float(t_local_edges.max()),
        "t_all_edges_ms": 1e3 * float((t_local_edges + t_remote_edges).max()),
        "t_forward_ms": 1e3 * float(t_forward.max()),
        "t_backward_ms": 1e3 * float(t_backward.max()),
        # Hidden: the step (slowest rank) takes within 1% of the time it would without exchanges.
        "hidden_forward": float(t_forward.max()) <= 1.01 * float((t_gather + t_local_edges + t_remote_edges).max()),
        "hidden_backward": float(t_backward.max()) <= 1.01 * float(
            (t_gather + 2 * t_local_edges + 2 * t_remote_edges).max()),
    }
    result.update(one_and_half_d(num_nodes, num_edges, p, row_bytes, args))
    return result


def one_and_half_d(num_nodes, num_edges, p, row_bytes, args):
    """Best modelled communication time (ms) of the two 1.5D schemes and its replication c.

    Replication stays inside a host while c <= 8 (NVLink); the shifts cross hosts once P > 8."""
    shift_bw = NVLINK_BW if p <= GPUS_PER_HOST else NET_BW
    alpha = (args.alpha_intra_us if p <= GPUS_PER_HOST else args.alpha_inter_us) * 1e-6
    best = {}
    for name in ("dense_shift", "sparse_shift"):
        options = []
        c = 1
        while c * c <= p:
            if p % c == 0:
                messages = p / (c * c) + math.log2(c)
                replicas = 1 if name == "dense_shift" else 2
                replicate = replicas * (c - 1) * num_nodes * row_bytes / p
                shift = num_nodes * row_bytes / c if name == "dense_shift" else 12 * num_edges / c
                t = (alpha * messages + replicate / (NVLINK_BW if c <= GPUS_PER_HOST else NET_BW)
                     + shift / shift_bw)
                options.append((t, c, replicate + shift))
            c *= 2
        t, c, volume = min(options)
        best[f"{name}_ms"] = 1e3 * t
        best[f"{name}_c"] = c
        best[f"{name}_bytes"] = volume
    return best


def markdown(rows, scale, dim):
    head = ("| partition | P | edges/rank | max/avg edges | all-local edges | unique remote rows/rank (max) | "
            "dedup | max/avg recv | max/avg send | comm ms (latency) | local-edge ms | all-edge ms | "
            "comm/all-edge | fwd ms | bwd ms | hidden fwd/bwd | 1.5D dense ms (c) | 1.5D sparse ms (c) |")
    lines = [f"\n### R-MAT scale {scale} ({1 << scale} nodes, {16 << scale} edges), D={dim} float32\n", head,
             "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r['partition']} | {r['P']} | {r['edges_avg']:.3g} | {r['edges_max_over_avg']:.2f} | "
            f"{100 * r['local_edge_fraction']:.1f}% | {r['remote_rows_avg']:.3g} ({r['remote_rows_max']:.3g}) | "
            f"{r['dedup_ratio']:.2f} | {r['recv_max_over_avg']:.2f} | {r['send_max_over_avg']:.2f} | "
            f"{r['t_comm_ms']:.3g} ({r['t_latency_ms']:.2g}) | {r['t_local_edges_ms']:.3g} | "
            f"{r['t_all_edges_ms']:.3g} | {r['comm_over_all_edges']:.2g} | "
            f"{r['t_forward_ms']:.3g} | {r['t_backward_ms']:.3g} | "
            f"{'yes' if r['hidden_forward'] else 'no'}/{'yes' if r['hidden_backward'] else 'no'} | "
            f"{r['dense_shift_ms']:.3g} ({r['dense_shift_c']}) | {r['sparse_shift_ms']:.3g} ({r['sparse_shift_c']}) |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scales", type=int, nargs="+", default=[20])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64, 128, 256, 512, 1024])
    parser.add_argument("--partitions", nargs="+", default=["contiguous", "balanced", "random"])
    parser.add_argument("--dim", type=int, default=128, help="features per row (float32)")
    parser.add_argument("--alpha-intra-us", type=float, default=3.0)
    parser.add_argument("--alpha-inter-us", type=float, default=8.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write every row here")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    row_bytes = 4 * args.dim
    every = []
    for scale in args.scales:
        started = time.time()
        num_nodes = 1 << scale
        src, dst = rmat(scale, 16, args.seed + scale)
        print(f"# scale {scale}: R-MAT generated in {time.time() - started:.1f} s", file=sys.stderr)
        rows = []
        for name, (s, d), offsets_for in partitions(src, dst, num_nodes, args.seed):
            if name not in args.partitions:
                continue
            for p in args.ranks:
                t0 = time.time()
                row = {"scale": scale, "partition": name, **analyse(s, d, offsets_for(p), row_bytes, args)}
                rows.append(row)
                print(f"# scale {scale} {name} P={p}: {time.time() - t0:.1f} s", file=sys.stderr)
        every += rows
        print(markdown(rows, scale, args.dim))
        print(f"# scale {scale} done in {time.time() - started:.1f} s", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": every}, f, indent=1)


if __name__ == "__main__":
    main()
