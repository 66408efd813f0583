"""What the index check of a new batch costs a loop of steps, on a CUDA machine: graph attention on
scripts/profile_minibatch.py's batch with its CSR pointer (``dst_ptr``, so no sort), new index
tensors every step, timed as the benchmark times it (back-to-back steps between two CUDA events,
medians) with the check, without it (``check_indices=False``), with it on indices it remembers, and
with it while Python's garbage collector is off; then torch.profiler's CPU spans of the checked
loop, the costliest first (the spans of scripts/host_costs.py's ``--threads``, without a device
kept busy).

    python scripts/check_cost.py [--backward]
"""

import argparse
import gc
import statistics

import torch

import edgedot
from host_costs import DIM, HEADS  # this folder is on the path of a script run from it

SEEDS, FANOUT = 16_384, 10


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backward", action="store_true", help="time forward + backward steps")
    args = parser.parse_args()
    num_nodes = 11 * SEEDS
    gen = torch.Generator("cuda").manual_seed(0)
    dst = torch.arange(SEEDS, device="cuda").repeat_interleave(FANOUT)
    src = torch.randint(num_nodes, (dst.shape[0],), generator=gen, device="cuda")
    ptr = edgedot.index_to_ptr(dst, num_nodes)
    leaves = [torch.randn(num_nodes, HEADS, DIM, generator=gen, device="cuda").requires_grad_() for _ in range(3)]
    grad = torch.randn(num_nodes, HEADS, DIM, generator=gen, device="cuda")

    def step(fresh=True, **options):
        def run():
            for t in leaves:
                t.grad = None
            s, d, p = (src.clone(), dst.clone(), ptr.clone()) if fresh else (src, dst, ptr)
            out = edgedot.graph_attention(*leaves, s, d, dst_ptr=p, **options)
            if args.backward:
                out.backward(grad)
        return run

    def loop_us(run, steps=40, rounds=7):
        for _ in range(5):
            run()
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        samples = []
        for _ in range(rounds):
            begin.record()
            for _ in range(steps):
                run()
            end.record()
            torch.cuda.synchronize()
            samples.append(1e3 * begin.elapsed_time(end) / steps)
        return statistics.median(samples)

    variants = {"checked, new indices": step(),
                "unchecked, new indices": step(check_indices=False),
                "checked, the same indices (remembered)": step(fresh=False)}
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; µs a step "
          f"({'forward + backward' if args.backward else 'forward'}), back-to-back")
    for name, run in variants.items():
        print(f"{loop_us(run):9.1f}  {name}", flush=True)
    gc.disable()
    try:
        print(f"{loop_us(step()):9.1f}  checked, new indices, garbage collector off", flush=True)
    finally:
        gc.enable()

    from torch.profiler import ProfilerActivity, profile
    run = step()
    for _ in range(5):
        run()
    torch.cuda.synchronize()
    steps = 100
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
    spans = {}
    for event in prof.events():
        spans.setdefault(event.name, []).append(event.time_range.elapsed_us())
    rows = sorted(spans.items(), key=lambda item: -sum(item[1]))[:25]
    print(f"\n{'µs a step':>10} {'a step':>7}  span (checked, new indices)")
    for name, lengths in rows:
        print(f"{sum(lengths) / steps:10.1f} {len(lengths) / steps:7.2f}  {name[:90]}")


if __name__ == "__main__":
    main()
