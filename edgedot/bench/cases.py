"""The edge_dot benchmark cases, their input sets, and the names of the measured sections."""

import math
from dataclasses import asdict, dataclass, replace

import torch

from .graphs import rmat_edges, sorted_by_src, uniform_edges
from .timing import cache_bytes

# Largest relative error ||got - ref|| / ||ref|| against the float64 reference.
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}

# Keys of the sections in a case's record (and in the JSON).
FORWARD = "forward"
FORWARD_BACKWARD = "forward_backward"
GRAPH_REPLAY = "graph_replay"           # cold: the captured calls rotate through the input sets
GRAPH_REPLAY_HOT = "graph_replay_hot"   # hot: every captured call on input set 0
ATTN_FORWARD = "attention_forward"
ATTN_FORWARD_BACKWARD = "attention_forward_backward"
GAT_FORWARD = "gat_forward"
GAT_FORWARD_BACKWARD = "gat_forward_backward"
EDGE_ATTN_FORWARD = "edge_attention_forward"
EDGE_ATTN_FORWARD_BACKWARD = "edge_attention_forward_backward"


def dtype_name(dtype):
    return str(dtype).removeprefix("torch.")


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
    graph_replay: bool = False  # also time calls captured in a CUDA graph (cold and hot)

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


def rotating_sets(make_set, device, settings):
    """``make_set(seed)`` for as many seeds as together exceed twice the L2 cache (at most
    ``settings.max_sets``), so that calls rotating through them are not timed out of the cache."""
    first = make_set(0)
    count = min(settings.max_sets, max(1, math.ceil(2 * cache_bytes(device) / first.nbytes())))
    return [first] + [make_set(seed) for seed in range(1, count)]


def make_input_sets(case, device, settings):
    """The rotating input sets of an edge_dot case (:func:`rotating_sets`)."""
    return rotating_sets(lambda seed: make_input_set(case, device, seed), device, settings)
