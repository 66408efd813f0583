"""``edgedot.nn.GATConv``: PyG's graph attention layer with the per-edge work (scores, softmax,
dropout, weighted sum) fused into :func:`edgedot.gat_attention`; and ``_GATBase``, what it shares
with ``edgedot.nn.GATv2Conv`` (gatv2_conv.py)."""

import math
import typing
from typing import List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn import Parameter

from ..ops import checked_graph
from ..ops.attention import dropout_keep, next_dropout_state
from ..ops.gat import gat_attention, gat_layer_attention, gatv2_attention
from ..ops.node_logits import gat_node_logit_sides, gat_node_logits
from ..runtime.checks import call_naming_graph, self_looped_with_check
from ._pyg import (Adj, Adjacency, Linear, MessagePassing, NoneType, OptPairTensor, OptTensor, PairTensor, Projections,
                   Size, SparseTensor, add_self_loops, adjacency, attention_weights, check_edge_attr, compute_loop_attr,
                   dense_in_range, fused_path, is_torch_sparse_tensor, loops_of, may_check, remove_self_loops,
                   set_sparse_value, softmax, torch_sparse)

if typing.TYPE_CHECKING:
    from typing import overload
else:
    from torch.jit import _overload_method as overload

# No __all__: PyG's generated propagate and edge_updater do ``from edgedot.nn.gat_conv import *``
# and need the type names (OptTensor, ...) imported here.


def _glorot(param):
    """PyG's ``glorot`` initialisation of ``param`` (uniform in ``sqrt(6 / (fan_in + fan_out))``
    over its last two dimensions); nothing for None."""
    if param is not None:
        bound = math.sqrt(6.0 / (param.shape[-2] + param.shape[-1]))
        with torch.no_grad():
            param.uniform_(-bound, bound)


def _zero(param):
    if param is not None:
        with torch.no_grad():
            param.zero_()


def _node_logits(x: Tensor, att: Tensor) -> Tensor:
    """``(x * att).sum(-1)``: on CUDA the fused op (one read of ``x``, a fixed-order ``att``
    gradient); on the CPU PyTorch's own ops, which the op would run anyway, without its dispatch."""
    if x.is_cuda:
        if torch.jit.is_scripting():
            return torch.ops.edgedot.gat_node_logits(x, att)
        return _eager_node_logits(x, att)
    return (x * att).sum(-1)


@torch.jit.unused
def _eager_node_logits(x: Tensor, att: Tensor) -> Tensor:
    return gat_node_logits(x, att)  # past torch.library's autograd wrapper (runtime/eager.py)


def _node_logit_sides(x: Tensor, att_src: Tensor, att_dst: Tensor) -> Tuple[Tensor, Tensor]:
    """Both sides' logits over one CUDA ``x`` from one read of it; in eager mode each ``att``
    passed as it is (no concatenation forward, no stacking backward)."""
    if torch.jit.is_scripting():
        logits = torch.ops.edgedot.gat_node_logits(x, torch.cat([att_src, att_dst]).view(2, x.shape[1], x.shape[2]))
        return logits[0], logits[1]
    return _eager_node_logit_sides(x, att_src, att_dst)


@torch.jit.unused
def _eager_node_logit_sides(x: Tensor, att_src: Tensor, att_dst: Tensor) -> Tuple[Tensor, Tensor]:
    return gat_node_logit_sides(x, att_src, att_dst)


def _promoted_dtype(first: Tensor, others: List[Optional[Tensor]]) -> torch.dtype:
    """The dtype the arithmetic of ``first`` and ``others`` (None skipped) promotes to. Under
    autocast the projections come out in the autocast dtype while the attention vectors stay
    float32, and PyG's layer then computes the attention in float32 by type promotion; the fused
    op, which takes one dtype, gets its inputs in that dtype too."""
    dtype = first.dtype
    for t in others:
        if t is not None:
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


class _GATBase(Projections, MessagePassing):
    """What both layers share: the attributes PyG's layers have, self-loop handling, the heads'
    concatenation or mean, the residual and the bias, and the fused path's bookkeeping."""

    def _init_common(self, in_channels, out_channels, heads, concat, negative_slope, dropout, add_self_loops,
                     edge_dim, fill_value, residual):
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.heads = heads
        self.concat = concat
        self.negative_slope = negative_slope
        self.dropout = dropout
        self.add_self_loops = add_self_loops
        self.edge_dim = edge_dim
        self.fill_value = fill_value
        self.residual = residual
        # Whether the aggregation is the kernel's sum (what TorchScript may fuse).
        self._sum_aggr = self.aggr in ("add", "sum")

    def _init_tail(self, in_channels, bias):
        """``res`` and ``bias``, created after the attention parameters as in PyG's layers."""
        width = self.out_channels * (self.heads if self.concat else 1)
        if self.residual:
            in_dst = in_channels if isinstance(in_channels, int) else in_channels[1]
            self.res = Linear(in_dst, width, bias=False, weight_initializer="glorot")
        else:
            self.register_parameter("res", None)
        if bias:
            self.bias = Parameter(torch.empty(width))
        else:
            self.register_parameter("bias", None)

    def _finish(self, out: Tensor, res: OptTensor, bias_added: bool = False) -> Tensor:
        """``[N, H, C]`` attention output -> the layer's output: heads concatenated (or
        averaged), plus the residual and the bias (unless ``bias_added``: by the attention)."""
        if self.concat:
            out = out.reshape(-1, self.heads * self.out_channels)
        else:
            out = out.mean(dim=1)
        if res is not None:
            out = out + res
        if self.bias is not None and not bias_added:
            out = self._add_bias(out, self.bias)
        return out

    def _sparse_loops(self, edge_index: SparseTensor) -> SparseTensor:
        """PyG's self-loops of a ``SparseTensor``: its diagonal set; refused with ``edge_dim``, as
        PyG refuses it."""
        if self.edge_dim is not None:
            raise NotImplementedError("add_self_loops with edge_dim cannot take a SparseTensor edge_index "
                                      "(as in PyG)")
        return torch_sparse.set_diag(edge_index)

    def _self_looped(self, edge_index: Tensor, edge_attr: OptTensor, num_nodes: int) -> Tuple[Tensor, OptTensor]:
        """PyG's ``remove_self_loops`` then ``add_self_loops`` of a ``[2, E]`` tensor (loops of
        nodes ``0 .. num_nodes - 1``, their ``edge_attr`` from ``fill_value``): the same edges in
        the same order, derived anew on every call."""
        looped, kept = loops_of(edge_index, num_nodes)
        if edge_attr is None:
            return looped, None
        if kept is not None:
            edge_attr = edge_attr.index_select(0, kept)
        loop_attr = self._loop_attr(looped[:, :looped.size(1) - num_nodes], edge_attr, num_nodes)
        return looped, torch.cat([edge_attr, loop_attr], dim=0)

    @torch.jit.unused
    def _loops_in_place(self, edge_index, edge_attr, num_nodes, num_src, num_dst):
        """PyG's self-loop handling of a ``[2, E]`` CUDA tensor (sources in row 0) as the kernels'
        :class:`Adjacency`, without a wait for the device: every edge keeps its place, a self-loop's
        destination becomes ``num_dst`` (a row the kernels drop: an out-of-range destination adds
        nothing to any output or gradient), and the loops of nodes ``0 .. num_nodes - 1`` follow,
        ``edge_attr`` filled as :meth:`_self_looped` fills it. Removing the loops instead would need
        their count on the host. One kernel of the extension writes both index tensors and range-checks
        ``edge_index`` on the way (:func:`edgedot.runtime.checks.self_looped_with_check`, the check
        :func:`dense_in_range` makes). Returns ``(edge_attr, adjacency)``."""
        src, dst = self_looped_with_check(edge_index, num_nodes, num_dst, num_src, num_dst,
                                          ("edge_index[0]", "edge_index[1]", "dst_ptr"))
        if edge_attr is not None:
            kept = torch.stack([src[:edge_index.shape[1]], dst[:edge_index.shape[1]]])
            edge_attr = torch.cat([edge_attr, self._loop_attr(kept, edge_attr, num_nodes)])
        return edge_attr, Adjacency(src, dst, None, None, True)

    def _tensor_loops(self, edge_index: Tensor, edge_attr: OptTensor, num_nodes: int) -> Tuple[Tensor, OptTensor]:
        """PyG's ``remove_self_loops`` then ``add_self_loops`` of any tensor adjacency
        (``[2, E]``, ``EdgeIndex``, ``torch.sparse``), the loops' features from :meth:`_loop_attr`."""
        edge_index, edge_attr = remove_self_loops(edge_index, edge_attr)
        if edge_attr is None or is_torch_sparse_tensor(edge_index):
            return add_self_loops(edge_index, edge_attr, fill_value=self.fill_value, num_nodes=num_nodes)
        loop_attr = self._loop_attr(edge_index, edge_attr, num_nodes)
        edge_index, _ = add_self_loops(edge_index, None, num_nodes=num_nodes)
        return edge_index, torch.cat([edge_attr, loop_attr], dim=0)

    def _loop_attr(self, kept_index: Tensor, edge_attr: Tensor, num_nodes: int) -> Tensor:
        """:func:`edgedot.nn._pyg.loop_attr` with ``fill_value``, scriptable (TorchScript picks
        ``compute_loop_attr``'s overload from the attribute's type): a reduction leaves out the
        edges into nodes past the loops."""
        if isinstance(self.fill_value, str):
            into = kept_index[1].clamp(max=num_nodes)
            return compute_loop_attr(torch.stack([into, into]), edge_attr, num_nodes + 1, False,
                                     self.fill_value)[:num_nodes]
        return compute_loop_attr(kept_index, edge_attr, num_nodes, False, self.fill_value)

    @torch.jit.unused
    def _adjacency(self, edge_index, edge_attr, num_nodes, num_src, num_dst, want_graph):
        """The edges the fused kernel runs over, after PyG's self-loop handling: a tensor
        (``[2, E]``, ``EdgeIndex`` or ``torch.sparse``) loses its self-loops and gains one per
        node of ``0 .. num_nodes - 1`` (``edge_attr`` filled with ``fill_value``); a
        ``SparseTensor`` gets its diagonal set (refused with ``edge_dim``, as PyG refuses it).
        Returns ``(edge_index, edge_attr, Adjacency)``: the graph PyG's attention weights are
        returned with (only where ``want_graph``), its edge features, and the kernel's view of it."""
        if type(edge_index) is torch.Tensor and edge_index.layout == torch.strided:
            if edge_index.dim() != 2 or edge_index.shape[0] != 2:
                adjacency(edge_index, num_src, num_dst, self.flow)  # raises the error naming edge_index
            if self.add_self_loops:
                # The input range-checked; the looped graph then is in range by construction (its
                # loops are of nodes below min(num_src, num_dst)).
                if edge_index.is_cuda and self.flow == "source_to_target" and not want_graph and \
                        may_check(edge_index):
                    edge_attr, adj = self._loops_in_place(edge_index, edge_attr, num_nodes, num_src, num_dst)
                    return edge_index, edge_attr, adj
                checked = dense_in_range(edge_index, num_src, num_dst, self.flow)
                edge_index, edge_attr = self._self_looped(edge_index, edge_attr, num_nodes)
                src, dst = (edge_index[0], edge_index[1]) if self.flow == "source_to_target" else \
                    (edge_index[1], edge_index[0])
                return edge_index, edge_attr, Adjacency(src, dst, None, None, checked)
        elif self.add_self_loops:
            if isinstance(edge_index, SparseTensor):
                edge_index = self._sparse_loops(edge_index)
            else:
                edge_index, edge_attr = self._tensor_loops(edge_index, edge_attr, num_nodes)
        return edge_index, edge_attr, adjacency(edge_index, num_src, num_dst, self.flow)

    @torch.jit.unused
    def _fused_edge_attr(self, adj, edge_attr):
        """The fused path's edge features, ``[E, D]`` or None: ``edge_attr``, else a sparse
        adjacency's values as PyG's propagate takes them; a 1-D tensor is one feature per edge."""
        if edge_attr is None and adj.edge_attr is not None and adj.edge_attr.dim() > 1:
            edge_attr = adj.edge_attr
        if edge_attr is not None and edge_attr.dim() == 1:
            edge_attr = edge_attr.view(-1, 1)
        return edge_attr

    @torch.jit.unused
    def _weights(self, edge_index, alpha, rng_state, num_edges):
        """PyG's ``return_attention_weights`` value for ``alpha`` ``[E, H]``: the weights after
        dropout in training (dropout applies the mask of ``rng_state``), as PyG's layers return them."""
        if rng_state is not None:
            if self.dropout >= 1:
                alpha = torch.zeros_like(alpha)
            else:
                keep = dropout_keep(rng_state, num_edges, self.heads, self.dropout, alpha.device)
                alpha = alpha * keep / (1 - self.dropout)
        return attention_weights(edge_index, alpha, sparse_values=True)

    @torch.jit.unused
    def _attend(self, op, tensors, edge_name, adj, num_src, num_dst, edge_index, res, return_attention_weights):
        """Runs the fused ``op`` on ``tensors`` (its four feature tensors, the edge term, passed as
        ``edge_name``, may be None) and the adjacency of ``num_src`` sources and ``num_dst``
        destinations; returns the layer's output (see :meth:`_finish`), with the attention weights
        where ``return_attention_weights`` is true. A CPU graph the layer has checked goes to the
        op's autograd Function directly (:mod:`edgedot.ops.checked_graph`).

        Where the weights are wanted in training with dropout, the dropout state the op is about to
        draw is read first (nothing drawn), for PyG's dropped weights."""
        want_alpha = bool(return_attention_weights)
        dropout_p = self.dropout if self.training else 0.0
        device = tensors[0].device
        rng_state = next_dropout_state(device) if want_alpha and dropout_p > 0 else None
        # On CUDA the attention kernel adds the bias of concatenated heads as it stores its output.
        bias = self.bias if (self.bias is not None and res is None and self.concat and device.type == "cuda"
                             and self.bias.dtype == tensors[0].dtype) else None
        out = None
        if adj.checked and device.type == "cpu":
            out = checked_graph.attend(op, tensors, adj.src, adj.dst, num_src, num_dst, self.negative_slope, dropout_p,
                                       want_alpha)
        if out is None:
            out = call_naming_graph(adj.names, op, *tensors[:3], adj.src, adj.dst, negative_slope=self.negative_slope,
                                    dropout_p=dropout_p, dst_ptr=adj.dst_ptr, check_indices=not adj.checked,
                                    return_attention=want_alpha, residual=bias, **{edge_name: tensors[3]})
            out = out if want_alpha else (out, None)
        out, alpha = out
        out = self._finish(out, res, bias is not None)
        return (out, self._weights(edge_index, alpha, rng_state, adj.src.shape[0])) if want_alpha else out

    def __repr__(self):
        return f"{self.__class__.__name__}({self.in_channels}, {self.out_channels}, heads={self.heads})"


class GATConv(_GATBase):
    """Drop-in for ``torch_geometric.nn.GATConv`` (graph attention, Velickovic et al. 2018), its
    edges' work computed by :func:`edgedot.gat_attention`.

    With PyG installed this is a ``torch_geometric.nn.MessagePassing`` with PyG's constructor
    (``in_channels`` an int or a pair, ``out_channels``, ``heads``, ``concat``,
    ``negative_slope``, ``dropout``, ``add_self_loops``, ``edge_dim``, ``fill_value``, ``bias``,
    ``residual``; ``**kwargs`` go to ``MessagePassing``), parameters (``lin`` or ``lin_src`` and
    ``lin_dst``, ``att_src``, ``att_dst``, ``lin_edge``, ``att_edge``, ``res``, ``bias``: state
    dicts load both ways), initialisation (the same seed gives the same weights as PyG's layer),
    ``__repr__``, ``reset_parameters``, ``edge_update`` and ``message``; without PyG it is a
    ``torch.nn.Module`` with the fused path only.

    ``forward(x, edge_index, edge_attr=None, size=None, return_attention_weights=None)``: ``x`` a
    tensor or a pair ``(x_src, x_dst)`` (``x_dst`` may be None); ``edge_index`` a ``[2, E]``
    tensor (sources in row 0), a PyG ``EdgeIndex``, a transposed ``torch.sparse`` adjacency
    (``[num_dst, num_src]``) or a transposed ``torch_sparse.SparseTensor``; ``size`` the
    ``(num_src, num_dst)`` of the adjacency. Self-loops are replaced as in PyG (removed, then one
    per node added, their ``edge_attr`` from ``fill_value``). With ``return_attention_weights``
    true it returns what PyG returns: ``(out, (edge_index, alpha))`` (the edges after the
    self-loop handling), ``(out, (adj, alpha))`` for a ``torch.sparse`` adjacency, ``(out, adj)``
    for a ``SparseTensor``; ``alpha`` ``[E, heads]`` is after dropout, as PyG's, but not
    differentiable. Dropout on the attention applies in training mode only, with the mask of
    :func:`edgedot.ops.attention.dropout_keep`.

    The fused kernel runs unless PyG's exact path is needed: in explain mode, with
    message-passing hooks, with another ``aggr`` or ``decomposed_layers > 1``, and for a pair
    ``(x_src, None)`` without ``size``. The exact path is PyG's ``edge_updater`` and
    ``propagate``; there ``alpha`` is differentiable. Unlike PyG's layer, a module holding this
    one compiles with ``torch.jit.script``; there ``return_attention_weights=False`` returns the
    weights too (one return type per signature), and on a ``[2, E]`` ``edge_index`` the scripted
    module runs the op the eager one runs (the same numbers, bit for bit); sparse adjacencies,
    and the weights after dropout in training, take the exact path.

    The projections are called as modules, as in PyG's layer (hooks, adapters and swapped modules
    take effect), except ``lin_edge`` where it is a plain bias-free ``Linear`` without hooks: its
    weights are then folded into ``att_edge`` (no ``[E, heads, out_channels]`` projection).

    Under autocast the attention is computed in the dtype PyG's layer computes it in: the
    projections come out in the autocast dtype, the attention vectors stay float32, and type
    promotion makes the attention and the output float32.

    Without PyG, self-loops of a ``torch.sparse`` adjacency and ``fill_value`` reductions other
    than ``"add"``, ``"sum"`` and ``"mean"`` raise ``ValueError``.
    """

    def __init__(self, in_channels: Union[int, Tuple[int, int]], out_channels: int, heads: int = 1,
                 concat: bool = True, negative_slope: float = 0.2, dropout: float = 0.0, add_self_loops: bool = True,
                 edge_dim: Optional[int] = None, fill_value: Union[float, Tensor, str] = "mean", bias: bool = True,
                 residual: bool = False, **kwargs):
        kwargs.setdefault("aggr", "add")
        super().__init__(node_dim=0, **kwargs)
        self._init_common(in_channels, out_channels, heads, concat, negative_slope, dropout, add_self_loops,
                          edge_dim, fill_value, residual)
        width = heads * out_channels
        # Created in PyG's order, so that a seed gives PyG's initial weights.
        self.lin = self.lin_src = self.lin_dst = None
        if isinstance(in_channels, int):
            self.lin = Linear(in_channels, width, bias=False, weight_initializer="glorot")
        else:
            self.lin_src = Linear(in_channels[0], width, bias=False, weight_initializer="glorot")
            self.lin_dst = Linear(in_channels[1], width, bias=False, weight_initializer="glorot")
        self.att_src = Parameter(torch.empty(1, heads, out_channels))
        self.att_dst = Parameter(torch.empty(1, heads, out_channels))
        if edge_dim is not None:
            self.lin_edge = Linear(edge_dim, width, bias=False, weight_initializer="glorot")
            self.att_edge = Parameter(torch.empty(1, heads, out_channels))
        else:
            self.lin_edge = None
            self.register_parameter("att_edge", None)
        self._init_tail(in_channels, bias)
        self.reset_parameters()

    # The edge term through lin_edge's weights when it is a plain Linear (_pyg.plain_linear).
    _fusable = ("lin_edge",)

    def reset_parameters(self):
        """Re-initialises every parameter as PyG's layer does (same order, same draws)."""
        super().reset_parameters()
        for lin in (self.lin, self.lin_src, self.lin_dst, self.lin_edge, self.res):
            if lin is not None:
                lin.reset_parameters()
        _glorot(self.att_src)
        _glorot(self.att_dst)
        _glorot(self.att_edge)
        _zero(self.bias)

    @overload
    def forward(self, x: Union[Tensor, OptPairTensor], edge_index: Adj, edge_attr: OptTensor = None,
                size: Size = None, return_attention_weights: NoneType = None) -> Tensor:
        pass

    @overload
    def forward(self, x: Union[Tensor, OptPairTensor], edge_index: Tensor,  # noqa: F811
                edge_attr: OptTensor = None, size: Size = None,
                return_attention_weights: bool = None) -> Tuple[Tensor, Tuple[Tensor, Tensor]]:
        pass

    @overload
    def forward(self, x: Union[Tensor, OptPairTensor], edge_index: SparseTensor,  # noqa: F811
                edge_attr: OptTensor = None, size: Size = None,
                return_attention_weights: bool = None) -> Tuple[Tensor, SparseTensor]:
        pass

    def forward(self, x: Union[Tensor, OptPairTensor], edge_index: Adj, edge_attr: OptTensor = None,  # noqa: F811
                size: Size = None, return_attention_weights: Optional[bool] = None
                ) -> Union[Tensor, Tuple[Tensor, Tuple[Tensor, Tensor]], Tuple[Tensor, SparseTensor]]:
        """The layer's output (see the class); with ``return_attention_weights`` true, also the
        attention weights."""
        H, C = self.heads, self.out_channels
        if not torch.jit.is_scripting():
            check_edge_attr(edge_index, edge_attr)
        x_src, x_dst, res = self._project(x)
        if not torch.jit.is_scripting():  # (TorchScript compiles the whole condition of an if)
            if fused_path(self) and (x_dst is not None or size is not None):
                return self._fused_forward(x_src, x_dst, res, edge_index, edge_attr, size,
                                           return_attention_weights)
        # TorchScript: the fused op too on a [2, E] tensor, so that a scripted module gives the
        # eager module's numbers (hooks and explain mode do not exist there); PyG's path where
        # the weights after dropout are wanted.
        if torch.jit.is_scripting() and isinstance(edge_index, Tensor) and self._sum_aggr:
            want_alpha = isinstance(return_attention_weights, bool)
            if self._decomposed_layers == 1 and not is_torch_sparse_tensor(edge_index) \
                    and (x_dst is not None or size is not None) and not (want_alpha and self.training
                                                                        and self.dropout > 0):
                out, looped, alpha = self._scripted_attention(x_src, x_dst, res, edge_index, edge_attr, size,
                                                              want_alpha)
                if isinstance(return_attention_weights, bool):
                    return out, (looped, alpha)
                return out

        # PyG's exact path.
        a_src = (x_src * self.att_src).sum(dim=-1)
        a_dst = None if x_dst is None else (x_dst * self.att_dst).sum(-1)
        if self.add_self_loops:
            if isinstance(edge_index, Tensor):
                # Loops for the nodes that are both sources and destinations.
                num_nodes = x_src.size(0)
                if x_dst is not None:
                    num_nodes = min(num_nodes, x_dst.size(0))
                num_nodes = min(size) if size is not None else num_nodes
                edge_index, edge_attr = self._tensor_loops(edge_index, edge_attr, num_nodes)
            elif isinstance(edge_index, SparseTensor):
                edge_index = self._sparse_loops(edge_index)

        # edge_updater_type: (alpha: OptPairTensor, edge_attr: OptTensor)
        alpha = self.edge_updater(edge_index, alpha=(a_src, a_dst), edge_attr=edge_attr, size=size)
        # propagate_type: (x: OptPairTensor, alpha: Tensor)
        out = self.propagate(edge_index, x=(x_src, x_dst), alpha=alpha, size=size)
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

    def _project(self, x: Union[Tensor, OptPairTensor]) -> Tuple[Tensor, OptTensor, OptTensor]:
        """``x_src`` ``[Ns, H, C]``, ``x_dst`` ``[Nd, H, C]`` (None for a pair ``(x, None)``) and
        the residual (None without ``residual`` or ``x_dst``)."""
        H, C = self.heads, self.out_channels
        res: OptTensor = None
        if isinstance(x, Tensor):
            if x.dim() != 2:
                raise ValueError(f"x must be [N, in_channels], got {x.dim()} dimensions")
            if self.res is not None:
                res = self.res(x)
            if self.lin is not None:
                x_src = self.lin(x).view(-1, H, C)
                x_dst: OptTensor = x_src
            else:
                assert self.lin_src is not None and self.lin_dst is not None
                x_src = self.lin_src(x).view(-1, H, C)
                x_dst = self.lin_dst(x).view(-1, H, C)
        else:
            x_src_in, x_dst_in = x[0], x[1]
            if x_src_in.dim() != 2:
                raise ValueError(f"x[0] must be [N, in_channels], got {x_src_in.dim()} dimensions")
            if x_dst_in is not None and self.res is not None:
                res = self.res(x_dst_in)
            if self.lin is not None:  # one projection for both sides
                x_src = self.lin(x_src_in).view(-1, H, C)
                x_dst = None if x_dst_in is None else self.lin(x_dst_in).view(-1, H, C)
            else:
                assert self.lin_src is not None and self.lin_dst is not None
                x_src = self.lin_src(x_src_in).view(-1, H, C)
                x_dst = None if x_dst_in is None else self.lin_dst(x_dst_in).view(-1, H, C)
        return x_src, x_dst, res

    def edge_update(self, alpha_j: Tensor, alpha_i: OptTensor, edge_attr: OptTensor, index: Tensor,
                    ptr: OptTensor, dim_size: Optional[int]) -> Tensor:
        """PyG's attention of each edge: ``leaky_relu`` of the summed source, destination (and
        edge) terms, softmax over each destination's edges, dropout."""
        alpha = alpha_j if alpha_i is None else alpha_j + alpha_i
        if index.numel() == 0:
            return alpha
        if edge_attr is not None and self.lin_edge is not None:
            if edge_attr.dim() == 1:
                edge_attr = edge_attr.view(-1, 1)
            edge_attr = self.lin_edge(edge_attr).view(-1, self.heads, self.out_channels)
            alpha = alpha + (edge_attr * self.att_edge).sum(dim=-1)
        alpha = F.leaky_relu(alpha, self.negative_slope)
        alpha = softmax(alpha, index, ptr, dim_size)
        return F.dropout(alpha, p=self.dropout, training=self.training)

    def message(self, x_j: Tensor, alpha: Tensor) -> Tensor:
        """PyG's message: the source's features weighted by the edge's attention."""
        return alpha.unsqueeze(-1) * x_j

    def _attention_inputs(self, x_src: Tensor, x_dst: OptTensor, edge_attr: OptTensor, num_dst: int
                          ) -> Tuple[Tensor, Tensor, Tensor, OptTensor]:
        """The fused op's ``(x, a_src, a_dst, a_edge)`` in one dtype (eager and TorchScript
        compute them alike): per-node logits (zeros for absent destination features), the edge
        term where ``edge_attr`` is given and the layer has ``edge_dim``."""
        H, C = self.heads, self.out_channels
        if x_dst is not None and x_dst is x_src and x_src.is_cuda:  # both sides from one read of x
            a_src, a_dst = _node_logit_sides(x_src, self.att_src, self.att_dst)
        else:
            a_src = _node_logits(x_src, self.att_src.view(H, C))
            if x_dst is not None:
                a_dst = _node_logits(x_dst, self.att_dst.view(H, C))
            else:
                a_dst = x_src.new_zeros(num_dst, self.heads)
        a_edge: OptTensor = None
        if edge_attr is not None and self.lin_edge is not None:
            if edge_attr.dim() == 1:
                edge_attr = edge_attr.view(-1, 1)
            a_edge = self._edge_logits(edge_attr)
        dtype = _promoted_dtype(x_src, [a_src, a_dst, a_edge])
        if a_edge is not None:
            a_edge = a_edge.to(dtype)
        return x_src.to(dtype), a_src.to(dtype), a_dst.to(dtype), a_edge

    def _scripted_attention(self, x_src: Tensor, x_dst: OptTensor, res: OptTensor, edge_index: Tensor,
                            edge_attr: OptTensor, size: Size, want_alpha: bool) -> Tuple[Tensor, Tensor, Tensor]:
        """The fused path under TorchScript, on a ``[2, E]`` ``edge_index``: ``(out, the graph
        after the self-loop handling, alpha)`` (``alpha`` empty unless ``want_alpha``)."""
        num_src = x_src.size(0)
        if x_dst is not None:
            num_dst = x_dst.size(0)
        else:
            assert size is not None
            num_dst = size[1]
        if size is not None and (size[0] != num_src or size[1] != num_dst):
            raise ValueError("size disagrees with the node features")
        if self.add_self_loops:
            edge_index, edge_attr = self._self_looped(edge_index, edge_attr, min(num_src, num_dst))
        x, a_src, a_dst, a_edge = self._attention_inputs(x_src, x_dst, edge_attr, num_dst)
        src, dst = (edge_index[0], edge_index[1]) if self.flow == "source_to_target" else \
            (edge_index[1], edge_index[0])
        dropout_p = self.dropout if self.training else 0.0
        out, _, alpha, _ = torch.ops.edgedot.gat_attention(
            x, a_src, a_dst, a_edge, src, dst, None, None, None, None, float(self.negative_slope), float(dropout_p),
            None, want_alpha, True)
        return self._finish(out, res), edge_index, alpha

    def _edge_logits(self, edge_attr: Tensor) -> Tensor:
        """``<lin_edge(edge_attr), att_edge>`` per edge and head, ``[E, H]``: through ``[H,
        edge_dim]`` weights, with no ``[E, H, C]`` projection, where ``lin_edge`` is a plain
        bias-free ``Linear``; else by calling ``lin_edge``, as PyG's layer does."""
        H, C = self.heads, self.out_channels
        if self.lin_edge is not None and self.att_edge is not None:
            if hasattr(self.lin_edge, "weight") and self._plain(["lin_edge"]) and self.lin_edge.bias is None:
                weight = self.lin_edge.weight.view(H, C, -1)
                return edge_attr @ (weight * self.att_edge.view(H, C, 1)).sum(1).t()
            return (self.lin_edge(edge_attr).view(-1, H, C) * self.att_edge).sum(dim=-1)
        raise ValueError("edge_attr was given but the layer was built without edge_dim")

    @torch.jit.unused
    def _fused_forward(self, x_src, x_dst, res, edge_index, edge_attr, size, return_attention_weights):
        num_src = x_src.shape[0] if size is None else size[0]
        num_dst = x_dst.shape[0] if x_dst is not None else size[1]
        if size is not None and (x_src.shape[0], num_dst) != (size[0], size[1]):
            raise ValueError(f"size {tuple(size)} disagrees with the node features: "
                             f"{x_src.shape[0]} sources, {num_dst} destinations")
        loops = min(num_src, num_dst) if size is None else min(size)
        edge_index, edge_attr, adj = self._adjacency(edge_index, edge_attr, loops, num_src, num_dst,
                                                     bool(return_attention_weights))
        edge_attr = self._fused_edge_attr(adj, edge_attr)
        if x_dst is x_src and x_src.is_cuda:  # one x for both sides: its logits and attention as one op
            a_edge = None if edge_attr is None or self.lin_edge is None else self._edge_logits(edge_attr)
            return self._attend(gat_layer_attention, (x_src, self.att_src, self.att_dst, a_edge), "a_edge", adj,
                                num_src, num_dst, edge_index, res, return_attention_weights)
        x_src, a_src, a_dst, a_edge = self._attention_inputs(x_src, x_dst, edge_attr, num_dst)
        return self._attend(gat_attention, (x_src, a_src, a_dst, a_edge), "a_edge", adj, num_src, num_dst, edge_index,
                            res, return_attention_weights)
