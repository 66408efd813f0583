"""Fused graph attention: :func:`graph_attention`, softmax attention of each destination node over
its incoming edges without materialising anything of ``E x H x D``, and the custom operators behind
it (schemas, per-device implementations, fake tensors, autograd).

``edgedot::graph_attention``           forward: ``(out, lse, alpha, rng_state)``.
``edgedot::graph_attention_backward``  ``(dq, dk, dv, d_edge_feat)`` by recomputation from ``lse``.

Groupings (``edgedot.runtime.plan.build_side`` and ``group_offsets``) ride along as optional tensors:
the CUDA kernels walk the edges grouped by destination (forward, ``dq``, ``d_edge_feat``) and by
source (``dk``, ``dv``); an absent grouping is built by the implementation that needs it
(:func:`build_grouping`: on CUDA one sort and one kernel of the extension). Offsets without a
grouping say the edges are already sorted by that side, the offsets being their CSR pointer
(``graph_attention``'s ``dst_ptr``, int32 or int64, checked against ``dst_idx`` with the index
ranges): the kernels then walk the edges as they are. The CPU implementation reads the indices
as they are.

Dropout (:mod:`edgedot.runtime.dropout`): the forward draws its ``(seed, offset)`` from
``generator`` (None: the default generator of the inputs' device) when it runs, and returns it as ``rng_state`` (int64
``[2]`` on the inputs' device; ``[0]`` without dropout), which the backward takes. Drawing inside
the implementation keeps ``torch.compile`` tracing the op (the fake implementation draws nothing)
and CUDA graphs replaying fresh masks; the forward carries the ``nondeterministic_seeded`` tag,
so that no compiler pass merges two calls or recomputes one.

``lse`` is kept in the accumulation dtype (float64 for float64 inputs, else float32): a
float32 log-sum-exp of logits around 1e4 is off by about 1e-3, which would cost float64
gradients their precision.
"""

import math
import numbers

import torch

from ..cpu import attention as cpu_attention
from ..runtime import dropout, eager
from ..runtime.build import cuda_module
from ..runtime.checks import FEATURE_DTYPES, check_graph, check_indices_pair, grouping_with_check
from ..runtime.checks import deferred as deferred_checks
from ..runtime.grouped import check_dst_ptr, index_to_ptr
from ..runtime.plan import MAX_ROWS, EdgePlan, build_side, group_offsets

__all__ = ["graph_attention", "dropout_keep", "next_dropout_state", "index_to_ptr", "graph_attention_op",
           "graph_attention_backward_op", "check_inputs", "build_grouping"]

_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor

# ------------------------------------------------------------------------------ the public function


# The residual argument of the attention functions, as their docstrings describe it.
RESIDUAL_DOC = """optional tensor added to ``out``, in the inputs' dtype: of ``out``'s shape (a
            skip connection), or of its row's (``[H, C]`` or flat ``[H * C]``) added to every row
            (a bias). On CUDA the kernel adds it as it stores ``out`` (rounded once, no pass of its
            own); elsewhere it is an add after the attention."""


def with_residual_doc(function):
    """``function`` with :data:`RESIDUAL_DOC` written into its docstring (absent under ``-OO``)."""
    if function.__doc__:
        function.__doc__ = function.__doc__.replace("{residual}", RESIDUAL_DOC)
    return function


@with_residual_doc
def graph_attention(q, k, v, src_idx, dst_idx, *, scale=None, edge_feat=None, dropout_p=0.0, generator=None,
                    plan=None, dst_ptr=None, deterministic=None, check_indices=True, return_attention=False,
                    residual=None):
    """Multi-head softmax attention over the edges of a graph (PyG's ``TransformerConv``).

    For each edge ``e`` from ``s = src_idx[e]`` to ``n = dst_idx[e]`` and head ``h``::

        score[e, h] = scale * <q[n, h], k[s, h] + edge_feat[e, h]>
        alpha[e, h] = softmax of score[:, h] over the edges into n
        out[n, h]   = sum over edges e into n of alpha[e, h] * (v[s, h] + edge_feat[e, h])

    A node without incoming edges gets zeros. The softmax keeps a running maximum, so logits of
    any size are safe. Non-finite scores, the same on every device: a node that has incoming
    edges but whose every score is ``-inf`` or NaN gets NaN (its log-sum-exp is NaN too); an edge
    whose ``alpha`` is exactly 0 (a ``-inf`` score into a node with a finite log-sum-exp) adds
    nothing to any gradient, so the gradients are finite wherever the output is. Nodes of any
    in-degree are fast: the edges of a hub are split into chunks walked in parallel, whose partial
    softmaxes are merged in a fixed order (reproducible). The backward recomputes the scores from a per-node log-sum-exp
    (FlashAttention-style): besides the output, only ``O(N * H)`` floats and the ``O(E)``
    integer groupings of the edges are kept for it.

    Args:
        q: ``[Nd, H, D]`` queries of the destination nodes.
        k: ``[Ns, H, D]`` keys of the source nodes.
        v: ``[Ns, H, Dv]`` values of the source nodes (``Dv`` may differ from ``D``; on CUDA
            both are at most 256).
            ``q``, ``k``, ``v`` share a dtype (float32, float64, float16 or bfloat16; half
            types accumulate in float32) and may be strided views (e.g. slices of one fused
            QKV projection).
        src_idx, dst_idx: 1-D int32 or int64 tensors of length ``E``, in any order, read as
            they are.
        scale: the logits' factor, ``1 / sqrt(D)`` by default.
        edge_feat: optional ``[E, H, D]`` edge features added to the keys and to the values
            (PyG's ``edge_dim``; needs ``Dv == D``).
        dropout_p: dropout on ``alpha`` without renormalisation (PyG's semantics). Each call
            draws a state ``(seed, offset)`` from ``generator``; the mask is a hash of the
            state, the edge and the head (the same on CPU and CUDA, whatever the edge order),
            regenerated in the backward from the state the forward recorded instead of stored.
            :func:`next_dropout_state` tells the state a call will draw, :func:`dropout_keep`
            the mask of a state. On CUDA dropout adds no wait for the device, and a call
            captured in a CUDA graph draws a new mask at each replay. Apply it only in training.
        generator: the ``torch.Generator`` dropout draws from: one of the inputs' device (a CPU
            generator for CPU inputs, a CUDA generator of their device for CUDA inputs;
            ``ValueError`` otherwise), by default that device's default generator. On CUDA the
            state is the generator's Philox seed and offset, which each call moves on by 4, as
            torch's own dropout does; in a CUDA graph, a generator other than the default must
            be registered with the graph (``CUDAGraph.register_generator_state``). On CPU the
            seed is a 64-bit integer drawn from the generator and the offset is 0.
            ``torch.compile`` traces calls with the default generator (None), which draw when
            they run, as in eager mode; a generator object breaks the graph at the call (an
            error with ``fullgraph=True``).
        plan: an :class:`edgedot.EdgePlan` of this graph (``EdgePlan(src_idx, dst_idx, Ns,
            Nd)``): the edges' groupings by destination and by source are then built once
            instead of in every call.
        dst_ptr: for edges already sorted by destination (a CSC adjacency, PyG's ``NeighborLoader``
            output, a DGL block): int32/int64 ``[Nd + 1]`` CSR pointer, the edges into node ``n``
            being ``dst_ptr[n]`` to ``dst_ptr[n + 1] - 1`` (:func:`index_to_ptr` makes it from a
            sorted ``dst_idx``). The forward then needs no sort, and the backward sorts only by
            source, only when ``k`` or ``v`` needs a gradient. With ``check_indices`` it is
            checked against ``dst_idx`` (``ValueError`` naming ``dst_ptr``); without, a pointer
            that disagrees with ``dst_idx`` makes the destinations concerned NaN. Not together
            with ``plan``.
        deterministic: accepted for symmetry with :func:`edgedot.edge_dot`. Every path is
            bitwise reproducible already (no float atomics), with or without a plan.
        check_indices: raise ``IndexError`` naming the index tensor if an index is out of range
            (``ValueError`` naming ``dst_ptr`` if it disagrees with ``dst_idx``). The CPU checks
            during the call. On CUDA the call never waits for the device: the indices and
            ``dst_ptr`` are checked together by one kernel queued ahead of the call's own, and
            the error is raised by the first edgedot call made after the device ran the check,
            or at the latest by :func:`edgedot.wait_for_checks`; a graph found right is
            remembered until its tensors are modified in place (views such as ``edge_index[0]``
            made anew each call included), so a graph passed again launches no check. With
            ``False`` nothing is checked. Out-of-range values are never read: an out-of-range
            source makes its destination's output NaN, an out-of-range destination drops its
            edge, and a wrong ``dst_ptr`` makes the destinations concerned NaN.
        return_attention: also return ``alpha`` ``[E, H]`` (before dropout, not differentiable).
        residual: {residual}

    Returns:
        ``out`` ``[Nd, H, Dv]`` in the inputs' dtype, differentiable in ``q``, ``k``, ``v``,
        ``edge_feat`` and ``residual``; ``(out, alpha)`` with ``return_attention=True``.
    """
    check_inputs(q, k, v, src_idx, dst_idx, edge_feat)
    scale = _check_scale(q, scale)
    check_options(q.device, dropout_p, generator, plan, check_indices, return_attention, deterministic)
    residual = check_residual(residual, q, q.shape[0], q.shape[1], v.shape[2])
    groups, check_indices = edge_groupings(plan, dst_ptr, k, q, src_idx, dst_idx, check_indices, (k, v))
    out, _, alpha = eager.call(graph_attention_op, _GraphAttentionFunction, q, k, v, edge_feat, src_idx, dst_idx,
                               *groups, float(scale), float(dropout_p), generator, return_attention,
                               check_indices, residual=residual)[:3]
    return (out, alpha) if return_attention else out


def check_residual(residual, like, num_dst, heads, channels):
    """``residual`` as the attention functions take it (None, or a tensor of ``like``'s dtype and
    device, ``[num_dst, heads, channels]``, ``[heads, channels]`` or ``[heads * channels]``), with
    unit stride on its last dim; raises TypeError / ValueError naming it otherwise."""
    if residual is None:
        return None
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"residual must be a tensor, got {type(residual).__name__}")
    if residual.dtype != like.dtype:
        raise TypeError(f"residual must have the output's dtype {like.dtype}, got {residual.dtype}")
    if residual.device != like.device:
        raise ValueError(f"residual is on {residual.device} but the features are on {like.device}")
    shapes = ((num_dst, heads, channels), (heads, channels), (heads * channels,))
    if tuple(residual.shape) not in shapes:
        raise ValueError(f"residual must be [Nd, H, C] = {list(shapes[0])}, or a bias [H, C] = {list(shapes[1])} or "
                         f"[H * C] = {list(shapes[2])}, got shape {tuple(residual.shape)}")
    return residual if residual.stride(-1) == 1 else residual.contiguous()


def _check_scale(q, scale):
    """The scale, ``1 / sqrt(D)`` by default, after checking it."""
    if scale is None:
        return 1.0 / math.sqrt(q.shape[-1])
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return scale


def check_options(device, dropout_p, generator, plan, check_indices, return_attention, deterministic=None):
    """Checks the keyword arguments the attention functions share (TypeError / ValueError naming
    the argument); ``device`` is the inputs'."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a real number, got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p must lie in [0, 1], got {dropout_p}")
    dropout.check_generator(generator, device)
    if plan is not None and not isinstance(plan, EdgePlan):
        raise TypeError(f"plan must be an edgedot.EdgePlan or None, got {type(plan).__name__}")
    for name, flag, optional in (("deterministic", deterministic, True), ("check_indices", check_indices, False),
                                 ("return_attention", return_attention, False)):
        if not isinstance(flag, bool) and not (optional and flag is None):
            raise TypeError(f"{name} must be a bool{' or None' if optional else ''}, got {type(flag).__name__}")


def edge_groupings(plan, dst_ptr, src_feat, dst_feat, src_idx, dst_idx, check_indices, source_inputs=()):
    """``((dst_group, dst_offsets, src_group, src_offsets), check_indices)`` for an attention op:
    the groupings from ``plan`` or ``dst_ptr`` (checked here against the graph) or built on CUDA,
    and whether the op must still check the graph's indices (False where the grouping's kernel
    ran the check: see :func:`edgedot.runtime.checks.grouping_with_check`). ``src_feat`` /
    ``dst_feat`` have one row per source / destination node. ``source_inputs``: the tensors whose
    gradients the backward computes by walking the edges by source; where one will get a gradient,
    the grouping by source is built too, from the same sort."""
    # An earlier call's graph the device found bad; a checked CUDA call settles them in its check.
    if not (check_indices and dst_feat.is_cuda) and not torch.compiler.is_compiling():
        deferred_checks.raise_found()
    if plan is not None:
        plan.check_matches(src_feat, dst_feat, src_idx, dst_idx)
    num_dst, num_src, is_cuda = dst_feat.shape[0], src_feat.shape[0], dst_feat.is_cuda
    if dst_ptr is not None:
        if plan is not None:
            raise ValueError("pass either plan or dst_ptr, not both")
        dst_ptr = check_dst_ptr(dst_ptr, dst_idx, num_dst)
    if plan is not None and is_cuda:
        return (plan.dst, plan.offsets("dst"), plan.src, plan.offsets("src")), check_indices
    if dst_ptr is not None:
        return (None, dst_ptr, None, None), check_indices  # the edges as they are: no grouping to build
    if is_cuda:
        # Built here, so that the backward reuses them; without a gradient by source, the backward
        # builds none.
        by_src = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in source_inputs)
        if (check_indices and _extension_groups(dst_idx, src_idx) and not torch.jit.is_tracing()
                and not torch.cuda.is_current_stream_capturing()):
            # The grouping's kernel reads every index anyway: it runs the graph's check too (not in
            # a trace, whose op calls would replay without one).
            groups = build_grouping(dst_idx, src_idx, num_dst, num_src, both=by_src, check=True)
            check_indices = False
        else:
            groups = build_grouping(dst_idx, src_idx, num_dst, num_src, both=by_src)
        return (groups if by_src else groups + (None, None)), check_indices
    return (None, None, None, None), check_indices


def next_dropout_state(device="cpu", generator=None):
    """The dropout state ``(seed, offset)``, an int64 ``[2]`` CPU tensor, that the next call of
    :func:`graph_attention`, :func:`edgedot.gat_attention` or :func:`edgedot.gatv2_attention`
    with ``dropout_p > 0`` on ``device`` draws from ``generator`` (default: the device's default
    generator). Nothing is drawn: the generator stays as it is.
    Pass the state to :func:`dropout_keep` for the call's mask. Before a CUDA graph's replay it
    tells the state of the graph's first call with dropout, once the capture has finished on the
    device (``torch.cuda.synchronize()`` after capturing): as capture begins, torch writes the
    generator's device-side state (its seed, offset 0) on the capture stream, and a first replay
    on another stream that overtakes that write draws from offset 0 instead (torch's own dropout
    alike)."""
    return dropout.next_state(device, generator)


def dropout_keep(rng_state, num_edges, heads, p, device=None):
    """The dropout mask of a :func:`graph_attention` (or :func:`edgedot.gat_attention`,
    :func:`edgedot.gatv2_attention`) call that drew ``rng_state``: bool ``[num_edges, heads]``,
    True where ``alpha`` is kept (then scaled by ``1 / (1 - p)``).

    ``rng_state`` is :func:`next_dropout_state`'s tensor (taken before the call), or the
    ``(seed, offset)`` pair as ints. The mask is a hash of the state and ``e * heads + h``,
    the same on CPU and CUDA, so it does not depend on the order the edges are visited in.
    It is made on ``device`` (default: ``rng_state``'s device, or the CPU)."""
    seed, offset = dropout.state_pair(rng_state)
    if device is None:
        device = rng_state.device if isinstance(rng_state, torch.Tensor) else "cpu"
    for name, value in (("num_edges", num_edges), ("heads", heads)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < 0:
            raise ValueError(f"{name} must be non-negative, got {value}")
    if isinstance(p, bool) or not isinstance(p, numbers.Real):
        raise TypeError(f"p must be a real number, got {type(p).__name__}")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p must lie in [0, 1], got {p}")
    return cpu_attention.keep_mask(dropout.key(seed, offset), 0, num_edges, heads, p, device)


# ------------------------------------------------------------------------------ the custom operators

_lib = torch.library.Library("edgedot", "FRAGMENT")
_lib.define(
    "graph_attention(Tensor q, Tensor k, Tensor v, Tensor? edge_feat, Tensor src_idx, Tensor dst_idx, "
    "Tensor? dst_group, Tensor? dst_offsets, Tensor? src_group, Tensor? src_offsets, float scale, "
    "float dropout_p, Generator? generator, bool return_attention, bool check_indices) "
    "-> (Tensor, Tensor, Tensor, Tensor)", tags=(torch.Tag.nondeterministic_seeded,))
_lib.define(
    "graph_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor? edge_feat, Tensor out, "
    "Tensor lse, Tensor src_idx, Tensor dst_idx, Tensor? dst_group, Tensor? dst_offsets, Tensor? src_group, "
    "Tensor? src_offsets, float scale, float dropout_p, Tensor? rng_state, bool edge_feat_grad, bool kv_grad) "
    "-> (Tensor, Tensor, Tensor, Tensor)")

graph_attention_op = torch.ops.edgedot.graph_attention.default
graph_attention_backward_op = torch.ops.edgedot.graph_attention_backward.default


# Edges a grouping can hold: the kernels count sorted positions in int32.
MAX_EDGES = 2**31 - 1
# Rows of either side: below 2**31 - 1, since the chunk schedule scans num_rows + 1 int32 counts.
MAX_ATTENTION_ROWS = MAX_ROWS - 1
# Widest head dims (D and Dv) of the CUDA kernels (kAttentionMaxDim in csrc/edgedot.h).
CUDA_MAX_DIM = 256


def check_inputs(q, k, v, src_idx, dst_idx, edge_feat):
    """Raises TypeError / ValueError naming the first malformed tensor argument of
    :func:`edgedot.graph_attention`."""
    named = (("q", q), ("k", k), ("v", v), ("src_idx", src_idx), ("dst_idx", dst_idx))
    for name, t in named + (("edge_feat", edge_feat),) * (edge_feat is not None):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D [N, H, D], got shape {tuple(t.shape)}")
        if t.dtype not in FEATURE_DTYPES:
            raise TypeError(f"{name} must be float32, float64, float16 or bfloat16, got {t.dtype}")
        if 0 in t.shape[1:]:
            raise ValueError(f"{name} needs at least one head and one feature, got shape {tuple(t.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"q is {q.dtype} but {name} is {t.dtype}; they must match")
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"k and v must have one row per source node, got {k.shape[0]} and {v.shape[0]}")
    if not q.shape[1] == k.shape[1] == v.shape[1]:
        raise ValueError(f"head counts differ: q has H={q.shape[1]}, k has H={k.shape[1]}, v has H={v.shape[1]}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"feature sizes differ: q has D={q.shape[2]}, k has D={k.shape[2]}")
    if q.is_cuda and max(q.shape[2], v.shape[2]) > CUDA_MAX_DIM:
        raise ValueError(f"on CUDA, q and v take head dims of at most {CUDA_MAX_DIM}, got D={q.shape[2]} "
                         f"and Dv={v.shape[2]}")
    check_indices_pair(src_idx, dst_idx)
    num_edges = src_idx.shape[0]
    if edge_feat is not None:
        want = (num_edges, q.shape[1], q.shape[2])
        if edge_feat.dim() != 3 or tuple(edge_feat.shape) != want:
            raise ValueError(f"edge_feat must be [E, H, D] = {list(want)}, got shape {tuple(edge_feat.shape)}")
        if edge_feat.dtype != q.dtype:
            raise TypeError(f"q is {q.dtype} but edge_feat is {edge_feat.dtype}; they must match")
        if v.shape[2] != q.shape[2]:
            raise ValueError(f"edge_feat is added to the values, so v needs D={q.shape[2]}, got Dv={v.shape[2]}")
    for name, t in (("k", k), ("v", v), ("src_idx", src_idx), ("dst_idx", dst_idx), ("edge_feat", edge_feat)):
        if t is not None and t.device != q.device:
            raise ValueError(f"q is on {q.device} but {name} is on {t.device}; all inputs must share a device")
    if num_edges >= MAX_EDGES:
        raise ValueError(f"src_idx has {num_edges} edges; graph_attention takes fewer than {MAX_EDGES}")
    for name, t in (("q", q), ("k", k)):
        if t.shape[0] > MAX_ATTENTION_ROWS:
            raise ValueError(f"{name} has {t.shape[0]} rows; graph_attention takes at most {MAX_ATTENTION_ROWS}")


def check_op_inputs(q, k, v, edge_feat, src_idx, dst_idx, dropout_p, generator=None):
    """The checks every implementation repeats."""
    check_inputs(q, k, v, src_idx, dst_idx, edge_feat)
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p must lie in [0, 1], got {dropout_p}")
    dropout.check_generator(generator, q.device)


def _lse_dtype(dtype):
    return cpu_attention.acc_dtype(dtype)


def _check_graph(q, k, src_idx, dst_idx, dst_group, dst_offsets):
    # Offsets without a grouping are graph_attention's dst_ptr: checked with the ranges, in one
    # pass (on CUDA on the device, read back later).
    dst_ptr = dst_offsets if dst_group is None else None
    check_graph(src_idx, k.shape[0], dst_idx, q.shape[0], dst_ptr)


# Edges up to which a call needing both groupings sorts both sides' keys at once (one sort's
# launches instead of two). Past it the launches are a small share of the call, and the one sort's
# buffers (twice one side's) would raise the peak memory of the forward.
BOTH_SIDES_MAX_EDGES = 1 << 23


def _extension_groups(row_idx, other_idx):
    """Whether :func:`build_grouping` takes the extension's kernels: plain CUDA tensors outside
    tracing."""
    return (not torch.compiler.is_compiling() and type(row_idx) is torch.Tensor and type(other_idx) is torch.Tensor
            and row_idx.is_cuda and not _is_wrapped(row_idx) and not _is_wrapped(other_idx))


def build_grouping(row_idx, other_idx, num_rows, num_other, both=False, check=False):
    """``(build_side(row_idx, other_idx, num_rows, num_other), its group_offsets)``, and with
    ``both`` the same by ``other_idx`` after them (four tensors). Plain CUDA tensors outside tracing
    take one radix sort and one kernel of the extension (one sort of both sides' keys, up to
    ``BOTH_SIDES_MAX_EDGES`` edges), which give the same tensors bit for bit; fake,
    functorch-wrapped or subclassed tensors and ``torch.compile`` keep the tensor operations, which
    they can trace. With ``check`` (the extension's path only, outside CUDA-graph capture), the
    grouping kernel by ``row_idx`` also runs the graph's deferred range check, ``row_idx`` as the
    destinations (:func:`edgedot.runtime.checks.grouping_with_check`)."""
    if _extension_groups(row_idx, other_idx):
        ext = cuda_module()
        one_sort = both and row_idx.shape[0] <= BOTH_SIDES_MAX_EDGES
        if check:
            groups = grouping_with_check(row_idx, other_idx, num_rows, num_other, one_sort)
        elif one_sort:
            groups = ext.group_edges_both(row_idx, other_idx, num_rows, num_other)
        else:
            groups = ext.group_edges(row_idx, other_idx, num_rows, num_other)
        if both and not one_sort:
            groups += ext.group_edges(other_idx, row_idx, num_other, num_rows)
        return groups
    if check:
        raise ValueError("build_grouping: check needs the extension's grouping (plain CUDA index tensors)")
    groups = ()
    for rows, others, n, n_other in ((row_idx, other_idx, num_rows, num_other),
                                     (other_idx, row_idx, num_other, num_rows))[:2 if both else 1]:
        group = build_side(rows, others, n, n_other)
        groups += (group, group_offsets(group, n))
    return groups


def _grouping(group, offsets, row_idx, other_idx, num_rows, num_other):
    """The grouping the CUDA kernels take: (group, offsets) as given when both are, (None, offsets)
    for edges given sorted (offsets alone), else built here."""
    if group is None and offsets is None:
        return build_grouping(row_idx, other_idx, num_rows, num_other)
    if offsets is None:
        offsets = group_offsets(group, num_rows)
    return group, offsets.to(torch.int64).contiguous()  # a dst_ptr comes as given


# Whether the CUDA backwards of graph attention, AGNN, GAT and GATv2 keep each (edge, head)'s
# alpha and ds (GAT: dz; GATv2: and the signs of m) between their two passes, where they fit in
# memory (8 bytes per edge and head at float32 accumulation; GATv2 12 at bf16 x 32): the source
# pass then gathers fewer rows and recomputes no score. Off, it recomputes them, with the same
# gradients bit for bit; the tests compare the two.
BACKWARD_RECORDS = True


def backward_groupings(dst_group, dst_offsets, src_group, src_offsets, src_idx, dst_idx, num_src, num_dst, by_src):
    """A CUDA backward's groupings (see :func:`_grouping`): by destination, and by source where
    ``by_src`` (else as given)."""
    dst_group, dst_offsets = _grouping(dst_group, dst_offsets, dst_idx, src_idx, num_dst, num_src)
    if by_src:
        src_group, src_offsets = _grouping(src_group, src_offsets, src_idx, dst_idx, num_src, num_dst)
    return dst_group, dst_offsets, src_group, src_offsets


def draw_cpu(like, dropout_p, generator):
    """A CPU forward's ``(rng_state, key)``: a state drawn from ``generator`` where ``dropout_p``
    is positive, else the empty state of ``like``'s device."""
    if dropout_p == 0:
        return dropout.no_state(like), 0
    rng_state = dropout.draw_cpu(generator)
    return rng_state, dropout.recorded_key(rng_state, dropout_p)


def forward_fake(like, num_dst, channels, num_edges, dropout_p, return_attention):
    """A forward op's fake ``(out, lse, alpha, rng_state)`` for ``like`` ``[N, H, ...]``."""
    heads = like.shape[1]
    out = like.new_empty((num_dst, heads, channels))
    lse = like.new_empty((num_dst, heads), dtype=_lse_dtype(like.dtype))
    alpha = like.new_empty((num_edges, heads) if return_attention else (0,))
    return out, lse, alpha, dropout.fake_state(like, dropout_p)


def _check_call_graph(q, k, v, edge_feat, src_idx, dst_idx, dst_group, dst_offsets, *_):
    """The forward's check of the graph: the CPU's, every call (``check_indices`` only spares CUDA
    a wait), and the eager CUDA call's where ``check_indices``."""
    _check_graph(q, k, src_idx, dst_idx, dst_group, dst_offsets)


def _forward_on_cpu(q, k, v, edge_feat, src_idx, dst_idx, dst_group, dst_offsets, src_group, src_offsets,
                    scale, dropout_p, generator, return_attention, check_indices):
    """The CPU forward, arguments and graph checked: ``((out, lse, alpha, rng_state), kept)``,
    ``kept`` what :func:`edgedot.cpu.attention.backward` may take instead of recomputing (or None)."""
    rng_state, key = draw_cpu(q, dropout_p, generator)
    out, lse, alpha, kept = cpu_attention.forward(q, k, v, edge_feat, src_idx, dst_idx, scale, dropout_p, key,
                                                   return_attention)
    return (out, lse, alpha, rng_state), kept


@torch.library.impl(_lib, "graph_attention", "CPU")
def _forward_cpu(q, k, v, edge_feat, src_idx, dst_idx, dst_group, dst_offsets, src_group, src_offsets,
                 scale, dropout_p, generator, return_attention, check_indices):
    if not eager.arguments_checked():
        check_op_inputs(q, k, v, edge_feat, src_idx, dst_idx, dropout_p, generator)
    _check_call_graph(q, k, v, edge_feat, src_idx, dst_idx, dst_group, dst_offsets)
    return _forward_on_cpu(q, k, v, edge_feat, src_idx, dst_idx, dst_group, dst_offsets, src_group, src_offsets,
                           scale, dropout_p, generator, return_attention, check_indices)[0]


@torch.library.impl(_lib, "graph_attention", "CUDA")
def _forward_cuda(q, k, v, edge_feat, src_idx, dst_idx, dst_group, dst_offsets, src_group, src_offsets,
                  scale, dropout_p, generator, return_attention, check_indices):
    if not eager.arguments_checked():
        check_op_inputs(q, k, v, edge_feat, src_idx, dst_idx, dropout_p, generator)
    if check_indices:
        _check_graph(q, k, src_idx, dst_idx, dst_group, dst_offsets)
    dst_group, dst_offsets = _grouping(dst_group, dst_offsets, dst_idx, src_idx, q.shape[0], k.shape[0])
    # The extension draws the dropout state from the CUDA generator (no wait for the device).
    return cuda_module().attention_forward(q, k, v, edge_feat, src_idx.contiguous(), dst_idx.contiguous(), dst_group,
                                           dst_offsets, scale, dropout_p, generator, return_attention)


@torch.library.register_fake("edgedot::graph_attention")
def _forward_fake(q, k, v, edge_feat, src_idx, dst_idx, dst_group, dst_offsets, src_group, src_offsets,
                  scale, dropout_p, generator, return_attention, check_indices):
    check_op_inputs(q, k, v, edge_feat, src_idx, dst_idx, dropout_p, generator)
    return forward_fake(q, q.shape[0], v.shape[-1], src_idx.shape[0], dropout_p, return_attention)


def _backward_on_cpu(grad_out, q, k, v, edge_feat, out, lse, src_idx, dst_idx, scale, dropout_p, rng_state,
                     edge_feat_grad, kv_grad, kept=None):
    """The CPU backward, arguments checked; ``kept``: what the forward kept, if anything."""
    key = dropout.recorded_key(rng_state, dropout_p)
    dq, dk, dv, d_edge_feat = cpu_attention.backward(grad_out, q, k, v, edge_feat, out, lse, src_idx, dst_idx, scale,
                                                      dropout_p, key, edge_feat_grad, kept)
    return (dq, dk, dv, d_edge_feat) if kv_grad else (dq, k.new_empty(0), v.new_empty(0), d_edge_feat)


@torch.library.impl(_lib, "graph_attention_backward", "CPU")
def _backward_cpu(grad_out, q, k, v, edge_feat, out, lse, src_idx, dst_idx, dst_group, dst_offsets, src_group,
                  src_offsets, scale, dropout_p, rng_state, edge_feat_grad, kv_grad):
    if not eager.arguments_checked():
        check_op_inputs(q, k, v, edge_feat, src_idx, dst_idx, dropout_p)
    return _backward_on_cpu(grad_out, q, k, v, edge_feat, out, lse, src_idx, dst_idx, scale, dropout_p, rng_state,
                            edge_feat_grad, kv_grad)


@torch.library.impl(_lib, "graph_attention_backward", "CUDA")
def _backward_cuda(grad_out, q, k, v, edge_feat, out, lse, src_idx, dst_idx, dst_group, dst_offsets, src_group,
                   src_offsets, scale, dropout_p, rng_state, edge_feat_grad, kv_grad):
    if not eager.arguments_checked():
        check_op_inputs(q, k, v, edge_feat, src_idx, dst_idx, dropout_p)
    # The grouping by source serves dk and dv alone.
    dst_group, dst_offsets, src_group, src_offsets = backward_groupings(
        dst_group, dst_offsets, src_group, src_offsets, src_idx, dst_idx, k.shape[0], q.shape[0], kv_grad)
    return cuda_module().attention_backward(grad_out, q, k, v, edge_feat, out, lse, src_idx.contiguous(),
                                            dst_idx.contiguous(), dst_group, dst_offsets, src_group, src_offsets,
                                            scale, dropout_p, rng_state, edge_feat_grad, kv_grad, BACKWARD_RECORDS)


@torch.library.register_fake("edgedot::graph_attention_backward")
def _backward_fake(grad_out, q, k, v, edge_feat, out, lse, src_idx, dst_idx, dst_group, dst_offsets, src_group,
                   src_offsets, scale, dropout_p, rng_state, edge_feat_grad, kv_grad):
    check_op_inputs(q, k, v, edge_feat, src_idx, dst_idx, dropout_p)
    d_edge_feat = q.new_empty((src_idx.shape[0], q.shape[1], q.shape[2]) if edge_feat_grad else (0,))
    dk, dv = (k.new_empty(k.shape), v.new_empty(v.shape)) if kv_grad else (k.new_empty(0), v.new_empty(0))
    return q.new_empty(q.shape), dk, dv, d_edge_feat


# Positions of the forward op's arguments.
_Q, _K, _V, _EDGE_FEAT = 0, 1, 2, 3


def setup_context(ctx, inputs, output):
    """The autograd context of a forward op of graph attention's form (also GAT's and GATv2's):
    four feature tensors, the indices and groupings, the score's float argument (``ctx.score_arg``:
    the scale, or the negative slope), ``dropout_p``, and outputs ``(out, lse, alpha, rng_state)``."""
    (q, k, v, edge_feat, src_idx, dst_idx, dst_group, dst_offsets, src_group, src_offsets,
     score_arg, dropout_p, _, _, _) = inputs
    out, lse, alpha, rng_state = output
    # alpha is returned for inspection: the backward has no term for it.
    ctx.mark_non_differentiable(lse, alpha, rng_state)
    ctx.set_materialize_grads(False)  # no zeros of E x H for alpha's absent gradient
    ctx.save_for_backward(q, k, v, edge_feat, out, lse, src_idx, dst_idx, dst_group, dst_offsets, src_group,
                          src_offsets, rng_state)
    ctx.score_arg, ctx.dropout_p = score_arg, dropout_p


def _backward(ctx, grad_out, grad_lse, grad_alpha, grad_rng_state):
    if grad_out is None:  # out's gradient is undefined: so are the inputs'
        return (None,) * 15
    (q, k, v, edge_feat, out, lse, src_idx, dst_idx, dst_group, dst_offsets, src_group, src_offsets,
     rng_state) = ctx.saved_tensors
    needs = ctx.needs_input_grad
    edge_feat_grad, kv_grad = bool(needs[_EDGE_FEAT]), bool(needs[_K] or needs[_V])
    kept = eager.take_kept(ctx)
    if kept is not None and not torch.is_grad_enabled():  # (create_graph: the op, whose autograd raises)
        dq, dk, dv, d_edge_feat = _backward_on_cpu(grad_out, q, k, v, edge_feat, out, lse, src_idx, dst_idx,
                                                   ctx.score_arg, ctx.dropout_p, rng_state, edge_feat_grad, kv_grad,
                                                   kept=kept)
    else:
        dq, dk, dv, d_edge_feat = graph_attention_backward_op(
            grad_out, q, k, v, edge_feat, out, lse, src_idx, dst_idx, dst_group, dst_offsets, src_group,
            src_offsets, ctx.score_arg, ctx.dropout_p, rng_state, edge_feat_grad, kv_grad)
    return (dq if needs[_Q] else None, dk if needs[_K] else None, dv if needs[_V] else None,
            d_edge_feat if needs[_EDGE_FEAT] else None) + (None,) * 11


def cuda_autograd(name, check_graph):
    """The eager CUDA call with gradients of a forward op of graph attention's form (arguments
    checked): ``check_graph(*args)`` where ``check_indices``, then the extension's ``name`` (the
    forward under a C++ autograd node, csrc/attention/autograd.cpp), which takes
    :data:`BACKWARD_RECORDS` in place of ``check_indices``, and ``residual`` (added to the output as
    the kernel stores it: :func:`edgedot.runtime.eager.call`)."""
    def call(*args, residual=None):
        if args[-1]:
            check_graph(*args)
        return getattr(cuda_module(), name)(*args[:-1], BACKWARD_RECORDS, residual)
    return call


eager.first_order_only(graph_attention_backward_op, "graph_attention")
_GraphAttentionFunction = eager.register_autograd(graph_attention_op, "GraphAttentionFunction", _backward,
                                                  setup_context, _forward_on_cpu, _check_call_graph,
                                                  cuda_autograd("graph_attention_autograd", _check_call_graph))
