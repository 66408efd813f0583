"""The GAT layers' self-loop handling on CUDA, before against after, in one process: the five
tensor operations (``where`` of the loops' destinations, ``arange``, two concatenations, the
comparison) against the extension's one ``self_looped`` kernel, on the mini-batch of
``scripts/profile_minibatch.py`` (16,384 seeds x 10 in-edges among 180,224 nodes, 128 input
features, 4 heads x 32, default options: self-loops added).

    python scripts/ab_self_loops.py [--rounds 8] [--calls 30] [--dtypes float32,bfloat16]

Both variants take turns in rounds (each: warm-up, then ``calls`` forward + backward steps, each on
a fresh clone of one of 8 batches), and the medians of CUDA-event times over the rounds' medians
are printed, with the host's time to issue a step while the device is kept busy (a queued sleep).
The outputs and gradients of the two variants are first checked for equality.
"""

import argparse
import statistics
import time

import torch

import edgedot.nn
from edgedot.nn import gat_conv
from edgedot.nn._pyg import Adjacency

SEEDS, FANOUT, HEADS, DIM, IN_CHANNELS = 16_384, 10, 4, 32, 128


def tensor_ops_loops(self, edge_index, edge_attr, num_nodes, num_dst):
    """The handling before the kernel (edge features not supported here: the batch has none)."""
    assert edge_attr is None
    src = edge_index[0]
    dst = torch.where(src == edge_index[1], num_dst, edge_index[1])
    loop = torch.arange(num_nodes, device=edge_index.device, dtype=edge_index.dtype)
    return None, Adjacency(torch.cat([src, loop]), torch.cat([dst, loop]), None, None, True)


VARIANTS = {"tensor ops": tensor_ops_loops, "kernel": gat_conv._GATBase._loops_in_place}


def step(layer, x, batch, grad):
    out = layer(x, batch.clone())
    x.grad = None
    for p in layer.parameters():
        p.grad = None
    out.backward(grad)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args()
    num_nodes = 11 * SEEDS
    gen = torch.Generator("cuda").manual_seed(0)
    batches = []
    for _ in range(8):
        dst = torch.arange(SEEDS, device="cuda").repeat_interleave(FANOUT)
        src = torch.randint(num_nodes, (dst.shape[0],), generator=gen, device="cuda")
        src[::97] = dst[::97]  # some self-loops, which the handling drops
        batches.append(torch.stack([src, dst]))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; µs per forward + backward step")
    for dtype in [getattr(torch, d) for d in args.dtypes.split(",")]:
        for name in ("GATConv", "GATv2Conv"):
            torch.manual_seed(0)
            layer = getattr(edgedot.nn, name)(IN_CHANNELS, DIM, heads=HEADS).to("cuda", dtype)
            x = torch.randn(num_nodes, IN_CHANNELS, device="cuda", dtype=dtype, requires_grad=True)
            grad = torch.randn(num_nodes, HEADS * DIM, device="cuda", dtype=dtype)
            results = {}
            for variant, loops in VARIANTS.items():
                gat_conv._GATBase._loops_in_place = loops
                out = step(layer, x, batches[0], grad)
                results[variant] = [out] + [x.grad] + [p.grad for p in layer.parameters()]
            same = all(torch.equal(a, b) for a, b in zip(*results.values()))
            times = {v: [] for v in VARIANTS}
            host = {v: [] for v in VARIANTS}
            for _ in range(args.rounds):
                for variant, loops in VARIANTS.items():
                    gat_conv._GATBase._loops_in_place = loops
                    for i in range(5):
                        step(layer, x, batches[i % 8], grad)
                    events = []
                    for i in range(args.calls):
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        start.record()
                        step(layer, x, batches[i % 8], grad)
                        end.record()
                        events.append((start, end))
                    torch.cuda.synchronize()
                    times[variant].append(statistics.median(s.elapsed_time(e) * 1e3 for s, e in events))
                    issue = []
                    for i in range(10):
                        torch.cuda._sleep(10_000_000)
                        begin = time.perf_counter()
                        step(layer, x, batches[i % 8], grad)
                        issue.append(1e6 * (time.perf_counter() - begin))
                        torch.cuda.synchronize()
                    host[variant].append(statistics.median(issue))
            gat_conv._GATBase._loops_in_place = VARIANTS["kernel"]
            before, after = statistics.median(times["tensor ops"]), statistics.median(times["kernel"])
            host_before, host_after = statistics.median(host["tensor ops"]), statistics.median(host["kernel"])
            print(f"{name:10s} {str(dtype)[6:]:9s} step {before:8.1f} -> {after:8.1f} ({after / before:.3f})  "
                  f"host {host_before:8.1f} -> {host_after:8.1f} ({host_after / host_before:.3f})  "
                  f"same bits: {same}")


if __name__ == "__main__":
    main()
