"""Validation of index tensors: the memo of what was learned (TensorMemo), and the one fused
check per call (check_graph / graph_flags) of src_idx, dst_idx and dst_ptr."""

import pytest
import torch

import edgedot
from edgedot.runtime import checks
from edgedot.runtime.checks import (DST_OUT_OF_RANGE, PTR_DECREASES, PTR_DISAGREES, PTR_ENDS_WRONG,
                                    SRC_OUT_OF_RANGE, TensorMemo)
from utils import (DEVICES, count_graph_checks, gen, launched_kernels, raises_checked, rand_feat, rand_index,
                   requires_cuda)

NUM_SRC, NUM_DST, HEADS, DIM = 12, 7, 2, 8


@pytest.fixture
def waits(monkeypatch):
    """One entry per fused check (on CUDA, one launch of the device's check each): (check_src,
    check_dst, check_ptr)."""
    return count_graph_checks(monkeypatch)


def _qkv(device, seed=0):
    g = gen(seed)
    return (rand_feat((NUM_DST, HEADS, DIM), torch.float32, device, g),
            rand_feat((NUM_SRC, HEADS, DIM), torch.float32, device, g),
            rand_feat((NUM_SRC, HEADS, DIM), torch.float32, device, g))


def _edge_index(device, num_edges=40, seed=1, sort=False):
    g = gen(seed)
    src = torch.randint(0, NUM_SRC, (num_edges,), generator=g)
    dst = torch.randint(0, NUM_DST, (num_edges,), generator=g)
    if sort:
        dst = dst.sort().values
    return torch.stack([src, dst]).to(device)


# ------------------------------------------------------------------------------ TensorMemo


def test_memo_finds_views_made_anew_and_forgets_on_any_write():
    memo = TensorMemo()
    edge_index = torch.arange(20).view(2, 10)
    memo.put(edge_index[0], "row 0")
    assert memo.get(edge_index[0]) == "row 0"  # a new view object, the same data
    assert memo.get(edge_index.view(-1)[:10]) == "row 0"  # another view of the same place
    assert memo.get(edge_index[1]) is None and memo.get(edge_index[0, :9]) is None
    assert memo.get(edge_index[0].to(torch.int32)) is None
    edge_index[1, 0] = 5  # a write through the base, elsewhere: every view's entry is stale
    assert memo.get(edge_index[0]) is None
    memo.put(edge_index[0], "row 0")
    other_view = edge_index.view(-1)
    other_view[15] = 3  # a write through another view of the base
    assert memo.get(edge_index[0]) is None


def test_memo_never_trusts_other_version_counters():
    """``.detach()`` and ``.data`` share the memory; only a tensor sharing the version counter of the
    base an entry was learned on is trusted."""
    memo = TensorMemo()
    base = torch.arange(10)
    memo.put(base, "fact")
    assert memo.get(base.detach()) is None and memo.get(base.data) is None
    alias = base.detach()
    memo.put(alias, "alias fact")
    assert memo.get(alias) == "alias fact" and memo.get(base) is None  # one entry per place
    alias.add_(1)
    assert memo.get(alias) is None


def test_memo_misses_a_new_tensor_at_a_reused_address():
    memo = TensorMemo()
    seen = set()
    reused = False
    for _ in range(50):
        idx = torch.arange(16)
        ptr = idx.data_ptr()
        reused |= ptr in seen
        assert memo.get(idx) is None and memo.get(idx[2:]) is None
        memo.put(idx[2:], "fact")
        assert memo.get(idx[2:]) == "fact"
        seen.add(ptr)
        del idx
        assert not memo._entries  # dropped with its storage
    assert reused  # the allocator did hand the same memory out again


def test_memo_declines_tensors_it_cannot_key():
    memo = TensorMemo()
    with torch.inference_mode():
        idx = torch.arange(5)
    memo.put(idx, "fact")
    assert memo.get(idx) is None and not memo._entries


# ------------------------------------------------------------------------------ graph_flags


def _flags(src, dst, ptr=None, num_src=NUM_SRC, num_dst=NUM_DST, check_src=True, check_dst=True):
    return checks.graph_flags(src, num_src, dst, num_dst, ptr, check_src, check_dst)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("ptr_dtype", [torch.int32, torch.int64])
def test_graph_flags_name_each_failed_condition(device, index_dtype, ptr_dtype):
    ei = _edge_index(device, sort=True).to(index_dtype)
    src, dst = ei[0], ei[1]
    ptr = edgedot.index_to_ptr(dst, NUM_DST).to(ptr_dtype)
    assert _flags(src, dst, ptr) == 0
    assert _flags(src, dst) == 0
    bad = src.clone()
    bad[3] = NUM_SRC
    assert _flags(bad, dst, ptr) == SRC_OUT_OF_RANGE
    bad[3] = -1
    assert _flags(bad, dst) == SRC_OUT_OF_RANGE
    assert _flags(bad, dst, check_src=False) == 0
    bad = dst.clone()
    bad[-1] = NUM_DST  # out of range, hence also outside its destination's range
    assert _flags(src, bad, ptr) == DST_OUT_OF_RANGE | PTR_DISAGREES
    assert _flags(src, bad, ptr, check_dst=False) == PTR_DISAGREES
    wrong = ptr.clone()
    wrong[-1] -= 1
    assert _flags(src, dst, wrong) & PTR_ENDS_WRONG
    wrong = ptr.clone()
    wrong[0] = 1
    assert _flags(src, dst, wrong) & PTR_ENDS_WRONG
    wrong = ptr.clone()
    wrong[2] = int(ptr[3]) + 1
    assert _flags(src, dst, wrong) & PTR_DECREASES
    shuffled = dst.flip(0)
    if not torch.equal(shuffled, dst):
        assert _flags(src, shuffled, ptr) == PTR_DISAGREES


@pytest.mark.parametrize("device", DEVICES)
def test_graph_flags_strided_and_empty(device):
    ei = _edge_index(device, sort=True)
    ptr = edgedot.index_to_ptr(ei[1], NUM_DST)
    pairs = ei.t()  # [E, 2]: its columns have stride 2
    assert _flags(pairs[:, 0], pairs[:, 1], torch.stack([ptr, ptr], 1)[:, 0]) == 0
    bad = ei.t().clone()
    bad[5, 0] = NUM_SRC + 3
    assert _flags(bad[:, 0], bad[:, 1]) == SRC_OUT_OF_RANGE
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    zeros = torch.zeros(NUM_DST + 1, dtype=torch.int64, device=device)
    assert _flags(empty, empty, zeros) == 0
    assert _flags(empty, empty, zeros + 1) == PTR_ENDS_WRONG
    no_nodes = torch.zeros(1, dtype=torch.int64, device=device)
    assert _flags(empty, empty, no_nodes, num_src=0, num_dst=0) == 0


# ------------------------------------------------------------------------------ check_graph in calls


@pytest.mark.parametrize("device", DEVICES)
def test_fresh_graph_per_call_is_one_wait(device, waits):
    """A new mini-batch graph every call: ranges and pointer in one fused check, nothing else."""
    q, k, v = _qkv(device)
    for step in range(3):
        ei = _edge_index(device, seed=10 + step, sort=True)
        ptr = edgedot.index_to_ptr(ei[1], NUM_DST)
        edgedot.graph_attention(q, k, v, ei[0].clone(), ei[1].clone(), dst_ptr=ptr.clone())
        assert waits[-1] == (True, True, True) and len(waits) == step + 1
        edgedot.graph_attention(q, k, v, ei[0].clone(), ei[1].clone())
        assert waits[-1] == (True, True, False)
        del waits[-1]


@pytest.mark.parametrize("device", DEVICES)
def test_views_and_pointer_checked_once(device, waits):
    """On CUDA a graph's views and pointer are checked once, and again after a write; on the CPU,
    whose memory can change behind the version counter (torch.from_numpy), on every call."""
    q, k, v = _qkv(device)
    ei = _edge_index(device, sort=True)
    ptr = edgedot.index_to_ptr(ei[1], NUM_DST).to(torch.int32)
    first = edgedot.graph_attention(q, k, v, ei[0], ei[1], dst_ptr=ptr)
    for _ in range(3):
        torch.testing.assert_close(edgedot.graph_attention(q, k, v, ei[0], ei[1], dst_ptr=ptr), first, rtol=0, atol=0)
    if device == "cpu":
        assert waits == [(True, True, True)] * 4
        ei.data[1, 0] = NUM_DST - 1  # out of order, behind the version counter: seen
        with raises_checked(ValueError, match="dst_ptr disagrees"):
            edgedot.graph_attention(q, k, v, ei[0], ei[1], dst_ptr=ptr)
        return
    assert waits == [(True, True, True)]
    ptr[0] = 0  # a write (of the same value): the pointer alone is checked again
    edgedot.graph_attention(q, k, v, ei[0], ei[1], dst_ptr=ptr)
    assert waits[-1] == (False, False, True)
    ei[0, 0] = 0  # a write through the base: both views are checked again, and the pointer
    edgedot.graph_attention(q, k, v, ei[0], ei[1], dst_ptr=ptr)
    assert waits[-1] == (True, True, True) and len(waits) == 3


@pytest.mark.parametrize("device", DEVICES)
def test_check_graph_errors_name_the_argument(device):
    q, k, v = _qkv(device)
    ei = _edge_index(device, sort=True)
    ptr = edgedot.index_to_ptr(ei[1], NUM_DST)
    bad = ei.clone()
    bad[0, 4] = NUM_SRC + 2
    with raises_checked(IndexError, match=f"src_idx holds {NUM_SRC + 2}, outside"):
        edgedot.graph_attention(q, k, v, bad[0], bad[1], dst_ptr=ptr)
    bad = ei.clone()
    bad[1, 4] = -3
    with raises_checked(IndexError, match="dst_idx holds -3, outside"):
        edgedot.graph_attention(q, k, v, bad[0], bad[1])
    with raises_checked(ValueError, match="dst_ptr disagrees with dst_idx: edge 4 has destination -3"):
        edgedot.graph_attention(q, k, v, bad[0], bad[1], dst_ptr=ptr)
    wrong = ptr.clone()
    wrong[1] = int(ptr[2]) + 1
    with raises_checked(ValueError, match="dst_ptr must rise from 0"):
        edgedot.graph_attention(q, k, v, ei[0], ei[1], dst_ptr=wrong)


# ------------------------------------------------------------------------------ torch.compile


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_calls_on_views_check_once_aot_eager(device, waits):
    """Eager kernels under torch.compile get real views of the graph's edge_index: on CUDA two
    calls in the compiled function and two runs of it check the graph once (on the CPU, which
    remembers nothing, each call checks)."""
    q, k, v = _qkv(device)
    ei = _edge_index(device)

    def two_layers(q, k, v, ei):
        return edgedot.graph_attention(q, k, v, ei[0], ei[1]) + edgedot.graph_attention(q, k, v, ei[0], ei[1])

    fn = torch.compile(two_layers, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(fn(q, k, v, ei), two_layers(q, k, v, ei))
    waits.clear()
    ei.add_(0)  # a new version: learned again once
    fn(q, k, v, ei)
    fn(q, k, v, ei)
    assert waits == [(True, True, False)] * (4 if device == "cpu" else 1)
    ei[0, 3] = NUM_SRC
    with raises_checked(IndexError, match="src_idx"):
        fn(q, k, v, ei)


def test_inductor_aliases_are_checked_and_writes_inside_the_graph_caught():
    """Inductor hands the op fresh aliases of the input's memory with version counters of their
    own, and writes mutated inputs in place between two calls without counting: a memo keyed on
    the memory alone would call the second call's changed indices in range."""
    q, k, v = _qkv("cpu")
    ei = _edge_index("cpu")
    ei[0] = ei[0] % (NUM_SRC - 1)

    def step(q, k, v, ei):
        out = edgedot.graph_attention(q, k, v, ei[0], ei[1])
        ei[0].add_(1)
        return out + edgedot.graph_attention(q, k, v, ei[0], ei[1])

    fn = torch.compile(step, backend="inductor", fullgraph=True)
    fn(q, k, v, ei)  # max source index now NUM_SRC - 1
    with raises_checked(IndexError, match=f"src_idx holds {NUM_SRC}"):
        fn(q, k, v, ei)


# ------------------------------------------------------------------------------ CUDA


@requires_cuda
def test_cuda_fresh_graph_waits_once_and_only_in_the_check(waits):
    """No PyTorch-level synchronisation at all (sync debug mode), one fused check per call."""
    q, k, v = _qkv("cuda")
    graphs = [_edge_index("cuda", seed=20 + s, sort=True) for s in range(3)]
    ptrs = [edgedot.index_to_ptr(ei[1], NUM_DST) for ei in graphs]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for ei, ptr in zip(graphs, ptrs):
            edgedot.graph_attention(q, k, v, ei[0].clone(), ei[1].clone(), dst_ptr=ptr.clone())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert waits == [(True, True, True)] * 3


@requires_cuda
def test_cuda_check_graph_matches_the_tensor_operations():
    """The extension's kernel and the tensor-operation path give the same flags on random faults."""
    g = gen(30)
    for trial in range(40):
        ei = _edge_index("cpu", num_edges=int(torch.randint(0, 300, (1,), generator=g)), seed=trial, sort=True)
        ptr = edgedot.index_to_ptr(ei[1], NUM_DST)
        if ei.shape[1] and trial % 2:
            ei[int(torch.randint(0, 2, (1,), generator=g)), int(torch.randint(0, ei.shape[1], (1,), generator=g))] = \
                int(torch.randint(-3, NUM_SRC + 3, (1,), generator=g))
        if trial % 3 == 0:
            ptr[int(torch.randint(0, NUM_DST + 1, (1,), generator=g))] += int(torch.randint(-2, 3, (1,), generator=g))
        for p in (None, ptr):
            want = _flags(ei[0], ei[1], p)
            got = _flags(ei[0].cuda(), ei[1].cuda(), None if p is None else p.cuda())
            assert got == want, (trial, got, want)


@requires_cuda
def test_cuda_check_is_one_kernel_writing_host_memory():
    """A new graph's check on CUDA launches its kernel alone, which writes the flags into pinned host
    memory: nothing to zero on the device, no copy back."""
    g = gen(11)
    src, dst = rand_index(NUM_SRC, 300, torch.int64, "cuda", g), rand_index(NUM_DST, 300, torch.int32, "cuda", g)
    launched = launched_kernels(lambda: checks.check_graph(src, NUM_SRC, dst, NUM_DST))
    assert len(launched) == 1 and "check_graph_kernel" in launched[0], launched
    checks.deferred.wait()
    dst[7] = NUM_DST
    checks.check_graph(src, NUM_SRC, dst, NUM_DST)
    with pytest.raises(IndexError, match=f"dst_idx holds {NUM_DST}"):
        checks.deferred.wait()


@pytest.mark.cpu_only
def test_check_inputs_shortcut_accepts_only_what_the_full_checks_accept(monkeypatch):
    """check_inputs' one-expression shortcut for the common case admits no argument list that its
    full checks refuse: every combination of ranks, dtypes, widths, lengths and devices (the meta
    device standing for a second one) that the shortcut passes also passes with the shortcut off."""
    import itertools

    feats = [torch.zeros(shape, dtype=dtype, device=device)
             for shape in ((3, 4), (3, 5), (3, 2, 4), (4,)) for dtype in (torch.float32, torch.bfloat16, torch.int64)
             for device in ("cpu", "meta")]
    indices = [torch.zeros(shape, dtype=dtype, device=device)
               for shape in ((6,), (7,), (6, 1)) for dtype in (torch.int64, torch.int32, torch.float32)
               for device in ("cpu", "meta")]
    shortcut = checks._plain_pair
    taken = 0
    for args in itertools.product(feats, feats, indices, indices):
        if not shortcut(*args):
            continue
        taken += 1
        monkeypatch.setattr(checks, "_plain_pair", lambda *a: False)
        checks.check_inputs(*args)  # raises if the shortcut admitted a bad argument list
        monkeypatch.setattr(checks, "_plain_pair", shortcut)
    # two widths x two feature dtypes x two devices x two dtypes of each index x two lengths
    assert taken == 2 ** 6
