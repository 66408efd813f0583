"""edgedot::column_sum (x.sum(0) in an order fixed by the shape) on every device against float64,
and the layers' linear / add_bias built on it: their gradients against PyTorch's, under autocast
too; bad arguments."""

import pytest
import torch
import torch.nn.functional as F

from edgedot.ops.column_sum import add_bias, column_sum, linear
from utils import DEVICES, dtype_id, gen, rand_feat, rel_error, requires_cuda

TOL = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("shape", [(180_224, 128), (1000, 7), (65, 1), (3, 515), (100_003, 384), (1, 8), (0, 16),
                                   (16, 0)], ids=lambda s: "x".join(map(str, s)))
def test_matches_float64(device, dtype, shape):
    x = rand_feat(shape, dtype, device, gen(0))
    out = column_sum(x)
    assert out.dtype == dtype and out.shape == shape[1:]
    want = x.double().sum(0)
    if shape[0] == 0:
        assert torch.equal(out, torch.zeros_like(out))
        return
    assert rel_error(out, want) < TOL[dtype]


@pytest.mark.parametrize("device", DEVICES)
def test_strided_rows_and_offsets(device):
    """Rows further apart than their width, a start off a 16-byte boundary, a transposed view."""
    base = rand_feat((4000, 260), torch.float32, device, gen(1))
    for x in (base[:, :128], base[:, 1:129], base[1:, 3:], base[:300].t()):
        assert rel_error(column_sum(x), x.double().sum(0)) < 1e-6


@requires_cuda
def test_bitwise_reproducible():
    x = rand_feat((123_457, 96), torch.float32, "cuda", gen(2))
    first = column_sum(x)
    for _ in range(3):
        assert torch.equal(column_sum(x.clone()), first)


@pytest.mark.parametrize("device", DEVICES)
def test_gradient(device):
    x = rand_feat((517, 9), torch.float64, device, gen(3)).requires_grad_()
    assert torch.autograd.gradcheck(column_sum, (x,))


def test_bad_arguments():
    with pytest.raises(ValueError, match="x must be 2-D"):
        column_sum(torch.ones(3))
    with pytest.raises(TypeError, match="x must be float32"):
        column_sum(torch.ones(3, 2, dtype=torch.int64))
    with pytest.raises(TypeError, match="x must be a tensor"):
        column_sum([[1.0]])


def _grads(fn, *inputs):
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*inputs)
    grad = rand_feat(out.shape, torch.float32, out.device, gen(9)).to(out.dtype)
    return (out,) + torch.autograd.grad(out, inputs, grad)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=dtype_id)
def test_linear_and_add_bias_match_pytorch(device, dtype):
    """Outputs, and gradients of every input, as F.linear's and x + bias's (float64 reference)."""
    g = gen(4)
    x, weight, bias = (rand_feat(s, dtype, device, g) for s in ((2000, 48), (80, 48), (80,)))
    tol = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2e-2}[dtype]
    for fn, ref, inputs in ((linear, F.linear, (x, weight, bias)), (add_bias, torch.add, (x[:, :1].expand(-1, 80)
                                                                                         .contiguous(), bias))):
        got = _grads(fn, *inputs)
        want = _grads(ref, *(t.double() for t in inputs))
        for a, b in zip(got, want):
            assert a.dtype == dtype and rel_error(a, b) < tol


@requires_cuda
@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
def test_autocast_as_pytorch(autocast_dtype):
    """Under autocast: the output's dtype and each gradient's dtype as F.linear's and x + bias's."""
    g = gen(5)
    x, weight, bias = (rand_feat(s, torch.float32, "cuda", g) for s in ((3000, 64), (96, 64), (96,)))
    half = rand_feat((3000, 96), autocast_dtype, "cuda", g)
    with torch.autocast("cuda", dtype=autocast_dtype):
        for fn, ref, inputs in ((linear, F.linear, (x, weight, bias)), (add_bias, torch.add, (half, bias))):
            got, want = _grads(fn, *inputs), _grads(ref, *inputs)
            for a, b in zip(got, want):
                assert a.dtype == b.dtype and a.shape == b.shape
                assert rel_error(a, b) < 2e-2


def test_without_grad_or_bias():
    x, weight = torch.randn(10, 4), torch.randn(3, 4)
    assert torch.equal(linear(x, weight), F.linear(x, weight))
    assert add_bias(x, None) is x


@requires_cuda
def test_cuda_nodes_and_second_order():
    """On CUDA, plain tensors and parameters take the extension's C++ nodes (no Python backward);
    a backward that records a graph gives PyTorch's second-order gradients; a tensor subclass
    takes PyTorch's own ops."""
    g = gen(6)
    x = rand_feat((500, 24), torch.float64, "cuda", g).float()
    weight = torch.nn.Parameter(rand_feat((40, 24), torch.float32, "cuda", g))
    bias = torch.nn.Parameter(rand_feat((40,), torch.float32, "cuda", g))
    for out in (linear(x, weight, bias), add_bias(x[:, :1].expand(-1, 40).contiguous(), bias)):
        assert not isinstance(out.grad_fn, torch.autograd.function.BackwardCFunction), out.grad_fn.name()
        assert "Function" in out.grad_fn.name()

    def second_order(fn):
        w, b = weight.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()
        xs = x.detach().clone().requires_grad_()
        dx, = torch.autograd.grad(fn(xs, w, b).square().sum(), xs, create_graph=True)
        return torch.autograd.grad(dx.square().sum(), (w, b))

    for a, b in zip(second_order(linear), second_order(F.linear)):
        assert rel_error(a, b) < 1e-5

    class Marked(torch.Tensor):
        pass

    out = linear(x.as_subclass(Marked), weight, bias)
    assert type(out) is Marked and "LinearFunction" not in out.grad_fn.name(), out.grad_fn.name()
    assert torch.equal(out.as_subclass(torch.Tensor), F.linear(x, weight, bias))
