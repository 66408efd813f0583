"""Pure-PyTorch edge dot product: the test oracle and the benchmark's eager baseline.

It materialises two [E, ..., D] gathers, which is exactly what edgedot avoids; use it for
checking results, not for speed.
"""

import torch

__all__ = ["edge_dot_reference"]


def edge_dot_reference(src_feat, dst_feat, src_idx, dst_idx):
    """``(src_feat[src_idx] * dst_feat[dst_idx]).sum(-1)`` with heads broadcast.

    Accepts the same shapes as :func:`edgedot.edge_dot`: features ``[N, D]`` or ``[N, H, D]``
    (a head dimension of 1 broadcasts). Computes in the features' dtype, like the seed's model.
    """
    if src_feat.dim() != dst_feat.dim():  # a 2-D side is one head: [N, D] -> [N, 1, D]
        src_feat = src_feat.unsqueeze(1) if src_feat.dim() == 2 else src_feat
        dst_feat = dst_feat.unsqueeze(1) if dst_feat.dim() == 2 else dst_feat
    src = src_feat[src_idx.long()]
    dst = dst_feat[dst_idx.long()]
    return (src * dst).sum(dim=-1)
