"""The three layers' forward + backward on the CPU against PyG's with the same weights, on graphs
from a toy one to ogbn-arxiv-like density: the evidence behind docs/performance.md's CPU table.

    python scripts/cpu_layers.py [--threads 2] [--cases tiny,cora,pubmed,20k,batch]
                                 [--layers TransformerConv,GATConv,GATv2Conv]

Each layer is called as ``conv(x, edge_index)`` with default options (the GAT layers add
self-loops) on uniform random edges, and ``out.sum()`` is differentiated. ``batch`` is shaped
like a sampled mini-batch (examples/train_minibatch.py's on the CPU): half the nodes receive 5
edges each from any node, the edges grouped by destination as ``NeighborLoader`` emits them. Both outputs and the
weights' gradients are first checked against each other (float32, relative error 1e-4); then
edgedot and PyG steps alternate, and the medians of ``time.perf_counter`` per step are printed
with their ratio.
"""

import argparse
import statistics
import time
import warnings

import torch

import edgedot.nn

# name: nodes, edges, input features, heads, channels per head
CASES = {
    "tiny": (50, 200, 128, 4, 32),
    "cora": (2708, 10556, 1433, 8, 8),
    "pubmed": (19717, 88648, 500, 8, 8),
    "20k": (20000, 400000, 128, 4, 32),
    "batch": (16384, 40960, 100, 4, 32),
}
LAYERS = ("TransformerConv", "GATConv", "GATv2Conv")
STEPS = {"tiny": 200, "cora": 30, "pubmed": 8, "20k": 5, "batch": 15}


def rel_error(got, want):
    """Relative error, against a norm of at least 1 (TransformerConv's key bias has a zero
    gradient in exact arithmetic: both layers give rounding noise there)."""
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1.0)).item()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--layers", default=",".join(LAYERS))
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import torch_geometric.nn as pyg
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms per forward + backward, medians")
    for case in args.cases.split(","):
        nodes, edges, features, heads, channels = CASES[case]
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(nodes, features, generator=gen)
        edge_index = torch.randint(nodes, (2, edges), generator=gen)
        if case == "batch":
            edge_index[1] = torch.arange(nodes // 2).repeat_interleave(edges // (nodes // 2))
        for name in args.layers.split(","):
            theirs = getattr(pyg, name)(features, channels, heads=heads)
            ours = getattr(edgedot.nn, name)(features, channels, heads=heads)
            ours.load_state_dict(theirs.state_dict())

            def step(layer):
                layer.zero_grad(set_to_none=True)
                out = layer(x, edge_index)
                out.sum().backward()
                return out

            pairs = [("out", step(ours), step(theirs))]
            theirs_params = dict(theirs.named_parameters())
            pairs += [(key, p.grad, theirs_params[key].grad) for key, p in ours.named_parameters()]
            for what, a, b in pairs:
                if rel_error(a, b) > 1e-4:
                    raise SystemExit(f"{case} {name}: edgedot and PyG differ in {what} ({rel_error(a, b):.2e})")
            times = {"edgedot": [], "PyG": []}
            for _ in range(STEPS[case]):
                for label, layer in (("edgedot", ours), ("PyG", theirs)):
                    begin = time.perf_counter()
                    step(layer)
                    times[label].append(time.perf_counter() - begin)
            ours_ms, theirs_ms = (1e3 * statistics.median(times[k]) for k in ("edgedot", "PyG"))
            print(f"{case:7s} {nodes:6d} nodes {edges:7d} edges {heads}x{channels:<3d} {name:16s} "
                  f"edgedot {ours_ms:9.2f}  PyG {theirs_ms:9.2f}  ratio {ours_ms / theirs_ms:5.2f}", flush=True)


if __name__ == "__main__":
    main()
