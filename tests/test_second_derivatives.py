"""Gradients taken with create_graph=True, differentiated again: edge_dot's and the node logits'
are differentiable (gradgradcheck in float64); the attention ops' first-order gradients are
right, and a backward through them raises naming the op instead of passing no gradient on."""

import pytest
import torch

import edgedot
import edgedot.nn
from edgedot.ops.edge_dot import edge_dot_op
from edgedot.ops.node_logits import gat_node_logit_sides, gat_node_logits
from edgedot.runtime.plan import EdgePlan
from utils import DEVICES, gen, rand_feat, rand_index


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shapes", [((9, 3), (7, 3)), ((9, 2, 3), (7, 1, 3)), ((9, 3), (7, 2, 3))],
                         ids=["2d", "heads_broadcast_dst", "heads_broadcast_src"])
@pytest.mark.parametrize("route", ["default", "plan", "deterministic", "op"])
def test_edge_dot_gradgradcheck(device, shapes, route):
    """Every path (the eager CPU and CUDA Functions, a plan, the registered op) differentiates its
    gradient again: the gradient op's own autograd."""
    g = gen(1)
    src, dst = (rand_feat(shape, torch.float64, device, g).requires_grad_() for shape in shapes)
    src_idx, dst_idx = rand_index(9, 30, device=device, g=g), rand_index(7, 30, device=device, g=g)
    if route == "op":
        def call(a, b):
            return edge_dot_op(a, b, src_idx, dst_idx, None, None, False, True)
    else:
        kwargs = {"plan": EdgePlan(src_idx, dst_idx, 9, 7)} if route == "plan" else \
            {"deterministic": route == "deterministic"}

        def call(a, b):
            return edgedot.edge_dot(a, b, src_idx, dst_idx, **kwargs)
    assert torch.autograd.gradgradcheck(call, (src, dst))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sides", [None, 2], ids=["att_HC", "att_2HC"])
def test_node_logits_gradgradcheck(device, sides):
    g = gen(2)
    x = rand_feat((11, 2, 5), torch.float64, device, g).requires_grad_()
    att = rand_feat((sides, 2, 5) if sides else (2, 5), torch.float64, device, g).requires_grad_()
    assert torch.autograd.gradgradcheck(gat_node_logits, (x, att))
    grad = rand_feat(((sides,) if sides else ()) + (11, 2), torch.float64, device, g).requires_grad_()

    def backward_op(grad, x, att):
        return torch.ops.edgedot.gat_node_logits_backward(grad, x, att, True, True)

    assert torch.autograd.gradcheck(backward_op, (grad, x, att))
    assert torch.autograd.gradgradcheck(backward_op, (grad, x, att))


@pytest.mark.parametrize("device", DEVICES)
def test_node_logit_sides_gradgradcheck(device):
    g = gen(3)
    x = rand_feat((13, 3, 4), torch.float64, device, g).requires_grad_()
    att_src, att_dst = (rand_feat((1, 3, 4), torch.float64, device, g).requires_grad_() for _ in range(2))
    assert torch.autograd.gradgradcheck(gat_node_logit_sides, (x, att_src, att_dst))


def _attention_calls(device, g):
    n, heads, dim = 12, 2, 4
    q, k, v = (rand_feat((n, heads, dim), torch.float64, device, g).requires_grad_() for _ in range(3))
    a_src, a_dst = (rand_feat((n, heads), torch.float64, device, g).requires_grad_() for _ in range(2))
    att = rand_feat((heads, dim), torch.float64, device, g).requires_grad_()
    beta = rand_feat((heads,), torch.float64, device, g).requires_grad_()
    return {
        "graph_attention": (lambda s, d: edgedot.graph_attention(q, k, v, s, d), (q, k, v)),
        "gat_attention": (lambda s, d: edgedot.gat_attention(v, a_src, a_dst, s, d), (v, a_src, a_dst)),
        "gatv2_attention": (lambda s, d: edgedot.gatv2_attention(k, q, att, s, d), (k, q, att)),
        "agnn_attention": (lambda s, d: edgedot.agnn_attention(v, beta, s, d), (v, beta)),
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["graph_attention", "gat_attention", "gatv2_attention", "agnn_attention"])
def test_attention_ops_refuse_a_second_derivative(device, name):
    g = gen(4)
    call, ins = _attention_calls(device, g)[name]
    src_idx, dst_idx = rand_index(12, 40, device=device, g=g), rand_index(12, 40, device=device, g=g)
    first = torch.autograd.grad(call(src_idx, dst_idx).square().sum(), ins)
    created = torch.autograd.grad(call(src_idx, dst_idx).square().sum(), ins, create_graph=True)
    for a, b in zip(first, created):
        assert torch.equal(a, b.detach())
    # A sum with a differentiable term must not hide the missing derivative.
    penalty = sum(gr.square().sum() for gr in created) + ins[0].sum()
    with pytest.raises(RuntimeError, match=f"{name} has no second derivative"):
        penalty.backward()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name, op", [("TransformerConv", "graph_attention"), ("GATConv", "gat_attention"),
                                      ("GATv2Conv", "gatv2_attention")])
def test_layer_gradient_penalty_raises(device, name, op):
    """A gradient penalty through a layer (WGAN-GP style) raises rather than dropping its term."""
    torch.manual_seed(0)
    layer = getattr(edgedot.nn, name)(8, 4, heads=2).to(device, torch.float64)
    g = gen(5)
    x = rand_feat((10, 8), torch.float64, device, g).requires_grad_()
    edge_index = torch.stack([rand_index(10, 30, device=device, g=g), rand_index(10, 30, device=device, g=g)])
    grad_x, = torch.autograd.grad(layer(x, edge_index).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match=f"{op} has no second derivative"):
        grad_x.square().sum().backward()
