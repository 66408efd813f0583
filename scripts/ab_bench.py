"""Times two checkouts of edgedot on the same GPU in one run: the attention ops' forward and
forward + backward on the same graphs, each checkout in its own processes (its own build cache),
alternating A B A B so that drift hits both. Checks each result against a float64 reference first.
A static graph (an EdgePlan) is timed with its steps queued behind a GPU sleep (the kernels
alone; a sample whose steps the GPU reached before the host had queued them all is counted as
queued late); a mini-batch, a new graph every step, by back-to-back calls (host work included).
Each sample is 10 steps between two CUDA events; a case's figure is the median of its samples.

    python scripts/ab_bench.py --a OLD_ROOT --b NEW_ROOT [--rounds 2] [--json FILE]

Prints, per case, the median of each checkout (the smaller of its rounds' medians) and B / A.
Each side builds into its own cache folder, $AB_CACHE_A and $AB_CACHE_B (default /tmp/ab_cache_a, _b).
"""

import argparse
import functools
import json
import os
import subprocess
import sys
import time

CASES = [
    # name, op, nodes, edges, heads, dim, dtype, hub edges, layout
    ("attn-arxiv-f32-plan", "graph_attention", 169_343, 1_166_243, 4, 32, "float32", 0, "plan"),
    ("attn-arxiv-bf16-plan", "graph_attention", 169_343, 1_166_243, 4, 32, "bfloat16", 0, "plan"),
    ("attn-hub-bf16-plan", "graph_attention", 169_343, 1_166_243 + 2_000_000, 4, 32, "bfloat16", 2_000_000, "plan"),
    ("attn-products-bf16-plan", "graph_attention", 2_449_029, 30_000_000, 4, 32, "bfloat16", 0, "plan"),
    ("attn-minibatch-f32-ptr", "graph_attention", 180_000, 163_840, 4, 32, "float32", 0, "minibatch"),
    ("gat-minibatch-f32-ptr", "gat_attention", 180_000, 163_840, 4, 32, "float32", 0, "minibatch"),
    ("gatv2-minibatch-f32-ptr", "gatv2_attention", 180_000, 163_840, 4, 32, "float32", 0, "minibatch"),
    # The same batches with default options (no dst_ptr): each call groups its edges itself.
    ("attn-minibatch-f32", "graph_attention", 180_000, 163_840, 4, 32, "float32", 0, "fresh"),
    ("gat-minibatch-f32", "gat_attention", 180_000, 163_840, 4, 32, "float32", 0, "fresh"),
    ("gatv2-minibatch-f32", "gatv2_attention", 180_000, 163_840, 4, 32, "float32", 0, "fresh"),
    ("gat-arxiv-bf16-plan", "gat_attention", 169_343, 1_166_243, 4, 32, "bfloat16", 0, "plan"),
    ("gat-products-bf16-plan", "gat_attention", 2_449_029, 30_000_000, 4, 32, "bfloat16", 0, "plan"),
    ("gatv2-arxiv-bf16-plan", "gatv2_attention", 169_343, 1_166_243, 4, 32, "bfloat16", 0, "plan"),
    ("gatv2-products-bf16-plan", "gatv2_attention", 2_449_029, 30_000_000, 4, 32, "bfloat16", 0, "plan"),
    ("gatv2-hub-f32-plan", "gatv2_attention", 169_343, 1_166_243 + 2_000_000, 4, 32, "float32", 2_000_000, "plan"),
]


@functools.cache
def cycles_per_second():
    """The GPU clock, as torch.cuda._sleep counts it (measured: clocks vary by card and load)."""
    import torch
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 50_000_000
    torch.cuda._sleep(cycles)  # warm
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize()
    return cycles / (start.elapsed_time(end) / 1e3)


def worker(names, reps):
    import torch

    import edgedot

    results = {}
    for name, op, nodes, edges, heads, dim, dtype, hub_edges, layout in CASES:
        if name not in names:
            continue
        torch.manual_seed(0)
        dt = getattr(torch, dtype)
        g = torch.Generator(device="cuda").manual_seed(0)
        src = torch.randint(0, nodes, (edges,), device="cuda", generator=g)
        dst = torch.randint(0, nodes, (edges,), device="cuda", generator=g)
        if hub_edges:
            dst[:hub_edges] = 7

        def leaf(*shape):
            return torch.randn(*shape, device="cuda", generator=g).to(dt).requires_grad_()
        if op == "graph_attention":
            inputs = [leaf(nodes, heads, dim), leaf(nodes, heads, dim), leaf(nodes, heads, dim)]
        elif op == "gat_attention":
            inputs = [leaf(nodes, heads, dim), leaf(nodes, heads), leaf(nodes, heads)]
        else:
            inputs = [leaf(nodes, heads, dim), leaf(nodes, heads, dim), leaf(heads, dim)]
        fn = getattr(edgedot, op)
        if layout == "plan":
            plan = edgedot.EdgePlan(src, dst, nodes, nodes)
            graphs = [(src, dst, dict(plan=plan))]
        else:  # a new sorted mini-batch graph every call: 16384 seeds x 10 in-edges (dst_ptr or not)
            graphs = []
            for i in range(2 * (10 * reps + 5)):  # no index tensor seen twice
                s = torch.randint(0, nodes, (edges,), device="cuda", generator=g)
                d = torch.arange(edges // 10, device="cuda").repeat_interleave(10)
                graphs.append((s, d, dict(dst_ptr=edgedot.index_to_ptr(d, nodes)) if layout == "minibatch" else {}))
        # Correctness first, on the first graph, against a float64 reference (graphs of up to 4M
        # edges: the reference holds E x H x D float64 values).
        s0, d0, kw0 = graphs[0]
        out = fn(*inputs, s0, d0, **kw0)
        err = None
        if edges <= 4_000_000:
            ref_fn = getattr(edgedot, op + "_reference")
            ref = ref_fn(*[t.detach().double() for t in inputs], s0, d0)[0]
            err = ((out.double() - ref).norm() / ref.norm()).item()
            assert err < (1e-5 if dt == torch.float32 else 2e-2), (name, err)
            del ref
        times = {}
        counter = iter(range(1, 10**9))
        for mode in ("forward", "forward+backward"):
            def step(i):
                s, d, kw = graphs[i % len(graphs)]
                out = fn(*inputs, s, d, **kw)
                if mode != "forward":
                    out.backward(grad)
                return out
            grad = torch.ones_like(out)
            for t in inputs:
                t.grad = None
            run_block = lambda: step(next(counter))  # noqa: E731
            run_block()
            torch.cuda.synchronize()
            # A static graph: its steps queued behind a GPU sleep long enough for the host to queue
            # them all, so that the time between the events is the kernels' alone (host work and
            # launch gaps excluded). CUDA-graph capture would do the same, but the tree before the
            # engine cannot be captured. A mini-batch runs back to back (host work included).
            sleep_cycles = 0
            if layout == "plan":
                begin = time.perf_counter()
                for _ in range(10):
                    run_block()
                sleep_cycles = int(max(4 * (time.perf_counter() - begin), 1e-3) * cycles_per_second())
                torch.cuda.synchronize()
            samples, gaps = [], 0
            for _ in range(reps):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                slept = torch.cuda.Event()
                if sleep_cycles:
                    torch.cuda._sleep(sleep_cycles)
                    slept.record()
                start.record()
                for _ in range(10):
                    run_block()
                end.record()
                gaps += bool(sleep_cycles) and slept.query()  # the GPU reached the steps before all were queued
                torch.cuda.synchronize()
                samples.append(start.elapsed_time(end) * 100)  # microseconds per step
            times[mode + " samples queued late"] = gaps
            samples.sort()
            times[mode] = samples[len(samples) // 2]
            for t in inputs:
                t.grad = None
        results[name] = dict(times, error=err)
        del inputs, graphs, out
        torch.cuda.empty_cache()
    print("AB_RESULT " + json.dumps(results))


def run_worker(side, root, names, reps):
    cache = os.environ.get(f"AB_CACHE_{side.upper()}", f"/tmp/ab_cache_{side}")
    env = dict(os.environ, PYTHONPATH=root, EDGEDOT_CACHE=cache)
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", "--reps", str(reps), *names],
                          cwd=root, env=env, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("AB_RESULT "):
            return json.loads(line[len("AB_RESULT "):])
    raise RuntimeError(f"worker in {root} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a")
    parser.add_argument("--b")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--json")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("cases", nargs="*")
    args = parser.parse_args()
    names = args.cases or [c[0] for c in CASES]
    if args.worker:
        worker(names, args.reps)
        return
    runs = {"a": [], "b": []}
    for _ in range(args.rounds):
        for side, root in (("a", args.a), ("b", args.b)):
            runs[side].append(run_worker(side, os.path.abspath(root), names, args.reps))
            print(f"{side} round {len(runs[side])}: {json.dumps(runs[side][-1])}", flush=True)  # kept if cut short
    table = {}
    print(f"{'case':28s} {'mode':18s} {'A us':>10s} {'B us':>10s} {'B/A':>6s}")
    for name in names:
        for mode in ("forward", "forward+backward"):
            a = min(r[name][mode] for r in runs["a"])
            b = min(r[name][mode] for r in runs["b"])
            spread = max(max(r[name][mode] for r in runs[s]) / min(r[name][mode] for r in runs[s]) for s in "ab")
            late = {side: sum(r[name][mode + " samples queued late"] for r in runs[side]) for side in "ab"}
            table[f"{name} {mode}"] = dict(a=a, b=b, ratio=b / a, spread=spread, queued_late=late)
            flag = f"  samples queued late: A {late['a']}, B {late['b']}" if late["a"] or late["b"] else ""
            print(f"{name:28s} {mode:18s} {a:10.1f} {b:10.1f} {b / a:6.3f}  (rounds spread {spread:.3f}){flag}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(runs=runs, table=table), f, indent=1)


if __name__ == "__main__":
    main()
