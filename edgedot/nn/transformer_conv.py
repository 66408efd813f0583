"""``edgedot.nn.TransformerConv``: PyG's ``TransformerConv`` with its attention fused into
:func:`edgedot.graph_attention`."""

import math
import typing
from typing import Any, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from ..ops import checked_graph
from ..ops.attention import graph_attention
from ..runtime.checks import call_naming_graph
from ._pyg import (Adj, Linear, MessagePassing, NoneType, OptTensor, PairTensor, Projections, SparseTensor,
                   adjacency, attention_weights, check_edge_attr, fused_path, is_torch_sparse_tensor, one_gemm_pays,
                   softmax)

if typing.TYPE_CHECKING:
    from typing import overload
else:
    from torch.jit import _overload_method as overload

# No __all__: PyG's generated propagate does ``from edgedot.nn.transformer_conv import *`` and needs
# the type names (OptTensor, ...) imported here.


class TransformerConv(Projections, MessagePassing):
    """Drop-in for ``torch_geometric.nn.TransformerConv`` (graph transformer, Shi et al. 2021),
    its attention computed by :func:`edgedot.graph_attention`.

    With PyG installed this is a ``torch_geometric.nn.MessagePassing`` with PyG's constructor
    (``**kwargs`` go to ``MessagePassing``), parameters (``lin_key``, ``lin_query``,
    ``lin_value``, ``lin_edge``, ``lin_skip``, ``lin_beta``: state dicts load both ways),
    initialisation (the same seed gives the same weights as PyG's layer), ``__repr__``,
    ``reset_parameters``, ``_alpha`` and ``message``; without PyG it is a ``torch.nn.Module``
    with the fused path only.

    ``forward(x, edge_index, edge_attr=None, return_attention_weights=None, plan=None)``: ``x`` a
    tensor or a pair ``(x_src, x_dst)``; ``edge_index`` a ``[2, E]`` tensor (sources in row 0),
    a PyG ``EdgeIndex``, a transposed ``torch.sparse`` adjacency (COO, CSR or CSC,
    ``[num_dst, num_src]``) or a transposed ``torch_sparse.SparseTensor``, whose values serve as
    ``edge_attr`` when none is given. With ``return_attention_weights`` a bool it returns what
    PyG returns: ``(out, (edge_index, alpha))``, or ``(out, adj)`` holding ``alpha`` for a
    ``SparseTensor``; ``alpha`` ``[E, heads]`` is in the order of the input's edges, before
    dropout. Dropout on the attention applies in training mode only.

    ``plan``: an :class:`edgedot.EdgePlan` of a ``[2, E]`` graph (``EdgePlan(edge_index[0],
    edge_index[1], num_src, num_dst)``), reused across steps.

    ``lin_query``, ``lin_key`` and ``lin_value`` are called as modules, as in PyG's layer, when
    any of them has hooks (or global module hooks exist) or is not a plain ``Linear`` (an
    adapter, a subclass); otherwise they run by their weights, as one GEMM on one input tensor (on
    the CPU from 2^18 input elements: smaller inputs are faster through three). A plain
    ``lin_skip`` of their shape joins that GEMM: on CUDA where the heads are concatenated without
    ``beta`` (the attention kernel then adds the skip connection as it stores its output), on the
    CPU where the input is wider than the heads' width.

    Under CUDA autocast the attention runs in float32 on projections rounded to the autocast
    dtype, and the output is float32, as in PyG's layer (autocast runs its ``sum`` and ``exp`` in
    float32).

    The fused kernel runs unless PyG's exact path is needed: under TorchScript on a sparse
    adjacency (a ``[2, E]`` one runs the eager module's op, bit for bit), in explain mode
    (GNNExplainer's edge masks get their gradients), with message-passing hooks (e.g.
    AttentionExplainer's), with another ``aggr`` or ``decomposed_layers > 1``. The exact path is
    PyG's ``propagate`` and ``message``; there ``alpha`` is differentiable and ``plan`` unused.
    Unlike PyG, the fused path raises ``ValueError`` for ``edge_attr`` without ``edge_dim``.
    """
    _alpha: OptTensor
    # One GEMM for query, key and value when all three are plain Linear layers (_pyg.plain_linear),
    # with lin_skip too where _skip_in_gemm says so.
    _fusable = ("lin_query", "lin_key", "lin_value", "lin_skip")

    def __init__(self, in_channels, out_channels, heads=1, concat=True, beta=False, dropout=0., edge_dim=None,
                 bias=True, root_weight=True, **kwargs):
        kwargs.setdefault("aggr", "add")
        super().__init__(node_dim=0, **kwargs)
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.heads = heads
        self.beta = beta and root_weight
        self.root_weight = root_weight
        self.concat = concat
        self.dropout = dropout
        self.edge_dim = edge_dim
        self._alpha = None
        in_src, in_dst = (in_channels, in_channels) if isinstance(in_channels, int) else in_channels
        width = heads * out_channels
        # Created in PyG's order, so that a seed gives PyG's initial weights.
        self.lin_key = Linear(in_src, width, bias=bias)
        self.lin_query = Linear(in_dst, width, bias=bias)
        self.lin_value = Linear(in_src, width, bias=bias)
        self.lin_edge = None if edge_dim is None else Linear(edge_dim, width, bias=False)
        skip_width = width if concat else out_channels
        self.lin_skip = Linear(in_dst, skip_width, bias=bias)
        self.lin_beta = Linear(3 * skip_width, 1, bias=False) if self.beta else None
        # One GEMM for query, key and value when both sides are the same tensor (and large enough:
        # _pyg.one_gemm_pays).
        self._fuse_qkv = in_src == in_dst != -1
        # Whether the aggregation is the kernel's sum (what TorchScript may fuse).
        self._sum_aggr = self.aggr in ("add", "sum")
        self.reset_parameters()

    def reset_parameters(self):
        """Re-initialises every linear layer as PyG's layer does (same order, same draws)."""
        super().reset_parameters()
        for lin in (self.lin_key, self.lin_query, self.lin_value, self.lin_edge, self.lin_skip, self.lin_beta):
            if lin is not None:
                lin.reset_parameters()

    @overload
    def forward(self, x: Union[Tensor, PairTensor], edge_index: Adj, edge_attr: OptTensor = None,
                return_attention_weights: NoneType = None, plan: Any = None) -> Tensor:
        pass

    @overload
    def forward(self, x: Union[Tensor, PairTensor], edge_index: Tensor,  # noqa: F811
                edge_attr: OptTensor = None, return_attention_weights: bool = None,
                plan: Any = None) -> Tuple[Tensor, Tuple[Tensor, Tensor]]:
        pass

    @overload
    def forward(self, x: Union[Tensor, PairTensor], edge_index: SparseTensor,  # noqa: F811
                edge_attr: OptTensor = None, return_attention_weights: bool = None,
                plan: Any = None) -> Tuple[Tensor, SparseTensor]:
        pass

    def forward(self, x: Union[Tensor, PairTensor], edge_index: Adj, edge_attr: OptTensor = None,  # noqa: F811
                return_attention_weights: Optional[bool] = None, plan: Any = None
                ) -> Union[Tensor, Tuple[Tensor, Tuple[Tensor, Tensor]], Tuple[Tensor, SparseTensor]]:
        """The layer's output (see the class); ``(out, attention weights)`` when
        ``return_attention_weights`` is a bool."""
        if not torch.jit.is_scripting():  # (TorchScript compiles the whole condition of an if)
            check_edge_attr(edge_index, edge_attr)
            if fused_path(self):
                return self._fused_forward(x, edge_index, edge_attr, return_attention_weights, plan)
        if isinstance(x, Tensor):
            x = (x, x)
        # TorchScript: the fused kernel too on a [2, E] tensor, so that a scripted module gives
        # the eager module's numbers (hooks and explain mode do not exist there).
        if torch.jit.is_scripting() and isinstance(edge_index, Tensor) and self._sum_aggr:
            if not is_torch_sparse_tensor(edge_index) and self._decomposed_layers == 1:
                out, alpha = self._scripted_attention(x[0], x[1], edge_index, edge_attr,
                                                      isinstance(return_attention_weights, bool))
                if isinstance(return_attention_weights, bool):
                    return out, (edge_index, alpha)
                return out

        # PyG's exact path.
        H, C = self.heads, self.out_channels
        query = self.lin_query(x[1]).view(-1, H, C)
        key = self.lin_key(x[0]).view(-1, H, C)
        value = self.lin_value(x[0]).view(-1, H, C)

        # propagate_type: (query: Tensor, key:Tensor, value: Tensor,
        #                  edge_attr: OptTensor)
        out = self.propagate(edge_index, query=query, key=key, value=value, edge_attr=edge_attr)
        alpha = self._alpha
        self._alpha = None
        out = self._combine(out, x[1])

        if isinstance(return_attention_weights, bool):
            assert alpha is not None
            if isinstance(edge_index, Tensor):
                return out, (edge_index, alpha)
            elif isinstance(edge_index, SparseTensor):
                return out, edge_index.set_value(alpha, layout='coo')
        else:
            return out

    def message(self, query_i: Tensor, key_j: Tensor, value_j: Tensor, edge_attr: OptTensor, index: Tensor,
                ptr: OptTensor, size_i: Optional[int]) -> Tensor:
        """PyG's message: softmax attention of each edge, ``alpha`` kept in ``_alpha``."""
        if self.lin_edge is not None:
            assert edge_attr is not None
            edge_attr = self.lin_edge(edge_attr).view(-1, self.heads, self.out_channels)
            key_j = key_j + edge_attr
        alpha = (query_i * key_j).sum(dim=-1) / math.sqrt(self.out_channels)
        alpha = softmax(alpha, index, ptr, size_i)
        self._alpha = alpha
        alpha = F.dropout(alpha, p=self.dropout, training=self.training)
        out = value_j
        if edge_attr is not None:
            out = out + edge_attr
        return out * alpha.view(-1, self.heads, 1)

    def _combine(self, out: Tensor, x_dst: Tensor, skip: OptTensor = None) -> Tensor:
        """Heads concatenated or averaged, then the skip connection (gated with ``beta``);
        ``skip``: ``lin_skip(x_dst)`` where :meth:`_project` computed it (``[N, H, C]``)."""
        if self.concat:
            out = out.reshape(-1, self.heads * self.out_channels)
        else:
            out = out.mean(dim=1)
        if self.root_weight:
            if skip is not None:
                x_r = skip.reshape(skip.shape[0], -1)
            elif self._plain(["lin_skip"]):
                x_r = self._linear(x_dst, self.lin_skip.weight, self.lin_skip.bias)
            else:
                x_r = self.lin_skip(x_dst)
            if self.lin_beta is not None:
                beta = self.lin_beta(torch.cat([out, x_r, out - x_r], dim=-1)).sigmoid()
                out = beta * x_r + (1 - beta) * out
            else:
                out = out + x_r
        return out

    @torch.jit.unused
    def _fused_forward(self, x, edge_index, edge_attr, return_attention_weights, plan):
        x_src, x_dst = (x, x) if isinstance(x, Tensor) else x
        adj = adjacency(edge_index, x_src.shape[0], x_dst.shape[0], self.flow)
        if edge_attr is None and self.lin_edge is not None:
            edge_attr = adj.edge_attr
        query, key, value, edge_feat, skip = self._project(x_src, x_dst, edge_attr)
        if query.is_cuda and torch.is_autocast_enabled("cuda"):
            # PyG's attention under CUDA autocast is float32 (autocast runs sum and exp in float32,
            # and the messages promote): the projections come rounded to the autocast dtype, the
            # attention and the output are float32.
            query, key, value = query.float(), key.float(), value.float()
            edge_feat = None if edge_feat is None else edge_feat.float()
        want_alpha = isinstance(return_attention_weights, bool)
        dropout_p = self.dropout if self.training else 0.0
        residual = None
        if query.is_cuda and self.concat and self.root_weight and self.lin_beta is None:
            # The skip connection, added by the attention kernel as it stores its output.
            if skip is None and self._plain(["lin_skip"]):
                skip = self._linear(x_dst, self.lin_skip.weight, self.lin_skip.bias)
            if skip is not None and skip.dtype == query.dtype:
                residual = skip if skip.dim() == 3 else skip.view(-1, self.heads, self.out_channels)
        out = None
        if adj.checked and plan is None and query.device.type == "cpu":  # past the op's checks: see checked_graph
            out = checked_graph.attend(graph_attention, (query, key, value, edge_feat), adj.src, adj.dst,
                                       x_src.shape[0], x_dst.shape[0], 1.0 / math.sqrt(query.shape[-1]), dropout_p,
                                       want_alpha)
        if out is None:
            out = call_naming_graph(adj.names, graph_attention, query, key, value, adj.src, adj.dst,
                                    edge_feat=edge_feat, dropout_p=dropout_p, plan=plan,
                                    dst_ptr=adj.dst_ptr if plan is None else None, check_indices=not adj.checked,
                                    return_attention=want_alpha, residual=residual)
            out = out if want_alpha else (out, None)
        out, alpha = out
        out = out.reshape(-1, self.heads * self.out_channels) if residual is not None else \
            self._combine(out, x_dst, skip)
        return (out, attention_weights(edge_index, alpha)) if want_alpha else out

    def _scripted_attention(self, x_src: Tensor, x_dst: Tensor, edge_index: Tensor, edge_attr: OptTensor,
                            want_alpha: bool) -> Tuple[Tensor, Tensor]:
        """The fused path under TorchScript: the op :func:`graph_attention` calls, on a
        ``[2, E]`` ``edge_index``; ``(out, alpha)`` (``alpha`` empty unless ``want_alpha``)."""
        query, key, value, edge_feat, skip = self._project(x_src, x_dst, edge_attr)
        src, dst = (edge_index[0], edge_index[1]) if self.flow == "source_to_target" else \
            (edge_index[1], edge_index[0])
        dropout_p = self.dropout if self.training else 0.0
        out, _, alpha, _ = torch.ops.edgedot.graph_attention(
            query, key, value, edge_feat, src, dst, None, None, None, None, 1.0 / math.sqrt(self.out_channels),
            float(dropout_p), None, want_alpha, True)
        return self._combine(out, x_dst, skip), alpha

    def _project(self, x_src: Tensor, x_dst: Tensor, edge_attr: OptTensor
                 ) -> Tuple[Tensor, Tensor, Tensor, OptTensor, OptTensor]:
        """Queries, keys, values ``[N, H, C]``, the projected edge features, and ``lin_skip(x_dst)``
        ``[N, H, C]`` where it came from the same GEMM (else None)."""
        heads, channels = self.heads, self.out_channels
        skip: OptTensor = None
        if x_src is x_dst and self._fuse_qkv and hasattr(self.lin_query, "weight") and hasattr(self.lin_key, "weight") \
                and hasattr(self.lin_value, "weight") and self._plain(["lin_query", "lin_key", "lin_value"]):
            if one_gemm_pays(x_dst):
                weights = [self.lin_query.weight, self.lin_key.weight, self.lin_value.weight]
                biases: List[Tensor] = []
                if self.lin_query.bias is not None:
                    biases = [self.lin_query.bias, self.lin_key.bias, self.lin_value.bias]
                if self._skip_in_gemm(x_dst):
                    weights.append(self.lin_skip.weight)
                    if self.lin_skip.bias is not None:
                        biases.append(self.lin_skip.bias)
                # q, k, v (and the skip): column blocks of the one projection ([N, sides, H, C]);
                # on CUDA the op writes q, k and v's gradients into one such buffer for the GEMMs'
                # backward (_linear_sides).
                sides = self._linear_sides(x_dst, weights, biases, heads)
                query, key, value = sides[0], sides[1], sides[2]
                if len(sides) == 4:
                    skip = sides[3]
            else:
                query = self._linear(x_dst, self.lin_query.weight, self.lin_query.bias).view(-1, heads, channels)
                key = self._linear(x_dst, self.lin_key.weight, self.lin_key.bias).view(-1, heads, channels)
                value = self._linear(x_dst, self.lin_value.weight, self.lin_value.bias).view(-1, heads, channels)
        else:
            query = self.lin_query(x_dst).view(-1, heads, channels)
            key = self.lin_key(x_src).view(-1, heads, channels)
            value = self.lin_value(x_src).view(-1, heads, channels)
        edge_feat: OptTensor = None
        if self.lin_edge is not None:
            if edge_attr is None:
                raise ValueError("edge_attr is required: the layer was built with edge_dim")
            edge_feat = self.lin_edge(edge_attr).view(-1, heads, channels)
        elif edge_attr is not None:
            raise ValueError("edge_attr was given but the layer was built without edge_dim")
        return query, key, value, edge_feat, skip

    def _skip_in_gemm(self, x_dst: Tensor) -> bool:
        """Whether ``lin_skip`` joins the query, key and value GEMM as a fourth block, for a plain
        ``lin_skip`` of their shape and bias. The GEMMs then read ``x`` once less and autograd adds
        no two gradients of ``x``, while the blocks' gradients, joined for the GEMM's backward,
        take the skip's too. On CUDA where the heads are concatenated without ``beta``: the
        attention adds the skip as its residual and writes its gradient beside q, k and v's, one
        buffer the GEMM's backward takes without a copy. On the CPU where ``x`` is wider than a
        block (2 cores, forward + backward against PyG's: Cora's 1,433 features against 64, 0.885
        -> 0.82; PubMed's 500, 0.80 -> 0.745; but 100 against 128, 0.94 -> 1.01)."""
        if not self.root_weight or not hasattr(self.lin_skip, "weight") or not self._plain(["lin_skip"]):
            return False
        skip_weight, query_weight = self.lin_skip.weight, self.lin_query.weight
        if skip_weight.shape != query_weight.shape or skip_weight.dtype != query_weight.dtype \
                or (self.lin_skip.bias is None) != (self.lin_query.bias is None):
            return False
        if x_dst.is_cuda:
            return self.concat and self.lin_beta is None
        return skip_weight.shape[1] > skip_weight.shape[0]

    def __repr__(self):
        return f"{self.__class__.__name__}({self.in_channels}, {self.out_channels}, heads={self.heads})"
