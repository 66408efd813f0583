"""The graph-attention benchmark: ``edgedot.graph_attention`` (default, deterministic, with a
plan, with the edges given grouped by ``dst_ptr``), ``edgedot.nn.TransformerConv``, PyG's
``TransformerConv``, ``torch.compile`` of the unfused math and, when it is installed, Turbo-GNN's
fused ``graph_transformer_aggr``, forward and forward+backward, on graphs of the sizes of
ogbn-arxiv, ogbn-products and Reddit (uniform random edges sorted by destination, 4 heads of 32,
128 input features), on power-law graphs (R-MAT, and arxiv's size plus one node of 2M incoming
edges) beside uniform graphs of the same size, and on sampled mini-batches with a new graph every
call."""

import math
from dataclasses import asdict, dataclass, replace
from typing import Optional

import torch

import edgedot

from .attention_check import LINEARS, expected_attention, rows_error, unfused_attention, weights_error
from .cases import ATTN_FORWARD, ATTN_FORWARD_BACKWARD, QUICK_EDGES, TOLERANCE, dtype_name, rotating_sets
from .graphs import rmat_edges, sorted_by_src, uniform_edges
from .timing import FRESH_GRAPH_ROUNDS, BenchPath, NotApplicable, progress, relative_error, run_section

GB = 10**9


@dataclass(frozen=True)
class AttentionCase:
    """One attention problem: ``num_nodes`` nodes on both sides, targets (for an NVIDIA H200) from
    the issue."""

    name: str
    num_nodes: int
    num_edges: int
    dtype: torch.dtype
    target_forward_us: Optional[float] = None
    target_forward_backward_us: Optional[float] = None
    memory_budget_bytes: Optional[int] = None  # forward+backward extra memory the op must fit in
    heads: int = 4
    dim: int = 32
    in_channels: int = 128
    index_dtype: torch.dtype = torch.int64      # PyG's edge_index
    graph: str = "uniform"       # "uniform", "rmat", "hub" (uniform plus one node of hub_edges in-edges),
    hub_edges: int = 0           # or "minibatch" (seeds x fanout in-edges from any node)
    seeds: int = 0
    fresh_graph: bool = False    # every timed call gets new index tensors (a new mini-batch)
    twin: Optional[str] = None   # the uniform case of equal size, for the power-law ratio

    def describe(self):
        fields = asdict(self)
        fields["dtype"] = dtype_name(self.dtype)
        fields["index_dtype"] = dtype_name(self.index_dtype)
        return fields


# Sampled mini-batches (PyG's NeighborLoader: 16,384 seeds, each with `fanout` in-edges from any of
# 180,224 nodes), a new graph every call: fan-outs 5, 10 and 25 in float32, and 10 in bfloat16.
SEEDS = 16_384


def minibatch(fanout, dtype):
    """The shape of a sampled mini-batch case of ``fanout`` in-edges a seed."""
    return dict(num_nodes=SEEDS * 11, num_edges=SEEDS * fanout, dtype=dtype, graph="minibatch", seeds=SEEDS,
                fresh_graph=True)


MINIBATCHES = {"minibatch_f32": minibatch(10, torch.float32), "minibatch_fan5_f32": minibatch(5, torch.float32),
               "minibatch_fan25_f32": minibatch(25, torch.float32), "minibatch_bf16": minibatch(10, torch.bfloat16)}

ARXIV = dict(num_nodes=169_343, num_edges=1_166_243)
# A graph a laptop trains on (the CPU comparison with PyG's layers; seconds on a GPU).
SMALL = dict(num_nodes=20_000, num_edges=400_000)
ATTENTION_CASES = [
    AttentionCase("attn_arxiv_f32", **ARXIV, dtype=torch.float32, target_forward_us=450,
                  target_forward_backward_us=1300),
    AttentionCase("attn_arxiv_bf16", **ARXIV, dtype=torch.bfloat16, target_forward_us=250,
                  target_forward_backward_us=750),
    AttentionCase("attn_products_bf16", 2_449_029, 30_000_000, torch.bfloat16, 6000, 18000),
    AttentionCase("attn_reddit_bf16", 232_965, 114_615_892, torch.bfloat16, 21000, 63000,
                  memory_budget_bytes=10 * GB),
    AttentionCase("attn_rmat20_bf16", 2**20, 8 * 2**20, torch.bfloat16, graph="rmat", twin="attn_uniform20_bf16"),
    AttentionCase("attn_uniform20_bf16", 2**20, 8 * 2**20, torch.bfloat16),
    AttentionCase("attn_arxiv_hub_bf16", ARXIV["num_nodes"], ARXIV["num_edges"] + 2_000_000, torch.bfloat16,
                  graph="hub", hub_edges=2_000_000, twin="attn_arxiv_3m_bf16"),
    AttentionCase("attn_arxiv_3m_bf16", ARXIV["num_nodes"], ARXIV["num_edges"] + 2_000_000, torch.bfloat16),
] + [AttentionCase(f"attn_{name}", **shape) for name, shape in MINIBATCHES.items()] + [
    AttentionCase("attn_20k_f32", **SMALL, dtype=torch.float32)]

# Power-law graphs against the uniform graph of the same size (``twin``), edgedot's paths.
MAX_POWER_LAW_VS_UNIFORM = 1.3

# The card the targets were set for: other devices, and --quick runs, print them unscored.
TARGET_DEVICE = "H200"


def targets_apply(device_name, quick):
    """Whether a run on ``device_name`` (``"cpu"`` or the CUDA device's name) is scored against the
    targets: full-size cases on the card they were set for."""
    return TARGET_DEVICE in device_name and not quick


# Issue targets on the ratios (see ``targets``).
MAX_FORWARD_VS_BOUND = 1.5
MAX_FORWARD_BACKWARD_VS_FORWARD = 3.0
MAX_DETERMINISTIC_VS_DEFAULT = 1.2


def shrunk_attention(case):
    """The case with nodes and edges divided by one factor, down to about ``QUICK_EDGES`` edges."""
    factor = max(1, case.num_edges // QUICK_EDGES)
    num_nodes = max(1, case.num_nodes // factor)
    if case.graph == "rmat":  # a power of two
        num_nodes = 1 << max(1, num_nodes.bit_length() - 1)
    return replace(case, num_nodes=num_nodes, num_edges=case.num_edges // factor,
                   hub_edges=case.hub_edges // factor, seeds=max(1, case.seeds // factor) if case.seeds else 0)


def gather_bytes(case):
    """Least bytes of the forward: each edge's k and v rows and its two indices, each node's q
    row and output row."""
    row = case.heads * case.dim * case.dtype.itemsize
    return case.num_edges * (2 * row + 2 * case.index_dtype.itemsize) + case.num_nodes * 2 * row


def forward_backward_bytes(case):
    """Least bytes of the forward and a deterministic backward by recomputation (two passes over
    the edges, no float atomics): the forward's, then the destination pass (each edge's k and v
    rows and indices; each node's q, grad_out and out rows read, dq written) and the source pass
    (each edge's destination q and grad_out rows and indices; each node's k, v read, dk, dv
    written)."""
    row = case.heads * case.dim * case.dtype.itemsize
    per_pass = case.num_edges * (2 * row + 2 * case.index_dtype.itemsize)
    return gather_bytes(case) + 2 * per_pass + case.num_nodes * 8 * row


# --------------------------------------------------------------------------- inputs

@dataclass
class AttentionSet:
    """One input set of an attention case (all paths' inputs and gradients of the output)."""

    x: torch.Tensor            # [N, in_channels], the layers' input
    q: torch.Tensor            # [N, H, D], the op's inputs
    k: torch.Tensor
    v: torch.Tensor
    edge_index: torch.Tensor   # [2, E], sources in row 0, sorted by destination
    grad_out: torch.Tensor     # [N, H, D], the op's
    grad_layer: torch.Tensor   # [N, H * D], the layers'
    dst_ptr: Optional[torch.Tensor] = None  # CSR pointer of the destinations

    def __post_init__(self):
        self.src_idx, self.dst_idx = self.edge_index[0], self.edge_index[1]  # the same objects every call
        if self.dst_ptr is None:
            self.dst_ptr = edgedot.index_to_ptr(self.dst_idx, self.q.shape[0])
        # GAT's per-node logits [N, H] (k's and q's first channel, as tensors of their own): a view
        # of k or q would make every backward zero-fill a [N, H, D] gradient for it (select's
        # backward), a cost of the harness in every path's time, not of any path.
        self.a_src, self.a_dst = self.k[..., 0].detach().clone(), self.q[..., 0].detach().clone()

    def leaves(self):
        return (self.x, self.q, self.k, self.v, self.a_src, self.a_dst)

    def nbytes(self):
        return sum(t.nbytes for t in (self.x, self.q, self.k, self.v, self.a_src, self.a_dst, self.edge_index,
                                      self.grad_out, self.grad_layer))

    def clear_grads(self):
        for t in self.leaves():
            t.grad = None

    def requires_grad_(self):
        for t in self.leaves():
            t.requires_grad_()


def case_edges(case, generator):
    """The case's random edges (``case.graph``), int64, in random order."""
    n = case.num_nodes
    if case.graph == "rmat":
        return rmat_edges(n.bit_length() - 1, case.num_edges, generator)
    if case.graph == "minibatch":  # each seed (nodes 0 .. seeds-1) gets the same number of in-edges
        dst = torch.arange(case.seeds, device=generator.device).repeat_interleave(case.num_edges // case.seeds)
        src = torch.randint(n, (dst.shape[0],), generator=generator, device=generator.device)
        return src, dst
    src, dst = uniform_edges(n, n, case.num_edges, generator)
    if case.graph == "hub":
        dst[:case.hub_edges] = int(torch.randint(n, (), generator=generator, device=generator.device))
    return src, dst


def make_attention_set(case, device, seed):
    """The case's edges sorted by destination and normal features, drawn from ``seed``."""
    generator = torch.Generator(device).manual_seed(seed)
    src, dst = case_edges(case, generator)
    dst, src = sorted_by_src(dst, src)
    edge_index = torch.stack([src, dst]).to(case.index_dtype)
    del src, dst

    def normal(*shape):
        return torch.randn(shape, generator=generator, device=device, dtype=case.dtype)

    n, h, d = case.num_nodes, case.heads, case.dim
    return AttentionSet(normal(n, case.in_channels), normal(n, h, d), normal(n, h, d), normal(n, h, d),
                        edge_index, normal(n, h, d), normal(n, h * d))


def layer_weights(case, device):
    """Seeded weights of the layers' projections (``torch.nn.Linear``'s initialisation), in the
    case's dtype, shared by edgedot's and PyG's layer and by the reference."""
    generator = torch.Generator(device).manual_seed(99)
    bound = 1 / math.sqrt(case.in_channels)
    width = case.heads * case.dim
    weights = {}
    for lin in (*LINEARS, "lin_skip"):  # lin_skip: built by both layers, unused without root_weight
        for name, shape in ((f"{lin}.weight", (width, case.in_channels)), (f"{lin}.bias", (width,))):
            uniform = torch.rand(shape, generator=generator, device=device, dtype=torch.float64)
            weights[name] = ((2 * uniform - 1) * bound).to(case.dtype)
    return weights


def load_weights(layer, weights):
    """Copies ``weights`` into the layer's parameters of the same names (each must have one)."""
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if name not in weights:
                raise KeyError(f"the benchmark has no weights for parameter {name}")
            param.copy_(weights[name])


# --------------------------------------------------------------------------- the paths

class PathMaker:
    """What the paths of one section share: the graph of input set ``i`` as a call receives it,
    and the checked, timed call of an op or a layer. ``backward``: each timed call is
    ``out.backward(grad)`` too; ``leaves``: more tensors whose gradients a reset clears."""

    def __init__(self, case, sets, check, weights, backward, leaves=()):
        self.case, self.sets, self.check, self.weights, self.backward = case, sets, check, weights, backward
        self.leaves = leaves
        self.device = sets[0].x.device

    def graph(self, i):
        """(edge_index, src_idx, dst_idx, dst_ptr) of set i, as a call receives them: with
        ``case.fresh_graph`` new copies of the index tensors every call (a new mini-batch:
        nothing remembered about the last one helps)."""
        s = self.sets[i]
        if not self.case.fresh_graph:
            return s.edge_index, s.src_idx, s.dst_idx, s.dst_ptr
        edge_index = s.edge_index.clone()
        return edge_index, edge_index[0], edge_index[1], s.dst_ptr.clone()

    def plans(self):
        """An :class:`edgedot.EdgePlan` per input set, built here (outside any timing); n/a for a
        case with a new graph every call."""
        if self.case.fresh_graph:
            raise NotApplicable("a plan is for a static graph")
        n = self.case.num_nodes
        return [edgedot.EdgePlan(s.src_idx, s.dst_idx, n, n) for s in self.sets]

    def clear(self, i):
        """Drops the gradients of set i's inputs and of the leaves."""
        self.sets[i].clear_grads()
        for t in self.leaves:
            t.grad = None

    def _checked(self, forward, grad, want, extra_errors, reset):
        """The largest error of ``forward(0)`` against ``want`` at the check's rows, its backward
        from ``grad`` and the errors ``extra_errors()`` then tells; gradients reset around it."""
        reset(0)
        out = forward(0)
        out.backward(grad)
        errors = [relative_error(out[self.check.rows], want)] + extra_errors()
        reset(0)
        return max(errors)

    def _timed(self, forward, grad_of):
        def call(i):
            out = forward(i)
            out.backward(grad_of(self.sets[i]))
            return out
        return call

    def op_path(self, call_op):
        """The path of ``call_op(i)``, an op's output ``[N, H, D]`` on set i."""
        check, sets = self.check, self.sets
        if not self.backward:
            return BenchPath(call_op, lambda out: relative_error(out[check.rows], check.out))

        def errors():
            return [rows_error(getattr(sets[0], name).grad, rows, want) for name, (rows, want) in check.grads.items()]

        def verify():
            return self._checked(call_op, check.grad_out, check.out, errors, self.clear)

        return BenchPath(self._timed(call_op, lambda s: s.grad_out), None, reset=self.clear, check=verify)

    def layer_path(self, layer, adjacency=None, strict=True):
        """The path of ``layer`` (given the benchmark's weights) on set i's features and
        ``adjacency(i)`` (by default the set's ``edge_index``)."""
        check, sets = self.check, self.sets
        layer = layer.to(device=self.device, dtype=self.case.dtype)
        load_weights(layer, self.weights)

        def forward(i):
            return layer(sets[i].x, adjacency(i) if adjacency else self.graph(i)[0])

        def reset(i):
            self.clear(i)
            layer.zero_grad(set_to_none=True)

        if not self.backward:
            def call(i):
                with torch.no_grad():
                    return forward(i)
            return BenchPath(call, lambda out: relative_error(out[check.rows], check.layer_out), strict=strict)

        def errors():
            return [rows_error(sets[0].x.grad, *check.x_grad),
                    weights_error({name: p.grad for name, p in layer.named_parameters()}, check.weight_grads)]

        def verify():
            return self._checked(forward, check.layer_grad_out, check.layer_out, errors, reset)

        return BenchPath(self._timed(forward, lambda s: s.grad_layer), None, reset=reset, check=verify, strict=strict)

    def turbo_graphs(self, turbo_gnn):
        """A function of i: set i's graph as Turbo-GNN's adjacency (built here for a static graph,
        in the call for a fresh one)."""
        adjacency = turbo_gnn.AdjacencyForwardBackwardWithNodeBuckets

        def build(edge_index):
            return adjacency.from_edge_list(edge_index, num_nodes=self.case.num_nodes).to(self.device)

        graphs = None if self.case.fresh_graph else [build(s.edge_index) for s in self.sets]
        return lambda i: graphs[i] if graphs else build(self.graph(i)[0])


def attention_paths(case, sets, check, compiled, weights, backward):
    """Path makers of one section (see :class:`PathMaker`)."""
    op = getattr(edgedot, "graph_attention", None)
    paths = PathMaker(case, sets, check, weights, backward)
    graph, op_path, layer_path = paths.graph, paths.op_path, paths.layer_path

    def edgedot_op(plans=False, grouped=False, **options):
        def make():
            if op is None:
                raise NotApplicable("edgedot.graph_attention is not available")
            plan_of = paths.plans() if plans else [None] * len(sets)

            def call(i):
                _, src, dst, ptr = graph(i)
                extra = {"dst_ptr": ptr} if grouped else {}
                return op(sets[i].q, sets[i].k, sets[i].v, src, dst, plan=plan_of[i], **extra, **options)
            return op_path(call)
        return make

    def edgedot_layer():
        layer_class = getattr(edgedot.nn, "TransformerConv", None)
        if layer_class is None:
            raise NotApplicable("edgedot.nn.TransformerConv is not available")
        return layer_path(layer_class(case.in_channels, case.dim, heads=case.heads, root_weight=False))

    def pyg_layer():
        try:
            from torch_geometric.nn import TransformerConv
        except ImportError:
            raise NotApplicable("torch_geometric is not installed") from None
        # A baseline: timed even where its half-precision sums miss the tolerance (marked).
        return layer_path(TransformerConv(case.in_channels, case.dim, heads=case.heads, root_weight=False),
                          strict=False)

    scale = case.dim ** -0.5

    def turbo():
        try:
            import turbo_gnn
        except ImportError:
            raise NotApplicable("turbo_gnn is not installed") from None
        graph_of = paths.turbo_graphs(turbo_gnn)

        def call(i):  # its score is Q[source] . K[destination]: our k and q
            return turbo_gnn.graph_transformer_aggr(graph_of(i), sets[i].x, Q=sets[i].k, K=sets[i].q, V=sets[i].v,
                                                    scale=scale).view(sets[i].q.shape)
        return op_path(call)

    return {
        "edgedot": edgedot_op(),
        "edgedot_det": edgedot_op(deterministic=True),
        "edgedot_plan": edgedot_op(plans=True),
        "edgedot_grouped": edgedot_op(grouped=True),
        # The same without the checks that wait for the device (a trusted loader's batches).
        "edgedot_grouped_unchecked": edgedot_op(grouped=True, check_indices=False),
        "edgedot_layer": edgedot_layer,
        "pyg": pyg_layer,
        "compile": lambda: op_path(lambda i: compiled(sets[i].q, sets[i].k, sets[i].v, *graph(i)[1:3], scale)),
        "turbo": turbo,
    }


# --------------------------------------------------------------------------- one case

def run_attention_case(case, device, clock, settings, with_backward, bandwidths):
    """Checks and times every attention path of one case; returns its record (the JSON's)."""
    copy_bw = bandwidths["copy"]
    progress(f"{case.name}: making inputs")
    sets = rotating_sets(lambda seed: make_attention_set(case, device, seed), device, settings)
    weights = layer_weights(case, device)
    check = expected_attention(case, sets[0], weights, with_backward)
    moved, moved_both = gather_bytes(case), forward_backward_bytes(case)
    bound_us = 1e6 * moved / copy_bw if copy_bw else None
    record = {"kind": "attention", "config": case.describe(), "input_sets": len(sets),
              "check": check.describe(), "bytes": {ATTN_FORWARD: moved, ATTN_FORWARD_BACKWARD: moved_both},
              "bound_us": bound_us, "forward_backward_bound_us": 1e6 * moved_both / copy_bw if copy_bw else None}
    options = dict(tolerance=TOLERANCE[case.dtype], num_sets=len(sets), clock=clock, settings=settings,
                   baselines=("compile", "pyg", "turbo"), rounds=FRESH_GRAPH_ROUNDS if case.fresh_graph else 1)
    torch._dynamo.reset()
    compiled = torch.compile(unfused_attention, dynamic=False)
    record[ATTN_FORWARD] = run_section("attention forward", attention_paths(case, sets, check, compiled, weights,
                                                                             backward=False),
                                       moved, copy_bw, **options)
    if with_backward:
        for inputs in sets:
            inputs.requires_grad_()
        record[ATTN_FORWARD_BACKWARD] = run_section(
            "attention forward+backward", attention_paths(case, sets, check, compiled, weights, backward=True),
            moved_both, copy_bw, **options)
    add_ratios(record)
    record["targets"] = targets(case, record)
    return record


def ok_time(section, path):
    """The path's median time in the section, None where it was not timed."""
    result = section.get(path, {})
    return result.get("median_us") if result.get("status") == "ok" else None


def add_ratios(record):
    """``vs_bound`` (time / the bytes bound of the section: forward, or forward and backward) and
    ``vs_forward`` (forward+backward time / the same path's forward time)."""
    forward = record[ATTN_FORWARD]
    for path, result in forward.items():
        if result["status"] == "ok":
            result["vs_bound"] = ratio(result["median_us"], record["bound_us"])
    for path, result in record.get(ATTN_FORWARD_BACKWARD, {}).items():
        if result["status"] == "ok":
            result["vs_forward"] = ratio(result["median_us"], ok_time(forward, path))
            result["vs_bound"] = ratio(result["median_us"], record.get("forward_backward_bound_us"))


def ratio(num, den):
    """``num / den``, None where either is missing."""
    return num / den if num is not None and den else None


def targets(case, record):
    """The issue's targets next to the measured values (edgedot's default path unless named)."""
    forward, both = record[ATTN_FORWARD], record.get(ATTN_FORWARD_BACKWARD, {})
    section = both or forward  # deterministic against default: training where it was timed
    result = {
        "forward_us": [ok_time(forward, "edgedot"), case.target_forward_us],
        "forward_backward_us": [ok_time(both, "edgedot"), case.target_forward_backward_us],
        "forward_vs_bound": [ratio(ok_time(forward, "edgedot"), record["bound_us"]), MAX_FORWARD_VS_BOUND],
        "forward_backward_vs_forward": [ratio(ok_time(both, "edgedot"), ok_time(forward, "edgedot")),
                                        MAX_FORWARD_BACKWARD_VS_FORWARD],
        "deterministic_vs_default": [ratio(ok_time(section, "edgedot_det"), ok_time(section, "edgedot")),
                                     MAX_DETERMINISTIC_VS_DEFAULT],
    }
    peak = both.get("edgedot", {}).get("peak_extra_bytes")
    result["forward_backward_peak_bytes"] = [peak, case.memory_budget_bytes]
    if case.memory_budget_bytes:
        # Whether each path trains within the budget: True / False, or its status (OOM, ...).
        result["memory_budget_bytes"] = case.memory_budget_bytes
        result["fits_budget"] = {path: fits(found, case.memory_budget_bytes) for path, found in both.items()}
    return result


def add_power_law_ratios(records):
    """For each power-law case whose uniform twin was run too: edgedot's times over the twin's
    (forward and forward+backward, per edgedot path), and the target on the default path."""
    for record in records.values():
        twin = records.get(record.get("config", {}).get("twin") or "")
        if record.get("kind") != "attention" or twin is None:
            continue
        ratios = {}
        for section in (ATTN_FORWARD, ATTN_FORWARD_BACKWARD):
            for path in record.get(section, {}):
                if path.startswith("edgedot"):
                    ratios[f"{section}/{path}"] = ratio(ok_time(record[section], path),
                                                        ok_time(twin.get(section, {}), path))
        record["vs_uniform_twin"] = ratios
        record["targets"]["forward_vs_uniform"] = [ratios.get(f"{ATTN_FORWARD}/edgedot"), MAX_POWER_LAW_VS_UNIFORM]
        record["targets"]["forward_backward_vs_uniform"] = [ratios.get(f"{ATTN_FORWARD_BACKWARD}/edgedot"),
                                                            MAX_POWER_LAW_VS_UNIFORM]


def fits(result, budget):
    """True or False against ``budget``; the status where the path did not run (OOM, n/a, ...),
    None where the peak is unknown (CPU)."""
    if result["status"] != "ok":
        return result["status"]
    peak = result.get("peak_extra_bytes")
    return None if peak is None else peak <= budget
