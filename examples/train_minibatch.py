"""Trains a 2-layer GATv2 (or TransformerConv) model on neighbour-sampled mini-batches, edgedot's
layers against PyG's: the same initial weights, the same batches, the same optimiser. Prints the
time per training step of each and both loss curves, which must match.

    python examples/train_minibatch.py                      a products-like synthetic graph
    python examples/train_minibatch.py --model transformer  TransformerConv instead of GATv2Conv
    python examples/train_minibatch.py --cora DIR           Cora too, from the Planetoid raw files
                                                            under DIR/Cora/raw (PyG's layout)

The synthetic graph is shaped like ogbn-products at a smaller size: power-law in-degrees around a
mean of 25, 100 features, 47 classes that depend on a node's features and its neighbours'. Each
step samples a batch as PyG's ``NeighborLoader`` does (seed nodes first, then two hops of up to
``--fanouts`` in-neighbours each, the edges grouped by destination, new index tensors every
step) and trains on the seeds' labels. Runs on the GPU when there is one (``--device`` chooses);
without PyG installed only edgedot's model trains.
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import edgedot.nn


# --------------------------------------------------------------------------- the graph and the sampler

class Graph:
    """A graph held as in-neighbour lists (a CSR by destination), with features and labels."""

    def __init__(self, src, dst, x, y, train_nodes):
        order = torch.argsort(dst, stable=True)
        self.src = src[order]
        self.ptr = torch.searchsorted(dst[order], torch.arange(x.shape[0] + 1, device=dst.device))
        self.x, self.y, self.train_nodes = x, y, train_nodes
        self.num_classes = int(y.max()) + 1


def synthetic_graph(num_nodes, device, generator):
    """Power-law in-degrees (mean about 25), 100 features, 47 classes planted in the features and
    smoothed over the in-neighbours once."""
    degrees = (torch.rand(num_nodes, generator=generator) ** -0.6 * 10).clamp(max=2000).long()
    dst = torch.repeat_interleave(torch.arange(num_nodes), degrees)
    src = torch.randint(num_nodes, (dst.shape[0],), generator=generator)
    x = torch.randn(num_nodes, 100, generator=generator)
    centres = torch.randn(47, 100, generator=generator)
    own = x @ centres.t()
    mixed = own + torch.zeros_like(own).index_add_(0, dst, own[src]) / degrees.clamp(min=1)[:, None]
    y = mixed.argmax(1)
    train = torch.randperm(num_nodes, generator=generator)[:num_nodes // 2]
    return Graph(src.to(device), dst.to(device), x.to(device), y.to(device), train.to(device))


def cora_graph(root, device):
    """Cora from the Planetoid raw files under ``root``/Cora/raw, or None where they are missing."""
    if not os.path.exists(os.path.join(root, "Cora", "raw", "ind.cora.x")):
        return None
    from torch_geometric.datasets import Planetoid
    data = Planetoid(root, "Cora")[0]
    return Graph(data.edge_index[0].to(device), data.edge_index[1].to(device), data.x.to(device),
                 data.y.to(device), data.train_mask.nonzero().squeeze(1).to(device))


def sample_batch(graph, batch_size, fanouts, generator):
    """A mini-batch as ``NeighborLoader`` hands it over: ``(x, edge_index, y)`` of the sampled
    subgraph, the seeds its first ``batch_size`` nodes, each hop's edges grouped by destination.
    Up to ``fanout`` in-neighbours of each frontier node are drawn uniformly (with replacement)."""
    device = graph.x.device
    pick = torch.randint(graph.train_nodes.shape[0], (batch_size,), generator=generator).to(device)
    seeds = torch.unique(graph.train_nodes[pick])
    nodes, frontier = [seeds], seeds
    local = torch.full((graph.x.shape[0],), -1, dtype=torch.long, device=device)
    local[seeds] = torch.arange(seeds.shape[0], device=device)
    count = seeds.shape[0]
    srcs, dsts = [], []
    for fanout in fanouts:
        begin, degree = graph.ptr[frontier], graph.ptr[frontier + 1] - graph.ptr[frontier]
        has = degree > 0
        owner = torch.arange(frontier.shape[0], device=device)[has].repeat_interleave(fanout)
        draw = torch.rand(owner.shape[0], generator=generator).to(device)
        src = graph.src[begin[owner] + (draw * degree[owner]).long()]
        new = torch.unique(src[local[src] < 0])
        local[new] = torch.arange(count, count + new.shape[0], device=device)
        count += new.shape[0]
        nodes.append(new)
        srcs.append(local[src])
        dsts.append(local[frontier[owner]])
        frontier = new
    nodes = torch.cat(nodes)
    edge_index = torch.stack([torch.cat(srcs), torch.cat(dsts)])
    return graph.x[nodes], edge_index, graph.y[seeds], seeds.shape[0]


# --------------------------------------------------------------------------- the models

class Model(torch.nn.Module):
    """Two attention layers (4 heads, then 1), ELU between them, from ``layers`` (a module holding
    ``GATv2Conv`` and ``TransformerConv``: ``edgedot.nn`` or ``torch_geometric.nn``)."""

    def __init__(self, layers, kind, in_channels, hidden, num_classes):
        super().__init__()
        if kind == "gatv2":
            self.conv1 = layers.GATv2Conv(in_channels, hidden, heads=4)
            self.conv2 = layers.GATv2Conv(4 * hidden, num_classes, heads=1)
        else:
            self.conv1 = layers.TransformerConv(in_channels, hidden, heads=4)
            self.conv2 = layers.TransformerConv(4 * hidden, num_classes, heads=1)

    def forward(self, x, edge_index):
        return self.conv2(F.elu(self.conv1(x, edge_index)), edge_index)


def progress(iterable, total, label):
    """tqdm's bar where tqdm is installed, else a count rewritten in place."""
    try:
        from tqdm import tqdm
        return tqdm(iterable, total=total, desc=label, leave=False)
    except ImportError:
        def counted():
            for step, item in enumerate(iterable):
                print(f"\r{label}: {step + 1}/{total}", end="", file=sys.stderr, flush=True)
                yield item
            print(file=sys.stderr)
        return counted()


def train(graph, kind, args, device, label):
    """Trains edgedot's model (and PyG's, from the same weights) on the same batches; prints the
    time per step and the loss curves; returns the largest difference between the curves."""
    models = {}
    torch.manual_seed(0)
    models["edgedot"] = Model(edgedot.nn, kind, graph.x.shape[1], args.hidden, graph.num_classes).to(device)
    try:
        import torch_geometric.nn as pyg_nn
        models["PyG"] = Model(pyg_nn, kind, graph.x.shape[1], args.hidden, graph.num_classes).to(device)
        models["PyG"].load_state_dict(models["edgedot"].state_dict())
    except ImportError:
        print("torch_geometric is not installed: edgedot's model alone")
    losses, seconds = {}, {}
    for name, model in models.items():
        optimiser = torch.optim.Adam(model.parameters(), lr=args.lr)
        generator = torch.Generator().manual_seed(1)  # the same batches for every model
        losses[name], seconds[name] = [], []
        for _ in progress(range(args.steps), args.steps, f"{label}, {name}"):
            x, edge_index, y, seeds = sample_batch(graph, args.batch_size, args.fanouts, generator)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            optimiser.zero_grad()
            loss = F.cross_entropy(model(x, edge_index)[:seeds], y)
            loss.backward()
            optimiser.step()
            losses[name].append(loss.item())  # waits for the step, as a logging loop does
            seconds[name].append(time.perf_counter() - start)
    print(f"\n{label}: {kind} model, {args.steps} steps of {args.batch_size} seeds, fan-outs {args.fanouts}, "
          f"on {device}")
    warm = seconds["edgedot"][min(3, args.steps - 1):]
    for name in models:
        step = statistics.median(seconds[name][min(3, args.steps - 1):])
        print(f"  {name:8s} {1e3 * step:8.2f} ms a step (median after 3 steps)"
              + (f", {step / statistics.median(warm):.2f}x edgedot's" if name != "edgedot" else ""))
    every = max(1, args.steps // 10)
    print("  step  " + "  ".join(f"{name:>9s}" for name in models))
    for step in range(0, args.steps, every):
        print(f"  {step:4d}  " + "  ".join(f"{losses[name][step]:9.4f}" for name in models))
    if len(models) == 1:
        return 0.0
    gap = max(abs(a - b) for a, b in zip(losses["edgedot"], losses["PyG"]))
    print(f"  largest difference between the loss curves: {gap:.2e}")
    return gap


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("gatv2", "transformer"), default="gatv2")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--nodes", type=int, default=None,
                        help="synthetic graph's nodes (default 200,000 on a GPU, 20,000 on the CPU)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--fanouts", type=int, nargs=2, default=[10, 5])
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--tolerance", type=float, default=1e-3,
                        help="largest difference between the loss curves accepted (float32 rounding)")
    parser.add_argument("--cora", metavar="DIR", help="also Cora, from DIR/Cora/raw (PyG's Planetoid layout)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.steps < 1 or args.batch_size < 1 or min(args.fanouts) < 1:
        parser.error("--steps, --batch-size and --fanouts must be positive")
    num_nodes = args.nodes or (200_000 if device.type == "cuda" else 20_000)
    graphs = [("synthetic", synthetic_graph(num_nodes, device, torch.Generator().manual_seed(0)))]
    if args.cora:
        cora = cora_graph(args.cora, device)
        if cora is None:
            print(f"no Planetoid raw files under {args.cora}/Cora/raw: Cora skipped")
        else:
            graphs.append(("Cora", cora))
    gaps = [train(graph, args.model, args, device, label) for label, graph in graphs]
    if max(gaps) > args.tolerance:
        sys.exit(f"the loss curves differ by {max(gaps):.2e}, more than {args.tolerance}")
    print("loss curves match")


if __name__ == "__main__":
    main()
