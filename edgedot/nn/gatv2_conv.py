"""``edgedot.nn.GATv2Conv``: PyG's GATv2 layer with the per-edge work (scores, softmax, dropout,
weighted sum) fused into :func:`edgedot.gatv2_attention`, on ``_GATBase`` (gat_conv.py)."""

import math
import typing
from typing import List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn import Parameter

from ..ops.attention import dropout_keep, next_dropout_state
from ..ops.gat import gat_attention, gatv2_attention
from .gat_conv import _glorot, _zero, _promoted_dtype, _GATBase
from ._pyg import (Adj, Adjacency, Linear, MessagePassing, NoneType, OptPairTensor, OptTensor, PairTensor, Projections,
                   Size, SparseTensor, add_self_loops, adjacency, attention_weights, check_edge_attr, compute_loop_attr,
                   dense_in_range, fused_path, is_torch_sparse_tensor, loops_of, one_gemm_pays, remove_self_loops,
                   set_sparse_value, softmax, torch_sparse)

if typing.TYPE_CHECKING:
    from typing import overload
else:
    from torch.jit import _overload_method as overload

# No __all__: PyG's generated propagate and edge_updater do ``from edgedot.nn.gatv2_conv import *``
# and need the type names (OptTensor, ...) imported here.


class GATv2Conv(_GATBase):
    """Drop-in for ``torch_geometric.nn.GATv2Conv`` (Brody et al. 2022, "How attentive are graph
    attention networks?"), its edges' work computed by :func:`edgedot.gatv2_attention`: no
    ``[E, heads, out_channels]`` tensor is made (except the projected ``edge_attr`` with
    ``edge_dim``).

    Constructor, parameters (``lin_l``, ``lin_r``, ``att``, ``lin_edge``, ``res``, ``bias``),
    initialisation, ``__repr__`` and paths as PyG's ``GATv2Conv`` and as :class:`GATConv`
    describes for it (``share_weights=True``: ``lin_r`` is ``lin_l``).
    ``forward(x, edge_index, edge_attr=None, return_attention_weights=None)``: ``x`` a tensor or
    a pair of tensors; the other arguments and the return values as for :class:`GATConv`.
    ``edge_attr`` without ``edge_dim`` raises ``ValueError``.
    """
    _fusable = ("lin_l", "lin_r")

    def __init__(self, in_channels: Union[int, Tuple[int, int]], out_channels: int, heads: int = 1,
                 concat: bool = True, negative_slope: float = 0.2, dropout: float = 0.0, add_self_loops: bool = True,
                 edge_dim: Optional[int] = None, fill_value: Union[float, Tensor, str] = "mean", bias: bool = True,
                 share_weights: bool = False, residual: bool = False, **kwargs):
        super().__init__(node_dim=0, **kwargs)
        self._init_common(in_channels, out_channels, heads, concat, negative_slope, dropout, add_self_loops,
                          edge_dim, fill_value, residual)
        self.share_weights = share_weights
        width = heads * out_channels
        in_src, in_dst = (in_channels, in_channels) if isinstance(in_channels, int) else in_channels
        # Created in PyG's order, so that a seed gives PyG's initial weights.
        self.lin_l = Linear(in_src, width, bias=bias, weight_initializer="glorot")
        if share_weights:
            self.lin_r = self.lin_l
        else:
            self.lin_r = Linear(in_dst, width, bias=bias, weight_initializer="glorot")
        self.att = Parameter(torch.empty(1, heads, out_channels))
        if edge_dim is not None:
            self.lin_edge = Linear(edge_dim, width, bias=False, weight_initializer="glorot")
        else:
            self.lin_edge = None
        self._init_tail(in_channels, bias)
        self.reset_parameters()

    def reset_parameters(self):
        """Re-initialises every parameter as PyG's layer does (same order, same draws)."""
        super().reset_parameters()
        self.lin_l.reset_parameters()
        self.lin_r.reset_parameters()
        if self.lin_edge is not None:
            self.lin_edge.reset_parameters()
        if self.res is not None:
            self.res.reset_parameters()
        _glorot(self.att)
        _zero(self.bias)

    @overload
    def forward(self, x: Union[Tensor, PairTensor], edge_index: Adj, edge_attr: OptTensor = None,
                return_attention_weights: NoneType = None) -> Tensor:
        pass

    @overload
    def forward(self, x: Union[Tensor, PairTensor], edge_index: Tensor,  # noqa: F811
                edge_attr: OptTensor = None,
                return_attention_weights: bool = None) -> Tuple[Tensor, Tuple[Tensor, Tensor]]:
        pass

    @overload
    def forward(self, x: Union[Tensor, PairTensor], edge_index: SparseTensor,  # noqa: F811
                edge_attr: OptTensor = None,
                return_attention_weights: bool = None) -> Tuple[Tensor, SparseTensor]:
        pass

    def forward(self, x: Union[Tensor, PairTensor], edge_index: Adj, edge_attr: OptTensor = None,  # noqa: F811
                return_attention_weights: Optional[bool] = None
                ) -> Union[Tensor, Tuple[Tensor, Tuple[Tensor, Tensor]], Tuple[Tensor, SparseTensor]]:
        """The layer's output (see the class); with ``return_attention_weights`` true, also the
        attention weights."""
        H, C = self.heads, self.out_channels
        if not torch.jit.is_scripting():
            check_edge_attr(edge_index, edge_attr)
        x_l, x_r, res = self._project(x)
        if not torch.jit.is_scripting():
            if fused_path(self):
                return self._fused_forward(x_l, x_r, res, edge_index, edge_attr, return_attention_weights)
        # TorchScript: the fused op too on a [2, E] tensor (see GATConv.forward).
        if torch.jit.is_scripting() and isinstance(edge_index, Tensor) and self._sum_aggr:
            want_alpha = isinstance(return_attention_weights, bool)
            if self._decomposed_layers == 1 and not is_torch_sparse_tensor(edge_index) \
                    and not (want_alpha and self.training and self.dropout > 0):
                out, looped, alpha = self._scripted_attention(x_l, x_r, res, edge_index, edge_attr, want_alpha)
                if isinstance(return_attention_weights, bool):
                    return out, (looped, alpha)
                return out

        # PyG's exact path.
        if self.add_self_loops:
            if isinstance(edge_index, Tensor):
                num_nodes = min(x_l.size(0), x_r.size(0))
                edge_index, edge_attr = self._tensor_loops(edge_index, edge_attr, num_nodes)
            elif isinstance(edge_index, SparseTensor):
                edge_index = self._sparse_loops(edge_index)

        # edge_updater_type: (x: PairTensor, edge_attr: OptTensor)
        alpha = self.edge_updater(edge_index, x=(x_l, x_r), edge_attr=edge_attr)
        # propagate_type: (x: PairTensor, alpha: Tensor)
        out = self.propagate(edge_index, x=(x_l, x_r), alpha=alpha)
        out = self._finish(out.view(-1, H, C), res)

        # (isinstance first: TorchScript drops the branch where the argument is None.)
        if isinstance(return_attention_weights, bool):
            if return_attention_weights or torch.jit.is_scripting():  # (one return type per overload)
                if isinstance(edge_index, Tensor):
                    if is_torch_sparse_tensor(edge_index):
                        return out, (set_sparse_value(edge_index, alpha), alpha)
                    return out, (edge_index, alpha)
                elif isinstance(edge_index, SparseTensor):
                    return out, edge_index.set_value(alpha, layout="coo")
        return out

    def _fuse_sides(self) -> bool:
        """Whether one x's two projections may run by their weights (as one GEMM where that pays,
        :func:`edgedot.nn._pyg.one_gemm_pays`): two plain linear layers (no hooks, adapters or lazy
        weights; see :func:`edgedot.nn._pyg.plain_linear`) of one input width, both with a bias or
        both without."""
        return (not self.share_weights and hasattr(self.lin_l, "weight") and hasattr(self.lin_r, "weight")
                and self._plain(["lin_l", "lin_r"])
                and self.lin_l.weight.shape[1] == self.lin_r.weight.shape[1]
                and (self.lin_l.bias is None) == (self.lin_r.bias is None))

    def _project(self, x: Union[Tensor, PairTensor]) -> Tuple[Tensor, Tensor, OptTensor]:
        """``x_l`` ``[Ns, H, C]`` (sources), ``x_r`` ``[Nd, H, C]`` (destinations) and the
        residual (None without ``residual``)."""
        H, C = self.heads, self.out_channels
        res: OptTensor = None
        if isinstance(x, Tensor):
            if x.dim() != 2:
                raise ValueError(f"x must be [N, in_channels], got {x.dim()} dimensions")
            if self.res is not None:
                res = self.res(x)
            if self._fuse_sides():
                if one_gemm_pays(x):
                    # One GEMM for both sides ([N, 2, H, C]; x_l, x_r strided views of it): its
                    # backward writes dx once, where two projections would each write one and add;
                    # the op writes the sides' gradients into one such buffer for it (_linear_sides).
                    lr_biases: List[Tensor] = []
                    if self.lin_l.bias is not None and self.lin_r.bias is not None:
                        lr_biases = [self.lin_l.bias, self.lin_r.bias]
                    sides = self._linear_sides(x, [self.lin_l.weight, self.lin_r.weight], lr_biases, H)
                    x_l, x_r = sides[0], sides[1]
                else:
                    x_l = self._linear(x, self.lin_l.weight, self.lin_l.bias).view(-1, H, C)
                    x_r = self._linear(x, self.lin_r.weight, self.lin_r.bias).view(-1, H, C)
            else:
                x_l = self.lin_l(x).view(-1, H, C)
                x_r = x_l if self.share_weights else self.lin_r(x).view(-1, H, C)
        else:
            x_src_in, x_dst_in = x[0], x[1]
            if x_src_in.dim() != 2:
                raise ValueError(f"x[0] must be [N, in_channels], got {x_src_in.dim()} dimensions")
            if x_dst_in is None:
                raise ValueError("x[1] must be a tensor: GATv2Conv needs the destinations' features")
            if self.res is not None:
                res = self.res(x_dst_in)
            x_l = self.lin_l(x_src_in).view(-1, H, C)
            x_r = self.lin_r(x_dst_in).view(-1, H, C)
        return x_l, x_r, res

    def edge_update(self, x_j: Tensor, x_i: Tensor, edge_attr: OptTensor, index: Tensor, ptr: OptTensor,
                    dim_size: Optional[int]) -> Tensor:
        """PyG's attention of each edge: ``att . leaky_relu(x_i + x_j (+ edge term))``, softmax
        over each destination's edges, dropout."""
        x = x_i + x_j
        if edge_attr is not None:
            if edge_attr.dim() == 1:
                edge_attr = edge_attr.view(-1, 1)
            if self.lin_edge is None:
                raise ValueError("edge_attr was given but the layer was built without edge_dim")
            x = x + self.lin_edge(edge_attr).view(-1, self.heads, self.out_channels)
        x = F.leaky_relu(x, self.negative_slope)
        alpha = (x * self.att).sum(dim=-1)
        alpha = softmax(alpha, index, ptr, dim_size)
        return F.dropout(alpha, p=self.dropout, training=self.training)

    def message(self, x_j: Tensor, alpha: Tensor) -> Tensor:
        """PyG's message: the source's features weighted by the edge's attention."""
        return x_j * alpha.unsqueeze(-1)

    def _attention_inputs(self, x_l: Tensor, x_r: Tensor, edge_attr: OptTensor
                          ) -> Tuple[Tensor, Tensor, Tensor, OptTensor]:
        """The fused op's ``(x_src, x_dst, att, edge_feat)`` in one dtype (eager and TorchScript
        compute them alike); ``edge_feat`` is ``lin_edge(edge_attr)`` where ``edge_attr`` is given."""
        edge_feat: OptTensor = None
        if edge_attr is not None:
            if edge_attr.dim() == 1:
                edge_attr = edge_attr.view(-1, 1)
            if self.lin_edge is not None:
                edge_feat = self.lin_edge(edge_attr).view(-1, self.heads, self.out_channels)
            else:
                raise ValueError("edge_attr was given but the layer was built without edge_dim")
        att = self.att.view(self.heads, self.out_channels)
        dtype = _promoted_dtype(x_l, [x_r, att, edge_feat])
        if edge_feat is not None:
            edge_feat = edge_feat.to(dtype)
        return x_l.to(dtype), x_r.to(dtype), att.to(dtype), edge_feat

    def _scripted_attention(self, x_l: Tensor, x_r: Tensor, res: OptTensor, edge_index: Tensor, edge_attr: OptTensor,
                            want_alpha: bool) -> Tuple[Tensor, Tensor, Tensor]:
        """The fused path under TorchScript (see :meth:`GATConv._scripted_attention`)."""
        if self.add_self_loops:
            edge_index, edge_attr = self._self_looped(edge_index, edge_attr, min(x_l.size(0), x_r.size(0)))
        x_src, x_dst, att, edge_feat = self._attention_inputs(x_l, x_r, edge_attr)
        src, dst = (edge_index[0], edge_index[1]) if self.flow == "source_to_target" else \
            (edge_index[1], edge_index[0])
        dropout_p = self.dropout if self.training else 0.0
        out, _, alpha, _ = torch.ops.edgedot.gatv2_attention(
            x_src, x_dst, att, edge_feat, src, dst, None, None, None, None, float(self.negative_slope),
            float(dropout_p), None, want_alpha, True)
        return self._finish(out, res), edge_index, alpha

    @torch.jit.unused
    def _fused_forward(self, x_l, x_r, res, edge_index, edge_attr, return_attention_weights):
        num_src, num_dst = x_l.shape[0], x_r.shape[0]
        edge_index, edge_attr, adj = self._adjacency(edge_index, edge_attr, min(num_src, num_dst), num_src, num_dst,
                                                     bool(return_attention_weights))
        x_l, x_r, att, edge_feat = self._attention_inputs(x_l, x_r, self._fused_edge_attr(adj, edge_attr))
        return self._attend(gatv2_attention, (x_l, x_r, att, edge_feat), "edge_feat", adj, num_src, num_dst,
                            edge_index, res, return_attention_weights)
