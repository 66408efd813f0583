// GAT's and GATv2's score policies of the attention engine (engine.cuh, scores.cuh): per edge e from
// source s to destination n and head h,
//   GatScore   (GAT):   leaky_relu((a_src[s] + a_dst[n]) + a_edge[e]), values x[s];
//   Gatv2Score (GATv2): sum over c of att[c] * leaky_relu((x[s] + x_dst[n]) + edge_feat[e])[c],
//                       values x[s].
#pragma once

#include "attention/scores.cuh"

namespace edgedot {

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

// ---- GAT and GATv2: what they share ------------------------------------------------------------
// Values x[s]; sizes from GatInputs; the source gradient dx += alpha' * grad_out (+ the score's).
struct GatFamily : RecordsPolicy {
  using Inputs = GatInputs;
  using ForwardArgs = GatForwardArgs;
  using BackwardArgs = GatBackwardArgs;

  __host__ __device__ static int64_t num_dst(const Inputs& in) { return in.num_dst; }
  __host__ __device__ static int64_t num_src(const Inputs& in) { return in.x.num_rows; }
  __host__ __device__ static int64_t dim_v(const Inputs& in) { return in.dim; }
  static int64_t team_dim(const Inputs& in) { return in.dim; }
  static bool edge_grads_wanted(const BackwardArgs& a) { return a.edge_grad != nullptr; }
  template <typename T, int NV, bool kEdge>
  static constexpr bool kForwardLight = false;
  template <typename T, int NV, bool kEdge>
  static constexpr bool kDstLight = false;
  template <typename T, int NV, bool kEdge>
  static constexpr bool kFourBlocks = false;
  static constexpr bool kTeamGrads = false;
  static constexpr bool kResidualGrad = false;  // its sides hold no residual (grad_pack 2)

  // Whether every row the passes read or write as rows can move as 16-byte vectors of T.
  template <typename T>
  static bool vectorizable(const ForwardArgs& a) {
    const Inputs& in = a.in;
    return attention_vectorizable<T>({{&in.x, in.dim}, {&in.x_dst, in.dim}, {&in.att, in.dim}, {&in.edge_feat, in.dim},
                                      {&a.residual, in.dim}},
                                     {a.out});
  }
  template <typename T>
  static bool vectorizable(const BackwardArgs& a) {
    const Inputs& in = a.in;
    // GAT's dst_grad and edge_grad are scalars, written one at a time.
    return attention_vectorizable<T>({{&in.x, in.dim}, {&in.x_dst, in.dim}, {&in.att, in.dim}, {&in.edge_feat, in.dim},
                                      {&a.grad_out, in.dim}, {&a.out, in.dim}, {&a.residual, in.dim}},
                                     {a.dx, in.v2 ? a.dst_grad : nullptr, a.datt_teams, in.v2 ? a.edge_grad : nullptr});
  }

  template <typename T>
  static void src_row_merges(const BackwardArgs& a, MergeList<T>& merges) {
    merges.add(a.src_chunks, a.in.dim, static_cast<const accum_t<T>*>(a.part_dx), static_cast<T*>(a.dx), a.grad_pack);
  }
};

// ---- GAT ----------------------------------------------------------------------------------------
struct GatScore : GatFamily {
  static bool has_edge(const Inputs& in) { return in.a_edge.data != nullptr; }
  // A score of per-node scalars: the same on every lane, no sum.
  static constexpr bool kTeamScore = false;

  // Per-edge extras are scalars: the register budget of a light score. With rows of one vector a
  // lane and no edge term, every pass (the src pass from records) fits 64 registers: four blocks
  // a SM (at most 8 bytes spilled, by the float forward; sm_90).
  template <bool kEdge>
  static constexpr bool kHeavy = false;
  template <typename T, int NV, bool kEdge>
  static constexpr bool kFourBlocks = NV == 1 && !kEdge;
  template <typename T, int NV, bool kEdge>
  static constexpr int kForwardBatch = kEdgeBatch<T, NV, false>;
  template <typename T, int NV, bool kEdge>
  static constexpr int kDstBatch = kEdgeBatch<T, NV, false>;
  // float32 with a_edge holds at most three (more would spill).
  template <typename T, int NV, bool kEdge>
  static constexpr int kSrcBatch =
      kEdge && std::is_same_v<T, float> ? std::min(3, kEdgeBatch<T, NV, false>) : kEdgeBatch<T, NV, false>;
  template <typename T, int NV>
  static constexpr int kRecordsBatch = kEdgeBatch<T, NV, false>;

  template <typename T, int VEC, int NV, bool kEdge, int B>
  struct Dst {
    using A = accum_t<T>;
    const int vecs;
    const A slope;
    A logit_dst, da_dst;  // da_dst: the same on every lane
    A logit_src[B], logit_edge[B];
    RawRow<T, VEC, NV> xr[B];

    __device__ __forceinline__ explicit Dst(const Inputs& in)
        : vecs(static_cast<int>(in.dim / VEC)), slope(static_cast<A>(in.negative_slope)) {}

    __device__ __forceinline__ void begin(const Inputs& in, const Team&, int64_t n, int64_t h) {
      logit_dst = load_scalar<T>(in.a_dst, n, h);
    }
    // The alpha pass needs no x rows: GAT's scores come from scalars.
    template <RowLoads kRows>
    __device__ __forceinline__ void load(const Inputs& in, const Team& t, const GroupedEdge (&e)[B], int64_t h) {
      if constexpr (kRows != RowLoads::kScores) {
#pragma unroll
        for (int j = 0; j < B; ++j) xr[j].load(e[j].other >= 0 ? row_head<T>(in.x, e[j].other, h) : nullptr, t, vecs);
      }
#pragma unroll
      for (int j = 0; j < B; ++j) {
        const bool ok = e[j].other >= 0;
        logit_src[j] = ok ? load_scalar<T>(in.a_src, e[j].other, h) : A(0);
        if constexpr (kEdge) logit_edge[j] = ok ? load_scalar<T>(in.a_edge, e[j].edge, h) : A(0);
      }
    }

    // z = (a_src + a_dst) + a_edge of edge j.
    __device__ __forceinline__ A logit(int j) const {
      A z = logit_src[j] + logit_dst;
      if constexpr (kEdge) z += logit_edge[j];
      return z;
    }
    __device__ __forceinline__ A score(int j, const Team&) const { return leaky_relu(logit(j), slope); }
    __device__ __forceinline__ void add_value(LaneRow<T, VEC, NV>& acc, A p, int j, const Team& t) const {
      add_scaled(acc, p, xr[j], xr[j], false, t, vecs);
    }
    __device__ __forceinline__ A value_dot(const LaneRow<T, VEC, NV>& dout, int j, const Team& t) const {
      return lane_dot(dout, xr[j], xr[j], false, t, vecs);
    }

    __device__ __forceinline__ void zero_grads() { da_dst = 0; }
    __device__ __forceinline__ static T* edge_grads(const BackwardArgs& a) {
      return kEdge ? static_cast<T*>(a.edge_grad) : nullptr;
    }
    __device__ __forceinline__ static int64_t edge_grad_width(const Inputs&) { return 1; }
    __device__ __forceinline__ void zero_edge_grad(T* row, const Team& t) const {
      if (t.lane == 0) *row = from_accum<T>(A(0));
    }
    // dz = ds * leaky_relu'(z) (rounded: the src pass reads it from the record or recomputes it):
    // da_dst += dz, da_edge = dz.
    __device__ __forceinline__ A dz(int j, A ds) const { return mul_rounded(ds, leaky_relu_grad(logit(j), slope)); }
    __device__ __forceinline__ void add_grads(int j, A ds, A, const LaneRow<T, VEC, NV>&, T* edge_row,
                                              const Team& t) {
      const A g = dz(j, ds);
      da_dst += g;
      if (edge_row != nullptr && t.lane == 0) *edge_row = from_accum<T>(g);
    }
    // The record's second value: dz, which is all of ds the src pass needs.
    __device__ __forceinline__ A recorded(int j, A ds) const { return dz(j, ds); }
    __device__ __forceinline__ void store_src_state(const BackwardArgs&, int64_t, int, const Team&) const {}
    __device__ __forceinline__ void store_grads(const BackwardArgs& a, const WorkUnit& w, int64_t unit,
                                                const Team& t) const {
      store_grad_scalar<T>(w, a.part_dst_grad, a.dst_grad, unit, a.in.heads, t, da_dst);
    }
  };

  // What both src passes hold and write: the source's dx and da_src, which they add to as
  // dx += alpha' * grad_out, da_src += dz.
  template <typename T, int VEC, int NV>
  struct SrcGrads {
    using A = accum_t<T>;
    const int vecs;
    const A slope;
    LaneRow<T, VEC, NV> dx;
    A da_src;  // the same on every lane

    __device__ __forceinline__ explicit SrcGrads(const Inputs& in)
        : vecs(static_cast<int>(in.dim / VEC)), slope(static_cast<A>(in.negative_slope)) {}

    __device__ __forceinline__ void zero_grads() {
      dx.zero();
      da_src = 0;
    }
    __device__ __forceinline__ void add_dx(A dz, A alpha_keep, const RawRow<T, VEC, NV>& gr, const Team& t) {
      da_src += dz;
      add_scaled(dx, alpha_keep, gr, gr, false, t, vecs);
    }
    __device__ __forceinline__ void store_grads(const BackwardArgs& a, const WorkUnit& w, int64_t unit,
                                                const Team& t) const {
      store_grad_row(w, a.part_dx, a.dx, unit, a.in.heads, a.in.dim, a.grad_pack, t, vecs, dx);
      store_grad_scalar<T>(w, a.part_da_src, a.da_src, unit, a.in.heads, t, da_src);
    }
  };

  // The src pass by recomputation, where the records did not fit in memory.
  template <typename T, int VEC, int NV, bool kEdge, int B>
  struct Src : SrcGrads<T, VEC, NV> {
    using A = accum_t<T>;
    using Base = SrcGrads<T, VEC, NV>;
    RawRow<T, VEC, NV> xs;
    A logit_src;
    A logit_dst[B], logit_edge[B];

    __device__ __forceinline__ explicit Src(const Inputs& in) : Base(in) {}

    __device__ __forceinline__ void begin(const Inputs& in, const Team& t, int64_t s, int64_t h) {
      xs.load(row_head<T>(in.x, s, h), t, this->vecs);
      logit_src = load_scalar<T>(in.a_src, s, h);
    }
    __device__ __forceinline__ void load(const Inputs& in, const Team&, const GroupedEdge (&e)[B], int64_t h) {
#pragma unroll
      for (int j = 0; j < B; ++j) {
        const bool ok = e[j].other >= 0;
        logit_dst[j] = ok ? load_scalar<T>(in.a_dst, e[j].other, h) : A(0);
        if constexpr (kEdge) logit_edge[j] = ok ? load_scalar<T>(in.a_edge, e[j].edge, h) : A(0);
      }
    }
    // The forward's (a_src + a_dst) + a_edge.
    __device__ __forceinline__ A logit(int j) const {
      A z = logit_src + logit_dst[j];
      if constexpr (kEdge) z += logit_edge[j];
      return z;
    }
    __device__ __forceinline__ A score(int j, const Team&) const { return leaky_relu(logit(j), this->slope); }
    __device__ __forceinline__ A value_dot(const RawRow<T, VEC, NV>& gr, int, const Team& t) const {
      return lane_dot(gr, xs, xs, false, t, this->vecs);
    }
    __device__ __forceinline__ void add_grads(int j, A ds, A alpha_keep, const RawRow<T, VEC, NV>& gr,
                                              const Team& t) {
      this->add_dx(mul_rounded(ds, leaky_relu_grad(logit(j), this->slope)), alpha_keep, gr, t);
    }
  };

  // The src pass from the dst pass's records (where memory allows: alpha and dz = ds *
  // leaky_relu'(z) in place of ds), with the grad_out rows: no a_dst, a_edge, lse or delta
  // gathered, no score, no <grad_out, x>.
  template <typename T, int VEC, int NV, bool kEdge, int B>
  struct SrcFromRecords : SrcGrads<T, VEC, NV> {
    using A = accum_t<T>;

    __device__ __forceinline__ explicit SrcFromRecords(const Inputs& in) : SrcGrads<T, VEC, NV>(in) {}

    __device__ __forceinline__ void begin(const Inputs&, const Team&, int64_t, int64_t) {}
    __device__ __forceinline__ void load(const BackwardArgs&, const Team&, const GroupedEdge (&)[B], int64_t) {}
    __device__ __forceinline__ void add_grads(int j, A dz, A alpha_keep, const RawRow<T, VEC, NV>& gr,
                                              const Team& t) {
      this->add_dx(dz, alpha_keep, gr, t);
    }
  };

  template <typename T>
  static void dst_merges(const BackwardArgs& a, MergeList<T>& merges) {
    merges.add(a.dst_chunks, 1, static_cast<const accum_t<T>*>(a.part_dst_grad), static_cast<T*>(a.dst_grad));
  }
  template <typename T>
  static void src_merges(const BackwardArgs& a, MergeList<T>& merges) {
    src_row_merges<T>(a, merges);
    merges.add(a.src_chunks, 1, static_cast<const accum_t<T>*>(a.part_da_src), static_cast<T*>(a.da_src));
  }
};

// ---- GATv2 --------------------------------------------------------------------------------------
// m = (x[s] + x_dst[n]) + edge_feat[e], element c of vector u.
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
  accum_t<T> acc = 0;
#pragma unroll
  for (int u = 0; u < NV; ++u) {
    if (!lane_has<NV>(t, vectors, u)) continue;
#pragma unroll
    for (int c = 0; c < VEC; ++c)
      acc = fma_accum(att.at(u, c), leaky_relu(gatv2_m<accum_t<T>>(xs, xd, ef, has_ef, u, c), slope), acc);
  }
  return acc;
}

// ds * leaky_relu'(m) of one element by the sign of m: ds, or ds_slope = ds * slope (computed once an
// edge). dm = att * it and datt's term it * m then take a select and two fused multiply-adds.
template <typename A>
__device__ __forceinline__ A gatv2_ds_of_sign(A ds, A ds_slope, bool positive) {
  return positive ? ds : ds_slope;
}

struct Gatv2Score : GatFamily {
  static bool has_edge(const Inputs& in) { return in.edge_feat.data != nullptr; }
  static constexpr bool kTeamScore = true;
  // datt, a sum over every edge, is summed per team (one row of datt_teams each), not per
  // destination: [teams, dim] instead of [num_dst, heads, dim] written and summed again.
  static constexpr bool kTeamGrads = true;

  // x_dst and att rows besides the output row: the register budget of per-edge rows.
  template <bool kEdge>
  static constexpr bool kHeavy = true;
  // The src pass would gather x_dst (and edge_feat) rows again for m; where memory allows, the dst
  // pass records alpha, ds and the signs of m instead (a bit per element, a byte per vector), and
  // the src pass (SrcFromRecords) gathers only grad_out rows and recomputes nothing. The signs take
  // a byte per (edge, head) and vector of vec elements.
  static int64_t src_state_width(const Inputs& in, int vec) { return in.dim / vec; }
  template <typename A>
  __device__ static uint8_t* signs(const BackwardArgs& a) {
    return reinterpret_cast<uint8_t*>(records<A>(a) + a.in.num_edges * a.in.heads);
  }
  // One vector a lane without edge features, 3 edges a batch fit the light budget (3 blocks a SM)
  // and beat 2 or 4 at 2 blocks a SM (H200). The forward on half types: 80 registers, products size
  // 5.57 -> 5.14 ms against 2 edges (float32 keeps 4 at 2 blocks). The dst pass on half types: 72
  // bytes spilled, products' backward 16.0 -> 14.9 ms against 4 edges (4 at 3 blocks, 112 bytes
  // spilled: 15.2); on float32: 76 registers, the f32 hub's backward 1.04x faster.
  template <typename T, int NV, bool kEdge>
  static constexpr bool kForwardLight = sizeof(T) == 2 && NV == 1 && !kEdge;
  template <typename T, int NV, bool kEdge>
  static constexpr int kForwardBatch = kForwardLight<T, NV, kEdge> ? 3 : kEdgeBatch<T, NV, true>;
  template <typename T, int NV, bool kEdge>
  static constexpr bool kDstLight = (sizeof(T) == 2 || std::is_same_v<T, float>) && NV == 1 && !kEdge;
  template <typename T, int NV, bool kEdge>
  static constexpr int kDstBatch = kDstLight<T, NV, kEdge> ? 3 : kEdgeBatch<T, NV, true, true>;
  template <typename T, int NV, bool kEdge>
  static constexpr int kSrcBatch = kEdgeBatch<T, NV, true, true>;
  template <typename T, int NV>
  static constexpr int kRecordsBatch = kEdgeBatch<T, NV, true, true>;

  template <typename T, int VEC, int NV, bool kEdge, int B>
  struct Dst {
    using A = accum_t<T>;
    const int vecs;
    const A slope;
    LaneRow<T, VEC, NV> xd, att, dxd, datt;
    RawRow<T, VEC, NV> xr[B], er[B];
    unsigned positive[NV];  // bit c of vector u: element c of the last edge's m > 0

    // datt: the team's sum over all its units.
    __device__ __forceinline__ explicit Dst(const Inputs& in)
        : vecs(static_cast<int>(in.dim / VEC)), slope(static_cast<A>(in.negative_slope)) {
      datt.zero();
    }

    __device__ __forceinline__ void begin(const Inputs& in, const Team& t, int64_t n, int64_t h) {
      load_widened(xd, row_head<T>(in.x_dst, n, h), t, vecs);
      load_widened(att, row_head<T>(in.att, 0, h), t, vecs);
    }
    // The source rows are in the score: loaded in every pass, before the edges' rows.
    template <RowLoads>
    __device__ __forceinline__ void load(const Inputs& in, const Team& t, const GroupedEdge (&e)[B], int64_t h) {
#pragma unroll
      for (int j = 0; j < B; ++j) xr[j].load(e[j].other >= 0 ? row_head<T>(in.x, e[j].other, h) : nullptr, t, vecs);
      if constexpr (kEdge) {
#pragma unroll
        for (int j = 0; j < B; ++j) {
          er[j].load(e[j].other >= 0 ? row_head<T>(in.edge_feat, e[j].edge, h) : nullptr, t, vecs);
        }
      }
    }
    __device__ __forceinline__ A lane_score(int j, const Team& t) const {
      return gatv2_lane_score(att, xr[j], xd, er[j], kEdge, slope, t, vecs);
    }
    __device__ __forceinline__ A score_of(A sum) const { return sum; }
    __device__ __forceinline__ void add_value(LaneRow<T, VEC, NV>& acc, A p, int j, const Team& t) const {
      add_scaled(acc, p, xr[j], xr[j], false, t, vecs);
    }
    __device__ __forceinline__ A value_dot(const LaneRow<T, VEC, NV>& dout, int j, const Team& t) const {
      return lane_dot(dout, xr[j], xr[j], false, t, vecs);
    }

    __device__ __forceinline__ void zero_grads() { dxd.zero(); }
    __device__ __forceinline__ static T* edge_grads(const BackwardArgs& a) {
      return kEdge ? static_cast<T*>(a.edge_grad) : nullptr;
    }
    __device__ __forceinline__ static int64_t edge_grad_width(const Inputs& in) { return in.dim; }
    __device__ __forceinline__ void zero_edge_grad(T* row, const Team& t) const {
      store_zero_row<T, VEC, NV>(row, t, vecs);
    }
    // dm = ds * att * leaky_relu'(m): dx_dst += dm, d_edge_feat = dm; datt += ds * leaky_relu(m).
    // Keeps the signs of m for store_src_state.
    __device__ __forceinline__ void add_grads(int j, A ds, A, const LaneRow<T, VEC, NV>&, T* edge_row,
                                              const Team& t) {
      const A ds_slope = ds * slope;
#pragma unroll
      for (int u = 0; u < NV; ++u) {
        if (!lane_has<NV>(t, vecs, u)) continue;
        Vec<T, VEC> dm_out;
        unsigned bits = 0;
#pragma unroll
        for (int c = 0; c < VEC; ++c) {
          const A m = gatv2_m<A>(xr[j], xd, er[j], kEdge, u, c);
          const A g = gatv2_ds_of_sign(ds, ds_slope, m > A(0));
          dxd.x[u][c] = fma_accum(att.at(u, c), g, dxd.x[u][c]);
          datt.x[u][c] = fma_accum(g, m, datt.x[u][c]);
          bits |= m > A(0) ? 1u << c : 0u;
          if constexpr (kEdge) dm_out.v[c] = from_accum<T>(att.at(u, c) * g);
        }
        positive[u] = bits;
        if constexpr (kEdge) {
          if (edge_row != nullptr) *reinterpret_cast<Vec<T, VEC>*>(edge_row + (t.lane + u * t.group) * VEC) = dm_out;
        }
      }
    }
    __device__ __forceinline__ A recorded(int, A ds) const { return ds; }
    // The signs of the last edge add_grads took, a byte per vector (bit c: element c of m > 0), for
    // the src pass.
    __device__ __forceinline__ void store_src_state(const BackwardArgs& a, int64_t edge_head, int,
                                                    const Team& t) const {
      uint8_t* row = signs<A>(a) + edge_head * vecs;
#pragma unroll
      for (int u = 0; u < NV; ++u) {
        if (lane_has<NV>(t, vecs, u)) row[t.lane + u * t.group] = static_cast<uint8_t>(positive[u]);
      }
    }
    __device__ __forceinline__ void store_grads(const BackwardArgs& a, const WorkUnit& w, int64_t unit,
                                                const Team& t) const {
      store_grad_row(w, a.part_dst_grad, a.dst_grad, unit, a.in.heads, a.in.dim, a.grad_pack, t, vecs, dxd);
    }
    // The team's share of datt (accumulation type), summed over teams afterwards.
    __device__ __forceinline__ void store_team_grads(const BackwardArgs& a, int64_t team, const Team& t) const {
      store_partial(static_cast<A*>(a.datt_teams) + team * a.in.dim, t, vecs, datt);
    }
  };

  // What both src passes hold and write: att and the source's dx, which they add to as
  // dx += alpha' * grad_out + ds * att * leaky_relu'(m), with whether m > 0 for element (u, c)
  // from positive(u, c).
  template <typename T, int VEC, int NV>
  struct SrcGrads {
    using A = accum_t<T>;
    const int vecs;
    const A slope;
    LaneRow<T, VEC, NV> att, dx;

    __device__ __forceinline__ explicit SrcGrads(const Inputs& in)
        : vecs(static_cast<int>(in.dim / VEC)), slope(static_cast<A>(in.negative_slope)) {}

    __device__ __forceinline__ void begin(const Inputs& in, const Team& t, int64_t, int64_t h) {
      load_widened(att, row_head<T>(in.att, 0, h), t, vecs);
    }
    __device__ __forceinline__ void zero_grads() { dx.zero(); }
    template <typename Positive>
    __device__ __forceinline__ void add_dx(A ds, A alpha_keep, const RawRow<T, VEC, NV>& gr, const Team& t,
                                           Positive&& positive) {
      const A ds_slope = ds * slope;
#pragma unroll
      for (int u = 0; u < NV; ++u) {
        if (!lane_has<NV>(t, vecs, u)) continue;
#pragma unroll
        for (int c = 0; c < VEC; ++c) {
          const A d = fma_accum(alpha_keep, gr.at(u, c), dx.x[u][c]);
          dx.x[u][c] = fma_accum(att.at(u, c), gatv2_ds_of_sign(ds, ds_slope, positive(u, c)), d);
        }
      }
    }
    __device__ __forceinline__ void store_grads(const BackwardArgs& a, const WorkUnit& w, int64_t unit,
                                                const Team& t) const {
      store_grad_row(w, a.part_dx, a.dx, unit, a.in.heads, a.in.dim, a.grad_pack, t, vecs, dx);
    }
  };

  // The src pass by recomputation, where the records did not fit in memory: each edge's x_dst (and
  // edge_feat) row gathered again for its score and m.
  template <typename T, int VEC, int NV, bool kEdge, int B>
  struct Src : SrcGrads<T, VEC, NV> {
    using A = accum_t<T>;
    using Base = SrcGrads<T, VEC, NV>;
    RawRow<T, VEC, NV> xs;
    RawRow<T, VEC, NV> xdr[B], er[B];

    __device__ __forceinline__ explicit Src(const Inputs& in) : Base(in) {}

    __device__ __forceinline__ void begin(const Inputs& in, const Team& t, int64_t s, int64_t h) {
      xs.load(row_head<T>(in.x, s, h), t, this->vecs);
      Base::begin(in, t, s, h);
    }
    __device__ __forceinline__ void load(const Inputs& in, const Team& t, const GroupedEdge (&e)[B], int64_t h) {
#pragma unroll
      for (int j = 0; j < B; ++j) {
        const bool ok = e[j].other >= 0;
        xdr[j].load(ok ? row_head<T>(in.x_dst, e[j].other, h) : nullptr, t, this->vecs);
        if constexpr (kEdge) er[j].load(ok ? row_head<T>(in.edge_feat, e[j].edge, h) : nullptr, t, this->vecs);
      }
    }
    __device__ __forceinline__ A lane_score(int j, const Team& t) const {
      return gatv2_lane_score(this->att, xs, xdr[j], er[j], kEdge, this->slope, t, this->vecs);
    }
    __device__ __forceinline__ A score_of(A sum) const { return sum; }
    __device__ __forceinline__ A value_dot(const RawRow<T, VEC, NV>& gr, int, const Team& t) const {
      return lane_dot(gr, xs, xs, false, t, this->vecs);
    }
    __device__ __forceinline__ void add_grads(int j, A ds, A alpha_keep, const RawRow<T, VEC, NV>& gr,
                                              const Team& t) {
      this->add_dx(ds, alpha_keep, gr, t,
                   [&](int u, int c) { return gatv2_m<A>(xs, xdr[j], er[j], kEdge, u, c) > A(0); });
    }
  };

  // The src pass from the dst pass's records: leaky_relu'(m) from the recorded signs.
  template <typename T, int VEC, int NV, bool kEdge, int B>
  struct SrcFromRecords : SrcGrads<T, VEC, NV> {
    using A = accum_t<T>;
    using Base = SrcGrads<T, VEC, NV>;
    uint8_t positive[B][NV];

    __device__ __forceinline__ explicit SrcFromRecords(const Inputs& in) : Base(in) {}

    __device__ __forceinline__ void load(const BackwardArgs& a, const Team& t, const GroupedEdge (&e)[B], int64_t h) {
      const uint8_t* all = signs<A>(a);
#pragma unroll
      for (int j = 0; j < B; ++j) {
        const uint8_t* row = all + (int64_t{e[j].edge} * a.in.heads + h) * this->vecs;
#pragma unroll
        for (int u = 0; u < NV; ++u) {
          const int v = t.lane + u * t.group;
          positive[j][u] = e[j].other >= 0 && v < this->vecs ? __ldg(row + v) : 0;
        }
      }
    }
    __device__ __forceinline__ void add_grads(int j, A ds, A alpha_keep, const RawRow<T, VEC, NV>& gr,
                                              const Team& t) {
      this->add_dx(ds, alpha_keep, gr, t, [&](int u, int c) { return ((positive[j][u] >> c) & 1u) != 0; });
    }
  };

  template <typename T>
  static void dst_merges(const BackwardArgs& a, MergeList<T>& merges) {
    merges.add(a.dst_chunks, a.in.dim, static_cast<const accum_t<T>*>(a.part_dst_grad), static_cast<T*>(a.dst_grad),
               a.grad_pack);
  }
  template <typename T>
  static void src_merges(const BackwardArgs& a, MergeList<T>& merges) {
    src_row_merges<T>(a, merges);
  }
};

}  // namespace edgedot
