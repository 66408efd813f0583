// GAT and GATv2 backward, destination side, by recomputation from lse (as graph attention's,
// csrc/attention_backward.cu): a team per (n, h) of the dst grouping writes delta[n, h] =
// <grad_out, out>, the gradient of the destination's own inputs (GAT: da_dst; GATv2: dx_dst and
// its share of datt) and each edge's gradient (da_edge; d_edge_feat), without atomics. Long rows
// are walked in chunks whose partials a merge sums in chunk order (csrc/attention_merge.cu).
#include "attention/scores.cuh"

namespace edgedot {

namespace {

// GATv2, one edge: dm = ds * att * leaky_relu'(m) added to dxd and written to dm_row (when not
// null), ds * leaky_relu(m) added to datt.
template <typename T, int VEC, int NV>
__device__ __forceinline__ void gatv2_edge_grads(LaneRow<T, VEC, NV>& dxd, LaneRow<T, VEC, NV>& datt,
                                                 accum_t<T> ds, const LaneRow<T, VEC, NV>& att,
                                                 const RawRow<T, VEC, NV>& xs, const LaneRow<T, VEC, NV>& xd,
                                                 const RawRow<T, VEC, NV>& ef, bool has_ef, accum_t<T> slope,
                                                 T* dm_row, const Team& t, int vectors) {
  using A = accum_t<T>;
#pragma unroll
  for (int u = 0; u < NV; ++u) {
    if (!lane_has<NV>(t, vectors, u)) continue;
    Vec<T, VEC> dm_out;
#pragma unroll
    for (int c = 0; c < VEC; ++c) {
      const A m = gatv2_m<A>(xs, xd, ef, has_ef, u, c);
      const A dm = gatv2_dm(ds, att.at(u, c), m, slope);
      dxd.x[u][c] += dm;
      datt.x[u][c] = fma_accum(ds, leaky_relu(m, slope), datt.x[u][c]);
      dm_out.v[c] = from_accum<T>(dm);
    }
    if (dm_row != nullptr) *reinterpret_cast<Vec<T, VEC>*>(dm_row + (t.lane + u * t.group) * VEC) = dm_out;
  }
}

// Per edge: ds = alpha * (<grad_out[n], x[s]> * w - delta), w = keep / (1 - p) (keep_weight). An
// edge whose alpha is exactly 0 (a -inf score) or whose source is out of range adds nothing, and
// its edge gradient is zero. Units as in the forward (for_each_unit): a chunk of a long row writes
// its partial gradients to its slot.
template <typename T, int VEC, int NV, bool kV2, bool kEdge>
__global__ void __launch_bounds__(kBlockThreads, kGatBlocksPerSM<T, NV, kV2>)
gat_backward_dst_kernel(GatBackwardArgs a, int group) {
  using A = accum_t<T>;
  constexpr int B = kGatBatch<T, NV, kV2>;
  const GatInputs& in = a.in;
  const Team t(group);
  const int vecs = static_cast<int>(in.dim / VEC);
  const int64_t num_dst = in.num_dst, num_src = in.x.num_rows, heads = in.heads;
  // Elements of an edge's gradient per head: GAT's da_edge is a scalar, GATv2's d_edge_feat a row.
  const int64_t edge_width = kV2 ? in.dim : 1;
  const A slope = static_cast<A>(in.negative_slope);
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const A* lse_in = static_cast<const A*>(a.lse);
  A* delta_out = static_cast<A*>(a.delta);
  T* dst_grad = static_cast<T*>(a.dst_grad);
  T* edge_grad = static_cast<T*>(a.edge_grad);
  const uint64_t key = unpack_dropout_key(in.dropout.rng);  // the pair the forward recorded

  for_each_unit(a.dst, a.dst_chunks, num_dst, heads, in.num_edges, thread / group, threads / group,
                [&](const WorkUnit& w) {
    const int64_t n = w.row, h = w.head, unit = n * heads + h;
    GatDstSide<T, VEC, NV, kV2, kEdge, B> side;
    side.begin(in, t, vecs, n, h);
    LaneRow<T, VEC, NV> dout;
    load_widened(dout, row_head<T>(a.grad_out, n, h), t, vecs);
    A delta;
    {
      LaneRow<T, VEC, NV> out;
      load_widened(out, row_head<T>(a.out, n, h), t, vecs);
      delta = t.sum(lane_dot(dout, out));
    }
    if (w.lead && t.lane == 0) delta_out[unit] = delta;
    const A lse = lse_in[unit];
    LaneRow<T, VEC, NV> dxd, datt;  // GATv2
    A da_dst = 0;                    // GAT: the same on every lane
    if constexpr (kV2) {
      dxd.zero();
      datt.zero();
    }
    RawRow<T, VEC, NV> xr[B];
    walk_edges<B>(
        a.dst, in.num_edges, num_src, t, n, w.begin, w.end,
        [&](const GroupedEdge (&e)[B]) {
#pragma unroll
          for (int j = 0; j < B; ++j) xr[j].load(e[j].other >= 0 ? row_head<T>(in.x, e[j].other, h) : nullptr, t, vecs);
          side.load(in, t, vecs, e, h);
        },
        [&](const GroupedEdge (&e)[B], int64_t i) {
#pragma unroll
          for (int j = 0; j < B; ++j) {
            if (i + j >= w.end) break;
            T* eg = edge_grad != nullptr && e[j].edge >= 0 ? edge_grad + (e[j].edge * heads + h) * edge_width
                                                           : nullptr;
            const A s = e[j].other >= 0 ? side.score(j, xr[j], slope, t, vecs) : A(0);
            const A alpha = accurate_exp(s - lse);
            if (e[j].other < 0 || alpha == A(0)) {
              if (eg != nullptr) {
                if constexpr (kV2) {
                  store_zero_row<T, VEC, NV>(eg, t, vecs);
                } else if (t.lane == 0) {
                  *eg = from_accum<T>(A(0));
                }
              }
              continue;
            }
            const A dp = t.sum(lane_dot(dout, xr[j], xr[j], false, t, vecs));
            const A w8 = keep_weight<A>(in.dropout, key, e[j].edge, h, heads);
            const A ds = alpha * (dp * w8 - delta);
            if constexpr (kV2) {
              gatv2_edge_grads(dxd, datt, ds, side.att, xr[j], side.xd, side.er[j], kEdge, slope, eg, t, vecs);
            } else {
              const A dz = ds * leaky_relu_grad(side.logit(j), slope);
              da_dst += dz;
              if (eg != nullptr && t.lane == 0) *eg = from_accum<T>(dz);
            }
          }
        });
    if constexpr (kV2) {
      if (w.slot >= 0) {
        const int64_t part = int64_t{w.slot} * heads + h;
        store_partial(static_cast<A*>(a.part_dst_grad) + part * in.dim, t, vecs, dxd);
        store_partial(static_cast<A*>(a.part_datt) + part * in.dim, t, vecs, datt);
      } else {
        store_row(dst_grad + unit * in.dim, t, vecs, A(1), dxd);
        store_partial(static_cast<A*>(a.datt_rows) + unit * in.dim, t, vecs, datt);
      }
    } else if (t.lane == 0) {
      if (w.slot >= 0) {
        static_cast<A*>(a.part_dst_grad)[int64_t{w.slot} * heads + h] = da_dst;
      } else {
        dst_grad[unit] = from_accum<T>(da_dst);
      }
    }
  });

  if (edge_grad == nullptr || a.dst.order == nullptr) return;  // edges given grouped all lie in some row
  // Edges whose destination is out of range (only without index checks) add nothing.
  const int64_t tail = clamp_position(a.dst.offsets[num_dst], in.num_edges);
  const int64_t row_elems = heads * edge_width;
  for (int64_t x = thread; x < (in.num_edges - tail) * row_elems; x += threads) {
    const int64_t i = tail + x / row_elems;
    const int64_t e = a.dst.order[i];
    if (in_range(e, in.num_edges)) edge_grad[e * row_elems + x % row_elems] = from_accum<T>(A(0));
  }
}

}  // namespace

void launch_gat_backward_dst(const GatBackwardArgs& a, ScalarKind scalar, cudaStream_t stream) {
  dispatch_scalar(scalar, [&](auto zero) {
    using T = decltype(zero);
    using A = accum_t<T>;
    const GatInputs& in = a.in;
    dispatch_gat<T>(in, gat_backward_vectorizable<T>(a), [&](auto v, auto nv, auto v2, auto edge, int group) {
      auto kernel = gat_backward_dst_kernel<T, decltype(v)::value, decltype(nv)::value, decltype(v2)::value,
                                            decltype(edge)::value>;
      const int64_t threads = (in.num_dst + a.dst_chunks.max_slots) * in.heads * group +
                              (a.edge_grad != nullptr ? in.num_edges : 0);
      if (threads == 0) return;
      kernel<<<grid_blocks(kernel, threads), kBlockThreads, 0, stream>>>(a, group);
    });
    if (a.dst_chunks.first_chunk != nullptr) {
      const int64_t width = in.v2 ? in.dim : 1;
      launch_merge_sum<T>(a.dst_chunks, in.heads, width, static_cast<const A*>(a.part_dst_grad),
                          static_cast<T*>(a.dst_grad), stream);
      if (in.v2) {
        launch_merge_sum<A>(a.dst_chunks, in.heads, in.dim, static_cast<const A*>(a.part_datt),
                            static_cast<A*>(a.datt_rows), stream);
      }
    }
  });
}

}  // namespace edgedot
