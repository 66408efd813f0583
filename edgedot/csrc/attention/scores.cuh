// The dot-product score policies of the attention engine (engine.cuh says what a policy gives the
// passes): per edge e from source s to destination n and head h,
//   DotScore    (graph attention): scale * <q[n], k[s] + edge_feat[e]>, values v[s] + edge_feat[e];
//   CosineScore (AGNN): beta[h] * <q[n], k[s]> with q = k = x / |x| (the caller normalises), values
//               x[s], beta a learned temperature.
// GAT's and GATv2's are in gat_scores.cuh. A policy holds what its score reads and what its
// gradients accumulate; the walk, the softmax, dropout, chunks and merges are the engine's.
#pragma once

#include "attention/engine.cuh"

namespace edgedot {

// Stores a chunk's partial row (slot >= 0) or the row's final value (unit = row * heads + head);
// the output's rows of heads x dim lie pack such rows apart (grad_pack of the backward's arguments;
// the branch keeps the contiguous case's code and registers).
template <typename T, int VEC, int NV>
__device__ __forceinline__ void store_grad_row(const WorkUnit& w, void* part, void* out, int64_t unit, int64_t heads,
                                               int64_t dim, int pack, const Team& t, int vectors,
                                               const LaneRow<T, VEC, NV>& g) {
  if (w.slot >= 0) {
    store_partial(static_cast<accum_t<T>*>(part) + (int64_t{w.slot} * heads + w.head) * dim, t, vectors, g);
  } else {
    T* row = static_cast<T*>(out) + unit * dim;
    if (pack != 1) row += int64_t{w.row} * (pack - 1) * heads * dim;
    store_row(row, t, vectors, accum_t<T>(1), g);
  }
}

// Stores a scalar gradient (the same on every lane) the same way.
template <typename T>
__device__ __forceinline__ void store_grad_scalar(const WorkUnit& w, void* part, void* out, int64_t unit,
                                                  int64_t heads, const Team& t, accum_t<T> g) {
  if (t.lane != 0) return;
  if (w.slot >= 0) {
    static_cast<accum_t<T>*>(part)[int64_t{w.slot} * heads + w.head] = g;
  } else {
    static_cast<T*>(out)[unit] = from_accum<T>(g);
  }
}

// ---- graph attention ----------------------------------------------------------------------------
struct DotScore : RecordsPolicy {
  using Inputs = AttentionInputs;
  using ForwardArgs = AttentionForwardArgs;
  using BackwardArgs = AttentionBackwardArgs;

  __host__ __device__ static int64_t num_dst(const Inputs& in) { return in.q.num_rows; }
  __host__ __device__ static int64_t num_src(const Inputs& in) { return in.k.num_rows; }
  __host__ __device__ static int64_t dim_v(const Inputs& in) { return in.dim_v; }
  static int64_t team_dim(const Inputs& in) { return in.dim > in.dim_v ? in.dim : in.dim_v; }
  static bool has_edge(const Inputs& in) { return in.edge_feat.data != nullptr; }
  static bool edge_grads_wanted(const BackwardArgs& a) { return a.d_edge_feat != nullptr; }

  static constexpr bool kTeamScore = true;
  static constexpr bool kResidualGrad = true;
  template <bool kEdge>
  static constexpr bool kHeavy = kEdge;
  template <typename T, int NV, bool kEdge>
  static constexpr bool kForwardLight = false;
  template <typename T, int NV, bool kEdge>
  static constexpr bool kDstLight = false;
  // At 64 registers its passes spill (float 72-198 bytes, half types' 16-byte rows 120-268; sm_90).
  template <typename T, int NV, bool kEdge>
  static constexpr bool kFourBlocks = false;
  static constexpr bool kTeamGrads = false;
  template <typename T, int NV, bool kEdge>
  static constexpr int kForwardBatch = kEdgeBatch<T, NV, kEdge>;
  // A backward pass's batch of rows: one edge for float32 rows of two vectors a lane (more spill).
  template <typename T, int NV, bool kEdge>
  static constexpr int kRowsBatch = std::is_same_v<T, float> && NV == 2 ? 1 : kEdgeBatch<T, NV, kEdge, true>;
  // The dst pass also holds the record's store: float32 at one vector a lane without edge_feat
  // takes 3 edges (4 spilled 120 bytes; 3 spill 40 and ran arxiv's backward 1.03x faster).
  template <typename T, int NV, bool kEdge>
  static constexpr int kDstBatch = std::is_same_v<T, float> && NV == 1 && !kEdge ? 3 : kRowsBatch<T, NV, kEdge>;
  // The src pass holds lse and delta besides the rows: one edge fewer without edge_feat.
  template <typename T, int NV, bool kEdge>
  static constexpr int kSrcBatch = kEdge ? kRowsBatch<T, NV, true> : std::max(1, kRowsBatch<T, NV, false> - 1);
  // From records the src pass holds q and grad_out rows alone: a light score's batch for half types
  // (three, not two), float32's as before (one more spills).
  template <typename T, int NV>
  static constexpr int kRecordsBatch =
      std::is_same_v<T, float> ? kSrcBatch<T, NV, false> : kEdgeBatch<T, NV, false, true>;

  template <typename T>
  static bool vectorizable(const ForwardArgs& a) {
    const Inputs& in = a.in;
    return attention_vectorizable<T>({{&in.q, in.dim}, {&in.k, in.dim}, {&in.v, in.dim_v}, {&in.edge_feat, in.dim},
                                      {&a.residual, in.dim_v}},
                                     {a.out});
  }
  template <typename T>
  static bool vectorizable(const BackwardArgs& a) {
    const Inputs& in = a.in;
    return attention_vectorizable<T>({{&in.q, in.dim}, {&in.k, in.dim}, {&in.v, in.dim_v}, {&in.edge_feat, in.dim},
                                      {&a.grad_out, in.dim_v}, {&a.out, in.dim_v}, {&a.residual, in.dim_v}},
                                     {a.dq, a.dk, a.dv, a.d_edge_feat, a.residual_grad});
  }

  template <typename T, int VEC, int NV, bool kEdge, int B>
  struct Dst {
    using A = accum_t<T>;
    const int dvec, vvec;
    A scale;
    LaneRow<T, VEC, NV> q, dq;
    RawRow<T, VEC, NV> kr[B], vr[B], er[B];

    __device__ __forceinline__ explicit Dst(const Inputs& in)
        : dvec(static_cast<int>(in.dim / VEC)),
          vvec(static_cast<int>(in.dim_v / VEC)),
          scale(static_cast<A>(in.scale)) {}

    __device__ __forceinline__ void begin(const Inputs& in, const Team& t, int64_t n, int64_t h) {
      load_widened(q, row_head<T>(in.q, n, h), t, dvec);
    }

    template <RowLoads kRows>
    __device__ __forceinline__ void load(const Inputs& in, const Team& t, const GroupedEdge (&e)[B], int64_t h) {
#pragma unroll
      for (int j = 0; j < B; ++j) {
        const bool ok = e[j].other >= 0;
        kr[j].load(ok ? row_head<T>(in.k, e[j].other, h) : nullptr, t, dvec);
        if constexpr (kRows == RowLoads::kEdgeByEdge) {
          vr[j].load(ok ? row_head<T>(in.v, e[j].other, h) : nullptr, t, vvec);
        }
        if constexpr (kEdge) er[j].load(ok ? row_head<T>(in.edge_feat, e[j].edge, h) : nullptr, t, dvec);
      }
      if constexpr (kRows == RowLoads::kScoresThenValues) {
#pragma unroll
        for (int j = 0; j < B; ++j) vr[j].load(e[j].other >= 0 ? row_head<T>(in.v, e[j].other, h) : nullptr, t, vvec);
      }
    }

    __device__ __forceinline__ A lane_score(int j, const Team& t) const {
      return lane_dot(q, kr[j], er[j], kEdge, t, dvec);
    }
    __device__ __forceinline__ A score_of(A sum) const { return scaled_score(sum, scale); }
    __device__ __forceinline__ void add_value(LaneRow<T, VEC, NV>& acc, A p, int j, const Team& t) const {
      add_scaled(acc, p, vr[j], er[j], kEdge, t, vvec);
    }
    __device__ __forceinline__ A value_dot(const LaneRow<T, VEC, NV>& dout, int j, const Team& t) const {
      return lane_dot(dout, vr[j], er[j], kEdge, t, vvec);
    }

    __device__ __forceinline__ void zero_grads() { dq.zero(); }
    __device__ __forceinline__ static T* edge_grads(const BackwardArgs& a) {
      return kEdge ? static_cast<T*>(a.d_edge_feat) : nullptr;
    }
    __device__ __forceinline__ static int64_t edge_grad_width(const Inputs& in) { return in.dim; }
    __device__ __forceinline__ void zero_edge_grad(T* row, const Team& t) const {
      store_zero_row<T, VEC, NV>(row, t, dvec);
    }
    // dq += scale * ds * (k + edge_feat); d_edge_feat = scale * ds * q + alpha' * grad_out.
    __device__ __forceinline__ void add_grads(int j, A ds, A alpha_keep, const LaneRow<T, VEC, NV>& dout, T* edge_row,
                                              const Team& t) {
      add_scaled(dq, scale * ds, kr[j], er[j], kEdge, t, dvec);
      if (edge_row != nullptr) store_combination(edge_row, t, dvec, scale * ds, q, alpha_keep, dout, true);
    }
    __device__ __forceinline__ A recorded(int, A ds) const { return ds; }
    __device__ __forceinline__ void store_src_state(const BackwardArgs&, int64_t, int, const Team&) const {}
    __device__ __forceinline__ void store_grads(const BackwardArgs& a, const WorkUnit& w, int64_t unit,
                                                const Team& t) const {
      store_grad_row(w, a.part_dq, a.dq, unit, a.in.heads, a.in.dim, a.grad_pack, t, dvec, dq);
    }
  };

  // What both src passes hold and write: each edge's q row and the source's dk and dv, which they
  // add to as dk += scale * ds * q, dv += alpha' * grad_out.
  template <typename T, int VEC, int NV, int B>
  struct KvGrads {
    using Element = T;
    using A = accum_t<T>;
    const int dvec, vvec;
    A scale;
    LaneRow<T, VEC, NV> dk, dv;
    RawRow<T, VEC, NV> qr[B];

    __device__ __forceinline__ explicit KvGrads(const Inputs& in)
        : dvec(static_cast<int>(in.dim / VEC)),
          vvec(static_cast<int>(in.dim_v / VEC)),
          scale(static_cast<A>(in.scale)) {}

    __device__ __forceinline__ void load_q(const Inputs& in, const Team& t, const GroupedEdge (&e)[B], int64_t h) {
#pragma unroll
      for (int j = 0; j < B; ++j) qr[j].load(e[j].other >= 0 ? row_head<T>(in.q, e[j].other, h) : nullptr, t, dvec);
    }
    __device__ __forceinline__ void zero_grads() {
      dk.zero();
      dv.zero();
    }
    __device__ __forceinline__ void add_grads(int j, A ds, A alpha_keep, const RawRow<T, VEC, NV>& gr, const Team&) {
      const A g = scale * ds;
#pragma unroll
      for (int u = 0; u < NV; ++u)
#pragma unroll
        for (int c = 0; c < VEC; ++c) {
          dk.x[u][c] = fma_accum(g, qr[j].at(u, c), dk.x[u][c]);
          dv.x[u][c] = fma_accum(alpha_keep, gr.at(u, c), dv.x[u][c]);
        }
    }
    __device__ __forceinline__ void store_grads(const BackwardArgs& a, const WorkUnit& w, int64_t unit,
                                                const Team& t) const {
      store_grad_row(w, a.part_dk, a.dk, unit, a.in.heads, a.in.dim, a.grad_pack, t, dvec, dk);
      store_grad_row(w, a.part_dv, a.dv, unit, a.in.heads, a.in.dim_v, a.grad_pack, t, vvec, dv);
    }
  };

  // The src pass by recomputation, where the records did not fit in memory: each edge's score and
  // <grad_out, v + edge_feat> again, from the source's k and v rows.
  template <typename T, int VEC, int NV, bool kEdge, int B>
  struct Src : KvGrads<T, VEC, NV, B> {
    using A = accum_t<T>;
    using Base = KvGrads<T, VEC, NV, B>;
    RawRow<T, VEC, NV> k, v;
    RawRow<T, VEC, NV> er[B];

    __device__ __forceinline__ explicit Src(const Inputs& in) : Base(in) {}

    __device__ __forceinline__ void begin(const Inputs& in, const Team& t, int64_t s, int64_t h) {
      k.load(row_head<T>(in.k, s, h), t, this->dvec);
      v.load(row_head<T>(in.v, s, h), t, this->vvec);
    }
    __device__ __forceinline__ void load(const Inputs& in, const Team& t, const GroupedEdge (&e)[B], int64_t h) {
      this->load_q(in, t, e, h);
      if constexpr (kEdge) {
#pragma unroll
        for (int j = 0; j < B; ++j) {
          er[j].load(e[j].other >= 0 ? row_head<T>(in.edge_feat, e[j].edge, h) : nullptr, t, this->dvec);
        }
      }
    }
    // The forward's score: q widened, k + edge_feat widened element by element.
    __device__ __forceinline__ A lane_score(int j, const Team& t) const {
      return lane_dot(this->qr[j], k, er[j], kEdge, t, this->dvec);
    }
    __device__ __forceinline__ A score_of(A sum) const { return scaled_score(sum, this->scale); }
    __device__ __forceinline__ A value_dot(const RawRow<T, VEC, NV>& gr, int j, const Team& t) const {
      return lane_dot(gr, v, er[j], kEdge, t, this->vvec);
    }
  };

  // The src pass from the dst pass's records (alpha and ds, where memory allows): the q and
  // grad_out rows it needs anyway, and no k, v or edge_feat rows, no score, no dot products.
  template <typename T, int VEC, int NV, bool kEdge, int B>
  struct SrcFromRecords : KvGrads<T, VEC, NV, B> {
    using Base = KvGrads<T, VEC, NV, B>;

    __device__ __forceinline__ explicit SrcFromRecords(const Inputs& in) : Base(in) {}

    __device__ __forceinline__ void begin(const Inputs&, const Team&, int64_t, int64_t) {}
    __device__ __forceinline__ void load(const BackwardArgs& a, const Team& t, const GroupedEdge (&e)[B], int64_t h) {
      this->load_q(a.in, t, e, h);
    }
  };

  template <typename T>
  static void dst_merges(const BackwardArgs& a, MergeList<T>& merges) {
    merges.add(a.dst_chunks, a.in.dim, static_cast<const accum_t<T>*>(a.part_dq), static_cast<T*>(a.dq), a.grad_pack);
  }
  template <typename T>
  static void src_merges(const BackwardArgs& a, MergeList<T>& merges) {
    merges.add(a.src_chunks, a.in.dim, static_cast<const accum_t<T>*>(a.part_dk), static_cast<T*>(a.dk), a.grad_pack);
    merges.add(a.src_chunks, a.in.dim_v, static_cast<const accum_t<T>*>(a.part_dv), static_cast<T*>(a.dv), a.grad_pack);
  }
};

// CosineScore's passes (cosine_*.cu), called by graph attention's when scale_heads is given.
void launch_cosine_forward(const AttentionForwardArgs& a, ScalarKind scalar, cudaStream_t stream);
void launch_cosine_backward_dst(const AttentionBackwardArgs& a, ScalarKind scalar, cudaStream_t stream);
void launch_cosine_backward_src(const AttentionBackwardArgs& a, ScalarKind scalar, cudaStream_t stream);

// ---- AGNN ---------------------------------------------------------------------------------------
// The dot score under a learned per-head scale (scale_heads, AGNN's beta) of rows the caller
// normalised: q = k = x / |x| make <q, k> the cosine. The dst pass also sums, per unit, ds times
// the unscaled dot product: the scale's gradient once summed over rows.
struct CosineScore : DotScore {
  static constexpr bool kResidualGrad = false;  // AGNN takes no residual
  template <typename T>
  __device__ __forceinline__ static accum_t<T> head_scale(const Inputs& in, int64_t h) {
    return to_accum(__ldg(static_cast<const T*>(in.scale_heads) + h));
  }

  template <typename T, int VEC, int NV, bool kEdge, int B>
  struct Dst : DotScore::Dst<T, VEC, NV, kEdge, B> {
    using Base = DotScore::Dst<T, VEC, NV, kEdge, B>;
    using A = accum_t<T>;
    A dscale;  // the same on every lane

    __device__ __forceinline__ explicit Dst(const Inputs& in) : Base(in) {}

    __device__ __forceinline__ void begin(const Inputs& in, const Team& t, int64_t n, int64_t h) {
      Base::begin(in, t, n, h);
      this->scale = head_scale<T>(in, h);
    }
    __device__ __forceinline__ void zero_grads() {
      Base::zero_grads();
      dscale = 0;
    }
    __device__ __forceinline__ void add_grads(int j, A ds, A alpha_keep, const LaneRow<T, VEC, NV>& dout, T* edge_row,
                                              const Team& t) {
      Base::add_grads(j, ds, alpha_keep, dout, edge_row, t);
      dscale = fma_accum(ds, t.sum(lane_dot(this->q, this->kr[j], this->er[j], kEdge, t, this->dvec)), dscale);
    }
    __device__ __forceinline__ void store_grads(const BackwardArgs& a, const WorkUnit& w, int64_t unit,
                                                const Team& t) const {
      Base::store_grads(a, w, unit, t);
      if (t.lane != 0) return;
      const int64_t row = w.slot >= 0 ? num_dst(a.in) + w.slot : int64_t{w.row};
      static_cast<A*>(a.d_scale_rows)[row * a.in.heads + w.head] = dscale;
    }
  };

  // A src pass of DotScore's under the head's scale.
  template <class Side>
  struct HeadScaled : Side {
    __device__ __forceinline__ explicit HeadScaled(const Inputs& in) : Side(in) {}

    __device__ __forceinline__ void begin(const Inputs& in, const Team& t, int64_t s, int64_t h) {
      Side::begin(in, t, s, h);
      this->scale = head_scale<typename Side::Element>(in, h);
    }
  };
  template <typename T, int VEC, int NV, bool kEdge, int B>
  using Src = HeadScaled<DotScore::Src<T, VEC, NV, kEdge, B>>;
  template <typename T, int VEC, int NV, bool kEdge, int B>
  using SrcFromRecords = HeadScaled<DotScore::SrcFromRecords<T, VEC, NV, kEdge, B>>;
};

}  // namespace edgedot
