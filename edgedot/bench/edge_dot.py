"""The edge_dot benchmark: float64 expected results, bytes counted, and the timed paths
(eager, torch.compile, cuSPARSE, edgedot; forward, forward+backward, CUDA-graph replay)."""

import time
import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from .. import EdgePlan, edge_dot, edge_dot_reference
from .cases import (FORWARD, FORWARD_BACKWARD, GRAPH_REPLAY, GRAPH_REPLAY_HOT, TOLERANCE,
                    make_input_sets)
from .timing import (CALLS_PER_GRAPH, BenchPath, NotApplicable, capture_in_graph, first_line, progress,
                     relative_error, run_section)

REFERENCE_CHUNK_ELEMENTS = 1 << 24  # float64 elements gathered at once by the reference


# --------------------------------------------------------------------------- float64 reference

def reference_out(src64, dst64, src_idx, dst_idx):
    """Float64 ``out[e] = <src64[src_idx[e]], dst64[dst_idx[e]]>``, gathered in bounded chunks."""
    out = torch.empty(src_idx.shape + src64.shape[1:-1], dtype=torch.float64, device=src64.device)
    step = max(1, REFERENCE_CHUNK_ELEMENTS // src64[0].numel())
    for start in range(0, src_idx.shape[0], step):
        part = slice(start, start + step)
        out[part] = (src64[src_idx[part].long()] * dst64[dst_idx[part].long()]).sum(-1)
    return out


def reference_grad(grad_out64, row64, other64, row_idx, other_idx):
    """Float64 gradient with respect to ``row64``: each edge adds ``grad_out[e] * other[other_idx[e]]``."""
    grad = torch.zeros_like(row64)
    step = max(1, REFERENCE_CHUNK_ELEMENTS // other64[0].numel())
    for start in range(0, row_idx.shape[0], step):
        part = slice(start, start + step)
        contribution = grad_out64[part].unsqueeze(-1) * other64[other_idx[part].long()]
        grad.index_add_(0, row_idx[part].long(), contribution)
    return grad


@dataclass
class Expected:
    out: torch.Tensor
    grad_src: Optional[torch.Tensor] = None
    grad_dst: Optional[torch.Tensor] = None


def expected_results(inputs, with_grads):
    src64, dst64 = inputs.src_feat.double(), inputs.dst_feat.double()
    out = reference_out(src64, dst64, inputs.src_idx, inputs.dst_idx)
    if not with_grads:
        return Expected(out)
    grad_out64 = inputs.grad_out.double()
    return Expected(out,
                    reference_grad(grad_out64, src64, dst64, inputs.src_idx, inputs.dst_idx),
                    reference_grad(grad_out64, dst64, src64, inputs.dst_idx, inputs.src_idx))


# --------------------------------------------------------------------------- bytes moved

def forward_bytes(case, num_edges, src_rows_read):
    """Least bytes a forward over ``num_edges`` edges moves (module docstring, "Bytes")."""
    feat_size = case.dtype.itemsize
    row = case.heads * case.dim * feat_size
    per_edge = 2 * case.index_dtype.itemsize + case.heads * feat_size + row  # indices, output, dst row
    return num_edges * per_edge + src_rows_read * row


def backward_bytes(case):
    """Least bytes the backward adds (module docstring, "Bytes")."""
    feat_size = case.dtype.itemsize
    row = case.heads * case.dim * feat_size
    per_edge = 2 * case.index_dtype.itemsize + case.heads * feat_size + 2 * row
    return case.num_edges * per_edge + (case.num_src + case.num_dst) * row


def src_rows_read(case, inputs):
    """Src rows the forward must read: each distinct one once if sorted by src, else one per edge."""
    if case.edges == "sorted":
        return torch.unique(inputs.src_idx).numel()
    return case.num_edges


# --------------------------------------------------------------------------- the paths

def forward_paths(case, sets, expected, compiled, device):
    def path_of(op, **options):
        return lambda: BenchPath(lambda i: op(*sets[i].args, **options),
                                 lambda out: relative_error(out, expected.out))

    return {
        "eager": path_of(edge_dot_reference),
        "compile": path_of(compiled),
        "cusparse": lambda: cusparse_path(case, sets, device),
        "edgedot": path_of(edge_dot),
        "edgedot_fresh": path_of(edge_dot_fresh_indices),
        "edgedot_nocheck": path_of(edge_dot, check_indices=False),
    }


def edge_dot_fresh_indices(src_feat, dst_feat, src_idx, dst_idx):
    """edge_dot on new view objects of the indices: none is remembered as checked, so every call
    pays the index check (on CUDA, a wait for the kernel), as with new index tensors each step."""
    return edge_dot(src_feat, dst_feat, src_idx.view(-1), dst_idx.view(-1))


def csr_mask(case, inputs):
    """CSR mask (zero values) of the unique (src, dst) pairs sorted by src then dst, and the pairs."""
    key = torch.unique(inputs.src_idx.long() * case.num_dst + inputs.dst_idx.long())
    rows, cols = key // case.num_dst, key % case.num_dst
    crow = torch.zeros(case.num_src + 1, dtype=torch.int64, device=key.device)
    crow[1:] = torch.cumsum(torch.bincount(rows, minlength=case.num_src), 0)
    values = torch.zeros(key.numel(), dtype=case.dtype, device=key.device)
    with warnings.catch_warnings():  # "CSR support is in beta", "invariant checks disabled"
        warnings.simplefilter("ignore", UserWarning)
        mask = torch.sparse_csr_tensor(crow.to(case.index_dtype), cols.to(case.index_dtype), values,
                                       size=(case.num_src, case.num_dst), check_invariants=False)
    return mask, rows, cols


def cusparse_path(case, sets, device):
    if device.type != "cuda":
        raise NotApplicable("cuSPARSE runs on CUDA only")
    if case.heads > 1:
        raise NotApplicable("sampled_addmm has no head dimension")
    masks, first_rows, first_cols = [], None, None
    for inputs in sets:
        mask, rows, cols = csr_mask(case, inputs)
        masks.append(mask)
        if first_rows is None:
            first_rows, first_cols = rows, cols

    def call(i):
        return torch.sparse.sampled_addmm(masks[i], sets[i].src_feat, sets[i].dst_feat.t(), beta=0.0)

    try:
        call(0)
    except RuntimeError as error:
        if isinstance(error, torch.OutOfMemoryError):
            raise
        raise NotApplicable(f"sampled_addmm raised {first_line(error)}") from None
    first = sets[0]
    want = reference_out(first.src_feat.double(), first.dst_feat.double(), first_rows, first_cols)
    moved = forward_bytes(case, first_rows.numel(), torch.unique_consecutive(first_rows).numel())
    return BenchPath(call, lambda out: relative_error(out.values(), want), bytes_moved=moved,
                     num_edges=first_rows.numel())


def graph_replay_paths(sets, expected, compiled, device, hot):
    """``CALLS_PER_GRAPH`` forward calls in one CUDA graph, replayed; ``hot``: all on input set 0
    (its tables stay in L2), else rotating through the input sets (cold)."""
    set_of_call = (lambda k: 0) if hot else (lambda k: k % len(sets))

    def path_of(op):
        def make():
            if device.type != "cuda":
                raise NotApplicable("CUDA graphs need CUDA")
            graph, outs = capture_in_graph(lambda i: op(*sets[i].args), set_of_call)

            def replay(_):
                graph.replay()
                return outs[0]  # the call on input set 0

            return BenchPath(replay, lambda out: relative_error(out, expected.out))
        return make

    return {"eager": path_of(edge_dot_reference), "compile": path_of(compiled), "edgedot": path_of(edge_dot)}


def forward_backward_paths(case, sets, expected, compiled):
    def error_of(out):
        first = sets[0]
        return max(relative_error(out, expected.out),
                   relative_error(first.src_feat.grad, expected.grad_src),
                   relative_error(first.dst_feat.grad, expected.grad_dst))

    def training_step(op, options_of=lambda i: {}):
        def call(i):
            out = op(*sets[i].args, **options_of(i))
            out.backward(sets[i].grad_out)
            return out
        return BenchPath(call, error_of, reset=lambda i: sets[i].clear_grads())

    def with_plans():
        plans = [EdgePlan(s.src_idx, s.dst_idx, case.num_src, case.num_dst) for s in sets]
        return training_step(edge_dot, lambda i: {"plan": plans[i]})

    return {
        "eager": lambda: training_step(edge_dot_reference),
        "compile": lambda: training_step(compiled),
        "edgedot": lambda: training_step(edge_dot),
        "edgedot_det": lambda: training_step(edge_dot, lambda i: {"deterministic": True}),
        "edgedot_plan": with_plans,
    }


# --------------------------------------------------------------------------- one case

def run_case(case, device, clock, settings, with_backward, bandwidths):
    """Checks and times every path of one edge_dot case; returns its record (the JSON's)."""
    copy_bw = bandwidths["copy"]
    progress(f"{case.name}: making inputs")
    sets = make_input_sets(case, device, settings)
    expected = expected_results(sets[0], with_backward)
    rows_read = src_rows_read(case, sets[0])
    fwd_bytes = forward_bytes(case, case.num_edges, rows_read)
    record = {"kind": "edge_dot", "config": case.describe(), "input_sets": len(sets), "src_rows_read": rows_read,
              "bytes": {FORWARD: fwd_bytes, FORWARD_BACKWARD: fwd_bytes + backward_bytes(case)}}
    measure_options = dict(tolerance=TOLERANCE[case.dtype], num_sets=len(sets), clock=clock,
                           settings=settings)
    torch._dynamo.reset()
    compiled = torch.compile(edge_dot_reference, dynamic=False)

    record[FORWARD] = run_section("forward", forward_paths(case, sets, expected, compiled, device),
                                  fwd_bytes, copy_bw, **measure_options)
    if case.graph_replay:
        replay_options = dict(calls_per_run=CALLS_PER_GRAPH, with_peak=False, **measure_options)
        record[GRAPH_REPLAY] = run_section(
            "graph replay (cold)", graph_replay_paths(sets, expected, compiled, device, hot=False), fwd_bytes,
            copy_bw, **replay_options)
        # Hot: every row is gathered once per edge (no sort makes a row's reads rarer).
        gathered = forward_bytes(case, case.num_edges, case.num_edges)
        record["bytes"][GRAPH_REPLAY_HOT] = gathered
        record[GRAPH_REPLAY_HOT] = run_section(
            "graph replay (hot)", graph_replay_paths(sets, expected, compiled, device, hot=True), gathered,
            copy_bw, with_l2=True, l2_bw=bandwidths["l2_copy"], **replay_options)
    if with_backward:
        for inputs in sets:
            inputs.src_feat.requires_grad_()
            inputs.dst_feat.requires_grad_()
        record[FORWARD_BACKWARD] = run_section(
            "forward+backward", forward_backward_paths(case, sets, expected, compiled),
            record["bytes"][FORWARD_BACKWARD], copy_bw, **measure_options)
    return record


def load_kernels(device):
    """One tiny call, forward and backward, so a first-use build of the kernels is not timed."""
    start = time.perf_counter()
    feat = torch.randn(4, 8, device=device, requires_grad=True)
    idx = torch.arange(4, device=device)
    edge_dot(feat, feat, idx, idx).sum().backward()
    return time.perf_counter() - start
