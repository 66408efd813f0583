// GAT and GATv2 forward: one team of lanes per (destination, head) walks the destination's incoming
// edges with an online softmax, exactly as graph attention's forward (csrc/attention_forward.cu)
// does, with the score of the model (csrc/gat.cuh) in place of a dot product. Long rows are walked
// in chunks whose partials the softmax merge combines in chunk order (csrc/attention_merge.cu).
#include "attention/scores.cuh"

namespace edgedot {

namespace {

// Team per unit (n, h) of the dst grouping: the destination side of the score and the output row in
// registers, B edges' x rows (and GATv2's edge_feat rows) in flight per lane. An edge whose source
// is out of range makes its destination NaN, and so does a destination whose edges all score -inf
// or NaN. The alpha pass (after out and lse are final) recomputes each score and writes alpha;
// edges whose destination is out of range lie past offsets[num_dst]: their alpha is NaN.
template <typename T, int VEC, int NV, bool kV2, bool kEdge>
__global__ void __launch_bounds__(kBlockThreads, kGatBlocksPerSM<T, NV, kV2>)
gat_forward_kernel(GatForwardArgs a, int group, bool alpha_pass) {
  using A = accum_t<T>;
  constexpr int B = kGatBatch<T, NV, kV2>;
  const GatInputs& in = a.in;
  const Team t(group);
  const int vecs = static_cast<int>(in.dim / VEC);
  const int64_t num_dst = in.num_dst, num_src = in.x.num_rows, heads = in.heads;
  const A slope = static_cast<A>(in.negative_slope);
  const A inf = static_cast<A>(INFINITY), nan = static_cast<A>(NAN);
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  T* out = static_cast<T*>(a.out);
  A* lse_out = static_cast<A*>(a.lse);
  T* alpha = static_cast<T*>(a.alpha);

  GatDstSide<T, VEC, NV, kV2, kEdge, B> side;
  RawRow<T, VEC, NV> xr[B];
  int64_t h = 0;
  // GAT's alpha pass needs no x rows: its scores come from scalars.
  const bool load_x = kV2 || !alpha_pass;
  auto load = [&](const GroupedEdge (&e)[B]) {
    if (load_x) {
#pragma unroll
      for (int j = 0; j < B; ++j) xr[j].load(e[j].other >= 0 ? row_head<T>(in.x, e[j].other, h) : nullptr, t, vecs);
    }
    side.load(in, t, vecs, e, h);
  };
  // Edge j's score; NaN when its rows do not exist.
  auto score = [&](const GroupedEdge& e, int j) { return e.other < 0 ? nan : side.score(j, xr[j], slope, t, vecs); };

  if (alpha_pass) {
    for_each_unit(a.dst, a.dst_chunks, num_dst, heads, in.num_edges, thread / group, threads / group,
                  [&](const WorkUnit& w) {
      h = w.head;
      side.begin(in, t, vecs, w.row, h);
      const A lse = lse_out[int64_t{w.row} * heads + h];
      walk_edges<B>(a.dst, in.num_edges, num_src, t, w.row, w.begin, w.end, load,
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
    side.begin(in, t, vecs, w.row, h);
    LaneRow<T, VEC, NV> acc;
    acc.zero();
    A m = -inf, l = 0;
    bool bad = w.bad;
    walk_edges<B>(a.dst, in.num_edges, num_src, t, w.row, w.begin, w.end, load,
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
        add_scaled(acc, p * keep_weight<A>(in.dropout, key, e[j].edge, h, heads), xr[j], xr[j], false, t, vecs);
      }
    });
    const int64_t unit = int64_t{w.row} * heads + h;
    if (w.slot >= 0) {  // a chunk of a long row: its partial result
      const int64_t part = int64_t{w.slot} * heads + h;
      store_partial(static_cast<A*>(a.part_acc) + part * in.dim, t, vecs, acc);
      if (t.lane == 0) {
        static_cast<A*>(a.part_ml)[2 * part] = bad ? nan : m;
        static_cast<A*>(a.part_ml)[2 * part + 1] = l;
      }
      return;
    }
    // A destination with edges that all score -inf has no softmax: NaN, as in PyTorch.
    if (w.end > w.begin && !(l > 0)) bad = true;
    T* out_row = out + unit * in.dim;
    if (bad) {
      store_row(out_row, t, vecs, nan, acc);
    } else if (l > 0) {
      store_row(out_row, t, vecs, A(1) / l, acc);
    } else {
      store_zero_row<T, VEC, NV>(out_row, t, vecs);
    }
    if (t.lane == 0) lse_out[unit] = bad ? nan : l > 0 ? m + accurate_log(l) : -inf;
  });
}

template <typename T, int VEC, int NV, bool kV2, bool kEdge>
void launch(const GatForwardArgs& a, int group, bool alpha_pass, cudaStream_t stream) {
  auto kernel = gat_forward_kernel<T, VEC, NV, kV2, kEdge>;
  int64_t threads = (a.in.num_dst + a.dst_chunks.max_slots) * a.in.heads * group +
                    (alpha_pass ? a.in.num_edges : 0);
  // Without rows the main pass still runs a thread when it must record the dropout state.
  if (threads == 0 && (alpha_pass || a.in.dropout.rng.record == nullptr)) return;
  threads = std::max<int64_t>(threads, 1);
  kernel<<<grid_blocks(kernel, threads), kBlockThreads, 0, stream>>>(a, group, alpha_pass);
}

}  // namespace

void launch_gat_forward(const GatForwardArgs& a, ScalarKind scalar, cudaStream_t stream) {
  dispatch_scalar(scalar, [&](auto zero) {
    using T = decltype(zero);
    const GatInputs& in = a.in;
    dispatch_gat<T>(in, gat_vectorizable<T>(in, {}, {a.out}), [&](auto v, auto nv, auto v2, auto edge, int group) {
      constexpr int kVec = decltype(v)::value, kNV = decltype(nv)::value;
      constexpr bool kV2 = decltype(v2)::value, kEdge = decltype(edge)::value;
      launch<T, kVec, kNV, kV2, kEdge>(a, group, false, stream);
      if (a.dst_chunks.first_chunk != nullptr) {
        launch_merge_softmax<T>(a.dst_chunks, in.heads, in.dim, static_cast<const accum_t<T>*>(a.part_acc),
                                static_cast<const accum_t<T>*>(a.part_ml), static_cast<T*>(a.out),
                                static_cast<accum_t<T>*>(a.lse), stream);
      }
      if (a.alpha != nullptr) launch<T, kVec, kNV, kV2, kEdge>(a, group, true, stream);
    });
  });
}

}  // namespace edgedot
