// The attention engine: the units of work over a grouping (whole rows, and chunks of long rows),
// the walk over a row's edges, and the three passes every score function shares (the forward with
// its online softmax, and the backward's destination and source passes, by recomputation from
// lse). A score function is a policy (scores.cuh) that says what a score reads and what its
// gradients are; the passes here hold everything else.
#pragma once

#include <initializer_list>
#include <numeric>
#include <stdexcept>
#include <utility>

#include "attention/dropout.cuh"
#include "attention/lanes.cuh"

namespace edgedot {

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

// Sorted positions [begin, end) of row r, clamped to [0, num_edges]: no offsets make a kernel read
// outside the grouping.
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

// The unit of a whole row as a lane of the team reads it ahead (for_each_unit): its row, or ~row
// when the grouping given is bad for it, and its positions; end < begin: a long row, which its
// chunks serve.
struct RowAhead {
  int32_t row, begin, end;
};

__device__ __forceinline__ RowAhead row_ahead(const AttentionGrouping& g, const RowChunks& c, int64_t k,
                                              int64_t num_edges, bool partition) {
  const int32_t row = c.row_order != nullptr ? __ldg(c.row_order + k) : static_cast<int32_t>(k);
  const int64_t first = g.offsets[row], last = g.offsets[row + 1];
  const PositionRange range = clamped_positions(first, last, num_edges);
  if (c.first_chunk != nullptr && is_long_row(range.end - range.begin, c.chunk)) return {row, 1, 0};
  bool bad = !partition;
  if (g.order == nullptr && partition) {
    // The row's range must lie in [0, num_edges] and hold all its edges: the positions just
    // outside it are other rows'. Only positions inside the edges are read.
    bad = first < 0 || last < first || last > num_edges ||
          (first > 0 && load_index(g.row_idx, g.row_index, first - 1) == row) ||
          (last < num_edges && load_index(g.row_idx, g.row_index, last) == row);
  }
  return {bad ? ~row : row, static_cast<int32_t>(range.begin), static_cast<int32_t>(range.end)};
}

// Calls f(WorkUnit) for the units of team `team` of `teams`: every (chunk, head) of the long rows,
// then every (row, head) of a row that is not long, in row_order when there is one. Teams of a warp
// take adjacent units: the heads of one row, which have equal lengths.
// A whole row's unit waits on a chain of loads before its first row (its row in row_order, its
// offsets, then its positions), and a row of few edges or none is bound by that chain. So each lane
// of the team reads one of the team's next units ahead (RowAhead), all in one round trip, and the
// team then takes them in turn.
template <typename F>
__device__ __forceinline__ void for_each_unit(const AttentionGrouping& g, const RowChunks& c, int64_t num_rows,
                                              int64_t heads, int64_t num_edges, const Team& t, int64_t team,
                                              int64_t teams, F&& f) {
  // The schedule keeps within max_slots; the bound only guards the partial buffers.
  const int64_t slots = c.first_chunk != nullptr ? min(c.first_chunk[num_rows], c.max_slots) : 0;
  // Edges given grouped: the pointer must start at 0, end at num_edges and never decrease.
  const bool partition = g.order != nullptr || (g.offsets[0] == 0 && g.offsets[num_rows] == num_edges);
  const int64_t chunk_units = slots * heads, units = (num_rows + slots) * heads;
  // The lanes' reads ahead, one entry a thread (every pass runs blocks of kBlockThreads): in shared
  // memory, not in registers that would stay live through f.
  __shared__ RowAhead rows_ahead[kBlockThreads];
  RowAhead* team_rows = rows_ahead + (threadIdx.x - t.lane);
  int window = t.group;  // the place of unit u in the team's window; t.group: read a new one
  for (int64_t u = team; u < units; u += teams) {
    WorkUnit w;
    if (u < chunk_units) {
      w.slot = static_cast<int32_t>(u / heads);
      w.head = static_cast<int32_t>(u - int64_t{w.slot} * heads);
      w.row = static_cast<int32_t>(slot_row(c, w.slot, num_rows));
      const PositionRange range = row_positions(g, w.row, num_edges);
      const int64_t begin = range.begin + (w.slot - c.first_chunk[w.row]) * c.chunk;
      w.begin = static_cast<int32_t>(begin);
      w.end = static_cast<int32_t>(begin + c.chunk < range.end ? begin + c.chunk : range.end);
      w.lead = begin == range.begin;
      // The row's own checks, as row_ahead makes them for a whole row (no row_order, no chunks).
      w.bad = g.order == nullptr && row_ahead(g, RowChunks{}, w.row, num_edges, partition).row < 0;
    } else {
      if (window == t.group) {
        __syncwarp(t.mask);  // the team has read the last window
        const int64_t mine = u + t.lane * teams;
        team_rows[t.lane] = mine < units ? row_ahead(g, c, mine / heads - slots, num_edges, partition) : RowAhead{};
        __syncwarp(t.mask);
        window = 0;
      }
      const RowAhead ahead = team_rows[window++];
      w.begin = ahead.begin;
      w.end = ahead.end;
      const int32_t row = ahead.row;
      if (w.end < w.begin) continue;  // a long row
      w.row = row < 0 ? ~row : row;
      w.bad = row < 0;
      w.head = static_cast<int32_t>(u % heads);
      w.slot = -1;
      w.lead = true;
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

// The scores of a batch's edges, s[j] (`absent` where e[j].other < 0: past the end, or a row out
// of range), and with a dot(j) (a lane's part of a dot product of edge j) its team sums dp[j] (0
// where absent). A policy whose score is a team sum (kTeamScore) gives each lane's part
// (lane_score(j, t)) and what the sum makes a score (score_of); the others give score(j, t). All of
// a batch's sums share one set of rounds (Team::sum_each).
template <class Score, class Side, typename A, int B, typename Dot>
__device__ __forceinline__ void batch_scores(const Side& side, const Team& t, const GroupedEdge (&e)[B], A absent,
                                             A (&s)[B], A (&dp)[B], Dot&& dot) {
  constexpr bool kDots = !std::is_same_v<std::decay_t<Dot>, std::nullptr_t>;
  constexpr int kScores = Score::kTeamScore ? B : 0;
  constexpr int kSums = kScores + (kDots ? B : 0);
  A part[kSums > 0 ? kSums : 1];
  if constexpr (kSums > 0) {
#pragma unroll
    for (int j = 0; j < B; ++j) {
      const bool ok = e[j].other >= 0;
      if constexpr (Score::kTeamScore) part[j] = ok ? side.lane_score(j, t) : A(0);
      if constexpr (kDots) part[kScores + j] = ok ? dot(j) : A(0);
    }
    t.sum_each(part);
  }
#pragma unroll
  for (int j = 0; j < B; ++j) {
    if constexpr (kDots) dp[j] = part[kScores + j];
    if (e[j].other < 0) {
      s[j] = absent;
    } else if constexpr (Score::kTeamScore) {
      s[j] = side.score_of(part[j]);
    } else {
      s[j] = side.score(j, t);
    }
  }
}

template <class Score, class Side, typename A, int B>
__device__ __forceinline__ void batch_scores(const Side& side, const Team& t, const GroupedEdge (&e)[B], A absent,
                                             A (&s)[B]) {
  A unused[B];
  batch_scores<Score>(side, t, e, absent, s, unused, nullptr);
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

// One merge of long rows' partials (merge.cu): a grouping's chunk schedule, the width of its rows,
// part [slots, heads, dim] and, for a softmax merge, part_ml [slots, heads, 2] the partials' (max,
// sum); the merged rows go to out [rows, heads, dim] (and a softmax's to lse [rows, heads]).
template <typename T>
struct MergeTarget {
  RowChunks chunks;
  int dim;
  const accum_t<T>* part;
  const accum_t<T>* part_ml;
  T* out;
  accum_t<T>* lse;
  int pack = 1;  // a sum's out rows of heads x dim lie this many such rows apart (store_grad_row)
  Rows plus{};   // a softmax's residual, added to each merged row (data null: none)
};

// The most sum merges one launch takes: a backward's (graph attention's dq, dk and dv; GAT's da_dst,
// dx and da_src).
constexpr int kMaxMerges = 3;

// Sum merges launched together: after both backward passes instead of one after each (nothing
// reads the dst pass's merged rows before the src pass ends), in one launch for rows of at most 32
// columns and one for wider rows, since small calls are bound by the host's launches.
template <typename T>
struct MergeList {
  MergeTarget<T> at[kMaxMerges];
  int count;

  void add(const RowChunks& chunks, int64_t dim, const accum_t<T>* part, T* out, int pack = 1) {
    if (count == kMaxMerges) throw std::logic_error("edgedot: more sum merges than kMaxMerges");
    at[count++] = MergeTarget<T>{chunks, static_cast<int>(dim), part, nullptr, out, nullptr, pack};
  }
};

// The merges, after the kernels that wrote the partials: softmax (the forward's), out = the
// partials' softmax-weighted sum and lse; sums (the backward's), each target's partials summed.
template <typename T>
void launch_merge_softmax(const RowChunks& c, int64_t heads, int64_t dim, const accum_t<T>* part,
                          const accum_t<T>* part_ml, T* out, accum_t<T>* lse, const Rows& plus, cudaStream_t stream);
template <typename T>
void launch_merge_sums(const MergeList<T>& merges, int64_t heads, cudaStream_t stream);

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

// Calls f(integral_constant VEC, integral_constant NV, bool_constant has_edge) with the
// smallest NV >= per_lane, up to what kAttentionMaxDim needs at this vector width (32 lanes of NV
// vectors of VEC elements).
template <int VEC, int NV, typename F>
inline void dispatch_per_lane(int per_lane, bool has_edge, F&& f) {
  if constexpr (NV * 32 * VEC < kAttentionMaxDim) {
    if (per_lane > NV) {
      dispatch_per_lane<VEC, 2 * NV>(per_lane, has_edge, f);
      return;
    }
  }
  if (has_edge) {
    f(std::integral_constant<int, VEC>{}, std::integral_constant<int, NV>{}, std::true_type{});
  } else {
    f(std::integral_constant<int, VEC>{}, std::integral_constant<int, NV>{}, std::false_type{});
  }
}

// What the dst pass hands the src pass of one (edge, head) where a policy's kSrcFromRecords says its
// src pass reads them instead of recomputing the score: alpha (before dropout) and ds (or what the
// policy's Dst::recorded(j, ds) makes of it), in the accumulation type. An edge the dst pass skips
// (alpha 0) records {0, 0}.
template <typename A>
struct alignas(2 * sizeof(A)) EdgeRecord {
  A alpha, ds;
};

// What a policy whose src pass reads records shares (kSrcFromRecords): the records at
// args.src_state, and src_state_width(in, vec), the bytes per (edge, head) its dst pass hands
// besides them: none here (a policy that hands more hides it).
struct RecordsPolicy {
  static constexpr bool kSrcFromRecords = true;
  template <typename A, class Args>
  __host__ __device__ static EdgeRecord<A>* records(const Args& a) {
    return static_cast<EdgeRecord<A>*>(a.src_state);
  }
  template <class Inputs>
  static int64_t src_state_width(const Inputs&, int) {
    return 0;
  }
};

template <typename A>
__device__ __forceinline__ EdgeRecord<A> load_record(const EdgeRecord<A>* p) {
  if constexpr (std::is_same_v<A, double>) {
    const double2 v = __ldg(reinterpret_cast<const double2*>(p));
    return {v.x, v.y};
  } else {
    const float2 v = __ldg(reinterpret_cast<const float2*>(p));
    return {v.x, v.y};
  }
}

// ---- The passes ---------------------------------------------------------------------------------
// A score policy Score (scores.cuh) gives the passes:
//   Inputs, ForwardArgs, BackwardArgs: its argument structs (edgedot.h); num_dst, num_src, dim_v
//     (the value rows' width), team_dim (the widest row a team holds) and has_edge of its inputs;
//     vectorizable<T>(args): whether every row of a pass moves as 16-byte vectors;
//   kHeavy<kEdge>: whether its state takes the register budget of per-edge rows; kForwardLight,
//     kDstLight <T, NV, kEdge>: whether its forward, its dst pass, runs at the light budget all the
//     same; kFourBlocks<T, NV, kEdge>: whether its light passes fit four blocks a SM
//     (kPassBlocksPerSM);
//   kForwardBatch, kDstBatch, kSrcBatch <T, NV, kEdge>: edges in flight per team in each pass;
//   kTeamScore: whether a score is a sum over the team's lanes, of which each side then gives a
//     lane's part, lane_score(j, t), and what the sum makes a score, score_of(sum); else score(j, t)
//     (batch_scores);
//   Dst<T, VEC, NV, kEdge, B>: a destination's side of its edges' scores (forward and dst pass):
//     begin(in, t, n, h); load<Loads>(in, t, edges, h) (which rows, in which order: RowLoads);
//     the score; add_value(acc, p, j, t); value_dot(dout, j, t) (a lane's part); and the dst pass's
//     gradients: zero_grads(), edge_grads(args), edge_grad_width(in), zero_edge_grad(row, t),
//     add_grads(j, ds, alpha', dout, edge_row, t), store_grads(args, unit, t);
//   Src<T, VEC, NV, kEdge, B>: a source's side (src pass): begin, load(in, t, edges, h), the score,
//     value_dot(grad_out row, j, t), zero_grads, add_grads(j, ds, alpha', grad_out row, t),
//     store_grads;
//   kTeamGrads: whether Dst also sums a gradient over every unit its team serves (a parameter's,
//     not a node's), held from its constructor on and written by store_team_grads(args, team, t)
//     after the team's last unit; the team serves head team % heads throughout (with_backward_dst);
//   dst_merges<T>(args, list), src_merges<T>(args, list): adds the chunk merges of each pass's
//     gradients to a MergeList (launch_backward_merges launches them together).
//   kResidualGrad: whether its dst pass writes a packed residual's gradient (args.residual_grad);
//   kSrcFromRecords: whether its src pass can read each (edge, head)'s alpha and ds from the dst
//     pass (records(args), EdgeRecord<A>*; null when no src pass follows or they did not fit in
//     memory: then Src recomputes them) instead of recomputing them (RecordsPolicy gives the flag,
//     records and src_state_width, the bytes handed besides the records); Dst::recorded(j, ds) is the
//     record's second value, Dst::store_src_state(args, edge * heads + h, j, t) (after add_grads of
//     edge j) writes whatever else the src pass needs of edge j, kRecordsBatch<T, NV> is that pass's
//     batch, and SrcFromRecords (load takes the BackwardArgs; no score or value_dot) reads it.
// Every pass computes a score with the same operations in the same order and the same team shape,
// so the backward's alpha = exp(score - lse) is the forward's softmax.

// What a pass loads of a batch's edges, and in which order (the order is the register
// allocator's: each pass keeps the one it was tuned with). kScores: the score's rows alone (the
// alpha pass); kScoresThenValues: the score's rows of every edge, then the values' (the forward);
// kEdgeByEdge: each edge's rows together (the dst pass).
enum class RowLoads { kScores, kScoresThenValues, kEdgeByEdge };

// Blocks per SM the passes are built for: 3 (80 registers a thread), 2 (128) for heavy scores or 8
// vectors a lane, 1 for double. Edges in flight per team: each lane loads the rows of this many
// edges before it adds any (the gather is latency-bound): 4 for float, 3 for half types at 3 blocks
// per SM, 2 for double, fewer for more vectors a lane. Heavy scores on half types: 2 in the forward,
// 4 in the backward passes (at 2 blocks a SM; with 2 they held too few bytes in flight: DRAM 25-42%
// busy at products size), unless the policy says otherwise (kForwardLight, kDstLight: GATv2 takes 3
// at 3 blocks a SM where its rows are one vector a lane).
template <typename T, int NV, bool kHeavy>
constexpr int kBlocksPerSM = sizeof(T) == 8 ? 1 : kHeavy || NV == 8 ? 2 : 3;
template <typename T, int NV, bool kHeavy, bool kBackward = false>
constexpr int kEdgeBatch =
    std::max(1, (std::is_same_v<T, float> ? 4 : sizeof(T) == 8 ? 2 : kHeavy ? (kBackward ? 4 : 2) : 3) / NV);

// A pass's blocks a SM: kBlocksPerSM's, or 4 (64 registers) for a pass at the light budget whose
// policy fits it there without spills (kFourBlocks<T, NV, kEdge>): a quarter more teams in flight,
// for passes bound by latency rather than bytes (GAT's scalar scores on mini-batches).
template <class Score, typename T, int NV, bool kEdge, bool kHeavyPass>
constexpr int kPassBlocksPerSM = !kHeavyPass && kBlocksPerSM<T, NV, false> == 3 &&
                                         Score::template kFourBlocks<T, NV, kEdge>
                                     ? 4
                                     : kBlocksPerSM<T, NV, kHeavyPass>;

// The forward's, and the dst pass's: the light budget where a heavy policy's kForwardLight,
// kDstLight says its batch there fits it.
template <class Score, typename T, int NV, bool kEdge>
constexpr int kScoreBlocksPerSM =
    kPassBlocksPerSM<Score, T, NV, kEdge,
                     Score::template kHeavy<kEdge> && !Score::template kForwardLight<T, NV, kEdge>>;
template <class Score, typename T, int NV, bool kEdge>
constexpr int kDstBlocksPerSM =
    kPassBlocksPerSM<Score, T, NV, kEdge, Score::template kHeavy<kEdge> && !Score::template kDstLight<T, NV, kEdge>>;
// A src pass from records holds no score rows: the light budget. One that recomputes the scores
// keeps the policy's own (and never four blocks: it holds more).
template <class Score, typename T, int NV, bool kEdge, bool kRecords>
constexpr int kSrcBlocksPerSM =
    kRecords ? kPassBlocksPerSM<Score, T, NV, kEdge, false> : kBlocksPerSM<T, NV, Score::template kHeavy<kEdge>>;

// The src pass's side of a policy and its batch: Src, or SrcFromRecords when it reads the dst
// pass's records.
template <class Score, bool kRecords>
struct SrcSide {
  template <typename T, int NV, bool kEdge>
  static constexpr int kBatch = Score::template kSrcBatch<T, NV, kEdge>;
  template <typename T, int VEC, int NV, bool kEdge, int B>
  using type = typename Score::template Src<T, VEC, NV, kEdge, B>;
};
template <class Score>
struct SrcSide<Score, true> {
  template <typename T, int NV, bool>
  static constexpr int kBatch = Score::template kRecordsBatch<T, NV>;
  template <typename T, int VEC, int NV, bool kEdge, int B>
  using type = typename Score::template SrcFromRecords<T, VEC, NV, kEdge, B>;
};

// One team of lanes per (destination, head) unit (for_each_unit) walks the destination's edges with
// an online softmax; no per-edge row ever reaches memory. The softmax state (m, l) is the same bits
// on every lane (Team::sum), so branches on it are uniform. An edge whose source is out of range
// makes its destination NaN, and so does a destination whose edges all score -inf, or a score of
// NaN or +inf. A whole row writes its output and lse; a chunk of a long row writes its unnormalised
// output and (m, l) to its slot. The alpha pass (after out and lse are final) recomputes each score
// and writes alpha; edges whose destination is out of range lie past offsets[num_dst]: NaN.
template <class Score, typename T, int VEC, int NV, bool kEdge>
__global__ void __launch_bounds__(kBlockThreads, kScoreBlocksPerSM<Score, T, NV, kEdge>)
attention_forward_kernel(typename Score::ForwardArgs a, int group, bool alpha_pass) {
  using A = accum_t<T>;
  constexpr int B = Score::template kForwardBatch<T, NV, kEdge>;
  const auto& in = a.in;
  const Team t(group);
  const int vvec = static_cast<int>(Score::dim_v(in) / VEC);
  const int64_t num_dst = Score::num_dst(in), num_src = Score::num_src(in), heads = in.heads;
  const A inf = static_cast<A>(INFINITY), nan = static_cast<A>(NAN);
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  T* out = static_cast<T*>(a.out);
  A* lse_out = static_cast<A*>(a.lse);
  T* alpha = static_cast<T*>(a.alpha);
  typename Score::template Dst<T, VEC, NV, kEdge, B> side(in);
  int64_t h = 0;

  if (alpha_pass) {
    for_each_unit(a.dst, a.dst_chunks, num_dst, heads, in.num_edges, t, thread / group, threads / group,
                  [&](const WorkUnit& w) {
      if (w.begin == w.end) return;  // no edges, no weights
      h = w.head;
      side.begin(in, t, w.row, h);
      const A lse = lse_out[int64_t{w.row} * heads + h];
      walk_edges<B>(
          a.dst, in.num_edges, num_src, t, w.row, w.begin, w.end,
          [&](const GroupedEdge (&e)[B]) { side.template load<RowLoads::kScores>(in, t, e, h); },
          [&](const GroupedEdge (&e)[B], int64_t i) {
            A s[B];
            batch_scores<Score>(side, t, e, nan, s);
#pragma unroll
            for (int j = 0; j < B; ++j) {
              if (i + j < w.end && t.lane == (j & (group - 1)) && e[j].edge >= 0) {
                alpha[e[j].edge * heads + h] = from_accum<T>(w.bad ? nan : accurate_exp(s[j] - lse));
              }
            }
          });
    });
    if (a.dst.order == nullptr) return;  // edges given grouped lie in some destination's range
    const int64_t tail = clamp_position(a.dst.offsets[num_dst], in.num_edges);
    for (int64_t x = thread; x < (in.num_edges - tail) * heads; x += threads) {
      const int64_t e = a.dst.order[tail + x / heads];
      if (in_range(e, in.num_edges)) alpha[e * heads + x % heads] = from_accum<T>(nan);
    }
    return;
  }

  // This pass records the dropout (seed, offset) for the backward (the alpha pass draws no mask).
  const uint64_t key = unpack_dropout_key(in.dropout.rng);
  for_each_unit(a.dst, a.dst_chunks, num_dst, heads, in.num_edges, t, thread / group, threads / group,
                [&](const WorkUnit& w) {
    h = w.head;
    if (w.begin < w.end) side.begin(in, t, w.row, h);  // a row without edges reads no row
    LaneRow<T, VEC, NV> acc;
    acc.zero();
    A m = -inf, l = 0;
    bool bad = w.bad;
    walk_edges<B>(
        a.dst, in.num_edges, num_src, t, w.row, w.begin, w.end,
        [&](const GroupedEdge (&e)[B]) { side.template load<RowLoads::kScoresThenValues>(in, t, e, h); },
        [&](const GroupedEdge (&e)[B], int64_t i) {
          A s[B];
          batch_scores<Score>(side, t, e, nan, s);
          A m_new = m;
#pragma unroll
          for (int j = 0; j < B; ++j) {
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
            side.add_value(acc, p * keep_weight<A>(in.dropout, key, e[j].edge, h, heads), j, t);
          }
        });
    // A score of +inf makes l NaN (inf - inf), in a chunk as in a whole row.
    if (!(l == l)) bad = true;
    const int64_t unit = int64_t{w.row} * heads + h;
    const int64_t dim_v = Score::dim_v(in);
    if (w.slot >= 0) {  // a chunk of a long row: its partial result
      const int64_t part = int64_t{w.slot} * heads + h;
      store_partial(static_cast<A*>(a.part_acc) + part * dim_v, t, vvec, acc);
      if (t.lane == 0) {
        static_cast<A*>(a.part_ml)[2 * part] = bad ? nan : m;
        static_cast<A*>(a.part_ml)[2 * part + 1] = l;
      }
      return;
    }
    // A destination with edges that all score -inf has no softmax: NaN, as in PyTorch.
    if (w.end > w.begin && !(l > 0)) bad = true;
    T* out_row = out + unit * dim_v;
    const T* plus = a.residual.data != nullptr ? row_head<T>(a.residual, w.row, h) : nullptr;
    if (bad) {
      store_row_plus(out_row, t, vvec, nan, acc, plus);
    } else if (l > 0) {
      store_row_plus(out_row, t, vvec, A(1) / l, acc, plus);
    } else if (plus != nullptr) {
      store_row_plus(out_row, t, vvec, A(0), acc, plus);  // acc is zero: the residual alone
    } else {
      store_zero_row<T, VEC, NV>(out_row, t, vvec);
    }
    if (t.lane == 0) lse_out[unit] = bad ? nan : l > 0 ? m + accurate_log(l) : -inf;
  });
}

// A packed residual's gradient: grad_out (contiguous) copied into its side, grad_pack rows of heads x
// dim_v apart (BackwardArgs::residual_grad; null: none), every row, in 16-byte pieces where the
// pass's rows move as vectors (VEC > 1). By the dst pass's threads before their units: inside the
// units, with the row held through the walk, the half types' pass spilled more.
template <typename T, int VEC, typename Args>
__device__ __forceinline__ void copy_residual_grad(const Args& a, int64_t num_dst, int64_t thread, int64_t threads) {
  static_assert(VEC == 1 || VEC * sizeof(T) == 16, "a vector is 16 bytes");
  using Piece = std::conditional_t<VEC == 1, T, uint4>;
  if (a.residual_grad == nullptr) return;
  const int64_t width = a.in.heads * a.in.dim_v / VEC;  // pieces a row
  const Piece* from = static_cast<const Piece*>(a.grad_out.data);
  Piece* to = static_cast<Piece*>(a.residual_grad);
  for (int64_t x = thread; x < num_dst * width; x += threads) to[x + x / width * (a.grad_pack - 1) * width] = from[x];
}

// The backward's destination pass, by recomputation from lse: a team per (n, h) unit writes delta =
// <grad_out, out>, the destination's own gradients and each edge's gradient (the score's), without
// atomics. Per edge: ds = alpha * (<grad_out, value> * w - delta), w = keep / (1 - p)
// (keep_weight), alpha' = alpha * w. An edge whose alpha is exactly 0 (a -inf score) or whose
// source is out of range adds nothing, and its edge gradient is zero. A chunk of a long row writes
// its partial gradients to its slot.
template <class Score, typename T, int VEC, int NV, bool kEdge>
__global__ void __launch_bounds__(kBlockThreads, kDstBlocksPerSM<Score, T, NV, kEdge>)
attention_backward_dst_kernel(typename Score::BackwardArgs a, int group) {
  using A = accum_t<T>;
  constexpr int B = Score::template kDstBatch<T, NV, kEdge>;
  using Dst = typename Score::template Dst<T, VEC, NV, kEdge, B>;
  const auto& in = a.in;
  const Team t(group);
  const int vvec = static_cast<int>(Score::dim_v(in) / VEC);
  const int64_t num_dst = Score::num_dst(in), num_src = Score::num_src(in), heads = in.heads;
  const int64_t edge_width = Dst::edge_grad_width(in);
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const A* lse_in = static_cast<const A*>(a.lse);
  A* delta_out = static_cast<A*>(a.delta);
  T* edge_grads = Dst::edge_grads(a);
  EdgeRecord<A>* records = nullptr;
  if constexpr (Score::kSrcFromRecords) records = Score::template records<A>(a);
  const uint64_t key = unpack_dropout_key(in.dropout.rng);  // the pair the forward recorded

  if constexpr (Score::kResidualGrad) copy_residual_grad<T, VEC>(a, num_dst, thread, threads);
  Dst side(in);
  for_each_unit(a.dst, a.dst_chunks, num_dst, heads, in.num_edges, t, thread / group, threads / group,
                [&](const WorkUnit& w) {
    const int64_t n = w.row, h = w.head, unit = n * heads + h;
    LaneRow<T, VEC, NV> dout, out;
    A delta = w.bad ? static_cast<A>(NAN) : A(0);  // a row without edges: out is 0 (NaN if bad)
    if (w.begin < w.end) {
      side.begin(in, t, n, h);
      load_widened(dout, row_head<T>(a.grad_out, n, h), t, vvec);
      load_widened(out, row_head<T>(a.out, n, h), t, vvec);
      A dot = lane_dot(dout, out);
      if (a.residual.data != nullptr) {  // out holds the attention's output plus the residual
        load_widened(out, row_head<T>(a.residual, n, h), t, vvec);
        dot -= lane_dot(dout, out);
      }
      delta = t.sum(dot);
    }
    if (w.lead && t.lane == 0) delta_out[unit] = delta;
    const A lse = lse_in[unit];
    side.zero_grads();
    walk_edges<B>(
        a.dst, in.num_edges, num_src, t, n, w.begin, w.end,
        [&](const GroupedEdge (&e)[B]) { side.template load<RowLoads::kEdgeByEdge>(in, t, e, h); },
        [&](const GroupedEdge (&e)[B], int64_t i) {
          A s[B], dp[B];
          batch_scores<Score>(side, t, e, A(0), s, dp, [&](int j) { return side.value_dot(dout, j, t); });
#pragma unroll
          for (int j = 0; j < B; ++j) {
            if (i + j >= w.end) break;
            T* edge_row = edge_grads != nullptr && e[j].edge >= 0 ? edge_grads + (e[j].edge * heads + h) * edge_width
                                                                  : nullptr;
            const A alpha = accurate_exp(s[j] - lse);
            // The src pass visits an edge only where both its rows are in range (other >= 0).
            const int64_t edge_head = int64_t{e[j].edge} * heads + h;
            if (e[j].other < 0 || alpha == A(0)) {
              if (edge_row != nullptr) side.zero_edge_grad(edge_row, t);
              if (records != nullptr && e[j].other >= 0 && t.lane == 0) records[edge_head] = {A(0), A(0)};
              continue;
            }
            const A keep = keep_weight<A>(in.dropout, key, e[j].edge, h, heads);
            const A ds = alpha * (dp[j] * keep - delta);
            side.add_grads(j, ds, alpha * keep, dout, edge_row, t);
            if constexpr (Score::kSrcFromRecords) {
              if (records != nullptr) {
                if (t.lane == 0) records[edge_head] = {alpha, side.recorded(j, ds)};
                side.store_src_state(a, edge_head, j, t);
              }
            }
          }
        });
    side.store_grads(a, w, unit, t);
  });
  if constexpr (Score::kTeamGrads) side.store_team_grads(a, thread / group, t);

  if (edge_grads == nullptr || a.dst.order == nullptr) return;  // edges given grouped all lie in some row
  // Edges whose destination is out of range (only without index checks) add nothing.
  const int64_t tail = clamp_position(a.dst.offsets[num_dst], in.num_edges);
  const int64_t row_elems = heads * edge_width;
  for (int64_t x = thread; x < (in.num_edges - tail) * row_elems; x += threads) {
    const int64_t e = a.dst.order[tail + x / row_elems];
    if (in_range(e, in.num_edges)) edge_grads[e * row_elems + x % row_elems] = from_accum<T>(A(0));
  }
}

// The backward's source pass, reading the dst pass's delta: a team per (s, h) unit walks the
// source's outgoing edges, each destination's grad_out row, lse and delta in flight, and writes the
// source's gradients without atomics. A chunk of a long row writes its partial gradients to its slot.
// With kRecords (a policy with kSrcFromRecords, whose records fitted in memory) it reads each
// edge's alpha and ds (and the policy's own per-edge state) from the dst pass instead: grad_out
// rows and records in flight, no score recomputed.
template <class Score, typename T, int VEC, int NV, bool kEdge, bool kRecords>
__global__ void __launch_bounds__(kBlockThreads, kSrcBlocksPerSM<Score, T, NV, kEdge, kRecords>)
attention_backward_src_kernel(typename Score::BackwardArgs a, int group) {
  using A = accum_t<T>;
  constexpr int B = SrcSide<Score, kRecords>::template kBatch<T, NV, kEdge>;
  using Src = typename SrcSide<Score, kRecords>::template type<T, VEC, NV, kEdge, B>;
  const auto& in = a.in;
  const Team t(group);
  const int vvec = static_cast<int>(Score::dim_v(in) / VEC);
  const int64_t num_dst = Score::num_dst(in), num_src = Score::num_src(in), heads = in.heads;
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const uint64_t key = unpack_dropout_key(in.dropout.rng);  // the pair the forward recorded

  for_each_unit(a.src, a.src_chunks, num_src, heads, in.num_edges, t, thread / group, threads / group,
                [&](const WorkUnit& w) {
    const int64_t s = w.row, h = w.head, unit = s * heads + h;
    Src side(in);
    if (w.begin < w.end) side.begin(in, t, s, h);  // a source without edges: zero gradients
    side.zero_grads();
    RawRow<T, VEC, NV> gr[B];
    if constexpr (kRecords) {
      const EdgeRecord<A>* records = Score::template records<A>(a);
      EdgeRecord<A> rec[B];
      walk_edges<B>(
          a.src, in.num_edges, num_dst, t, s, w.begin, w.end,
          [&](const GroupedEdge (&e)[B]) {
            side.load(a, t, e, h);
#pragma unroll
            for (int j = 0; j < B; ++j) {
              const bool ok = e[j].other >= 0;
              gr[j].load(ok ? row_head<T>(a.grad_out, e[j].other, h) : nullptr, t, vvec);
              rec[j] = ok ? load_record(records + int64_t{e[j].edge} * heads + h) : EdgeRecord<A>{A(0), A(0)};
            }
          },
          [&](const GroupedEdge (&e)[B], int64_t) {
#pragma unroll
            for (int j = 0; j < B; ++j) {
              if (e[j].other < 0 || rec[j].alpha == A(0)) continue;  // as the recomputing pass skips
              const A keep = keep_weight<A>(in.dropout, key, e[j].edge, h, heads);
              side.add_grads(j, rec[j].ds, rec[j].alpha * keep, gr[j], t);
            }
          });
    } else {
      const A* lse_in = static_cast<const A*>(a.lse);
      const A* delta_in = static_cast<const A*>(a.delta);
      A lse[B], delta[B];
      walk_edges<B>(
          a.src, in.num_edges, num_dst, t, s, w.begin, w.end,
          [&](const GroupedEdge (&e)[B]) {
            side.load(in, t, e, h);
#pragma unroll
            for (int j = 0; j < B; ++j) {
              const bool ok = e[j].other >= 0;
              const int64_t n = e[j].other;
              gr[j].load(ok ? row_head<T>(a.grad_out, n, h) : nullptr, t, vvec);
              lse[j] = ok ? __ldg(lse_in + n * heads + h) : A(0);
              delta[j] = ok ? __ldg(delta_in + n * heads + h) : A(0);
            }
          },
          [&](const GroupedEdge (&e)[B], int64_t) {
            A s[B], dp[B];
            batch_scores<Score>(side, t, e, A(0), s, dp, [&](int j) { return side.value_dot(gr[j], j, t); });
#pragma unroll
            for (int j = 0; j < B; ++j) {
              if (e[j].other < 0) continue;  // past the end, or an out-of-range destination: adds nothing
              const A alpha = accurate_exp(s[j] - lse[j]);
              if (alpha == A(0)) continue;  // a -inf score adds nothing
              const A keep = keep_weight<A>(in.dropout, key, e[j].edge, h, heads);
              side.add_grads(j, alpha * (dp[j] * keep - delta[j]), alpha * keep, gr[j], t);
            }
          });
    }
    side.store_grads(a, w, unit, t);
  });
}

// Calls f(VEC, NV, kEdge as integral constants, group) for the inputs' team shape.
template <class Score, typename T, typename F>
inline void dispatch_score(const typename Score::Inputs& in, bool vectorized, F&& f) {
  const int vec = vectorized ? wide_vec<T>() : 1;
  const TeamShape shape = attention_team(Score::team_dim(in) / vec);
  auto call = [&](auto v, auto nv, auto edge) { f(v, nv, edge, shape.group); };
  if (vectorized) {
    dispatch_per_lane<wide_vec<T>(), 1>(shape.per_lane, Score::has_edge(in), call);
  } else {
    dispatch_per_lane<1, 1>(shape.per_lane, Score::has_edge(in), call);
  }
}

// out, lse (and alpha) of a score's attention over the dst grouping; every element written.
template <class Score>
void launch_forward(const typename Score::ForwardArgs& a, ScalarKind scalar, cudaStream_t stream) {
  dispatch_scalar(scalar, [&](auto zero) {
    using T = decltype(zero);
    using A = accum_t<T>;
    const auto& in = a.in;
    dispatch_score<Score, T>(in, Score::template vectorizable<T>(a), [&](auto v, auto nv, auto edge, int group) {
      auto kernel = attention_forward_kernel<Score, T, decltype(v)::value, decltype(nv)::value, decltype(edge)::value>;
      auto run = [&](bool alpha_pass) {
        int64_t threads = (Score::num_dst(in) + a.dst_chunks.max_slots) * in.heads * group +
                          (alpha_pass ? in.num_edges : 0);
        // Without rows the main pass still runs a thread when it must record the dropout state.
        if (threads == 0 && (alpha_pass || in.dropout.rng.record == nullptr)) return;
        threads = std::max<int64_t>(threads, 1);
        kernel<<<grid_blocks(kernel, threads), kBlockThreads, 0, stream>>>(a, group, alpha_pass);
      };
      run(false);
      if (a.dst_chunks.first_chunk != nullptr) {
        launch_merge_softmax<T>(a.dst_chunks, in.heads, Score::dim_v(in), static_cast<const A*>(a.part_acc),
                                static_cast<const A*>(a.part_ml), static_cast<T*>(a.out), static_cast<A*>(a.lse),
                                a.residual, stream);
      }
      if (a.alpha != nullptr) run(true);
    });
  });
}

// Calls f(kernel, blocks, group) with the dst pass's kernel for the inputs and its grid, if it has
// work. The grid fills every SM (grid_blocks); for a policy with team sums (kTeamGrads) its team
// count is a multiple of heads, so that a team serves one head in all its units (for_each_unit
// strides by the team count).
template <class Score, typename T, typename F>
void with_backward_dst(const typename Score::BackwardArgs& a, F&& f) {
  const auto& in = a.in;
  dispatch_score<Score, T>(in, Score::template vectorizable<T>(a), [&](auto v, auto nv, auto edge, int group) {
    auto kernel =
        attention_backward_dst_kernel<Score, T, decltype(v)::value, decltype(nv)::value, decltype(edge)::value>;
    const int64_t threads = (Score::num_dst(in) + a.dst_chunks.max_slots) * in.heads * group +
                            (Score::edge_grads_wanted(a) ? in.num_edges : 0);
    if (threads == 0) return;
    int64_t blocks = grid_blocks(kernel, threads);
    if constexpr (Score::kTeamGrads) {
      const int64_t step = in.heads / std::gcd(in.heads, int64_t{kBlockThreads / group});
      blocks = std::max(step, blocks - blocks % step);
    }
    f(kernel, static_cast<int>(blocks), group);
  });
}

// The dst pass (delta, the destinations' and the edges' gradients); its merges come with the src
// pass's (launch_backward_merges).
template <class Score>
void launch_backward_dst(const typename Score::BackwardArgs& a, ScalarKind scalar, cudaStream_t stream) {
  dispatch_scalar(scalar, [&](auto zero) {
    with_backward_dst<Score, decltype(zero)>(a, [&](auto kernel, int blocks, int group) {
      kernel<<<blocks, kBlockThreads, 0, stream>>>(a, group);
    });
  });
}

// Teams of the dst pass (0 without work), with every other field of args set: the rows of a
// kTeamGrads policy's team sums.
template <class Score>
int64_t backward_dst_teams(const typename Score::BackwardArgs& a, ScalarKind scalar) {
  int64_t teams = 0;
  dispatch_scalar(scalar, [&](auto zero) {
    with_backward_dst<Score, decltype(zero)>(
        a, [&](auto, int blocks, int group) { teams = int64_t{blocks} * (kBlockThreads / group); });
  });
  return teams;
}

// Bytes of what the dst pass hands a kSrcFromRecords src pass (records, then the policy's
// src_state_width bytes per (edge, head) at the pass's vector width); 0 for other policies.
template <class Score>
int64_t src_state_bytes(const typename Score::BackwardArgs& a, ScalarKind scalar) {
  int64_t bytes = 0;
  if constexpr (Score::kSrcFromRecords) {
    dispatch_scalar(scalar, [&](auto zero) {
      using T = decltype(zero);
      const int vec = Score::template vectorizable<T>(a) ? wide_vec<T>() : 1;
      bytes = a.in.num_edges * a.in.heads *
              (static_cast<int64_t>(sizeof(EdgeRecord<accum_t<T>>)) + Score::src_state_width(a.in, vec));
    });
  }
  return bytes;
}

// The src pass (the sources' gradients, reading delta); its merges: launch_backward_merges.
template <class Score>
void launch_backward_src(const typename Score::BackwardArgs& a, ScalarKind scalar, cudaStream_t stream) {
  dispatch_scalar(scalar, [&](auto zero) {
    using T = decltype(zero);
    const auto& in = a.in;
    dispatch_score<Score, T>(in, Score::template vectorizable<T>(a), [&](auto v, auto nv, auto edge, int group) {
      const int64_t threads = (Score::num_src(in) + a.src_chunks.max_slots) * in.heads * group;
      if (threads == 0) return;
      auto run = [&](auto has_edge, auto records) {
        auto kernel = attention_backward_src_kernel<Score, T, decltype(v)::value, decltype(nv)::value,
                                                    decltype(has_edge)::value, decltype(records)::value>;
        kernel<<<grid_blocks(kernel, threads), kBlockThreads, 0, stream>>>(a, group);
      };
      bool records = false;
      if constexpr (Score::kSrcFromRecords) records = Score::template records<accum_t<T>>(a) != nullptr;
      if (records) {
        // The records stand for the edges' features: the pass reads none (and holds the batch of
        // a graph without them).
        if constexpr (Score::kSrcFromRecords) run(std::false_type{}, std::true_type{});
      } else {
        run(edge, std::false_type{});
      }
    });
  });
}

// The merges of both passes' long rows in one launch, after the passes (the src pass's only where it
// ran: src_chunks is empty without it).
template <class Score>
void launch_backward_merges(const typename Score::BackwardArgs& a, ScalarKind scalar, cudaStream_t stream) {
  dispatch_scalar(scalar, [&](auto zero) {
    using T = decltype(zero);
    MergeList<T> merges{};
    if (a.dst_chunks.first_chunk != nullptr) Score::template dst_merges<T>(a, merges);
    if (a.src_chunks.first_chunk != nullptr) Score::template src_merges<T>(a, merges);
    if (merges.count > 0) launch_merge_sums<T>(merges, a.in.heads, stream);
  });
}


}  // namespace edgedot
