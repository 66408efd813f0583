"""edgedot: fused CUDA kernels for edge-wise dot products on graphs (SDDMM, ``u_dot_v``).

``edge_dot(src_feat, dst_feat, src_idx, dst_idx)`` computes
``out[e] = <src_feat[src_idx[e]], dst_feat[dst_idx[e]]>`` without materialising the gathered
rows, forward and backward, on CPU and CUDA. ``graph_attention(q, k, v, src_idx, dst_idx)``
is the softmax attention over each node's incoming edges built on the same idea;
``gat_attention`` and ``gatv2_attention`` are GAT's and GATv2's attention.
"""

from . import nn, ops
from .ops.attention import graph_attention
from .ops.edge_dot import edge_dot
from .ops.gat import gat_attention, gatv2_attention
from .runtime.grouped import index_to_ptr
from .runtime.plan import EdgePlan
from .reference import (edge_dot_reference, gat_attention_reference, gatv2_attention_reference,
                        graph_attention_reference)

__all__ = ["edge_dot", "graph_attention", "gat_attention", "gatv2_attention", "index_to_ptr", "EdgePlan",
           "edge_dot_reference", "graph_attention_reference", "gat_attention_reference", "gatv2_attention_reference",
           "nn", "ops"]
__version__ = "0.1.0"
