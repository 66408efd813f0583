"""First-call latency of edgedot on a GPU, in this fresh process.

Prints the seconds from process start to ``import edgedot``, to an initialised CUDA context, and
to the first ``edge_dot`` result on the GPU (synchronised), and the time of that first call alone
(which loads the prebuilt extension, or builds it just in time). Checks the result against a
float64 reference and says which extension served it.

    python scripts/first_call.py [--expect-prebuilt] [--max-first-call SECONDS]

``--expect-prebuilt`` fails unless the extension was the prebuilt ``edgedot._C`` of an installed
CUDA wheel (not a just-in-time build, not a checkout on sys.path); ``--max-first-call`` fails when
the first call took longer. Linux only (reads the process start time from /proc).
"""

import argparse
import os
import sys
import time


def since_process_start():
    """Seconds since this process started (from /proc, in clock ticks: 10 ms resolution)."""
    with open("/proc/self/stat") as stat:
        start_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
    return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--expect-prebuilt", action="store_true", help="fail unless edgedot._C served the call")
    parser.add_argument("--max-first-call", type=float, default=None, help="fail above this many seconds")
    args = parser.parse_args()

    import torch

    import edgedot
    from edgedot.runtime import build
    at_import = since_process_start()

    if not torch.cuda.is_available():
        sys.exit("first_call.py: no CUDA device")
    g = torch.Generator(device="cuda").manual_seed(0)
    src = torch.randn(1024, 128, device="cuda", generator=g)
    dst = torch.randn(768, 128, device="cuda", generator=g)
    src_idx = torch.randint(0, 1024, (16384,), device="cuda", generator=g, dtype=torch.int32)
    dst_idx = torch.randint(0, 768, (16384,), device="cuda", generator=g, dtype=torch.int32)
    torch.cuda.synchronize()
    at_context = since_process_start()

    start = time.perf_counter()
    out = edgedot.edge_dot(src, dst, src_idx, dst_idx)
    torch.cuda.synchronize()
    first_call = time.perf_counter() - start
    at_result = since_process_start()

    expected = edgedot.edge_dot_reference(src.double(), dst.double(), src_idx, dst_idx)
    error = ((out.double() - expected).norm() / expected.norm()).item()
    module = build.cuda_module()
    print(f"edgedot {edgedot.__file__}")
    print(f"extension {module.__name__} ({getattr(module, '__file__', '?')})")
    print(f"process start -> import edgedot {at_import:.2f} s, -> CUDA context {at_context:.2f} s, "
          f"-> first edge_dot result {at_result:.2f} s; first call {first_call:.3f} s; "
          f"relative error {error:.1e}")
    failures = []
    if not error <= 1e-5:
        failures.append(f"relative error {error:.1e} against float64")
    if args.expect_prebuilt and module.__name__ != build.PREBUILT:
        failures.append(f"the extension is {module.__name__}, not the prebuilt {build.PREBUILT}")
    if args.max_first_call is not None and first_call > args.max_first_call:
        failures.append(f"the first call took {first_call:.2f} s, over {args.max_first_call} s")
    if failures:
        sys.exit("first_call.py: " + "; ".join(failures))


if __name__ == "__main__":
    main()
