"""Fuzzes the attention ops with hostile pointers and indices, unchecked: huge, negative,
overlapping, decreasing and non-partition ``dst_ptr``; out-of-range and negative indices; hubs long
enough to be chunked; on CUDA also buffers rewritten between CUDA-graph replays.

Every call must return (NaN-marked rows are fine) or raise a clear ``ValueError``/``IndexError``;
nothing may read out of range. Under ``compute-sanitizer --tool memcheck`` on a GPU this is the
memory-safety proof; on the CPU (tests/test_fuzz_pointers.py) it checks that the same inputs give
clear errors or results. After the fuzz, a valid call must still match its float64 reference (the
process's CUDA context survived).

    python scripts/fuzz_pointers.py [--device cuda] [--rounds 40] [--seed 0]
"""

import argparse

import torch

import edgedot

OPS = ("graph_attention", "gat_attention", "gatv2_attention", "agnn_attention")


def hostile_ptr(gen, num_rows, num_edges, device):
    """A dst_ptr of one of several broken kinds (or a valid one), int64 [num_rows + 1]."""
    kind = int(torch.randint(0, 7, (1,), generator=gen))
    ptr = torch.sort(torch.randint(0, num_edges + 1, (num_rows + 1,), generator=gen)).values
    ptr[0], ptr[-1] = 0, num_edges
    if kind == 1:  # huge values inside
        ptr[1 + int(torch.randint(0, num_rows, (1,), generator=gen)):] = 10**12
        ptr[-1] = num_edges
    elif kind == 2:  # negative values
        ptr[torch.randint(0, num_rows + 1, (3,), generator=gen)] = -(10**9)
    elif kind == 3:  # overlapping ranges: every row claims (nearly) all edges
        ptr = torch.zeros(num_rows + 1, dtype=torch.int64)
        ptr[1::2] = num_edges
        ptr[-1] = num_edges
    elif kind == 4:  # decreasing
        ptr = torch.flip(ptr, [0])
    elif kind == 5:  # not a partition: wrong ends
        ptr = ptr + int(torch.randint(-5, 6, (1,), generator=gen))
    elif kind == 6:  # garbage
        ptr = torch.randint(-(2**40), 2**40, (num_rows + 1,), generator=gen)
    return ptr.to(device)


def hostile_index(gen, num_rows, num_edges, device, dtype):
    """Indices with a hub (a row of most edges, chunked), some out of range or negative."""
    idx = torch.randint(0, num_rows, (num_edges,), generator=gen)
    idx[: num_edges // 2] = int(torch.randint(0, num_rows, (1,), generator=gen))
    bad = torch.randint(0, num_edges, (max(1, num_edges // 50),), generator=gen)
    idx[bad] = torch.tensor([-1, num_rows, 2**31 - 1, -(2**31)])[torch.randint(0, 4, bad.shape, generator=gen)]
    if dtype == torch.int64:
        idx[bad[:1]] = 2**40
    return idx.to(device=device, dtype=dtype)


def call(op, inputs, src, dst, ptr, device):
    """op's forward (and backward) on hostile graph tensors, unchecked; a clear error is fine."""
    kw = dict(check_indices=False)
    if ptr is not None:
        kw["dst_ptr"] = ptr
    try:
        out = getattr(edgedot, op)(*inputs, src, dst, **kw)
        out.float().nan_to_num().sum().backward()
    except (ValueError, IndexError) as error:
        return str(error)
    return None


def make_inputs(op, gen, num_src, num_dst, heads, dim, dtype, device):
    def leaf(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype).requires_grad_()
    if op == "graph_attention":
        return leaf(num_dst, heads, dim), leaf(num_src, heads, dim), leaf(num_src, heads, dim)
    if op == "gat_attention":
        return leaf(num_src, heads, dim), leaf(num_src, heads), leaf(num_dst, heads)
    if op == "agnn_attention":  # one node set: sources and destinations alike
        return leaf(num_dst, heads, dim), leaf(heads)
    return leaf(num_src, heads, dim), leaf(num_dst, heads, dim), leaf(heads, dim)


def fuzz(device, rounds, seed):
    gen = torch.Generator().manual_seed(seed)
    errors = 0
    for r in range(rounds):
        op = OPS[r % len(OPS)]
        dtype = (torch.float32, torch.bfloat16, torch.float64, torch.float16)[r % 4]
        index_dtype = (torch.int32, torch.int64)[r % 2]
        num_src, num_dst = 37 + r, 23 + r % 5
        num_edges = int(torch.randint(1, 3000, (1,), generator=gen))
        inputs = make_inputs(op, gen, num_src, num_dst, 2, (1, 8, 33)[r % 3], dtype, device)
        if op == "agnn_attention":
            num_src = num_dst
        src = hostile_index(gen, num_src, num_edges, device, index_dtype)
        dst = hostile_index(gen, num_dst, num_edges, device, index_dtype)
        if call(op, inputs, src, dst, None, device) is not None:
            errors += 1
        # Given grouped: the pointer is hostile, the indices sorted and hostile too.
        dst_sorted = torch.sort(dst).values
        if call(op, inputs, src, dst_sorted, hostile_ptr(gen, num_dst, num_edges, device), device) is not None:
            errors += 1
    if device == "cuda":
        errors += fuzz_graph_replays(gen)
    return errors


def fuzz_graph_replays(gen):
    """A forward and backward captured in a CUDA graph, replayed after its graph buffers are
    rewritten with hostile values (the check cannot run inside a capture)."""
    num_src, num_dst, num_edges, heads, dim = 300, 200, 4000, 2, 32
    q = torch.randn(num_dst, heads, dim, device="cuda", requires_grad=True)
    k = torch.randn(num_src, heads, dim, device="cuda", requires_grad=True)
    v = torch.randn(num_src, heads, dim, device="cuda", requires_grad=True)
    src = torch.randint(0, num_src, (num_edges,), device="cuda")
    dst = torch.sort(torch.randint(0, num_dst, (num_edges,), device="cuda")).values
    ptr = edgedot.index_to_ptr(dst, num_dst)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up outside the capture
            edgedot.graph_attention(q, k, v, src, dst, dst_ptr=ptr, check_indices=False).sum().backward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = edgedot.graph_attention(q, k, v, src, dst, dst_ptr=ptr, check_indices=False)
        out.sum().backward()
    for _ in range(12):
        src.copy_(hostile_index(gen, num_src, num_edges, "cuda", src.dtype))
        dst.copy_(hostile_index(gen, num_dst, num_edges, "cuda", dst.dtype))
        ptr.copy_(hostile_ptr(gen, num_dst, num_edges, "cuda"))
        graph.replay()
    torch.cuda.synchronize()
    return 0


def check_still_right(device):
    """A valid call after the fuzz matches its float64 reference."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(n, 2, 16, generator=gen, dtype=torch.float64) for n in (50, 60, 60))
    src = torch.randint(0, 60, (500,), generator=gen)
    dst = torch.randint(0, 50, (500,), generator=gen)
    out = edgedot.graph_attention(q.to(device), k.to(device), v.to(device), src.to(device), dst.to(device))
    ref, _ = edgedot.graph_attention_reference(q, k, v, src, dst)
    error = (out.cpu() - ref).norm() / ref.norm()
    assert error < 1e-12, f"a valid call after the fuzz is off: relative error {error:.3g}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    errors = fuzz(args.device, args.rounds, args.seed)
    if args.device == "cuda":
        torch.cuda.synchronize()
    check_still_right(args.device)
    print(f"fuzz_pointers: {args.rounds} rounds on {args.device}, {errors} calls raised a clear error, "
          "the rest returned; a valid call afterwards is right")


if __name__ == "__main__":
    main()
