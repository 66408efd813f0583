"""``nn.Module`` wrappers around :func:`edgedot.edge_dot`, :func:`edgedot.graph_attention`,
:func:`edgedot.gat_attention`, :func:`edgedot.gatv2_attention` and :func:`edgedot.agnn_attention`,
the attention layers drop-ins for PyG's. ``import edgedot`` loads this package only when
``edgedot.nn`` is first used, so the ops do not import ``torch_geometric``."""

import torch

from ..ops.edge_dot import edge_dot
from .agnn_conv import AGNNConv
from .gat_conv import GATConv
from .gatv2_conv import GATv2Conv
from .transformer_conv import TransformerConv

__all__ = ["AGNNConv", "EdgeDot", "GATConv", "GATv2Conv", "InnerProductDecoder", "TransformerConv"]


class EdgeDot(torch.nn.Module):
    """Module form of :func:`edgedot.edge_dot`.

    ``forward(src_feat, dst_feat, src_idx, dst_idx, plan=None)`` returns the edge scores;
    ``deterministic`` and ``check_indices`` are fixed at construction.
    """

    def __init__(self, deterministic=None, check_indices=True):
        super().__init__()
        self.deterministic = deterministic
        self.check_indices = check_indices

    def forward(self, src_feat, dst_feat, src_idx, dst_idx, plan=None):
        return edge_dot(src_feat, dst_feat, src_idx, dst_idx, plan=plan,
                        deterministic=self.deterministic, check_indices=self.check_indices)

    @torch.jit.unused
    def extra_repr(self):
        return f"deterministic={self.deterministic}, check_indices={self.check_indices}"


class InnerProductDecoder(torch.nn.Module):
    """Drop-in for ``torch_geometric.nn.models.InnerProductDecoder`` (graph auto-encoders).

    ``forward(z, edge_index, sigmoid=True)`` scores the pairs of ``edge_index`` ([2, E] tensor or
    PyG ``EdgeIndex``) as ``<z[edge_index[0]], z[edge_index[1]]>`` through the fused kernel;
    ``forward_all`` scores every pair as ``z @ z.T``. Scriptable with ``torch.jit.script``, as
    PyG's.
    """

    def forward(self, z: torch.Tensor, edge_index: torch.Tensor, sigmoid: bool = True) -> torch.Tensor:
        if torch.jit.is_scripting():
            # edge_dot's Python entry is not scriptable: the op it dispatches to.
            value = torch.ops.edgedot.edge_dot(z, z, edge_index[0], edge_index[1], None, None, False, True)
        else:
            if edge_index.dim() != 2 or edge_index.shape[0] != 2:
                raise ValueError(f"edge_index must be [2, E], got shape {tuple(edge_index.shape)}")
            value = edge_dot(z, z, edge_index[0], edge_index[1])
        return torch.sigmoid(value) if sigmoid else value

    @torch.jit.export
    def forward_all(self, z: torch.Tensor, sigmoid: bool = True) -> torch.Tensor:
        """Scores of every pair of nodes, ``z @ z.T`` (through the sigmoid unless ``sigmoid=False``)."""
        adj = torch.matmul(z, z.t())
        return torch.sigmoid(adj) if sigmoid else adj
