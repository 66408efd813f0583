"""Float64 expected results of the attention cases, on a sample of destination nodes.

The output rows of a destination node depend only on the edges into it, so the reference is
computed on the subgraph of the edges into a random sample of destination nodes (every node
when the graph has at most ``REFERENCE_EDGES`` edges). For the gradients, the check's backward
gets a ``grad_out`` that is zero outside the sample: then every gradient (q, k, v, x and the
weights) depends only on the sampled subgraph too, and the reference gradients are exact for
the whole tensors (zero outside the rows they name)."""

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

import edgedot

REFERENCE_EDGES = 2**20    # edges of the sampled subgraph (about; the whole graph when smaller)
LINEARS = ("lin_query", "lin_key", "lin_value")


def unfused_attention(q, k, v, src_idx, dst_idx, scale, edge_feat=None):
    """Graph attention as a user writes it in PyTorch (the ``compile`` path compiles this):
    gather ``q[dst]``, ``k[src]``, ``v[src]`` (plus ``edge_feat`` on keys and values), scores,
    ``scatter_reduce`` amax per destination, ``exp``, scatter-added sums, ``index_add`` of the
    weighted values. Softmax and sums run in float32 at least, gradients' scatter-adds too (sums
    of half types drop the terms of high-degree nodes)."""
    src, dst = src_idx.long(), dst_idx.long()
    dtype, acc = q.dtype, torch.promote_types(q.dtype, torch.float32)
    num_dst, heads = q.shape[0], q.shape[1]
    q, k, v = q.to(acc), k.to(acc), v.to(acc)  # (the gradients' scatter-adds too)
    keys, values = k[src], v[src]
    if edge_feat is not None:
        keys, values = keys + edge_feat.to(acc), values + edge_feat.to(acc)
    score = (q[dst] * keys).sum(-1) * scale
    top = torch.full((num_dst, heads), -math.inf, dtype=acc, device=q.device)
    top = top.scatter_reduce(0, dst[:, None].expand(-1, heads), score.detach(), "amax")
    weight = torch.exp(score - top[dst])
    total = torch.zeros((num_dst, heads), dtype=acc, device=q.device).index_add(0, dst, weight)
    alpha = weight / total[dst]
    out = torch.zeros((num_dst, heads, v.shape[-1]), dtype=acc, device=q.device)
    return out.index_add(0, dst, alpha[..., None] * values).to(dtype)


def reference_attention(q, k, v, src_idx, dst_idx, scale):
    """``edgedot.graph_attention_reference``'s output (the unfused formula where it is missing)."""
    oracle = getattr(edgedot, "graph_attention_reference", None)
    if oracle is None:
        return unfused_attention(q, k, v, src_idx, dst_idx, scale)
    return oracle(q, k, v, src_idx, dst_idx, scale=scale)[0]


def rows_error(got, rows, want):
    """Relative error of ``got`` against a float64 reference equal to ``want`` at ``rows``
    (all rows when None) and zero elsewhere."""
    if got is None:
        return math.inf
    got = got.detach()
    if rows is None:
        return float((got.double() - want).norm() / want.norm().clamp_min(1e-300))
    part = got[rows].double()
    rest = float(torch.linalg.vector_norm(got, dtype=torch.float64) ** 2 - part.pow(2).sum())
    error = math.sqrt(float((part - want).pow(2).sum()) + max(rest, 0.0))
    return error / max(float(want.norm()), 1e-300)


@dataclass
class AttentionCheck:
    """What the paths of one attention case are checked against (input set 0)."""

    rows: torch.Tensor                # sampled destination nodes
    num_edges: int                    # edges into them
    out: torch.Tensor                 # float64 op output at ``rows``
    layer_out: torch.Tensor           # float64 layer output at ``rows``
    grad_out: Optional[torch.Tensor] = None        # the op's grad_out, zero outside ``rows``
    layer_grad_out: Optional[torch.Tensor] = None  # the layer's, likewise
    grads: dict = field(default_factory=dict)       # input name -> (rows or None, float64 gradient)
    x_grad: Optional[tuple] = None                  # (rows, float64 gradient of the layer's x there)
    weight_grads: dict = field(default_factory=dict)  # parameter name -> float64 gradient

    def describe(self):
        return {"dst_nodes": self.rows.numel(), "edges": self.num_edges}


def weights_error(grads, want):
    """Relative error of the parameters' gradients taken together (``lin_key.bias``'s alone is
    zero: a constant added to every key of a node's edges leaves its softmax unchanged)."""
    if any(grads.get(name) is None for name in want):
        return math.inf
    got = torch.cat([grads[name].detach().double().flatten() for name in want])
    return rows_error(got, None, torch.cat([w.flatten() for w in want.values()]))


def sample_rows(num_nodes, num_edges, device, generator):
    """Sorted random destination nodes with about ``REFERENCE_EDGES`` edges into them (all if fewer)."""
    if num_edges <= REFERENCE_EDGES:
        return torch.arange(num_nodes, device=device)
    count = max(1, num_nodes * REFERENCE_EDGES // num_edges)
    return torch.randperm(num_nodes, generator=generator, device=device)[:count].sort().values


def masked(grad, rows):
    """``grad`` at ``rows``, zero elsewhere."""
    out = torch.zeros_like(grad)
    out[rows] = grad[rows]
    return out


def summed_rows(parts):
    """Rows and float64 values of ``sum`` over ``(rows, values)`` parts, rows deduplicated."""
    rows, inverse = torch.unique(torch.cat([r for r, _ in parts]), return_inverse=True)
    values = torch.cat([v for _, v in parts])
    return rows, torch.zeros((rows.numel(),) + values.shape[1:], dtype=values.dtype,
                             device=values.device).index_add_(0, inverse, values)


def sampled_subgraph(case, inputs):
    """The check's subgraph of ``inputs``: ``(rows, edges, src_rows, src_local, dst_local)``, the
    sampled destination nodes, the edges into them, the sources those edges read, and each edge's
    source and destination as positions in ``src_rows`` and ``rows``."""
    device = inputs.x.device
    generator = torch.Generator(device).manual_seed(1234)
    rows = sample_rows(case.num_nodes, case.num_edges, device, generator)
    local = torch.full((case.num_nodes,), -1, dtype=torch.int64, device=device)
    local[rows] = torch.arange(rows.numel(), device=device)
    edges = (local[inputs.dst_idx] >= 0).nonzero().squeeze(1)
    dst_local = local[inputs.dst_idx[edges]]
    src_rows, src_local = torch.unique(inputs.src_idx[edges], return_inverse=True)
    return rows, edges, src_rows, src_local, dst_local


def expected_attention(case, inputs, weights, with_grads):
    """The float64 reference of the op and of the layer on the sampled subgraph of ``inputs``."""
    rows, edges, src_rows, src_local, dst_local = sampled_subgraph(case, inputs)
    scale = case.dim ** -0.5
    heads, dim = case.heads, case.dim

    def leaf(t):
        return t.detach().double().requires_grad_(with_grads)

    q, k, v = leaf(inputs.q[rows]), leaf(inputs.k[src_rows]), leaf(inputs.v[src_rows])
    out = reference_attention(q, k, v, src_local, dst_local, scale)
    check = AttentionCheck(rows, edges.numel(), out.detach(), None)
    if with_grads:
        check.grad_out = masked(inputs.grad_out, rows)
        out.backward(check.grad_out[rows].double())
        check.grads = {"q": (rows, q.grad), "k": (src_rows, k.grad), "v": (src_rows, v.grad)}

    params = {name: leaf(weights[name]) for lin in LINEARS for name in (f"{lin}.weight", f"{lin}.bias")}
    x_dst, x_src = leaf(inputs.x[rows]), leaf(inputs.x[src_rows])

    def project(lin, x):
        return F.linear(x, params[f"{lin}.weight"], params[f"{lin}.bias"]).view(x.shape[0], heads, dim)

    layer_out = reference_attention(project("lin_query", x_dst), project("lin_key", x_src),
                                    project("lin_value", x_src), src_local, dst_local, scale)
    layer_out = layer_out.reshape(rows.numel(), heads * dim)
    check.layer_out = layer_out.detach()
    if with_grads:
        check.layer_grad_out = masked(inputs.grad_layer, rows)
        layer_out.backward(check.layer_grad_out[rows].double())
        check.x_grad = summed_rows([(rows, x_dst.grad), (src_rows, x_src.grad)])
        check.weight_grads = {name: p.grad for name, p in params.items()}
    return check
