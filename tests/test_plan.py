"""EdgePlan: the packed layout documented in edgedot/runtime/plan.py ``build_side``, checked on the
CPU, and an independent emulation of the plan-driven backward that only reads the unpacked plan."""

import pytest
import torch

import edgedot
import edgedot.runtime.plan
from utils import (CHUNK_EDGES, DEVICES, gen, rand_feat, rand_index, reference_grads, rel_error, requires_cuda,
                   skewed_index)


def unpack(packed, num_edges):
    """(order, row, other) of each sorted position, decoded from build_side's layout."""
    assert packed.dtype == torch.int64 and packed.dim() == 1 and packed.numel() == 2 * num_edges
    packed = packed.cpu()
    order, row_other = packed[:num_edges], packed[num_edges:]
    row = row_other >> 32
    other = (row_other & 0xFFFFFFFF).to(torch.int32).long()  # the low half as a signed 32-bit int
    return order, row, other


def emulate_row_grad(packed, grad_out, other_feat, row_shape):
    """The plan-driven backward from the plan alone: each sorted edge with a real row and other
    row adds grad_out[order] * other_feat[other] to its row, every other row stays zero."""
    num_edges = grad_out.shape[0]
    order, row, other = unpack(packed, num_edges)
    row_heads = row_shape[1] if len(row_shape) == 3 else 1
    other_3d = other_feat if other_feat.dim() == 3 else other_feat.unsqueeze(1)
    heads = max(row_heads, other_3d.shape[1])
    grad = grad_out.reshape(num_edges, heads).to(torch.float64)
    valid = (row < row_shape[0]) & (other >= 0)
    contrib = grad[order[valid]][:, :, None] * other_3d[other[valid]].to(torch.float64)
    if row_heads == 1 and heads > 1:
        contrib = contrib.sum(1, keepdim=True)
    result = torch.zeros((row_shape[0], row_heads, other_3d.shape[-1]), dtype=torch.float64)
    result.index_add_(0, row[valid], contrib)
    return result.reshape(row_shape)


def check_layout(packed, row_idx, other_idx, num_rows, num_other):
    """Invariants of build_side's documented layout."""
    num_edges = row_idx.shape[0]
    rows, others = row_idx.long().cpu(), other_idx.long().cpu()
    keys = torch.where((rows >= 0) & (rows < num_rows), rows, torch.full_like(rows, num_rows))
    order, row, other = unpack(packed, num_edges)
    assert sorted(order.tolist()) == list(range(num_edges)), "order is not a permutation"
    assert torch.equal(order, torch.sort(keys, stable=True).indices), "order is not the stable sort by row"
    assert torch.equal(row, keys[order])
    assert (row[1:] >= row[:-1]).all()
    expect_other = torch.where((others >= 0) & (others < num_other), others, torch.full_like(others, -1))
    assert torch.equal(other, expect_other[order])


def _graphs():
    """name -> (num_rows, num_other, row_idx, other_idx)."""
    g = gen(0)
    cases = {}
    # Rows just under/at/over a chunk, a very long row, and empty rows in between.
    hot = {0: 3 * CHUNK_EDGES + 17, 2: CHUNK_EDGES, 5: CHUNK_EDGES + 1, 9: 2 * CHUNK_EDGES}
    n_e = sum(hot.values()) + 300
    cases["long_and_empty_rows"] = (40, 30, skewed_index(40, n_e, g=g, hot=hot), rand_index(30, n_e, g=g))
    cases["single_hot_row"] = (3, 7, torch.zeros(5 * CHUNK_EDGES, dtype=torch.long),
                               rand_index(7, 5 * CHUNK_EDGES, g=g))
    cases["no_edges"] = (6, 4, torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long))
    cases["no_edges_no_rows"] = (0, 0, torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long))
    cases["many_rows"] = (100_000, 50, rand_index(100_000, 700, g=g), rand_index(50, 700, g=g))
    cases["many_rows_hot"] = (20_000, 9, skewed_index(20_000, 1500, g=g, hot={19_999: 600}), rand_index(9, 1500, g=g))
    cases["uniform"] = (64, 64, rand_index(64, 1000, torch.int32, g=g), rand_index(64, 1000, torch.int32, g=g))
    cases["big_hot"] = (5000, 300, skewed_index(5000, 1 << 20, g=g, hot={17: 5000}), rand_index(300, 1 << 20, g=g))
    cases["last_row_only"] = (10, 10, torch.full((CHUNK_EDGES * 2 + 1,), 9), rand_index(10, CHUNK_EDGES * 2 + 1, g=g))
    return cases


GRAPHS = _graphs()


@pytest.mark.parametrize("name", list(GRAPHS))
def test_layout(name):
    num_rows, num_other, row_idx, other_idx = GRAPHS[name]
    packed = edgedot.runtime.plan.build_side(row_idx, other_idx, num_rows, num_other)
    check_layout(packed, row_idx, other_idx, num_rows, num_other)


def test_layout_folds_out_of_range_indices():
    """Rows outside [0, num_rows) sort last as num_rows, other rows outside [0, num_other) become
    -1, so that no cast wraps them onto a real row."""
    rows = torch.tensor([2, -1, 0, 5, 2**40, 1, 2, -(2**33)])
    others = torch.tensor([0, 1, -5, 3, 2, 2**32 + 1, 4, 1])
    packed = edgedot.runtime.plan.build_side(rows, others, 5, 4)
    check_layout(packed, rows, others, 5, 4)
    order, row, other = unpack(packed, 8)
    assert row.tolist() == [0, 1, 2, 2, 5, 5, 5, 5]
    assert other.tolist() == [-1, -1, 0, -1, 1, 3, 2, 1]


def test_too_many_rows():
    idx = torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="at most"):
        edgedot.runtime.plan.build_side(idx, idx, edgedot.runtime.plan.MAX_ROWS + 1, 5)
    with pytest.raises(ValueError, match="at most"):
        edgedot.EdgePlan(idx, idx, 5, edgedot.runtime.plan.MAX_ROWS + 1)


@pytest.mark.parametrize("heads", ["2d", "heads", "row_broadcast", "other_broadcast"])
@pytest.mark.parametrize("name", [n for n in GRAPHS if n != "big_hot"])
def test_emulated_backward_matches_reference(name, heads):
    num_rows, num_other, row_idx, other_idx = GRAPHS[name]
    g = gen(1)
    num_edges, dim = row_idx.shape[0], 5
    row_shape = {"2d": (dim,), "heads": (3, dim), "row_broadcast": (1, dim), "other_broadcast": (3, dim)}[heads]
    other_shape = {"2d": (dim,), "heads": (3, dim), "row_broadcast": (3, dim), "other_broadcast": (dim,)}[heads]
    row_feat = rand_feat((num_rows, *row_shape), torch.float64, g=g)
    other_feat = rand_feat((num_other, *other_shape), torch.float64, g=g)
    grad_out = rand_feat((num_edges, 3) if heads != "2d" else (num_edges,), torch.float64, g=g)

    packed = edgedot.runtime.plan.build_side(row_idx, other_idx, num_rows, num_other)
    got = emulate_row_grad(packed, grad_out, other_feat, row_feat.shape)
    expect, expect_other = reference_grads(row_feat, other_feat, row_idx, other_idx, grad_out)
    assert got.shape == expect.shape
    assert rel_error(got, expect) <= 1e-12

    # Same for the plan that EdgePlan builds for this side, from both sides' point of view.
    plan = edgedot.EdgePlan(row_idx, other_idx, num_rows, num_other)
    assert torch.equal(plan.src, packed)
    got_other = emulate_row_grad(plan.dst, grad_out, row_feat, other_feat.shape)
    assert got_other.shape == expect_other.shape
    assert rel_error(got_other, expect_other) <= 1e-12


@pytest.mark.parametrize("name", ["long_and_empty_rows", "many_rows_hot", "uniform"])
def test_plan_is_index_dtype_independent(name):
    num_rows, num_other, row_idx, other_idx = GRAPHS[name]
    a = edgedot.EdgePlan(row_idx.int(), other_idx.int(), num_rows, num_other)
    b = edgedot.EdgePlan(row_idx.long(), other_idx.long(), num_rows, num_other)
    assert torch.equal(a.src, b.src) and torch.equal(a.dst, b.dst)


@pytest.mark.parametrize("num_rows, num_edges", [(1, 0), (1, 1), (5, 7), (3, 10 * CHUNK_EDGES + 3), (7, 1 << 17)])
def test_size_is_two_ints_per_edge(num_rows, num_edges):
    row_idx = rand_index(num_rows, num_edges, g=gen(num_edges))
    packed = edgedot.runtime.plan.build_side(row_idx, row_idx, num_rows, num_rows)
    assert packed.shape == (2 * num_edges,) and packed.dtype == torch.int64
    edgedot.runtime.plan.check_plan_layout(packed, num_edges, packed.device)
    with pytest.raises(ValueError, match="does not match"):
        edgedot.runtime.plan.check_plan_layout(packed, num_edges + 1, packed.device)


def test_edge_plan_attributes_and_to():
    g = gen(2)
    s, d = rand_index(10, 50, torch.int32, g=g), rand_index(7, 50, g=g)
    plan = edgedot.EdgePlan(s, d, 10, 7)
    assert (plan.num_edges, plan.num_src, plan.num_dst) == (50, 10, 7)
    assert plan.device == torch.device("cpu")
    assert plan.src.dtype == plan.dst.dtype == torch.int64
    assert "num_edges=50" in repr(plan)
    moved = plan.to("cpu")
    assert moved is not plan and torch.equal(moved.src, plan.src) and torch.equal(moved.dst, plan.dst)
    assert (moved.num_edges, moved.num_src, moved.num_dst) == (50, 10, 7)
    # sizes given as 0-d tensors or numpy-like ints are accepted
    plan2 = edgedot.EdgePlan(s, d, torch.tensor(10), 7)
    assert plan2.num_src == 10 and torch.equal(plan2.src, plan.src)


@requires_cuda
@pytest.mark.parametrize("name", list(GRAPHS))
def test_cuda_plan_matches_cpu_plan(name):
    num_rows, num_other, row_idx, other_idx = GRAPHS[name]
    cpu = edgedot.EdgePlan(row_idx, other_idx, num_rows, num_other)
    gpu = edgedot.EdgePlan(row_idx.cuda(), other_idx.cuda(), num_rows, num_other)
    assert gpu.device.type == "cuda" and gpu.src.is_cuda and gpu.dst.is_cuda
    assert torch.equal(gpu.src.cpu(), cpu.src) and torch.equal(gpu.dst.cpu(), cpu.dst)
    moved = cpu.to("cuda")
    assert moved.device.type == "cuda" and moved.src.is_cuda
    assert torch.equal(moved.src.cpu(), cpu.src)


@requires_cuda
def test_cuda_plan_moved_from_cpu_is_usable():
    g = gen(3)
    s, d = rand_index(100, 2000, g=g), skewed_index(50, 2000, g=g, hot={3: 600})
    plan = edgedot.EdgePlan(s, d, 100, 50).to("cuda")
    src = rand_feat((100, 16), device="cuda", g=g, requires_grad=True)
    dst = rand_feat((50, 16), device="cuda", g=g, requires_grad=True)
    edgedot.edge_dot(src, dst, s.cuda(), d.cuda(), plan=plan).sum().backward()
    rs, rd = reference_grads(src, dst, s.cuda(), d.cuda(), torch.ones(2000, device="cuda"), torch.float64)
    assert rel_error(src.grad, rs) < 1e-5 and rel_error(dst.grad, rd) < 1e-5


def _calls_with_plan(device, num_src, num_dst, g):
    """``name -> call(src_idx, dst_idx, plan)`` for every op that takes a plan, on features of
    ``num_src`` source and ``num_dst`` destination rows."""
    src2, dst2 = rand_feat((num_src, 8), torch.float64, device, g), rand_feat((num_dst, 8), torch.float64, device, g)
    q, k, v = (rand_feat((n, 2, 8), torch.float64, device, g) for n in (num_dst, num_src, num_src))
    a_src, a_dst = rand_feat((num_src, 2), torch.float64, device, g), rand_feat((num_dst, 2), torch.float64, device, g)
    att = rand_feat((2, 8), torch.float64, device, g)
    return {
        "edge_dot": lambda s, d, plan: edgedot.edge_dot(src2, dst2, s, d, plan=plan),
        "graph_attention": lambda s, d, plan: edgedot.graph_attention(q, k, v, s, d, plan=plan),
        "gat_attention": lambda s, d, plan: edgedot.gat_attention(k, a_src, a_dst, s, d, plan=plan),
        "gatv2_attention": lambda s, d, plan: edgedot.gatv2_attention(k, q, att, s, d, plan=plan),
    }


@pytest.mark.parametrize("op", ["edge_dot", "graph_attention", "gat_attention", "gatv2_attention"])
@pytest.mark.parametrize("device", DEVICES)
def test_plan_of_another_graph_of_the_same_size_is_refused(device, op):
    """A plan is matched to the graph, not only to its sizes: another graph with as many edges
    and nodes raises ValueError naming plan; the plan's own graph, in the tensors it was built
    from or in copies (another dtype too), is accepted and gives the plan-free result."""
    g = gen(4)
    num_src, num_dst = 10, 7
    src_idx, dst_idx = rand_index(num_src, 50, g=g).to(device), rand_index(num_dst, 50, g=g).to(device)
    plan = edgedot.EdgePlan(src_idx, dst_idx, num_src, num_dst)
    call = _calls_with_plan(device, num_src, num_dst, g)[op]
    expected = call(src_idx, dst_idx, None)
    for s, d in ((src_idx, dst_idx), (src_idx.clone(), dst_idx.int()), (src_idx, dst_idx)):
        torch.testing.assert_close(call(s, d, plan), expected, rtol=1e-12, atol=1e-12)
    for s, d in ((src_idx.roll(1), dst_idx), (src_idx, dst_idx.flip(0)), (src_idx.roll(1), dst_idx.roll(1))):
        with pytest.raises(ValueError, match="plan .*graph"):
            call(s, d, plan)


def test_plan_of_a_buffer_refilled_behind_the_version_counter():
    """On the CPU the plan is checked against the indices' content on every call: a numpy buffer
    refilled with another graph (no version bump) is refused."""
    np = pytest.importorskip("numpy")
    g = gen(5)
    buffer = np.stack([rand_index(10, 50, g=g).numpy(), rand_index(7, 50, g=g).numpy()])
    edge_index = torch.from_numpy(buffer)
    plan = edgedot.EdgePlan(edge_index[0], edge_index[1], 10, 7)
    call = _calls_with_plan("cpu", 10, 7, g)["graph_attention"]
    call(edge_index[0], edge_index[1], plan)
    buffer[0] = np.roll(buffer[0], 1)
    with pytest.raises(ValueError, match="plan .*graph"):
        call(edge_index[0], edge_index[1], plan)


@pytest.mark.parametrize("device", DEVICES)
def test_transformer_conv_plan_of_another_graph(device):
    pytest.importorskip("torch_geometric")
    import edgedot.nn

    g = gen(6)
    layer = edgedot.nn.TransformerConv(6, 4, heads=2).to(device, torch.float64)
    x = rand_feat((10, 6), torch.float64, device, g)
    edge_index = torch.stack([rand_index(10, 40, g=g), rand_index(10, 40, g=g)]).to(device)
    plan = edgedot.EdgePlan(edge_index[0], edge_index[1], 10, 10)
    torch.testing.assert_close(layer(x, edge_index, plan=plan), layer(x, edge_index), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="plan .*graph"):
        layer(x, edge_index.roll(1, dims=1), plan=plan)


def test_plan_copies_and_one_tensor_for_both_sides():
    """A plan pickles and deep-copies (the copy checks its indices once); one tensor passed as
    both sides is the plan's graph."""
    import copy
    import pickle

    g = gen(7)
    idx = rand_index(6, 30, g=g)
    plan = edgedot.EdgePlan(idx, idx, 6, 6)
    call = _calls_with_plan("cpu", 6, 6, g)["edge_dot"]
    expected = call(idx, idx, None)
    for p in (plan, copy.deepcopy(plan), pickle.loads(pickle.dumps(plan))):
        torch.testing.assert_close(call(idx, idx, p), expected, rtol=0, atol=0)
        with pytest.raises(ValueError, match="plan .*graph"):
            call(idx, idx.roll(1), p)
