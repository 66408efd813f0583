"""edgedot: fused CUDA kernels for edge-wise dot products on graphs (SDDMM, ``u_dot_v``).

``edge_dot(src_feat, dst_feat, src_idx, dst_idx)`` computes
``out[e] = <src_feat[src_idx[e]], dst_feat[dst_idx[e]]>`` without materialising the gathered
rows, forward and backward, on CPU and CUDA. ``graph_attention(q, k, v, src_idx, dst_idx)``
is the softmax attention over each node's incoming edges built on the same idea;
``gat_attention``, ``gatv2_attention`` and ``agnn_attention`` are GAT's, GATv2's and AGNN's
attention.
"""

import importlib

from . import ops
from .ops.agnn import agnn_attention
from .ops.attention import graph_attention
from .ops.edge_dot import edge_dot
from .ops.gat import gat_attention, gatv2_attention
from .reference import (agnn_attention_reference, edge_dot_reference, gat_attention_reference,
                        gatv2_attention_reference, graph_attention_reference)
from .runtime.checks import wait_for_checks
from .runtime.grouped import index_to_ptr
from .runtime.plan import EdgePlan

__all__ = ["edge_dot", "graph_attention", "gat_attention", "gatv2_attention", "agnn_attention", "index_to_ptr",
           "EdgePlan", "wait_for_checks", "edge_dot_reference", "graph_attention_reference", "gat_attention_reference",
           "gatv2_attention_reference", "agnn_attention_reference", "nn", "ops"]
__version__ = "0.1.0"

# Subpackages imported on first access, so that ``import edgedot`` stays lean: edgedot.nn imports
# torch_geometric (where it is installed) for its PyG layers.
_LAZY_SUBPACKAGES = ("nn",)


def __getattr__(name):
    if name in _LAZY_SUBPACKAGES:
        return importlib.import_module(f".{name}", __name__)  # the import binds it here: called once
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY_SUBPACKAGES))
