"""The host's cost of running a backward on autograd's device thread instead of the calling thread,
on a CUDA machine: a forward + backward of ``x * 2`` on 4096 floats whose backward is C++ nodes, a
Python ``autograd.Function``, or a ``torch.compile``d function, each timed by
``host_costs.host_us`` (the device busy with a sleep queued ahead, so only the host's own work
counts) with ``torch.autograd.set_multithreading_enabled`` on and off. Medians, µs; the difference
is the hand-over (NOTES.md's run log; scripts/host_costs.py times graph attention the same way).

    python scripts/backward_handoff.py
"""

import torch

from host_costs import host_us  # this folder is on the path of a script run from it


class Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


def main():
    x = torch.randn(4096, device="cuda", requires_grad=True)
    grad = torch.ones(4096, device="cuda")
    compiled = torch.compile(lambda t: t * 2)
    pieces = {"C++ nodes": lambda: (x * 2).backward(grad),
              "Python autograd.Function": lambda: Twice.apply(x).backward(grad),
              "torch.compile": lambda: compiled(x).backward(grad)}
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; host µs of a forward + backward")
    for name, piece in pieces.items():
        on_device_thread = host_us(piece)
        with torch.autograd.set_multithreading_enabled(False):
            on_calling_thread = host_us(piece)
        print(f"{name:26s} device thread {on_device_thread:8.1f}  calling thread {on_calling_thread:8.1f}  "
              f"difference {on_device_thread - on_calling_thread:8.1f}")


if __name__ == "__main__":
    main()
