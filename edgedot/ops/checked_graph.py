"""The layers' CPU calls of the attention ops, on a graph the layer has range-checked itself.

A layer of :mod:`edgedot.nn` checks its ``edge_index`` against the node counts on every CPU call
(:func:`edgedot.nn._pyg.dense_in_range`). The public functions would then check every argument
again, and the op's CPU forward the graph a second time: on a 50-node graph that is a tenth of a
step. :func:`attend` calls the op's eager ``autograd.Function`` instead, its twin without the
graph check (:func:`edgedot.runtime.eager.register_autograd`), after :func:`_fits` has restated
every condition the op checks that the layer does not guarantee by construction. Where one
fails it returns None, and the layer calls the public function, whose error names the argument
(or which takes the input, a tensor subclass say, by its own route).
"""

import math

import torch

from ..runtime.checks import FEATURE_DTYPES
from ..runtime.checks import deferred as deferred_checks
from . import attention as attention_ops
from . import gat as gat_ops

__all__ = ["attend"]

# (One test for every functorch-wrapped tensor at once: they exist only under a transform.)
_transforms_active = torch._C._are_functorch_transforms_active

# op -> (its Function without the graph check, positions of the tensors with a row per source node,
# of those with one per destination node, of the tensor whose shape past its rows the edge
# tensor's has).
_OPS = {
    attention_ops.graph_attention: (attention_ops._GraphAttentionFunction.graph_checked, (1, 2), (0,), 1),
    gat_ops.gat_attention: (gat_ops._EAGER_FUNCTIONS[gat_ops.gat_attention_op].graph_checked, (0, 1), (2,), 1),
    gat_ops.gatv2_attention: (gat_ops._EAGER_FUNCTIONS[gat_ops.gatv2_attention_op].graph_checked, (0,), (1,), 0),
}


def attend(op, tensors, src_idx, dst_idx, num_src, num_dst, score_arg, dropout_p, return_attention):
    """``op`` (:func:`edgedot.graph_attention`, :func:`edgedot.gat_attention` or
    :func:`edgedot.gatv2_attention`) on ``tensors`` (its four feature tensors in the operator's
    order, the last, the edge term, may be None) over the CPU graph ``src_idx``, ``dst_idx``,
    which the caller has found inside ``[0, num_src)`` and ``[0, num_dst)`` (int32 or int64 rows
    of one ``[2, E]`` tensor); ``score_arg`` is the scale or the negative slope. Returns ``(out,
    alpha)`` as the op's ``return_attention`` gives them (``alpha`` an empty tensor unless
    ``return_attention``), with the bits the public function gives; or None where
    :func:`_fits` fails, for the caller to call the public function."""
    function, src_rows, dst_rows, edge_like = _OPS[op]
    if not _fits(tensors, src_idx, dst_idx, num_src, num_dst, src_rows, dst_rows, edge_like, score_arg, dropout_p):
        return None
    deferred_checks.raise_found()  # as every edgedot call: an earlier CUDA call's graph found bad
    args = (*tensors, src_idx, dst_idx, None, None, None, None, float(score_arg), float(dropout_p), None,
            return_attention, False)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        out, _, alpha, _ = function.apply(*args)
    else:  # nothing to differentiate: the Function's forward without its bookkeeping (inference)
        (out, _, alpha, _), _ = function.cpu_forward(*args)
    return out, alpha


def _fits(tensors, src_idx, dst_idx, num_src, num_dst, src_rows, dst_rows, edge_like, score_arg, dropout_p):
    """Whether the op would take these arguments as they are, given what the layers guarantee:
    features ``[N, H, C]`` views of their projections (``H``, ``C`` at least 1; GAT's logits
    ``[N, H]`` sums over their ``C``, GATv2's ``att`` an ``[H, C]`` view) and the graph's indices
    int32 or int64 rows of one ``[2, E]`` tensor. The rest is checked here: plain eager CPU
    tensors of one feature dtype; as many rows as the nodes the graph was checked against (a
    projection swapped for another module may change them); the edge tensor's shape (it comes
    from ``lin_edge``, which may be anything); the size limits; the slope (or scale) and the
    dropout probability, attributes a user may set to anything."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing() or _transforms_active():
        return False
    dtype = tensors[0].dtype
    if dtype not in FEATURE_DTYPES:
        return False
    for t in tensors:
        if t is not None and (type(t) is not torch.Tensor or not t.is_cpu or t.dtype != dtype):
            return False
    for idx in (src_idx, dst_idx):
        if type(idx) is not torch.Tensor or not idx.is_cpu:
            return False
    for positions, rows in ((src_rows, num_src), (dst_rows, num_dst)):
        for position in positions:
            if tensors[position].shape[0] != rows:
                return False
    num_edges = src_idx.shape[0]
    edge = tensors[3]
    if edge is not None and edge.shape != (num_edges,) + tensors[edge_like].shape[1:]:
        return False
    return (num_edges < attention_ops.MAX_EDGES and max(num_src, num_dst) <= attention_ops.MAX_ATTENTION_ROWS
            and _real(score_arg) and math.isfinite(score_arg) and _real(dropout_p) and 0.0 <= dropout_p <= 1.0)


def _real(value):
    # The op's checks take any real number but a bool: a rarer type (numpy's, say) goes that way.
    return type(value) is float or type(value) is int
