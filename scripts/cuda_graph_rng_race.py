"""Whether the first replay of a CUDA graph can read the default generator's device-side state as
capture began wrote it (its seed, offset 0) instead of the replay's (seed, offset): torch fills
those tensors on the capture stream just before capture begins, outside the graph, and again on
the replay stream before each replay, with no order between the two streams. Here the capture
stream's write is held back by a sleep and the graph's dropout by a sleep inside the graph; torch
only (``torch.nn.functional.dropout``), no edgedot. Prints, for a plain and a forced capture,
whether the replay's mask is the told offset's or offset 0's. On torch 2.11+cu130 (H100,
2026-12-07): plain told 40 -> 40's; forced -> 0's. Hence ``tests/utils.capture_graph`` waits
for the device after capturing.

    python scripts/cuda_graph_rng_race.py
"""
import torch
import torch.nn.functional as F

torch.cuda.manual_seed(5)
x = torch.ones(1 << 16, device="cuda")
torch.cuda.synchronize()
cycles = 200_000_000  # ~0.1 s at 2 GHz


def masks_at(offset):
    g = torch.cuda.default_generators[0]
    saved = g.get_state()
    torch.cuda.manual_seed(5)
    g.set_offset(offset)
    m = F.dropout(x, 0.5) != 0
    g.set_state(saved)
    return m


for force in (False, True):
    torch.cuda.manual_seed(5)
    for _ in range(10):
        F.dropout(x, 0.5)  # moves the offset on
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        if force:
            torch.cuda._sleep(cycles)        # the capture stream busy: its fill (seed, 0) waits
        graph.capture_begin()
        if force:
            torch.cuda._sleep(2 * cycles)    # the graph's first node: the kernel reads later
        static = F.dropout(x, 0.5)
        graph.capture_end()
    told = torch.cuda.default_generators[0].get_offset()
    graph.replay()
    torch.cuda.synchronize()
    got = static != 0
    print(f"forced={force}: offset told {told}; replay's mask = offset {told}'s: {torch.equal(got, masks_at(told))}; "
          f"= offset 0's: {torch.equal(got, masks_at(0))}", flush=True)
