"""EdgePlan: the packed layout documented in edgedot/plan.py ``build_side``, checked on the CPU by
an independent emulation of the atomic-free backward that only reads the unpacked plan."""

import pytest
import torch

import edgedot
import edgedot.plan
from utils import (PIECE_LEN, gen, piece_len, rand_feat, rand_index, reference_grads, rel_error,
                   requires_cuda, skewed_index)

FIELDS = ["order", "other_sorted", "piece_row", "piece_begin", "piece_end", "piece_slot",
          "row_slot_begin", "row_pieces"]


def unpack(packed, num_edges, num_rows):
    """Splits a packed side plan into its named fields (layout of build_side's docstring)."""
    num_pieces = num_rows + num_edges // piece_len(num_edges)
    sizes = [num_edges, num_edges] + [num_pieces] * 4 + [num_rows, num_rows]
    assert packed.dtype == torch.int64
    assert packed.dim() == 1
    assert packed.numel() == sum(sizes), (packed.numel(), sizes)
    return dict(zip(FIELDS, (t.cpu() for t in torch.split(packed, sizes))))


def emulate_row_grad(fields, grad_out, other_feat, row_shape):
    """The plan-driven backward, written out serially: what the CUDA segment kernel must do.

    Phase 1: each used piece sums its edges' contributions (in sorted order) and either writes
    its row directly (piece_slot == -1) or a workspace slot. Phase 2: each row of several pieces
    sums its slots in slot order. Rows start as NaN so a row nobody writes is caught, and each
    direct write is counted so a row written twice is caught too.
    """
    row_heads = row_shape[1] if len(row_shape) == 3 else 1
    other = other_feat if other_feat.dim() == 3 else other_feat.unsqueeze(1)
    heads = max(row_heads, other.shape[1])
    num_rows = row_shape[0]
    grad = grad_out.reshape(-1, heads).to(torch.float64)
    dim = other.shape[-1]
    order, other_sorted = fields["order"], fields["other_sorted"]

    # Contribution of each sorted edge: [E, heads, D], summed over heads for a broadcast row.
    contrib = grad[order][:, :, None] * other[other_sorted].to(torch.float64)
    if row_heads == 1 and heads > 1:
        contrib = contrib.sum(1, keepdim=True)

    result = torch.full((num_rows, row_heads, dim), float("nan"), dtype=torch.float64)
    writes = torch.zeros(num_rows, dtype=torch.long)
    num_slots = int((fields["piece_slot"].max() + 1).clamp(min=0)) if fields["piece_slot"].numel() else 0
    workspace = torch.full((num_slots, row_heads, dim), float("nan"), dtype=torch.float64)
    slot_written = torch.zeros(num_slots, dtype=torch.long)

    used = fields["piece_row"] >= 0
    is_empty = fields["piece_begin"] == fields["piece_end"]
    # Empty pieces (rows without edges) write zeros: done in one go to keep large graphs fast.
    empty = (used & is_empty).nonzero().flatten()
    assert (fields["piece_slot"][empty] == -1).all(), "an empty piece uses a workspace slot"
    rows = fields["piece_row"][empty]
    result[rows] = 0.0
    writes.index_add_(0, rows, torch.ones_like(rows))
    for p in (used & ~is_empty).nonzero().flatten().tolist():
        row, slot = int(fields["piece_row"][p]), int(fields["piece_slot"][p])
        begin, end = int(fields["piece_begin"][p]), int(fields["piece_end"][p])
        acc = contrib[begin:end].sum(0)
        if slot == -1:
            result[row] = acc
            writes[row] += 1
        else:
            workspace[slot] = acc
            slot_written[slot] += 1
    for row in (fields["row_pieces"] > 1).nonzero().flatten().tolist():
        first, count = int(fields["row_slot_begin"][row]), int(fields["row_pieces"][row])
        acc = workspace[first].clone()
        for slot in range(first + 1, first + count):
            acc += workspace[slot]
        result[row] = acc
        writes[row] += 1
    assert (slot_written == 1).all(), "a workspace slot was written zero or several times"
    assert (writes == 1).all(), f"rows written != once: {(writes != 1).nonzero().flatten()[:10].tolist()}"
    return result.reshape(row_shape)


def check_layout(fields, row_idx, other_idx, num_rows):
    """Invariants of build_side's documented layout."""
    num_edges = row_idx.shape[0]
    rows, other = row_idx.long().cpu(), other_idx.long().cpu()
    order = fields["order"]
    # order: a stable sort by row.
    assert sorted(order.tolist()) == list(range(num_edges))
    expect_order = torch.sort(rows, stable=True).indices
    assert torch.equal(order, expect_order)
    assert torch.equal(fields["other_sorted"], other[order])
    sorted_rows = rows[order]

    length = piece_len(num_edges)
    num_pieces = num_rows + num_edges // length
    piece_row, begin, end, slot = (fields[k] for k in ("piece_row", "piece_begin", "piece_end", "piece_slot"))
    assert piece_row.shape == (num_pieces,)
    used = piece_row >= 0
    assert (piece_row[~used] == -1).all(), "unused pieces must have piece_row == -1"
    assert (piece_row < num_rows).all()
    # Used pieces come first, in row order.
    n_used = int(used.sum())
    assert used[:n_used].all() and not used[n_used:].any()
    assert (piece_row[:n_used][1:] >= piece_row[:n_used][:-1]).all()

    degree = torch.bincount(rows, minlength=num_rows)
    row_ptr = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(degree, 0)])
    expect_pieces = ((degree + length - 1) // length).clamp(min=1)
    assert torch.equal(fields["row_pieces"], expect_pieces)
    assert n_used == int(expect_pieces.sum()) <= num_pieces
    split_rows = expect_pieces > 1
    slots = torch.where(split_rows, expect_pieces, torch.zeros_like(expect_pieces))
    assert torch.equal(fields["row_slot_begin"], torch.cumsum(slots, 0) - slots)

    # Per piece (vectorised): pieces tile their row's sorted range in order, each at most
    # piece_len(E) long and non-empty unless the row is empty.
    pr, b, e, sl = piece_row[:n_used], begin[:n_used], end[:n_used], slot[:n_used]
    assert torch.equal(torch.bincount(pr, minlength=num_rows), expect_pieces)
    first_of_row = torch.ones(n_used, dtype=torch.bool)
    first_of_row[1:] = pr[1:] != pr[:-1]
    last_of_row = torch.ones(n_used, dtype=torch.bool)
    last_of_row[:-1] = pr[1:] != pr[:-1]
    assert torch.equal(b[first_of_row], row_ptr[:-1]), "first piece must start at the row's start"
    assert torch.equal(e[last_of_row], row_ptr[1:]), "last piece must end at the row's end"
    assert torch.equal(b[1:][~first_of_row[1:]], e[:-1][~first_of_row[1:]]), "pieces not contiguous"
    length = e - b
    size = e - b
    assert (size <= length).all()
    assert ((size >= 1) | (degree[pr] == 0)).all(), "empty piece in a non-empty row"
    assert ((size == 0) <= (degree[pr] == 0)).all()
    if num_edges:
        covered = torch.zeros(num_edges + 1, dtype=torch.long)
        covered.index_add_(0, b[size > 0], torch.ones_like(b[size > 0]))
        covered.index_add_(0, e[size > 0], -torch.ones_like(e[size > 0]))
        assert (torch.cumsum(covered, 0)[:-1] == 1).all(), "every sorted edge belongs to exactly one piece"
        assert torch.equal(sorted_rows[b[size > 0]], pr[size > 0])
        assert torch.equal(sorted_rows[e[size > 0] - 1], pr[size > 0])
    # Slots: -1 for a row's only piece, else consecutive from row_slot_begin[row].
    piece_index = torch.arange(n_used)
    first_piece = torch.cumsum(expect_pieces, 0) - expect_pieces
    k = piece_index - first_piece[pr]
    single = expect_pieces[pr] == 1
    assert (sl[single] == -1).all(), "a row's only piece must be written directly"
    assert torch.equal(sl[~single], fields["row_slot_begin"][pr[~single]] + k[~single])


def test_piece_len_bounds():
    sizes = (0, 1, 100, 1 << 16, 1 << 20, 1 << 24, 1 << 30)
    lengths = [piece_len(num_edges) for num_edges in sizes]
    assert all(8 <= n <= PIECE_LEN for n in lengths)
    assert lengths == sorted(lengths), "bigger graphs never get shorter pieces"
    assert piece_len(1 << 30) == PIECE_LEN


def _graphs():
    """name -> (num_rows, num_other, row_idx, other_idx)."""
    g = gen(0)
    cases = {}
    # Rows just under/at/over the piece length, a very long row, and empty rows in between.
    hot = {0: 3 * PIECE_LEN + 17, 2: PIECE_LEN, 5: PIECE_LEN + 1, 9: 2 * PIECE_LEN}
    n_e = sum(hot.values()) + 300
    cases["long_and_empty_rows"] = (40, 30, skewed_index(40, n_e, g=g, hot=hot), rand_index(30, n_e, g=g))
    cases["single_hot_row"] = (3, 7, torch.zeros(5 * PIECE_LEN, dtype=torch.long), rand_index(7, 5 * PIECE_LEN, g=g))
    cases["no_edges"] = (6, 4, torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long))
    cases["no_edges_no_rows"] = (0, 0, torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long))
    cases["many_rows"] = (100_000, 50, rand_index(100_000, 700, g=g), rand_index(50, 700, g=g))
    cases["many_rows_hot"] = (20_000, 9, skewed_index(20_000, 1500, g=g, hot={19_999: 600}), rand_index(9, 1500, g=g))
    cases["uniform"] = (64, 64, rand_index(64, 1000, torch.int32, g=g), rand_index(64, 1000, torch.int32, g=g))
    cases["exact_multiple"] = (2, 2, torch.tensor([0] * 256 + [1] * 256), torch.tensor([1] * 512))
    # Enough edges for longer pieces (piece_len grows with E).
    cases["big_hot"] = (5000, 300, skewed_index(5000, 1 << 20, g=g, hot={17: 5000}), rand_index(300, 1 << 20, g=g))
    cases["last_row_only"] = (10, 10, torch.full((PIECE_LEN * 2 + 1,), 9), rand_index(10, PIECE_LEN * 2 + 1, g=g))
    return cases


GRAPHS = _graphs()


@pytest.mark.parametrize("name", list(GRAPHS))
def test_layout(name):
    num_rows, num_other, row_idx, other_idx = GRAPHS[name]
    packed = edgedot.plan.build_side(row_idx, other_idx, num_rows)
    fields = unpack(packed, row_idx.shape[0], num_rows)
    check_layout(fields, row_idx, other_idx, num_rows)


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

    packed = edgedot.plan.build_side(row_idx, other_idx, num_rows)
    got = emulate_row_grad(unpack(packed, num_edges, num_rows), grad_out, other_feat, row_feat.shape)
    expect, expect_other = reference_grads(row_feat, other_feat, row_idx, other_idx, grad_out)
    assert got.shape == expect.shape
    assert rel_error(got, expect) <= 1e-12

    # Same for the plan that EdgePlan builds for this side, from both sides' point of view.
    plan = edgedot.EdgePlan(row_idx, other_idx, num_rows, num_other)
    assert torch.equal(plan.src, packed)
    got_other = emulate_row_grad(unpack(plan.dst, num_edges, num_other), grad_out, row_feat, other_feat.shape)
    assert got_other.shape == expect_other.shape
    assert rel_error(got_other, expect_other) <= 1e-12


@pytest.mark.parametrize("name", ["long_and_empty_rows", "many_rows_hot", "uniform"])
def test_plan_is_index_dtype_independent(name):
    num_rows, num_other, row_idx, other_idx = GRAPHS[name]
    a = edgedot.EdgePlan(row_idx.int(), other_idx.int(), num_rows, num_other)
    b = edgedot.EdgePlan(row_idx.long(), other_idx.long(), num_rows, num_other)
    assert torch.equal(a.src, b.src) and torch.equal(a.dst, b.dst)


@pytest.mark.parametrize("num_rows, num_edges", [
    (1, 0), (1, 1), (5, 7), (5, 8), (5, 9), (3, 10 * PIECE_LEN + 3), (1000, 2 * PIECE_LEN), (7, 1 << 17),
    (50, (1 << 24) // 1000)])
def test_static_size_and_unused_pieces(num_rows, num_edges):
    row_idx = rand_index(num_rows, num_edges, g=gen(num_edges))
    packed = edgedot.plan.build_side(row_idx, row_idx, num_rows)
    num_pieces = num_rows + num_edges // piece_len(num_edges)
    assert packed.numel() == 2 * num_edges + 4 * num_pieces + 2 * num_rows
    fields = unpack(packed, num_edges, num_rows)
    n_used = int(fields["row_pieces"].sum())
    assert n_used <= num_pieces
    assert (fields["piece_row"][n_used:] == -1).all()
    assert (fields["piece_row"][:n_used] >= 0).all()


def test_uniform_graph_has_unused_pieces():
    """Evenly spread rows leave the tail of the static piece array unused: marked -1."""
    num_edges = 4 * PIECE_LEN
    idx = torch.arange(num_edges) % 100
    fields = unpack(edgedot.plan.build_side(idx, idx, 100), num_edges, 100)
    num_pieces = 100 + num_edges // piece_len(num_edges)
    n_used = int(fields["row_pieces"].sum())
    assert n_used < num_pieces
    assert fields["piece_row"].tolist()[n_used:] == [-1] * (num_pieces - n_used)
    check_layout(fields, idx, idx, 100)


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
