"""Edge-wise dot products: :func:`edge_dot`, the public entry point, and the custom operators
behind it (schemas, per-device implementations, fake tensors, autograd).

``edgedot::edge_dot``       forward; the plans ride along only for the backward.
``edgedot::edge_dot_grad``  gradient for one side ("rows"), given the other side's features, by
                            the reduction named in ``reduction`` (REDUCTIONS).

Both are registered with ``torch.library`` so ``torch.compile(fullgraph=True)`` traces through
them and ``torch.library.opcheck`` holds.
"""

import functools

import torch

from ..cpu import edge_dot as cpu_edge_dot
from ..runtime.build import cuda_module
from ..runtime.checks import check_graph, check_inputs, check_tensors, output_shape
from ..runtime.plan import EdgePlan, check_plan_layout

_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor

__all__ = ["edge_dot", "edge_dot_op", "edge_dot_grad_op", "EagerCUDAEdgeDot", "EagerCPUEdgeDot", "forward_cuda",
           "grad_cuda", "forward_cpu", "grad_cpu"]

# ------------------------------------------------------------------------------ the public function


def edge_dot(src_feat, dst_feat, src_idx, dst_idx, *, plan=None, deterministic=None, check_indices=True):
    """Edge-wise dot products: ``out[e] = <src_feat[src_idx[e]], dst_feat[dst_idx[e]]>``.

    Args:
        src_feat: ``[Ns, D]`` or ``[Ns, H, D]`` features of the source nodes.
        dst_feat: ``[Nd, D]`` or ``[Nd, H, D]`` features of the destination nodes; a head count
            of 1 on one side broadcasts against ``H`` on the other. Same dtype as ``src_feat``
            (float32, float64, float16 or bfloat16; half types accumulate in float32).
        src_idx, dst_idx: 1-D int32 or int64 tensors of length ``E``, read as they are.
        plan: an :class:`edgedot.EdgePlan` of this graph. The backward then reduces each
            gradient row without atomics: deterministic, and no re-sorting per step.
        deterministic: bitwise-reproducible gradients. ``None`` (default) follows
            ``torch.are_deterministic_algorithms_enabled()``. Without a plan this sorts the
            edges in every backward pass.
        check_indices: raise ``IndexError`` naming the index tensor if an index is out of range.
            On CUDA the check waits for the kernel to finish; an index tensor found in range is
            remembered until it is modified in place, so repeated calls on one graph skip the
            wait. With ``False`` the call is always asynchronous and out-of-range edges yield
            NaN. Inside CUDA-graph capture the wait is skipped. Out-of-range indices are never
            read.

    Returns:
        ``[E]`` if both feature tensors are 2-D, else ``[E, H]``, in the features' dtype.
        Differentiable with respect to both feature tensors.
    """
    _check_options(plan, deterministic, check_indices)
    eager_device = _eager_device(src_feat, dst_feat, src_idx, dst_idx)
    if eager_device == "cpu" and plan is None:
        return _eager_cpu(src_feat, dst_feat, src_idx, dst_idx, deterministic, check_indices)
    if eager_device == "cuda" and plan is None and not (torch.is_grad_enabled()
                                                        and (src_feat.requires_grad or dst_feat.requires_grad)):
        return forward_cuda(src_feat, dst_feat, src_idx, dst_idx, check_indices)
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    if plan is None:
        src_plan = dst_plan = None
    else:
        check_tensors(src_feat, dst_feat, src_idx, dst_idx)
        plan.check_matches(src_feat, dst_feat, src_idx, dst_idx)
        src_plan, dst_plan = plan.src, plan.dst
    args = (src_feat, dst_feat, src_idx, dst_idx, src_plan, dst_plan, deterministic, check_indices)
    if eager_device == "cuda":
        return EagerCUDAEdgeDot.apply(*args)
    if eager_device == "cpu":
        check_inputs(src_feat, dst_feat, src_idx, dst_idx)
        return _gathers_checked(EagerCPUEdgeDot.apply, *args, output_shape(src_feat, dst_feat, src_idx.shape[0]))
    # Every implementation checks its inputs; a non-tensor must be named before the dispatcher
    # refuses it in its own words.
    check_tensors(src_feat, dst_feat, src_idx, dst_idx)
    return edge_dot_op(*args)


def _eager_cpu(src_feat, dst_feat, src_idx, dst_idx, deterministic, check_indices):
    """:func:`edge_dot` on plain CPU tensors without a plan: ATen ops that autograd records where
    they serve (their backward then runs as C++ nodes, with no Python), else
    :class:`EagerCPUEdgeDot`. Each path gives the registered op's bits."""
    check_inputs(src_feat, dst_feat, src_idx, dst_idx)
    num_edges = src_idx.shape[0]
    shape = output_shape(src_feat, dst_feat, num_edges)
    grad = torch.is_grad_enabled() and (src_feat.requires_grad or dst_feat.requires_grad)
    if cpu_edge_dot.all_pairs_pay(src_feat, dst_feat, num_edges):
        if not grad or cpu_edge_dot.pairs_backward(src_feat, dst_feat):
            return _gathers_checked(cpu_edge_dot.pair_products, src_feat, dst_feat, src_idx, dst_idx)
    elif not grad:
        return _gathers_checked(cpu_edge_dot.gathered_forward, src_feat, dst_feat, src_idx, dst_idx, shape)
    elif cpu_edge_dot.recordable(src_feat, dst_feat, num_edges, shape[-1] if len(shape) == 2 else 1):
        return _gathers_checked(cpu_edge_dot.recorded_forward, src_feat, dst_feat, src_idx, dst_idx)
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    args = (src_feat, dst_feat, src_idx, dst_idx, None, None, deterministic, check_indices)
    return _gathers_checked(EagerCPUEdgeDot.apply, *args, shape)


def _check_options(plan, deterministic, check_indices):
    """TypeError naming the keyword argument of :func:`edge_dot` that has the wrong type (before
    the dispatcher or the extension refuses it in its own words)."""
    if plan is not None and not isinstance(plan, EdgePlan):
        raise TypeError(f"plan must be an edgedot.EdgePlan or None, got {type(plan).__name__}")
    if deterministic is not None and not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool or None, got {type(deterministic).__name__}")
    if not isinstance(check_indices, bool):
        raise TypeError(f"check_indices must be a bool, got {type(check_indices).__name__}")


def _eager_device(src_feat, dst_feat, src_idx, dst_idx):
    """``"cuda"`` or ``"cpu"`` where the call skips the dispatcher, else None. Plain tensors
    outside tracing skip it (small graphs are bound by its host time); fake, functorch-wrapped or
    other subclassed tensors, torch.compile, and on the CPU torch.jit.trace, go through the
    registered op. The eager path checks devices as the op does."""
    if not (type(src_feat) in _PLAIN and type(dst_feat) in _PLAIN and type(src_idx) in _PLAIN
            and type(dst_idx) in _PLAIN) or torch.compiler.is_compiling() or _is_wrapped(src_feat) \
            or _is_wrapped(dst_feat):
        return None
    if src_feat.is_cuda:
        return "cuda"
    if src_feat.is_cpu and not torch.jit.is_tracing():
        return "cpu"
    return None


_PLAIN = (torch.Tensor, torch.nn.Parameter)


# ------------------------------------------------------------------------------ the custom operators

_lib = torch.library.Library("edgedot", "DEF")
_lib.define(
    "edge_dot(Tensor src_feat, Tensor dst_feat, Tensor src_idx, Tensor dst_idx, "
    "Tensor? src_plan, Tensor? dst_plan, bool deterministic, bool check_indices) -> Tensor")
_lib.define(
    "edge_dot_grad(Tensor grad_out, Tensor row_feat, Tensor other_feat, Tensor row_idx, "
    "Tensor other_idx, Tensor? plan, str reduction) -> Tensor")

# Reductions of edge_dot_grad without a plan (a plan overrides them):
#   "atomic"  edges as given, atomics (the rounding varies from call to call);
#   "sorted"  the caller promises row_idx is non-decreasing; each row written once, bitwise
#             reproducible;
#   "sort"    the op sorts the edges by row (stable radix sort), then as "sorted".
REDUCTIONS = ("atomic", "sorted", "sort")

edge_dot_op = torch.ops.edgedot.edge_dot.default
edge_dot_grad_op = torch.ops.edgedot.edge_dot_grad.default


def _gathers_checked(forward, src_feat, dst_feat, src_idx, dst_idx, *rest):
    """``forward(src_feat, dst_feat, src_idx, dst_idx, *rest)``, a CPU forward whose own gathers
    check the index ranges (``index_select`` and indexing refuse an index outside the table before
    reading it; before indexing, which reads a negative index from the end, a negative minimum is
    refused), with the refusal turned into :func:`check_graph`'s error naming the argument. That
    spares a pass over the indices on small graphs."""
    try:
        return forward(src_feat, dst_feat, src_idx, dst_idx, *rest)
    except IndexError:
        check_graph(src_idx, src_feat.shape[0], dst_idx, dst_feat.shape[0])
        raise


def forward_cpu(src_feat, dst_feat, src_idx, dst_idx):
    """The CPU forward behind the custom op and the eager path without autograd, with its checks."""
    check_inputs(src_feat, dst_feat, src_idx, dst_idx)
    shape = output_shape(src_feat, dst_feat, src_idx.shape[0])
    return _gathers_checked(cpu_edge_dot.forward, src_feat, dst_feat, src_idx, dst_idx, shape)


def grad_cpu(grad_out, row_feat, other_feat, row_idx, other_idx, plan, reduction):
    """The CPU gradient of one side behind both the custom op and the eager path. index_add_ on
    the CPU adds in edge order, so it is deterministic without a plan (which it does not need)."""
    return cpu_edge_dot.grad_rows(grad_out, row_feat, other_feat, row_idx, other_idx)


@torch.library.impl(_lib, "edge_dot", "CPU")
def _edge_dot_cpu(src_feat, dst_feat, src_idx, dst_idx, src_plan, dst_plan, deterministic, check_indices):
    return forward_cpu(src_feat, dst_feat, src_idx, dst_idx)


# Outcome codes of the extension's forward (edgedot/csrc/edge_dot/edge_dot_ops.cpp).
_BAD_SRC_INDEX, _BAD_DST_INDEX, _INVALID_INPUTS = 1, 2, 3


def forward_cuda(src_feat, dst_feat, src_idx, dst_idx, check_indices):
    """The CUDA forward behind both the custom op and the eager fast path.

    The extension validates the arguments itself (cheaper than Python), and remembers index
    tensors it found in range; when it refuses the arguments, ``check_inputs`` raises the error
    that names the argument."""
    out, outcome = cuda_module().forward(src_feat, dst_feat, src_idx, dst_idx, check_indices)
    if outcome:
        if outcome == _INVALID_INPUTS:
            check_inputs(src_feat, dst_feat, src_idx, dst_idx)
            raise RuntimeError("edgedot: the CUDA extension refused inputs that check_inputs accepts")
        name, feat = ("src_idx", src_feat) if outcome == _BAD_SRC_INDEX else ("dst_idx", dst_feat)
        raise IndexError(f"{name} holds an index outside [0, {feat.shape[0]})")
    return out


def grad_cuda(grad_out, row_feat, other_feat, row_idx, other_idx, plan, reduction):
    """The CUDA gradient of one side behind both the custom op and the eager fast path."""
    if plan is not None:
        check_plan_layout(plan, row_idx.shape[0], row_feat.device)
    return cuda_module().grad_rows(grad_out, row_feat, other_feat, row_idx, other_idx, plan, reduction)


@torch.library.impl(_lib, "edge_dot", "CUDA")
def _edge_dot_cuda(src_feat, dst_feat, src_idx, dst_idx, src_plan, dst_plan, deterministic, check_indices):
    return forward_cuda(src_feat, dst_feat, src_idx, dst_idx, check_indices)


@torch.library.register_fake("edgedot::edge_dot")
def _edge_dot_fake(src_feat, dst_feat, src_idx, dst_idx, src_plan, dst_plan, deterministic, check_indices):
    check_inputs(src_feat, dst_feat, src_idx, dst_idx)
    return src_feat.new_empty(output_shape(src_feat, dst_feat, src_idx.shape[0]))


def _check_reduction(reduction):
    if reduction not in REDUCTIONS:
        raise ValueError(f"edgedot: unknown reduction {reduction!r} (atomic, sorted or sort)")


@torch.library.impl(_lib, "edge_dot_grad", "CPU")
def _edge_dot_grad_cpu(grad_out, row_feat, other_feat, row_idx, other_idx, plan, reduction):
    _check_reduction(reduction)
    return grad_cpu(grad_out, row_feat, other_feat, row_idx, other_idx, plan, reduction)


torch.library.impl(_lib, "edge_dot_grad", "CUDA")(grad_cuda)


@torch.library.register_fake("edgedot::edge_dot_grad")
def _edge_dot_grad_fake(grad_out, row_feat, other_feat, row_idx, other_idx, plan, reduction):
    _check_reduction(reduction)
    return row_feat.new_empty(row_feat.shape)


def _grad_setup_context(ctx, inputs, output):
    grad_out, row_feat, other_feat, row_idx, other_idx, plan, reduction = inputs
    ctx.save_for_backward(grad_out, other_feat, row_idx, other_idx)
    ctx.deterministic = plan is not None or reduction != "atomic"


def _grad_backward(ctx, upstream):
    """edge_dot_grad is linear in ``grad_out`` and in ``other_feat`` (``row_feat`` gives only the
    shape): its derivatives are edge_dot and edge_dot_grad with the sides' roles swapped."""
    grad_out, other_feat, row_idx, other_idx = ctx.saved_tensors
    needs = ctx.needs_input_grad
    d_grad = d_other = None
    if upstream is not None and needs[0]:
        d_grad = edge_dot(upstream, other_feat, row_idx, other_idx, check_indices=False)
    if upstream is not None and needs[2]:
        d_other = edge_dot_grad_op(grad_out, other_feat, upstream, other_idx, row_idx, None,
                                   "sort" if ctx.deterministic else "atomic")
    return d_grad, None, d_other, None, None, None, None


torch.library.register_autograd("edgedot::edge_dot_grad", _grad_backward, setup_context=_grad_setup_context)


def _setup_context(ctx, inputs, output):
    src_feat, dst_feat, src_idx, dst_idx, src_plan, dst_plan, deterministic, _ = inputs
    ctx.save_for_backward(src_feat, dst_feat, src_idx, dst_idx, src_plan, dst_plan)
    ctx.deterministic = deterministic


# Without a plan, a gradient of at least this many edges whose atomic buffer exceeds half the L2
# cache is reduced over edges sorted by row, unless its index is known to be sorted already: the
# sort costs less than atomics that miss L2 (H200, per side: 2**24 edges, 2.45M rows of 128
# floats, 3.98 against 6.79 ms). Atomics into a buffer that fits L2 stay faster (2M edges, 100k
# rows of one float: 0.06 against 0.19 ms). NOTES.md.
SORT_MIN_EDGES = 1 << 20


@functools.lru_cache(maxsize=None)
def _l2_bytes(device_index):
    return torch.cuda.get_device_properties(device_index).L2_cache_size


def _atomics_miss_l2(row_feat):
    # The atomic buffer holds half types in float32.
    buffer_bytes = row_feat.numel() * max(row_feat.element_size(), 4)
    return 2 * buffer_bytes > _l2_bytes(row_feat.device.index)


def _is_sorted(idx):
    """Whether ``idx`` is non-decreasing (a pass and a wait, in a backward of at least
    SORT_MIN_EDGES edges); None while tracing or capturing a CUDA graph, where nothing may wait.
    Learned anew in every backward: the sorted reduction on an index that is no longer sorted
    would give wrong gradients, and the index's memory may have been rewritten behind PyTorch's
    version counter since it was last seen."""
    if type(idx) is not torch.Tensor or _is_wrapped(idx) or (idx.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    return bool((idx[1:] >= idx[:-1]).all())


def _reduction(row_feat, row_idx, deterministic):
    """The reduction of one side without a plan:

    - on large graphs, a sorted index (checked in every backward): the sorted reduction over the
      edges as given;
    - deterministic mode, or a large graph whose gradient does not fit in L2: the edges sorted
      by row in the op, then the sorted reduction;
    - otherwise atomics over the edges as given (runs of one row summed in registers first).
    """
    large = row_idx.shape[0] >= SORT_MIN_EDGES
    if large and _is_sorted(row_idx):
        return "sorted"
    if deterministic or (large and _atomics_miss_l2(row_feat)):
        return "sort"
    return "atomic"


def _grad_side(grad_rows, grad_out, row_feat, other_feat, row_idx, other_idx, plan, deterministic):
    """One side's gradient: over a given plan's sorted edges, else by ``_reduction``."""
    if plan is not None or not row_idx.is_cuda:
        return grad_rows(grad_out, row_feat, other_feat, row_idx, other_idx, plan, "atomic")
    return grad_rows(grad_out, row_feat, other_feat, row_idx, other_idx, None,
                     _reduction(row_feat, row_idx, deterministic))


def _backward_with(grad_rows, ctx, grad_out):
    src_feat, dst_feat, src_idx, dst_idx, src_plan, dst_plan = ctx.saved_tensors
    grad_src = grad_dst = None
    if ctx.needs_input_grad[0]:
        grad_src = _grad_side(grad_rows, grad_out, src_feat, dst_feat, src_idx, dst_idx, src_plan,
                              ctx.deterministic)
    if ctx.needs_input_grad[1]:
        grad_dst = _grad_side(grad_rows, grad_out, dst_feat, src_feat, dst_idx, src_idx, dst_plan,
                              ctx.deterministic)
    return grad_src, grad_dst, None, None, None, None, None, None


def _backward(ctx, grad_out):
    return _backward_with(edge_dot_grad_op, ctx, grad_out)


torch.library.register_autograd("edgedot::edge_dot", _backward, setup_context=_setup_context)


class EagerCUDAEdgeDot(torch.autograd.Function):
    """Eager CUDA path of :func:`edgedot.edge_dot`: the op's own kernels, checks and backward,
    reached with one Python hop instead of a dispatcher round trip per layer; small graphs are
    bound by exactly that host time. ``forward`` takes ``ctx`` itself: a separate
    ``setup_context`` makes ``Function.apply`` bind the arguments with ``inspect``, which cost
    tens of microseconds per call."""

    @staticmethod
    def forward(ctx, src_feat, dst_feat, src_idx, dst_idx, src_plan, dst_plan, deterministic, check_indices):
        out = forward_cuda(src_feat, dst_feat, src_idx, dst_idx, check_indices)
        inputs = (src_feat, dst_feat, src_idx, dst_idx, src_plan, dst_plan, deterministic, check_indices)
        _setup_context(ctx, inputs, out)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        # create_graph: the op, whose autograd differentiates the gradient again
        return _backward_with(edge_dot_grad_op if torch.is_grad_enabled() else grad_cuda, ctx, grad_out)


class EagerCPUEdgeDot(torch.autograd.Function):
    """Eager CPU path of :func:`edgedot.edge_dot` where its ATen ops are not recorded (problems of
    more than one chunk; half-type tables of more than a chunk; a plan), :class:`EagerCUDAEdgeDot`'s
    twin: the op's CPU forward and gradients without the dispatcher's and ``register_autograd``'s
    round trips. Its caller has checked the arguments, passes the output's shape, and turns the
    gathers' refusal of an out-of-range index into the error naming it (:func:`_gathers_checked`)."""

    @staticmethod
    def forward(ctx, src_feat, dst_feat, src_idx, dst_idx, src_plan, dst_plan, deterministic, check_indices,
                out_shape):
        out = cpu_edge_dot.forward(src_feat, dst_feat, src_idx, dst_idx, out_shape)
        inputs = (src_feat, dst_feat, src_idx, dst_idx, src_plan, dst_plan, deterministic, check_indices)
        _setup_context(ctx, inputs, out)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        # create_graph: the op, whose autograd differentiates the gradient again
        return *_backward_with(edge_dot_grad_op if torch.is_grad_enabled() else grad_cpu, ctx, grad_out), None
