"""Training steps on fresh mini-batches without a host wait: a default call of the attention ops and
the layers, forward and backward, never blocks on the GPU (``torch.cuda.set_sync_debug_mode``);
index checks run on the device and report a bad graph at a later call or at
``edgedot.wait_for_checks``; the GAT layers' self-loops are handled in place."""

import pytest
import torch

import edgedot
from edgedot.runtime import checks
from utils import count_graph_checks, gen, launched_kernels, rand_feat, raises_checked, rel_error, requires_cuda

pyg_nn = pytest.importorskip("torch_geometric.nn")

NUM_NODES, SEEDS, FANOUT, HEADS, DIM, IN_CHANNELS = 300, 60, 5, 2, 8, 16


def _batch(g, device, loops=0):
    """A sampled batch as NeighborLoader hands it over: ``SEEDS`` destinations with ``FANOUT``
    in-edges each, grouped by destination; ``loops`` of the edges made self-loops."""
    dst = torch.arange(SEEDS).repeat_interleave(FANOUT)
    src = torch.randint(0, NUM_NODES, (dst.shape[0],), generator=g)
    src[:loops * FANOUT:FANOUT] = dst[:loops * FANOUT:FANOUT]
    return torch.stack([src, dst]).to(device)


def _ops(device, g):
    q, k, v = (rand_feat((NUM_NODES, HEADS, DIM), torch.float32, device, g, requires_grad=True) for _ in range(3))
    a_src, a_dst = (rand_feat((NUM_NODES, HEADS), torch.float32, device, g, requires_grad=True) for _ in range(2))
    att = rand_feat((HEADS, DIM), torch.float32, device, g, requires_grad=True)
    return {
        "graph_attention": lambda src, dst: edgedot.graph_attention(q, k, v, src, dst),
        "gat_attention": lambda src, dst: edgedot.gat_attention(v, a_src, a_dst, src, dst),
        "gatv2_attention": lambda src, dst: edgedot.gatv2_attention(k, q, att, src, dst),
    }


def _layers(device):
    torch.manual_seed(0)
    return {name: getattr(edgedot.nn, name)(IN_CHANNELS, DIM, heads=HEADS).to(device)
            for name in ("TransformerConv", "GATConv", "GATv2Conv")}


@requires_cuda
def test_default_calls_on_fresh_batches_never_wait():
    """Forward and backward of the three ops and the three layers, default options, a new batch
    every call (the GAT layers add self-loops), under the sync debug mode's "error"."""
    g = gen(1)
    ops = _ops("cuda", g)
    layers = _layers("cuda")
    x = rand_feat((NUM_NODES, IN_CHANNELS), torch.float32, "cuda", g, requires_grad=True)
    calls = [(name, lambda ei, op=op: op(ei[0], ei[1])) for name, op in ops.items()]
    calls += [(name, lambda ei, layer=layer: layer(x, ei)) for name, layer in layers.items()]
    batches = [_batch(g, "cuda", loops=3) for _ in range(4)]
    for _, call in calls:  # the extension loaded, the kernels' first launches done
        call(batches[0].clone()).sum().backward()
    torch.cuda.synchronize()
    for name, call in calls:
        for batch in batches[1:]:
            fresh = batch.clone()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                call(fresh).square().sum().backward()
            except RuntimeError as error:
                pytest.fail(f"{name} waited for the device: {error}")
            finally:
                torch.cuda.set_sync_debug_mode("default")
    edgedot.wait_for_checks()  # every batch was valid


@requires_cuda
@pytest.mark.parametrize("op", ["graph_attention", "gat_attention", "gatv2_attention"])
def test_bad_index_raises_at_the_next_call_or_the_check(op):
    """A bad source index is never read (its destination's output is NaN) and raises IndexError
    naming ``src_idx`` at the next call once the device ran the check, or at wait_for_checks."""
    g = gen(2)
    call = _ops("cuda", g)[op]
    good, bad = _batch(g, "cuda"), _batch(g, "cuda")
    bad[0, 7] = NUM_NODES + 5
    out = call(bad[0], bad[1])  # returns: the check runs on the device
    assert torch.isnan(out[bad[1, 7]]).all() and not torch.isnan(out[bad[1, 0]]).any()
    torch.cuda.synchronize()
    with pytest.raises(IndexError, match=f"src_idx holds {NUM_NODES + 5}, outside .*earlier call"):
        call(good[0], good[1])
    call(good[0], good[1])  # reported once; good graphs go on
    bad = bad.clone()
    call(bad[0], bad[1])
    with pytest.raises(IndexError, match="src_idx"):
        edgedot.wait_for_checks()
    edgedot.wait_for_checks()  # nothing pending now


@requires_cuda
@pytest.mark.parametrize("op", ["graph_attention", "gat_attention", "gatv2_attention"])
def test_fresh_graph_is_checked_by_the_grouping_kernel(op, monkeypatch):
    """A default call on a new graph launches no check kernel of its own: the grouping's kernel
    checks both ranges; the same graph again is grouped without a check."""
    g = gen(7)
    call = _ops("cuda", g)[op]
    checked = count_graph_checks(monkeypatch)
    ei = _batch(g, "cuda")
    names = launched_kernels(lambda: call(ei[0], ei[1]))
    assert not any("check_graph_kernel" in name for name in names), names
    assert checked == [(True, True, False)]
    call(ei[0], ei[1])
    assert len(checked) == 1
    edgedot.wait_for_checks()


@requires_cuda
def test_layer_reports_the_edge_index_row():
    g = gen(3)
    layer = _layers("cuda")["GATConv"]
    x = rand_feat((NUM_NODES, IN_CHANNELS), torch.float32, "cuda", g)
    bad = _batch(g, "cuda")
    bad[1, 3] = NUM_NODES
    with raises_checked(IndexError, match=r"edge_index\[1\] holds"):
        layer(x, bad)


@requires_cuda
def test_pending_check_covers_the_same_graph_once(monkeypatch):
    """The graph passed again before its verdict is read is not checked again; a graph found bad
    is forgotten, so passing it again checks it again."""
    launched = count_graph_checks(monkeypatch)
    g = gen(4)
    call = _ops("cuda", g)["graph_attention"]
    ei = _batch(g, "cuda")
    for _ in range(3):
        call(ei[0], ei[1])
    assert len(launched) == 1
    ei[0, 0] = -1
    call(ei[0], ei[1])
    with pytest.raises(IndexError, match="src_idx holds -1"):
        edgedot.wait_for_checks()
    call(ei[0], ei[1])
    assert len(launched) == 3
    with pytest.raises(IndexError):
        edgedot.wait_for_checks()


@requires_cuda
def test_reused_read_back_reports_each_check():
    """The read-back buffers of finished checks serve later ones: good and bad graphs alternating,
    fresh each call, each verdict is its own (a reused buffer never reports an earlier check's)."""
    g = gen(6)
    call = _ops("cuda", g)["graph_attention"]
    for step in range(2 * checks.DeferredChecks.MAX_SPARE + 3):
        ei = _batch(g, "cuda")
        bad = step % 3 == 2
        if bad:
            ei[1, step % ei.shape[1]] = SEEDS + NUM_NODES
        call(ei[0], ei[1])
        if bad:
            with pytest.raises(IndexError, match=f"dst_idx holds {SEEDS + NUM_NODES}"):
                edgedot.wait_for_checks()
        else:
            edgedot.wait_for_checks()


@requires_cuda
def test_check_events_go_on_the_current_stream():
    """A check's read-back event is recorded on the stream current at the call: the deferred checks'
    wrapper of it is that stream, made once per stream; a bad graph checked on a side stream is
    reported once that stream ran its check."""
    device = torch.device("cuda", torch.cuda.current_device())
    side = torch.cuda.Stream()
    first = checks.deferred._current_stream(device)
    assert first == torch.cuda.current_stream(device) and checks.deferred._current_stream(device) is first
    g = gen(7)
    call = _ops("cuda", g)["graph_attention"]
    bad = _batch(g, "cuda")
    bad[0, 2] = -3
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        assert checks.deferred._current_stream(device) == side
        call(bad[0], bad[1])
    side.synchronize()
    with pytest.raises(IndexError, match="src_idx holds -3"):
        edgedot.wait_for_checks()


def test_wait_for_checks_without_pending_checks_returns():
    edgedot.wait_for_checks()
    assert "wait_for_checks" in edgedot.__all__


@requires_cuda
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("shape", [(300, 40, 25), (0, 40, 25), (50, 0, 25), (0, 0, 0), (3000, 500, 700)],
                         ids=["batch", "no_edges", "no_loops", "empty", "more_dst_than_loops"])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_self_looped_kernel_matches_tensor_ops(index_dtype, shape, strided):
    """The extension's ``self_looped`` (one kernel) writes what the tensor operations it replaced
    do: the edges in place, a self-loop's destination set to ``dropped``, then the loops of nodes
    ``0 .. num_nodes - 1``; for either index dtype, a ``[2, E]`` index of any strides, no edges
    or no loops; the edges in range pass its range check."""
    num_edges, num_nodes, dropped = shape
    g = gen(9)
    ei = torch.randint(0, max(dropped, 1), (2, num_edges), generator=g)
    ei[1, ::4] = ei[0, ::4]
    ei = ei.to(index_dtype).cuda()
    if strided:
        ei = ei.t().contiguous().t()  # rows of stride 2
    bound = max(dropped, 1)
    src, dst = checks.self_looped_with_check(ei, num_nodes, dropped, bound, bound, ("row 0", "row 1", "ptr"))
    loop = torch.arange(num_nodes, device="cuda", dtype=index_dtype)
    want_dst = torch.where(ei[0] == ei[1], dropped, ei[1])
    assert src.dtype == dst.dtype == index_dtype and src.is_contiguous() and dst.is_contiguous()
    assert torch.equal(src, torch.cat([ei[0], loop])) and torch.equal(dst, torch.cat([want_dst, loop]))
    edgedot.wait_for_checks()


@requires_cuda
def test_self_looped_refuses_what_it_cannot_write():
    """Arguments the kernel would misread are refused with ValueError before any launch."""
    from edgedot.runtime.build import cuda_module
    ei = torch.zeros(2, 4, dtype=torch.int32, device="cuda")
    three_rows = torch.zeros(3, 4, dtype=torch.int64, device="cuda")
    host_flags = torch.zeros(checks.DeferredChecks.NUM_FLAGS, dtype=torch.int32, pin_memory=True)
    for args in ((ei.float(), 3, 3), (three_rows, 3, 3), (ei, -1, 3), (ei, 3, 2**31), (ei.cpu(), 3, 3),
                 (ei[0], 3, 3)):
        with pytest.raises(ValueError, match="self_looped"):
            cuda_module().self_looped_checked(*args, 4, 4, host_flags)
    with pytest.raises(ValueError, match="host_flags"):
        cuda_module().self_looped_checked(ei, 3, 3, 4, 4, host_flags[:2])


@requires_cuda
@pytest.mark.parametrize("kind, loops", [("GATConv", True), ("GATv2Conv", True), ("TransformerConv", False),
                                         ("GATConv", False), ("GATv2Conv", False), ("AGNNConv", False)])
@pytest.mark.parametrize("row, value", [(0, NUM_NODES), (1, NUM_NODES + 3), (0, -1), (1, -2)])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_layers_check_a_fresh_graph_in_a_kernel_they_run_anyway(kind, loops, row, value, index_dtype, monkeypatch):
    """A layer's default call on a new graph launches no check kernel of its own: the GAT layers'
    self-loop kernel range-checks both rows on the way, and without self-loops the op's grouping
    kernel does; the same graph again is not checked again; a bad index is reported naming its
    row of ``edge_index``, at the latest by wait_for_checks."""
    g = gen(8)
    torch.manual_seed(0)
    if kind == "AGNNConv":
        layer = edgedot.nn.AGNNConv(add_self_loops=loops)
        x = rand_feat((NUM_NODES, IN_CHANNELS), torch.float32, "cuda", g, requires_grad=True)
    else:
        options = {} if kind == "TransformerConv" else {"add_self_loops": loops}
        layer = getattr(edgedot.nn, kind)(IN_CHANNELS, DIM, heads=HEADS, **options)
        x = rand_feat((NUM_NODES, IN_CHANNELS), torch.float32, "cuda", g)
    layer = layer.to("cuda")
    checked = count_graph_checks(monkeypatch)
    ei = _batch(g, "cuda").to(index_dtype)
    names = launched_kernels(lambda: layer(x, ei).sum().backward())
    assert not any("check_graph_kernel" in name for name in names), names
    assert checked == [(True, True, False)]
    layer(x, ei)
    assert len(checked) == 1
    edgedot.wait_for_checks()
    bad = _batch(g, "cuda").to(index_dtype)
    bad[row, 5] = value
    with raises_checked(IndexError, match=rf"edge_index\[{row}\] holds {value}, outside \[0, {NUM_NODES}\)"):
        layer(x, bad)
    assert checked[-1] == (True, True, False)
    layer(x, bad.clone()[:, :5])  # good graphs go on
    edgedot.wait_for_checks()


@requires_cuda
@pytest.mark.parametrize("kind", ["GATConv", "GATv2Conv"])
@pytest.mark.parametrize("fill_value", ["mean", "add", 0.5])
def test_self_loops_in_place_match_pyg(kind, fill_value):
    """On CUDA the GAT layers handle self-loops in place (a loop edge pointing at no destination),
    with edge features filled from ``fill_value``: output and gradients are PyG's, whose layer
    removes the loops."""
    g = gen(5)
    torch.manual_seed(1)
    ours = getattr(edgedot.nn, kind)(IN_CHANNELS, DIM, heads=HEADS, edge_dim=3, fill_value=fill_value).double()
    theirs = getattr(pyg_nn, kind)(IN_CHANNELS, DIM, heads=HEADS, edge_dim=3, fill_value=fill_value).double()
    theirs.load_state_dict(ours.state_dict())
    ei = _batch(g, "cpu", loops=7)
    edge_attr = rand_feat((ei.shape[1], 3), torch.float64, "cpu", g)
    x = rand_feat((NUM_NODES, IN_CHANNELS), torch.float64, "cpu", g)
    grad = rand_feat((NUM_NODES, HEADS * DIM), torch.float64, "cpu", g)
    results = []
    for layer, device in ((ours.cuda(), "cuda"), (theirs, "cpu")):
        xd = x.to(device).requires_grad_()
        out = layer(xd, ei.to(device), edge_attr.to(device))
        out.backward(grad.to(device))
        results.append([out, xd.grad] + [p.grad for p in layer.parameters()])
    for got, want in zip(*results):
        assert rel_error(got, want) < 1e-12
