// Shared by the graph attention kernels: thread teams, a lane's vectors of a row, the dropout hash.
#pragma once

#include <cmath>
#include <cstring>
#include <initializer_list>
#include <utility>

#include "common.cuh"

namespace edgedot {

__device__ __forceinline__ float fma_accum(float a, float b, float c) { return fmaf(a, b, c); }
__device__ __forceinline__ double fma_accum(double a, double b, double c) { return fma(a, b, c); }

// A score, rounded on its own: never fused into a later subtraction (of lse), which the forward
// and the backward passes would then round differently.
__device__ __forceinline__ float scaled_score(float dot, float scale) { return __fmul_rn(dot, scale); }
__device__ __forceinline__ double scaled_score(double dot, double scale) { return __dmul_rn(dot, scale); }

// Edges in flight per team: each lane loads the rows of this many edges before it adds any, since
// the gather is latency-bound; fewer when a lane holds more vectors of each row, and half as many
// for types whose widened values take more registers (half types, double), which spilled at four.
template <typename T, int NV>
constexpr int kAttentionBatch = (std::is_same_v<T, float> ? 4 : 2) / NV > 1 ? (std::is_same_v<T, float> ? 4 : 2) / NV : 1;

// Blocks per SM the kernels are built for: 128 registers a thread; double, whose values take two,
// gets 255 (it spilled at 128).
template <typename T>
constexpr int kAttentionBlocksPerSM = sizeof(T) == 8 ? 1 : 2;

// A team of `group` lanes (an aligned power of two up to 32) owns one (row, head) pair. Teams of a
// warp walk different rows, so they diverge: reductions shuffle within the team's own lanes.
struct Team {
  unsigned mask;
  int lane, group, first;  // first: the warp lane of the team's lane 0

  __device__ __forceinline__ explicit Team(int g) : group(g) {
    const int warp_lane = threadIdx.x & 31;
    lane = warp_lane & (g - 1);
    first = warp_lane - lane;
    mask = g == 32 ? 0xffffffffu : ((1u << g) - 1) << first;
  }

  // Sum over the team. The butterfly gives every lane the same bits (a + b == b + a), so decisions
  // taken on the result stay uniform across the team.
  template <typename A>
  __device__ __forceinline__ A sum(A x) const {
    for (int offset = group >> 1; offset > 0; offset >>= 1) x += __shfl_xor_sync(mask, x, offset);
    return x;
  }

  template <typename V>
  __device__ __forceinline__ V from(V x, int team_lane) const {
    return __shfl_sync(mask, x, first + team_lane);
  }
};

// Team shape for rows of `vectors` vectors: lanes per team and vectors per lane (per_lane, a power
// of two). One vector per lane up to 32, so small heads spread over several lanes and the heads of
// one node (adjacent teams) read adjacent memory.
struct TeamShape {
  int group, per_lane;
};

inline TeamShape attention_team(int64_t vectors) {
  int group = 1;
  while (group < 32 && group < vectors) group *= 2;
  int per_lane = 1;
  while (static_cast<int64_t>(group) * per_lane < vectors) per_lane *= 2;
  return {group, per_lane};
}

// A lane's NV vectors of a row: vectors lane + u * group, u < NV, those below `vectors`.
template <typename T, int VEC, int NV>
struct LaneRow {
  using A = accum_t<T>;
  A x[NV][VEC];

  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int u = 0; u < NV; ++u)
#pragma unroll
      for (int j = 0; j < VEC; ++j) x[u][j] = 0;
  }
};

template <int NV>
__device__ __forceinline__ bool lane_has(const Team& t, int vectors, int u) {
  return t.lane + u * t.group < vectors;
}

template <typename T, int VEC>
__device__ __forceinline__ const T* lane_vec(const T* row, const Team& t, int u) {
  return row + (t.lane + u * t.group) * VEC;
}

// load_vec through the read-only data cache: the kernels never write the tables they gather from,
// and the compiler does not infer that by itself here (the plain loads stayed ld.global).
template <typename T, int VEC>
__device__ __forceinline__ Vec<T, VEC> load_vec_ro(const T* p) {
  constexpr int kBytes = sizeof(T) * VEC;
  Vec<T, VEC> v;
  if constexpr (kBytes == 16) {
    const int4 bits = __ldg(reinterpret_cast<const int4*>(p));
    memcpy(&v, &bits, kBytes);
  } else if constexpr (kBytes == 8) {
    const int2 bits = __ldg(reinterpret_cast<const int2*>(p));
    memcpy(&v, &bits, kBytes);
  } else if constexpr (kBytes == 4) {
    const int bits = __ldg(reinterpret_cast<const int*>(p));
    memcpy(&v, &bits, kBytes);
  } else {
    static_assert(kBytes == 2, "vectors of 2, 4, 8 or 16 bytes");
    const unsigned short bits = __ldg(reinterpret_cast<const unsigned short*>(p));
    memcpy(&v, &bits, kBytes);
  }
  return v;
}

// Raw vectors of a row, as loaded (converted later, so that loads of several edges issue together).
template <typename T, int VEC, int NV>
struct RawRow {
  Vec<T, VEC> x[NV];

  __device__ __forceinline__ void load(const T* row, const Team& t, int vectors) {
#pragma unroll
    for (int u = 0; u < NV; ++u)
      if (lane_has<NV>(t, vectors, u)) x[u] = load_vec_ro<T, VEC>(lane_vec<T, VEC>(row, t, u));
  }
};

// Element c of vector u of raw (+ extra when add_extra), in the accumulation type. Rows are kept
// as loaded and widened where used, which keeps half the registers for half types.
template <typename T, int VEC, int NV>
__device__ __forceinline__ accum_t<T> widened(const RawRow<T, VEC, NV>& raw, const RawRow<T, VEC, NV>& extra,
                                              bool add_extra, int u, int c) {
  accum_t<T> value = to_accum(raw.x[u].v[c]);
  if (add_extra) value += to_accum(extra.x[u].v[c]);
  return value;
}

template <typename T, int VEC, int NV>
__device__ __forceinline__ void load_widened(LaneRow<T, VEC, NV>& out, const T* row, const Team& t, int vectors) {
  RawRow<T, VEC, NV> raw;
  raw.load(row, t, vectors);
#pragma unroll
  for (int u = 0; u < NV; ++u) {
    const bool has = lane_has<NV>(t, vectors, u);
#pragma unroll
    for (int c = 0; c < VEC; ++c) out.x[u][c] = has ? to_accum(raw.x[u].v[c]) : accum_t<T>(0);
  }
}

// This lane's part of <x, raw (+ extra)> over the vectors below `vectors`.
template <typename T, int VEC, int NV>
__device__ __forceinline__ accum_t<T> lane_dot(const LaneRow<T, VEC, NV>& x, const RawRow<T, VEC, NV>& raw,
                                               const RawRow<T, VEC, NV>& extra, bool add_extra, const Team& t,
                                               int vectors) {
  accum_t<T> acc = 0;
#pragma unroll
  for (int u = 0; u < NV; ++u) {
    if (!lane_has<NV>(t, vectors, u)) continue;
#pragma unroll
    for (int c = 0; c < VEC; ++c) acc = fma_accum(x.x[u][c], widened(raw, extra, add_extra, u, c), acc);
  }
  return acc;
}

// acc += g * (raw (+ extra)) over the vectors below `vectors`.
template <typename T, int VEC, int NV>
__device__ __forceinline__ void add_scaled(LaneRow<T, VEC, NV>& acc, accum_t<T> g, const RawRow<T, VEC, NV>& raw,
                                           const RawRow<T, VEC, NV>& extra, bool add_extra, const Team& t,
                                           int vectors) {
#pragma unroll
  for (int u = 0; u < NV; ++u) {
    if (!lane_has<NV>(t, vectors, u)) continue;
#pragma unroll
    for (int c = 0; c < VEC; ++c) acc.x[u][c] = fma_accum(g, widened(raw, extra, add_extra, u, c), acc.x[u][c]);
  }
}

// This lane's part of <x, y>; lanes without a vector hold zeros there.
template <typename T, int VEC, int NV>
__device__ __forceinline__ accum_t<T> lane_dot(const LaneRow<T, VEC, NV>& x, const LaneRow<T, VEC, NV>& y) {
  accum_t<T> acc = 0;
#pragma unroll
  for (int u = 0; u < NV; ++u)
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc = fma_accum(x.x[u][j], y.x[u][j], acc);
  return acc;
}

// acc *= c.
template <typename T, int VEC, int NV>
__device__ __forceinline__ void scale_row(LaneRow<T, VEC, NV>& acc, accum_t<T> c) {
#pragma unroll
  for (int u = 0; u < NV; ++u)
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc.x[u][j] *= c;
}

// row = a * x + b * y (y only when use_y), written as T over the lane's vectors.
template <typename T, int VEC, int NV>
__device__ __forceinline__ void store_combination(T* row, const Team& t, int vectors, accum_t<T> a,
                                                  const LaneRow<T, VEC, NV>& x, accum_t<T> b,
                                                  const LaneRow<T, VEC, NV>& y, bool use_y) {
#pragma unroll
  for (int u = 0; u < NV; ++u) {
    if (!lane_has<NV>(t, vectors, u)) continue;
    Vec<T, VEC> out;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      accum_t<T> value = a * x.x[u][j];
      if (use_y) value = fma_accum(b, y.x[u][j], value);
      out.v[j] = from_accum<T>(value);
    }
    *reinterpret_cast<Vec<T, VEC>*>(row + (t.lane + u * t.group) * VEC) = out;
  }
}

template <typename T, int VEC, int NV>
__device__ __forceinline__ void store_zero_row(T* row, const Team& t, int vectors) {
  Vec<T, VEC> zero;
#pragma unroll
  for (int j = 0; j < VEC; ++j) zero.v[j] = from_accum<T>(accum_t<T>(0));
#pragma unroll
  for (int u = 0; u < NV; ++u)
    if (lane_has<NV>(t, vectors, u)) *reinterpret_cast<Vec<T, VEC>*>(row + (t.lane + u * t.group) * VEC) = zero;
}

template <typename T, int VEC, int NV>
__device__ __forceinline__ void store_row(T* row, const Team& t, int vectors, accum_t<T> a,
                                          const LaneRow<T, VEC, NV>& x) {
  store_combination(row, t, vectors, a, x, a, x, false);
}

// Multiply-xorshift integer hash, the mixing step of the dropout mask (edgedot.attention.dropout_keep).
__host__ __device__ __forceinline__ uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// Whether head h of edge e survives dropout: a function of (seed, e, h) only, so the forward and
// both backward passes agree whatever order they visit the edges in. threshold = floor(p * 2**32).
__device__ __forceinline__ bool attention_keep(int64_t edge, int64_t head, int64_t heads, uint64_t seed,
                                               uint64_t threshold) {
  const uint64_t c = static_cast<uint64_t>(edge) * static_cast<uint64_t>(heads) + static_cast<uint64_t>(head);
  uint32_t u = mix32(static_cast<uint32_t>(c) ^ static_cast<uint32_t>(seed));
  u = mix32(u ^ static_cast<uint32_t>(c >> 32) ^ static_cast<uint32_t>(seed >> 32));
  return static_cast<uint64_t>(u) >= threshold;
}

// alpha' / alpha for head h of edge e: 1 without dropout, else keep / (1 - p).
template <typename A>
__device__ __forceinline__ A keep_weight(const AttentionDropout& d, int64_t edge, int64_t head, int64_t heads) {
  if (d.threshold == 0) return A(1);
  return attention_keep(edge, head, heads, d.seed, d.threshold) ? static_cast<A>(d.keep_scale) : A(0);
}

template <typename A>
__device__ __forceinline__ A accurate_exp(A x) {
  if constexpr (std::is_same_v<A, double>) return exp(x);
  else return expf(x);
}

template <typename A>
__device__ __forceinline__ A accurate_log(A x) {
  if constexpr (std::is_same_v<A, double>) return log(x);
  else return logf(x);
}

// Row n of a feature table, head h.
template <typename T>
__device__ __forceinline__ const T* row_head(const Rows& r, int64_t n, int64_t h) {
  return static_cast<const T*>(r.data) + n * r.row_stride + h * r.head_stride;
}

// Sorted position i of a grouping: its other row (-1 when out of range) and edge id.
struct GroupedEdge {
  int32_t other;
  int64_t edge;
};

__device__ __forceinline__ GroupedEdge grouped_edge(const AttentionGrouping& g, int64_t i) {
  return {static_cast<int32_t>(static_cast<uint32_t>(__ldg(reinterpret_cast<const unsigned long long*>(g.row_other + i)))),
          __ldg(reinterpret_cast<const long long*>(g.order + i))};
}

// Sorted positions [begin, end) of row r, clamped to [0, num_edges] so that no offsets can make a
// kernel read outside the grouping.
struct PositionRange {
  int64_t begin, end;
};

__device__ __forceinline__ int64_t clamp_position(int64_t i, int64_t num_edges) {
  return i < 0 ? 0 : (i > num_edges ? num_edges : i);
}

__device__ __forceinline__ PositionRange row_positions(const AttentionGrouping& g, int64_t r, int64_t num_edges) {
  const int64_t begin = clamp_position(g.offsets[r], num_edges);
  const int64_t end = clamp_position(g.offsets[r + 1], num_edges);
  return {begin, end > begin ? end : begin};
}

// Walks sorted positions [begin, end) of a grouping in batches of B edges. For each batch,
// load(edges) issues the loads of the edges' rows, then the next batch's positions are loaded (so
// that they arrive while this batch's rows are in flight), then use(edges, i) computes. Positions
// past end come as {-1, -1}. In teams of at least B lanes, lane j loads position i + j (one
// coalesced load) and Team::from hands it to the team; smaller teams load every position per lane.
template <int B, typename Load, typename Use>
__device__ __forceinline__ void walk_edges(const AttentionGrouping& g, const Team& t, int64_t begin, int64_t end,
                                           Load&& load, Use&& use) {
  GroupedEdge next[B];
  auto fetch = [&](int64_t i) {
    if (t.group >= B) {
      next[0] = GroupedEdge{-1, -1};
      if (t.lane < B && i + t.lane < end) next[0] = grouped_edge(g, i + t.lane);
    } else {
#pragma unroll
      for (int j = 0; j < B; ++j) next[j] = i + j < end ? grouped_edge(g, i + j) : GroupedEdge{-1, -1};
    }
  };
  if (begin < end) fetch(begin);
  for (int64_t i = begin; i < end; i += B) {
    GroupedEdge e[B];
#pragma unroll
    for (int j = 0; j < B; ++j) {
      if (t.group >= B) {
        e[j].other = t.from(next[0].other, j);
        e[j].edge = t.from(next[0].edge, j);
      } else {
        e[j] = next[j];
      }
    }
    load(e);
    if (i + B < end) fetch(i + B);
    use(e, i);
  }
}

// Whether every row the kernels read or write can move as 16-byte vectors of T.
template <typename T>
inline bool attention_vectorizable(std::initializer_list<std::pair<const Rows*, int64_t>> rows,
                                   std::initializer_list<const void*> outputs) {
  for (const auto& [r, dim] : rows)
    if (r->data != nullptr && !rows_vectorizable<T>(*r, dim)) return false;
  for (const void* p : outputs)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}

// Calls f(integral_constant VEC, integral_constant NV) with the smallest NV >= per_lane, up to
// what kAttentionMaxDim needs at this vector width (32 lanes of NV vectors of VEC elements).
template <int VEC, int NV, typename F>
inline void dispatch_per_lane(int per_lane, F&& f) {
  if constexpr (NV * 32 * VEC < kAttentionMaxDim) {
    if (per_lane > NV) {
      dispatch_per_lane<VEC, 2 * NV>(per_lane, f);
      return;
    }
  }
  f(std::integral_constant<int, VEC>{}, std::integral_constant<int, NV>{});
}

// The same for 16-byte vectors when `vectorized`, else single elements.
template <typename T, typename F>
inline void dispatch_attention(bool vectorized, int per_lane, F&& f) {
  if (vectorized) {
    dispatch_per_lane<wide_vec<T>(), 1>(per_lane, f);
  } else {
    dispatch_per_lane<1, 1>(per_lane, f);
  }
}

}  // namespace edgedot
