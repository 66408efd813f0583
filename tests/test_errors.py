"""Bad inputs raise before anything is computed, with a message naming the argument; out-of-range
indices are caught on every device and never leave the process (or CUDA context) unusable."""

import pytest
import torch

import edgedot
from utils import (DEVICES, assert_accurate, count_graph_checks, raises_checked, check_forward, gen, rand_feat, rand_index, reference,
                   reference64, reference_grads, rel_error, requires_cuda, requires_2_gpus)

NUM_SRC, NUM_DST, NUM_EDGES, DIM = 9, 13, 40, 8  # NUM_SRC < NUM_DST: catches checking against the wrong N


def _good(device, heads=False):
    g = gen(0)
    src = rand_feat((NUM_SRC, 2, DIM) if heads else (NUM_SRC, DIM), torch.float32, device, g)
    dst = rand_feat((NUM_DST, 2, DIM) if heads else (NUM_DST, DIM), torch.float32, device, g)
    return {"src_feat": src, "dst_feat": dst,
            "src_idx": rand_index(NUM_SRC, NUM_EDGES, torch.int64, device, g),
            "dst_idx": rand_index(NUM_DST, NUM_EDGES, torch.int32, device, g)}


def _call(args, **kwargs):
    return edgedot.edge_dot(args["src_feat"], args["dst_feat"], args["src_idx"], args["dst_idx"], **kwargs)


def _with(args, **changes):
    out = dict(args)
    out.update(changes)
    return out


def _bad_index(idx, pos, value):
    idx = idx.clone()
    idx[pos] = value
    return idx


def _cases(device):
    """(id, args, exception, names that the message must contain)."""
    a = _good(device)
    h = _good(device, heads=True)
    f32 = torch.float32
    return [
        ("D_mismatch", _with(a, dst_feat=rand_feat((NUM_DST, DIM + 1), f32, device)), ValueError, ["src_feat", "dst_feat"]),
        ("D_mismatch_heads", _with(h, src_feat=rand_feat((NUM_SRC, 2, DIM - 1), f32, device)), ValueError, ["src_feat", "dst_feat"]),
        ("H_mismatch", _with(h, dst_feat=rand_feat((NUM_DST, 3, DIM), f32, device)), ValueError, ["src_feat", "dst_feat"]),
        ("E_mismatch", _with(a, dst_idx=a["dst_idx"][:-1]), ValueError, ["src_idx", "dst_idx"]),
        ("src_feat_1d", _with(a, src_feat=rand_feat((NUM_SRC,), f32, device)), ValueError, ["src_feat"]),
        ("dst_feat_4d", _with(a, dst_feat=rand_feat((NUM_DST, 1, 1, DIM), f32, device)), ValueError, ["dst_feat"]),
        ("src_idx_2d", _with(a, src_idx=a["src_idx"].reshape(2, -1)), ValueError, ["src_idx"]),
        ("dst_idx_2d", _with(a, dst_idx=a["dst_idx"].reshape(-1, 1)), ValueError, ["dst_idx"]),
        ("src_idx_0d", _with(a, src_idx=a["src_idx"][0]), ValueError, ["src_idx"]),
        ("src_idx_float", _with(a, src_idx=a["src_idx"].float()), TypeError, ["src_idx"]),
        ("dst_idx_float", _with(a, dst_idx=a["dst_idx"].double()), TypeError, ["dst_idx"]),
        ("dst_idx_int16", _with(a, dst_idx=a["dst_idx"].short()), TypeError, ["dst_idx"]),
        ("src_idx_bool", _with(a, src_idx=a["src_idx"] > 3), TypeError, ["src_idx"]),
        ("src_idx_uint8", _with(a, src_idx=a["src_idx"].to(torch.uint8)), TypeError, ["src_idx"]),
        ("feat_dtype_mismatch", _with(a, dst_feat=a["dst_feat"].double()), TypeError, ["src_feat", "dst_feat"]),
        ("feat_dtype_mismatch_half", _with(a, src_feat=a["src_feat"].half()), TypeError, ["src_feat", "dst_feat"]),
        ("src_feat_int", _with(a, src_feat=a["src_feat"].long(), dst_feat=a["dst_feat"].long()), TypeError, ["src_feat"]),
        ("src_idx_negative", _with(a, src_idx=_bad_index(a["src_idx"], 5, -1)), IndexError, ["src_idx"]),
        ("src_idx_eq_N", _with(a, src_idx=_bad_index(a["src_idx"], -1, NUM_SRC)), IndexError, ["src_idx"]),
        ("src_idx_huge", _with(a, src_idx=_bad_index(a["src_idx"], 0, 2**40)), IndexError, ["src_idx"]),
        ("dst_idx_negative", _with(a, dst_idx=_bad_index(a["dst_idx"], 7, -5)), IndexError, ["dst_idx"]),
        ("dst_idx_eq_N", _with(a, dst_idx=_bad_index(a["dst_idx"], 3, NUM_DST)), IndexError, ["dst_idx"]),
        ("dst_idx_int32_min", _with(a, dst_idx=_bad_index(a["dst_idx"], 3, -2**31)), IndexError, ["dst_idx"]),
        ("heads_src_idx_eq_N", _with(h, src_idx=_bad_index(h["src_idx"], 1, NUM_SRC)), IndexError, ["src_idx"]),
    ]


def _ids(device="cpu"):
    return [c[0] for c in _cases(device)]


@pytest.mark.parametrize("case", _ids())
@pytest.mark.parametrize("device", DEVICES)
def test_bad_inputs(device, case):
    _, args, exc, names = next(c for c in _cases(device) if c[0] == case)
    before = {k: v.clone() for k, v in args.items()}
    with raises_checked(exc, match=names[0]) as info:
        _call(args)
    for name in names:
        assert name in str(info.value), f"message does not name {name}: {info.value}"
    for k, v in args.items():
        assert torch.equal(v, before[k]), f"{k} was modified by a failing call"
    if device == "cuda":
        torch.cuda.synchronize()
        check_forward(**_good(device))  # the context is still usable
    # The same error through the module and with a plan-free deterministic call.
    with raises_checked(exc, match=names[0]):
        edgedot.nn.EdgeDot(deterministic=True)(args["src_feat"], args["dst_feat"], args["src_idx"], args["dst_idx"])


@pytest.mark.parametrize("device", DEVICES)
def test_not_tensors(device):
    a = _good(device)
    with raises_checked(TypeError, match="src_feat"):
        _call(_with(a, src_feat=a["src_feat"].tolist()))
    with raises_checked(TypeError, match="dst_idx"):
        _call(_with(a, dst_idx=a["dst_idx"].tolist()))


@pytest.mark.parametrize("device", DEVICES)
def test_oob_with_grad_leaves_no_grad(device):
    a = _good(device)
    src = a["src_feat"].clone().requires_grad_(True)
    with raises_checked(IndexError, match="dst_idx"):
        _call(_with(a, src_feat=src, dst_idx=_bad_index(a["dst_idx"], 0, NUM_DST + 100)))
    assert src.grad is None


def test_cpu_oob_raises_even_without_check():
    """On the CPU out-of-range indices are always refused (edgedot/ops/edge_dot.py), never read."""
    a = _good("cpu")
    for name, value in (("src_idx", NUM_SRC), ("dst_idx", -1)):
        bad = _with(a, **{name: _bad_index(a[name], 2, value)})
        with raises_checked(IndexError, match=name):
            _call(bad, check_indices=False)


def test_mixed_devices_via_meta():
    """Device mismatches are caught by the argument checks (here: meta vs cpu, on any machine)."""
    a = _good("cpu")
    for name in ("src_feat", "dst_feat", "src_idx", "dst_idx"):
        bad = _with(a, **{name: a[name].to("meta")})
        with raises_checked(ValueError, match=name):
            _call(bad)


@pytest.mark.parametrize("device", DEVICES)
def test_plan_of_wrong_graph_size(device):
    a = _good(device)
    plan = edgedot.EdgePlan(a["src_idx"], a["dst_idx"], NUM_SRC, NUM_DST)
    for bad in (edgedot.EdgePlan(a["src_idx"][:-1], a["dst_idx"][:-1], NUM_SRC, NUM_DST),
                edgedot.EdgePlan(a["src_idx"], a["dst_idx"], NUM_SRC + 1, NUM_DST),
                edgedot.EdgePlan(a["src_idx"], a["dst_idx"], NUM_SRC, NUM_DST + 1)):
        with raises_checked(ValueError, match="plan"):
            _call(a, plan=bad)
    # Swapped sides (num_src and num_dst exchanged) are a size mismatch too.
    swapped = edgedot.EdgePlan(a["dst_idx"], a["dst_idx"], NUM_DST, NUM_DST)
    with raises_checked(ValueError, match="plan"):
        _call(a, plan=swapped)
    # And the right plan works.
    check_forward(**a, plan=plan)


@pytest.mark.parametrize("device", DEVICES)
def test_unknown_gradient_reduction(device):
    g = gen(5)
    row, other = rand_feat((6, 4), device=device, g=g), rand_feat((5, 4), device=device, g=g)
    row_idx, other_idx = rand_index(6, 9, device=device, g=g), rand_index(5, 9, device=device, g=g)
    grad_out = rand_feat((9,), device=device, g=g)
    with raises_checked(ValueError, match="unknown reduction 'fastest'"):
        torch.ops.edgedot.edge_dot_grad(grad_out, row, other, row_idx, other_idx, None, "fastest")


@pytest.mark.parametrize("device", DEVICES)
def test_edge_plan_bad_inputs(device):
    a = _good(device)
    s, d = a["src_idx"], a["dst_idx"]
    with raises_checked(IndexError, match="src_idx"):
        edgedot.EdgePlan(_bad_index(s, 0, NUM_SRC), d, NUM_SRC, NUM_DST)
    with raises_checked(IndexError, match="dst_idx"):
        edgedot.EdgePlan(s, _bad_index(d, 0, -1), NUM_SRC, NUM_DST)
    with raises_checked(ValueError, match="src_idx|dst_idx"):
        edgedot.EdgePlan(s, d[:-1], NUM_SRC, NUM_DST)
    with raises_checked(TypeError, match="src_idx"):
        edgedot.EdgePlan(s.float(), d, NUM_SRC, NUM_DST)
    with raises_checked(ValueError, match="dst_idx"):
        edgedot.EdgePlan(s, d.reshape(2, -1), NUM_SRC, NUM_DST)


# ----------------------------------------------------------------------------------- CUDA only


@requires_cuda
def test_cuda_mixed_devices():
    a = _good("cuda")
    for name in ("src_feat", "dst_feat", "src_idx", "dst_idx"):
        with raises_checked(ValueError, match=name):
            _call(_with(a, **{name: a[name].cpu()}))
    torch.cuda.synchronize()
    check_forward(**a)


@requires_cuda
def test_cuda_plan_on_wrong_device():
    a = _good("cuda")
    plan = edgedot.EdgePlan(a["src_idx"].cpu(), a["dst_idx"].cpu(), NUM_SRC, NUM_DST)
    with raises_checked(ValueError, match="plan"):
        _call(a, plan=plan)
    check_forward(**a, plan=plan.to("cuda"))


@requires_cuda
@pytest.mark.parametrize("heads", [False, True])
@pytest.mark.parametrize("name, value", [("src_idx", -1), ("src_idx", NUM_SRC), ("dst_idx", NUM_DST),
                                         ("dst_idx", -2**31), ("src_idx", 2**40)])
def test_cuda_oob_raises_then_recovers(name, value, heads):
    a = _good("cuda", heads)
    if value == 2**40 and a[name].dtype == torch.int32:
        pytest.skip("value does not fit int32")
    bad = _with(a, **{name: _bad_index(a[name], NUM_EDGES // 2, value)})
    with raises_checked(IndexError, match=name):
        _call(bad)
        torch.cuda.synchronize()
    torch.cuda.synchronize()  # no sticky error: the CUDA context is still usable
    check_forward(**a)
    # with a gradient too
    src = a["src_feat"].clone().requires_grad_(True)
    edgedot.edge_dot(src, a["dst_feat"], a["src_idx"], a["dst_idx"]).sum().backward()
    torch.cuda.synchronize()
    assert torch.isfinite(src.grad).all()


@requires_cuda
@pytest.mark.parametrize("heads", [False, True])
def test_cuda_unchecked_oob_gives_nan(heads):
    """check_indices=False: out-of-range edges yield NaN, the others are right, nothing crashes.

    The features are views into a larger buffer full of finite values, so reading past the end
    of a view (an index == N, or a negative one) would produce a finite number, not NaN."""
    g = gen(1)
    num_edges = 5000
    tail = (2, DIM) if heads else (DIM,)
    src_buf = rand_feat((NUM_SRC + 64, *tail), torch.float32, "cuda", g)
    dst_buf = rand_feat((NUM_DST + 64, *tail), torch.float32, "cuda", g)
    src, dst = src_buf[32:32 + NUM_SRC], dst_buf[32:32 + NUM_DST]  # finite rows on both sides
    src_idx = rand_index(NUM_SRC, num_edges, torch.int64, "cuda", g)
    dst_idx = rand_index(NUM_DST, num_edges, torch.int32, "cuda", g)
    bad_src = torch.tensor([0, 17, 999, 4999], device="cuda")
    bad_dst = torch.tensor([17, 18, 2500], device="cuda")
    src_idx[bad_src] = torch.tensor([NUM_SRC, -1, NUM_SRC + 5, -32], device="cuda")
    dst_idx[bad_dst] = torch.tensor([NUM_DST, -1, 2**31 - 1], device="cuda", dtype=torch.int32)
    out = edgedot.edge_dot(src, dst, src_idx, dst_idx, check_indices=False)
    torch.cuda.synchronize()
    bad = torch.zeros(num_edges, dtype=torch.bool, device="cuda")
    bad[bad_src] = True
    bad[bad_dst] = True
    assert torch.isnan(out[bad]).all(), "out-of-range edges must be NaN"
    good = ~bad
    ref_args = (src, dst, src_idx[good], dst_idx[good])
    assert_accurate(out[good], reference(*ref_args), reference64(*ref_args), torch.float32)
    check_forward(src, dst, src_idx.clamp(0, NUM_SRC - 1), dst_idx.clamp(0, NUM_DST - 1))


@requires_cuda
def test_cuda_unchecked_oob_backward_does_not_crash():
    g = gen(2)
    src = rand_feat((NUM_SRC, DIM), torch.float32, "cuda", g, requires_grad=True)
    dst = rand_feat((NUM_DST, DIM), torch.float32, "cuda", g, requires_grad=True)
    src_idx = rand_index(NUM_SRC, 300, torch.int64, "cuda", g)
    dst_idx = rand_index(NUM_DST, 300, torch.int64, "cuda", g)
    src_idx[3] = NUM_SRC + 1000
    out = edgedot.edge_dot(src, dst, src_idx, dst_idx, check_indices=False)
    out.nan_to_num(0.0).sum().backward()
    torch.cuda.synchronize()
    check_forward(src.detach(), dst.detach(), src_idx.clamp(max=NUM_SRC - 1), dst_idx)


@requires_cuda
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_cuda_unchecked_oob_edges_add_no_gradient(deterministic):
    """check_indices=False: an out-of-range edge contributes nothing to either gradient, in every
    backward flavour (int64 indices beyond 2**32 must not wrap onto a valid row)."""
    g = gen(3)
    src = rand_feat((NUM_SRC, DIM), torch.float32, "cuda", g, requires_grad=True)
    dst = rand_feat((NUM_DST, DIM), torch.float32, "cuda", g, requires_grad=True)
    num_edges = 600
    src_idx = rand_index(NUM_SRC, num_edges, torch.int64, "cuda", g)
    dst_idx = rand_index(NUM_DST, num_edges, torch.int64, "cuda", g)
    bad = torch.tensor([1, 50, 51, 300, 599], device="cuda")
    src_idx[bad[:3]] = torch.tensor([NUM_SRC, 2**32 + 3, -2**32 + 2], device="cuda")
    dst_idx[bad[3:]] = torch.tensor([2**32 + 1, -1], device="cuda")
    grad_out = rand_feat((num_edges,), torch.float32, "cuda", g)
    out = edgedot.edge_dot(src, dst, src_idx, dst_idx, check_indices=False, deterministic=deterministic)
    out.backward(grad_out)
    torch.cuda.synchronize()
    good = torch.ones(num_edges, dtype=torch.bool, device="cuda")
    good[bad] = False
    assert torch.isnan(out[~good]).all()
    ref = reference_grads(src, dst, src_idx[good], dst_idx[good], grad_out[good], torch.float64)
    assert rel_error(src.grad, ref[0]) < 1e-5, "grad src_feat"
    assert rel_error(dst.grad, ref[1]) < 1e-5, "grad dst_feat"


@requires_2_gpus
def test_cuda_second_device():
    """Tensors on cuda:1 are computed on cuda:1, whatever the current device."""
    with torch.cuda.device(0):
        a = _good("cuda:1", heads=True)
        src = a["src_feat"].clone().requires_grad_(True)
        out = edgedot.edge_dot(src, a["dst_feat"], a["src_idx"], a["dst_idx"])
        assert out.device == torch.device("cuda:1")
        assert_accurate(out, reference(src, a["dst_feat"], a["src_idx"], a["dst_idx"]),
                        reference64(src, a["dst_feat"], a["src_idx"], a["dst_idx"]), torch.float32)
        out.sum().backward()
        assert src.grad.device == torch.device("cuda:1")
        plan = edgedot.EdgePlan(a["src_idx"], a["dst_idx"], NUM_SRC, NUM_DST)
        check_forward(**a, plan=plan)
        with raises_checked(IndexError, match="src_idx"):
            _call(_with(a, src_idx=_bad_index(a["src_idx"], 0, NUM_SRC)))
    torch.cuda.synchronize(1)
    check_forward(**a)


@requires_2_gpus
def test_cuda_devices_mixed():
    a = _good("cuda:0")
    for name in ("dst_feat", "src_idx", "dst_idx"):
        with raises_checked(ValueError, match=name):
            _call(_with(a, **{name: a[name].to("cuda:1")}))
    plan = edgedot.EdgePlan(a["src_idx"], a["dst_idx"], NUM_SRC, NUM_DST).to("cuda:1")
    with raises_checked(ValueError, match="plan"):
        _call(a, plan=plan)


# Index tensors found in range are remembered (the extension's memos; edgedot.runtime.checks.TensorMemo's rule)
# until they change.

@pytest.mark.parametrize("device", DEVICES)
def test_index_modified_in_place_after_a_checked_call_is_checked_again(device):
    a = _good(device)
    _call(a)  # found in range and remembered
    a["src_idx"][5] = NUM_SRC
    with raises_checked(IndexError, match="src_idx"):
        _call(a)
    a["src_idx"][5] = 0
    check_forward(a["src_feat"], a["dst_feat"], a["src_idx"], a["dst_idx"])


@pytest.mark.parametrize("device", DEVICES)
def test_remembered_index_is_checked_against_a_smaller_table(device):
    a = _good(device)
    a["dst_idx"][0] = NUM_DST - 1
    _call(a)
    smaller = a["dst_feat"][: NUM_DST - 1]
    with raises_checked(IndexError, match="dst_idx"):
        _call(_with(a, dst_feat=smaller))


@pytest.mark.parametrize("device", DEVICES)
def test_index_view_shares_the_check_of_its_storage_writes(device):
    a = _good(device)
    edge_index = torch.stack([a["src_idx"], a["dst_idx"].long()])
    src_view = edge_index[0]
    _call(_with(a, src_idx=src_view))
    edge_index[0, 3] = -1  # a write through the base bumps the view's version too
    with raises_checked(IndexError, match="src_idx"):
        _call(_with(a, src_idx=src_view))


@pytest.fixture
def count_range_checks(monkeypatch):
    """One ``(check_src, check_dst, check_ptr)`` entry per pass over the index tensors that
    edge_dot's CPU path and graph_attention make (on CUDA each launch of the device's check)."""
    return count_graph_checks(monkeypatch)


def _attention_args(device):
    g = gen(5)
    q = rand_feat((NUM_DST, 2, DIM), torch.float32, device, g)
    k, v = (rand_feat((NUM_SRC, 2, DIM), torch.float32, device, g) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("op", ["edge_dot", "graph_attention"])
@pytest.mark.parametrize("device", DEVICES)
def test_views_made_anew_each_call_are_checked_once(device, op, count_range_checks):
    """``edge_index[0]`` is a new tensor object on every call: on CUDA its range is still learned
    once per index (remembered on the base and the view's place in it), relearned after an
    in-place write; the CPU remembers nothing and checks every call (edge_dot's forward without
    autograd by its own gathers: no separate pass)."""
    if op == "edge_dot" and device == "cuda":
        pytest.skip("the CUDA forward keeps its memo in the extension: test_cuda_index_views_wait_once")
    a = _good(device)
    edge_index = torch.stack([a["src_idx"], a["dst_idx"].long()])
    q, k, v = _attention_args(device)

    def call():
        if op == "edge_dot":
            return _call(_with(a, src_idx=edge_index[0], dst_idx=edge_index[1]))
        return edgedot.graph_attention(q, k, v, edge_index[0], edge_index[1])

    first = call()
    for _ in range(4):
        torch.testing.assert_close(call(), first, rtol=0, atol=0)
    calls = 5 if device == "cpu" else 1
    passes = 0 if device == "cpu" and op == "edge_dot" else 1
    assert count_range_checks == [(True, True, False)] * calls * passes
    edge_index[1, 2] = 0  # in range, but a write: both views' entries are stale
    call()
    assert count_range_checks == [(True, True, False)] * (calls + 1) * passes
    edge_index[0, 3] = NUM_SRC
    with raises_checked(IndexError, match="src_idx"):
        call()


def test_memo_never_answers_for_changed_or_reused_memory():
    """An entry dies with its base; a tensor sharing memory without the version counter (``.data``,
    a compiled graph's reinterpreted views) is never trusted; views differing in offset, length,
    stride or dtype are distinct."""
    from edgedot.runtime.checks import TensorMemo
    memo = TensorMemo()
    base = torch.arange(12)
    memo.put(base[2:8], "fact")
    assert memo.get(base[2:8]) == "fact"
    for other in (base[3:9], base[2:7], base[2:8:2], base.view(torch.int32)[4:16], base[2:8].clone()):
        assert memo.get(other) is None
    alias = base.data  # shares the memory, not the version counter
    memo.put(alias, "alias fact")
    base.add_(1)
    assert memo.get(base.data) is None and memo.get(base[2:8]) is None
    del base, alias
    assert not memo._entries
    # Freed memory that a new tensor reuses (the allocator hands out the same block) never matches.
    for _ in range(20):
        fresh = torch.arange(12)
        assert memo.get(fresh[2:8]) is None
        memo.put(fresh[2:8], "fresh")
        del fresh
    assert not memo._entries


def test_compiled_views_are_checked_not_trusted():
    """Under torch.compile the index views reach the op as new tensors with a version counter of
    their own: an in-place write between calls must still be caught."""
    a = _good("cpu")
    edge_index = torch.stack([a["src_idx"], a["dst_idx"].long()])
    fn = torch.compile(lambda s, d, ei: edgedot.edge_dot(s, d, ei[0], ei[1]), fullgraph=True)
    fn(a["src_feat"], a["dst_feat"], edge_index)
    edge_index[0, 3] = NUM_SRC
    with raises_checked(IndexError, match="src_idx"):
        fn(a["src_feat"], a["dst_feat"], edge_index)


@requires_cuda
def test_cuda_memo_of_many_graphs_stays_correct():
    """More index tensors than the extension remembers: each is checked or known, never confused."""
    a = _good("cuda")
    graphs = [a["src_idx"].clone() for _ in range(40)]
    for idx in graphs:
        _call(_with(a, src_idx=idx))
    for k in (0, 25, 39):
        graphs[k][1] = NUM_SRC
        with raises_checked(IndexError, match="src_idx"):
            _call(_with(a, src_idx=graphs[k]))
        graphs[k][1] = 0
        check_forward(a["src_feat"], a["dst_feat"], graphs[k], a["dst_idx"])


def test_remembered_indices_do_not_outlive_their_tensors():
    from edgedot.runtime.checks import TensorMemo
    memo = TensorMemo()
    idx = torch.arange(10)
    memo.put(idx, 10)
    assert memo.get(idx) == 10 and memo.get(idx.clone()) is None
    del idx
    assert not memo._entries


@pytest.mark.parametrize("device", DEVICES)
def test_inference_mode_indices_are_checked_every_call(device):
    a = _good(device)
    with torch.inference_mode():
        src_idx = a["src_idx"].clone()
        _call(_with(a, src_idx=src_idx))
        src_idx[0] = NUM_SRC
        with raises_checked(IndexError, match="src_idx"):
            _call(_with(a, src_idx=src_idx))


@pytest.mark.parametrize("device", DEVICES)
def test_sortedness_is_learned_in_every_backward(device):
    """The sorted reduction on an index that is no longer sorted would give wrong gradients, so
    sortedness is never remembered: a write that PyTorch does not see (``.data``) is seen."""
    from edgedot.ops import edge_dot as edge_dot_ops
    idx = torch.arange(10, device=device)
    assert edge_dot_ops._is_sorted(idx) is True
    idx.data[3] = 0
    assert idx._version == 0 and edge_dot_ops._is_sorted(idx) is False
    assert edge_dot_ops._is_sorted(torch.tensor([2, 2, 5], device=device)) is True


@requires_cuda
def test_cuda_sorted_index_rewritten_behind_the_version_counter():
    """A backward large enough to take the sorted reduction where the index is sorted: the same
    index rewritten through ``.data`` to an unsorted one between two backwards still gets the
    reference's gradients."""
    from edgedot.ops.edge_dot import SORT_MIN_EDGES
    g = gen(31)
    num_rows, num_edges = 4096, SORT_MIN_EDGES
    src_feat = rand_feat((num_rows, 4), torch.float32, "cuda", g)
    dst_feat = rand_feat((num_rows, 4), torch.float32, "cuda", g)
    src_idx = rand_index(num_rows, num_edges, torch.int64, "cuda", g).sort().values
    dst_idx = rand_index(num_rows, num_edges, torch.int64, "cuda", g)
    grad_out = rand_feat((num_edges,), torch.float32, "cuda", g)
    for step in range(2):
        s = src_feat.clone().requires_grad_()
        out = edgedot.edge_dot(s, dst_feat, src_idx, dst_idx)
        (grad,) = torch.autograd.grad(out, s, grad_out)
        (want,) = reference_grads(src_feat, dst_feat, src_idx, dst_idx, grad_out, torch.float64)[:1]
        assert rel_error(grad, want) < 1e-5, step
        src_idx.data.copy_(src_idx.flip(0))  # unsorted now; the version counter does not move


@pytest.mark.parametrize("grad", [False, True], ids=["nograd", "grad"])
@pytest.mark.parametrize("device", DEVICES)
def test_flags_and_plan_of_the_wrong_type(device, grad):
    """``deterministic`` (a bool or None), ``check_indices`` (a bool) and ``plan`` (an EdgePlan or
    None) of another type raise TypeError naming the argument, on every path of every op."""
    a = _good(device)
    a["src_feat"].requires_grad_(grad)
    bad = [("deterministic", "yes"), ("deterministic", 1), ("check_indices", "yes"), ("check_indices", None),
           ("check_indices", 1), ("plan", "yes")]
    for name, value in bad:
        with raises_checked(TypeError, match=name):
            _call(a, **{name: value})
    g = gen(8)
    q, k, v = (rand_feat((n, 2, DIM), torch.float32, device, g, requires_grad=grad)
               for n in (NUM_DST, NUM_SRC, NUM_SRC))
    a_src, a_dst = rand_feat((NUM_SRC, 2), torch.float32, device, g), rand_feat((NUM_DST, 2), torch.float32, device, g)
    att = rand_feat((2, DIM), torch.float32, device, g)
    src_idx, dst_idx = a["src_idx"], a["dst_idx"]
    ops = {"graph_attention": lambda **kw: edgedot.graph_attention(q, k, v, src_idx, dst_idx, **kw),
           "gat_attention": lambda **kw: edgedot.gat_attention(k, a_src, a_dst, src_idx, dst_idx, **kw),
           "gatv2_attention": lambda **kw: edgedot.gatv2_attention(k, q, att, src_idx, dst_idx, **kw)}
    for op, call in ops.items():
        for name, value in bad[2:] + [("return_attention", "yes")] + bad[:2] * (op == "graph_attention"):
            with raises_checked(TypeError, match=name):
                call(**{name: value})
        if op != "graph_attention":
            with raises_checked(TypeError, match="deterministic"):
                call(deterministic=True)


@pytest.mark.parametrize("loops", [True, False], ids=["loops", "noloops"])
@pytest.mark.parametrize("kind", ["transformer", "gat", "gatv2"])
@pytest.mark.parametrize("device", DEVICES)
def test_layer_edge_attr_of_the_wrong_length(device, kind, loops):
    """An ``edge_attr`` with more or fewer rows than ``edge_index`` has edges raises ValueError
    naming ``edge_attr``, on the fused path and on PyG's exact path (taken with a message hook)."""
    pytest.importorskip("torch_geometric")
    import edgedot.nn

    cls = {"transformer": edgedot.nn.TransformerConv, "gat": edgedot.nn.GATConv, "gatv2": edgedot.nn.GATv2Conv}[kind]
    options = {} if kind == "transformer" else dict(add_self_loops=loops, fill_value="mean")
    layer = cls(6, 4, heads=2, edge_dim=3, **options).to(device)
    g = gen(9)
    x = rand_feat((NUM_SRC, 6), torch.float32, device, g)
    edge_index = torch.stack([rand_index(NUM_SRC, NUM_EDGES, torch.int64, device, g),
                              rand_index(NUM_SRC, NUM_EDGES, torch.int64, device, g)])
    for rows in (NUM_EDGES - 1, NUM_EDGES + 3):
        edge_attr = rand_feat((rows, 3), torch.float32, device, g)
        with raises_checked(ValueError, match="edge_attr"):
            layer(x, edge_index, edge_attr)
        handle = layer.register_message_forward_hook(lambda module, inputs, output: None)
        with raises_checked(ValueError, match="edge_attr"):
            layer(x, edge_index, edge_attr)
        handle.remove()
    layer(x, edge_index, rand_feat((NUM_EDGES, 3), torch.float32, device, g))  # the right length runs
