"""The torch.library custom ops (opcheck, torch.compile) and the nn modules."""

import pytest
import torch

import edgedot
import edgedot.nn
from utils import (DEVICES, CHUNK_EDGES, raises_checked, assert_accurate, check_backward, dtype_id, gen, rand_feat,
                   rand_index, reference, reference64, reference_grads, rel_error, skewed_index)

OP = torch.ops.edgedot.edge_dot.default
GRAD_OP = torch.ops.edgedot.edge_dot_grad.default

SHAPES = {  # name -> (src shape, dst shape)
    "2d": ((9, 8), (7, 8)),
    "heads": ((9, 3, 8), (7, 3, 8)),
    "broadcast": ((9, 1, 8), (7, 3, 8)),
    "mixed_2d_3d": ((9, 3, 8), (7, 8)),
}


def _inputs(shape, dtype, device, requires_grad, index_dtype=torch.int64, num_edges=CHUNK_EDGES + 20, seed=0):
    g = gen(seed)
    src_shape, dst_shape = SHAPES[shape]
    src = rand_feat(src_shape, dtype, device, g, requires_grad)
    dst = rand_feat(dst_shape, dtype, device, g, requires_grad)
    src_idx = skewed_index(src_shape[0], num_edges, index_dtype, device, g, hot={2: CHUNK_EDGES + 1})
    dst_idx = rand_index(dst_shape[0], num_edges, index_dtype, device, g)
    return src, dst, src_idx, dst_idx


OPCHECK_CASES = [  # (dtype, shape, use_plan, requires_grad, deterministic)
    (torch.float32, "2d", False, False, False),
    (torch.float32, "2d", False, True, False),
    (torch.float32, "2d", True, True, True),
    (torch.float32, "heads", True, True, False),
    (torch.float32, "broadcast", False, True, True),
    (torch.float32, "mixed_2d_3d", True, True, True),
    (torch.float64, "broadcast", True, True, False),
    (torch.float64, "mixed_2d_3d", False, False, False),
    (torch.bfloat16, "heads", False, True, True),
    (torch.float16, "2d", True, True, False),
]


@pytest.mark.parametrize("case", OPCHECK_CASES,
                         ids=lambda c: f"{dtype_id(c[0])}-{c[1]}-{'plan' if c[2] else 'noplan'}-"
                                       f"{'grad' if c[3] else 'nograd'}-{'det' if c[4] else 'atomic'}")
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_edge_dot(device, case):
    dtype, shape, use_plan, requires_grad, deterministic = case
    src, dst, src_idx, dst_idx = _inputs(shape, dtype, device, requires_grad,
                                         torch.int32 if use_plan else torch.int64)
    if use_plan:
        plan = edgedot.EdgePlan(src_idx, dst_idx, src.shape[0], dst.shape[0])
        plans = (plan.src, plan.dst)
    else:
        plans = (None, None)
    tolerances = {}
    if device == "cuda" and not (use_plan or deterministic):
        # Atomic CUDA gradients are reduced in a run-dependent order: eager and AOT runs differ
        # by rounding. Allow that (for float32: a few ulps of the summed hot row).
        tolerances = {"rtol": 2e-5, "atol": 2e-4} if dtype == torch.float32 else {"rtol": 1e-9, "atol": 1e-9}
    torch.library.opcheck(OP, (src, dst, src_idx, dst_idx, *plans, deterministic, True), **tolerances)


@pytest.mark.parametrize("dtype, shape, mode", [
    (torch.float32, "2d", "atomic"), (torch.float32, "broadcast", "plan"), (torch.float16, "mixed_2d_3d", "plan"),
    (torch.float64, "heads", "atomic"), (torch.float32, "2d", "sorted"), (torch.bfloat16, "broadcast", "sorted"),
    (torch.float64, "heads", "sorted"), (torch.float32, "2d", "sort"), (torch.float16, "heads", "sort")],
    ids=lambda v: dtype_id(v) if isinstance(v, torch.dtype) else str(v))
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_edge_dot_grad(device, dtype, shape, mode):
    src, dst, src_idx, dst_idx = _inputs(shape, dtype, device, False)
    out_shape = OP(src, dst, src_idx, dst_idx, None, None, False, True).shape
    grad_out = rand_feat(out_shape, dtype, device, gen(1))
    plan = edgedot.EdgePlan(src_idx, dst_idx, src.shape[0], dst.shape[0]) if mode == "plan" else None
    for row, other, row_idx, other_idx, side_plan in (
            (src, dst, src_idx, dst_idx, plan and plan.src), (dst, src, dst_idx, src_idx, plan and plan.dst)):
        reduction = "atomic" if mode == "plan" else mode
        edge_grad = grad_out
        if mode == "sorted":  # the op's contract: row_idx non-decreasing, the rest in the same order
            row_idx, order = torch.sort(row_idx, stable=True)
            other_idx, edge_grad = other_idx[order], grad_out[order]
        torch.library.opcheck(GRAD_OP, (edge_grad, row, other, row_idx, other_idx, side_plan, reduction))
        got = GRAD_OP(edge_grad, row, other, row_idx, other_idx, side_plan, reduction)
        assert got.shape == row.shape and got.dtype == dtype
        # The op computes d(sum(grad_out * out)) / d(row): compare with the reference's autograd.
        low = reference_grads(src, dst, src_idx, dst_idx, grad_out)
        f64 = reference_grads(src, dst, src_idx, dst_idx, grad_out, torch.float64)
        k = 0 if row is src else 1
        assert_accurate(got, low[k], f64[k], dtype, what="edge_dot_grad")


@pytest.mark.parametrize("device", DEVICES)
def test_ops_are_registered(device):
    assert hasattr(torch.ops.edgedot, "edge_dot") and hasattr(torch.ops.edgedot, "edge_dot_grad")
    src, dst, src_idx, dst_idx = _inputs("heads", torch.float32, device, False)
    out = OP(src, dst, src_idx, dst_idx, None, None, False, True)
    torch.testing.assert_close(out, reference(src, dst, src_idx, dst_idx))


def _loss(src, dst, src_idx, dst_idx, plan=None):
    out = edgedot.edge_dot(src, dst, src_idx, dst_idx, plan=plan)
    return (out.float().sin() * out.float()).sum(), out


@pytest.mark.parametrize("shape", ["2d", "broadcast"])
@pytest.mark.parametrize("use_plan", [False, True], ids=["noplan", "plan"])
@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_forward_backward(device, use_plan, shape):
    """torch.compile(fullgraph=True, inductor) of forward + backward matches eager."""
    torch._dynamo.reset()
    src, dst, src_idx, dst_idx = _inputs(shape, torch.float32, device, True)
    plan = edgedot.EdgePlan(src_idx, dst_idx, src.shape[0], dst.shape[0]) if use_plan else None
    compiled = torch.compile(_loss, fullgraph=True, backend="inductor")

    loss_c, out_c = compiled(src, dst, src_idx, dst_idx, plan)
    grads_c = torch.autograd.grad(loss_c, (src, dst))
    loss_e, out_e = _loss(src, dst, src_idx, dst_idx, plan)
    grads_e = torch.autograd.grad(loss_e, (src, dst))
    torch.testing.assert_close(out_c, out_e)
    torch.testing.assert_close(loss_c, loss_e)
    # CUDA atomics without a plan sum in a run-dependent order: allow a few ulps of a hot row.
    grad_tol = {"rtol": 2e-5, "atol": 5e-4} if device == "cuda" and plan is None else {}
    for gc, ge in zip(grads_c, grads_e):
        torch.testing.assert_close(gc, ge, **grad_tol)
    # And eager itself is right.
    assert_accurate(out_e, reference(src, dst, src_idx, dst_idx), reference64(src, dst, src_idx, dst_idx),
                    torch.float32)

    # A second call with new values (same shapes) reuses the compiled graph and is still right.
    src2, dst2, _, _ = _inputs(shape, torch.float32, device, True, seed=1)
    loss_c2, out_c2 = compiled(src2, dst2, src_idx, dst_idx, plan)
    torch.testing.assert_close(out_c2, _loss(src2, dst2, src_idx, dst_idx)[1])


@pytest.mark.parametrize("device", DEVICES)
def test_compile_training_step(device):
    """A compiled module step (decoder + loss) trains like eager."""
    torch._dynamo.reset()
    g = gen(3)
    z = rand_feat((20, 8), torch.float32, device, g)
    edge_index = torch.stack([rand_index(20, 64, device=device, g=g), rand_index(20, 64, device=device, g=g)])
    target = (rand_feat((64,), torch.float32, device, g) > 0).float()
    decoder = edgedot.nn.InnerProductDecoder()

    def step(z):
        prob = decoder(z, edge_index)
        return torch.nn.functional.binary_cross_entropy(prob, target)

    zc = z.clone().requires_grad_(True)
    ze = z.clone().requires_grad_(True)
    torch.compile(step, fullgraph=True)(zc).backward()
    step(ze).backward()
    grad_tol = {"rtol": 2e-5, "atol": 1e-5} if device == "cuda" else {}  # CUDA atomics: rounding order
    torch.testing.assert_close(zc.grad, ze.grad, **grad_tol)


# ---------------------------------------------------------------------------------- nn modules


@pytest.mark.parametrize("device", DEVICES)
def test_edge_dot_module(device):
    src, dst, src_idx, dst_idx = _inputs("broadcast", torch.float32, device, True)
    plan = edgedot.EdgePlan(src_idx, dst_idx, src.shape[0], dst.shape[0])
    for module in (edgedot.nn.EdgeDot(), edgedot.nn.EdgeDot(deterministic=True, check_indices=False)):
        assert isinstance(module, torch.nn.Module)
        assert "deterministic=" in repr(module) and "check_indices=" in repr(module)
        for p in (None, plan):
            out = module(src, dst, src_idx, dst_idx, plan=p)
            assert_accurate(out, reference(src, dst, src_idx, dst_idx),
                            reference64(src, dst, src_idx, dst_idx), torch.float32)
    check_backward(src.detach(), dst.detach(), src_idx, dst_idx, torch.ones(src_idx.shape[0], 3, device=device),
                   plan=plan)


@pytest.mark.parametrize("device", DEVICES)
def test_edge_dot_module_checks_indices(device):
    src, dst, src_idx, dst_idx = _inputs("2d", torch.float32, device, False)
    bad = src_idx.clone()
    bad[3] = src.shape[0]
    with raises_checked(IndexError, match="src_idx"):
        edgedot.nn.EdgeDot()(src, dst, bad, dst_idx)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=dtype_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("device", DEVICES)
def test_inner_product_decoder(device, dtype, index_dtype):
    g = gen(4)
    z = rand_feat((30, 16), dtype, device, g)
    edge_index = torch.stack([rand_index(30, 100, index_dtype, device, g), rand_index(30, 100, index_dtype, device, g)])
    decoder = edgedot.nn.InnerProductDecoder()
    z64 = z.double()
    logits64 = (z64[edge_index[0].long()] * z64[edge_index[1].long()]).sum(-1)
    logits_low = (z[edge_index[0].long()] * z[edge_index[1].long()]).sum(-1)

    raw = decoder(z, edge_index, sigmoid=False)
    assert_accurate(raw, logits_low, logits64, dtype)
    prob = decoder(z, edge_index)  # sigmoid=True by default
    assert prob.shape == (100,) and prob.dtype == dtype
    assert_accurate(prob, torch.sigmoid(logits_low), torch.sigmoid(logits64), dtype)
    assert ((prob >= 0) & (prob <= 1)).all()

    all_raw = decoder.forward_all(z, sigmoid=False)
    assert all_raw.shape == (30, 30)
    assert_accurate(all_raw, z @ z.t(), z64 @ z64.t(), dtype)
    all_prob = decoder.forward_all(z)
    assert_accurate(all_prob, torch.sigmoid(z @ z.t()), torch.sigmoid(z64 @ z64.t()), dtype)
    # forward_all agrees with forward on the listed pairs.
    torch.testing.assert_close(all_raw[edge_index[0].long(), edge_index[1].long()].double(), raw.double(),
                               rtol=0.02 if dtype == torch.bfloat16 else 1e-5,
                               atol=0.1 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_inner_product_decoder_grad(device):
    g = gen(5)
    z = rand_feat((25, 8), torch.float64, device, g, requires_grad=True)
    edge_index = torch.stack([rand_index(25, 80, device=device, g=g), rand_index(25, 80, device=device, g=g)])
    decoder = edgedot.nn.InnerProductDecoder()
    assert torch.autograd.gradcheck(lambda z: decoder(z, edge_index), (z,))
    decoder(z, edge_index).sum().backward()
    zr = z.detach().clone().requires_grad_(True)
    torch.sigmoid((zr[edge_index[0]] * zr[edge_index[1]]).sum(-1)).sum().backward()
    assert rel_error(z.grad, zr.grad) < 1e-12


@pytest.mark.parametrize("bad_shape", [(3, 10), (10,), (2, 5, 1)])
def test_inner_product_decoder_rejects_bad_edge_index(bad_shape):
    z = rand_feat((10, 4))
    with raises_checked(ValueError, match="edge_index"):
        edgedot.nn.InnerProductDecoder()(z, torch.zeros(bad_shape, dtype=torch.long))


def test_inner_product_decoder_matches_pyg():
    pyg = pytest.importorskip("torch_geometric.nn")
    g = gen(6)
    z = rand_feat((30, 16), g=g)
    edge_index = torch.stack([rand_index(30, 100, g=g), rand_index(30, 100, g=g)])
    ours, theirs = edgedot.nn.InnerProductDecoder(), pyg.InnerProductDecoder()
    for sigmoid in (True, False):
        torch.testing.assert_close(ours(z, edge_index, sigmoid=sigmoid), theirs(z, edge_index, sigmoid=sigmoid))
        torch.testing.assert_close(ours.forward_all(z, sigmoid=sigmoid), theirs.forward_all(z, sigmoid=sigmoid))
