"""Where autograd's device thread costs a mini-batch step, on a CUDA machine: ``graph_attention``'s
forward and backward on scripts/profile_minibatch.py's batch (new index tensors every call), with the
backward on autograd's device thread (how ``loss.backward()`` of a CUDA loss runs) and on the calling
thread (``torch.autograd.set_multithreading_enabled(False)``). For each: the host µs of the forward
and of the backward (medians, the device kept busy by a sleep queued ahead, as in
scripts/host_costs.py), and a loop's µs a step between two CUDA events (host and device together).

    python scripts/backward_thread.py [LABEL]

NOTES.md's run log ("C++ autograd nodes for the eager CUDA calls") has its figures; run it under
``taskset`` to see what pinning the threads to cores changes.
"""

import statistics
import sys
import time

import torch

import edgedot
from host_costs import DIM, HEADS  # this folder is on the path of a script run from it

SEEDS, FANOUT = 16_384, 10
ROUNDS, CALLS = 30, 8


def main():
    label = sys.argv[1] if len(sys.argv) > 1 else ""
    num_nodes = 11 * SEEDS
    gen = torch.Generator("cuda").manual_seed(0)
    dst = torch.arange(SEEDS, device="cuda").repeat_interleave(FANOUT)
    src = torch.randint(num_nodes, (dst.shape[0],), generator=gen, device="cuda")
    leaves = [torch.randn(num_nodes, HEADS, DIM, generator=gen, device="cuda").requires_grad_() for _ in range(3)]
    grad = torch.randn(num_nodes, HEADS, DIM, generator=gen, device="cuda")

    def forward():
        for t in leaves:
            t.grad = None
        return edgedot.graph_attention(*leaves, src.clone(), dst.clone())

    def host_split():
        """Median host µs of the forward and of the backward."""
        forwards, backwards = [], []
        for _ in range(ROUNDS):
            torch.cuda._sleep(10_000_000)  # a few ms: longer than CALLS steps take to issue
            for _ in range(CALLS):
                begin = time.perf_counter()
                out = forward()
                middle = time.perf_counter()
                out.backward(grad)
                forwards.append(middle - begin)
                backwards.append(time.perf_counter() - middle)
            torch.cuda.synchronize()
        return 1e6 * statistics.median(forwards), 1e6 * statistics.median(backwards)

    def loop_us(steps=40, rounds=5):
        """Median µs a step of back-to-back steps, between CUDA events."""
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        samples = []
        for _ in range(rounds):
            begin.record()
            for _ in range(steps):
                forward().backward(grad)
            end.record()
            torch.cuda.synchronize()
            samples.append(1e3 * begin.elapsed_time(end) / steps)
        return statistics.median(samples)

    for _ in range(10):
        forward().backward(grad)
    torch.cuda.synchronize()
    for on_device_thread in (True, False):
        with torch.autograd.set_multithreading_enabled(on_device_thread):
            host_forward, host_backward = host_split()
            print(f"{label:10s} backward on the {'device' if on_device_thread else 'calling'} thread: host µs "
                  f"forward {host_forward:7.1f}, backward {host_backward:7.1f}; loop {loop_us():7.1f} µs a step",
                  flush=True)


if __name__ == "__main__":
    main()
