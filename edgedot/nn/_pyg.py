"""What a fused drop-in for a PyG message-passing layer needs, whichever layer it is.

* :data:`MessagePassing`, :data:`Linear`: PyG's classes where ``torch_geometric`` imports (the layer
  then is a real ``MessagePassing``: explainers, hooks, ``to_hetero``, TorchScript see it as PyG's
  own), stand-ins otherwise (PyG stays optional; only the fused path exists then).
* :func:`fused_path`: whether a call may take the fused kernel, or must run PyG's exact
  ``propagate`` (explain mode, message-passing hooks, another aggregation, decomposed layers).
* :func:`adjacency`: any adjacency PyG accepts (``[2, E]`` tensor, ``EdgeIndex``, ``torch.sparse``
  COO/CSR/CSC, ``torch_sparse.SparseTensor``) as the kernels' ``(src, dst)`` index pair, with the
  destination row pointer where the input is sorted by destination.
* :func:`attention_weights`: what PyG returns as attention weights for that input.
* :class:`Projections`: whether a projection may be used by its weights (fused, folded) instead
  of being called: only a plain ``Linear`` without hooks.
* :func:`remove_self_loops`, :func:`add_self_loops`: PyG's utilities where PyG imports, versions
  for ``[2, E]`` tensors otherwise (the GAT layers' self-loop handling).
"""

import math
from typing import Dict, List, NamedTuple, Optional, Tuple, Union

import torch

from ..ops import column_sum
from ..runtime.checks import check_graph

try:
    from torch_geometric import EdgeIndex
    from torch_geometric.nn.conv import MessagePassing
    from torch_geometric.nn.dense.linear import Linear
    from torch_geometric.typing import Adj, NoneType, OptPairTensor, OptTensor, PairTensor, Size, SparseTensor
    from torch_geometric.typing import torch_sparse
    from torch_geometric.utils import add_self_loops, is_torch_sparse_tensor, remove_self_loops, softmax
    from torch_geometric.utils.loop import compute_loop_attr
    from torch_geometric.utils.sparse import set_sparse_value
    HAVE_PYG = True
except ImportError:  # PyG is optional: the layers then run their fused path only.
    HAVE_PYG = False

    class EdgeIndex:  # noqa: D101 - never instantiated: isinstance checks fail without PyG
        pass

    class SparseTensor:  # noqa: D101 - never instantiated: isinstance checks fail without PyG
        pass

    # PyG's type names, for the layers' TorchScript signatures.
    Adj = Union[torch.Tensor, SparseTensor]
    OptTensor = NoneType = Optional[torch.Tensor]
    PairTensor = Tuple[torch.Tensor, torch.Tensor]
    OptPairTensor = Tuple[torch.Tensor, Optional[torch.Tensor]]
    Size = Optional[Tuple[int, int]]
    softmax = None  # PyG's edge softmax, used by the exact (PyG-only) path
    torch_sparse = set_sparse_value = None  # reached only with a SparseTensor / torch.sparse input and PyG

    def is_torch_sparse_tensor(src):
        """Whether ``src`` is a ``torch.sparse`` tensor (PyG's utility of that name)."""
        return isinstance(src, torch.Tensor) and src.layout != torch.strided

    def remove_self_loops(edge_index, edge_attr=None):
        """``edge_index`` ``[2, E]`` and ``edge_attr`` without the edges from a node to itself."""
        if is_torch_sparse_tensor(edge_index):
            raise ValueError("edge_index: self-loops of a torch.sparse adjacency need torch_geometric installed")
        keep = edge_index[0] != edge_index[1]
        return edge_index[:, keep], None if edge_attr is None else edge_attr[keep]

    def add_self_loops(edge_index, edge_attr=None, fill_value=None, num_nodes=None):
        """``edge_index`` ``[2, E]`` followed by the loops of nodes ``0 .. num_nodes - 1``; the
        loops' ``edge_attr`` is ``fill_value`` (a number, a tensor, or ``"add"``/``"sum"``/``"mean"``
        of the features of the edges into the node), as PyG's utility of that name."""
        if num_nodes is None:
            num_nodes = int(edge_index.max()) + 1 if edge_index.numel() else 0
        loop = torch.arange(num_nodes, device=edge_index.device)  # int64, as PyG's
        full = torch.cat([edge_index, torch.stack([loop, loop])], dim=1)
        if edge_attr is None:
            return full, None
        return full, torch.cat([edge_attr, compute_loop_attr(edge_index, edge_attr, num_nodes, False, fill_value)])

    def compute_loop_attr(edge_index, edge_attr, num_nodes, is_sparse, fill_value=None):
        """The ``edge_attr`` of the self-loops of nodes ``0 .. num_nodes - 1``: ``fill_value`` (a
        number, a tensor, or ``"add"``/``"sum"``/``"mean"`` of the features of the edges into the
        node; ones for None), as PyG's utility of that name (``is_sparse`` False only)."""
        shape = (num_nodes,) + tuple(edge_attr.shape[1:])
        if fill_value is None:
            return edge_attr.new_ones(shape)
        if isinstance(fill_value, str):
            if fill_value not in ("add", "sum", "mean"):
                raise ValueError(f"fill_value={fill_value!r} needs torch_geometric installed "
                                 "(only 'add', 'sum' and 'mean' without it)")
            dst = edge_index[1].long()
            loop_attr = edge_attr.new_zeros(shape).index_add_(0, dst, edge_attr)
            if fill_value == "mean":
                count = torch.zeros(num_nodes, dtype=edge_attr.dtype, device=edge_attr.device)
                count.index_add_(0, dst, torch.ones_like(dst, dtype=edge_attr.dtype))
                loop_attr = loop_attr / count.clamp(min=1).view((-1,) + (1,) * (len(shape) - 1))
            return loop_attr
        value = torch.as_tensor(fill_value, dtype=edge_attr.dtype, device=edge_attr.device)
        if value.dim() and value.dim() != edge_attr.dim():
            value = value.unsqueeze(0)
        return value.expand(shape).contiguous()

    class MessagePassing(torch.nn.Module):
        """Stand-in for ``torch_geometric.nn.MessagePassing`` without PyG: takes its constructor
        keywords (only a sum aggregation in one layer), has no hooks and no explain mode."""

        def __init__(self, aggr="sum", *, aggr_kwargs=None, flow="source_to_target", node_dim=-2,
                     decomposed_layers=1):
            super().__init__()
            if aggr not in ("add", "sum") or aggr_kwargs:
                raise ValueError(f"aggr={aggr!r} needs torch_geometric installed (only 'add' without it)")
            if flow not in ("source_to_target", "target_to_source"):
                raise ValueError(f"flow must be 'source_to_target' or 'target_to_source', got {flow!r}")
            if decomposed_layers != 1:
                raise ValueError("decomposed_layers needs torch_geometric installed")
            self.aggr, self.flow, self.node_dim, self.decomposed_layers = aggr, flow, node_dim, decomposed_layers
            self.explain = None

        def reset_parameters(self):
            """Nothing to reset: the aggregation has no parameters."""

    class _GlorotLinear(torch.nn.Linear):
        """``torch.nn.Linear`` initialised as PyG's ``Linear(..., weight_initializer="glorot")``."""

        def reset_parameters(self):
            """Glorot-uniform weight, bias uniform in ``1/sqrt(fan_in)`` (PyG's draws, in order)."""
            bound = math.sqrt(6.0 / (self.weight.shape[0] + self.weight.shape[1]))
            torch.nn.init.uniform_(self.weight, -bound, bound)
            if self.bias is not None:
                torch.nn.init.uniform_(self.bias, -1 / math.sqrt(self.in_features), 1 / math.sqrt(self.in_features))

    class _LazyGlorotLinear(torch.nn.LazyLinear):
        """``LazyLinear`` that becomes a :class:`_GlorotLinear` at its first input."""
        cls_to_become = _GlorotLinear

        def reset_parameters(self):
            """Initialises as :class:`_GlorotLinear` once the input width is known."""
            if not self.has_uninitialized_params() and self.in_features != 0:
                _GlorotLinear.reset_parameters(self)

    def Linear(in_channels, out_channels, bias=True, weight_initializer=None):  # noqa: N802 - PyG's class
        """``torch.nn.Linear`` (``LazyLinear`` for PyG's ``in_channels=-1``): the same
        initialisation as PyG's ``Linear`` (Kaiming-uniform with ``a=sqrt(5)``, or Glorot-uniform
        with ``weight_initializer="glorot"``; bias uniform in ``1/sqrt(fan_in)``)."""
        if weight_initializer not in (None, "glorot"):
            raise ValueError(f"weight_initializer={weight_initializer!r} needs torch_geometric installed")
        if weight_initializer == "glorot":
            return (_LazyGlorotLinear if in_channels == -1 else _GlorotLinear)(
                *([] if in_channels == -1 else [in_channels]), out_channels, bias=bias)
        if in_channels == -1:
            return torch.nn.LazyLinear(out_channels, bias=bias)
        return torch.nn.Linear(in_channels, out_channels, bias=bias)

__all__ = ["HAVE_PYG", "MessagePassing", "Linear", "SparseTensor", "Adj", "NoneType", "OptTensor", "PairTensor",
           "OptPairTensor", "Size", "softmax", "torch_sparse", "is_torch_sparse_tensor", "set_sparse_value",
           "remove_self_loops", "add_self_loops", "compute_loop_attr", "loops_of", "self_looped", "loop_attr",
           "dense_in_range", "may_check", "Adjacency", "Projections", "plain_linear", "one_gemm_pays", "adjacency",
           "attention_weights", "check_edge_attr", "fused_path"]

# The classes a projection may have for its weights to stand for its call.
PLAIN_LINEAR = (torch.nn.Linear, Linear) if HAVE_PYG else (torch.nn.Linear, _GlorotLinear)


def plain_linear(*modules):
    """Whether calling each of ``modules`` computes ``F.linear(x, module.weight, module.bias)`` and
    nothing else: it is a ``torch.nn.Linear`` or PyG's ``Linear`` of exactly that class (not a
    subclass, a parametrised or lazy one, or an adapter), with no forward or backward hooks of its
    own and none registered for every module. Only then may a layer use its weights directly (one
    fused GEMM for several projections, a projection folded into the attention vector); otherwise
    it calls the module, as PyG's layer does, so that hooks, adapters (LoRA, PEFT) and quantised
    swaps take effect."""
    hooks = torch.nn.modules.module
    if (hooks._global_forward_hooks or hooks._global_forward_pre_hooks or hooks._global_backward_hooks
            or hooks._global_backward_pre_hooks):
        return False
    for module in modules:
        # (A lazy weight by its mixin: isinstance of UninitializedParameter runs a Python metaclass.)
        if (type(module) not in PLAIN_LINEAR or module._forward_hooks or module._forward_pre_hooks
                or module._backward_hooks or module._backward_pre_hooks
                or isinstance(module.weight, torch.nn.parameter.UninitializedTensorMixin)):
            return False
    return True


class Projections(torch.nn.Module):
    """Mixin of the layers: :meth:`_plain` tells whether projections may be used by their weights.

    TorchScript cannot look at hooks or classes at run time: there the answer is the one of the
    moment the module was scripted (``__prepare_scriptable__``), for the projections named in
    ``_fusable``."""
    _fusable: Tuple[str, ...] = ()
    _plain_when_scripted: Dict[str, bool]

    def _plain(self, names: List[str]) -> bool:
        """Whether every projection named in ``names`` is :func:`plain_linear`."""
        if torch.jit.is_scripting():
            for name in names:
                if not self._plain_when_scripted.get(name, False):
                    return False
            return True
        return self._eager_plain(names)

    @torch.jit.unused
    def _eager_plain(self, names: List[str]) -> bool:
        return plain_linear(*[getattr(self, name) for name in names])  # global hooks looked at once

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """``F.linear(x, weight, bias)``; outside TorchScript with the bias's gradient as a column sum
        (:func:`edgedot.ops.column_sum.linear`)."""
        if torch.jit.is_scripting():
            return torch.nn.functional.linear(x, weight, bias)
        return self._eager_linear(x, weight, bias)

    @torch.jit.unused
    def _eager_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return column_sum.linear(x, weight, bias)

    def _linear_sides(self, x: torch.Tensor, weights: List[torch.Tensor], biases: List[torch.Tensor],
                      heads: int) -> List[torch.Tensor]:
        """``F.linear`` of ``x`` by each of ``weights`` (``biases``: one per weight, or empty) as one
        GEMM, each weight's block ``[N, heads, width / heads]``; outside TorchScript by
        :func:`edgedot.ops.column_sum.linear_sides` (no concatenation or view in autograd's graph;
        the attention ops' gradients of the blocks reach the GEMM without a copy)."""
        if torch.jit.is_scripting():
            bias: Optional[torch.Tensor] = torch.cat(biases) if len(biases) > 0 else None
            y = torch.nn.functional.linear(x, torch.cat(weights), bias)
            return y.view(x.size(0), len(weights), heads, -1).unbind(1)
        return self._eager_linear_sides(x, weights, biases, heads)

    @torch.jit.unused
    def _eager_linear_sides(self, x: torch.Tensor, weights: List[torch.Tensor], biases: List[torch.Tensor],
                            heads: int) -> List[torch.Tensor]:
        return column_sum.linear_sides(x, weights, biases, heads)

    def _add_bias(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """``x + bias``; outside TorchScript with the bias's gradient as a column sum
        (:func:`edgedot.ops.column_sum.add_bias`)."""
        if torch.jit.is_scripting():
            return x + bias
        return self._eager_add_bias(x, bias)

    @torch.jit.unused
    def _eager_add_bias(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return column_sum.add_bias(x, bias)

    def __prepare_scriptable__(self):
        self._plain_when_scripted = {name: getattr(self, name) is not None and plain_linear(getattr(self, name))
                                     for name in self._fusable}
        return self


# On the CPU, projections of one input run as one GEMM on their concatenated weights only for an
# input of at least 2^18 elements: below, concatenating the weights each call and splitting
# their gradient cost more than the GEMM calls saved (2 cores, TransformerConv forward + backward:
# 50 x 128 inputs 4% faster as three GEMMs, 2708 x 1433 8% faster as one; the crossover lay
# between 143k and 430k elements). On CUDA one GEMM also saves launches: always.
def one_gemm_pays(x: torch.Tensor) -> bool:
    """Whether projections of ``x`` are faster as one GEMM than as one each (see above)."""
    return x.is_cuda or x.numel() >= 2**18  # (a literal: TorchScript compiles this)


def check_edge_attr(edge_index, edge_attr):
    """Raises ``ValueError`` naming ``edge_attr`` unless it has one row per edge of ``edge_index``
    (a ``[2, E]`` tensor, an ``EdgeIndex``, a ``torch.sparse`` adjacency or a ``SparseTensor``),
    ``TypeError`` unless it is a tensor or None. A malformed ``edge_index`` is left to
    :func:`adjacency`, whose error names it."""
    if edge_attr is None:
        return
    if not isinstance(edge_attr, torch.Tensor):
        raise TypeError(f"edge_attr must be a tensor or None, got {type(edge_attr).__name__}")
    if isinstance(edge_index, SparseTensor):
        num_edges = edge_index.nnz()
    elif not isinstance(edge_index, torch.Tensor):
        return
    elif edge_index.layout != torch.strided:
        num_edges = edge_index._nnz()
    elif edge_index.dim() == 2 and edge_index.shape[0] == 2:
        num_edges = edge_index.shape[1]
    else:
        return
    if edge_attr.dim() == 0 or edge_attr.shape[0] != num_edges:
        raise ValueError(f"edge_attr must have one row per edge of edge_index ({num_edges}), got shape "
                         f"{tuple(edge_attr.shape)}")


def fused_path(layer):
    """Whether ``layer`` (a :data:`MessagePassing`) may run its fused kernel now: not in explain
    mode (the edge mask multiplies PyG's messages), without message-passing hooks (they see
    PyG's messages; AttentionExplainer's is one), with a sum aggregation and one decomposed
    layer. TorchScript never gets here: the layers test ``torch.jit.is_scripting()`` first."""
    if not HAVE_PYG:
        return True
    # Runs on every call: plain attribute reads, no loop.
    return not (layer._explain or layer._decomposed_layers > 1 or layer.aggr not in ("add", "sum")
                or layer._propagate_forward_pre_hooks or layer._propagate_forward_hooks
                or layer._message_forward_pre_hooks or layer._message_forward_hooks
                or layer._aggregate_forward_pre_hooks or layer._aggregate_forward_hooks
                or layer._message_and_aggregate_forward_pre_hooks or layer._message_and_aggregate_forward_hooks)


class Adjacency(NamedTuple):
    """An adjacency as the fused kernels take it.

    ``src``, ``dst``: 1-D index tensors, edge ``e`` from ``src[e]`` to ``dst[e]``, in the order
    PyG's messages have for that input (so per-edge results line up with PyG's).
    ``dst_ptr``: ``[num_dst + 1]`` row pointer where the edges are sorted by destination
    (``dst[dst_ptr[n]:dst_ptr[n + 1]] == n``), else None.
    ``edge_attr``: the edge features the input carries (values of a ``SparseTensor``, or of a
    hybrid ``torch.sparse`` tensor), used where no ``edge_attr`` is passed, as PyG does; or None.
    ``checked``: whether the layer checked ``src`` and ``dst`` itself (the kernel need not; on CUDA
    the verdict may still be on its way, raised by a later call).
    ``names``: where the layer leaves the check to the op, the names its errors give ``src``,
    ``dst`` and a pointer (:func:`edgedot.runtime.checks.call_naming_graph`), else None.
    """
    src: torch.Tensor
    dst: torch.Tensor
    dst_ptr: Optional[torch.Tensor]
    edge_attr: Optional[torch.Tensor]
    checked: bool
    names: Optional[Tuple[str, str, str]] = None


def adjacency(edge_index, num_src, num_dst, flow="source_to_target"):
    """``edge_index`` in any form PyG's ``propagate`` accepts, as an :class:`Adjacency` for
    ``num_src`` source and ``num_dst`` destination nodes.

    * a ``[2, E]`` integer tensor: sources in row 0 (row 1 with ``flow="target_to_source"``),
      range-checked (see :func:`dense_in_range`);
    * a PyG ``EdgeIndex``: the same, with its row pointer when sorted by destination (the claim
      checked against the edges: ``ValueError`` naming ``edge_index`` if it is false);
    * a ``torch.sparse`` tensor (COO, CSR or CSC) or a ``torch_sparse.SparseTensor``: the
      *transposed* adjacency, ``[num_dst, num_src]`` (rows are destinations); a CSR layout and a
      ``SparseTensor`` give the row pointer, a coalesced COO one gets one. The index tensors of a
      ``torch.sparse`` input are derived on every call (a few kernels, no wait for the device):
      its memory may have been rewritten since the last one.

    Raises ``TypeError`` / ``ValueError`` naming ``edge_index`` for anything else, and for sparse
    sizes other than ``(num_dst, num_src)``.
    """
    if type(edge_index) is torch.Tensor and edge_index.layout == torch.strided and edge_index.dim() == 2 \
            and edge_index.shape[0] == 2:
        return _dense(edge_index, num_src, num_dst, flow, None)  # the common case first: it runs on every call
    if isinstance(edge_index, SparseTensor):
        _check_sparse(edge_index, tuple(edge_index.sparse_sizes()), num_src, num_dst, flow)
        storage = edge_index.storage
        value = storage.value()
        return Adjacency(storage.col(), storage.row(), storage.rowptr(), value, False)
    if not isinstance(edge_index, torch.Tensor):
        raise TypeError(f"edge_index must be a [2, E] tensor, a torch.sparse tensor or a SparseTensor, "
                        f"got {type(edge_index).__name__}")
    if edge_index.layout != torch.strided:
        _check_sparse(edge_index, tuple(edge_index.shape[:2]), num_src, num_dst, flow)
        return _sparse_adjacency(edge_index, num_dst)
    if edge_index.dim() != 2 or edge_index.shape[0] != 2:
        raise ValueError(f"edge_index must be [2, E], got shape {tuple(edge_index.shape)}")
    dst_ptr = None
    if isinstance(edge_index, EdgeIndex):
        num_rows, num_cols = edge_index.sparse_size()
        if (num_rows, num_cols) != (None, None):
            expected = (num_src, num_dst) if flow == "source_to_target" else (num_dst, num_src)
            if (num_rows, num_cols) != expected:
                raise ValueError(f"edge_index is an EdgeIndex of sparse size {(num_rows, num_cols)}, "
                                 f"expected {expected} for these node features")
        if flow == "source_to_target" and edge_index.is_sorted_by_col and num_cols is not None:
            dst_ptr = edge_index.get_indptr()
        elif flow == "target_to_source" and edge_index.is_sorted_by_row and num_rows is not None:
            dst_ptr = edge_index.get_indptr()
        order = edge_index.sort_order
        edge_index = edge_index.as_tensor()
        if dst_ptr is not None:
            return _claimed_sorted(edge_index, num_src, num_dst, flow, dst_ptr, order)
    return _dense(edge_index, num_src, num_dst, flow, dst_ptr)


def attention_weights(edge_index, alpha, sparse_values=False):
    """What PyG's attention layers return as ``(edge_index, alpha)`` for ``edge_index``:
    ``edge_index.set_value(alpha, layout="coo")`` for a ``SparseTensor``; ``(edge_index, alpha)``
    for a tensor, or with ``sparse_values`` (``GATConv``'s convention) ``(adj, alpha)`` where a
    ``torch.sparse`` ``edge_index`` becomes ``adj``, the same sparsity holding ``alpha``."""
    if isinstance(edge_index, SparseTensor):
        return edge_index.set_value(alpha, layout="coo")
    if sparse_values and edge_index.layout != torch.strided:
        return set_sparse_value(edge_index, alpha), alpha
    return edge_index, alpha


def _check_sparse(edge_index, sizes, num_src, num_dst, flow):
    if flow != "source_to_target":
        raise ValueError("flow='target_to_source' cannot take a sparse edge_index: pass the transposed "
                         "adjacency instead (as PyG requires)")
    if sizes != (num_dst, num_src):
        raise ValueError(f"edge_index is a sparse adjacency of size {sizes}, expected (num_dst, num_src) = "
                         f"{(num_dst, num_src)}: pass the transposed adjacency adj.t()")


def _sparse_adjacency(adj_t, num_dst):
    """The (src, dst, dst_ptr, edge_attr) of a ``torch.sparse`` ``[num_dst, num_src]`` tensor, in
    its storage order (PyG's ``to_edge_index``)."""
    layout = adj_t.layout
    if layout == torch.sparse_coo:
        indices, values = adj_t._indices(), adj_t._values()
        dst, src = indices[0], indices[1]
        # Coalesced means sorted by (row, column): by destination.
        dst_ptr = (torch._convert_indices_from_coo_to_csr(dst, num_dst, out_int32=dst.dtype == torch.int32)
                   if adj_t.is_coalesced() else None)
    elif layout == torch.sparse_csr:
        dst_ptr, values = adj_t.crow_indices(), adj_t.values()
        src = adj_t.col_indices()
        dst = torch._convert_indices_from_csr_to_coo(dst_ptr, src, out_int32=src.dtype == torch.int32)[0]
    elif layout == torch.sparse_csc:
        src_ptr, values, dst_ptr = adj_t.ccol_indices(), adj_t.values(), None
        dst = adj_t.row_indices()
        src = torch._convert_indices_from_csr_to_coo(src_ptr, dst, out_int32=dst.dtype == torch.int32)[0]
    else:
        raise ValueError(f"edge_index has an unsupported sparse layout {layout}")
    return Adjacency(src, dst, dst_ptr, values if values.dim() > 1 else None, False)


def _claimed_sorted(edge_index, num_src, num_dst, flow, dst_ptr, order):
    """The :class:`Adjacency` of an EdgeIndex that claims to be sorted by destination, with its
    row pointer ``dst_ptr``: the claim is checked with the ranges, in the one fused check of
    :func:`edgedot.runtime.checks.check_graph` (on CUDA without a wait: an error is raised by a
    later call), since the CUDA kernels walk the pointer as given. A false claim raises
    ``ValueError`` naming ``edge_index``; meanwhile the kernels make the destinations concerned NaN."""
    src, dst = (edge_index[0], edge_index[1]) if flow == "source_to_target" else (edge_index[1], edge_index[0])
    if not may_check(edge_index):
        return Adjacency(src, dst, dst_ptr, None, False)  # the kernel checks the pointer itself
    names = _row_names(flow) + (f"edge_index (an EdgeIndex with sort_order={order!r}): its row pointer",)
    check_graph(src, num_src, dst, num_dst, dst_ptr, names)
    return Adjacency(src, dst, dst_ptr, None, True)


def _dense(edge_index, num_src, num_dst, flow, dst_ptr):
    src, dst = (edge_index[0], edge_index[1]) if flow == "source_to_target" else (edge_index[1], edge_index[0])
    if edge_index.is_cuda and dst_ptr is None:
        # Left to the op, under the rows' names: the kernel grouping a new graph checks both rows
        # on the way, with no launch of its own (with a plan, the op's check is this one's).
        return Adjacency(src, dst, None, None, False, _row_names(flow) + ("dst_ptr",))
    return Adjacency(src, dst, dst_ptr, None, dense_in_range(edge_index, num_src, num_dst, flow))


def _row_names(flow):
    """The names of the source and destination rows of a ``[2, E]`` ``edge_index``."""
    return ("edge_index[0]", "edge_index[1]") if flow == "source_to_target" else ("edge_index[1]", "edge_index[0]")


def may_check(edge_index):
    """Whether the layer checks the graph itself now: not while tracing or capturing a CUDA graph
    (the kernel then checks its rows itself), nor for a dtype the kernel refuses with its error."""
    if torch.compiler.is_compiling() or (edge_index.is_cuda and torch.cuda.is_current_stream_capturing()):
        return False
    return edge_index.dtype in (torch.int32, torch.int64)


def dense_in_range(edge_index, num_src, num_dst, flow="source_to_target"):
    """Checks a ``[2, E]`` ``edge_index`` against the node counts and returns True, or returns
    False where the layer does not check (tracing, CUDA-graph capture, a dtype the kernel
    refuses) and the kernel checks its rows itself.

    The check is :func:`edgedot.runtime.checks.check_graph`'s, naming ``edge_index[0]`` or
    ``edge_index[1]``: on the CPU every call (both rows at once first); on CUDA without a wait for
    the device (an error is raised by the first edgedot call after the device ran the check, or by
    :func:`edgedot.wait_for_checks`; the kernels read nothing out of range meanwhile), and a
    tensor found in range is remembered until its version counter moves."""
    if not may_check(edge_index):
        return False
    if not edge_index.is_cuda and _both_rows_below(edge_index, min(num_src, num_dst)):
        return True
    row_src, row_dst = (edge_index[0], edge_index[1]) if flow == "source_to_target" else (edge_index[1], edge_index[0])
    check_graph(row_src, num_src, row_dst, num_dst, None, _row_names(flow) + ("dst_ptr",))
    return True


def _both_rows_below(edge_index, bound):
    """Whether every entry of a CPU ``[2, E]`` ``edge_index`` lies in ``[0, bound)``: both rows in one
    pass, two numbers read back (about a third of the two rows' checks at 50 nodes). Where
    not, the rows' own checks decide, and name the row in their error."""
    if edge_index.numel() == 0:
        return True
    lo, hi = torch.aminmax(edge_index)
    return lo.item() >= 0 and hi.item() < bound


def loops_of(edge_index: torch.Tensor, num_nodes: int) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """PyG's ``remove_self_loops`` then ``add_self_loops`` (loops of nodes ``0 .. num_nodes - 1``)
    of a ``[2, E]`` tensor, the same edges in the same order: ``(looped edge_index, kept)``,
    ``kept`` the positions of the edges that stay (None when all do). Derived anew on every
    call, as PyG's layers do (on CUDA the removal waits for the device once): the graph's memory
    may have been rewritten since the last call without PyTorch seeing it. Scriptable."""
    kept = (edge_index[0] != edge_index[1]).nonzero().squeeze(1)
    loop = torch.arange(num_nodes, device=edge_index.device)  # int64: PyG's result is int64
    loops = torch.stack([loop, loop])
    if kept.size(0) == edge_index.size(1):
        return torch.cat([edge_index, loops], dim=1), None
    return torch.cat([edge_index.index_select(1, kept), loops], dim=1), kept


def self_looped(edge_index, edge_attr, fill_value, num_nodes):
    """:func:`loops_of` a ``[2, E]`` tensor with its ``edge_attr``: ``(looped edge_index, looped
    edge_attr)``, the loops' features from ``fill_value`` (:func:`loop_attr`). Derived anew on
    every call."""
    looped, kept = loops_of(edge_index, num_nodes)
    if edge_attr is None:
        return looped, None
    if kept is not None:
        edge_attr = edge_attr.index_select(0, kept)
    return looped, torch.cat([edge_attr, loop_attr(looped[:, :looped.shape[1] - num_nodes], edge_attr, fill_value,
                                                   num_nodes)])


def loop_attr(kept_index, edge_attr, fill_value, num_nodes):
    """The features of the loops of nodes ``0 .. num_nodes - 1`` (PyG's ``compute_loop_attr``).
    A reduction (``"mean"``, ``"add"``, ...) over the edges into each looped node leaves out the
    edges into nodes past the loops, as a bipartite graph with more destinations than sources
    has: they go to one extra row, dropped (PyG's utility indexes past its rows there: an error
    on the CPU, a device-side assert on CUDA). The GAT layers' ``_loop_attr`` is the scriptable
    twin."""
    if isinstance(fill_value, str):
        into = kept_index[1].clamp(max=num_nodes)
        return compute_loop_attr(torch.stack([into, into]), edge_attr, num_nodes + 1, False, fill_value)[:num_nodes]
    return compute_loop_attr(kept_index, edge_attr, num_nodes, False, fill_value)
