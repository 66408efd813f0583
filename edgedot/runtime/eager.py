"""Eager calls of the attention ops past ``torch.library``'s autograd wrapper.

``register_autograd`` serves every caller (torch.compile, functorch, subclasses), but each forward
with a setup_context pays for ``torch._library.utils.fill_defaults``, which rebuilds the schema's
argument list once per argument: 50 us for an op of 15 arguments, a large share of a small call's
host time. A plain eager call with gradients takes the same ``setup_context`` and ``backward``
through an ``autograd.Function`` of its own instead; inside it gradients are off, so the op runs
the wrapper's no-grad path. Anything else calls the op as it is.
"""

import torch

_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def register_autograd(op, name, backward, setup_context):
    """``torch.library.register_autograd(op, backward, setup_context=setup_context)``; returns the
    ``autograd.Function`` (named ``name``) that :func:`call` takes for eager calls of ``op``."""
    torch.library.register_autograd(op, backward, setup_context=setup_context)

    def forward(ctx, *args):
        output = op(*args)
        setup_context(ctx, args, output)
        return output

    return type(name, (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward)})


def call(op, function, *args):
    """``op(*args)``, through ``function`` (:func:`register_autograd`'s for ``op``) when the call is
    plain eager autograd: gradients on, some input requiring one, not traced (torch.compile,
    torch.jit.trace), and every tensor argument a plain ``torch.Tensor`` (no subclass, no functorch
    wrapper)."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing() or not torch.is_grad_enabled():
        return op(*args)
    wants_grad = False
    for arg in args:
        if isinstance(arg, torch.Tensor):
            if type(arg) is not torch.Tensor or _is_wrapped(arg):
                return op(*args)
            wants_grad = wants_grad or arg.requires_grad
    return function.apply(*args) if wants_grad else op(*args)
