"""Accuracy fuzz of the ops against their float64 references (edgedot.reference): random sizes,
heads, index dtypes, hubs and empty rows, strided inputs and every option that keeps the math
the same (plans, destination pointers, determinism, returned attention, edge terms, scales and
slopes), and dropout against the reference given the call's mask (``dropout_keep``).

    python scripts/op_fuzz.py [--start 0] [--count 2000] [--device cpu] [--dtype float64]

Each seed draws an op (edge_dot, graph_attention, gat_attention, gatv2_attention,
agnn_attention), a graph of 0 to 80 edges over 1 to 24 nodes a side (uniform, or most edges
into one hub; sorted by destination or not; int32 or int64), features (possibly transposed or
sliced views, possibly broadcasting one head for edge_dot) and options. Outputs, attention
weights and the gradients of every floating input must match the reference computed in float64
from the same values: relative error (against a norm of at least 1) at most 1e-10 (float64), or
for lower precisions four times the error of the reference computed in that dtype, and at least
3e-5 for float32 and 32 epsilons for half types, times 1 / (1 - dropout_p), the scale dropout
puts on the kept weights. For half types that is a detector of gross errors: on graphs of a few
edges a node edgedot's bfloat16 gradients hold about half the error of PyTorch's bfloat16
autograd of the reference, on one or two edges up to four times it. The backward recomputes
from the log-sum-exp and takes <grad_out, out> from the output as returned, rounded to its
dtype: a gradient that is zero in exact arithmetic (a query's on a destination of one edge) then
keeps an error of the order of epsilon x |grad_out| |value| |key|, counted apart as "cancelling
gradient (known)". Prints every other disagreement or unexpected error and a count by kind.
"""

import argparse
import random
import traceback

import torch

import edgedot
from edgedot import reference
from edgedot.ops.attention import dropout_keep, next_dropout_state

OPS = ("edge_dot", "graph_attention", "gat_attention", "gatv2_attention", "agnn_attention")


def rel(got, want):
    """Relative error against a norm of at least 1: the inputs and output gradients are of order 1,
    so a gradient that cancels to (near) zero is held to its terms' scale, not to its own."""
    return ((got.double().to(want.device) - want).norm() / want.norm().clamp_min(1.0)).item() if want.numel() else 0.0


def feature(shape, g, device, dtype, rng):
    """A random float64 tensor of ``shape`` as ``dtype``, sometimes a non-contiguous view."""
    if rng.random() < 0.25 and len(shape) >= 2:
        wide = torch.randn(*shape[:-1], shape[-1] * 2, dtype=torch.float64, generator=g)
        t = wide[..., ::2]
    elif rng.random() < 0.2 and len(shape) == 2:
        t = torch.randn(shape[1], shape[0], dtype=torch.float64, generator=g).t()
    else:
        t = torch.randn(*shape, dtype=torch.float64, generator=g)
    return t.to(device=device, dtype=dtype).requires_grad_()


def graph(rng, g, num_src, num_dst, device):
    num_edges = rng.choice([0, 1, rng.randint(1, 80)])
    src = torch.randint(0, num_src, (num_edges,), generator=g)
    if rng.random() < 0.3 and num_edges:  # a hub: most edges into one destination
        dst = torch.where(torch.rand(num_edges, generator=g) < 0.8, rng.randrange(num_dst),
                          torch.randint(0, num_dst, (num_edges,), generator=g))
    else:
        dst = torch.randint(0, num_dst, (num_edges,), generator=g)
    sort = rng.random() < 0.4
    if sort and num_edges:
        dst, order = torch.sort(dst, stable=True)
        src = src[order]
    index_dtype = rng.choice([torch.int64, torch.int32])
    return src.to(device, index_dtype), dst.to(device, index_dtype), sort


def run(seed, device, dtype):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    op = rng.choice(OPS)
    heads, dim = rng.randint(1, 3), rng.randint(1, 9)
    num_src = rng.randint(1, 24)
    num_dst = num_src if op == "agnn_attention" else rng.randint(1, 24)
    src, dst, sort = graph(rng, g, num_src, num_dst, device)
    num_edges = src.shape[0]
    kwargs = {}
    if op != "edge_dot" and sort and rng.random() < 0.5:
        kwargs["dst_ptr"] = edgedot.index_to_ptr(dst, num_dst)
    elif rng.random() < 0.3:
        kwargs["plan"] = edgedot.EdgePlan(src, dst, num_src, num_dst)
    if op in ("edge_dot", "graph_attention") and rng.random() < 0.3:
        kwargs["deterministic"] = True
    drop, ref_drop = {}, {}
    if op in ("graph_attention", "gat_attention", "gatv2_attention") and rng.random() < 0.3:
        # The mask the call will draw, read first from a generator of the call's own.
        p = rng.choice([0.1, 0.5, 0.9])
        generator = torch.Generator(device).manual_seed(seed)
        keep = dropout_keep(next_dropout_state(device, generator), num_edges, heads, p, device)
        drop, ref_drop = dict(dropout_p=p, generator=generator), dict(keep=keep, dropout_p=p)
    if op != "edge_dot" and rng.random() < 0.4:
        kwargs["return_attention"] = True
    if op == "edge_dot":
        src_heads = 1 if rng.random() < 0.3 else heads
        dst_heads = heads if src_heads != heads or rng.random() < 0.7 else 1
        shape = lambda n, h: (n, dim) if h == 1 and rng.random() < 0.5 else (n, h, dim)
        inputs = [feature(shape(num_src, src_heads), g, device, dtype, rng),
                  feature(shape(num_dst, dst_heads), g, device, dtype, rng)]
        call = lambda t: edgedot.edge_dot(t[0], t[1], src, dst, **kwargs)
        check = lambda t: reference.edge_dot_reference(t[0], t[1], src, dst)
    elif op == "graph_attention":
        inputs = [feature((num_dst, heads, dim), g, device, dtype, rng),
                  feature((num_src, heads, dim), g, device, dtype, rng),
                  feature((num_src, heads, dim), g, device, dtype, rng)]
        if rng.random() < 0.3:
            inputs.append(feature((num_edges, heads, dim), g, device, dtype, rng))
        scale = rng.choice([None, 0.3, 2.0])
        edge = lambda t: t[3] if len(t) > 3 else None
        call = lambda t: edgedot.graph_attention(t[0], t[1], t[2], src, dst, scale=scale, edge_feat=edge(t),
                                                 **kwargs, **drop)
        check = lambda t: reference.graph_attention_reference(t[0], t[1], t[2], src, dst, scale=scale,
                                                              edge_feat=edge(t), **ref_drop)
    elif op == "gat_attention":
        inputs = [feature((num_src, heads, dim), g, device, dtype, rng),
                  feature((num_src, heads), g, device, dtype, rng),
                  feature((num_dst, heads), g, device, dtype, rng)]
        if rng.random() < 0.3:
            inputs.append(feature((num_edges, heads), g, device, dtype, rng))
        slope = rng.choice([0.2, 0.0, 1.0, 3.0])
        edge = lambda t: t[3] if len(t) > 3 else None
        call = lambda t: edgedot.gat_attention(t[0], t[1], t[2], src, dst, a_edge=edge(t), negative_slope=slope,
                                               **kwargs, **drop)
        check = lambda t: reference.gat_attention_reference(t[0], t[1], t[2], src, dst, a_edge=edge(t),
                                                            negative_slope=slope, **ref_drop)
    elif op == "gatv2_attention":
        inputs = [feature((num_src, heads, dim), g, device, dtype, rng),
                  feature((num_dst, heads, dim), g, device, dtype, rng), feature((heads, dim), g, device, dtype, rng)]
        if rng.random() < 0.3:
            inputs.append(feature((num_edges, heads, dim), g, device, dtype, rng))
        slope = rng.choice([0.2, 0.0, 1.0, 3.0])
        edge = lambda t: t[3] if len(t) > 3 else None
        call = lambda t: edgedot.gatv2_attention(t[0], t[1], t[2], src, dst, edge_feat=edge(t), negative_slope=slope,
                                                 **kwargs, **drop)
        check = lambda t: reference.gatv2_attention_reference(t[0], t[1], t[2], src, dst, edge_feat=edge(t),
                                                              negative_slope=slope, **ref_drop)
    else:
        flat = rng.random() < 0.4
        inputs = [feature((num_src, dim) if flat else (num_src, heads, dim), g, device, dtype, rng),
                  feature((1,) if flat else (heads,), g, device, dtype, rng)]
        call = lambda t: edgedot.agnn_attention(t[0], t[1], src, dst, **kwargs)
        check = lambda t: reference.agnn_attention_reference(t[0], t[1], src, dst)
    desc = (f"seed {seed}: {op} heads {heads} dim {dim}, {num_src} -> {num_dst} nodes, {num_edges} edges "
            f"({src.dtype}, {'sorted' if sort else 'unsorted'}), options {sorted(kwargs)}, dropout "
            f"{drop.get('dropout_p', 0)}, "
            f"inputs {[tuple(t.shape) for t in inputs]} contiguous {[t.is_contiguous() for t in inputs]}")
    exact = [t.detach().double().requires_grad_() for t in inputs]
    grad_out = None
    results = {}
    # The call, the float64 reference and (for float32) the reference in the inputs' dtype, whose
    # error is the yardstick: a gradient that cancels to zero in exact arithmetic is all rounding.
    for name, fn, args in (("got", call, inputs), ("want", check, exact), ("peer", check, inputs)):
        if name == "peer" and dtype == torch.float64:
            continue
        args = [t.detach().clone().requires_grad_() for t in args] if name == "peer" else args
        result = fn(args)
        out, alpha = result if isinstance(result, tuple) else (result, None)
        if grad_out is None:
            grad_out = torch.randn(out.shape, dtype=torch.float64, generator=g)
        grads = torch.autograd.grad(out, args, grad_out.to(out.device, out.dtype), allow_unused=True)
        grads = [torch.zeros_like(t) if d is None else d for t, d in zip(args, grads)]
        results[name] = [out, alpha] + grads
    want = results["want"]
    names = ["out", "alpha"] + [f"grad of input {i}" for i in range(len(inputs))]
    for i, name in enumerate(names):
        got = results["got"][i]
        if got is None or want[i] is None:
            if name == "alpha" or (got is None) == (want[i] is None):
                continue
        if got.shape != want[i].shape:
            return "SHAPE", f"{desc}: {name} {tuple(got.shape)} {tuple(want[i].shape)}"
        error = rel(got, want[i])
        floor = (3e-5 if dtype == torch.float32 else 32 * torch.finfo(dtype).eps) / (1 - drop.get("dropout_p", 0))
        bound = 1e-10 if dtype == torch.float64 else max(4 * rel(results["peer"][i], want[i]), floor)
        if error > bound:
            if name.startswith("grad") and want[i].norm() < 1e-9:
                return "cancelling gradient (known)", ""
            return name.split()[0].upper(), f"{desc}: {name} relative error {error:.2e}, bound {bound:.2e}"
    return "ok", ""


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float64", choices=("float64", "float32", "bfloat16", "float16"))
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    counts = {}
    for seed in range(args.start, args.start + args.count):
        try:
            kind, detail = run(seed, args.device, dtype)
        except Exception:
            kind, detail = "ERROR", f"seed {seed}\n{traceback.format_exc()}"
        counts[kind] = counts.get(kind, 0) + 1
        if kind != "ok":
            print(kind, detail, flush=True)
    print(counts)


if __name__ == "__main__":
    main()
