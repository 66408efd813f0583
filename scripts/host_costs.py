"""The host's time to issue single pieces of an attention call on a CUDA machine, so that the
costliest can be told apart (docs/performance.md, the mini-batch profile's host column).

    python scripts/host_costs.py [--seeds 16384] [--fanout 10] [--dtype float32] [--layers] [--threads]

The batch is scripts/profile_minibatch.py's: ``seeds`` destinations with ``fanout`` in-edges each,
sources among ``11 * seeds`` nodes, 4 heads of 32. Each piece is timed with ``time.perf_counter``
while the device runs a sleep queued ahead of it, so that no call waits for the device and only the
host's own work is counted; rounds of ``CALLS`` calls keep the launch queue short. Medians, µs.
"""

import argparse
import statistics
import time

import torch

import edgedot
from edgedot.ops import attention as attention_ops
from edgedot.runtime import checks
from edgedot.runtime.build import cuda_module

HEADS, DIM = 4, 32
ROUNDS, CALLS = 30, 8


def host_us(piece):
    """Median host µs of ``piece()`` with the device busy."""
    for _ in range(3):
        piece()
    torch.cuda.synchronize()
    times = []
    for _ in range(ROUNDS):
        torch.cuda._sleep(10_000_000)  # a few ms: longer than CALLS calls take to issue
        for _ in range(CALLS):
            begin = time.perf_counter()
            piece()
            times.append(time.perf_counter() - begin)
        torch.cuda.synchronize()
    return 1e6 * statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=16_384)
    parser.add_argument("--fanout", type=int, default=10)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--layers", action="store_true",
                        help="time the three layers' forward + backward (edgedot's and PyG's) instead, and "
                             "profile edgedot's by Python function")
    parser.add_argument("--threads", action="store_true",
                        help="also trace graph attention's forward + backward with its backward on autograd's "
                             "device thread and on the calling thread: each span's median length and thread")
    args = parser.parse_args()
    if args.layers:
        layers(args)
        return
    dtype = getattr(torch, args.dtype)
    ext = cuda_module()
    num_nodes = 11 * args.seeds
    gen = torch.Generator("cuda").manual_seed(0)
    dst = torch.arange(args.seeds, device="cuda").repeat_interleave(args.fanout)
    src = torch.randint(num_nodes, (dst.shape[0],), generator=gen, device="cuda")
    num_edges = dst.shape[0]
    q, k, v = (torch.randn(num_nodes, HEADS, DIM, generator=gen, device="cuda", dtype=dtype) for _ in range(3))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    grad = torch.randn_like(q)
    scale = DIM ** -0.5
    dst_group, dst_offsets = ext.group_edges(dst, src, num_nodes, num_nodes)
    src_group, src_offsets = ext.group_edges(src, dst, num_nodes, num_nodes)
    small_dst, small_src = dst[:64].clone(), src[:64].clone()
    small_group, small_offsets = ext.group_edges(small_dst, small_src, num_nodes, num_nodes)
    out, lse, _, _ = ext.attention_forward(q, k, v, None, src, dst, dst_group, dst_offsets, scale, 0.0, None, False)
    x = torch.zeros(1024, device="cuda")
    dst32, flat = dst.to(torch.int32), torch.ones(num_nodes + 1, dtype=torch.int64, device="cuda")

    def forward_backward():
        qg.grad = kg.grad = vg.grad = None
        edgedot.graph_attention(qg, kg, vg, src.clone(), dst.clone()).backward(grad)

    pieces = {
        "torch.empty (163840 int64)": lambda: torch.empty(num_edges, dtype=torch.int64, device="cuda"),
        "x.add_(1): one aten launch": lambda: x.add_(1),
        "torch.sort (int32, stable)": lambda: torch.sort(dst32, stable=True),
        "torch.cumsum (int64 rows)": lambda: torch.cumsum(flat, 0),
        "ext.graph_flags": lambda: ext.graph_flags(src, num_nodes, dst, num_nodes, None, True, True),
        "two index clones (in each piece below that takes new indices)": lambda: (src.clone(), dst.clone()),
        "check_inputs": lambda: attention_ops.check_inputs(q, k, v, src, dst, None),
        "check_graph, new indices": lambda: checks.check_graph(src.clone(), num_nodes, dst.clone(), num_nodes),
        "check_graph, the same indices (remembered)": lambda: checks.check_graph(src, num_nodes, dst, num_nodes),
        "ext.group_edges_both": lambda: ext.group_edges_both(dst, src, num_nodes, num_nodes),
        "edge_groupings with the graph's check, new indices": lambda: attention_ops.edge_groupings(
            None, None, kg, qg, src.clone(), dst.clone(), True, (kg, vg)),
        "ext.group_edges": lambda: ext.group_edges(dst, src, num_nodes, num_nodes),
        "ext.attention_forward, 64 edges (no schedule)": lambda: ext.attention_forward(
            q, k, v, None, small_src, small_dst, small_group, small_offsets, scale, 0.0, None, False),
        "ext.attention_forward (schedule built)": lambda: ext.attention_forward(
            q, k, v, None, src, dst, dst_group, dst_offsets, scale, 0.0, None, False),
        "ext.attention_backward (two schedules)": lambda: ext.attention_backward(
            grad, q, k, v, None, out, lse, src, dst, dst_group, dst_offsets, src_group, src_offsets, scale, 0.0,
            None, False, True, True),
        "graph_attention forward, no grad": lambda: edgedot.graph_attention(q, k, v, src.clone(), dst.clone()),
        "graph_attention forward with grad (no backward)": lambda: edgedot.graph_attention(
            qg, kg, vg, src.clone(), dst.clone()),
        "graph_attention forward with grad, the same indices": lambda: edgedot.graph_attention(qg, kg, vg, src, dst),
        "graph_attention forward + backward": forward_backward,
    }
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}, E={num_edges}, "
          f"N={num_nodes}; host µs per call, device kept busy")
    for name, piece in pieces.items():
        print(f"{host_us(piece):9.1f}  {name}", flush=True)
        checks.deferred.wait()  # the checks' read-back buffers back for the next piece
    # The backward runs on autograd's device thread; on the calling thread instead, its Python
    # shows in cProfile, and the difference is the hand-over's cost.
    with torch.autograd.set_multithreading_enabled(False):
        print(f"{host_us(forward_backward):9.1f}  graph_attention forward + backward, backward on the calling thread")
        profile(forward_backward)
    if args.threads:
        for multithreading in (True, False):
            with torch.autograd.set_multithreading_enabled(multithreading):
                print(f"\n== spans, backward on the {'device' if multithreading else 'calling'} thread")
                thread_spans(forward_backward)


def layers(args):
    """Host µs of edgedot's three layers' forward + backward on the batch, default options (the
    backward on the calling thread, as cProfile needs), then cProfile's view of each."""
    import edgedot.nn
    dtype = getattr(torch, args.dtype)
    num_nodes = 11 * args.seeds
    gen = torch.Generator("cuda").manual_seed(0)
    dst = torch.arange(args.seeds, device="cuda").repeat_interleave(args.fanout)
    src = torch.randint(num_nodes, (dst.shape[0],), generator=gen, device="cuda")
    edge_index = torch.stack([src, dst])
    x = torch.randn(num_nodes, 128, generator=gen, device="cuda", dtype=dtype)
    grad = torch.randn(num_nodes, HEADS * DIM, generator=gen, device="cuda", dtype=dtype)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}, E={dst.shape[0]}, "
          f"N={num_nodes}; host µs per layer forward + backward (backward on the calling thread), device kept busy")
    steps = {}
    for name in ("TransformerConv", "GATConv", "GATv2Conv"):
        ours = getattr(edgedot.nn, name)(128, DIM, heads=HEADS).to("cuda", dtype)

        def step(layer=ours):
            for p in layer.parameters():
                p.grad = None
            layer(x, edge_index.clone()).backward(grad)
        steps[name] = step
    with torch.autograd.set_multithreading_enabled(False):
        for name, step in steps.items():
            print(f"{host_us(step):9.1f}  {name}", flush=True)
        for name, step in steps.items():
            print(f"\n== {name}")
            profile(step, top=40)


def thread_spans(piece, top=25):
    """torch.profiler's CPU spans over ROUNDS * CALLS calls of ``piece``, the device kept busy: per
    span name, its count a call, median µs and the threads it ran on (0: the calling thread, 1,
    2, ...: others in order of appearance), the costliest first (median times count)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    for _ in range(3):
        piece()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(ROUNDS):
            torch.cuda._sleep(10_000_000)
            for _ in range(CALLS):
                piece()
            torch.cuda.synchronize()
    calls = ROUNDS * CALLS
    threads, spans = {}, {}
    # Labelled in order of first appearance: each call starts on the calling thread (0).
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        label = threads.setdefault(event.thread, len(threads))
        entry = spans.setdefault(event.name, ([], set()))
        entry[0].append(event.time_range.elapsed_us())
        entry[1].add(label)
    rows = sorted(spans.items(), key=lambda item: -statistics.median(item[1][0]) * len(item[1][0]))
    print(f"{'µs (median)':>12} {'a call':>7}  threads  span")
    for name, (lengths, labels) in rows[:top]:
        print(f"{statistics.median(lengths):12.1f} {len(lengths) / calls:7.2f}  {sorted(labels)!s:8} {name[:90]}")


def profile(piece, top=30):
    """cProfile's costliest functions by own time, then by time with callees, over ROUNDS * CALLS
    calls, the device kept busy."""
    import cProfile
    import pstats
    profiler = cProfile.Profile()
    for _ in range(ROUNDS):
        torch.cuda._sleep(10_000_000)
        profiler.enable()
        for _ in range(CALLS):
            piece()
        profiler.disable()
        torch.cuda.synchronize()
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)


if __name__ == "__main__":
    main()
