"""``edgedot.nn.AGNNConv``: PyG's ``AGNNConv`` with its attention fused into
:func:`edgedot.agnn_attention`."""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn import Parameter

from ..ops.agnn import agnn_attention
from ..runtime.checks import call_naming_graph
from ._pyg import (Adj, MessagePassing, OptTensor, SparseTensor, add_self_loops, adjacency, fused_path,
                   is_torch_sparse_tensor, remove_self_loops, self_looped, softmax, torch_sparse)

# No __all__: PyG's generated propagate does ``from edgedot.nn.agnn_conv import *`` and needs the
# type names (OptTensor, ...) imported here.


class AGNNConv(MessagePassing):
    """Drop-in for ``torch_geometric.nn.AGNNConv`` (Thekumparampil et al. 2018, attention-based
    graph neural network), its propagation computed by :func:`edgedot.agnn_attention`::

        out[i] = sum over j in N(i) of softmax_j(beta * cos(x[i], x[j])) * x[j]

    With PyG installed this is a ``torch_geometric.nn.MessagePassing`` with PyG's constructor
    (``requires_grad``, ``add_self_loops``; ``**kwargs`` go to ``MessagePassing``), its ``beta``
    (a ``[1]`` parameter initialised to 1, or a buffer of ones with ``requires_grad=False``: state
    dicts load both ways), ``__repr__``, ``reset_parameters`` and ``message``; without PyG it is
    a ``torch.nn.Module`` with the fused path only.

    ``forward(x, edge_index)``: ``x`` ``[N, F]``; ``edge_index`` a ``[2, E]`` tensor (sources in
    row 0), a PyG ``EdgeIndex``, a transposed ``torch.sparse`` adjacency (COO, CSR or CSC) or a
    transposed ``torch_sparse.SparseTensor`` (its values are ignored, as PyG ignores them).
    Self-loops as in PyG: a tensor loses its self-loops and gains one per node, a
    ``SparseTensor`` gets its diagonal set. The output has PyG's dtype, that of ``x`` and
    ``beta`` promoted (under autocast, bfloat16 features and the float32 ``beta`` give float32;
    the kernel computes in ``x``'s dtype).

    The fused kernel runs unless PyG's exact path is needed: in explain mode, with
    message-passing hooks, with another ``aggr`` or ``decomposed_layers > 1``. Under TorchScript
    a ``[2, E]`` ``edge_index`` takes the fused op too (the scripted module gives the eager one's
    numbers); other inputs take PyG's path.
    """

    def __init__(self, requires_grad: bool = True, add_self_loops: bool = True, **kwargs):
        kwargs.setdefault("aggr", "add")
        super().__init__(**kwargs)
        self.requires_grad = requires_grad
        self.add_self_loops = add_self_loops
        if requires_grad:
            self.beta = Parameter(torch.empty(1))
        else:
            self.register_buffer("beta", torch.ones(1))
        # Whether the aggregation is the kernel's sum (what TorchScript may fuse).
        self._sum_aggr = self.aggr in ("add", "sum")
        self.reset_parameters()

    def reset_parameters(self):
        """``beta`` back to 1 (where it is a parameter), as PyG's layer does."""
        super().reset_parameters()
        if self.requires_grad:
            self.beta.data.fill_(1)

    def forward(self, x: Tensor, edge_index: Adj) -> Tensor:
        """The propagated features ``[N, F]`` (see the class)."""
        if not torch.jit.is_scripting():  # (TorchScript compiles the whole condition of an if)
            if fused_path(self):
                return self._fused_forward(x, edge_index)

        if self.add_self_loops:
            if isinstance(edge_index, Tensor):
                edge_index, _ = remove_self_loops(edge_index)
                edge_index, _ = add_self_loops(edge_index, num_nodes=x.size(self.node_dim))
            elif isinstance(edge_index, SparseTensor):
                edge_index = torch_sparse.set_diag(edge_index)

        x_norm = F.normalize(x, p=2., dim=-1)

        # TorchScript: the fused op on a [2, E] tensor, as the eager module runs it.
        if torch.jit.is_scripting() and isinstance(edge_index, Tensor) and self._sum_aggr:
            if not is_torch_sparse_tensor(edge_index) and self._decomposed_layers == 1 and x.dim() == 2:
                src, dst = (edge_index[0], edge_index[1]) if self.flow == "source_to_target" else \
                    (edge_index[1], edge_index[0])
                out = torch.ops.edgedot.agnn_attention(x_norm.unsqueeze(1), x.unsqueeze(1), self.beta, src, dst,
                                                       None, None, None, None, False, True)[0]
                return out.squeeze(1).to(torch.promote_types(x.dtype, self.beta.dtype))

        # PyG's exact path.
        # propagate_type: (x: Tensor, x_norm: Tensor)
        return self.propagate(edge_index, x=x, x_norm=x_norm)

    def message(self, x_j: Tensor, x_norm_i: Tensor, x_norm_j: Tensor, index: Tensor, ptr: OptTensor,
                size_i: Optional[int]) -> Tensor:
        """PyG's message: the source's features weighted by the softmax of the scaled cosine."""
        alpha = self.beta * (x_norm_i * x_norm_j).sum(dim=-1)
        alpha = softmax(alpha, index, ptr, size_i)
        return x_j * alpha.view(-1, 1)

    @torch.jit.unused
    def _fused_forward(self, x, edge_index):
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a tensor, got {type(x).__name__}")
        if x.dim() != 2:
            raise ValueError(f"x must be [N, F], got shape {tuple(x.shape)}")
        num_nodes = x.shape[0]
        if self.add_self_loops:
            if isinstance(edge_index, SparseTensor):
                edge_index = torch_sparse.set_diag(edge_index)
            elif type(edge_index) is torch.Tensor and edge_index.layout == torch.strided:
                edge_index = self_looped(edge_index, None, None, num_nodes)[0]
            else:  # EdgeIndex, torch.sparse: PyG's utilities
                edge_index, _ = remove_self_loops(edge_index)
                edge_index, _ = add_self_loops(edge_index, num_nodes=num_nodes)
        adj = adjacency(edge_index, num_nodes, num_nodes, self.flow)
        out = call_naming_graph(adj.names, agnn_attention, x, self.beta, adj.src, adj.dst, dst_ptr=adj.dst_ptr,
                                check_indices=not adj.checked)
        return out.to(torch.promote_types(x.dtype, self.beta.dtype))

    def __repr__(self):
        return f"{self.__class__.__name__}()"
