"""Eager calls of the attention ops past ``torch.library``'s autograd wrapper.

``register_autograd`` serves every caller (torch.compile, functorch, subclasses), but each forward
with a setup_context pays for ``torch._library.utils.fill_defaults``, which rebuilds the schema's
argument list once per argument: 50 us for an op of 15 arguments, a large share of a small call's
host time. A plain eager call with gradients takes the same ``setup_context`` and ``backward``
through an ``autograd.Function`` of its own instead. There, and in plain eager calls without
gradients, the op is called below the Autograd dispatch keys (what the wrapper's no-grad path does
after a Python detour of its own: about 12 us a call on a desktop CPU). Anything else calls the op
as it is. On CUDA an op may have a C++ twin of that Function in the extension (``cuda_call`` of
:func:`register_autograd`): ``loss.backward()`` of a CUDA loss runs on autograd's device thread,
where a Python backward costs several times its own host work (NOTES.md's run log), and a C++
node's runs no Python.

On the CPU the eager ``autograd.Function`` calls the op's implementation itself (``cpu_forward``
of :func:`register_autograd`), which returns, besides the op's outputs, what its backward may take
instead of recomputing (the per-edge tensors of a small problem); the backward takes it once
(:func:`take_kept`). A backward without it (the wrapper's, or a second one of a retained graph)
recomputes it, with the same bits. The CPU forward checks the graph's indices first; the
Function's ``graph_checked`` twin does not, for a layer that has checked the same graph
(:mod:`edgedot.ops.checked_graph`).

Inside :func:`call` (after the public function has checked every argument) and inside the
backward of its ``autograd.Function`` (whose inputs are a checked forward's), the implementations
skip the argument checks they make when called as ``torch.ops``: :func:`arguments_checked`. The
checks of the graph's indices are not skipped there.
"""

import threading

import torch

_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_state = threading.local()


def arguments_checked():
    """Whether the running op implementation was reached from :func:`call` or the backward of its
    ``autograd.Function``, whose arguments were checked before (on this thread)."""
    return getattr(_state, "checked", False)


def _checked(fn, *args):
    """``fn(*args)`` with :func:`arguments_checked` true."""
    previous = getattr(_state, "checked", False)
    _state.checked = True
    try:
        return fn(*args)
    finally:
        _state.checked = previous


def register_autograd(op, name, backward, setup_context, cpu_forward=None, cpu_check_graph=None, cuda_call=None):
    """``torch.library.register_autograd(op, backward, setup_context=setup_context)``; returns the
    ``autograd.Function`` (named ``name``) that :func:`call` takes for eager calls of ``op``. With
    ``cuda_call`` (``cuda_call(*args)``: the op's outputs with a C++ autograd node of the extension
    as their ``grad_fn``), eager CUDA calls with gradients take it instead: a backward runs on
    autograd's device thread, where Python costs several times what it costs on the calling
    thread, and a C++ node runs none. With
    ``cpu_forward`` (``cpu_forward(*args) -> (output, kept)``: the op's CPU implementation, which
    also returns what its backward may take), CPU calls of the Function run it and leave ``kept``
    to ``backward`` (:func:`take_kept`), after ``cpu_check_graph(*args)`` (the op's check of the
    graph's indices). The Function's ``graph_checked`` attribute is its twin without that check,
    for a caller that has checked the same graph itself (:mod:`edgedot.ops.checked_graph`); its
    ``cpu_forward`` attribute is ``cpu_forward``, for such a caller's calls with nothing to
    differentiate."""
    torch.library.register_autograd(op, backward, setup_context=setup_context)

    def checked_backward(ctx, *grads):
        return _checked(backward, ctx, *grads)

    def function(function_name, check_graph):
        def forward(ctx, *args):
            if cpu_forward is not None and args[0].device.type == "cpu":
                if check_graph is not None:
                    check_graph(*args)
                output, ctx.kept = cpu_forward(*args)
            else:
                with torch._C._AutoDispatchBelowAutograd():
                    output = op(*args)
            setup_context(ctx, args, output)
            return output

        return type(function_name, (torch.autograd.Function,),
                    {"forward": staticmethod(forward), "backward": staticmethod(checked_backward)})

    eager_function = function(name, cpu_check_graph)
    eager_function.cuda_call = cuda_call
    if cpu_forward is not None:
        eager_function.graph_checked = function(name + "GraphChecked", None)
        eager_function.graph_checked.cpu_forward = staticmethod(cpu_forward)
    return eager_function


def first_order_only(backward_op, forward_name):
    """Registers the autograd of ``backward_op``, the backward of the op ``forward_name``, which has
    no derivative of its own: a backward through its outputs (gradients taken with
    ``create_graph=True``, differentiated again) raises ``RuntimeError`` naming the op. Without
    it PyTorch's fallback would warn and pass no gradient on, which a sum of terms hides."""
    def setup_context(ctx, inputs, output):
        pass

    def backward(ctx, *grads):
        raise RuntimeError(f"edgedot: {forward_name} has no second derivative: its gradients, taken with "
                           f"create_graph=True, cannot be differentiated again")

    torch.library.register_autograd(backward_op, backward, setup_context=setup_context)


def take_kept(ctx):
    """What the forward of :func:`register_autograd`'s Function kept for this backward, or None
    (none kept, taken already, or the wrapper's context); the context lets go of it, so that the
    memory is freed with the backward's."""
    kept = getattr(ctx, "kept", None)
    ctx.kept = None
    return kept


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)  # a Parameter overrides no torch function


def plain_eager(*tensors):
    """Whether a call on ``tensors`` is plain eager: not traced (torch.compile, torch.jit.trace),
    every one a plain ``torch.Tensor`` or ``Parameter`` (no other subclass, no functorch wrapper).
    Such a call may take an extension's C++ autograd node directly, as :func:`call` does."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return False
    return all(type(t) in _PLAIN_TYPES and not _is_wrapped(t) for t in tensors)


def call(op, function, *args, residual=None):
    """``op(*args)``, through ``function`` (:func:`register_autograd`'s for ``op``; on CUDA its
    ``cuda_call`` where it has one) when the call is plain eager autograd: gradients on, some input
    requiring one, not traced (torch.compile, torch.jit.trace), and every tensor argument a plain
    ``torch.Tensor`` (no subclass, no functorch wrapper); a plain eager call with nothing to
    differentiate dispatches below Autograd.

    ``residual`` (checked by the caller: ``[N, H, C]`` like the op's first output, or a bias of
    ``H x C`` elements for every row) is added to that output. A plain eager CUDA call takes
    ``cuda_call(*args, residual=residual)`` with or without gradients: the extension's node adds it
    as the kernel stores the output. Elsewhere it is an add after the op."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return add_residual(op(*args), residual)
    wants_grad = False
    for arg in args:
        if isinstance(arg, torch.Tensor):
            if type(arg) is not torch.Tensor or _is_wrapped(arg):
                return add_residual(op(*args), residual)
            wants_grad = wants_grad or arg.requires_grad
    plain_residual = residual is not None and type(residual) in _PLAIN_TYPES and not _is_wrapped(residual)
    cuda_call = getattr(function, "cuda_call", None)
    if cuda_call is not None and args[0].is_cuda:
        if plain_residual:
            return cuda_call(*args, residual=residual)
        if residual is None and wants_grad and torch.is_grad_enabled():
            return cuda_call(*args)
    if wants_grad and torch.is_grad_enabled():
        return add_residual(_checked(function.apply, *args), residual)
    with torch._C._AutoDispatchBelowAutograd():  # no gradient to record: the wrapper would do the same
        outputs = _checked(op, *args)
    return add_residual(outputs, residual)


def add_residual(outputs, residual):
    """An op's ``outputs`` with ``residual`` (None: nothing) added to the first, as :func:`call` adds
    it where no C++ node does (a bias of ``H x C`` elements broadcast over its rows)."""
    if residual is None:
        return outputs
    out = outputs[0]
    return (out + (residual if residual.dim() == 3 else residual.reshape(out.shape[1:])),) + tuple(outputs[1:])
