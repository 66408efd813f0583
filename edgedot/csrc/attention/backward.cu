// Graph attention backward by recomputation from lse (FlashAttention-style): two passes, each
// writing every row it owns once, without atomics, so gradients are bitwise reproducible.
//   dst pass: team per (n, h) over the dst grouping: delta[n, h], dq[n, h], d_edge_feat per edge;
//   src pass: team per (m, h) over the src grouping: dk[m, h], dv[m, h], reading delta.
// Long rows are walked in chunks whose partial gradients a merge sums in chunk order
// (csrc/attention_merge.cu).
// Scores are recomputed exactly as the forward computes them (same team shape, same order of
// operations), so alpha = exp(score - lse) matches the forward's softmax.
#include "attention/engine.cuh"

namespace edgedot {

namespace {

// Edges in flight per team in the dst pass: the forward's, but one for float32 rows of two vectors a
// lane, which spilled 152 bytes with two.
template <typename T, int NV, bool kHasEdgeFeat>
constexpr int kDstBatch = std::is_same_v<T, float> && NV == 2 ? 1 : kAttentionBatch<T, NV, kHasEdgeFeat>;

// The src pass holds more per edge (lse and delta besides the rows): one edge fewer without
// edge_feat, whose batch spilled at 80 registers.
template <typename T, int NV, bool kHasEdgeFeat>
constexpr int kSrcBatch = kHasEdgeFeat ? kDstBatch<T, NV, true> : std::max(1, kDstBatch<T, NV, false> - 1);

// Per edge: ds = alpha * (dp * w - delta), with w = keep / (1 - p) (keep_weight), alpha' = alpha * w.
// An edge whose alpha is exactly 0 (a -inf score) adds nothing, so gradients stay finite wherever
// the forward is. kPerEdge: whether edge_feat is present or d_edge_feat wanted; without either (the
// common case), the per-edge rows and stores are compiled out and take no registers.
// Units as in the forward (for_each_unit): a chunk of a long row writes its part of dq to its slot.
template <typename T, int VEC, int NV, bool kPerEdge>
__global__ void __launch_bounds__(kBlockThreads, kAttentionBlocksPerSM<T, NV, kPerEdge>)
attention_backward_dst_kernel(AttentionBackwardArgs a, int group) {
  using A = accum_t<T>;
  constexpr int B = kDstBatch<T, NV, kPerEdge>;
  const AttentionInputs& in = a.in;
  const Team t(group);
  const int dvec = static_cast<int>(in.dim / VEC), vvec = static_cast<int>(in.dim_v / VEC);
  const bool has_ef = kPerEdge && in.edge_feat.data != nullptr;
  const int64_t num_dst = in.q.num_rows, num_src = in.k.num_rows, heads = in.heads;
  const A scale = static_cast<A>(in.scale);
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const A* lse_in = static_cast<const A*>(a.lse);
  A* delta_out = static_cast<A*>(a.delta);
  T* dq_out = static_cast<T*>(a.dq);
  T* d_ef = kPerEdge ? static_cast<T*>(a.d_edge_feat) : nullptr;
  const uint64_t key = unpack_dropout_key(in.dropout.rng);  // the pair the forward recorded

  for_each_unit(a.dst, a.dst_chunks, num_dst, heads, in.num_edges, thread / group, threads / group,
                [&](const WorkUnit& w) {
    const int64_t n = w.row, h = w.head, unit = n * heads + h;
    LaneRow<T, VEC, NV> q, dout, dq;
    load_widened(q, row_head<T>(in.q, n, h), t, dvec);
    load_widened(dout, row_head<T>(a.grad_out, n, h), t, vvec);
    A delta;
    {
      LaneRow<T, VEC, NV> out;
      load_widened(out, row_head<T>(a.out, n, h), t, vvec);
      delta = t.sum(lane_dot(dout, out));
    }
    if (w.lead && t.lane == 0) delta_out[unit] = delta;
    const A lse = lse_in[unit];
    dq.zero();
    RawRow<T, VEC, NV> kr[B], vr[B], er[B];
    walk_edges<B>(
        a.dst, in.num_edges, num_src, t, n, w.begin, w.end,
        [&](const GroupedEdge (&e)[B]) {
#pragma unroll
          for (int j = 0; j < B; ++j) {
            const bool ok = e[j].other >= 0;
            kr[j].load(ok ? row_head<T>(in.k, e[j].other, h) : nullptr, t, dvec);
            vr[j].load(ok ? row_head<T>(in.v, e[j].other, h) : nullptr, t, vvec);
            er[j].load(has_ef && ok ? row_head<T>(in.edge_feat, e[j].edge, h) : nullptr, t, dvec);
          }
        },
        [&](const GroupedEdge (&e)[B], int64_t i) {
#pragma unroll
          for (int j = 0; j < B; ++j) {
            if (i + j >= w.end) break;
            T* d_ef_row = d_ef != nullptr && e[j].edge >= 0
                              ? d_ef + (e[j].edge * heads + h) * in.dim
                              : nullptr;
            const A s = e[j].other >= 0 ? scaled_score(t.sum(lane_dot(q, kr[j], er[j], has_ef, t, dvec)), scale)
                                        : A(0);
            const A alpha = accurate_exp(s - lse);
            if (e[j].other < 0 || alpha == A(0)) {  // an out-of-range source or a -inf score adds nothing
              if (d_ef_row != nullptr) store_zero_row<T, VEC, NV>(d_ef_row, t, dvec);
              continue;
            }
            const A dp = t.sum(lane_dot(dout, vr[j], er[j], has_ef, t, vvec));
            const A w8 = keep_weight<A>(in.dropout, key, e[j].edge, h, heads);
            const A ds = alpha * (dp * w8 - delta);
            add_scaled(dq, scale * ds, kr[j], er[j], has_ef, t, dvec);
            if (d_ef_row != nullptr) store_combination(d_ef_row, t, dvec, scale * ds, q, alpha * w8, dout, true);
          }
        });
    if (w.slot >= 0) {
      store_partial(static_cast<A*>(a.part_dq) + (int64_t{w.slot} * heads + h) * in.dim, t, dvec, dq);
    } else {
      store_row(dq_out + unit * in.dim, t, dvec, A(1), dq);
    }
  });

  if (d_ef == nullptr || a.dst.order == nullptr) return;  // edges given grouped all lie in some row
  // Edges whose destination is out of range (only without index checks) add nothing.
  const int64_t tail = clamp_position(a.dst.offsets[num_dst], in.num_edges);
  const int64_t row_elems = heads * in.dim;
  for (int64_t x = thread; x < (in.num_edges - tail) * row_elems; x += threads) {
    const int64_t i = tail + x / row_elems;
    const int64_t e = a.dst.order[i];
    if (in_range(e, in.num_edges)) d_ef[e * row_elems + x % row_elems] = from_accum<T>(A(0));
  }
}

// Team per unit (m, h) of the src grouping: k[m, h] and v[m, h] in registers, each outgoing edge's
// q, grad_out (destination n) and edge_feat rows in flight, with lse and delta of (n, h). A chunk of
// a long row writes its parts of dk and dv to its slot.
// kHasEdgeFeat: whether edge_feat is present; without it er is never touched and takes no registers.
template <typename T, int VEC, int NV, bool kHasEdgeFeat>
__global__ void __launch_bounds__(kBlockThreads, kAttentionBlocksPerSM<T, NV, kHasEdgeFeat>)
attention_backward_src_kernel(AttentionBackwardArgs a, int group) {
  using A = accum_t<T>;
  constexpr int B = kSrcBatch<T, NV, kHasEdgeFeat>;
  const AttentionInputs& in = a.in;
  const Team t(group);
  const int dvec = static_cast<int>(in.dim / VEC), vvec = static_cast<int>(in.dim_v / VEC);
  const int64_t num_dst = in.q.num_rows, num_src = in.k.num_rows, heads = in.heads;
  const A scale = static_cast<A>(in.scale);
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const A* lse_in = static_cast<const A*>(a.lse);
  const A* delta_in = static_cast<const A*>(a.delta);
  T* dk_out = static_cast<T*>(a.dk);
  T* dv_out = static_cast<T*>(a.dv);
  const uint64_t key = unpack_dropout_key(in.dropout.rng);  // the pair the forward recorded

  for_each_unit(a.src, a.src_chunks, num_src, heads, in.num_edges, thread / group, threads / group,
                [&](const WorkUnit& w) {
    const int64_t m = w.row, h = w.head, unit = m * heads + h;
    RawRow<T, VEC, NV> k, v;
    k.load(row_head<T>(in.k, m, h), t, dvec);
    v.load(row_head<T>(in.v, m, h), t, vvec);
    LaneRow<T, VEC, NV> dk, dv;
    dk.zero();
    dv.zero();
    RawRow<T, VEC, NV> qr[B], gr[B], er[B];
    A lse[B], delta[B];
    walk_edges<B>(
        a.src, in.num_edges, num_dst, t, m, w.begin, w.end,
        [&](const GroupedEdge (&e)[B]) {
#pragma unroll
          for (int j = 0; j < B; ++j) {
            const bool ok = e[j].other >= 0;
            qr[j].load(ok ? row_head<T>(in.q, e[j].other, h) : nullptr, t, dvec);
            gr[j].load(ok ? row_head<T>(a.grad_out, e[j].other, h) : nullptr, t, vvec);
            if constexpr (kHasEdgeFeat) er[j].load(ok ? row_head<T>(in.edge_feat, e[j].edge, h) : nullptr, t, dvec);
            lse[j] = ok ? __ldg(lse_in + e[j].other * heads + h) : A(0);
            delta[j] = ok ? __ldg(delta_in + e[j].other * heads + h) : A(0);
          }
        },
        [&](const GroupedEdge (&e)[B], int64_t) {
#pragma unroll
          for (int j = 0; j < B; ++j) {
            if (e[j].other < 0) continue;  // past the end, or an out-of-range destination: adds nothing
            // The forward's score: q widened, k + edge_feat widened element by element. Rows are
            // widened where used (zeros where the lane holds no vector).
            const A s = scaled_score(t.sum(lane_dot(qr[j], k, er[j], kHasEdgeFeat, t, dvec)), scale);
            const A alpha = accurate_exp(s - lse[j]);
            if (alpha == A(0)) continue;  // a -inf score adds nothing
            const A dp = t.sum(lane_dot(gr[j], v, er[j], kHasEdgeFeat, t, vvec));
            const A w8 = keep_weight<A>(in.dropout, key, e[j].edge, h, heads);
            const A ds = alpha * (dp * w8 - delta[j]);
            const A g = scale * ds, gv = alpha * w8;
#pragma unroll
            for (int u = 0; u < NV; ++u)
#pragma unroll
              for (int c = 0; c < VEC; ++c) {
                dk.x[u][c] = fma_accum(g, qr[j].at(u, c), dk.x[u][c]);
                dv.x[u][c] = fma_accum(gv, gr[j].at(u, c), dv.x[u][c]);
              }
          }
        });
    if (w.slot >= 0) {
      const int64_t part = int64_t{w.slot} * heads + h;
      store_partial(static_cast<A*>(a.part_dk) + part * in.dim, t, dvec, dk);
      store_partial(static_cast<A*>(a.part_dv) + part * in.dim_v, t, vvec, dv);
    } else {
      store_row(dk_out + unit * in.dim, t, dvec, A(1), dk);
      store_row(dv_out + unit * in.dim_v, t, vvec, A(1), dv);
    }
  });
}

template <typename T>
bool backward_vectorizable(const AttentionBackwardArgs& a) {
  const AttentionInputs& in = a.in;
  return attention_vectorizable<T>({{&in.q, in.dim},
                                    {&in.k, in.dim},
                                    {&in.v, in.dim_v},
                                    {&in.edge_feat, in.dim},
                                    {&a.grad_out, in.dim_v},
                                    {&a.out, in.dim_v}},
                                   {a.dq, a.dk, a.dv, a.d_edge_feat});
}

// Calls launch(integral_constant VEC, integral_constant NV, bool_constant per_edge, group) for the
// arguments' team shape, the same in both passes and in the forward.
template <typename T, typename F>
void dispatch_backward(const AttentionBackwardArgs& a, bool per_edge, F&& launch) {
  const bool vectorized = backward_vectorizable<T>(a);
  const int vec = vectorized ? wide_vec<T>() : 1;
  const TeamShape shape = attention_team((a.in.dim > a.in.dim_v ? a.in.dim : a.in.dim_v) / vec);
  dispatch_attention<T>(vectorized, shape.per_lane, per_edge,
                        [&](auto v, auto nv, auto pe) { launch(v, nv, pe, shape.group); });
}

}  // namespace

void launch_attention_backward_dst(const AttentionBackwardArgs& a, ScalarKind scalar, cudaStream_t stream) {
  dispatch_scalar(scalar, [&](auto zero) {
    using T = decltype(zero);
    const bool per_edge = a.in.edge_feat.data != nullptr || a.d_edge_feat != nullptr;
    dispatch_backward<T>(a, per_edge, [&](auto v, auto nv, auto pe, int group) {
      auto kernel = attention_backward_dst_kernel<T, decltype(v)::value, decltype(nv)::value, decltype(pe)::value>;
      const int64_t threads = (a.in.q.num_rows + a.dst_chunks.max_slots) * a.in.heads * group +
                              (a.d_edge_feat != nullptr ? a.in.num_edges : 0);
      if (threads == 0) return;
      kernel<<<grid_blocks(kernel, threads), kBlockThreads, 0, stream>>>(a, group);
    });
    if (a.dst_chunks.first_chunk != nullptr) {
      launch_merge_sum<T>(a.dst_chunks, a.in.heads, a.in.dim, static_cast<const accum_t<T>*>(a.part_dq),
                          static_cast<T*>(a.dq), stream);
    }
  });
}

void launch_attention_backward_src(const AttentionBackwardArgs& a, ScalarKind scalar, cudaStream_t stream) {
  dispatch_scalar(scalar, [&](auto zero) {
    using T = decltype(zero);
    dispatch_backward<T>(a, a.in.edge_feat.data != nullptr, [&](auto v, auto nv, auto ef, int group) {
      auto kernel = attention_backward_src_kernel<T, decltype(v)::value, decltype(nv)::value, decltype(ef)::value>;
      const int64_t threads = (a.in.k.num_rows + a.src_chunks.max_slots) * a.in.heads * group;
      if (threads == 0) return;
      kernel<<<grid_blocks(kernel, threads), kBlockThreads, 0, stream>>>(a, group);
    });
    if (a.src_chunks.first_chunk != nullptr) {
      launch_merge_sum<T>(a.src_chunks, a.in.heads, a.in.dim, static_cast<const accum_t<T>*>(a.part_dk),
                          static_cast<T*>(a.dk), stream);
      launch_merge_sum<T>(a.src_chunks, a.in.heads, a.in.dim_v, static_cast<const accum_t<T>*>(a.part_dv),
                          static_cast<T*>(a.dv), stream);
    }
  });
}

}  // namespace edgedot
