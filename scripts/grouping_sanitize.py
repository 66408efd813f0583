"""Groupings through both tile sizes of the one-launch sort and CUB's path, bad indices included,
then the three ops on a mini-batch: a workload for compute-sanitizer."""
import sys

import torch

import edgedot
from edgedot.runtime.build import cuda_module
from edgedot.runtime.plan import build_side, group_offsets

ext = cuda_module()
g = torch.Generator().manual_seed(0)
sizes = [int(x) for x in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1000, 2049, 10243, 300000]
bad = 0
for num_edges in sizes:
    for dt in (torch.int32, torch.int64):
        rows = torch.randint(0, 70000, (num_edges,), generator=g)
        others = torch.randint(0, 9000, (num_edges,), generator=g)
        rows[::97] = -3
        others[5::101] = 9000
        rows, others = rows.to(dt).cuda(), others.to(dt).cuda()
        got = ext.group_edges_both(rows, others, 70000, 9000)
        for i, (r, o, n, m) in enumerate(((rows, others, 70000, 9000), (others, rows, 9000, 70000))):
            want = build_side(r, o, n, m)
            bad += not torch.equal(got[2 * i], want) or not torch.equal(got[2 * i + 1], group_offsets(want, n))
        one = ext.group_edges(rows, others, 70000, 9000)
        want = build_side(rows, others, 70000, 9000)
        bad += not torch.equal(one[0], want)
S, F, N = 4096, 10, 45056
dst = torch.arange(S, device="cuda").repeat_interleave(F)
src = torch.randint(0, N, (S * F,), device="cuda")
q, k, v = (torch.randn(N, 4, 32, device="cuda", requires_grad=True) for _ in range(3))
out = edgedot.graph_attention(q, k, v, src, dst)
out.backward(torch.randn_like(out))
a_s, a_d = (torch.randn(N, 4, device="cuda", requires_grad=True) for _ in range(2))
out = edgedot.gat_attention(v, a_s, a_d, src, dst)
out.backward(torch.randn_like(out))
att = torch.randn(4, 32, device="cuda", requires_grad=True)
out = edgedot.gatv2_attention(k, q, att, src, dst)
out.backward(torch.randn_like(out))
edgedot.wait_for_checks()
torch.cuda.synchronize()
print(f"grouping workload: {len(sizes)} sizes x 2 dtypes, mismatches: {bad}")
sys.exit(1 if bad else 0)
