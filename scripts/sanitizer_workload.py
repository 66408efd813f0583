"""Small forward and backward calls through every kernel variant, for compute-sanitizer."""
import torch

import edgedot
from edgedot.ops.gat import gat_layer_attention

dev = "cuda"
for dt in [torch.float32, torch.float64, torch.float16, torch.bfloat16]:
    for D in [3, 128, 129]:
        for it in [torch.int32, torch.int64]:
            s = torch.randn(50, 2, D, device=dev, dtype=dt, requires_grad=True)
            d = torch.randn(40, 1, D, device=dev, dtype=dt, requires_grad=True)
            si = torch.randint(0, 50, (700,), device=dev, dtype=it)
            di = torch.randint(0, 40, (700,), device=dev, dtype=it)
            si[:300] = 7  # a hot row longer than a chunk, so it is split
            plan = edgedot.EdgePlan(si, di, 50, 40)
            for kw in ({}, {"plan": plan}, {"deterministic": True}):
                out = edgedot.edge_dot(s, d, si, di, **kw)
                out.backward(torch.randn_like(out))
            # Every reduction of the gradient op, "sorted" and "sort" included (the autograd path
            # takes them only on graphs of 2**20 edges), on edges with a hot row and empty rows.
            g = torch.randn(700, 2, device=dev, dtype=dt)
            sorted_si, order = torch.sort(si)
            grad_op = torch.ops.edgedot.edge_dot_grad
            grad_op(g, s, d, si, di, None, "atomic")
            grad_op(g[order], s, d, sorted_si, di[order], None, "sorted")
            grad_op(g, s, d, si, di, None, "sort")
            try:
                edgedot.edge_dot(s, d, torch.tensor([0, 50], device=dev), torch.tensor([0, 1], device=dev))
            except IndexError:
                pass
            bad_src = torch.tensor([-1, 0, 50, 3, 2**40], device=dev, dtype=torch.int64)
            bad_dst = torch.tensor([0, 41, 1, -5, 2], device=dev, dtype=it)
            for kw in ({}, {"deterministic": True}):  # out-of-range edges, unchecked, both reductions
                out = edgedot.edge_dot(s, d, bad_src, bad_dst, check_indices=False, **kw)
                out.backward(torch.randn_like(out))
            bad_g = torch.randn(5, 2, device=dev, dtype=dt)
            sorted_bad, order = torch.sort(bad_src)
            grad_op(bad_g, s, d, bad_src, bad_dst, None, "sort")
            grad_op(bad_g[order], s, d, sorted_bad, bad_dst[order], None, "sorted")
            grad_op(bad_g, d, s, bad_dst, bad_src, None, "sort")


def forwards(s, d, si, di, out_of_range):
    """The forward on the edges as given and sorted by src; then, after ``idx[positions] = value``
    for each ``(idx, positions, value)`` of ``out_of_range``, unchecked and checked (which raises)."""
    edgedot.edge_dot(s, d, si, di)
    edgedot.edge_dot(s, d, torch.sort(si).values, di)
    for idx, positions, value in out_of_range:
        idx[positions] = value
    edgedot.edge_dot(s, d, si, di, check_indices=False)
    try:
        edgedot.edge_dot(s, d, si, di)
    except IndexError:
        pass


# The forward's grouped visit order: shuffled edges over wide rows of a table larger than L2, with
# out-of-range edges unchecked and checked; the same edges sorted, where the order is not used.
big = torch.cuda.get_device_properties(0).L2_cache_size // 2048 + 1
for it in [torch.int32, torch.int64]:
    s = torch.randn(big, 512, device=dev)
    d = torch.randn(500, 512, device=dev)
    si = torch.randint(0, big, (2 * big,), device=dev, dtype=it)
    di = torch.randint(0, 500, (2 * big,), device=dev, dtype=it)
    forwards(s, d, si, di, [(si, slice(None, None, 1000), big), (si, slice(1, None, 1000), -1)])
# Graphs with enough items for the forward's warps to take tiles of 32 (the last one cut short),
# groups of 1 to 16 lanes per item, rows of one 256-byte block (float32 64, bf16 128), heads,
# out-of-range edges unchecked and checked.
props = torch.cuda.get_device_properties(0)
num_edges = 2 * 32 * 32 * props.multi_processor_count + 5
for dt, H, D in [(torch.float32, 1, 64), (torch.bfloat16, 1, 128), (torch.float32, 3, 33), (torch.float64, 1, 2),
                 (torch.float16, 4, 8)]:
    s = torch.randn(3000, H, D, device=dev, dtype=dt)
    d = torch.randn(2000, H, D, device=dev, dtype=dt)
    si = torch.randint(0, 3000, (num_edges,), device=dev)
    di = torch.randint(0, 2000, (num_edges,), device=dev, dtype=torch.int32)
    forwards(s, d, si, di, [(si, slice(None, None, 997), 3000), (di, slice(5, None, 1009), -1)])


def attention_calls(q, k, v, ef, src, dst, p, return_attention, grouped=False):
    """Graph attention forward and backward through the extension, with groupings of src / dst
    (out-of-range indices included: build_side maps them past the rows or to -1); grouped: dst
    sorted and given as its CSR pointer instead of a grouping."""
    import edgedot.runtime.build
    import edgedot.runtime.plan
    ext = edgedot.runtime.build.cuda_module()
    num_dst, num_src = q.shape[0], k.shape[0]
    if grouped:
        dst, order = torch.sort(dst, stable=True)
        src = src[order].contiguous()
        ef = None if ef is None else ef[order]
    groups = []
    for rows, other, num_rows, num_other in ((dst, src, num_dst, num_src), (src, dst, num_src, num_dst)):
        group = edgedot.runtime.plan.build_side(rows, other, num_rows, num_other)
        keys = group[group.shape[0] // 2:] >> 32
        groups += [group, torch.searchsorted(keys, torch.arange(num_rows + 1, device=dev))]
    if grouped:
        groups[0] = None
    out, lse, alpha, rng_state = ext.attention_forward(q, k, v, ef, src, dst, groups[0], groups[1], 0.3, p, None,
                                                       return_attention)
    ext.attention_backward(torch.randn_like(out), q, k, v, ef, out, lse, src, dst, *groups, 0.3, p, rng_state,
                           ef is not None, True, True)


# Graph attention: every dtype; 16-byte rows with 1, 2 or 4 vectors per lane and single-element rows
# (odd dims, a misaligned stride) with up to 8; value dims unlike the key dims; edge features,
# dropout and attention weights on and off; destinations and sources without edges; one
# out-of-range source and one out-of-range destination; a destination hub and a source hub of
# 3000 edges, split into chunks merged by a block, and rows of a few chunks merged by a warp; edges
# given sorted by destination.
for dt in [torch.float32, torch.float64, torch.float16, torch.bfloat16]:
    for D, Dv, misaligned in [(32, 32, False), (64, 64, False), (256, 256, False), (3, 5, False), (40, 40, True),
                              (100, 100, True), (256, 256, True), (8, 24, False)]:
        H, num_src, num_dst, E = 3, 40, 30, 300
        q = torch.randn(num_dst, H, D + misaligned, device=dev, dtype=dt)[..., misaligned:]
        k = torch.randn(num_src, H, D, device=dev, dtype=dt)
        v = torch.randn(num_src, H, Dv, device=dev, dtype=dt)
        src = torch.randint(0, num_src - 3, (E,), device=dev)
        dst = torch.randint(0, num_dst - 4, (E,), device=dev, dtype=torch.int32)
        src[0] = num_src
        dst[1] = num_dst
        ef = torch.randn(E, H, D, device=dev, dtype=dt) if D == Dv else None
        attention_calls(q, k, v, ef, src, dst, 0.3, True)
        attention_calls(q, k, v, None, src, dst, 0.0, False)
    H, D, num_src, num_dst, E = 2, 32, 700, 500, 12000
    q, k, v = (torch.randn(n, H, D, device=dev, dtype=dt) for n in (num_dst, num_src, num_src))
    src = torch.randint(0, num_src, (E,), device=dev)
    dst = torch.randint(0, num_dst, (E,), device=dev)
    dst[:3000] = 7
    src[5000:8000] = 11
    dst[8000:8900] = 9
    ef = torch.randn(E, H, D, device=dev, dtype=dt)
    attention_calls(q, k, v, ef, src, dst, 0.2, True)
    attention_calls(q, k, v, None, src, dst, 0.0, True, grouped=True)
    # A residual added by the kernels (the hubs' merges too): rows of a wider tensor, a misaligned bias.
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    for residual in (torch.randn(num_dst, 2, H, D, device=dev, dtype=dt)[:, 1],
                     torch.randn(H * D + 1, device=dev, dtype=dt)[1:]):
        out = edgedot.graph_attention(*leaves, src, dst, residual=residual.requires_grad_())
        out.backward(torch.randn_like(out))
    # TransformerConv's layout: q, k, v and the skip the four sides of one projection, whose
    # gradients the backward packs into one buffer.
    qkvr = torch.randn(num_src, 4, H, D, device=dev, dtype=dt, requires_grad=True)
    sides = qkvr.unbind(1)
    out = edgedot.graph_attention(*sides[:3], src, dst, residual=sides[3])
    out.backward(torch.randn_like(out))
    # The layers over one x: their projections by one GEMM of the joined weights (linear_sides), the
    # attention's gradients packed for its backward.
    for layer in (edgedot.nn.TransformerConv(16, D, heads=H), edgedot.nn.GATv2Conv(16, D, heads=H)):
        x = torch.randn(num_src, 16, device=dev, dtype=dt, requires_grad=True)
        out = layer.to(dev, dt)(x, torch.stack([src, dst]))
        out.backward(torch.randn_like(out))

# GAT and GATv2, forward and backward with every input needing a gradient: every dtype; C of one
# element, 16-byte rows, a misaligned view and the widest; edge terms, dropout and attention
# weights on and off; a destination hub of 9000 edges (more than 64 chunks: a block merge) and a
# source hub; unchecked out-of-range indices; edges given sorted by destination.
def gat_calls(dt, C, misaligned, p, edge, grouped, H=2, num_src=60, num_dst=50, E=12000):
    src = torch.randint(0, num_src, (E,), device=dev)
    dst = torch.randint(0, num_dst, (E,), device=dev, dtype=torch.int32)
    dst[:9000] = 5
    src[9000:10000] = 3
    if grouped:
        dst, order = torch.sort(dst, stable=True)
        src = src[order]
    options = dict(dropout_p=p, return_attention=p > 0)
    if grouped:
        options["dst_ptr"] = edgedot.index_to_ptr(dst, num_dst)
    else:
        src[0], dst[1] = num_src, num_dst  # out of range, unchecked
        options["check_indices"] = False

    def feat(*shape):
        t = torch.randn(*shape[:-1], shape[-1] + misaligned, device=dev, dtype=dt)[..., misaligned:]
        return t.requires_grad_()
    x, x_dst = feat(num_src, H, C), feat(num_dst, H, C)
    a_src, a_dst, att = feat(num_src, H), feat(num_dst, H), feat(H, C)
    # Residuals added by the kernels: rows (misaligned with the features), a flat bias, a [H, C] one.
    outs = [edgedot.gat_attention(x, a_src, a_dst, src, dst, a_edge=feat(E, H) if edge else None,
                                  residual=feat(num_dst, H, C), **options),
            edgedot.gatv2_attention(x, x_dst, att, src, dst, edge_feat=feat(E, H, C) if edge else None,
                                    residual=feat(H * C), **options)]
    # GATConv's one node over x for both sides (its logits inside), att_src and att_dst as [1, H, C].
    if grouped:
        options["dst_ptr"] = edgedot.index_to_ptr(dst, num_src)
    outs.append(gat_layer_attention(x, feat(1, H, C), feat(1, H, C), src, dst, a_edge=feat(E, H) if edge else None,
                                    residual=feat(H, C), **options))
    for out in outs:
        out = out[0] if isinstance(out, tuple) else out
        out.backward(torch.randn_like(out))


for dt in [torch.float32, torch.float64, torch.float16, torch.bfloat16]:
    for C, misaligned in [(1, False), (32, False), (100, True), (256, False)]:
        gat_calls(dt, C, misaligned, 0.3, True, False)
        gat_calls(dt, C, misaligned, 0.0, False, True)

# AGNN (CosineScore): every dtype, a hub long enough to be chunked, one and several heads, the
# edges given grouped, unchecked out-of-range indices.
for dt in [torch.float32, torch.float64, torch.float16, torch.bfloat16]:
    for H, C in [(1, 7), (3, 32), (2, 256)]:
        x = torch.randn(300, H, C, device=dev, dtype=dt, requires_grad=True)
        beta = torch.rand(H, device=dev, requires_grad=True)
        src = torch.randint(0, 300, (9000,), device=dev)
        dst = torch.randint(0, 300, (9000,), device=dev)
        dst[:5000] = 11
        edgedot.agnn_attention(x, beta, src, dst).sum().backward()
        dst_sorted = torch.sort(dst).values
        edgedot.agnn_attention(x, beta, src, dst_sorted, dst_ptr=edgedot.index_to_ptr(dst_sorted, 300)).sum().backward()
        src[::97] = 300
        edgedot.agnn_attention(x, beta, src, dst, check_indices=False).nan_to_num().sum().backward()

# GAT's per-node logits: every dtype, att in float32 beside narrower x (autocast), rows not a
# multiple of a backward block, misaligned channels, a strided x, one side or both.
for dt in [torch.float32, torch.float64, torch.float16, torch.bfloat16]:
    for N, H, C in [(1, 1, 1), (130, 3, 33), (1000, 4, 32), (70, 2, 256)]:
        x = torch.randn(N, H, C + 1, device=dev, dtype=dt)[..., 1:].requires_grad_()
        for att_dt, sides in {(dt, ()), (torch.float32, ()), (dt, (2,))}:  # one side, or both at once
            att = torch.randn(*sides, H, C, device=dev, dtype=att_dt, requires_grad=True)
            logits = edgedot.ops.node_logits.gat_node_logits(x, att)
            logits.backward(torch.randn_like(logits))
        # Both sides given apart (GATConv's parameters), the gradient of one side, of the other, of both.
        for att_dt in {dt, torch.float32}:
            att_src, att_dst = (torch.randn(1, H, C, device=dev, dtype=att_dt, requires_grad=True) for _ in range(2))
            for used in ((0,), (1,), (0, 1)):
                sides = edgedot.ops.node_logits.gat_node_logit_sides(x, att_src, att_dst)
                torch.autograd.backward([sides[k] for k in used], [torch.randn_like(sides[k]) for k in used])

# Column sums (the layers' bias gradients): every dtype, widths below and off a vector, strided and
# misaligned rows, one row, more rows than one block's slab times the block limit.
for dt in [torch.float32, torch.float64, torch.float16, torch.bfloat16]:
    for rows, width in [(1, 1), (7, 3), (1000, 129), (70_000, 128), (300, 520)]:
        base = torch.randn(rows, width + 5, device=dev, dtype=dt)
        for x in (base[:, :width], base[:, 1:width + 1]):
            edgedot.ops.column_sum.column_sum(x)

# The fused input check (one kernel; its verdict read later): good graphs, a pointer that disagrees, an index out of range.
for it in [torch.int32, torch.int64]:
    q, k, v = (torch.randn(n, 2, 16, device=dev) for n in (300, 400, 400))
    dst = torch.sort(torch.randint(0, 300, (5000,), device=dev, dtype=it)).values
    src = torch.randint(0, 400, (5000,), device=dev, dtype=it)
    ptr = edgedot.index_to_ptr(dst, 300)
    edgedot.graph_attention(q, k, v, src, dst, dst_ptr=ptr)
    wrong = ptr.clone()
    wrong[5] += 1
    bad_src = src.clone()
    bad_src[17] = 400
    for s_idx, p_idx in ((src, wrong), (bad_src, ptr)):
        try:
            edgedot.graph_attention(q, k, v, s_idx, dst, dst_ptr=p_idx)
            edgedot.wait_for_checks()  # the verdict arrives after the call returns
        except (ValueError, IndexError):
            pass

# The groupings of the extension (group_edges, group_edges_both): the one-launch sort of a small
# batch over one tile, several tiles (the last cut short) and 1 to 4 passes, and CUB's sort past
# its tiles; both index dtypes, out-of-range rows and others.
ext = edgedot.runtime.build.cuda_module()  # (imported by attention_calls)
for it in [torch.int32, torch.int64]:
    for num_edges, num_rows, num_other in [(1, 1, 1), (5000, 3, 100), (20001, 70000, 1000), (9000, 2**24, 2**30),
                                           (600_000, 16384, 180_000)]:
        rows = torch.randint(0, num_rows, (num_edges,), device=dev, dtype=it)
        others = torch.randint(0, num_other, (num_edges,), device=dev, dtype=it)
        rows[::7] = -1
        others[3::11] = num_other
        ext.group_edges(rows, others, num_rows, num_other)
        ext.group_edges_both(rows, others, num_rows, num_other)
torch.cuda.synchronize()
print("sanitize workload done")
