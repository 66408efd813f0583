"""Graph attention with edge features (PyG ``TransformerConv``'s ``edge_dim``) beside anemoi's
Triton GraphTransformer: :func:`edgedot.graph_attention` with ``edge_feat`` (``edgedot``: the
edges given grouped by ``dst_ptr``; ``edgedot_default``: as they come), ``torch.compile`` of the
unfused math (``compile``) and, where it imports, anemoi-models' ``anemoi.models.triton.gt``
(``anemoi``: a deterministic fused kernel, which needs only torch and Triton; its CSC adjacency
and reverse index are built once per graph, outside the timing), forward and forward + backward,
float16, on uniform graphs sorted by destination, 4 heads of 32. Each path is checked against the
float64 reference on a sample of destination nodes (outputs, and the gradients of q, k, v and
the edge features) before it is timed."""

from dataclasses import dataclass

import torch

import edgedot

from .attention import AttentionCase, PathMaker, forward_backward_bytes, gather_bytes, make_attention_set, ok_time
from .attention import ratio
from .attention_check import masked, sampled_subgraph, unfused_attention
from .cases import EDGE_ATTN_FORWARD, EDGE_ATTN_FORWARD_BACKWARD, TOLERANCE, rotating_sets
from .timing import NotApplicable, first_line, progress, run_section

__all__ = ["EdgeAttentionCase", "EDGE_ATTENTION_CASES", "run_edge_attention_case"]


@dataclass(frozen=True)
class EdgeAttentionCase(AttentionCase):
    """An attention case whose edges carry ``[E, H, D]`` features."""


EDGE_ATTENTION_CASES = [
    EdgeAttentionCase("edge_attn_arxiv_f16", 169_343, 1_166_243, torch.float16),
    EdgeAttentionCase("edge_attn_products_f16", 2_449_029, 30_000_000, torch.float16),
]


def edge_bytes(case):
    """The edge features' bytes, ``[E, H, D]``: the forward reads them once; the backward reads them
    in both passes (they are in the score) and writes their gradient once."""
    return case.num_edges * case.heads * case.dim * case.dtype.itemsize


@dataclass
class EdgeCheck:
    """The float64 expected output and gradients on the sampled subgraph of input set 0."""

    rows: torch.Tensor
    num_edges: int
    out: torch.Tensor
    grad_out: torch.Tensor = None
    grads: dict = None  # input set attribute -> (rows, float64 gradient)

    def describe(self):
        return {"dst_nodes": self.rows.numel(), "edges": self.num_edges}


def expected_edge_attention(case, inputs, with_grads):
    rows, edges, src_rows, src_local, dst_local = sampled_subgraph(case, inputs)

    def leaf(t):
        return t.detach().double().requires_grad_(with_grads)

    q, k, v, e = leaf(inputs.q[rows]), leaf(inputs.k[src_rows]), leaf(inputs.v[src_rows]), leaf(inputs.e[edges])
    out = edgedot.graph_attention_reference(q, k, v, src_local, dst_local, scale=case.dim ** -0.5, edge_feat=e)[0]
    check = EdgeCheck(rows, edges.numel(), out.detach())
    if with_grads:
        check.grad_out = masked(inputs.grad_out, rows)
        out.backward(check.grad_out[rows].double())
        check.grads = {"q": (rows, q.grad), "k": (src_rows, k.grad), "v": (src_rows, v.grad), "e": (edges, e.grad)}
    return check


def make_edge_attention_set(case, device, seed):
    """An attention set (:func:`~.attention.make_attention_set`) with edge features ``e``."""
    inputs = make_attention_set(case, device, seed)
    generator = torch.Generator(device).manual_seed(seed + 7919)
    inputs.e = torch.randn((case.num_edges, case.heads, case.dim), generator=generator, device=device,
                           dtype=case.dtype)
    return inputs


def edge_attention_paths(case, sets, check, compiled, backward):
    paths = PathMaker(case, sets, check, None, backward, leaves=[s.e for s in sets])
    scale = case.dim ** -0.5

    def edgedot_op(grouped):
        def make():
            def call(i):
                s = sets[i]
                return edgedot.graph_attention(s.q, s.k, s.v, s.src_idx, s.dst_idx, edge_feat=s.e,
                                               dst_ptr=s.dst_ptr if grouped else None)
            return paths.op_path(call)
        return make

    def compile_path():
        return paths.op_path(lambda i: compiled(sets[i].q, sets[i].k, sets[i].v, sets[i].src_idx, sets[i].dst_idx,
                                                scale, sets[i].e))

    def anemoi():
        if sets[0].q.device.type != "cuda":
            raise NotApplicable("a Triton kernel: CUDA only")
        try:
            from anemoi.models.triton import gt
        except Exception as error:  # not installed, or Triton missing
            raise NotApplicable(f"anemoi.models.triton.gt does not import: {first_line(error)}") from None
        graphs = [_anemoi_graph(s, case.num_nodes) for s in sets]

        def call(i):
            s = sets[i]
            csc, reverse = graphs[i]
            return gt.graph_transformer_attention_conv(s.q, s.k, s.v, s.e, csc, reverse)
        return paths.op_path(call)

    return {"edgedot": edgedot_op(True), "edgedot_default": edgedot_op(False), "compile": compile_path,
            "anemoi": anemoi}


def _anemoi_graph(inputs, num_nodes):
    """The adjacency anemoi's kernel takes for edges sorted by destination: ``(row, colptr)``, the
    sources in that order and the destinations' pointer, and ``(rowptr, edge_ids, edge_dst)``, the
    sources' pointer, the edges in source order and each edge's destination."""
    src, dst = inputs.src_idx.long(), inputs.dst_idx.long()
    by_src = torch.argsort(src, stable=True)
    rowptr = edgedot.index_to_ptr(src[by_src], num_nodes)
    return (src, inputs.dst_ptr.long()), (rowptr, by_src, dst)


def run_edge_attention_case(case, device, clock, settings, with_backward, bandwidths):
    """Checks and times every path of one case; returns its record (the JSON's)."""
    copy_bw = bandwidths["copy"]
    progress(f"{case.name}: making inputs")
    sets = rotating_sets(lambda seed: make_edge_attention_set(case, device, seed), device, settings)
    check = expected_edge_attention(case, sets[0], with_backward)
    moved = gather_bytes(case) + edge_bytes(case)
    moved_both = forward_backward_bytes(case) + 4 * edge_bytes(case)
    bound_us = 1e6 * moved / copy_bw if copy_bw else None
    both_bound_us = 1e6 * moved_both / copy_bw if copy_bw else None
    record = {"kind": "edge_attention", "config": case.describe(), "input_sets": len(sets),
              "check": check.describe(), "bytes": {EDGE_ATTN_FORWARD: moved, EDGE_ATTN_FORWARD_BACKWARD: moved_both},
              "bound_us": bound_us, "forward_backward_bound_us": both_bound_us}
    options = dict(tolerance=TOLERANCE[case.dtype], num_sets=len(sets), clock=clock, settings=settings,
                   baselines=("compile", "anemoi"))
    torch._dynamo.reset()
    compiled = torch.compile(unfused_attention, dynamic=False)
    record[EDGE_ATTN_FORWARD] = run_section("edge attention forward",
                                            edge_attention_paths(case, sets, check, compiled, backward=False),
                                            moved, copy_bw, **options)
    if with_backward:
        for inputs in sets:
            inputs.requires_grad_()
            inputs.e.requires_grad_()
        record[EDGE_ATTN_FORWARD_BACKWARD] = run_section(
            "edge attention forward+backward", edge_attention_paths(case, sets, check, compiled, backward=True),
            moved_both, copy_bw, **options)
    for section, bound in ((EDGE_ATTN_FORWARD, bound_us), (EDGE_ATTN_FORWARD_BACKWARD, both_bound_us)):
        for path, result in record.get(section, {}).items():
            if result["status"] == "ok":
                result["vs_bound"] = ratio(result["median_us"], bound)
                if section == EDGE_ATTN_FORWARD_BACKWARD:
                    result["vs_forward"] = ratio(result["median_us"], ok_time(record[EDGE_ATTN_FORWARD], path))
    return record
