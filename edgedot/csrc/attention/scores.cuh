// Shared by the GAT and GATv2 kernels (csrc/gat_forward.cu, csrc/gat_backward_dst.cu,
// csrc/gat_backward_src.cu): their scores, built on the graph attention machinery of attention.cuh.
// Every pass computes a score with the same operations in the same order (and the same team shape),
// so the backward's alpha = exp(score - lse) matches the forward's softmax.
#pragma once

#include "attention/engine.cuh"

namespace edgedot {

// Blocks per SM and edges in flight per team. GAT's per-edge extras are scalars, so it takes the
// budget of graph attention without edge_feat rows; GATv2 holds x_dst and att rows besides the
// output row, which is the budget of graph attention with edge_feat rows.
template <typename T, int NV, bool kV2>
constexpr int kGatBlocksPerSM = kAttentionBlocksPerSM<T, NV, kV2>;
template <typename T, int NV, bool kV2>
constexpr int kGatBatch = kAttentionBatch<T, NV, kV2>;

// leaky_relu(z) = z for z > 0, else slope * z; its derivative taken as slope at 0. The product is
// rounded on its own (scaled_score), never fused into a later subtraction of lse or the maximum.
template <typename A>
__device__ __forceinline__ A leaky_relu(A z, A slope) {
  return z > A(0) ? z : scaled_score(z, slope);
}

template <typename A>
__device__ __forceinline__ A leaky_relu_grad(A z, A slope) {
  return z > A(0) ? A(1) : slope;
}

// Element (n, h) of a per-node scalar table (Rows of dim 1), widened.
template <typename T>
__device__ __forceinline__ accum_t<T> load_scalar(const Rows& r, int64_t n, int64_t h) {
  return to_accum(__ldg(row_head<T>(r, n, h)));
}

// GATv2's m = (x_src + x_dst) + edge_feat, element c of vector u.
template <typename A, typename XS, typename XD, typename EF>
__device__ __forceinline__ A gatv2_m(const XS& xs, const XD& xd, const EF& ef, bool has_ef, int u, int c) {
  A m = xs.at(u, c) + xd.at(u, c);
  if (has_ef) m += ef.at(u, c);
  return m;
}

// This lane's part of GATv2's score: sum of att * leaky_relu(m) over its vectors.
template <typename T, int VEC, int NV, typename XS, typename XD>
__device__ __forceinline__ accum_t<T> gatv2_lane_score(const LaneRow<T, VEC, NV>& att, const XS& xs, const XD& xd,
                                                       const RawRow<T, VEC, NV>& ef, bool has_ef,
                                                       accum_t<T> slope, const Team& t, int vectors) {
  using A = accum_t<T>;
  A acc = 0;
#pragma unroll
  for (int u = 0; u < NV; ++u) {
    if (!lane_has<NV>(t, vectors, u)) continue;
#pragma unroll
    for (int c = 0; c < VEC; ++c)
      acc = fma_accum(att.at(u, c), leaky_relu(gatv2_m<A>(xs, xd, ef, has_ef, u, c), slope), acc);
  }
  return acc;
}

// GATv2's dm = dscore * att * leaky_relu'(m) for one element.
template <typename A>
__device__ __forceinline__ A gatv2_dm(A ds, A att, A m, A slope) {
  return ds * (att * leaky_relu_grad(m, slope));
}

// The destination side of a unit (n, h), as the forward and the backward's dst pass see it: what
// the score needs from n (GAT: a_dst; GATv2: x_dst and att rows) and from a batch of B edges
// (GAT: a_src and a_edge; GATv2: edge_feat rows); the source rows x come from the caller.
// kEdge: a_edge (GAT) or edge_feat (GATv2) is present. Members a model does not use are never
// touched and take no registers.
template <typename T, int VEC, int NV, bool kV2, bool kEdge, int B>
struct GatDstSide {
  using A = accum_t<T>;
  A ad;
  A as[B], ae[B];
  LaneRow<T, VEC, NV> xd, att;
  RawRow<T, VEC, NV> er[B];

  __device__ __forceinline__ void begin(const GatInputs& in, const Team& t, int vectors, int64_t n, int64_t h) {
    if constexpr (kV2) {
      load_widened(xd, row_head<T>(in.x_dst, n, h), t, vectors);
      load_widened(att, row_head<T>(in.att, 0, h), t, vectors);
    } else {
      ad = load_scalar<T>(in.a_dst, n, h);
    }
  }

  // The batch's per-edge inputs; edges whose rows do not exist (other < 0) get zeros.
  __device__ __forceinline__ void load(const GatInputs& in, const Team& t, int vectors, const GroupedEdge (&e)[B],
                                       int64_t h) {
#pragma unroll
    for (int j = 0; j < B; ++j) {
      const bool ok = e[j].other >= 0;
      if constexpr (kV2) {
        if constexpr (kEdge) er[j].load(ok ? row_head<T>(in.edge_feat, e[j].edge, h) : nullptr, t, vectors);
      } else {
        as[j] = ok ? load_scalar<T>(in.a_src, e[j].other, h) : A(0);
        if constexpr (kEdge) ae[j] = ok ? load_scalar<T>(in.a_edge, e[j].edge, h) : A(0);
      }
    }
  }

  // GAT's z = (a_src + a_dst) + a_edge of edge j.
  __device__ __forceinline__ A logit(int j) const {
    A z = as[j] + ad;
    if constexpr (kEdge) z += ae[j];
    return z;
  }

  // Edge j's score, x its source row (read by GATv2 only); the same bits on every lane of the team.
  __device__ __forceinline__ A score(int j, const RawRow<T, VEC, NV>& x, A slope, const Team& t, int vectors) const {
    if constexpr (kV2) {
      return t.sum(gatv2_lane_score(att, x, xd, er[j], kEdge, slope, t, vectors));
    } else {
      return leaky_relu(logit(j), slope);
    }
  }
};

// Whether every row the kernels read or write as rows can move as 16-byte vectors of T.
template <typename T>
inline bool gat_vectorizable(const GatInputs& in, std::initializer_list<std::pair<const Rows*, int64_t>> more,
                             std::initializer_list<const void*> outputs) {
  if (!attention_vectorizable<T>({{&in.x, in.dim}, {&in.x_dst, in.dim}, {&in.att, in.dim}, {&in.edge_feat, in.dim}},
                                 outputs)) {
    return false;
  }
  for (const auto& [r, dim] : more)
    if (r->data != nullptr && !rows_vectorizable<T>(*r, dim)) return false;
  return true;
}

// The same for both passes of the backward, so that they take one team shape.
template <typename T>
inline bool gat_backward_vectorizable(const GatBackwardArgs& a) {
  const GatInputs& in = a.in;
  // GAT's dst_grad and edge_grad are scalars, written one at a time.
  return gat_vectorizable<T>(in, {{&a.grad_out, in.dim}, {&a.out, in.dim}},
                             {a.dx, in.v2 ? a.dst_grad : nullptr, a.datt_rows, in.v2 ? a.edge_grad : nullptr});
}

// Calls f(integral_constant VEC, integral_constant NV, bool_constant kV2, bool_constant kEdge, group)
// for the inputs' model and team shape; every pass of one call's rows takes the same shape when
// `vectorized` agrees.
template <typename T, typename F>
inline void dispatch_gat(const GatInputs& in, bool vectorized, F&& f) {
  const int vec = vectorized ? wide_vec<T>() : 1;
  const TeamShape shape = attention_team(in.dim / vec);
  const bool has_edge = in.v2 ? in.edge_feat.data != nullptr : in.a_edge.data != nullptr;
  dispatch_attention<T>(vectorized, shape.per_lane, has_edge, [&](auto v, auto nv, auto edge) {
    if (in.v2) {
      f(v, nv, std::true_type{}, edge, shape.group);
    } else {
      f(v, nv, std::false_type{}, edge, shape.group);
    }
  });
}

}  // namespace edgedot
