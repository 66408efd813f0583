// GAT and GATv2 backward, source side, by recomputation from lse and the dst pass's delta
// (csrc/gat_backward_dst.cu): a team per (s, h) of the src grouping writes dx[s, h] = sum over its
// outgoing edges of alpha' * grad_out[n] (GATv2: plus dm) and, for GAT, da_src[s, h] = sum of dz,
// without atomics. Long rows are walked in chunks whose partials a merge sums in chunk order.
#include "attention/scores.cuh"

namespace edgedot {

namespace {

// Edges in flight per team: float GAT with a_edge holds at most three (at four its 80 registers
// spilled). The sums run in edge order whatever the batch, so the results are the same bits.
template <typename T, int NV, bool kV2, bool kEdge>
constexpr int kGatSrcBatch =
    kEdge && !kV2 && std::is_same_v<T, float> ? std::min(3, kGatBatch<T, NV, kV2>) : kGatBatch<T, NV, kV2>;

// Team per unit (s, h): x[s, h] (raw) and the gradient row in registers, each outgoing edge's
// grad_out row (destination n), lse and delta of (n, h) in flight, with GAT's a_dst[n] and a_edge[e]
// or GATv2's x_dst[n] and edge_feat[e] rows. Scores as the forward computes them (csrc/gat.cuh).
template <typename T, int VEC, int NV, bool kV2, bool kEdge>
__global__ void __launch_bounds__(kBlockThreads, kGatBlocksPerSM<T, NV, kV2>)
gat_backward_src_kernel(GatBackwardArgs a, int group) {
  using A = accum_t<T>;
  constexpr int B = kGatSrcBatch<T, NV, kV2, kEdge>;
  const GatInputs& in = a.in;
  const Team t(group);
  const int vecs = static_cast<int>(in.dim / VEC);
  const int64_t num_dst = in.num_dst, num_src = in.x.num_rows, heads = in.heads;
  const A slope = static_cast<A>(in.negative_slope);
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const A* lse_in = static_cast<const A*>(a.lse);
  const A* delta_in = static_cast<const A*>(a.delta);
  T* dx_out = static_cast<T*>(a.dx);
  T* da_src_out = static_cast<T*>(a.da_src);
  const uint64_t key = unpack_dropout_key(in.dropout.rng);  // the pair the forward recorded

  for_each_unit(a.src, a.src_chunks, num_src, heads, in.num_edges, thread / group, threads / group,
                [&](const WorkUnit& w) {
    const int64_t s = w.row, h = w.head, unit = s * heads + h;
    RawRow<T, VEC, NV> xs;
    xs.load(row_head<T>(in.x, s, h), t, vecs);
    LaneRow<T, VEC, NV> att;  // GATv2
    A as = 0;                 // GAT
    if constexpr (kV2) {
      load_widened(att, row_head<T>(in.att, 0, h), t, vecs);
    } else {
      as = load_scalar<T>(in.a_src, s, h);
    }
    LaneRow<T, VEC, NV> dx;
    dx.zero();
    A da_src = 0;  // GAT: the same on every lane
    RawRow<T, VEC, NV> gr[B], xdr[B], er[B];
    A lse[B], delta[B], ad[B], ae[B];
    walk_edges<B>(
        a.src, in.num_edges, num_dst, t, s, w.begin, w.end,
        [&](const GroupedEdge (&e)[B]) {
#pragma unroll
          for (int j = 0; j < B; ++j) {
            const bool ok = e[j].other >= 0;
            const int64_t n = e[j].other;
            gr[j].load(ok ? row_head<T>(a.grad_out, n, h) : nullptr, t, vecs);
            if constexpr (kV2) {
              xdr[j].load(ok ? row_head<T>(in.x_dst, n, h) : nullptr, t, vecs);
              if constexpr (kEdge) er[j].load(ok ? row_head<T>(in.edge_feat, e[j].edge, h) : nullptr, t, vecs);
            } else {
              ad[j] = ok ? load_scalar<T>(in.a_dst, n, h) : A(0);
              if constexpr (kEdge) ae[j] = ok ? load_scalar<T>(in.a_edge, e[j].edge, h) : A(0);
            }
            lse[j] = ok ? __ldg(lse_in + n * heads + h) : A(0);
            delta[j] = ok ? __ldg(delta_in + n * heads + h) : A(0);
          }
        },
        [&](const GroupedEdge (&e)[B], int64_t) {
#pragma unroll
          for (int j = 0; j < B; ++j) {
            if (e[j].other < 0) continue;  // past the end, or an out-of-range destination: adds nothing
            A z = 0, score;
            if constexpr (kV2) {
              score = t.sum(gatv2_lane_score(att, xs, xdr[j], er[j], kEdge, slope, t, vecs));
            } else {
              z = as + ad[j];  // the forward's (a_src + a_dst) + a_edge
              if constexpr (kEdge) z += ae[j];
              score = leaky_relu(z, slope);
            }
            const A alpha = accurate_exp(score - lse[j]);
            if (alpha == A(0)) continue;  // a -inf score adds nothing
            const A dp = t.sum(lane_dot(gr[j], xs, xs, false, t, vecs));
            const A w8 = keep_weight<A>(in.dropout, key, e[j].edge, h, heads);
            const A ds = alpha * (dp * w8 - delta[j]);
            const A gv = alpha * w8;
            if constexpr (!kV2) da_src += ds * leaky_relu_grad(z, slope);
#pragma unroll
            for (int u = 0; u < NV; ++u) {
              if (!lane_has<NV>(t, vecs, u)) continue;
#pragma unroll
              for (int c = 0; c < VEC; ++c) {
                A d = fma_accum(gv, gr[j].at(u, c), dx.x[u][c]);
                if constexpr (kV2) {
                  d += gatv2_dm(ds, att.at(u, c), gatv2_m<A>(xs, xdr[j], er[j], kEdge, u, c), slope);
                }
                dx.x[u][c] = d;
              }
            }
          }
        });
    if (w.slot >= 0) {
      const int64_t part = int64_t{w.slot} * heads + h;
      store_partial(static_cast<A*>(a.part_dx) + part * in.dim, t, vecs, dx);
      if (!kV2 && t.lane == 0) static_cast<A*>(a.part_da_src)[part] = da_src;
    } else {
      store_row(dx_out + unit * in.dim, t, vecs, A(1), dx);
      if (!kV2 && t.lane == 0) da_src_out[unit] = from_accum<T>(da_src);
    }
  });
}

}  // namespace

void launch_gat_backward_src(const GatBackwardArgs& a, ScalarKind scalar, cudaStream_t stream) {
  dispatch_scalar(scalar, [&](auto zero) {
    using T = decltype(zero);
    using A = accum_t<T>;
    const GatInputs& in = a.in;
    dispatch_gat<T>(in, gat_backward_vectorizable<T>(a), [&](auto v, auto nv, auto v2, auto edge, int group) {
      auto kernel = gat_backward_src_kernel<T, decltype(v)::value, decltype(nv)::value, decltype(v2)::value,
                                            decltype(edge)::value>;
      const int64_t threads = (in.x.num_rows + a.src_chunks.max_slots) * in.heads * group;
      if (threads == 0) return;
      kernel<<<grid_blocks(kernel, threads), kBlockThreads, 0, stream>>>(a, group);
    });
    if (a.src_chunks.first_chunk != nullptr) {
      launch_merge_sum<T>(a.src_chunks, in.heads, in.dim, static_cast<const A*>(a.part_dx), static_cast<T*>(a.dx),
                          stream);
      if (!in.v2) {
        launch_merge_sum<T>(a.src_chunks, in.heads, 1, static_cast<const A*>(a.part_da_src),
                            static_cast<T*>(a.da_src), stream);
      }
    }
  });
}

}  // namespace edgedot
