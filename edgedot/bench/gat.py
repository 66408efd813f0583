"""The GAT / GATv2 benchmark: :func:`edgedot.gat_attention` / :func:`edgedot.gatv2_attention`
(``edgedot``: edges given grouped by ``dst_ptr``; ``edgedot_plan``: an ``EdgePlan`` per input
set, built outside timing), ``edgedot.nn.GATConv`` / ``GATv2Conv``
(``edgedot_layer`` on a ``[2, E]`` tensor, ``edgedot_sorted`` on an ``EdgeIndex`` sorted by
destination, whose row pointer spares the kernel its sort), PyG's layers (``pyg``),
``torch.compile`` of the unfused PyG-style math (``compile``) and, when it is installed,
Turbo-GNN's fused ``gatv2_aggr`` (``turbo``), forward and forward+backward, on the attention
benchmark's graphs (``bench.attention``'s cases and input sets): ogbn-products' size (uniform,
30M edges), R-MAT beside its uniform twin, and sampled mini-batches with a new graph every
call; 4 heads of 32, 128 input features.

The layers run with ``add_self_loops=False`` (the graphs are what a sampler or a preprocessed
dataset hands over; PyG's self-loop handling, the same in both, would add its own cost to both).
The op paths take ``x = v`` and the logits ``a_src``, ``a_dst`` (GAT: copies of ``k[..., 0]`` and
``q[..., 0]``, leaves of their own) or ``x_src = k``, ``x_dst = q`` and a fixed ``att`` (GATv2) of
the input sets. Every path is checked first against
a float64 reference on a sample of destination nodes (``bench.attention_check``'s sampling),
outputs and gradients, then timed (CUDA-event medians).
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import edgedot

from .attention import (MINIBATCHES, SMALL, AttentionCase, PathMaker, make_attention_set, ok_time, ratio,
                        shrunk_attention)
from .attention_check import masked, sampled_subgraph, summed_rows
from .cases import GAT_FORWARD, GAT_FORWARD_BACKWARD, TOLERANCE, rotating_sets
from .timing import FRESH_GRAPH_ROUNDS, NotApplicable, progress, run_section

__all__ = ["GATCase", "GAT_CASES", "run_gat_case", "shrunk_gat", "add_gat_power_law_ratios", "unfused_gat"]

NEGATIVE_SLOPE = 0.2


@dataclass(frozen=True)
class GATCase(AttentionCase):
    """An attention case (its graph, sizes and dtype) for PyG's ``GATConv`` (``conv="gat"``) or
    ``GATv2Conv`` (``conv="gatv2"``)."""

    conv: str = "gat"

    def describe(self):
        return dict(super().describe(), conv=self.conv)


PRODUCTS = dict(num_nodes=2_449_029, num_edges=30_000_000, dtype=torch.bfloat16)
RMAT20 = dict(num_nodes=2**20, num_edges=8 * 2**20, dtype=torch.bfloat16)
GAT_CASES = [
    case
    for conv in ("gat", "gatv2")
    for case in (
        GATCase(f"{conv}_products_bf16", **PRODUCTS, conv=conv),
        GATCase(f"{conv}_rmat20_bf16", **RMAT20, graph="rmat", twin=f"{conv}_uniform20_bf16", conv=conv),
        GATCase(f"{conv}_uniform20_bf16", **RMAT20, conv=conv),
        *(GATCase(f"{conv}_{name}", **shape, conv=conv) for name, shape in MINIBATCHES.items()),
        GATCase(f"{conv}_20k_f32", **SMALL, dtype=torch.float32, conv=conv),
    )
] + [GATCase("gatv2_ogbn_products_bf16", num_nodes=2_449_029, num_edges=123_718_280, dtype=torch.bfloat16,
             conv="gatv2")]  # the real ogbn-products' size: the memory a layer needs there


def shrunk_gat(case):
    """The case at about ``QUICK_EDGES`` edges (``--quick``), as the attention cases shrink."""
    return shrunk_attention(case)


def forward_backward_bytes(case):
    """Least bytes of the forward and a deterministic two-pass backward: the forward's, the
    destination pass (each edge's source row and indices; each node's grad_out and out rows read,
    for GATv2 also x_dst read and dx_dst written, and each edge's record for the source pass
    written: alpha and ds in float32 and a bit per element for the sign of m, per head) and the
    source pass (each edge's destination grad_out row and indices, for GATv2 also the edge's
    record; each node's source row read and its gradient written)."""
    row = case.heads * case.dim * case.dtype.itemsize
    gatv2 = case.conv == "gatv2"
    record = case.heads * (8 + case.dim // 8) if gatv2 else 0
    per_edge = 2 * row + 2 * record + 4 * case.index_dtype.itemsize
    return gather_bytes(case) + case.num_edges * per_edge + case.num_nodes * (6 if gatv2 else 4) * row


def gather_bytes(case):
    """Least bytes of the forward over edges grouped by destination: each edge's source row and
    its two indices, each node's output row and, for GATv2, its x_dst row (read once per
    destination)."""
    row = case.heads * case.dim * case.dtype.itemsize
    node_rows = 2 if case.conv == "gatv2" else 1
    return case.num_edges * (row + 2 * case.index_dtype.itemsize) + case.num_nodes * node_rows * row


# --------------------------------------------------------------------------- the unfused math

def _softmax_aggregate(score, values, dst, num_dst):
    """PyG's scatter softmax over each destination's edges, then the weighted sum of ``values``
    (all in the accumulation dtype)."""
    heads = score.shape[1]
    top = torch.full((num_dst, heads), -math.inf, dtype=score.dtype, device=score.device)
    top = top.scatter_reduce(0, dst[:, None].expand(-1, heads), score.detach(), "amax")
    weight = torch.exp(score - top[dst])
    total = torch.zeros((num_dst, heads), dtype=score.dtype, device=score.device).index_add(0, dst, weight)
    alpha = weight / total[dst]
    out = torch.zeros((num_dst, heads, values.shape[-1]), dtype=score.dtype, device=score.device)
    return out.index_add(0, dst, alpha[..., None] * values)


def unfused_gat(conv, x, a_or_x_dst, b_or_att, src_idx, dst_idx, negative_slope=NEGATIVE_SLOPE):
    """GAT (``conv="gat"``: ``x``, ``a_src``, ``a_dst``) or GATv2 (``"gatv2"``: ``x_src``,
    ``x_dst``, ``att``) as PyG's layers compute it (the ``compile`` path compiles this): gathered
    ``[E, H, C]`` rows, scatter softmax, ``index_add``; in float32 at least."""
    src, dst = src_idx.long(), dst_idx.long()
    dtype, acc = x.dtype, torch.promote_types(x.dtype, torch.float32)
    values = x.to(acc)[src]
    if conv == "gat":
        a_src, a_dst = a_or_x_dst, b_or_att
        num_dst = a_dst.shape[0]
        score = F.leaky_relu(a_src.to(acc)[src] + a_dst.to(acc)[dst], negative_slope)
    else:
        x_dst, att = a_or_x_dst, b_or_att
        num_dst = x_dst.shape[0]
        score = (F.leaky_relu(values + x_dst.to(acc)[dst], negative_slope) * att.to(acc)).sum(-1)
    return _softmax_aggregate(score, values, dst, num_dst).to(dtype)


# --------------------------------------------------------------------------- weights and check

def _layer_classes(conv):
    """(edgedot's layer class, PyG's layer class or None)."""
    ours = edgedot.nn.GATConv if conv == "gat" else edgedot.nn.GATv2Conv
    try:
        from torch_geometric.nn import GATConv, GATv2Conv
    except ImportError:
        return ours, None
    return ours, GATConv if conv == "gat" else GATv2Conv


def make_layer(layer_class, case):
    return layer_class(case.in_channels, case.dim, heads=case.heads, add_self_loops=False)


def gat_weights(case, device):
    """Seeded weights of every parameter of the case's layer (uniform in the projection's
    ``1/sqrt(fan_in)``, the bias too, so that it counts), in the case's dtype."""
    generator = torch.Generator(device).manual_seed(99)
    template = make_layer(_layer_classes(case.conv)[0], case)
    weights = {}
    for name, param in template.named_parameters():
        uniform = torch.rand(param.shape, generator=generator, device=device, dtype=torch.float64)
        weights[name] = ((2 * uniform - 1) / math.sqrt(case.in_channels)).to(case.dtype)
    return weights


def op_inputs(case, s, att):
    """The op's tensors of input set ``s`` (see the module)."""
    if case.conv == "gat":
        return s.v, s.a_src, s.a_dst
    return s.k, s.q, att


def op_att(case, device):
    """GATv2's fixed ``att`` ``[H, C]`` of the op paths (a leaf: its gradient is computed too)."""
    generator = torch.Generator(device).manual_seed(7)
    att = torch.randn(case.heads, case.dim, generator=generator, device=device, dtype=torch.float64)
    return (att / math.sqrt(case.dim)).to(case.dtype)


@dataclass
class GATCheck:
    """What the paths of one case are checked against (input set 0, float64, at ``rows``)."""

    rows: torch.Tensor
    num_edges: int
    out: torch.Tensor
    layer_out: torch.Tensor
    grad_out: torch.Tensor = None
    layer_grad_out: torch.Tensor = None
    grads: dict = None          # input set attribute -> (rows or None, float64 gradient)
    x_grad: tuple = None
    weight_grads: dict = None

    def describe(self):
        return {"dst_nodes": self.rows.numel(), "edges": self.num_edges}


def expected_gat(case, inputs, weights, att, with_grads):
    """The float64 reference of the op and of the layer on the subgraph of the edges into a
    sample of destination nodes; with a ``grad_out`` zero outside the sample, every gradient
    depends on that subgraph only."""
    rows, edges, src_rows, src_local, dst_local = sampled_subgraph(case, inputs)
    heads, dim = case.heads, case.dim

    def leaf(t):
        return t.detach().double().requires_grad_(with_grads)

    # The rows the sample reads (gradients are zero elsewhere).
    q, k, v = leaf(inputs.q[rows]), leaf(inputs.k[src_rows]), leaf(inputs.v[src_rows])
    if case.conv == "gat":
        out = edgedot.gat_attention_reference(v, k[..., 0], q[..., 0], src_local, dst_local,
                                              negative_slope=NEGATIVE_SLOPE)[0]
    else:
        out = edgedot.gatv2_attention_reference(k, q, att.detach().double(), src_local, dst_local,
                                                negative_slope=NEGATIVE_SLOPE)[0]
    check = GATCheck(rows, edges.numel(), out.detach(), None, grads={}, weight_grads={})
    if with_grads:
        check.grad_out = masked(inputs.grad_out, rows)
        out.backward(check.grad_out[rows].double())
        if case.conv == "gat":  # the logits' gradients: k's and q's first channel
            check.grads = {"a_dst": (rows, q.grad[..., 0]), "a_src": (src_rows, k.grad[..., 0]),
                           "v": (src_rows, v.grad)}
        else:
            check.grads = {"q": (rows, q.grad), "k": (src_rows, k.grad)}

    params = {name: leaf(w) for name, w in weights.items()}
    x_dst, x_src = leaf(inputs.x[rows]), leaf(inputs.x[src_rows])

    def project(lin, x):
        bias = params.get(f"{lin}.bias")
        return F.linear(x, params[f"{lin}.weight"], bias).view(x.shape[0], heads, dim)

    if case.conv == "gat":
        xs, xd = project("lin", x_src), project("lin", x_dst)
        layer_out = edgedot.gat_attention_reference(xs, (xs * params["att_src"]).sum(-1),
                                                    (xd * params["att_dst"]).sum(-1), src_local, dst_local,
                                                    negative_slope=NEGATIVE_SLOPE)[0]
    else:
        layer_out = edgedot.gatv2_attention_reference(project("lin_l", x_src), project("lin_r", x_dst),
                                                      params["att"].view(heads, dim), src_local, dst_local,
                                                      negative_slope=NEGATIVE_SLOPE)[0]
    layer_out = layer_out.reshape(rows.numel(), heads * dim) + params["bias"]
    check.layer_out = layer_out.detach()
    if with_grads:
        check.layer_grad_out = masked(inputs.grad_layer, rows)
        layer_out.backward(check.layer_grad_out[rows].double())
        check.x_grad = summed_rows([(rows, x_dst.grad), (src_rows, x_src.grad)])
        check.weight_grads = {name: p.grad for name, p in params.items()}
    return check


# --------------------------------------------------------------------------- the paths

def gat_paths(case, sets, check, compiled, weights, att, backward):
    """Path makers of one section (see :class:`~.attention.PathMaker`; resets clear ``att``'s
    gradient too)."""
    ours_class, pyg_class = _layer_classes(case.conv)
    op = edgedot.gat_attention if case.conv == "gat" else edgedot.gatv2_attention
    paths = PathMaker(case, sets, check, weights, backward, leaves=(att,))
    graph, op_path, layer_path = paths.graph, paths.op_path, paths.layer_path

    def edgedot_op():
        def call(i):
            _, src, dst, ptr = graph(i)
            return op(*op_inputs(case, sets[i], att), src, dst, negative_slope=NEGATIVE_SLOPE, dst_ptr=ptr)
        return op_path(call)

    def edgedot_plan():
        plans = paths.plans()

        def call(i):
            _, src, dst, _ = graph(i)
            return op(*op_inputs(case, sets[i], att), src, dst, negative_slope=NEGATIVE_SLOPE, plan=plans[i])
        return op_path(call)

    def edgedot_layer():
        return layer_path(make_layer(ours_class, case))

    def edgedot_layer_sorted():
        try:
            from torch_geometric import EdgeIndex
        except ImportError:
            raise NotApplicable("an EdgeIndex needs torch_geometric") from None
        n = case.num_nodes

        def sorted_index(i):  # PyG's sorted form of the graph; its row pointer is made once per object
            return EdgeIndex(graph(i)[0], sparse_size=(n, n), sort_order="col")
        made = None if case.fresh_graph else [sorted_index(i) for i in range(len(sets))]
        return layer_path(make_layer(ours_class, case), adjacency=lambda i: made[i] if made else sorted_index(i))

    def pyg_layer():
        if pyg_class is None:
            raise NotApplicable("torch_geometric is not installed")
        # A baseline: timed even where its half-precision sums miss the tolerance (marked).
        return layer_path(make_layer(pyg_class, case), strict=False)

    def compile_path():
        return op_path(lambda i: compiled(case.conv, *op_inputs(case, sets[i], att), *graph(i)[1:3]))

    def turbo():
        if case.conv != "gatv2":
            raise NotApplicable("Turbo-GNN has no GAT (v1) kernel")
        try:
            import turbo_gnn
        except ImportError:
            raise NotApplicable("turbo_gnn is not installed") from None
        aggregate = getattr(turbo_gnn, "gatv2_aggr", None)
        if aggregate is None:
            raise NotApplicable("this turbo_gnn has no gatv2_aggr")
        graph_of = paths.turbo_graphs(turbo_gnn)

        def call(i):  # x: the destinations' rows, x_neighbors: the sources' (values), [N, H * C] out
            return aggregate(graph_of(i), sets[i].q, x_neighbors=sets[i].k, attention_weights=att,
                             negative_slope=NEGATIVE_SLOPE).view(sets[i].q.shape)
        return op_path(call)

    return {
        "edgedot": edgedot_op,
        "edgedot_plan": edgedot_plan,
        "edgedot_layer": edgedot_layer,
        "edgedot_sorted": edgedot_layer_sorted,
        "pyg": pyg_layer,
        "compile": compile_path,
        "turbo": turbo,
    }


# --------------------------------------------------------------------------- one case

def run_gat_case(case, device, clock, settings, with_backward, bandwidths):
    """Checks and times every path of one case; returns its record (the JSON's)."""
    copy_bw = bandwidths["copy"]
    progress(f"{case.name}: making inputs")
    sets = rotating_sets(lambda seed: make_attention_set(case, device, seed), device, settings)
    weights = gat_weights(case, device)
    att = op_att(case, device)
    check = expected_gat(case, sets[0], weights, att, with_backward)
    moved, moved_both = gather_bytes(case), forward_backward_bytes(case)
    bound_us = 1e6 * moved / copy_bw if copy_bw else None
    both_bound_us = 1e6 * moved_both / copy_bw if copy_bw else None
    record = {"kind": "gat", "config": case.describe(), "input_sets": len(sets), "check": check.describe(),
              "bytes": {GAT_FORWARD: moved, GAT_FORWARD_BACKWARD: moved_both}, "bound_us": bound_us,
              "forward_backward_bound_us": both_bound_us}
    options = dict(tolerance=TOLERANCE[case.dtype], num_sets=len(sets), clock=clock, settings=settings,
                   baselines=("compile", "pyg", "turbo"), rounds=FRESH_GRAPH_ROUNDS if case.fresh_graph else 1)
    torch._dynamo.reset()
    compiled = torch.compile(unfused_gat, dynamic=False)
    record[GAT_FORWARD] = run_section(f"{case.conv} forward", gat_paths(case, sets, check, compiled, weights, att,
                                                                      backward=False),
                                      moved, copy_bw, **options)
    if with_backward:
        for inputs in sets:
            inputs.requires_grad_()
        att.requires_grad_()
        record[GAT_FORWARD_BACKWARD] = run_section(
            f"{case.conv} forward+backward", gat_paths(case, sets, check, compiled, weights, att, backward=True),
            moved_both, copy_bw, **options)
    for path, result in record[GAT_FORWARD].items():
        if result["status"] == "ok":
            result["vs_bound"] = ratio(result["median_us"], bound_us)
    for path, result in record.get(GAT_FORWARD_BACKWARD, {}).items():
        if result["status"] == "ok":
            result["vs_forward"] = ratio(result["median_us"], ok_time(record[GAT_FORWARD], path))
            result["vs_bound"] = ratio(result["median_us"], both_bound_us)
    return record


def add_gat_power_law_ratios(records):
    """For each power-law GAT case whose uniform twin was run too: every path's time over the
    twin's, forward and forward+backward (``vs_uniform_twin`` of the record)."""
    for record in records.values():
        twin = records.get(record.get("config", {}).get("twin") or "")
        if record.get("kind") != "gat" or twin is None:
            continue
        record["vs_uniform_twin"] = {
            f"{section}/{path}": ratio(ok_time(record[section], path), ok_time(twin.get(section, {}), path))
            for section in (GAT_FORWARD, GAT_FORWARD_BACKWARD) for path in record.get(section, {})}

