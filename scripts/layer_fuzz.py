"""Differential fuzz of the PyG drop-ins: edgedot.nn's TransformerConv, GATConv, GATv2Conv and
AGNNConv against PyG's layers with the same weights, on random options, graphs and calls (float64, on the
CPU or, with ``--device cuda``, both layers on the GPU).

    python scripts/layer_fuzz.py [--start 0] [--count 3000] [--device cpu]

Each seed draws a layer (heads, concat, bias, edge_dim, beta, root_weight, self-loops, slope,
residual, fill_value, share_weights; square or bipartite inputs), a graph (0 to 40 edges with
duplicates and self-loops, sorted or not, int64 or int32), its form (``[2, E]``, ``EdgeIndex``,
transposed ``torch.sparse`` COO or CSR), ``size`` and ``return_attention_weights``. Both layers
run forward and backward (gradients of the weights and inputs); outputs, attention weights and
gradients must agree to 1e-10 relative, or both must raise. Prints every disagreement and a
count by kind.

Known: PyG is given the int64 graph (its TransformerConv's gradients on an int32 one are wrong,
docs/api.md). On a bipartite graph with more destinations than sources, self-loops and an
``edge_attr`` reduction as ``fill_value``, PyG's ``add_self_loops`` reduces over destinations
with a result sized by the smaller side and reads past it where edgedot leaves out the edges into
nodes past the loops: counted as ``PyG reads out of range (known)``. On the CPU PyG must then
raise; on a GPU it is not run, as its device-side assert would end the process.
"""

import argparse
import random
import traceback
import warnings

import torch
import torch_geometric.nn as pyg
from torch_geometric import EdgeIndex

import edgedot.nn

LAYERS = ("TransformerConv", "GATConv", "GATv2Conv", "AGNNConv")


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item() if b.numel() else 0.0


def dense_index(t):
    return (t.to_dense() if t.layout != torch.strided else t).long()


def draw_layer(rng):
    kind = rng.choice(LAYERS)
    if kind == "AGNNConv":  # (x) -> x: square graphs, no edge features
        return kind, rng.randint(1, 6), None, dict(requires_grad=rng.random() < 0.7,
                                                   add_self_loops=rng.random() < 0.6), False
    bipartite = rng.random() < 0.3
    fin = (rng.randint(1, 6), rng.randint(1, 6)) if bipartite else rng.randint(1, 6)
    kw = dict(heads=rng.randint(1, 3), concat=rng.random() < 0.6, bias=rng.random() < 0.7)
    if rng.random() < 0.4:
        kw["edge_dim"] = rng.randint(1, 3)
    if kind == "TransformerConv":
        kw.update(beta=rng.random() < 0.3, root_weight=rng.random() < 0.7)
    else:
        kw.update(add_self_loops=rng.random() < 0.6, negative_slope=rng.choice([0.2, 0.0, 1.5]),
                  residual=rng.random() < 0.3)
        if "edge_dim" in kw:
            kw["fill_value"] = rng.choice(["mean", "add", 0.5, "max", "min", "mul"])
        if kind == "GATv2Conv":
            kw["share_weights"] = not bipartite and rng.random() < 0.3
    return kind, fin, rng.randint(1, 5), kw, bipartite


def adjacency(form, edge_index, num_src, num_dst):
    if form == "edge_index":
        return EdgeIndex(edge_index.long(), sparse_size=(num_src, num_dst))
    if form in ("csr", "coo"):
        values = torch.ones(edge_index.shape[1], dtype=torch.float64, device=edge_index.device)
        adj = torch.sparse_coo_tensor(edge_index.long().flip(0), values, (num_dst, num_src)).coalesce()
        return adj.to_sparse_csr() if form == "csr" else adj
    return edge_index


def call(layer, x, edge_index, edge_attr, kwargs, inputs):
    try:
        out = layer(x, edge_index, edge_attr, **kwargs) if edge_attr is not None else layer(x, edge_index, **kwargs)
        first = out[0] if isinstance(out, tuple) else out
        grads = torch.autograd.grad(first.sum(), list(layer.parameters()) + inputs, allow_unused=True)
        return "ok", out, grads
    except Exception as error:  # compared with PyG's: both must raise
        return "err", type(error).__name__, str(error)[:200]


def compare(ours, theirs):
    if ours[0] != theirs[0]:
        theirs_said = theirs[1:] if theirs[0] == "err" else "ok"
        return "MISMATCH", f"ours={ours[0]} {ours[1:] if ours[0] == 'err' else ''} theirs={theirs_said}"
    if ours[0] == "err":
        return "both raise", ""
    out_a, out_b = (r[1][0] if isinstance(r[1], tuple) else r[1] for r in (ours, theirs))
    if out_a.shape != out_b.shape or rel(out_a, out_b) > 1e-10:
        return "OUT", f"{tuple(out_a.shape)} {tuple(out_b.shape)}"
    if isinstance(ours[1], tuple) != isinstance(theirs[1], tuple):
        return "RETURN", ""
    if isinstance(ours[1], tuple):
        (graph_a, alpha_a), (graph_b, alpha_b) = ours[1][1], theirs[1][1]
        if not torch.equal(dense_index(graph_a), dense_index(graph_b)) or alpha_a.shape != alpha_b.shape \
                or rel(alpha_a, alpha_b) > 1e-10:
            return "ALPHA", ""
    for i, (a, b) in enumerate(zip(ours[2], theirs[2])):
        if (a is None) != (b is None):
            if not any(t is not None and t.abs().max() != 0 for t in (a, b)):
                continue  # one side's gradient is absent, the other's all zeros
            return "GRAD", f"#{i} absent on one side"
        if a is not None and rel(a, b) > 1e-9 and (a - b).abs().max() > 1e-12:
            return "GRAD", f"#{i} relative error {rel(a, b):.2e}"
    return "ok", ""


def pyg_loops_read_out_of_range(kw, edge_attr, dst, num_src, num_dst):
    """Whether PyG's self-loop ``fill_value`` reduction indexes past its ``min(Ns, Nd)`` rows."""
    return bool(kw.get("add_self_loops") and isinstance(kw.get("fill_value"), str) and edge_attr is not None
                and (dst >= min(num_src, num_dst)).any())


def run(seed, device):
    rng = random.Random(seed)
    kind, fin, out_channels, kw, bipartite = draw_layer(rng)
    torch.manual_seed(seed)
    try:
        shape = () if kind == "AGNNConv" else (fin, out_channels)
        theirs = getattr(pyg, kind)(*shape, **kw).to(device, torch.float64)
    except Exception:
        return "PyG refuses the options", ""
    ours = getattr(edgedot.nn, kind)(*shape, **kw).to(device, torch.float64)
    ours.load_state_dict(theirs.state_dict())
    num_src = rng.randint(1, 12)
    num_dst = rng.randint(1, 12) if bipartite else num_src
    num_edges = rng.choice([0, 1, rng.randint(1, 40)])
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, num_src, (num_edges,), generator=g)
    dst = torch.randint(0, num_dst, (num_edges,), generator=g)
    if num_edges and rng.random() < 0.3:
        dst, order = torch.sort(dst)
        src = src[order]
    edge_index = torch.stack([src, dst]).to(device)
    if rng.random() < 0.2:
        edge_index = edge_index.to(torch.int32)
    form = "tensor" if kw.get("edge_dim") else rng.choice(["tensor", "tensor", "edge_index", "csr", "coo"])
    if kw.get("add_self_loops") and form in ("csr", "coo"):
        form = "tensor"
    kwargs = {}
    if rng.random() < 0.7 and kind != "AGNNConv":
        kwargs["return_attention_weights"] = rng.choice([True, False])
    if kind == "GATConv" and rng.random() < 0.2:  # (GATv2Conv takes no size)
        kwargs["size"] = (num_src, num_dst)
    f_src, f_dst = fin if isinstance(fin, tuple) else (fin, fin)
    x_src = torch.randn(num_src, f_src, dtype=torch.float64, generator=g).to(device).requires_grad_()
    x = (x_src, torch.randn(num_dst, f_dst, dtype=torch.float64, generator=g).to(device).requires_grad_()) \
        if bipartite else x_src
    inputs = list(x) if bipartite else [x_src]
    edge_attr = None
    if "edge_dim" in kw and rng.random() < 0.8:
        edge_attr = torch.randn(num_edges, kw["edge_dim"], dtype=torch.float64, generator=g).to(device)
    ours_result = call(ours, x, adjacency(form, edge_index, num_src, num_dst), edge_attr, kwargs, inputs)
    known = pyg_loops_read_out_of_range(kw, edge_attr, dst, num_src, num_dst) and ours_result[0] == "ok"
    theirs_result = ("err", "not run on " + device, "") if known and device != "cpu" else \
        call(theirs, x, adjacency(form, edge_index.long(), num_src, num_dst), edge_attr, kwargs, inputs)
    if known:
        kind_of, detail = ("PyG reads out of range (known)", "") if theirs_result[0] == "err" else \
            ("PREDICTION", "PyG ran where it was predicted to read out of range")
    else:
        kind_of, detail = compare(ours_result, theirs_result)
    return kind_of, (f"seed {seed}: {kind} {fin} -> {out_channels} {kw}, {num_src} -> {num_dst} nodes, "
                     f"{num_edges} edges ({edge_index.dtype}, {form}), {kwargs}: {detail}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--count", type=int, default=3000)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    counts = {}
    for seed in range(args.start, args.start + args.count):
        try:
            kind_of, detail = run(seed, args.device)
        except Exception:
            kind_of, detail = "CRASH", f"seed {seed}\n{traceback.format_exc()}"
        counts[kind_of] = counts.get(kind_of, 0) + 1
        if kind_of not in ("ok", "both raise", "PyG refuses the options", "PyG reads out of range (known)"):
            print(kind_of, detail, flush=True)
    print(counts)


if __name__ == "__main__":
    main()
