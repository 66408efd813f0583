"""Put edgedot's fused layers into an existing PyG model, keeping its weights.

edgedot.nn.GATConv, GATv2Conv and TransformerConv take PyG's constructor arguments and use
PyG's parameter names, so a PyG layer is replaced by building edgedot's layer with the same
arguments and loading the old layer's state dict. ``swap_layers`` does this for every such layer
of a model; the outputs before and after agree (float64 here, so up to rounding).

Run: python examples/swap_into_pyg.py   (CPU or CUDA; needs torch_geometric)
"""

import torch
import torch_geometric.nn as pyg_nn

import edgedot


class Net(torch.nn.Module):
    """A model written for PyG, knowing nothing of edgedot."""

    def __init__(self, in_channels, hidden, out_channels):
        super().__init__()
        self.conv1 = pyg_nn.GATConv(in_channels, hidden, heads=4)
        self.conv2 = pyg_nn.GATv2Conv(4 * hidden, hidden, heads=2, residual=True)
        self.conv3 = pyg_nn.TransformerConv(2 * hidden, out_channels, heads=2, concat=False, beta=True)

    def forward(self, x, edge_index):
        x = self.conv1(x, edge_index).relu()
        x = self.conv2(x, edge_index).relu()
        return self.conv3(x, edge_index)


def init_args(conv):
    """The constructor arguments of a PyG attention layer, read off the layer."""
    args = dict(in_channels=conv.in_channels, out_channels=conv.out_channels, heads=conv.heads,
                concat=conv.concat, dropout=conv.dropout, edge_dim=conv.edge_dim)
    if isinstance(conv, pyg_nn.TransformerConv):
        return dict(args, beta=conv.beta, root_weight=conv.root_weight, bias=conv.lin_key.bias is not None)
    args.update(negative_slope=conv.negative_slope, add_self_loops=conv.add_self_loops,
                fill_value=conv.fill_value, residual=conv.residual, bias=conv.bias is not None)
    if isinstance(conv, pyg_nn.GATv2Conv):
        args["share_weights"] = conv.share_weights
    return args


SWAPS = {pyg_nn.GATConv: edgedot.nn.GATConv, pyg_nn.GATv2Conv: edgedot.nn.GATv2Conv,
         pyg_nn.TransformerConv: edgedot.nn.TransformerConv}


def swap_layers(model):
    """Replaces, in place, each PyG layer of ``model`` that edgedot has with edgedot's, weights
    kept (a strict ``load_state_dict``: any parameter left over or missing raises)."""
    for name, module in list(model.named_modules()):
        fused = SWAPS.get(type(module))
        if fused is None:
            continue
        new = fused(**init_args(module)).to(next(module.parameters()))
        new.load_state_dict(module.state_dict())
        new.train(module.training)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, new)
    return model


if __name__ == "__main__":
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    num_nodes, num_edges = 500, 4000
    x = torch.randn(num_nodes, 16, device=device, dtype=torch.float64)
    edge_index = torch.randint(0, num_nodes, (2, num_edges), device=device)

    model = Net(16, 8, 3).to(device, torch.float64).eval()
    with torch.no_grad():
        before = model(x, edge_index)
        swap_layers(model)
        after = model(x, edge_index)
    print(model)
    print("output", tuple(after.shape), "max difference after the swap:",
          f"{(after - before).abs().max().item():.1e}")
    assert all(type(m).__module__.startswith("edgedot") for m in (model.conv1, model.conv2, model.conv3))
    assert torch.allclose(before, after), "edgedot's layers disagree with PyG's"
    print("outputs agree")
