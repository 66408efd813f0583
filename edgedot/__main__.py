"""``python -m edgedot``: the seed's default problem, checked, then timed against the reference.

Runs on the first CUDA device if there is one, else on the CPU (and says so). Prints the
relative error of edgedot against a float64 reference, then median time and peak extra memory
of the reference and of edgedot, forward and forward+backward.
"""

import argparse
import statistics
import time

import torch

from . import kernelbench
from .ops.edge_dot import edge_dot
from .reference import edge_dot_reference


def _rel_error(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_us(fn, device, reps):
    """Median wall time of ``fn`` in µs; CUDA calls are timed with events."""
    for _ in range(max(3, reps // 10)):
        fn()
    _sync(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) * 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


def _peak_extra_mb(fn, device):
    """Peak memory allocated during ``fn`` beyond what was allocated before (CUDA only: None)."""
    if device.type != "cuda":
        return None
    _sync(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    _sync(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def positive_int(text):
    """argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main(argv=None):
    """Command line: ``python -m edgedot [--reps N]``."""
    parser = argparse.ArgumentParser(prog="python -m edgedot", description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=positive_int, default=200, help="timed calls per measurement (at least 1)")
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        print("No CUDA device found: running the CPU implementation.")
    else:
        print(f"Device: {torch.cuda.get_device_name(device)}")
    torch.manual_seed(0)
    src_feat, dst_feat, src_idx, dst_idx = (t.to(device) for t in kernelbench.get_inputs())
    print(f"Problem: {src_feat.shape[0]} src x {dst_feat.shape[0]} dst nodes, {src_idx.shape[0]} edges, "
          f"D={src_feat.shape[1]}, {src_feat.dtype}, {src_idx.dtype} indices")

    expected = edge_dot_reference(src_feat.double(), dst_feat.double(), src_idx, dst_idx)
    err_ref = _rel_error(edge_dot_reference(src_feat, dst_feat, src_idx, dst_idx), expected)
    err_ours = _rel_error(edge_dot(src_feat, dst_feat, src_idx, dst_idx), expected)
    print(f"Relative error vs float64: reference {err_ref:.2e}, edgedot {err_ours:.2e}")
    if not err_ours <= max(2 * err_ref, 1e-6):
        raise SystemExit("edgedot disagrees with the reference")

    src_g = src_feat.clone().requires_grad_()
    dst_g = dst_feat.clone().requires_grad_()
    grad = torch.randn(src_idx.shape[0], device=device)

    def forward_backward(fn):
        def run():
            src_g.grad = dst_g.grad = None
            fn(src_g, dst_g, src_idx, dst_idx).backward(grad)
        return run

    paths = {"reference": edge_dot_reference, "edgedot": edge_dot}
    rows = []
    for name, fn in paths.items():
        fwd = lambda fn=fn: fn(src_feat, dst_feat, src_idx, dst_idx)  # noqa: E731
        fb = forward_backward(fn)
        rows.append((name, _median_us(fwd, device, args.reps), _peak_extra_mb(fwd, device),
                     _median_us(fb, device, args.reps), _peak_extra_mb(fb, device)))

    print()
    def mb(value):
        return "n/a" if value is None else f"{value:.2f}"

    print(f"{'path':<10} {'fwd µs':>10} {'fwd MB':>8} {'fwd+bwd µs':>11} {'fwd+bwd MB':>11}")
    for name, t_f, m_f, t_fb, m_fb in rows:
        print(f"{name:<10} {t_f:>10.1f} {mb(m_f):>8} {t_fb:>11.1f} {mb(m_fb):>11}")
    ref, ours = rows
    print(f"\nedgedot speed-up: forward {ref[1] / ours[1]:.1f}x, forward+backward {ref[3] / ours[3]:.1f}x")


if __name__ == "__main__":
    main()
