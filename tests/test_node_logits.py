"""edgedot::gat_node_logits (GAT's per-node logits <x[n, h], att[h]>) and gat_node_logit_sides (two
sides given apart, GATConv's) on every device against PyTorch's (x * att).sum(-1) in float64, with
gradients; dtype promotion; bad arguments."""

import pytest
import torch

from edgedot.ops.node_logits import gat_node_logit_sides, gat_node_logits
from utils import DEVICES, dtype_id, gen, rand_feat, rel_error, requires_cuda

TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _case(n, heads, dim, dtype, device, att_dtype=None, seed=0, sides=None):
    """x [n, heads, dim] and att [heads, dim], or [sides, heads, dim]."""
    g = gen(seed)
    x = rand_feat((n, heads, dim), dtype, device, g)
    att = rand_feat((sides, heads, dim) if sides else (heads, dim), att_dtype or dtype, device, g)
    return x, att


def _reference(x, att, grad):
    """PyG's math in float64: (x * att).sum(-1) per side, and its gradients."""
    x64, att64 = (t.detach().double().requires_grad_() for t in (x, att))
    out = (x64 * att64).sum(-1) if att.dim() == 2 else torch.stack([(x64 * a).sum(-1) for a in att64])
    return (out,) + torch.autograd.grad(out, (x64, att64), grad.double())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("shape", [(1000, 4, 32), (517, 3, 7), (3000, 1, 64), (5, 2, 256), (0, 4, 32)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("sides", [None, 2], ids=["att_HC", "att_2HC"])
def test_matches_float64(device, dtype, shape, sides):
    x, att = _case(*shape, dtype, device, sides=sides)
    x.requires_grad_()
    att.requires_grad_()
    out = gat_node_logits(x, att)
    assert out.dtype == dtype and out.shape == ((sides,) if sides else ()) + shape[:2]
    grad = rand_feat(out.shape, torch.float64, device, gen(1)).to(dtype)
    dx, datt = torch.autograd.grad(out, (x, att), grad)
    assert dx.dtype == x.dtype and datt.dtype == att.dtype and datt.shape == att.shape
    ref, ref_dx, ref_datt = _reference(x, att, grad)
    if shape[0] == 0:
        assert out.numel() == 0 and dx.numel() == 0 and torch.equal(datt, torch.zeros_like(datt))
        return
    for name, got, want in (("out", out, ref), ("dx", dx, ref_dx), ("datt", datt, ref_datt)):
        assert rel_error(got, want) < TOL[dtype], name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=dtype_id)
def test_float32_att_beside_half_features(device, x_dtype):
    """As under autocast: float32 att beside half features gives float32 logits (PyTorch's
    promotion); the gradients come back in each input's dtype."""
    x, att = _case(300, 4, 32, x_dtype, device, att_dtype=torch.float32)
    x.requires_grad_()
    att.requires_grad_()
    out = gat_node_logits(x, att)
    assert out.dtype == torch.float32
    grad = rand_feat(out.shape, torch.float32, device, gen(2))
    dx, datt = torch.autograd.grad(out, (x, att), grad)
    assert dx.dtype == x_dtype and datt.dtype == torch.float32
    ref, ref_dx, ref_datt = _reference(x, att, grad)
    assert rel_error(out, ref) < 1e-5
    assert rel_error(datt, ref_datt) < 1e-5
    assert rel_error(dx, ref_dx) < TOL[x_dtype]


@pytest.mark.parametrize("device", DEVICES)
def test_strided_features(device):
    """x as a view of a wider projection (PyG's lin output sliced): read as it is."""
    wide = rand_feat((400, 4, 48), torch.float32, device, gen(3))
    x = wide[:, :, 8:40]
    att = rand_feat((4, 32), torch.float32, device, gen(4))
    assert torch.allclose(gat_node_logits(x, att), (x * att).sum(-1), rtol=1e-5, atol=1e-5)


def test_cpu_is_pytorchs_own_math():
    x, att = _case(200, 4, 32, torch.float32, "cpu")
    assert torch.equal(gat_node_logits(x, att), (x * att).sum(-1))


def test_two_sides_on_cpu_are_each_sides_own_math():
    """Both sides in one call give what each side alone gives (PyG computes them apart)."""
    x, att = _case(200, 4, 32, torch.float32, "cpu", sides=2)
    both = gat_node_logits(x, att)
    assert torch.equal(both[0], (x * att[0]).sum(-1)) and torch.equal(both[1], (x * att[1]).sum(-1))


@requires_cuda
@pytest.mark.parametrize("sides", [None, 2], ids=["att_HC", "att_2HC"])
def test_cuda_repeats_bitwise(sides):
    x, att = _case(20_000, 4, 32, torch.float32, "cuda", seed=5, sides=sides)
    x.requires_grad_()
    att.requires_grad_()
    grad = rand_feat(((sides,) if sides else ()) + (20_000, 4), torch.float32, "cuda", gen(6))
    first = [gat_node_logits(x, att)] + list(torch.autograd.grad(gat_node_logits(x, att), (x, att), grad))
    for _ in range(3):
        again = [gat_node_logits(x, att)] + list(torch.autograd.grad(gat_node_logits(x, att), (x, att), grad))
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sides", [None, 2], ids=["att_HC", "att_2HC"])
def test_opcheck(device, sides):
    x, att = _case(50, 3, 8, torch.float64, device, sides=sides)
    torch.library.opcheck(torch.ops.edgedot.gat_node_logits.default, (x.requires_grad_(), att.requires_grad_()))


@pytest.mark.parametrize("sides", [None, 2], ids=["att_HC", "att_2HC"])
def test_gradcheck(sides):
    x, att = _case(20, 2, 5, torch.float64, "cpu", sides=sides)
    assert torch.autograd.gradcheck(gat_node_logits, (x.requires_grad_(), att.requires_grad_()))


@pytest.mark.parametrize("x, att, error, match", [
    (torch.zeros(4, 8), torch.zeros(1, 8), ValueError, "x must be 3-D"),
    (torch.zeros(4, 2, 8), torch.zeros(2, 7), ValueError, r"att must be \[H, C\] or \[2, H, C\]"),
    (torch.zeros(4, 2, 8), torch.zeros(3, 2, 8), ValueError, r"att must be \[H, C\] or \[2, H, C\]"),
    (torch.zeros(4, 2, 8, dtype=torch.int64), torch.zeros(2, 8), TypeError, "x must be float32"),
    (torch.zeros(4, 2, 8), "att", TypeError, "att must be a tensor"),
])
def test_bad_arguments(x, att, error, match):
    with pytest.raises(error, match=match):
        gat_node_logits(x, att)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtypes", [(torch.float32,) * 2, (torch.float64,) * 2, (torch.float16,) * 2,
                                    (torch.bfloat16,) * 2, (torch.bfloat16, torch.float32),
                                    (torch.float16, torch.float32), (torch.float32, torch.bfloat16),
                                    (torch.bfloat16, torch.float64)],
                         ids=lambda d: "-".join(map(dtype_id, d)))
@pytest.mark.parametrize("shape", [(1000, 4, 32), (517, 3, 7), (0, 4, 32)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("wanted", ["both", "src", "dst"])
def test_sides_match_float64_and_the_stacked_op(device, dtypes, shape, wanted):
    """Each side's logits and every gradient against float64, in PyTorch's promoted dtype; on CUDA
    bitwise what the [2, H, C] op gives (the same kernel sums). A side whose logits are unused gets
    no gradient term. The atts are the layer's [1, H, C] parameters."""
    x_dtype, att_dtype = dtypes
    n, heads, dim = shape
    g = gen(7)
    x = rand_feat(shape, x_dtype, device, g).requires_grad_()
    att_src, att_dst = (rand_feat((1, heads, dim), att_dtype, device, g).requires_grad_() for _ in range(2))
    a_src, a_dst = gat_node_logit_sides(x, att_src, att_dst)
    result = torch.promote_types(x_dtype, att_dtype)
    assert a_src.dtype == a_dst.dtype == result and a_src.shape == a_dst.shape == (n, heads)
    grads = [rand_feat((n, heads), torch.float64, device, gen(8 + k)).to(result) for k in range(2)]
    used = {"both": (a_src, a_dst), "src": (a_src,), "dst": (a_dst,)}[wanted]
    used_grads = {"both": grads, "src": grads[:1], "dst": grads[1:]}[wanted]
    got = torch.autograd.grad(used, (x, att_src, att_dst), used_grads, allow_unused=True)
    assert got[0].dtype == x_dtype and got[0].shape == x.shape
    x64, s64, d64 = (t.detach().double().requires_grad_() for t in (x, att_src, att_dst))
    ref = ((x64 * s64).sum(-1), (x64 * d64).sum(-1))
    ref_used = {"both": ref, "src": ref[:1], "dst": ref[1:]}[wanted]
    want = torch.autograd.grad(ref_used, (x64, s64, d64), [gr.double() for gr in used_grads], allow_unused=True)
    tol = max(TOL[x_dtype], TOL[att_dtype])
    for name, side, side_ref in (("a_src", a_src, ref[0]), ("a_dst", a_dst, ref[1])):
        assert rel_error(side, side_ref) < tol if n else side.numel() == 0, name
    for name, grad, grad_ref, att in (("dx", got[0], want[0], x), ("datt_src", got[1], want[1], att_src),
                                      ("datt_dst", got[2], want[2], att_dst)):
        if grad_ref is None:
            assert grad is None or not grad.any(), name  # unused: absent, or zeros at most
            continue
        assert grad is not None and grad.dtype == att.dtype and grad.shape == att.shape, name
        if n == 0:
            assert not grad.any(), name
        else:
            assert rel_error(grad, grad_ref) < tol, name
    if device == "cuda" and wanted == "both":
        both = torch.cat([att_src, att_dst])
        stacked = gat_node_logits(x, both)
        assert torch.equal(stacked[0], a_src) and torch.equal(stacked[1], a_dst)
        dx, dboth = torch.autograd.grad(stacked, (x, both), torch.stack(grads))
        assert torch.equal(dx, got[0]) and torch.equal(dboth[0:1], got[1]) and torch.equal(dboth[1:2], got[2])


@pytest.mark.parametrize("device", DEVICES)
def test_sides_second_derivatives(device):
    """A backward that records a graph (create_graph) differentiates again, as PyTorch's math does."""
    g = gen(11)
    x = rand_feat((30, 2, 5), torch.float64, device, g).requires_grad_()
    att_src, att_dst = (rand_feat((1, 2, 5), torch.float64, device, g).requires_grad_() for _ in range(2))

    def first_grads(fn):
        a_src, a_dst = fn(x, att_src, att_dst)
        loss = (a_src ** 2).sum() + (a_src * a_dst).sum()
        grads = torch.autograd.grad(loss, (x, att_src, att_dst), create_graph=True)
        return torch.autograd.grad(sum((gr ** 2).sum() for gr in grads), (x, att_src, att_dst))

    ours = first_grads(gat_node_logit_sides)
    theirs = first_grads(lambda x, s, d: ((x * s).sum(-1), (x * d).sum(-1)))
    for got, want in zip(ours, theirs):
        assert rel_error(got, want) < 1e-10


@pytest.mark.parametrize("x, att_src, error, match", [
    (torch.zeros(4, 8), torch.zeros(1, 8), ValueError, "x must be 3-D"),
    (torch.zeros(4, 2, 8), torch.zeros(1, 2, 7), ValueError, r"att_src must hold H x C = 2 x 8"),
    (torch.zeros(4, 2, 8), torch.zeros(2, 8, dtype=torch.int32), TypeError, "att_src must be float32"),
    (torch.zeros(4, 2, 8), None, TypeError, "att_src must be a tensor"),
    ("x", torch.zeros(2, 8), TypeError, "x must be a tensor"),
])
def test_sides_bad_arguments(x, att_src, error, match):
    with pytest.raises(error, match=match):
        gat_node_logit_sides(x, att_src, torch.zeros(2, 8))
