"""Plain eager calls of the attention ops take an autograd.Function of their own
(edgedot.runtime.eager); it must give what torch.library's autograd wrapper gives, bit for bit,
and every other call must still take the wrapper."""

import pytest
import torch

import edgedot
from edgedot.runtime import eager
from utils import DEVICES, gen, rand_feat, rand_index


def _calls(device):
    """name -> (call(leaves, src, dst) -> out, leaves)."""
    g = gen(0)
    qkv = [rand_feat((30, 2, 8), torch.float32, device, g) for _ in range(3)]
    gat = [rand_feat(s, torch.float32, device, g) for s in ((30, 2, 8), (30, 2), (30, 2))]
    gatv2 = [rand_feat(s, torch.float32, device, g) for s in ((30, 2, 8), (30, 2, 8), (2, 8))]
    agnn = [rand_feat(s, torch.float32, device, g) for s in ((30, 2, 8), (2,))]
    return {
        "graph_attention": (lambda t, s, d: edgedot.graph_attention(*t, s, d, dropout_p=0.3), qkv),
        "gat_attention": (lambda t, s, d: edgedot.gat_attention(*t, s, d, dropout_p=0.3), gat),
        "gatv2_attention": (lambda t, s, d: edgedot.gatv2_attention(*t, s, d), gatv2),
        "agnn_attention": (lambda t, s, d: edgedot.agnn_attention(*t, s, d), agnn),
    }


def _run(call, leaves, src, dst, seed):
    leaves = [t.detach().requires_grad_() for t in leaves]
    torch.manual_seed(seed)  # the same dropout draw on both paths
    out = call(leaves, src, dst)
    grad_fn = type(out.grad_fn).__name__
    grads = torch.autograd.grad(out, leaves, rand_feat(out.shape, out.dtype, out.device, gen(1)))
    return out, grads, grad_fn


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["graph_attention", "gat_attention", "gatv2_attention", "agnn_attention"])
def test_function_matches_the_wrapper_bitwise(monkeypatch, device, name):
    call, leaves = _calls(device)[name]
    src, dst = rand_index(30, 200, torch.int64, device, gen(2)), rand_index(30, 200, torch.int64, device, gen(3))
    out, grads, grad_fn = _run(call, leaves, src, dst, seed=7)
    assert "Function" in grad_fn and "GeneratedBackward" not in grad_fn, grad_fn
    monkeypatch.setattr(eager, "call", lambda op, function, *args: op(*args))
    out_w, grads_w, grad_fn_w = _run(call, leaves, src, dst, seed=7)
    assert "GeneratedBackward" in grad_fn_w, grad_fn_w
    assert torch.equal(out, out_w)
    for a, b in zip(grads, grads_w):
        assert torch.equal(a, b)


def test_other_calls_take_the_wrapper(monkeypatch):
    class Refused:
        @staticmethod
        def apply(*args):
            raise AssertionError("the eager Function was taken")

    monkeypatch.setattr(edgedot.ops.attention, "_GraphAttentionFunction", Refused)
    call, leaves = _calls("cpu")["graph_attention"]
    src, dst = rand_index(30, 200, torch.int64, "cpu", gen(2)), rand_index(30, 200, torch.int64, "cpu", gen(3))
    # No input requires a gradient, or gradients are off.
    assert call(leaves, src, dst).grad_fn is None
    leaves = [t.detach().requires_grad_() for t in leaves]
    with torch.no_grad():
        call(leaves, src, dst)

    class Index(torch.Tensor):
        pass

    # An index of a tensor subclass.
    call(leaves, src.as_subclass(Index), dst).sum().backward()
    assert all(t.grad is not None for t in leaves)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["graph_attention", "gat_attention", "gatv2_attention", "agnn_attention"])
def test_arguments_checked_once_a_call(monkeypatch, device, name):
    """The public function checks the arguments; the implementations it reaches (forward and
    backward) skip their own argument checks, which a torch.ops call still makes."""
    import edgedot.ops.agnn as agnn_ops
    import edgedot.ops.attention as attention_ops
    import edgedot.ops.gat as gat_ops
    checks = {"graph_attention": (attention_ops, "check_op_inputs"), "gat_attention": (gat_ops, "_check_gat"),
              "gatv2_attention": (gat_ops, "_check_gatv2"), "agnn_attention": (agnn_ops, "check_agnn_inputs")}
    module, check = checks[name]
    seen = []
    original = getattr(module, check)

    def counted(*args):
        seen.append(eager.arguments_checked())
        return original(*args)
    monkeypatch.setattr(module, check, counted)
    call, leaves = _calls(device)[name]
    src, dst = rand_index(30, 50, device=device, g=gen(2)), rand_index(30, 50, device=device, g=gen(3))
    _run(call, leaves, src, dst, seed=0)
    assert not eager.arguments_checked()
    if name == "agnn_attention":  # the public function checks through the same function, before the op
        assert seen == [False]
    else:
        assert seen == []
    if name == "graph_attention":  # a direct call of the operator checks, and names the argument
        q, k, v = leaves
        with pytest.raises(ValueError, match="k has H=1"):
            torch.ops.edgedot.graph_attention(q, k[:, :1], v, None, src, dst, None, None, None, None, 1.0, 0.0, None,
                                              False, True)
        assert seen == [False]
