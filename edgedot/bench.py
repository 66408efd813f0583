"""Benchmark of :func:`edgedot.edge_dot` against eager PyTorch, ``torch.compile`` and cuSPARSE.

Run ``python -m edgedot.bench`` on a CUDA device (``--help`` lists the options; ``--quick`` runs
every case at a tiny size, also on the CPU, as a smoke test of the code paths).

Cases (``CASES``; ``--cases`` picks some by name)
    ``default`` is the seed's problem (int32 indices); the others use int64 indices. "mid" is
    100k nodes a side and 2M edges, "large" 2.45M nodes and 2**24 edges; edges are uniform
    random pairs, "sorted" ones ordered by src. ``heads_bf16`` is the large sorted graph with
    ``[N, 4, 32]`` bfloat16 features. ``rmat`` is a Graph500 R-MAT graph (scale 22, edge factor
    4: 2**24 edges, node ids randomly relabelled, edges in random order).

Paths
    Forward: ``eager`` (:func:`edgedot.edge_dot_reference`), ``compile`` (``torch.compile`` of it,
    ``dynamic=False``, recompiled for each case and warmed before timing; a recompile during a
    timed loop raises), ``cusparse`` (``torch.sparse.sampled_addmm(mask, src_feat, dst_feat.T)``
    on a CSR mask of the unique (src, dst) pairs sorted by src, so it computes E_unique <= E dots;
    the mask is built beforehand and only the ``sampled_addmm`` call is timed; CUDA, float32 and
    float64 only, no heads), ``edgedot`` (the default: index check on; an index tensor found in
    range is remembered, so after the warm-up the rotated sets are not checked again),
    ``edgedot_fresh`` (the default on new index tensor objects every call, so every call is
    checked and waits for it) and ``edgedot_nocheck`` (``check_indices=False``).
    Forward+backward: ``eager``, ``compile``, ``edgedot`` (default mode, no plan),
    ``edgedot_det`` (``deterministic=True``, no plan: the edges are sorted in every backward) and
    ``edgedot_plan`` (an :class:`edgedot.EdgePlan` per input set, built once outside timing).
    One timed forward+backward call is ``out = f(...); out.backward(grad_out)`` with a fixed
    random ``grad_out``; before each call, outside the timed region, both features' ``.grad``
    is set to ``None`` (no device work), so every timed backward allocates fresh gradients.

Correctness
    Before a path is timed, its result on input set 0 (forward+backward: the output and both
    feature gradients) is compared with a float64 reference: the relative error
    ``||got - ref|| / ||ref||`` must not exceed ``TOLERANCE[dtype]``. A path that fails is
    reported as FAIL and not timed.

Timing
    Each call is timed on its own between two CUDA events (on the CPU: ``time.perf_counter``),
    and the median is reported. Warm-up is one timed pass over all input sets, discarded; its
    median sets the number of timed calls (enough for about ``target_s`` seconds, clamped to
    ``[min_reps, max_reps]``, times ``--reps-scale``). Calls rotate through several input sets
    (features, indices and ``grad_out`` drawn anew) until together they exceed twice the L2
    cache, so a small case is not timed out of the cache; a case larger than that uses one set.
    "Kernel time alone" (the ``default`` case): ``CALLS_PER_GRAPH`` calls, rotating through the
    input sets, are captured in one ``torch.cuda.CUDAGraph`` and the replays are timed; the time
    per call is a replay's divided by ``CALLS_PER_GRAPH``.

Bytes and bandwidth
    Bytes counted are the least the op must move for its edge order. Forward: both index arrays
    (``E x index itemsize x 2``), the output (``E x H x itemsize``), one dst row per edge
    (``E x H x D x itemsize``) and the src rows: each distinct src row once when the edges are
    sorted by src, else one per edge (``E x H x D x itemsize``). Forward+backward adds the
    backward's least: both index arrays and ``grad_out`` read again, the other side's row once
    per edge for each of the two gradients (no single edge order spares both), and each
    gradient row written once (``(Ns + Nd) x H x D x itemsize``). The cuSPARSE path is counted
    by the same rule on its own edges (E_unique, sorted by src). The bandwidth fraction is
    ``bytes / median time / copy bandwidth``, where the copy bandwidth is that of
    ``dst.copy_(src)`` on a 2 GiB tensor, counting bytes read and written, median of 10 copies.
    A fraction above 1 means rows counted once per edge came from the L2 cache instead: the
    rows of one side fit in it (mid cases), a power-law graph's hot rows stay in it (rmat), or
    edgedot visited shuffled edges of wide rows grouped by row range (``mid_d1000``; see
    ``edgedot/csrc/edge_order.cu``).

Peak extra memory
    ``torch.cuda.max_memory_allocated()`` during one call, after ``reset_peak_memory_stats()``,
    minus the memory allocated just before it: it includes the output (and gradients).

Statuses in place of a number: FAIL (wrong result), OOM (out of memory), n/a (the path does not
apply; the reason is printed under the tables), ERR (the path raised; the message is printed).
Results go to stdout as tables, to a JSON file (every number, including each timed call) and
to a PNG chart (if matplotlib is installed).
"""

import argparse
import datetime
import gc
import json
import math
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Optional

import torch

from . import EdgePlan, edge_dot, edge_dot_reference
from ._graphs import rmat_edges, sorted_by_src, uniform_edges

# Largest relative error ||got - ref|| / ||ref|| against the float64 reference.
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}
CALLS_PER_GRAPH = 100
L2_BYTES_IF_UNKNOWN = 60 * 2**20   # H200's L2; also stands for a CPU's last-level cache
REFERENCE_CHUNK_ELEMENTS = 1 << 24  # float64 elements gathered at once by the reference

FORWARD = "forward"
FORWARD_BACKWARD = "forward_backward"
GRAPH_REPLAY = "graph_replay"
SECTION_TITLES = {FORWARD: "Forward", FORWARD_BACKWARD: "Forward + backward",
                  GRAPH_REPLAY: "Kernel time alone: calls captured in a CUDA graph"}


# --------------------------------------------------------------------------- cases and settings

@dataclass(frozen=True)
class Case:
    """One benchmark problem; ``heads`` > 1 means ``[N, H, D]`` features on both sides."""

    name: str
    num_src: int
    num_dst: int
    num_edges: int
    dim: int
    heads: int = 1
    dtype: torch.dtype = torch.float32
    index_dtype: torch.dtype = torch.int64
    edges: str = "shuffled"  # "shuffled" (uniform), "sorted" (uniform, sorted by src) or "rmat"
    graph_replay: bool = False  # also time calls captured in a CUDA graph

    def feature_shape(self, rows):
        return (rows, self.dim) if self.heads == 1 else (rows, self.heads, self.dim)

    def out_shape(self):
        return (self.num_edges,) if self.heads == 1 else (self.num_edges, self.heads)

    def describe(self):
        fields = asdict(self)
        fields["dtype"] = dtype_name(self.dtype)
        fields["index_dtype"] = dtype_name(self.index_dtype)
        return fields


MID = dict(num_src=100_000, num_dst=100_000, num_edges=2_000_000)
LARGE = dict(num_src=2_450_000, num_dst=2_450_000, num_edges=2**24)
RMAT_SCALE, RMAT_EDGE_FACTOR = 22, 4  # 4.2M nodes, 2**24 edges

CASES = [
    Case("default", 1024, 768, 16384, 128, index_dtype=torch.int32, graph_replay=True),
    Case("mid_shuffled", **MID, dim=128),
    Case("mid_sorted", **MID, dim=128, edges="sorted"),
    Case("large_shuffled", **LARGE, dim=128),
    Case("large_sorted", **LARGE, dim=128, edges="sorted"),
    Case("large_d64_sorted", **LARGE, dim=64, edges="sorted"),
    Case("large_bf16_sorted", **LARGE, dim=128, dtype=torch.bfloat16, edges="sorted"),
    Case("heads_bf16", **LARGE, dim=32, heads=4, dtype=torch.bfloat16, edges="sorted"),
    Case("rmat", 2**RMAT_SCALE, 2**RMAT_SCALE, RMAT_EDGE_FACTOR * 2**RMAT_SCALE, 128, edges="rmat"),
    Case("mid_d1", **MID, dim=1),
    Case("mid_d1000", **MID, dim=1000),
]

QUICK_EDGES = 4096


def shrunk(case):
    """The case with nodes and edges divided by one factor, down to about ``QUICK_EDGES`` edges."""
    factor = max(1, case.num_edges // QUICK_EDGES)
    return replace(case, num_src=max(1, case.num_src // factor), num_dst=max(1, case.num_dst // factor),
                   num_edges=case.num_edges // factor)


@dataclass(frozen=True)
class Settings:
    """How long each measurement runs, and how many input sets a small case rotates through."""

    target_s: float   # timed seconds aimed at per path
    min_reps: int
    max_reps: int
    max_sets: int
    copy_bytes: int   # size of the tensor copied to measure the copy bandwidth
    reps_scale: float = 1.0

    def reps_for(self, seconds_per_call):
        reps = math.ceil(self.target_s / max(seconds_per_call, 1e-9))
        reps = min(max(reps, self.min_reps), self.max_reps)
        return max(1, round(reps * self.reps_scale))


# Host-bound calls of tens of microseconds vary from call to call (two modes on the H200's host):
# up to 2000 of them make a stable median in well under a second.
FULL = Settings(target_s=0.25, min_reps=10, max_reps=2000, max_sets=128, copy_bytes=2 * 2**30)
QUICK = Settings(target_s=0.01, min_reps=3, max_reps=10, max_sets=4, copy_bytes=64 * 2**20)


def dtype_name(dtype):
    return str(dtype).removeprefix("torch.")


# --------------------------------------------------------------------------- inputs

@dataclass
class InputSet:
    src_feat: torch.Tensor
    dst_feat: torch.Tensor
    src_idx: torch.Tensor
    dst_idx: torch.Tensor
    grad_out: torch.Tensor

    @property
    def args(self):
        return self.src_feat, self.dst_feat, self.src_idx, self.dst_idx

    def nbytes(self):
        return sum(t.nbytes for t in (*self.args, self.grad_out))

    def clear_grads(self):
        self.src_feat.grad = None
        self.dst_feat.grad = None


def make_edges(case, generator):
    if case.edges == "rmat":
        return rmat_edges(case.num_src.bit_length() - 1, case.num_edges, generator)
    src, dst = uniform_edges(case.num_src, case.num_dst, case.num_edges, generator)
    return sorted_by_src(src, dst) if case.edges == "sorted" else (src, dst)


def make_input_set(case, device, seed):
    generator = torch.Generator(device).manual_seed(seed)
    src_idx, dst_idx = make_edges(case, generator)

    def normal(shape):
        return torch.randn(shape, generator=generator, device=device, dtype=case.dtype)

    return InputSet(normal(case.feature_shape(case.num_src)), normal(case.feature_shape(case.num_dst)),
                    src_idx.to(case.index_dtype), dst_idx.to(case.index_dtype), normal(case.out_shape()))


def cache_bytes(device):
    if device.type == "cuda":
        return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", L2_BYTES_IF_UNKNOWN)
    return L2_BYTES_IF_UNKNOWN


def make_input_sets(case, device, settings):
    """As many input sets as together exceed twice the L2 cache (at most ``settings.max_sets``)."""
    first = make_input_set(case, device, seed=0)
    count = min(settings.max_sets, max(1, math.ceil(2 * cache_bytes(device) / first.nbytes())))
    return [first] + [make_input_set(case, device, seed) for seed in range(1, count)]


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


def relative_error(got, want):
    if got is None:
        return math.inf
    return float((got.detach().double() - want).norm() / want.norm().clamp_min(1e-300))


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


# --------------------------------------------------------------------------- clocks

def no_reset(_):
    pass


class CudaClock:
    """Times each call between two CUDA events; measures peak memory with the caching allocator."""

    def __init__(self, device):
        self.device = device

    def sync(self):
        torch.cuda.synchronize(self.device)

    def time_calls(self, call, reps, num_sets, reset=no_reset):
        """Seconds of each of ``reps`` calls, input set ``r % num_sets`` for call ``r``."""
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for rep in range(reps):
            reset(rep % num_sets)
            starts[rep].record()
            call(rep % num_sets)
            ends[rep].record()
        self.sync()
        return [start.elapsed_time(end) * 1e-3 for start, end in zip(starts, ends)]

    def peak_extra_bytes(self, call, reset):
        reset(0)
        self.sync()
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        out = call(0)
        self.sync()
        del out
        return torch.cuda.max_memory_allocated(self.device) - before


class HostClock:
    """CPU timing with ``time.perf_counter``; no memory statistics."""

    def sync(self):
        pass

    def time_calls(self, call, reps, num_sets, reset=no_reset):
        times = []
        for rep in range(reps):
            reset(rep % num_sets)
            start = time.perf_counter()
            call(rep % num_sets)
            times.append(time.perf_counter() - start)
        return times

    def peak_extra_bytes(self, call, reset):
        return None


def copy_bandwidth(device, clock, settings):
    """Bytes per second (read + written) of ``dst.copy_(src)``, median of 10 copies; None on CPU."""
    if device.type != "cuda":
        return None
    src = torch.ones(settings.copy_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    clock.time_calls(lambda _: dst.copy_(src), 3, 1)
    seconds = statistics.median(clock.time_calls(lambda _: dst.copy_(src), 10, 1))
    return 2 * src.nbytes / seconds


# --------------------------------------------------------------------------- paths and measurement

class NotApplicable(Exception):
    """The path cannot run this case; the message says why."""


@dataclass
class BenchPath:
    call: Callable[[int], torch.Tensor]           # the timed call, on input set i
    error_of: Callable[[torch.Tensor], float]     # relative error of call(0)'s result
    reset: Callable[[int], None] = no_reset       # restores input set i before a call (untimed)
    bytes_moved: Optional[int] = None             # when it differs from the case's count
    num_edges: Optional[int] = None               # edges computed, when not the case's E


def measure(path, tolerance, num_sets, clock, settings, calls_per_run=1, with_peak=True):
    """Checks ``path`` on input set 0, then times it; ``calls_per_run`` ops run in each call."""
    path.reset(0)
    error = path.error_of(path.call(0))
    if not error <= tolerance:
        return {"status": "FAIL", "rel_err": error}
    peak = clock.peak_extra_bytes(path.call, path.reset) if with_peak else None
    warm_up = clock.time_calls(path.call, max(3, num_sets), num_sets, path.reset)
    reps = settings.reps_for(statistics.median(warm_up))
    with torch._dynamo.config.patch(error_on_recompile=True):
        times = clock.time_calls(path.call, reps, num_sets, path.reset)
    times_us = [1e6 * t / calls_per_run for t in times]
    return {"status": "ok", "median_us": statistics.median(times_us), "reps": reps, "rel_err": error,
            "peak_extra_bytes": peak, "bytes_moved": path.bytes_moved, "num_edges": path.num_edges,
            "times_us": times_us}


def first_line(error):
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def run_path(make_path, num_sets, **measure_options):
    """Builds the path and measures it; OOM, n/a and errors become a status instead of raising."""
    try:
        path = make_path()
        try:
            return measure(path, num_sets=num_sets, **measure_options)
        finally:
            for i in range(num_sets):
                path.reset(i)
    except torch.OutOfMemoryError:
        return {"status": "OOM"}
    except NotApplicable as reason:
        return {"status": "n/a", "message": str(reason)}
    except Exception as error:  # a broken path must not stop the others
        return {"status": "ERR", "message": first_line(error)}


def release_memory():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_section(label, path_makers, bytes_moved, copy_bw, **measure_options):
    results = {}
    for name, make_path in path_makers.items():
        progress(f"  {label}: {name}")
        results[name] = run_path(make_path, **measure_options)
        release_memory()
    add_comparisons(results, bytes_moved, copy_bw)
    return results


def add_comparisons(results, bytes_moved, copy_bw):
    """Adds time / eager, time / compile and the fraction of the copy bandwidth to each result."""
    baselines = {key: results.get(name, {}).get("median_us") for key, name in
                 (("vs_eager", "eager"), ("vs_compile", "compile"))}
    for result in results.values():
        if result["status"] != "ok":
            continue
        seconds = result["median_us"] * 1e-6
        for key, baseline in baselines.items():
            result[key] = result["median_us"] / baseline if baseline else None
        result["bytes_moved"] = result["bytes_moved"] or bytes_moved
        result["bw_fraction"] = result["bytes_moved"] / seconds / copy_bw if copy_bw else None


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


def capture_in_graph(call, num_sets):
    """``CALLS_PER_GRAPH`` calls rotating through the input sets, captured in one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(3):
            call(i % num_sets)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [call(k % num_sets) for k in range(CALLS_PER_GRAPH)]
    return graph, outs


def graph_replay_paths(sets, expected, compiled, device):
    def path_of(op):
        def make():
            if device.type != "cuda":
                raise NotApplicable("CUDA graphs need CUDA")
            graph, outs = capture_in_graph(lambda i: op(*sets[i].args), len(sets))

            def replay(_):
                graph.replay()
                return outs[0]  # the call on input set 0

            return BenchPath(replay, lambda out: relative_error(out, expected.out))
        return make

    return {"edgedot": path_of(edge_dot), "compile": path_of(compiled)}


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

def run_case(case, device, clock, settings, with_backward, copy_bw):
    progress(f"{case.name}: making inputs")
    sets = make_input_sets(case, device, settings)
    expected = expected_results(sets[0], with_backward)
    rows_read = src_rows_read(case, sets[0])
    fwd_bytes = forward_bytes(case, case.num_edges, rows_read)
    record = {"config": case.describe(), "input_sets": len(sets), "src_rows_read": rows_read,
              "bytes": {FORWARD: fwd_bytes, FORWARD_BACKWARD: fwd_bytes + backward_bytes(case)}}
    measure_options = dict(tolerance=TOLERANCE[case.dtype], num_sets=len(sets), clock=clock,
                           settings=settings)
    torch._dynamo.reset()
    compiled = torch.compile(edge_dot_reference, dynamic=False)

    record[FORWARD] = run_section("forward", forward_paths(case, sets, expected, compiled, device),
                                  fwd_bytes, copy_bw, **measure_options)
    if case.graph_replay:
        record[GRAPH_REPLAY] = run_section(
            "graph replay", graph_replay_paths(sets, expected, compiled, device), fwd_bytes, copy_bw,
            calls_per_run=CALLS_PER_GRAPH, with_peak=False, **measure_options)
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


# --------------------------------------------------------------------------- report

def progress(message):
    print(message, file=sys.stderr, flush=True)


def megabytes(value):
    return f"{value / 1e6:.1f}"


METRICS = {
    "median_us": ("median time per call (us)", "{:.1f}".format),
    "vs_eager": ("time / eager time (<1: faster than eager)", "{:.3f}".format),
    "vs_compile": ("time / compile time (<1: faster than compile)", "{:.3f}".format),
    "bw_fraction": ("bytes counted / time / copy bandwidth", "{:.2f}".format),
    "peak_extra_bytes": ("peak extra memory of one call (MB)", megabytes),
}
SECTION_METRICS = {FORWARD: list(METRICS), FORWARD_BACKWARD: list(METRICS),
                   GRAPH_REPLAY: ["median_us", "vs_compile", "bw_fraction"]}
NAME_WIDTH, CELL_WIDTH, CASE_CELL_WIDTH = 18, 16, 11


def table_lines(header, rows, cell_width=CELL_WIDTH):
    def line(cells):
        return cells[0].ljust(NAME_WIDTH) + "".join(str(c).rjust(cell_width) for c in cells[1:])
    lines = [line(header), "-" * (NAME_WIDTH + cell_width * (len(header) - 1))]
    return lines + [line(row) for row in rows]


def metric_cell(result, key, formatter):
    if result is None:
        return "-"
    if result["status"] != "ok":
        return result["status"]
    value = result.get(key)
    return "n/a" if value is None else formatter(value)


def case_table(cases):
    header = ["case", "Ns", "Nd", "E", "HxD", "dtype", "index", "edges", "sets", "src rows",
              "fwd MB", "f+b MB", "cusparse E"]
    rows = []
    for name, record in cases.items():
        config = record["config"]
        cusparse = record[FORWARD].get("cusparse", {})
        rows.append([name, config["num_src"], config["num_dst"], config["num_edges"],
                     f"{config['heads']}x{config['dim']}", config["dtype"], config["index_dtype"],
                     config["edges"], record["input_sets"], record["src_rows_read"],
                     megabytes(record["bytes"][FORWARD]), megabytes(record["bytes"][FORWARD_BACKWARD]),
                     cusparse.get("num_edges") or "-"])
    return table_lines(header, rows, CASE_CELL_WIDTH)


def section_tables(cases, section):
    names = [name for name, record in cases.items() if section in record]
    if not names:
        return []
    paths = list(dict.fromkeys(path for name in names for path in cases[name][section]))
    lines = []
    for key in SECTION_METRICS[section]:
        title, formatter = METRICS[key]
        lines += ["", f"{SECTION_TITLES[section]}: {title}"]
        rows = [[name] + [metric_cell(cases[name][section].get(path), key, formatter) for path in paths]
                for name in names]
        lines += table_lines(["case"] + paths, rows)
    return lines


def note_lines(cases):
    notes = []
    for name, record in cases.items():
        for section in SECTION_TITLES:
            for path, result in record.get(section, {}).items():
                if result["status"] == "FAIL":
                    notes.append(f"{name} / {section} / {path}: FAIL, relative error {result['rel_err']:.3g}")
                elif result["status"] != "ok":
                    message = result.get("message", "")
                    notes.append(f"{name} / {section} / {path}: {result['status']} {message}")
    return ["", "Notes:"] + ["  " + note for note in notes] if notes else []


def report_lines(report):
    copy_bw = report["copy_bandwidth_bytes_per_s"]
    lines = [
        f"edgedot benchmark: {report['device']}, torch {report['torch']}, {report['date']}",
        "copy bandwidth (dst.copy_(src), read + write): "
        + (f"{copy_bw / 1e9:.0f} GB/s" if copy_bw else "n/a"),
        f"L2 cache assumed: {report['cache_bytes'] / 2**20:.0f} MiB; times: median per call; "
        "cusparse: sampled_addmm call only (mask built beforehand), on E_unique edges",
        "",
    ]
    lines += case_table(report["cases"])
    for section in SECTION_TITLES:
        lines += section_tables(report["cases"], section)
    lines += note_lines(report["cases"])
    lines += ["", f"kernel load {report['kernel_load_seconds']:.1f} s (not counted); "
                  f"benchmark {report['total_seconds']:.0f} s"]
    return lines


def write_json(report, path):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")


def save_chart(report, path):
    """Grouped bars of the median time per case, log scale, one panel per section."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart")
        return
    cases = report["cases"]
    sections = [s for s in (FORWARD, FORWARD_BACKWARD) if any(s in record for record in cases.values())]
    names = list(cases)
    figure, axes = plt.subplots(len(sections), 1, figsize=(max(8, 1.3 * len(names)), 4.5 * len(sections)),
                                squeeze=False)
    for axis, section in zip(axes[:, 0], sections):
        path_names = list(dict.fromkeys(p for record in cases.values() for p in record.get(section, {})))
        width = 0.8 / len(path_names)
        for k, path_name in enumerate(path_names):
            offset = (k - (len(path_names) - 1) / 2) * width
            bars = [(i + offset, cases[name][section][path_name]["median_us"])
                    for i, name in enumerate(names)
                    if cases[name].get(section, {}).get(path_name, {}).get("status") == "ok"]
            if bars:
                axis.bar(*zip(*bars), width=width, label=path_name)
        axis.set_yscale("log")
        axis.set_xticks(range(len(names)), names, rotation=30, ha="right")
        axis.set_ylabel("median time per call (us)")
        axis.set_title(f"{SECTION_TITLES[section]} ({report['device']})")
        axis.legend(fontsize="small")
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    print(f"wrote {path}")


# --------------------------------------------------------------------------- command line

def select_cases(names, quick):
    known = {case.name: case for case in CASES}
    chosen = [name.strip() for name in names.split(",")] if names else list(known)
    unknown = [name for name in chosen if name not in known]
    if unknown:
        raise SystemExit(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return [shrunk(known[name]) if quick else known[name] for name in chosen]


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m edgedot.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--cases", help="comma-separated case names (default: all): "
                        + ", ".join(case.name for case in CASES))
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test (also on CPU)")
    parser.add_argument("--json", default="bench_out/bench.json", help="where to write all numbers")
    parser.add_argument("--png", default="bench_out/bench.png", help="where to write the chart")
    parser.add_argument("--no-backward", action="store_true", help="time the forward only")
    parser.add_argument("--reps-scale", type=float, default=1.0,
                        help="multiplies every number of timed calls")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    settings = replace(QUICK if args.quick else FULL, reps_scale=args.reps_scale)
    cases = select_cases(args.cases, args.quick)
    clock = CudaClock(device) if device.type == "cuda" else HostClock()

    progress("loading the edgedot kernels")
    try:
        kernel_load_seconds = load_kernels(device)
    except Exception as error:  # every edgedot path will then report ERR
        progress(f"edgedot failed on {device}: {first_line(error)}")
        kernel_load_seconds = math.nan
    start = time.perf_counter()
    copy_bw = copy_bandwidth(device, clock, settings)
    records = {}
    for case in cases:
        records[case.name] = run_case(case, device, clock, settings, not args.no_backward, copy_bw)
        release_memory()
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "quick": args.quick,
        "settings": asdict(settings),
        "tolerance": {dtype_name(dtype): tol for dtype, tol in TOLERANCE.items()},
        "cache_bytes": cache_bytes(device),
        "copy_bandwidth_bytes_per_s": copy_bw,
        "kernel_load_seconds": kernel_load_seconds,
        "total_seconds": time.perf_counter() - start,
        "cases": records,
    }
    print("\n".join(report_lines(report)))
    write_json(report, args.json)
    save_chart(report, args.png)


if __name__ == "__main__":
    main()
