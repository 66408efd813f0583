"""``nn.Module`` wrappers around :func:`edgedot.edge_dot` and :func:`edgedot.graph_attention`."""

import torch

from ._checks import TensorMemo, check_index_range
from .attention import graph_attention
from .functional import edge_dot

__all__ = ["EdgeDot", "InnerProductDecoder", "TransformerConv"]


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

    def extra_repr(self):
        return f"deterministic={self.deterministic}, check_indices={self.check_indices}"


class InnerProductDecoder(torch.nn.Module):
    """Drop-in for ``torch_geometric.nn.models.InnerProductDecoder`` (graph auto-encoders).

    ``forward(z, edge_index, sigmoid=True)`` scores the pairs of ``edge_index`` ([2, E]) as
    ``<z[edge_index[0]], z[edge_index[1]]>`` through the fused kernel; ``forward_all`` scores
    every pair as ``z @ z.T``.
    """

    def forward(self, z, edge_index, sigmoid=True):
        if edge_index.dim() != 2 or edge_index.shape[0] != 2:
            raise ValueError(f"edge_index must be [2, E], got shape {tuple(edge_index.shape)}")
        value = edge_dot(z, z, edge_index[0], edge_index[1])
        return torch.sigmoid(value) if sigmoid else value

    def forward_all(self, z, sigmoid=True):
        adj = torch.matmul(z, z.t())
        return torch.sigmoid(adj) if sigmoid else adj


def _linear(in_channels, out_channels, bias):
    # PyG's in_channels=-1: sized on the first forward.
    if in_channels == -1:
        return torch.nn.LazyLinear(out_channels, bias=bias)
    return torch.nn.Linear(in_channels, out_channels, bias=bias)


class TransformerConv(torch.nn.Module):
    """Drop-in for ``torch_geometric.nn.TransformerConv`` (graph transformer, Shi et al. 2021),
    its attention computed by :func:`edgedot.graph_attention`.

    Same constructor, parameter names (``lin_key``, ``lin_query``, ``lin_value``, ``lin_edge``,
    ``lin_skip``, ``lin_beta``: state dicts load both ways) and forward:
    ``forward(x, edge_index, edge_attr=None, return_attention_weights=None)`` with ``x`` a
    tensor or a pair ``(x_src, x_dst)`` and ``edge_index`` ``[2, E]`` (sources in row 0).
    With ``return_attention_weights`` a bool it returns ``(out, (edge_index, alpha))``,
    ``alpha`` ``[E, heads]`` before dropout (not differentiable here). Dropout on the attention
    applies in training mode only.

    Extra keyword of ``forward``: ``plan``, an :class:`edgedot.EdgePlan` of the graph
    (``EdgePlan(edge_index[0], edge_index[1], num_src, num_dst)``), reused across steps.
    Unlike PyG, ``edge_attr`` without ``edge_dim`` raises ``ValueError``, and ``edge_index``
    must be a dense ``[2, E]`` tensor.
    """

    def __init__(self, in_channels, out_channels, heads=1, concat=True, beta=False, dropout=0.,
                 edge_dim=None, bias=True, root_weight=True):
        super().__init__()
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.heads = heads
        self.beta = beta and root_weight
        self.root_weight = root_weight
        self.concat = concat
        self.dropout = dropout
        self.edge_dim = edge_dim
        in_src, in_dst = (in_channels, in_channels) if isinstance(in_channels, int) else in_channels
        width = heads * out_channels
        self.lin_key = _linear(in_src, width, bias)
        self.lin_query = _linear(in_dst, width, bias)
        self.lin_value = _linear(in_src, width, bias)
        self.lin_edge = None if edge_dim is None else _linear(edge_dim, width, False)
        skip_width = width if concat else out_channels
        self.lin_skip = _linear(in_dst, skip_width, bias)
        self.lin_beta = _linear(3 * skip_width, 1, False) if self.beta else None
        # One GEMM for query, key and value when both sides are the same tensor.
        self._fuse_qkv = in_src == in_dst != -1

    def reset_parameters(self):
        """Re-initialises every linear layer (PyG's and ``torch.nn.Linear``'s initialisation)."""
        for lin in (self.lin_key, self.lin_query, self.lin_value, self.lin_edge, self.lin_skip, self.lin_beta):
            if lin is not None and not isinstance(lin, torch.nn.LazyLinear):
                lin.reset_parameters()

    def _qkv(self, x_src, x_dst):
        heads, channels = self.heads, self.out_channels
        if x_src is x_dst and self._fuse_qkv:
            lins = (self.lin_query, self.lin_key, self.lin_value)
            weight = torch.cat([lin.weight for lin in lins])
            bias = None if self.lin_query.bias is None else torch.cat([lin.bias for lin in lins])
            # [N, 3, H, C]: q, k, v are strided views of the one projection.
            return torch.nn.functional.linear(x_dst, weight, bias).view(-1, 3, heads, channels).unbind(1)
        return (self.lin_query(x_dst).view(-1, heads, channels), self.lin_key(x_src).view(-1, heads, channels),
                self.lin_value(x_src).view(-1, heads, channels))

    def forward(self, x, edge_index, edge_attr=None, return_attention_weights=None, *, plan=None):
        x_src, x_dst = (x, x) if isinstance(x, torch.Tensor) else x
        if not isinstance(edge_index, torch.Tensor):
            raise TypeError(f"edge_index must be a [2, E] tensor, got {type(edge_index).__name__}")
        if edge_index.dim() != 2 or edge_index.shape[0] != 2:
            raise ValueError(f"edge_index must be [2, E], got shape {tuple(edge_index.shape)}")
        edge_feat = None
        if self.lin_edge is not None:
            if edge_attr is None:
                raise ValueError("edge_attr is required: the layer was built with edge_dim")
            edge_feat = self.lin_edge(edge_attr).view(-1, self.heads, self.out_channels)
        elif edge_attr is not None:
            raise ValueError("edge_attr was given but the layer was built without edge_dim")
        query, key, value = self._qkv(x_src, x_dst)
        want_alpha = isinstance(return_attention_weights, bool)
        checked = _edge_index_in_range(edge_index, key.shape[0], query.shape[0])
        out = graph_attention(query, key, value, edge_index[0], edge_index[1], edge_feat=edge_feat,
                              dropout_p=self.dropout if self.training else 0.0, plan=plan,
                              check_indices=not checked, return_attention=want_alpha)
        out, alpha = out if want_alpha else (out, None)
        out = out.reshape(-1, self.heads * self.out_channels) if self.concat else out.mean(dim=1)
        if self.root_weight:
            x_r = self.lin_skip(x_dst)
            if self.lin_beta is not None:
                beta = self.lin_beta(torch.cat([out, x_r, out - x_r], dim=-1)).sigmoid()
                out = beta * x_r + (1 - beta) * out
            else:
                out = out + x_r
        return (out, (edge_index, alpha)) if want_alpha else out

    def __repr__(self):
        return f"{self.__class__.__name__}({self.in_channels}, {self.out_channels}, heads={self.heads})"


# edge_index tensors found in range, with the (num_src, num_dst) they were checked for.
_edge_index_checked = TensorMemo()


def _edge_index_in_range(edge_index, num_src, num_dst):
    """Checks ``edge_index`` against the node counts once per tensor (remembered until it changes)
    and returns True, or returns False where nothing may wait (tracing, CUDA-graph capture) and
    :func:`graph_attention` checks its rows itself. (graph_attention's own memo also remembers the
    views ``edge_index[0]``, ``edge_index[1]`` across calls; this keeps one entry for both.)"""
    if torch.compiler.is_compiling() or (edge_index.is_cuda and torch.cuda.is_current_stream_capturing()):
        return False
    known = _edge_index_checked.get(edge_index)
    if known is None or known[0] > num_src or known[1] > num_dst:
        check_index_range("edge_index[0]", edge_index[0], num_src)
        check_index_range("edge_index[1]", edge_index[1], num_dst)
        _edge_index_checked.put(edge_index, (num_src, num_dst))
    return True
