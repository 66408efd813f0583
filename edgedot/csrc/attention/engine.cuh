// Shared by the graph attention kernels: thread teams, a lane's vectors of a row, dropout weights.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <utility>

#include "common/common.cuh"
#include "attention/dropout.cuh"

namespace edgedot {

__device__ __forceinline__ float fma_accum(float a, float b, float c) { return fmaf(a, b, c); }
__device__ __forceinline__ double fma_accum(double a, double b, double c) { return fma(a, b, c); }

// A score, rounded on its own: never fused into a later subtraction (of lse), which the forward
// and the backward passes would then round differently.
__device__ __forceinline__ float scaled_score(float dot, float scale) { return __fmul_rn(dot, scale); }
__device__ __forceinline__ double scaled_score(double dot, double scale) { return __dmul_rn(dot, scale); }

// Edges in flight per team: each lane loads the rows of this many edges before it adds any, since
// the gather is latency-bound; fewer when a lane holds more vectors of each row, and fewer for
// types whose widened values take more registers (half types, double) or with edge_feat rows.
template <typename T, int NV, bool kHasEdgeFeat>
constexpr int kAttentionBatch =
    std::max(1, (std::is_same_v<T, float> ? 4 : sizeof(T) == 8 || kHasEdgeFeat ? 2 : 3) / NV);

// Blocks per SM the kernels are built for: 3 (80 registers a thread) where that leaves the batches
// above without spills; 2 (128 registers) with edge_feat rows or 8 vectors a lane; 1 for double,
// whose values take two registers each (it spilled at 128).
template <typename T, int NV, bool kHasEdgeFeat>
constexpr int kAttentionBlocksPerSM = sizeof(T) == 8 ? 1 : kHasEdgeFeat || NV == 8 ? 2 : 3;

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

// Fewest lanes of a team: walk_edges gives each edge of a batch to a lane of its own. Lanes beyond
// a row's vectors add zeros, which leave the team's sums as they are (but for the sign of a zero).
constexpr int kAttentionMinTeam = 4;

// Team shape for rows of `vectors` vectors: lanes per team and vectors per lane (per_lane, a power
// of two). One vector per lane up to 32, so small heads spread over several lanes and the heads of
// one node (adjacent teams) read adjacent memory.
struct TeamShape {
  int group, per_lane;
};

inline TeamShape attention_team(int64_t vectors) {
  int group = kAttentionMinTeam;
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

  __device__ __forceinline__ A at(int u, int c) const { return x[u][c]; }
};

template <int NV>
__device__ __forceinline__ bool lane_has(const Team& t, int vectors, int u) {
  return t.lane + u * t.group < vectors;
}

template <typename T, int VEC>
__device__ __forceinline__ const T* lane_vec(const T* row, const Team& t, int u) {
  return row + (t.lane + u * t.group) * VEC;
}

// The bits of a vector of VEC elements of T, in 32-bit words (one 16-bit word for a single half
// type element). Rows are held as these words: held as elements, bfloat16 rows took one register
// per 16-bit element, twice the registers, and spilled.
template <typename T, int VEC>
struct VecBits {
  static constexpr int kBytes = sizeof(T) * VEC;
  using Word = std::conditional_t<kBytes >= 4, uint32_t, uint16_t>;
  Word w[kBytes / sizeof(Word)];
};

// A vector's bits through the read-only data cache: the kernels never write the tables they gather
// from, and the compiler does not infer that by itself here (the plain loads stayed ld.global).
template <typename T, int VEC>
__device__ __forceinline__ VecBits<T, VEC> load_bits_ro(const T* p) {
  constexpr int kBytes = VecBits<T, VEC>::kBytes;
  VecBits<T, VEC> b;
  if constexpr (kBytes == 16) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
    b.w[0] = v.x, b.w[1] = v.y, b.w[2] = v.z, b.w[3] = v.w;
  } else if constexpr (kBytes == 8) {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
    b.w[0] = v.x, b.w[1] = v.y;
  } else if constexpr (kBytes == 4) {
    b.w[0] = __ldg(reinterpret_cast<const unsigned*>(p));
  } else {
    static_assert(kBytes == 2, "vectors of 2, 4, 8 or 16 bytes");
    b.w[0] = __ldg(reinterpret_cast<const unsigned short*>(p));
  }
  return b;
}

// Element c of a vector, widened to the accumulation type (exactly).
template <typename T, int VEC>
__device__ __forceinline__ accum_t<T> widen(const VecBits<T, VEC>& b, int c) {
  if constexpr (std::is_same_v<T, float>) {
    return __uint_as_float(b.w[c]);
  } else if constexpr (std::is_same_v<T, double>) {
    return __hiloint2double(static_cast<int>(b.w[2 * c + 1]), static_cast<int>(b.w[2 * c]));
  } else if constexpr (VecBits<T, VEC>::kBytes >= 4) {
    typename Pair<T>::type pair;  // half types: the element's half of its pair's word
    memcpy(&pair, &b.w[c / 2], sizeof(pair));
    const float2 f = to_float2(pair);
    return c % 2 == 0 ? f.x : f.y;
  } else {
    T x;
    memcpy(&x, &b.w[0], sizeof(x));
    return to_accum(x);
  }
}

// Raw vectors of a row, as loaded (widened where used, so that loads of several edges issue
// together and half types keep half the registers).
template <typename T, int VEC, int NV>
struct RawRow {
  VecBits<T, VEC> x[NV];

  // The lane's vectors of row; zeros for those it does not hold, and all zeros for a null row. Every
  // path sets every register: a vector left as it was would keep its registers live from one batch
  // (and unit) to the next, through the rest of the loop.
  __device__ __forceinline__ void load(const T* row, const Team& t, int vectors) {
    const VecBits<T, VEC> zero{};
#pragma unroll
    for (int u = 0; u < NV; ++u)
      x[u] = row != nullptr && lane_has<NV>(t, vectors, u) ? load_bits_ro<T, VEC>(lane_vec<T, VEC>(row, t, u)) : zero;
  }

  // Element c of vector u, widened.
  __device__ __forceinline__ accum_t<T> at(int u, int c) const { return widen(x[u], c); }
};

// Element c of vector u of raw (+ extra when add_extra), in the accumulation type.
template <typename T, int VEC, int NV>
__device__ __forceinline__ accum_t<T> widened(const RawRow<T, VEC, NV>& raw, const RawRow<T, VEC, NV>& extra,
                                              bool add_extra, int u, int c) {
  accum_t<T> value = raw.at(u, c);
  if (add_extra) value += extra.at(u, c);
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
    for (int c = 0; c < VEC; ++c) out.x[u][c] = has ? raw.at(u, c) : accum_t<T>(0);
  }
}

// This lane's part of <x, raw (+ extra)> over the vectors below `vectors`; x a LaneRow, or a RawRow
// widened element by element (the same values, without holding them widened).
template <typename X, typename T, int VEC, int NV>
__device__ __forceinline__ accum_t<T> lane_dot(const X& x, const RawRow<T, VEC, NV>& raw,
                                               const RawRow<T, VEC, NV>& extra, bool add_extra, const Team& t,
                                               int vectors) {
  accum_t<T> acc = 0;
#pragma unroll
  for (int u = 0; u < NV; ++u) {
    if (!lane_has<NV>(t, vectors, u)) continue;
#pragma unroll
    for (int c = 0; c < VEC; ++c) acc = fma_accum(x.at(u, c), widened(raw, extra, add_extra, u, c), acc);
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

// alpha' / alpha for head h of edge e: 1 without dropout, else keep / (1 - p), the element hashed
// being e * heads + h; key from unpack_dropout_key.
template <typename A>
__device__ __forceinline__ A keep_weight(const Dropout& d, uint64_t key, int64_t edge, int64_t head, int64_t heads) {
  return dropout_weight<A>(d, key, static_cast<uint64_t>(edge) * static_cast<uint64_t>(heads) +
                                       static_cast<uint64_t>(head));
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

// An index of either kind, widened.
__device__ __forceinline__ int64_t load_index(const void* idx, IndexKind kind, int64_t i) {
  return kind == IndexKind::i32 ? static_cast<int64_t>(__ldg(static_cast<const int32_t*>(idx) + i))
                                : static_cast<int64_t>(__ldg(reinterpret_cast<const long long*>(idx) + i));
}

// Sorted position i of row `row` of a grouping: its edge id (-1 when out of range) and other row (-1
// when out of range, when the edge id is, or, for edges given grouped, when the edge's own row is
// not `row`; so other >= 0 says the edge's rows exist and belong here). Edge ids lie below
// num_edges < 2**31: both fit 32 bits, which halves the registers of a batch's positions.
struct GroupedEdge {
  int32_t other, edge;
};

__device__ __forceinline__ GroupedEdge grouped_edge(const AttentionGrouping& g, int64_t i, int64_t num_edges,
                                                    int64_t num_other, int64_t row) {
  if (g.order == nullptr) {  // edges given grouped: position i is edge i
    const int64_t other = load_index(g.other_idx, g.other_index, i);
    const bool ok = in_range(other, num_other) && load_index(g.row_idx, g.row_index, i) == row;
    return {ok ? static_cast<int32_t>(other) : -1, static_cast<int32_t>(i)};
  }
  const int64_t edge = __ldg(reinterpret_cast<const long long*>(g.order + i));
  const uint64_t row_other = __ldg(reinterpret_cast<const unsigned long long*>(g.row_other + i));
  const int32_t other = static_cast<int32_t>(static_cast<uint32_t>(row_other));
  const bool edge_ok = in_range(edge, num_edges);
  return {edge_ok && in_range(other, num_other) ? other : -1, edge_ok ? static_cast<int32_t>(edge) : -1};
}

// Sorted positions [begin, end) of row r, clamped to [0, num_edges] so that no offsets can make a
// kernel read outside the grouping.
struct PositionRange {
  int64_t begin, end;
};

__host__ __device__ __forceinline__ int64_t clamp_position(int64_t i, int64_t num_edges) {
  return i < 0 ? 0 : (i > num_edges ? num_edges : i);
}

__host__ __device__ __forceinline__ PositionRange clamped_positions(int64_t begin, int64_t end, int64_t num_edges) {
  begin = clamp_position(begin, num_edges);
  end = clamp_position(end, num_edges);
  return {begin, end > begin ? end : begin};
}

__device__ __forceinline__ PositionRange row_positions(const AttentionGrouping& g, int64_t r, int64_t num_edges) {
  return clamped_positions(g.offsets[r], g.offsets[r + 1], num_edges);
}

// Whether a row of `edges` edges is split into chunks (the schedule and the kernels agree on it).
__host__ __device__ __forceinline__ bool is_long_row(int64_t edges, int64_t chunk) { return edges > chunk; }

// A team's unit of work: head h of row `row` over sorted positions [begin, end): the whole row
// (slot -1), or chunk `slot` of a long row, whose result is partial. bad: the grouping given for
// this row is not a valid CSR pointer for its edges (edges given grouped only). lead: the unit that writes the
// row's per-row values (the whole row, or a long row's first chunk).
// Positions, rows, heads and slots fit 32 bits (num_edges < 2**31 - 1): fewer registers live
// through the walk.
struct WorkUnit {
  int32_t begin, end, row, head, slot;
  bool bad, lead;
};

// The long row a slot belongs to: the last r with first_chunk[r] <= slot.
__device__ __forceinline__ int64_t slot_row(const RowChunks& c, int64_t slot, int64_t num_rows) {
  int64_t lo = 0, hi = num_rows;  // first_chunk[lo] <= slot < first_chunk[hi]
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (c.first_chunk[mid] <= slot) lo = mid; else hi = mid;
  }
  return lo;
}

// Calls f(WorkUnit) for the units of team `team` of `teams`: every (chunk, head) of the long rows,
// then every (row, head) of a row that is not long, in row_order when there is one. Teams of a warp
// take adjacent units: the heads of one row, which have equal lengths.
template <typename F>
__device__ __forceinline__ void for_each_unit(const AttentionGrouping& g, const RowChunks& c, int64_t num_rows,
                                              int64_t heads, int64_t num_edges, int64_t team, int64_t teams, F&& f) {
  // The schedule keeps within max_slots; the bound only guards the partial buffers.
  const int64_t slots = c.first_chunk != nullptr ? min(c.first_chunk[num_rows], c.max_slots) : 0;
  // Edges given grouped: the pointer must start at 0, end at num_edges and never decrease.
  const bool partition = g.order != nullptr || (g.offsets[0] == 0 && g.offsets[num_rows] == num_edges);
  for (int64_t u = team; u < (num_rows + slots) * heads; u += teams) {
    const int64_t item = u / heads;
    WorkUnit w;
    w.head = static_cast<int32_t>(u - item * heads);
    if (item >= slots) {
      const int64_t k = item - slots;
      w.row = c.row_order != nullptr ? c.row_order[k] : static_cast<int32_t>(k);
      w.slot = -1;
      const PositionRange range = row_positions(g, w.row, num_edges);
      if (c.first_chunk != nullptr && is_long_row(range.end - range.begin, c.chunk)) continue;
      w.begin = static_cast<int32_t>(range.begin);
      w.end = static_cast<int32_t>(range.end);
      w.lead = true;
    } else {
      w.slot = static_cast<int32_t>(item);
      w.row = static_cast<int32_t>(slot_row(c, w.slot, num_rows));
      const PositionRange range = row_positions(g, w.row, num_edges);
      const int64_t begin = range.begin + (w.slot - c.first_chunk[w.row]) * c.chunk;
      w.begin = static_cast<int32_t>(begin);
      w.end = static_cast<int32_t>(begin + c.chunk < range.end ? begin + c.chunk : range.end);
      w.lead = begin == range.begin;
    }
    w.bad = !partition;
    if (g.order == nullptr && partition) {
      // The row's range must hold all its edges: the positions just outside it are other rows'.
      const int64_t first = g.offsets[w.row], last = g.offsets[w.row + 1];
      w.bad = last < first || (first > 0 && load_index(g.row_idx, g.row_index, first - 1) == w.row) ||
              (last < num_edges && load_index(g.row_idx, g.row_index, last) == w.row);
    }
    f(w);
  }
}

// Walks sorted positions [begin, end) of row `row` of a grouping of num_edges edges between its rows
// and num_other other rows, in batches of B edges. For each batch, load(edges) issues the loads of the
// edges' rows, then the next batch's positions are loaded (so that they arrive while this batch's
// rows are in flight), then use(edges, i) computes. Positions past end come as {-1, -1}. Lane j < B
// of the team loads position i + j (one coalesced load, one position a lane in registers) and
// Team::from hands it to the team (which has at least kAttentionMinTeam >= B lanes).
template <int B, typename Load, typename Use>
__device__ __forceinline__ void walk_edges(const AttentionGrouping& g, int64_t num_edges, int64_t num_other,
                                           const Team& t, int32_t row, int32_t begin, int32_t end, Load&& load,
                                           Use&& use) {
  static_assert(B <= kAttentionMinTeam, "a lane of the team per edge of a batch");
  GroupedEdge next{-1, -1};
  // Positions lie below num_edges < 2**31 - 1; differences keep the comparisons from overflowing.
  auto fetch = [&](int32_t i) {
    next = t.lane < B && t.lane < end - i ? grouped_edge(g, i + t.lane, num_edges, num_other, row)
                                          : GroupedEdge{-1, -1};
  };
  if (begin < end) fetch(begin);
  for (int32_t i = begin; i < end; i += B) {
    GroupedEdge e[B];
#pragma unroll
    for (int j = 0; j < B; ++j) e[j] = {t.from(next.other, j), t.from(next.edge, j)};
    load(e);
    if (end - i > B) fetch(i + B);
    use(e, i);
    if (end - i <= B) break;  // i + B would pass end (and could pass 2**31 - 1)
  }
}

// Stores a lane's part of an accumulation-type row (a chunk's partial result).
template <typename T, int VEC, int NV>
__device__ __forceinline__ void store_partial(accum_t<T>* row, const Team& t, int vectors,
                                              const LaneRow<T, VEC, NV>& x) {
  using A = accum_t<T>;
#pragma unroll
  for (int u = 0; u < NV; ++u) {
    if (!lane_has<NV>(t, vectors, u)) continue;
    Vec<A, VEC> out;
#pragma unroll
    for (int j = 0; j < VEC; ++j) out.v[j] = x.x[u][j];
    *reinterpret_cast<Vec<A, VEC>*>(row + (t.lane + u * t.group) * VEC) = out;
  }
}

// The merges of long rows' partials (csrc/attention_merge.cu), after the kernel that wrote them:
// softmax: part [slots, heads, dim] unnormalised outputs and part_ml [slots, heads, 2] their (max,
// sum), into out [rows, heads, dim] and lse [rows, heads]; sum: part summed into out.
template <typename T>
void launch_merge_softmax(const RowChunks& c, int64_t heads, int64_t dim, const accum_t<T>* part,
                          const accum_t<T>* part_ml, T* out, accum_t<T>* lse, cudaStream_t stream);
template <typename T>
void launch_merge_sum(const RowChunks& c, int64_t heads, int64_t dim, const accum_t<T>* part, T* out,
                      cudaStream_t stream);

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

// Calls f(integral_constant VEC, integral_constant NV, bool_constant has_edge_feat) with the
// smallest NV >= per_lane, up to what kAttentionMaxDim needs at this vector width (32 lanes of NV
// vectors of VEC elements).
template <int VEC, int NV, typename F>
inline void dispatch_per_lane(int per_lane, bool has_edge_feat, F&& f) {
  if constexpr (NV * 32 * VEC < kAttentionMaxDim) {
    if (per_lane > NV) {
      dispatch_per_lane<VEC, 2 * NV>(per_lane, has_edge_feat, f);
      return;
    }
  }
  if (has_edge_feat) {
    f(std::integral_constant<int, VEC>{}, std::integral_constant<int, NV>{}, std::true_type{});
  } else {
    f(std::integral_constant<int, VEC>{}, std::integral_constant<int, NV>{}, std::false_type{});
  }
}

// The same for 16-byte vectors when `vectorized`, else single elements.
template <typename T, typename F>
inline void dispatch_attention(bool vectorized, int per_lane, bool has_edge_feat, F&& f) {
  if (vectorized) {
    dispatch_per_lane<wide_vec<T>(), 1>(per_lane, has_edge_feat, f);
  } else {
    dispatch_per_lane<1, 1>(per_lane, has_edge_feat, f);
  }
}

}  // namespace edgedot
