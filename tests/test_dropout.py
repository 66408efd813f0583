"""Dropout state of graph_attention (edgedot/runtime/dropout.py): the (seed, offset) a call draws, the
rng_state its forward returns and its backward reads, reproduction of the mask, generators,
torch.compile; on CUDA, no host synchronisation and CUDA graph replays that draw new masks."""

import pytest
import torch

import edgedot
from edgedot.ops.attention import dropout_keep, next_dropout_state
from edgedot.runtime import dropout
from utils import DEVICES, capture_graph, gen, raises_checked, rand_feat, rand_index, rel_error, requires_cuda

OP = torch.ops.edgedot.graph_attention.default
BACKWARD_OP = torch.ops.edgedot.graph_attention_backward.default


def inputs(device, num_src=23, num_dst=17, num_edges=400, heads=3, dim=8, dtype=torch.float64, seed=0):
    g = gen(seed)
    q = rand_feat((num_dst, heads, dim), dtype, device, g)
    k = rand_feat((num_src, heads, dim), dtype, device, g)
    v = rand_feat((num_src, heads, dim), dtype, device, g)
    ef = rand_feat((num_edges, heads, dim), dtype, device, g)
    src = rand_index(num_src, num_edges, torch.int64, device, g)
    dst = rand_index(num_dst - 1, num_edges, torch.int64, device, g)
    return q, k, v, ef, src, dst


def op_args(q, k, v, ef, src, dst, p, generator, return_attention=False):
    return (q, k, v, ef, src, dst, None, None, None, None, 0.35, p, generator, return_attention, True)


def reference(q, k, v, ef, src, dst, keep, p, grad_out, scale=0.35):
    """float64 reference output and gradients (dq, dk, dv, d_edge_feat) under mask ``keep``."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, ef)]
    out, _ = edgedot.graph_attention_reference(*leaves[:3], src, dst, scale=scale, edge_feat=leaves[3], keep=keep,
                                               dropout_p=p)
    return out, torch.autograd.grad(out, leaves, grad_out.double())


def backward(q, k, v, ef, src, dst, out, lse, p, rng_state, grad_out):
    return BACKWARD_OP(grad_out, q, k, v, ef, out, lse, src, dst, None, None, None, None, 0.35, p, rng_state, True,
                       True)


def assert_close_to(got, want, tol):
    for g, w in zip(got, want):
        assert rel_error(g, w) <= tol, rel_error(g, w)


# ------------------------------------------------------------------------------ state and mask


@pytest.mark.parametrize("device", DEVICES)
def test_op_returns_the_state_it_draws(device):
    """The forward's rng_state is what next_dropout_state said, on the inputs' device; the mask
    dropout_keep gives for it is the one the output and the gradients were made with."""
    q, k, v, ef, src, dst = inputs(device)
    generator = torch.Generator(device).manual_seed(31)
    p = 0.4
    state = next_dropout_state(device, generator)
    assert state.dtype == torch.int64 and state.shape == (2,) and state.device.type == "cpu"
    out, lse, _, rng_state = OP(*op_args(q, k, v, ef, src, dst, p, generator))
    assert rng_state.dtype == torch.int64 and rng_state.shape == (2,) and rng_state.device == q.device
    assert torch.equal(rng_state.cpu(), state)
    assert not torch.equal(next_dropout_state(device, generator), state), "the generator moved on"
    keep = dropout_keep(rng_state, src.shape[0], q.shape[1], p)
    assert keep.device == q.device and 0 < keep.float().mean().item() < 1
    grad_out = rand_feat(out.shape, torch.float64, device, gen(4))
    out64, grads64 = reference(q, k, v, ef, src, dst, keep, p, grad_out)
    assert rel_error(out, out64) <= 1e-12
    assert_close_to(backward(q, k, v, ef, src, dst, out, lse, p, rng_state, grad_out), grads64, 1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_no_state_without_dropout(device):
    q, k, v, ef, src, dst = inputs(device)
    *_, rng_state = OP(*op_args(q, k, v, ef, src, dst, 0.0, None))
    assert rng_state.dtype == torch.int64 and rng_state.shape == (0,)


@pytest.mark.parametrize("device", DEVICES)
def test_backward_reads_the_recorded_state(device):
    """The backward takes its mask from the forward's rng_state, not from the generator (which
    may have moved on in between): another state gives other gradients."""
    q, k, v, ef, src, dst = inputs(device)
    p = 0.5
    generator = torch.Generator(device).manual_seed(8)
    out, lse, _, rng_state = OP(*op_args(q, k, v, ef, src, dst, p, generator))
    OP(*op_args(q, k, v, ef, src, dst, p, generator))  # the generator moves on
    torch.randn(10, generator=generator, device=device)
    grad_out = rand_feat(out.shape, torch.float64, device, gen(5))
    keep = dropout_keep(rng_state, src.shape[0], q.shape[1], p)
    _, grads64 = reference(q, k, v, ef, src, dst, keep, p, grad_out)
    assert_close_to(backward(q, k, v, ef, src, dst, out, lse, p, rng_state, grad_out), grads64, 1e-12)
    other = rng_state + torch.tensor([0, 4], device=rng_state.device)
    same = backward(q, k, v, ef, src, dst, out, lse, p, rng_state, grad_out)[0]
    assert not torch.equal(backward(q, k, v, ef, src, dst, out, lse, p, other, grad_out)[0], same)


@pytest.mark.parametrize("device", DEVICES)
def test_autograd_after_generator_moved_on(device):
    """Through graph_attention: the gradients follow the forward's mask even when the default
    generator draws again between forward and backward."""
    q, k, v, ef, src, dst = inputs(device)
    p = 0.3
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, ef)]
    state = next_dropout_state(device)
    out = edgedot.graph_attention(*leaves[:3], src, dst, scale=0.35, edge_feat=leaves[3], dropout_p=p)
    edgedot.graph_attention(q, k, v, src, dst, dropout_p=p)
    grad_out = rand_feat(out.shape, torch.float64, device, gen(6))
    grads = torch.autograd.grad(out, leaves, grad_out)
    out64, grads64 = reference(q, k, v, ef, src, dst, dropout_keep(state, src.shape[0], q.shape[1], p, device), p,
                               grad_out)
    assert rel_error(out, out64) <= 1e-12
    assert_close_to(grads, grads64, 1e-12)


def test_gradcheck_with_fixed_state(monkeypatch):
    """gradcheck of forward and backward under one fixed state with a nonzero offset."""
    monkeypatch.setattr(dropout, "draw_cpu", lambda generator=None: torch.tensor([-12345, 40]))
    q, k, v, ef, src, dst = inputs("cpu", num_src=6, num_dst=5, num_edges=30, heads=2, dim=3)
    leaves = [t.requires_grad_() for t in (q, k, v, ef)]

    def dropped(q, k, v, ef):
        return edgedot.graph_attention(q, k, v, src, dst, edge_feat=ef, dropout_p=0.45)
    assert torch.autograd.gradcheck(dropped, leaves)
    keep = dropout_keep((-12345, 40), 30, 2, 0.45)
    want, _ = edgedot.graph_attention_reference(q, k, v, src, dst, edge_feat=ef, keep=keep, dropout_p=0.45)
    assert rel_error(dropped(q, k, v, ef), want) <= 1e-12


def test_next_state_draws_nothing():
    generator = torch.Generator().manual_seed(2)
    before = generator.get_state()
    first = next_dropout_state("cpu", generator)
    assert torch.equal(generator.get_state(), before)
    assert torch.equal(next_dropout_state("cpu", generator), first)
    assert first[1] == 0, "CPU states have offset 0"
    torch.manual_seed(5)
    state = next_dropout_state()
    assert torch.equal(dropout.draw_cpu(), state)


def test_key_mixes_seed_and_offset():
    """Nearby seeds and offsets give unrelated masks (about half of the elements differ)."""
    base = dropout_keep((7, 0), 4000, 2, 0.5)
    for other in ((8, 0), (7, 4), (7, 1), (-7, 0)):
        differ = (dropout_keep(other, 4000, 2, 0.5) != base).float().mean().item()
        assert 0.45 < differ < 0.55, other


@pytest.mark.parametrize("bad, error, pattern", [
    (torch.tensor([1, 2, 3]), ValueError, r"int64 tensor of shape \[2\]"),
    (torch.tensor([1.0, 2.0]), ValueError, r"int64 tensor of shape \[2\]"),
    (5, TypeError, "rng_state must be"),
    ((1, 2.5), TypeError, "rng_state must be"),
    ((True, 2), TypeError, "rng_state must be"),
])
def test_dropout_keep_bad_state(bad, error, pattern):
    with raises_checked(error, match=pattern):
        dropout_keep(bad, 10, 2, 0.5)


@pytest.mark.parametrize("kwargs, error, pattern", [
    (dict(num_edges=-1), ValueError, "num_edges"), (dict(heads=2.0), TypeError, "heads"),
    (dict(p=1.5), ValueError, "p must lie"), (dict(p=True), TypeError, "p must be")])
def test_dropout_keep_bad_arguments(kwargs, error, pattern):
    args = dict(rng_state=(1, 0), num_edges=10, heads=2, p=0.5) | kwargs
    with raises_checked(error, match=pattern):
        dropout_keep(**args)


# ------------------------------------------------------------------------------ generators


def meta_inputs():
    return [t.to("meta") for t in inputs("cpu")]


def test_generator_of_another_device():
    q, k, v, ef, src, dst = meta_inputs()
    with raises_checked(ValueError, match="generator is on cpu but the inputs are on meta"):
        edgedot.graph_attention(q, k, v, src, dst, dropout_p=0.5, generator=torch.Generator())
    with raises_checked(ValueError, match="generator is on cpu but the inputs are on cuda:0"):
        dropout.check_generator(torch.Generator(), torch.device("cuda", 0))
    with raises_checked(TypeError, match="generator must be a torch.Generator"):
        dropout.check_generator("cpu", "cpu")
    with raises_checked(ValueError, match="generator is on cpu"):
        next_dropout_state("meta", torch.Generator())


def test_op_checks_generator():
    q, k, v, ef, src, dst = meta_inputs()
    with raises_checked(ValueError, match="generator is on cpu"):
        OP(*op_args(q, k, v, ef, src, dst, 0.5, torch.Generator()))


def test_backward_needs_state():
    q, k, v, ef, src, dst = inputs("cpu")
    out, lse, _, _ = OP(*op_args(q, k, v, ef, src, dst, 0.5, None))
    with raises_checked(ValueError, match="rng_state"):
        backward(q, k, v, ef, src, dst, out, lse, 0.5, None, torch.ones_like(out))


def test_forward_is_tagged_random():
    assert torch.Tag.nondeterministic_seeded in OP.tags


# ------------------------------------------------------------------------------ torch.compile


def test_compile_draws_when_it_runs():
    """A compiled call draws its state at run time, as eager does: each call a new mask, the one
    next_dropout_state tells; the backward follows it."""
    torch._dynamo.reset()
    q, k, v, ef, src, dst = inputs("cpu")
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, ef)]
    p = 0.4

    def f(q, k, v, ef):
        return edgedot.graph_attention(q, k, v, src, dst, scale=0.35, edge_feat=ef, dropout_p=p)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    grad_out = rand_feat((q.shape[0], q.shape[1], v.shape[-1]), torch.float64, "cpu", gen(8))
    outs = []
    for _ in range(2):
        state = next_dropout_state()
        out = compiled(*leaves)
        grads = torch.autograd.grad(out, leaves, grad_out)
        out64, grads64 = reference(q, k, v, ef, src, dst, dropout_keep(state, src.shape[0], q.shape[1], p), p,
                                   grad_out)
        assert rel_error(out, out64) <= 1e-12
        assert_close_to(grads, grads64, 1e-12)
        outs.append(out)
    assert not torch.equal(outs[0], outs[1])


def test_compile_with_generator_breaks_the_graph_only():
    """A generator object cannot be traced: dynamo runs the call eagerly (same result)."""
    torch._dynamo.reset()
    q, k, v, ef, src, dst = inputs("cpu")

    def f(q, generator):
        return edgedot.graph_attention(q, k, v, src, dst, dropout_p=0.5, generator=generator).sin()
    compiled = torch.compile(f, backend="aot_eager")
    assert torch.equal(compiled(q, torch.Generator().manual_seed(3)), f(q, torch.Generator().manual_seed(3)))


# ------------------------------------------------------------------------------ CUDA


@requires_cuda
def test_cuda_mask_equals_public_reproduction():
    q, k, v, ef, src, dst = inputs("cuda", num_src=300, num_dst=200, num_edges=6000, heads=4, dim=32,
                                   dtype=torch.float32)
    p = 0.3
    generator = torch.Generator("cuda").manual_seed(77)
    state = next_dropout_state("cuda", generator)
    assert torch.equal(state, torch.tensor([77, 0]))
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, ef)]
    out = edgedot.graph_attention(*leaves[:3], src, dst, scale=0.35, edge_feat=leaves[3], dropout_p=p,
                                  generator=generator)
    assert generator.get_offset() == dropout.OFFSET_STEP
    grad_out = rand_feat(out.shape, torch.float32, "cuda", gen(9))
    grads = torch.autograd.grad(out, leaves, grad_out)
    keep = dropout_keep(state, src.shape[0], q.shape[1], p, "cuda")
    out64, grads64 = reference(q, k, v, ef, src, dst, keep, p, grad_out)
    assert rel_error(out, out64) <= 1e-5
    assert_close_to(grads, grads64, 1e-5)
    # The op's own rng_state says the same.
    *_, rng_state = OP(*op_args(q, k, v, ef, src, dst, p, generator))
    assert torch.equal(rng_state.cpu(), torch.tensor([77, dropout.OFFSET_STEP]))


@requires_cuda
def test_cuda_generator_of_another_device():
    q, k, v, ef, src, dst = inputs("cuda", dtype=torch.float32)
    with raises_checked(ValueError, match="generator is on cpu but the inputs are on cuda"):
        edgedot.graph_attention(q, k, v, src, dst, dropout_p=0.5, generator=torch.Generator())
    cpu = [t.cpu() for t in (q, k, v, src, dst)]
    with raises_checked(ValueError, match="generator is on cuda:0 but the inputs are on cpu"):
        edgedot.graph_attention(*cpu, dropout_p=0.5, generator=torch.Generator("cuda"))


@requires_cuda
def test_cuda_dropout_never_syncs():
    """Forward and backward with dropout (plan given, indices unchecked) wait for nothing."""
    q, k, v, ef, src, dst = inputs("cuda", num_src=300, num_dst=200, num_edges=6000, heads=4, dim=32,
                                   dtype=torch.float32)
    plan = edgedot.EdgePlan(src, dst, k.shape[0], q.shape[0])
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, ef)]
    grad_out = torch.randn(q.shape[0], q.shape[1], v.shape[-1], device="cuda")

    def step(generator=None):
        out = edgedot.graph_attention(*leaves[:3], src, dst, edge_feat=leaves[3], dropout_p=0.2, plan=plan,
                                      check_indices=False, generator=generator)
        return torch.autograd.grad(out, leaves, grad_out)
    step()  # loads the extension, builds the plan's offsets
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        step(torch.Generator("cuda").manual_seed(1))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def _state_explaining(out, q, k, v, ef, src, dst, p, grad_out, seeds, told):
    """The (seed, offset) pairs among ``seeds`` x offsets within 256 of ``told`` whose mask gives
    ``out``: what a replay drew, when it is not what next_dropout_state told."""
    found = []
    for seed in seeds:
        for offset in range(max(0, told - 256), told + 256, dropout.OFFSET_STEP):
            keep = dropout_keep((seed, offset), src.shape[0], q.shape[1], p, "cuda")
            if rel_error(out, reference(q, k, v, ef, src, dst, keep, p, grad_out)[0]) <= 1e-5:
                found.append((seed, offset))
    return found


@requires_cuda
@pytest.mark.parametrize("before", ["nothing", "own_generator", "sync_debug"])
def test_cuda_graph_replays_draw_new_masks(before):
    """graph_attention with dropout captured in a CUDA graph, forward and backward: each replay
    draws the state the default generator holds then (a new mask), and its output and gradients
    follow that replay's mask; also after calls that drew from a generator of their own, or ran
    under ``set_sync_debug_mode("error")``, as an earlier test in the same process may have."""
    q, k, v, ef, src, dst = inputs("cuda", num_src=300, num_dst=200, num_edges=6000, heads=4, dim=32,
                                   dtype=torch.float32)
    p = 0.35
    plan = edgedot.EdgePlan(src, dst, k.shape[0], q.shape[0])
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, ef)]
    grad_out = torch.randn(q.shape[0], q.shape[1], v.shape[-1], device="cuda")

    def step(generator=None):
        out = edgedot.graph_attention(*leaves[:3], src, dst, scale=0.35, edge_feat=leaves[3], dropout_p=p,
                                      plan=plan, check_indices=False, generator=generator)
        return (out,) + torch.autograd.grad(out, leaves, grad_out)
    if before == "own_generator":
        step(torch.Generator("cuda").manual_seed(1))
    elif before == "sync_debug":
        step()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    graph, static = capture_graph(step)
    replays = []
    for _ in range(3):
        state = next_dropout_state("cuda")
        graph.replay()
        torch.cuda.synchronize()
        keep = dropout_keep(state, src.shape[0], q.shape[1], p, "cuda")
        out64, grads64 = reference(q, k, v, ef, src, dst, keep, p, grad_out)
        if rel_error(static[0], out64) > 1e-5:
            seed, offset = state.tolist()
            drawn = _state_explaining(static[0], q, k, v, ef, src, dst, p, grad_out, {seed, 1}, offset)
            pytest.fail(f"the replay's output follows no mask of the state told, {(seed, offset)}; "
                        f"it follows {drawn or 'none of the states searched'}")
        assert_close_to(static[1:], grads64, 1e-5)
        replays.append((state, static[0].clone()))
    assert not torch.equal(replays[0][0], replays[1][0]), "each replay moves the offset on"
    assert not torch.equal(replays[0][1], replays[1][1]) and not torch.equal(replays[1][1], replays[2][1])
