"""edge_dot on the CPU against eager PyTorch (``(src[src_idx] * dst[dst_idx]).sum(-1)``), forward
and forward + backward, from a toy graph to a million edges: the evidence behind
docs/performance.md's CPU edge_dot table.

    python scripts/cpu_edge_dot.py [--threads 2] [--cases tiny,small,cora,seed,1m] [--dtypes float32,bfloat16]
                                   [--index-dtype int64]

Every case is checked first: both outputs and both gradients against float64 autograd of the
reference (relative error; edgedot's must be at most twice eager's, or 1e-6). Then edgedot and
eager calls alternate in rounds, and the medians of ``time.perf_counter`` per call are printed
with their ratio (below 1: edgedot faster). The gradient of ``out`` is a fixed random tensor.
"""

import argparse
import statistics
import time

import torch

import edgedot
from edgedot.reference import edge_dot_reference

# name: source nodes, destination nodes, edges, feature shape per node
CASES = {
    "tiny": (50, 50, 200, (16,)),
    "small": (200, 200, 1000, (16,)),
    "cora": (2708, 2708, 10556, (16,)),
    "seed": (1024, 768, 16384, (128,)),
    "heads": (20000, 20000, 100000, (4, 32)),
    "1m": (100000, 100000, 1000000, (64,)),
}
ROUNDS = {"tiny": 400, "small": 300, "cora": 100, "seed": 40, "heads": 10, "1m": 4}


def rel_error(got, want):
    return ((got.double() - want).norm() / want.norm().clamp_min(1e-30)).item()


def forward_backward(fn, src, dst, src_idx, dst_idx, grad_out):
    src.grad = dst.grad = None
    fn(src, dst, src_idx, dst_idx).backward(grad_out)


def check(src, dst, src_idx, dst_idx, grad_out):
    """Raises SystemExit unless edgedot is as accurate as eager PyTorch against float64."""
    exact = [t.detach().double().requires_grad_() for t in (src, dst)]
    want_out = edge_dot_reference(*exact, src_idx, dst_idx)
    want = (want_out.detach(), *torch.autograd.grad(want_out, exact, grad_out.double()))
    errors = {}
    for name, fn in (("eager", edge_dot_reference), ("edgedot", edgedot.edge_dot)):
        pair = [t.detach().clone().requires_grad_() for t in (src, dst)]
        out = fn(*pair, src_idx, dst_idx)
        got = (out.detach(), *torch.autograd.grad(out, pair, grad_out))
        errors[name] = [rel_error(g, w) for g, w in zip(got, want)]
    for what, ours, theirs in zip(("out", "grad src", "grad dst"), errors["edgedot"], errors["eager"]):
        if not ours <= max(2 * theirs, 1e-6):
            raise SystemExit(f"edgedot's {what} is off: relative error {ours:.2e}, eager's {theirs:.2e}")
    return max(errors["edgedot"])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cases", default="tiny,small,cora,seed,heads")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--index-dtype", default="int64", choices=("int64", "int32"),
                        help="the indices' dtype (eager PyTorch indexes with either)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.index_dtype} indices; µs per "
          "call, medians; ratio edgedot / eager")
    print(f"{'case':<6} {'dtype':<9} {'fwd eager':>10} {'edgedot':>9} {'ratio':>6} {'f+b eager':>10} "
          f"{'edgedot':>9} {'ratio':>6} {'max rel err':>11}")
    for case in args.cases.split(","):
        num_src, num_dst, num_edges, shape = CASES[case]
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            gen = torch.Generator().manual_seed(0)
            src = torch.randn(num_src, *shape, generator=gen).to(dtype).requires_grad_()
            dst = torch.randn(num_dst, *shape, generator=gen).to(dtype).requires_grad_()
            src_idx = torch.randint(num_src, (num_edges,), generator=gen).to(getattr(torch, args.index_dtype))
            dst_idx = torch.randint(num_dst, (num_edges,), generator=gen).to(getattr(torch, args.index_dtype))
            out_shape = (num_edges,) if len(shape) == 1 else (num_edges, shape[0])
            grad_out = torch.randn(out_shape, generator=gen).to(dtype)
            error = check(src, dst, src_idx, dst_idx, grad_out)
            paths = {"eager": edge_dot_reference, "edgedot": edgedot.edge_dot}
            times = {(name, part): [] for name in paths for part in ("fwd", "fb")}
            for _ in range(3):  # warm-up
                for fn in paths.values():
                    forward_backward(fn, src, dst, src_idx, dst_idx, grad_out)
            for _ in range(ROUNDS[case]):
                for name, fn in paths.items():
                    with torch.no_grad():
                        start = time.perf_counter()
                        fn(src, dst, src_idx, dst_idx)
                        times[name, "fwd"].append(time.perf_counter() - start)
                    start = time.perf_counter()
                    forward_backward(fn, src, dst, src_idx, dst_idx, grad_out)
                    times[name, "fb"].append(time.perf_counter() - start)
            med = {key: statistics.median(values) * 1e6 for key, values in times.items()}
            print(f"{case:<6} {dtype_name:<9} {med['eager', 'fwd']:>10.1f} {med['edgedot', 'fwd']:>9.1f} "
                  f"{med['edgedot', 'fwd'] / med['eager', 'fwd']:>6.2f} {med['eager', 'fb']:>10.1f} "
                  f"{med['edgedot', 'fb']:>9.1f} {med['edgedot', 'fb'] / med['eager', 'fb']:>6.2f} {error:>11.1e}",
                  flush=True)


if __name__ == "__main__":
    main()
