"""Where a training step's time goes on fresh neighbour-sampled mini-batches, on a CUDA machine:
the evidence behind docs/performance.md's mini-batch profile.

    python scripts/profile_minibatch.py [--dtype float32] [--fanout 10] [--seeds 16384] [--kernels] [--shapes]
                                        [--host] [--json FILE]

The batch is what PyG's ``NeighborLoader`` hands over: ``seeds`` destination nodes (0 .. seeds-1)
with ``fanout`` in-edges each from sources drawn among ``11 * seeds`` nodes, grouped by
destination, 4 heads of 32, 128 input features. Every call gets new index tensors (a pool of
batches, each cloned before its call), so nothing learned about an earlier batch helps.

For each path (the three ops with default options, ``torch.compile`` of their unfused math, and
the three layers, edgedot's and PyG's with the same weights, called as ``conv(x, edge_index)``
with default options): the median of CUDA-event times of a forward and of a forward+backward
after warm-up, and, over a profiled run of forward+backward calls, per call: kernels launched,
their summed device time, the host's time to issue the call, and the host's waits for the device
(``cuda*Synchronize`` and blocking copies). Then, under ``torch.cuda.set_sync_debug_mode("warn")``,
the source lines where a call synchronises.
"""

import argparse
import json
import statistics
import time
import warnings

import torch

import edgedot
from edgedot.bench.attention_check import unfused_attention
from edgedot.bench.gat import unfused_gat

HEADS, DIM, IN_CHANNELS = 4, 32, 128
POOL = 8  # distinct batches cycled through (each call clones one)
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def batches(seeds, fanout, num_nodes, index_dtype, generator):
    """``POOL`` edge indices ``[2, seeds * fanout]``, sorted by destination."""
    out = []
    for _ in range(POOL):
        dst = torch.arange(seeds, device="cuda").repeat_interleave(fanout)
        src = torch.randint(num_nodes, (dst.shape[0],), generator=generator, device="cuda")
        out.append(torch.stack([src, dst]).to(index_dtype))
    return out


def make_paths(args):
    """name -> function(step, backward) running one call on batch ``step % POOL``'s fresh copy."""
    dtype = getattr(torch, args.dtype)
    num_nodes = 11 * args.seeds
    gen = torch.Generator("cuda").manual_seed(0)
    pool = batches(args.seeds, args.fanout, num_nodes, torch.int64, gen)

    def normal(*shape):
        return torch.randn(shape, generator=gen, device="cuda", dtype=dtype).requires_grad_()

    x = normal(num_nodes, IN_CHANNELS)
    q, k, v = normal(num_nodes, HEADS, DIM), normal(num_nodes, HEADS, DIM), normal(num_nodes, HEADS, DIM)
    a_src, a_dst = normal(num_nodes, HEADS), normal(num_nodes, HEADS)
    att = normal(HEADS, DIM)
    grad = torch.randn(num_nodes, HEADS, DIM, generator=gen, device="cuda", dtype=dtype)
    grad_layer = grad.view(num_nodes, HEADS * DIM)
    scale = DIM ** -0.5

    def fresh(step):
        edge_index = pool[step % POOL].clone()
        return edge_index, edge_index[0], edge_index[1]

    leaves = [x, q, k, v, a_src, a_dst, att]

    def run(forward, grad_out):
        def call(step, backward):
            out = forward(step)
            if backward:
                # As optimizer.zero_grad() does: the backward writes fresh gradients, no accumulation.
                for leaf in leaves:
                    leaf.grad = None
                out.backward(grad_out)
        return call

    compiled_attention = torch.compile(unfused_attention, dynamic=False)
    compiled_gat = torch.compile(unfused_gat, dynamic=False)
    paths = {
        "graph_attention": run(lambda s: edgedot.graph_attention(q, k, v, *fresh(s)[1:]), grad),
        "compile attention": run(lambda s: compiled_attention(q, k, v, *fresh(s)[1:], scale), grad),
        "gat_attention": run(lambda s: edgedot.gat_attention(v, a_src, a_dst, *fresh(s)[1:]), grad),
        "compile gat": run(lambda s: compiled_gat("gat", v, a_src, a_dst, *fresh(s)[1:]), grad),
        "gatv2_attention": run(lambda s: edgedot.gatv2_attention(k, q, att, *fresh(s)[1:]), grad),
        "compile gatv2": run(lambda s: compiled_gat("gatv2", k, q, att, *fresh(s)[1:]), grad),
    }
    try:
        import torch_geometric.nn as pyg
    except ImportError:
        return paths
    for name in ("TransformerConv", "GATConv", "GATv2Conv"):
        theirs = getattr(pyg, name)(IN_CHANNELS, DIM, heads=HEADS).to("cuda", dtype)
        ours = getattr(edgedot.nn, name)(IN_CHANNELS, DIM, heads=HEADS).to("cuda", dtype)
        ours.load_state_dict(theirs.state_dict())
        leaves += list(ours.parameters()) + list(theirs.parameters())
        for label, layer in (("edgedot", ours), ("pyg", theirs)):
            paths[f"{label} {name}"] = run(lambda s, layer=layer: layer(x, fresh(s)[0]), grad_layer)
    return paths


def median_us(call, backward, reps, warmup=20):
    for step in range(warmup):
        call(step, backward)
    torch.cuda.synchronize()
    times = []
    for step in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call(step, backward)
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in times)


def profile_calls(call, calls=20, shapes=False):
    """Per forward+backward call: kernels, their device µs, host µs to issue it, host waits; with
    ``shapes``, also the operators that launched the most device time, with their input shapes."""
    for step in range(5):
        call(step, True)
    torch.cuda.synchronize()
    host = []
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, record_shapes=shapes) as prof:
        for step in range(calls):
            begin = time.perf_counter()
            call(step, True)
            host.append(time.perf_counter() - begin)
        torch.cuda.synchronize()
    kernels = device_us = launches = waits = 0
    for event in prof.events():
        name = event.name
        if event.device_type == torch.autograd.DeviceType.CUDA:
            if not name.startswith("Memcpy") and not name.startswith("Memset"):
                kernels += 1
                device_us += event.device_time
        elif name.startswith(("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchCooperativeKernel")):
            launches += 1
        elif name.startswith(SYNC_CALLS) and name != "cudaMemcpyAsync":
            waits += 1
    per_kernel = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and not event.name.startswith(("Memcpy", "Memset")):
            entry = per_kernel.setdefault(event.name[:90], [0, 0.0])
            entry[0] += 1
            entry[1] += event.device_time
    top = sorted(per_kernel.items(), key=lambda item: -item[1][1])[:12]
    # Where the host's time goes: operators and runtime calls by their own (self) CPU time.
    host_ops = sorted(prof.key_averages(), key=lambda avg: -avg.self_cpu_time_total)[:12]
    launchers = []
    if shapes:  # an operator's self device time is that of the kernels it launched itself
        by_shape = prof.key_averages(group_by_input_shape=True)
        by_shape = sorted(by_shape, key=lambda avg: -avg.self_device_time_total)[:20]
        launchers = [(avg.key[:60], str(avg.input_shapes)[:140], avg.count / calls,
                      avg.self_device_time_total / calls) for avg in by_shape if avg.self_device_time_total > 0]
    return {"launchers": launchers,
            "kernels": kernels / calls, "launches": launches / calls, "device_us": device_us / calls,
            "host_us": 1e6 * statistics.median(host), "waits": waits / calls,
            "top_kernels": [(name, count / calls, total / calls) for name, (count, total) in top],
            "top_host_ops": [(avg.key[:90], avg.count / calls, avg.self_cpu_time_total / calls) for avg in host_ops]}


def host_profile(call, calls=100, top=25):
    """The host's time to issue a forward+backward call without the profiler (median µs, the
    device kept ahead by a sleep so that no call waits for it), and cProfile's costliest functions
    by their own time over ``calls`` calls (Python functions and the C++ entry points they call)."""
    import cProfile
    import io
    import pstats
    for step in range(5):
        call(step, True)
    torch.cuda.synchronize()
    host = []
    for step in range(calls):
        torch.cuda._sleep(20_000_000)  # about 10 ms: the device stays busy, no issue waits on it
        begin = time.perf_counter()
        call(step, True)
        host.append(time.perf_counter() - begin)
        torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for step in range(calls):
        call(step, True)
    torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return 1e6 * statistics.median(host), text.getvalue()


def sync_sites(call):
    """Where one forward+backward call synchronises: for each warning of the sync debug mode, the
    ``file:line`` that called the synchronising operation, and after ``<-`` the innermost caller
    outside torch's own package (where a torch function such as ``torch.cuda.synchronize`` made
    the call)."""
    import traceback
    torch.cuda.synchronize()
    sites = set()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        site = f"{filename.split('site-packages/')[-1]}:{lineno}"
        if "/torch/" in filename:
            outside = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename
                       and "warnings.py" not in f.filename]
            if outside:
                site += f" <- {outside[-1].filename.split('site-packages/')[-1]}:{outside[-1].lineno}"
        sites.add(site)

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call(1000, True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sorted(sites)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--fanout", type=int, default=10)
    parser.add_argument("--seeds", type=int, default=16_384)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--paths", default="", help="comma-separated substrings of the paths to run")
    parser.add_argument("--kernels", action="store_true", help="also each path's costliest kernels per call")
    parser.add_argument("--shapes", action="store_true",
                        help="also the operators that launched the most device time, with their input shapes")
    parser.add_argument("--host", action="store_true",
                        help="also each path's host time without the profiler and its cProfile top functions")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    paths = make_paths(args)
    wanted = [p for p in args.paths.split(",") if p]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}, seeds {args.seeds}, "
          f"fanout {args.fanout}, {HEADS} heads x {DIM}")
    print(f"{'path':24s} {'fwd us':>8s} {'f+b us':>8s} {'kernels':>8s} {'launches':>8s} {'dev us':>8s} "
          f"{'host us':>8s} {'waits':>6s}  sync sites")
    results = {}
    for name, call in paths.items():
        if wanted and not any(w in name for w in wanted):
            continue
        forward = median_us(call, False, args.reps)
        both = median_us(call, True, args.reps)
        prof = profile_calls(call, shapes=args.shapes)
        sites = sync_sites(call)
        results[name] = dict(forward_us=forward, forward_backward_us=both, sync_sites=sites, **prof)
        print(f"{name:24s} {forward:8.1f} {both:8.1f} {prof['kernels']:8.1f} {prof['launches']:8.1f} "
              f"{prof['device_us']:8.1f} {prof['host_us']:8.1f} {prof['waits']:6.1f}  {' '.join(sites)}",
              flush=True)
        if args.kernels:
            for kernel, count, device_us in prof["top_kernels"]:
                print(f"    {device_us:8.1f} us {count:4.1f}x  {kernel}")
            print("    host, by own CPU time (profiled, so inflated):")
            for op, count, host_us in prof["top_host_ops"]:
                print(f"    {host_us:8.1f} us {count:4.1f}x  {op}")
        if args.shapes:
            print("    operators by the device time of the kernels they launched:")
            for op, shapes, count, device_us in prof["launchers"]:
                print(f"    {device_us:8.1f} us {count:4.1f}x  {op}  {shapes}")
        if args.host:
            plain_us, table = host_profile(call)
            results[name]["host_us_plain"] = plain_us
            print(f"    host time to issue forward+backward, no profiler: {plain_us:.1f} us; cProfile, 100 calls:")
            print("\n".join("    " + line for line in table.splitlines() if line.strip()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
