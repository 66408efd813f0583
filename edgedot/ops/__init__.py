"""The ops, one module per family: :mod:`~edgedot.ops.edge_dot`, :mod:`~edgedot.ops.attention`,
:mod:`~edgedot.ops.gat` and :mod:`~edgedot.ops.agnn`, each with its public function and the
``torch.library`` operators behind it; :mod:`~edgedot.ops.node_logits`, GAT's per-node logits;
:mod:`~edgedot.ops.column_sum`, the layers' bias gradients; :mod:`~edgedot.ops.checked_graph`, the
layers' CPU calls of the attention ops on a graph they have checked."""

from . import agnn, attention, column_sum, edge_dot, gat, node_logits

# What edgedot.ops was before the ops were split by family: edge_dot's operators and eager CUDA path,
# and the names that module imported.
from ..runtime.build import cuda_module
from ..runtime.checks import check_graph, check_inputs, output_shape
from ..runtime.plan import check_plan_layout
from .agnn import agnn_attention
from .edge_dot import (REDUCTIONS, SORT_MIN_EDGES, EagerCUDAEdgeDot, edge_dot_grad_op, edge_dot_op, forward_cuda,
                       grad_cuda)

__all__ = ["agnn_attention", "edge_dot_op", "edge_dot_grad_op", "EagerCUDAEdgeDot", "forward_cuda", "grad_cuda"]
