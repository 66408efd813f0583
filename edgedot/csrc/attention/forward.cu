// Graph attention forward: one team of lanes per (destination, head) walks the destination's
// incoming edges with an online softmax; no per-edge row ever reaches memory. Long rows (hubs) are
// walked in chunks by teams of their own, whose partial (max, sum, output) a merge kernel combines
// in chunk order (csrc/attention_merge.cu).
#include "attention/engine.cuh"

namespace edgedot {

namespace {

// Team per unit (n, h) of the dst grouping (for_each_unit): q[n, h] and the output row in
// registers, B edges' k, v and edge_feat rows in flight per lane, the next batch's positions loaded
// while they arrive. Softmax state (m, l) is kept per team; every lane holds the same bits
// (Team::sum), so branches on it are uniform. An edge whose source is out of range makes its
// destination NaN, and so does a destination whose edges all score -inf. A whole row writes its
// output and lse; a chunk of a long row writes its unnormalised output and (m, l) to its slot.
// The alpha pass (after out and lse are final) recomputes each score and writes alpha; edges whose
// destination is out of range lie past offsets[num_dst]: their alpha is NaN.
// kHasEdgeFeat: whether edge_feat is present; without it er is never touched and takes no registers.
template <typename T, int VEC, int NV, bool kHasEdgeFeat>
__global__ void __launch_bounds__(kBlockThreads, kAttentionBlocksPerSM<T, NV, kHasEdgeFeat>)
attention_forward_kernel(AttentionForwardArgs a, int group, bool alpha_pass) {
  using A = accum_t<T>;
  constexpr int B = kAttentionBatch<T, NV, kHasEdgeFeat>;
  const AttentionInputs& in = a.in;
  const Team t(group);
  const int dvec = static_cast<int>(in.dim / VEC), vvec = static_cast<int>(in.dim_v / VEC);
  const int64_t num_dst = in.q.num_rows, num_src = in.k.num_rows, heads = in.heads;
  const A scale = static_cast<A>(in.scale);
  const A inf = static_cast<A>(INFINITY), nan = static_cast<A>(NAN);
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  T* out = static_cast<T*>(a.out);
  A* lse_out = static_cast<A*>(a.lse);
  T* alpha = static_cast<T*>(a.alpha);

  LaneRow<T, VEC, NV> q;
  RawRow<T, VEC, NV> kr[B], vr[B], er[B];
  int64_t h = 0;
  auto load_keys = [&](const GroupedEdge (&e)[B]) {
#pragma unroll
    for (int j = 0; j < B; ++j) {
      const bool ok = e[j].other >= 0;
      kr[j].load(ok ? row_head<T>(in.k, e[j].other, h) : nullptr, t, dvec);
      if constexpr (kHasEdgeFeat) er[j].load(ok ? row_head<T>(in.edge_feat, e[j].edge, h) : nullptr, t, dvec);
    }
  };
  // Edge j's score; NaN when its rows do not exist.
  auto score = [&](const GroupedEdge& e, int j) {
    if (e.other < 0) return nan;
    return scaled_score(t.sum(lane_dot(q, kr[j], er[j], kHasEdgeFeat, t, dvec)), scale);
  };

  if (alpha_pass) {
    for_each_unit(a.dst, a.dst_chunks, num_dst, heads, in.num_edges, thread / group, threads / group,
                  [&](const WorkUnit& w) {
      h = w.head;
      load_widened(q, row_head<T>(in.q, w.row, h), t, dvec);
      const A lse = lse_out[int64_t{w.row} * heads + h];
      walk_edges<B>(a.dst, in.num_edges, num_src, t, w.row, w.begin, w.end, load_keys,
                    [&](const GroupedEdge (&e)[B], int64_t i) {
#pragma unroll
        for (int j = 0; j < B; ++j) {
          const A s = score(e[j], j);
          if (i + j < w.end && t.lane == (j & (group - 1)) && e[j].edge >= 0) {
            alpha[e[j].edge * heads + h] = from_accum<T>(w.bad ? nan : accurate_exp(s - lse));
          }
        }
      });
    });
    // Edges whose destination is out of range (only without index checks).
    if (a.dst.order == nullptr) return;  // edges given grouped lie in some destination's range
    const int64_t tail = clamp_position(a.dst.offsets[num_dst], in.num_edges);
    for (int64_t x = thread; x < (in.num_edges - tail) * heads; x += threads) {
      const int64_t i = tail + x / heads;
      const int64_t e = a.dst.order[i];
      if (in_range(e, in.num_edges)) alpha[e * heads + x % heads] = from_accum<T>(nan);
    }
    return;
  }

  // This pass records the dropout (seed, offset) for the backward (the alpha pass draws no mask).
  const uint64_t key = unpack_dropout_key(in.dropout.rng);
  for_each_unit(a.dst, a.dst_chunks, num_dst, heads, in.num_edges, thread / group, threads / group,
                [&](const WorkUnit& w) {
    h = w.head;
    load_widened(q, row_head<T>(in.q, w.row, h), t, dvec);
    LaneRow<T, VEC, NV> acc;
    acc.zero();
    A m = -inf, l = 0;
    bool bad = w.bad;
    walk_edges<B>(
        a.dst, in.num_edges, num_src, t, w.row, w.begin, w.end,
        [&](const GroupedEdge (&e)[B]) {
          load_keys(e);
#pragma unroll
          for (int j = 0; j < B; ++j) vr[j].load(e[j].other >= 0 ? row_head<T>(in.v, e[j].other, h) : nullptr, t, vvec);
        },
        [&](const GroupedEdge (&e)[B], int64_t i) {
          A s[B];
          A m_new = m;
#pragma unroll
          for (int j = 0; j < B; ++j) {
            s[j] = score(e[j], j);
            if (i + j < w.end && !(s[j] == s[j])) bad = true;  // also catches NaN from the inputs
            if (s[j] > m_new) m_new = s[j];
          }
          if (m_new == -inf) return;  // no edge of the batch adds anything
          const A correction = accurate_exp(m - m_new);  // 0 on the first edge (m = -inf)
          l *= correction;
          scale_row(acc, correction);
          m = m_new;
#pragma unroll
          for (int j = 0; j < B; ++j) {
            if (!(s[j] > -inf)) continue;  // NaN, -inf, or past the end
            const A p = accurate_exp(s[j] - m);
            l += p;
            add_scaled(acc, p * keep_weight<A>(in.dropout, key, e[j].edge, h, heads), vr[j], er[j], kHasEdgeFeat, t,
                       vvec);
          }
        });
    const int64_t unit = int64_t{w.row} * heads + h;
    if (w.slot >= 0) {  // a chunk of a long row: its partial result
      const int64_t part = int64_t{w.slot} * heads + h;
      store_partial(static_cast<A*>(a.part_acc) + part * in.dim_v, t, vvec, acc);
      if (t.lane == 0) {
        static_cast<A*>(a.part_ml)[2 * part] = bad ? nan : m;
        static_cast<A*>(a.part_ml)[2 * part + 1] = l;
      }
      return;
    }
    // A destination with edges that all score -inf has no softmax: NaN, as in PyTorch.
    if (w.end > w.begin && !(l > 0)) bad = true;
    T* out_row = out + unit * in.dim_v;
    if (bad) {
      store_row(out_row, t, vvec, nan, acc);
    } else if (l > 0) {
      store_row(out_row, t, vvec, A(1) / l, acc);
    } else {
      store_zero_row<T, VEC, NV>(out_row, t, vvec);
    }
    if (t.lane == 0) lse_out[unit] = bad ? nan : l > 0 ? m + accurate_log(l) : -inf;
  });
}

template <typename T, int VEC, int NV, bool kHasEdgeFeat>
void launch(const AttentionForwardArgs& a, int group, bool alpha_pass, cudaStream_t stream) {
  auto kernel = attention_forward_kernel<T, VEC, NV, kHasEdgeFeat>;
  int64_t threads = (a.in.q.num_rows + a.dst_chunks.max_slots) * a.in.heads * group +
                    (alpha_pass ? a.in.num_edges : 0);
  // Without rows the main pass still runs a thread when it must record the dropout state.
  if (threads == 0 && (alpha_pass || a.in.dropout.rng.record == nullptr)) return;
  threads = std::max<int64_t>(threads, 1);
  kernel<<<grid_blocks(kernel, threads), kBlockThreads, 0, stream>>>(a, group, alpha_pass);
}

}  // namespace

void launch_attention_forward(const AttentionForwardArgs& a, ScalarKind scalar, cudaStream_t stream) {
  dispatch_scalar(scalar, [&](auto zero) {
    using T = decltype(zero);
    const AttentionInputs& in = a.in;
    const bool vectorized = attention_vectorizable<T>(
        {{&in.q, in.dim}, {&in.k, in.dim}, {&in.v, in.dim_v}, {&in.edge_feat, in.dim}}, {a.out});
    const int vec = vectorized ? wide_vec<T>() : 1;
    const TeamShape shape = attention_team((in.dim > in.dim_v ? in.dim : in.dim_v) / vec);
    dispatch_attention<T>(vectorized, shape.per_lane, in.edge_feat.data != nullptr, [&](auto v, auto nv, auto ef) {
      constexpr int kVec = decltype(v)::value, kNV = decltype(nv)::value;
      constexpr bool kEF = decltype(ef)::value;
      launch<T, kVec, kNV, kEF>(a, shape.group, false, stream);
      if (a.dst_chunks.first_chunk != nullptr) {
        launch_merge_softmax<T>(a.dst_chunks, in.heads, in.dim_v, static_cast<const accum_t<T>*>(a.part_acc),
                                static_cast<const accum_t<T>*>(a.part_ml), static_cast<T*>(a.out),
                                static_cast<accum_t<T>*>(a.lse), stream);
      }
      if (a.alpha != nullptr) launch<T, kVec, kNV, kEF>(a, shape.group, true, stream);
    });
  });
}

}  // namespace edgedot
