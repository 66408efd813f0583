"""GATv2's forward + backward at the real ogbn-products size on a CUDA card: the time and the peak
extra memory of :func:`edgedot.gatv2_attention` (edges given grouped by ``dst_ptr``, as the
benchmark calls it) and of ``edgedot.nn.GATv2Conv`` (projections included, on a ``[2, E]`` tensor,
``add_self_loops=False``): the evidence behind the README's memory table, without the peers.

    python scripts/gatv2_memory.py [--nodes 2449029] [--edges 123718280] [--reps 3] [--memory-gb G]

``--memory-gb`` caps what the caching allocator may hold (``set_per_process_memory_fraction``): below
what the backward's per-edge records need, it recomputes instead (its peak then shows it).

Uniform random edges, bfloat16, 4 heads of 32, 128 input features. Peak extra memory: the caching
allocator's peak during one forward + backward above what was allocated before it. Times: medians
of ``reps`` CUDA-event timings after one warm-up call.
"""

import argparse
import statistics

import torch

import edgedot
import edgedot.nn

HEADS, DIM, FEATURES = 4, 32, 128


def measure(step, reps):
    """(median ms, peak extra GB) of ``step()``, a forward + backward."""
    step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - before) / 1e9
    times = []
    for _ in range(reps):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(begin.elapsed_time(end))
    return statistics.median(times), peak


def report(name, step, reps):
    """Prints ``measure(step, reps)``, or that the step ran out of the memory allowed."""
    try:
        ms, peak = measure(step, reps)
        print(f"{name:32s} {ms:9.1f} ms  peak extra {peak:6.2f} GB", flush=True)
    except torch.OutOfMemoryError:
        print(f"{name:32s} out of memory", flush=True)
    torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=2_449_029)
    parser.add_argument("--edges", type=int, default=123_718_280)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--memory-gb", type=float, help="cap on the memory this process may allocate")
    args = parser.parse_args()
    dtype, device = torch.bfloat16, "cuda"
    if args.memory_gb:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_gb * 1e9 / total))
    gen = torch.Generator(device).manual_seed(0)
    src = torch.randint(args.nodes, (args.edges,), generator=gen, device=device)
    dst = torch.randint(args.nodes, (args.edges,), generator=gen, device=device)
    order = torch.argsort(dst)
    src_sorted, dst_sorted = src[order].int(), dst[order].int()
    ptr = torch.zeros(args.nodes + 1, dtype=torch.int64, device=device)
    ptr[1:] = torch.bincount(dst, minlength=args.nodes).cumsum(0)
    del order
    x_src, x_dst = (torch.randn(args.nodes, HEADS, DIM, generator=gen, device=device, dtype=dtype, requires_grad=True)
                    for _ in range(2))
    att = torch.randn(HEADS, DIM, generator=gen, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(args.nodes, HEADS, DIM, generator=gen, device=device, dtype=dtype)

    def op_step():
        out = edgedot.gatv2_attention(x_src, x_dst, att, src_sorted, dst_sorted, dst_ptr=ptr)
        out.backward(grad)
        x_src.grad = x_dst.grad = att.grad = None

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bfloat16, {args.nodes} nodes, "
          f"{args.edges} edges, {HEADS} heads x {DIM}; forward + backward")
    report("gatv2_attention (dst_ptr)", op_step, args.reps)
    del src_sorted, dst_sorted, ptr
    x = torch.randn(args.nodes, FEATURES, generator=gen, device=device, dtype=dtype)
    edge_index = torch.stack([src, dst])
    del src, dst
    layer = edgedot.nn.GATv2Conv(FEATURES, DIM, heads=HEADS, add_self_loops=False).to(device, dtype)
    layer_grad = grad.view(args.nodes, HEADS * DIM)

    def layer_step():
        layer(x, edge_index).backward(layer_grad)
        layer.zero_grad(set_to_none=True)

    report("GATv2Conv ([2, E] tensor)", layer_step, args.reps)


if __name__ == "__main__":
    main()
