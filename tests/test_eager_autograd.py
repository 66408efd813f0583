"""Plain eager calls of the attention ops take an autograd.Function of their own
(edgedot.runtime.eager); it must give what torch.library's autograd wrapper gives, bit for bit,
and every other call must still take the wrapper."""

import pytest
import torch

import edgedot
from edgedot.runtime import eager
from utils import DEVICES, gen, launched_kernels, rand_feat, rand_index, requires_cuda


def _wrapper_call(op, function, *args, residual=None):
    """eager.call's stand-in taking the op itself: torch.library's autograd wrapper."""
    return eager.add_residual(op(*args), residual)


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
    grad_fn = out.grad_fn.name()
    grads = torch.autograd.grad(out, leaves, rand_feat(out.shape, out.dtype, out.device, gen(1)))
    return out, grads, grad_fn


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["graph_attention", "gat_attention", "gatv2_attention", "agnn_attention"])
def test_function_matches_the_wrapper_bitwise(monkeypatch, device, name):
    call, leaves = _calls(device)[name]
    src, dst = rand_index(30, 200, torch.int64, device, gen(2)), rand_index(30, 200, torch.int64, device, gen(3))
    out, grads, grad_fn = _run(call, leaves, src, dst, seed=7)
    assert "Function" in grad_fn and "GeneratedBackward" not in grad_fn, grad_fn
    monkeypatch.setattr(eager, "call", _wrapper_call)
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


# ------------------------------------------------------------------------------ CUDA: the C++ nodes


def _cuda_calls(edge):
    """name -> (call(leaves, src, dst, **options) -> out, leaves) for the ops with a C++ node on CUDA,
    with an edge term (its last leaf) where ``edge``."""
    g = gen(4)
    num_edges = 200

    def feats(*shapes):
        return [rand_feat(s, torch.float32, "cuda", g) for s in shapes]
    qkv = feats((30, 2, 8), (30, 2, 8), (30, 2, 8)) + feats((num_edges, 2, 8)) * edge
    gat = feats((30, 2, 8), (30, 2), (30, 2)) + feats((num_edges, 2)) * edge
    gatv2 = feats((30, 2, 8), (30, 2, 8), (2, 8)) + feats((num_edges, 2, 8)) * edge

    def with_edge(fn, keyword):
        return lambda t, s, d, **kw: fn(*t[:3], s, d, **({keyword: t[3]} if edge else {}), **kw)
    return {
        "graph_attention": (with_edge(edgedot.graph_attention, "edge_feat"), qkv),
        "gat_attention": (with_edge(edgedot.gat_attention, "a_edge"), gat),
        "gatv2_attention": (with_edge(edgedot.gatv2_attention, "edge_feat"), gatv2),
    }


def _cuda_graph():
    return rand_index(30, 200, torch.int64, "cuda", gen(2)), rand_index(30, 200, torch.int64, "cuda", gen(3))


@requires_cuda
@pytest.mark.parametrize("name", ["graph_attention", "gat_attention", "gatv2_attention"])
@pytest.mark.parametrize("edge", [False, True])
@pytest.mark.parametrize("wanted", ["all", "first", "last"])
def test_cuda_node_matches_the_wrapper_bitwise(monkeypatch, name, edge, wanted):
    """A CUDA call with gradients takes the extension's C++ node (no Python backward), whose
    outputs and gradients are the wrapper's bit for bit, whichever inputs want gradients."""
    call, leaves = _cuda_calls(edge)[name]
    src, dst = _cuda_graph()
    grad_out = None

    def run():
        nonlocal grad_out
        wants = {"all": range(len(leaves)), "first": [0], "last": [len(leaves) - 1]}[wanted]
        ins = [t.detach().requires_grad_(i in wants) for i, t in enumerate(leaves)]
        torch.manual_seed(3)
        out = call(ins, src, dst, dropout_p=0.25)
        if grad_out is None:
            grad_out = rand_feat(out.shape, out.dtype, out.device, gen(1))
        wanted_ins = [t for t in ins if t.requires_grad]
        return out, torch.autograd.grad(out, wanted_ins, grad_out), out.grad_fn

    out, grads, grad_fn = run()
    assert not isinstance(grad_fn, torch.autograd.function.BackwardCFunction), grad_fn.name()
    assert "AttentionFunction" in grad_fn.name(), grad_fn.name()
    monkeypatch.setattr(eager, "call", _wrapper_call)
    out_w, grads_w, grad_fn_w = run()
    assert "GeneratedBackward" in grad_fn_w.name()
    assert torch.equal(out, out_w)
    assert len(grads) == len(grads_w) > 0
    for a, b in zip(grads, grads_w):
        assert torch.equal(a, b)


@requires_cuda
@pytest.mark.parametrize("name", ["graph_attention", "gat_attention", "gatv2_attention"])
def test_cuda_node_groupings_given_or_built(name):
    """The C++ node with the edges given sorted (``dst_ptr``, int32: the backward sorts by source
    itself) and with a plan: the gradients of a call that builds its groupings, bit for bit."""
    call, leaves = _cuda_calls(False)[name]
    src, dst = _cuda_graph()
    dst, order = torch.sort(dst, stable=True)
    src = src[order]
    grad_out = rand_feat((30, 2, 8), torch.float32, "cuda", gen(1))
    results = []
    for options in ({}, {"dst_ptr": edgedot.index_to_ptr(dst, 30).int()},
                    {"plan": edgedot.EdgePlan(src, dst, 30, 30)}):
        ins = [t.detach().requires_grad_() for t in leaves]
        out = call(ins, src, dst, **options)
        results.append((out,) + torch.autograd.grad(out, ins, grad_out))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


@requires_cuda
@pytest.mark.parametrize("name", ["graph_attention", "gat_attention", "gatv2_attention"])
def test_cuda_node_backward_takes_the_forwards_schedule(monkeypatch, name):
    """On a graph whose hub is chunked, the C++ node's backward takes the destination schedule its
    forward built (one schedule launch fewer than the wrapper, which builds it again), with the
    wrapper's gradients bit for bit."""
    call, leaves = _cuda_calls(False)[name]
    g = gen(6)
    num_edges = 3000
    dst = torch.cat([torch.zeros(1200, dtype=torch.int64, device="cuda"), rand_index(30, num_edges - 1200, torch.int64,
                                                                                    "cuda", g)])
    src = rand_index(30, num_edges, torch.int64, "cuda", g)
    grad_out = None

    def step():
        nonlocal grad_out
        ins = [t.detach().requires_grad_() for t in leaves]
        out = call(ins, src, dst)
        if grad_out is None:
            grad_out = rand_feat(out.shape, out.dtype, out.device, gen(1))
        return out, torch.autograd.grad(out, ins, grad_out)

    def schedules(run):
        return sum("schedule_kernel" in name for name in launched_kernels(run))

    node_grads = step()[1]
    node_schedules = schedules(step)
    monkeypatch.setattr(eager, "call", _wrapper_call)
    wrapper_grads = step()[1]
    assert schedules(step) == node_schedules + 1
    for a, b in zip(node_grads, wrapper_grads):
        assert torch.equal(a, b)


@requires_cuda
@pytest.mark.parametrize("name", ["graph_attention", "gat_attention", "gatv2_attention"])
def test_cuda_node_saved_tensors_and_graph(name):
    """As a Python Function's: ``retain_graph`` backwards repeat their gradients, a second backward
    without it raises, ``create_graph`` gives the same first-order gradients, and an input or
    index tensor modified in place between forward and backward raises instead of giving wrong
    gradients (a loader refilling its index buffer)."""
    call, leaves = _cuda_calls(True)[name]
    src, dst = _cuda_graph()
    ins = [t.detach().requires_grad_() for t in leaves]
    out = call(ins, src, dst)
    grad_out = rand_feat(out.shape, out.dtype, out.device, gen(1))
    first = torch.autograd.grad(out, ins, grad_out, retain_graph=True)
    second = torch.autograd.grad(out, ins, grad_out)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="second time"):
        torch.autograd.grad(out, ins, grad_out)
    out = call(ins, src, dst)
    created = torch.autograd.grad(out, ins, grad_out, create_graph=True)
    for a, b in zip(first, created):
        assert torch.equal(a, b.detach())
    for modify in ("feature", "index"):
        src_now = src.clone()
        features = [t * 1 for t in ins]  # not leaves: modifiable in place
        out = call(features, src_now, dst)
        (features[0] if modify == "feature" else src_now).add_(0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.backward(grad_out)


@requires_cuda
@pytest.mark.parametrize("sides", [1, 2])
def test_cuda_node_logits_node(monkeypatch, sides):
    """GAT's node logits on CUDA take a C++ node too: the wrapper's gradients, bit for bit."""
    from edgedot.ops.node_logits import gat_node_logits
    g = gen(5)
    x = rand_feat((40, 3, 8), torch.float32, "cuda", g)
    att = rand_feat((3, 8) if sides == 1 else (2, 3, 8), torch.float32, "cuda", g)
    grad = rand_feat((40, 3) if sides == 1 else (2, 40, 3), torch.float32, "cuda", g)

    def run():
        ins = [t.detach().requires_grad_() for t in (x, att)]
        out = gat_node_logits(*ins)
        return (out,) + torch.autograd.grad(out, ins, grad), out.grad_fn

    got, grad_fn = run()
    assert "NodeLogitsFunction" in grad_fn.name()
    assert not isinstance(grad_fn, torch.autograd.function.BackwardCFunction)
    monkeypatch.setattr(eager, "call", _wrapper_call)
    want, _ = run()
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_cuda_calls_registered_and_cpu_calls_never_take_them(monkeypatch):
    """The three attention ops and GAT's node logits register a C++ twin for eager CUDA calls; a CPU
    call with gradients takes the Python Function as before."""
    import edgedot.ops.attention as attention_ops
    import edgedot.ops.gat as gat_ops
    import edgedot.ops.node_logits as node_logits_ops
    functions = [attention_ops._GraphAttentionFunction, node_logits_ops._NodeLogitsFunction,
                 *gat_ops._EAGER_FUNCTIONS.values()]
    for function in functions:
        assert callable(function.cuda_call)
        monkeypatch.setattr(function, "cuda_call", lambda *args: pytest.fail("a CPU call took the CUDA node"))
    for name in ("graph_attention", "gat_attention", "gatv2_attention"):
        call, leaves = _calls("cpu")[name]
        src, dst = rand_index(30, 200, torch.int64, "cpu", gen(2)), rand_index(30, 200, torch.int64, "cpu", gen(3))
        _, _, grad_fn = _run(call, leaves, src, dst, seed=1)
        assert "AttentionFunction" in grad_fn
    x, att = (rand_feat(s, torch.float32, "cpu", gen(4)).requires_grad_() for s in ((30, 2, 8), (2, 8)))
    assert "NodeLogitsFunction" in node_logits_ops.gat_node_logits(x, att).grad_fn.name()


def test_plain_eager_takes_tensors_and_parameters_only(monkeypatch):
    """A Parameter (the layers' attention vectors) is as plain as a tensor; another subclass, or a
    traced or compiled call, is not: those go through the dispatcher."""
    class Marked(torch.Tensor):
        pass

    t, p = torch.zeros(2), torch.nn.Parameter(torch.zeros(2))
    assert eager.plain_eager(t, p)
    assert not eager.plain_eager(t, torch.zeros(2).as_subclass(Marked))
    for namespace, name in ((torch.compiler, "is_compiling"), (torch.jit, "is_tracing")):
        with monkeypatch.context() as patch:
            patch.setattr(namespace, name, lambda: True)
            assert not eager.plain_eager(t, p)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_cuda_gat_layer_takes_the_sides_node(dtype):
    """GATConv's CUDA step computes both logits through the sides node (its Parameters passed as
    they are: no concatenation, no stacking), with gradients bitwise those of the [2, H, C] op."""
    layer = edgedot.nn.GATConv(16, 8, heads=2).to("cuda", dtype)
    x = rand_feat((50, 16), dtype, "cuda", gen(6))
    x_proj = layer.lin(x).view(-1, 2, 8).detach().requires_grad_()
    a_src, a_dst = layer._attention_inputs(x_proj, x_proj, None, 50)[1:3]
    assert "NodeLogitsSidesFunction" in a_src.grad_fn.name()
    grads = [rand_feat((50, 2), dtype, "cuda", gen(7 + k)) for k in range(2)]
    got = torch.autograd.grad((a_src, a_dst), (x_proj, layer.att_src, layer.att_dst), grads)
    both = torch.cat([layer.att_src, layer.att_dst])
    from edgedot.ops.node_logits import gat_node_logits
    stacked = gat_node_logits(x_proj, both.view(2, 2, 8))
    assert torch.equal(stacked[0], a_src) and torch.equal(stacked[1], a_dst)
    dx, dboth = torch.autograd.grad(stacked, (x_proj, both), torch.stack(grads))
    assert torch.equal(dx, got[0]) and torch.equal(dboth[:1], got[1]) and torch.equal(dboth[1:], got[2])


def _layer_leaves(dtype, edge, hub):
    """x [N, 2, 8], att_src and att_dst as a layer's [1, 2, 8] Parameters, a_edge or None, and a graph
    (with a chunked hub where ``hub``)."""
    g = gen(8)
    num_nodes, num_edges = 40, 3000 if hub else 300
    x = rand_feat((num_nodes, 2, 8), dtype, "cuda", g)
    atts = [torch.nn.Parameter(rand_feat((1, 2, 8), dtype, "cuda", g)) for _ in range(2)]
    a_edge = rand_feat((num_edges, 2), dtype, "cuda", g) if edge else None
    dst = rand_index(num_nodes, num_edges, torch.int64, "cuda", g)
    if hub:
        dst[:1500] = 3
    return x, atts, a_edge, rand_index(num_nodes, num_edges, torch.int64, "cuda", g), dst


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("edge", [False, True], ids=["", "edge"])
@pytest.mark.parametrize("hub", [False, True], ids=["", "hub"])
@pytest.mark.parametrize("wanted", ["all", "x", "atts", "att_dst"])
def test_cuda_gat_layer_node_matches_the_two_ops(monkeypatch, dtype, edge, hub, wanted):
    """gat_layer_attention's one C++ node (the logits and the attention) gives what the two ops give:
    the output bit for bit, the att and a_edge gradients too, and x's (the two terms now added
    inside the logits' kernel, rounded once) bit for bit in float32 and within a rounding in
    bfloat16; any subset of the inputs may want a gradient."""
    from edgedot.ops import gat as gat_ops
    x, atts, a_edge, src, dst = _layer_leaves(dtype, edge, hub)
    wants = {"all": (True, True, True), "x": (True, False, False), "atts": (False, True, True),
             "att_dst": (False, False, True)}[wanted]

    def run():
        ins = [t.detach().requires_grad_(w) for t, w in zip([x] + atts, wants)]
        edge_in = None if a_edge is None else a_edge.detach().requires_grad_()
        torch.manual_seed(3)
        out = gat_ops.gat_layer_attention(ins[0], ins[1], ins[2], src, dst, a_edge=edge_in, dropout_p=0.2)
        leaves = [t for t in ins + [edge_in] if t is not None and t.requires_grad]
        return out, torch.autograd.grad(out, leaves, rand_feat(out.shape, dtype, "cuda", gen(9))), out.grad_fn

    out, grads, grad_fn = run()
    assert "GatLayerFunction" in grad_fn.name(), grad_fn.name()
    monkeypatch.setattr(gat_ops, "_one_node", lambda *args: False)
    out_two, grads_two, grad_fn_two = run()
    assert "GatLayerFunction" not in grad_fn_two.name()
    assert torch.equal(out, out_two)
    for k, (a, b) in enumerate(zip(grads, grads_two)):
        if k == 0 and wants[0] and dtype != torch.float32:
            torch.testing.assert_close(a, b, rtol=2 ** -7, atol=2 ** -7 * b.abs().max().item())
        else:
            assert torch.equal(a, b), k


@requires_cuda
def test_cuda_gat_layer_node_graph_rules():
    """The one node keeps the attention nodes' rules: create_graph gives the same first-order
    gradients and a second derivative raises; an index refilled in place before the backward raises."""
    x, atts, _, src, dst = _layer_leaves(torch.float32, False, False)
    from edgedot.ops.gat import gat_layer_attention
    ins = [x.detach().requires_grad_()] + [torch.nn.Parameter(a.detach()) for a in atts]
    out = gat_layer_attention(*ins, src, dst)
    grad_out = rand_feat(out.shape, out.dtype, "cuda", gen(10))
    first = torch.autograd.grad(out, ins, grad_out, retain_graph=True)
    created = torch.autograd.grad(out, ins, grad_out, create_graph=True)
    for a, b in zip(first, created):
        assert torch.equal(a, b.detach())
    with pytest.raises(RuntimeError, match="no second derivative"):
        torch.autograd.grad(created[0].square().sum(), ins)
    src_now = src.clone()
    out = gat_layer_attention(*ins, src_now, dst)
    src_now.add_(0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward(grad_out)


@requires_cuda
@pytest.mark.parametrize("autocast", [False, True], ids=["", "autocast"])
def test_cuda_gat_conv_takes_the_layer_node(monkeypatch, autocast):
    """GATConv over one x on CUDA runs its logits and attention as one node; its step gives the two
    ops' output and gradients bit for bit (float32), and under autocast (float32 att beside bfloat16
    features) it keeps the two ops, as before."""
    from edgedot.ops import gat as gat_ops
    layer = edgedot.nn.GATConv(16, 8, heads=2).to("cuda")
    x = rand_feat((60, 16), torch.float32, "cuda", gen(11))
    edge_index = torch.stack([rand_index(60, 400, torch.int64, "cuda", gen(12)),
                              rand_index(60, 400, torch.int64, "cuda", gen(13))])
    taken = []
    one_node = gat_ops._one_node
    monkeypatch.setattr(gat_ops, "_one_node", lambda *args: taken.append(one_node(*args)) or taken[-1])

    def step():
        layer.zero_grad()
        with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
            out = layer(x, edge_index)
        out.float().square().sum().backward()
        return [out] + [p.grad.clone() for p in layer.parameters()]

    got = step()
    assert taken == [not autocast]
    monkeypatch.setattr(gat_ops, "_one_node", lambda *args: False)
    want = step()
    for a, b in zip(got, want):
        assert torch.equal(a, b)
