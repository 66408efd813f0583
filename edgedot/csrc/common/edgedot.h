// Plain C++ interface between the PyTorch bindings and the CUDA kernels (no torch types).
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace edgedot {

enum class ScalarKind { f32, f64, f16, bf16 };
enum class IndexKind { i32, i64 };

// A feature tensor [num_rows, heads, dim] with unit stride along dim.
struct Rows {
  const void* data;
  int64_t num_rows;
  int64_t row_stride;   // elements between consecutive nodes
  int64_t head_stride;  // elements between consecutive heads; 0 broadcasts one head to all
};

struct ForwardArgs {
  Rows src, dst;
  const void* src_idx;
  const void* dst_idx;
  void* out;             // [num_edges, heads], contiguous
  int64_t num_edges, heads, dim;
  int* error_flag;       // [2]: set to 1 when src_idx / dst_idx holds an out-of-range index; may be null
};

// Edges in the order to visit them (launch_edge_order), used only if *used != 0.
struct EdgeOrder {
  const int32_t* order;
  const int* used;
};

// Gradient of one side ("rows") given the other side's features. The row side's gradient is
// [num_rows, row_heads, dim]; row_heads is heads, or 1 when that side broadcast its one head.
struct GradArgs {
  const void* grad_out;  // [num_edges, heads], contiguous
  Rows other;
  const void* row_idx;
  const void* other_idx;
  int64_t num_rows, row_heads, num_edges, heads, dim;
};

// One side of an EdgePlan (edgedot.runtime.plan.build_side): sorted position i holds edge order[i];
// row_other[i] has its row in the high 32 bits (num_rows when out of range) and its other row in
// the low 32 bits (-1 when out of range).
struct PlanSide {
  const int64_t* order;
  const uint64_t* row_other;
};

// out[e, h] = <src[src_idx[e], h], dst[dst_idx[e], h]>; out-of-range edges yield NaN.
// With an order (order.order not null), the edges are visited in that order when *order.used != 0.
// round_products (half types, no order): each product is rounded to the feature type before it is
// added (in float), as PyTorch's `(src * dst).sum(-1)` does; the seed problem's contract
// (kernelbench/csrc/kernelbench.cpp).
void launch_forward(const ForwardArgs& args, const EdgeOrder& order, ScalarKind scalar, IndexKind src_index,
                    IndexKind dst_index, cudaStream_t stream, bool round_products = false);

// grad[row_idx[e], h] += grad_out[e, h] * other[other_idx[e], h], with atomics into a zeroed
// buffer of the accumulation type: float for half types, double for float32 with double_accum,
// else the scalar type itself.
void launch_grad_atomic(const GradArgs& args, void* grad_acc, ScalarKind scalar, bool double_accum,
                        IndexKind row_index, IndexKind other_index, cudaStream_t stream);

// The same gradient over edges sorted by row (row_idx non-decreasing; out-of-range rows are
// skipped), without atomics: each run of a row is summed in registers and written to grad (scalar
// type, zeroed beforehand for rows without edges); runs cut by chunk boundaries go through
// workspace (sorted_workspace_slots slots of the accumulation type) and are summed in chunk order,
// so the result is bitwise reproducible. sorted_chunk_edges sizes the chunks.
int64_t sorted_chunk_edges(const GradArgs& args, ScalarKind scalar);
int64_t sorted_workspace_slots(const GradArgs& args, int64_t chunk_edges);
// With pairs (launch_sort_packed_by_row), each edge's other row and gradient come from them:
// args.other_idx and args.grad_out are not read.
void launch_grad_sorted(const GradArgs& args, const uint64_t* pairs, void* grad, void* workspace,
                        int64_t chunk_edges, ScalarKind scalar, IndexKind row_index, IndexKind other_index,
                        cudaStream_t stream);
// The same reduction over a plan side's sorted edges, each edge's gradient gathered from
// args.grad_out through plan.order: args.row_idx and args.other_idx are not read.
void launch_grad_planned(const GradArgs& args, const PlanSide& plan, void* grad, void* workspace,
                         int64_t chunk_edges, ScalarKind scalar, cudaStream_t stream);

// Edges sorted by row (csrc/common/sort_by_row.cu), for num_edges and num_rows below 2**31:
// keys and positions hold 2 * num_keys entries each (two buffers of num_keys); temp holds
// sort_by_row_temp_bytes(num_keys, key_rows) bytes. num_keys is num_edges, key_rows num_rows; with
// second_idx (rows among num_second_rows on a second side, say the sources), num_keys is
// 2 * num_edges and key_rows num_rows + 1 + num_second_rows (below 2**31): the second side's
// entries sort after the first's, so that one sort groups the edges by both. Returns which buffer
// (0 or 1) holds the sorted keys (row_idx, with out-of-range rows as num_rows; second-side keys
// offset by num_rows + 1) and the positions of their edges, or -1 if CUB failed.
size_t sort_by_row_temp_bytes(int64_t num_keys, int64_t key_rows, bool packed);
int launch_sort_by_row(const void* row_idx, IndexKind row_index, int64_t num_edges, int64_t num_rows, int32_t* keys,
                       int32_t* positions, void* temp, size_t temp_bytes, cudaStream_t stream,
                       const void* second_idx = nullptr, IndexKind second_index = IndexKind::i32,
                       int64_t num_second_rows = 0);

// One side's grouping (edgedot.runtime.plan.build_side and its group_offsets), written by
// launch_group_edges: order [E], row_other [E] and offsets [num_rows + 1].
struct GroupSide {
  const void* other_idx;  // the other end of each edge
  IndexKind other_index;
  int64_t num_rows, num_other;
  int64_t* order;
  uint64_t* row_other;
  int64_t* offsets;
};

// Where a grouping reports the first side's indices out of range, as a graph check's flags do
// (set to 1, never cleared); a null pointer reports nothing. The grouping reads every index of
// both ends anyway, so a new graph's range check needs no launch of its own.
struct RangeFlags {
  int* row_out = nullptr;    // some row_idx[i] outside [0, num_rows)
  int* other_out = nullptr;  // some other_idx[i] outside [0, num_other)
};

// The groupings (csrc/common/group_edges.cu) from the sorted keys and positions of
// launch_sort_by_row (its num_keys entries each, the buffer it returned; unread when num_edges is
// 0), for one side or, with second (not null), two: order[i] = positions[i], row_other[i] = row
// << 32 | other row (-1 when other_idx[positions[i]] lies outside [0, num_other)), and offsets the
// first sorted position whose row is >= r. num_edges below 2**31 - 1, rows at most 2**31 - 1.
void launch_group_edges(const int32_t* keys, const int32_t* positions, int64_t num_edges, const GroupSide& first,
                        const GroupSide* second, RangeFlags range_flags, cudaStream_t stream);

// launch_sort_by_row and launch_group_edges in one cooperative launch (csrc/common/
// group_edges_cooperative.cu), for batches whose keys (num_keys: num_edges, or 2 * num_edges for
// both sides) a wave of blocks sorts at once. cooperative_grouping_tiles: the tiles of keys it
// sorts them in (one block each), or 0 where the batch does not fit (or the device takes no
// cooperative launch); scratch holds cooperative_grouping_ints(num_keys, tiles, first, second,
// row_index) ints, for the same sides as the launch. The second side's keys come from
// first.other_idx, as launch_sort_by_row's second_idx. Returns false where the launch could not
// start (the groupings are then unwritten; the two launches above serve).
int cooperative_grouping_tiles(int64_t num_keys, IndexKind row_index, IndexKind other_index);
int64_t cooperative_grouping_ints(int64_t num_keys, int tiles, const GroupSide& first, const GroupSide* second,
                                  IndexKind row_index);
bool launch_group_edges_cooperative(const void* row_idx, IndexKind row_index, int64_t num_edges, int tiles,
                                    int32_t* scratch, const GroupSide& first, const GroupSide* second,
                                    RangeFlags range_flags, cudaStream_t stream);

// A sorted edge in 64 bits: its other row in the low half (-1 when out of range), the bits of its
// heads x grad_out values (at most 4 bytes, head 0 lowest) in the high half.
__host__ __device__ inline uint64_t pack_edge(int32_t other, uint32_t grad_bits) {
  return static_cast<uint64_t>(grad_bits) << 32 | static_cast<uint32_t>(other);
}

// The same sort for the edges of args (other.num_rows below 2**31 too, heads x grad_bytes at
// most 4), carrying pack_edge pairs instead of positions: pairs holds 2 * num_edges entries, temp
// sort_by_row_temp_bytes(..., packed = true) bytes.
int launch_sort_packed_by_row(const GradArgs& args, IndexKind row_index, IndexKind other_index, int grad_bytes,
                              int32_t* keys, uint64_t* pairs, void* temp, size_t temp_bytes, cudaStream_t stream);

// Visit order for the forward (csrc/common/edge_order.cu), for 2 <= num_edges < 2**31: order
// (num_edges ints) receives the edges grouped by buckets of 2**shift rows of row_idx, at most
// kMaxOrderBuckets buckets, out-of-range rows in the last one; workspace holds
// edge_order_workspace_ints ints, its first the used flag: 0 when a sample of adjacent edges
// found row_idx or other_idx mostly non-decreasing, in which case order is left unwritten.
inline constexpr int kMaxOrderBuckets = 1024;
int64_t edge_order_workspace_ints(int buckets);
void launch_edge_order(const void* row_idx, IndexKind row_index, const void* other_idx, IndexKind other_index,
                       int64_t num_edges, int64_t num_rows, int shift, int32_t* order, int* workspace,
                       cudaStream_t stream);

// Index tensors held in a floating-point dtype (KernelBench casts every input to its precision),
// truncated toward zero like Tensor.long(): out[i] from src_idx, out[num_edges + i] from dst_idx,
// either pointer null to skip that half. A value that is not finite or lies outside int32 becomes
// -1, which every kernel treats as out of range. One launch (kernelbench/csrc/index_cast.cu).
void launch_cast_indices(const void* src_idx, const void* dst_idx, ScalarKind kind, int64_t num_edges, int32_t* out,
                         cudaStream_t stream);

// The conditions edgedot/runtime/checks.py:check_graph asks of a graph, one device flag each (ints set to
// 1 when the condition fails, never cleared: the caller zeroes them).
enum GraphCheckFlag : int {
  kSrcOutOfRange,  // some src_idx[i] outside [0, num_src) (with check_src)
  kDstOutOfRange,  // some dst_idx[i] outside [0, num_dst) (with check_dst)
  kPtrEndsWrong,   // dst_ptr[0] != 0 or dst_ptr[num_dst] != num_edges
  kPtrDecreases,   // dst_ptr[r + 1] < dst_ptr[r] for some r
  kPtrDisagrees,   // edge i outside [dst_ptr[d], dst_ptr[d + 1]) of its destination d = dst_idx[i]
  kGraphCheckFlags
};

struct GraphCheckArgs {
  const void* src_idx;  // [num_edges], element stride src_stride
  const void* dst_idx;  // [num_edges], element stride dst_stride
  const void* dst_ptr;  // [num_dst + 1], element stride ptr_stride; null: no pointer to check
  int64_t src_stride, dst_stride, ptr_stride;
  int64_t num_edges, num_src, num_dst;
  bool check_src, check_dst;
  int* flags;  // [kGraphCheckFlags] device ints, zeroed
};

// One kernel over the edges and the pointer (csrc/common/check_graph.cu).
void launch_check_graph(const GraphCheckArgs& args, IndexKind src_index, IndexKind dst_index, IndexKind ptr_index,
                        cudaStream_t stream);

// The layers' self-loop handling of a [2, E] edge index (csrc/common/self_loops.cu): out_src and
// out_dst [num_edges + num_nodes], the edges (a self-loop's destination replaced by `dropped`), then
// node n's loop at num_edges + n.
struct SelfLoopArgs {
  const void* src;
  const void* dst;
  int64_t src_stride, dst_stride;
  int64_t num_edges, num_nodes, dropped;
  void* out_src;
  void* out_dst;
  // The input's range check, folded in: other_out set when a source lies outside [0, num_src), row_out
  // when a destination lies outside [0, num_dst) (each null: not checked).
  RangeFlags range_flags;
  int64_t num_src, num_dst;
};

void launch_self_looped(const SelfLoopArgs& args, IndexKind index, cudaStream_t stream);

// Bytes of L2 cache of the current device (cached).
int64_t l2_cache_bytes();

// Graph attention (csrc/attention/: engine.cuh, scores.cuh): per edge e from s to n,
// score = scale * <q[n, h], k[s, h] + edge_feat[e, h]>, softmax over each destination's edges,
// out[n, h] = sum of alpha' * (v[s, h] + edge_feat[e, h]); no per-edge rows ever reach memory.

// Widest head (dim and dim_v) the kernels take: 32 lanes of up to 8 elements each.
inline constexpr int64_t kAttentionMaxDim = 256;

// One side of a graph grouped by row (edgedot.runtime.plan.build_side and group_offsets): the edges of row
// r lie at sorted positions offsets[r] .. offsets[r + 1] - 1; position i holds edge order[i], whose
// other row is the low 32 bits of row_other[i] (-1 when out of range). Positions from
// offsets[num_rows] on hold edges whose row is out of range.
// Edges given grouped (a CSR pointer by row): order and row_other are null, position i is edge i,
// its other row other_idx[i] and its row row_idx[i], which must be the row whose range holds i. A
// pointer that is not a partition of [0, num_edges) or a row index that disagrees with it makes
// the rows concerned NaN instead of dropping or misplacing edges.
struct AttentionGrouping {
  const int64_t* order;
  const uint64_t* row_other;
  const int64_t* offsets;  // [num_rows + 1]
  const void* row_idx;     // grouped input only
  const void* other_idx;   // grouped input only
  IndexKind row_index, other_index;
};

// Long rows split into chunks (csrc/attention/schedule.cu): a row of more than `chunk` edges is
// walked as ceil(degree / chunk) chunks by teams of their own, each writing a partial result to
// its slot; a merge kernel then combines each long row's partials in chunk order (no atomics, so
// results stay bitwise reproducible). first_chunk[r] = slots of the long rows before r,
// first_chunk[num_rows] = all slots (at most max_slots); long_rows[0 .. *num_long) lists the long
// rows in ascending order.
// row_order (null: rows in order) lists the rows by descending degree (csrc/attention/schedule.cu),
// in which order the kernels take them after the chunks: the teams of a warp then walk rows of
// similar length, and the longest go first (less idle time at the end).
struct RowChunks {
  int64_t chunk;
  const int64_t* first_chunk;  // [num_rows + 1]
  const int32_t* long_rows;    // [num_rows]
  const int32_t* num_long;     // [1]
  int64_t max_slots;
  const int32_t* row_order;    // [num_rows], or null
};

// The (seed, offset) pair a dropout mask is a hash of (edgedot/runtime/dropout.py, csrc/attention/dropout.cuh), as a
// kernel finds it: the values themselves (seed_ptr null), or device pointers to them, read as
// (*seed_ptr, *offset_ptr + offset_add). The pointers serve a CUDA graph being captured, whose
// replays each read the offset the generator holds then (torch's PhiloxCudaState, mirrored without
// torch types), and a backward, which reads the pair its forward recorded. A forward kernel writes
// the pair it used to record[0], record[1] (int64, device) when record is not null.
struct DropoutRng {
  uint64_t seed, offset;
  const int64_t* seed_ptr;
  const int64_t* offset_ptr;
  uint64_t offset_add;
  int64_t* record;
};

// Dropout without renormalisation: element c of a call is kept when the hash of its (seed, offset)
// and c is at least threshold (floor(p * 2**32), 0 without dropout), and kept terms are scaled by
// keep_scale (1 / (1 - p)). Graph attention and GAT hash c = e * heads + h.
struct Dropout {
  DropoutRng rng;
  uint64_t threshold;
  double keep_scale;
};

// q [num_dst, heads, dim], k [num_src, heads, dim], v [num_src, heads, dim_v], edge_feat
// [num_edges, heads, dim] with row_stride per edge (data null when absent; else dim_v == dim).
// num_dst and num_src are q.num_rows and k.num_rows.
// scale_heads (null for a fixed scale): [heads] in the inputs' type, a learned per-head scale in
// place of scale (AGNN's temperature, CosineScore in csrc/attention/scores.cuh).
struct AttentionInputs {
  Rows q, k, v, edge_feat;
  int64_t num_edges, heads, dim, dim_v;
  double scale;
  Dropout dropout;
  const void* scale_heads;
};

// The accumulation type: double for float64 inputs, float otherwise (lse, delta, partials).
struct AttentionForwardArgs {
  AttentionInputs in;
  AttentionGrouping dst;
  RowChunks dst_chunks;
  void* out;    // [num_dst, heads, dim_v], contiguous, in the inputs' type
  void* lse;    // [num_dst, heads], accumulation type: -inf for rows without edges
  void* alpha;  // [num_edges, heads] in the inputs' type (before dropout), or null
  void* part_acc;  // [max_slots, heads, dim_v] accumulation type: a chunk's unnormalised output
  void* part_ml;   // [max_slots, heads, 2]: its running maximum and sum
  // Output epilogue: added to every row of out as it is stored (rounded once), [num_dst, heads,
  // dim_v] in the inputs' type (row_stride 0: one row for all, a bias); data null: none.
  Rows residual;
};

struct AttentionBackwardArgs {
  AttentionInputs in;
  Rows grad_out, out;  // [num_dst, heads, dim_v]
  const void* lse;     // [num_dst, heads], accumulation type
  AttentionGrouping dst, src;
  RowChunks dst_chunks, src_chunks;
  void* delta;         // [num_dst, heads], accumulation type: <grad_out, out - residual>, by the dst pass
  Rows residual;       // the forward's residual (out holds the attention plus it), or data null
  void* dq;            // [num_dst, heads, dim] (rows grad_pack apart, below), in the inputs' type
  void* dk;            // [num_src, heads, dim]
  void* dv;            // [num_src, heads, dim_v]
  void* d_edge_feat;   // [num_edges, heads, dim], or null
  void* part_dq;       // [dst max_slots, heads, dim], accumulation type
  void* part_dk;       // [src max_slots, heads, dim]
  void* part_dv;       // [src max_slots, heads, dim_v]
  // With scale_heads: [num_dst + dst max_slots, heads], accumulation type, zeroed: per unit (a
  // whole row, or chunk slot at num_dst + slot) the sum of ds * <q, k + edge_feat> over its edges;
  // their sum over rows is the gradient of scale_heads.
  void* d_scale_rows;
  // With a src pass: [num_edges * heads] EdgeRecord (alpha, ds; attention_src_state_bytes), written
  // by the dst pass, read by the src pass; or null (the src pass then recomputes them).
  void* src_state;
  // dq, dk and dv's rows lie grad_pack rows of heads x dim apart: 3 where they are the three sides
  // of one [rows, 3, heads, dim] tensor (packed_sides in attention/attention_ops.cpp), 4 with a
  // packed residual, else 1.
  int32_t grad_pack = 1;
  // A packed residual's gradient (grad_out itself), the fourth side beside dq: the dst pass copies
  // grad_out there, every row; or null. Graph attention's policy only (kResidualGrad).
  void* residual_grad = nullptr;
};

// Edges a chunk of a long row holds, for a grouping of num_edges edges of these heads and head dims
// on the current device: long enough that few rows are split, short enough that no team's walk is
// more than a small part of the whole and a hub spreads over many teams.
int64_t attention_chunk_edges(int64_t num_edges, int64_t heads, int64_t dim, int64_t dim_v, ScalarKind scalar);
// Partial slots a schedule of that chunk may need: long rows of d > chunk edges take
// ceil(d / chunk) < 2 d / chunk slots.
inline int64_t attention_max_slots(int64_t num_edges, int64_t chunk) { return 2 * num_edges / chunk + 1; }
// The schedule of one grouping (first_chunk, long_rows, num_long of RowChunks) from its offsets;
// temp holds attention_schedule_temp_bytes bytes. No host synchronisation. num_rows below 2**31 - 1.
size_t attention_schedule_temp_bytes(int64_t num_rows);
cudaError_t launch_attention_schedule(const int64_t* offsets, int64_t num_rows, int64_t num_edges, int64_t chunk,
                                      int64_t* first_chunk, int32_t* long_rows, int32_t* num_long, void* temp,
                                      size_t temp_bytes, cudaStream_t stream);
// Whether a grouping is worth row_order: graphs of fewer edge-heads run in about the time of the
// launches that would build it.
inline bool attention_orders_rows(int64_t num_edges, int64_t heads) { return num_edges * heads >= (int64_t{1} << 22); }
// row_order of RowChunks: rows sorted by descending degree key (0 for no edges or a long row, else
// the degree up to 239, then 240 + floor(log2(degree))), stably: rows of one key keep their order.
// keys holds 2 * num_rows bytes, rows num_rows int32, temp attention_row_order_temp_bytes(num_rows)
// bytes.
size_t attention_row_order_temp_bytes(int64_t num_rows);
cudaError_t launch_attention_row_order(const int64_t* offsets, int64_t num_rows, int64_t num_edges, int64_t chunk,
                                       uint8_t* keys, int32_t* rows, int32_t* row_order, void* temp,
                                       size_t temp_bytes, cudaStream_t stream);

// out, lse (and alpha) over the dst grouping; every element of them is written. Needs dim and
// dim_v in 1 .. kAttentionMaxDim.
void launch_attention_forward(const AttentionForwardArgs& args, ScalarKind scalar, cudaStream_t stream);
// dq, delta (and d_edge_feat) over the dst grouping; then dk and dv over the src grouping, which
// reads delta; then the merges of both passes' long rows (one launch). Every element of the outputs
// is written: rows without edges as zeros.
void launch_attention_backward_dst(const AttentionBackwardArgs& args, ScalarKind scalar, cudaStream_t stream);
void launch_attention_backward_src(const AttentionBackwardArgs& args, ScalarKind scalar, cudaStream_t stream);
void launch_attention_backward_merges(const AttentionBackwardArgs& args, ScalarKind scalar, cudaStream_t stream);
// Bytes of args.src_state the passes need (0: none), with every other field of args set.
int64_t attention_src_state_bytes(const AttentionBackwardArgs& args, ScalarKind scalar);

// Fused GAT and GATv2 attention (their score policies in csrc/attention/scores.cuh), on the
// engine of graph attention above (groupings, chunk schedules, merges, dropout). Per edge e from s to n and head h:
//   GAT:   score = leaky_relu((a_src[s, h] + a_dst[n, h]) + a_edge[e, h]);
//   GATv2: score = sum over c of att[h, c] * leaky_relu((x[s, h, c] + x_dst[n, h, c]) + edge_feat[e, h, c]);
// softmax over each destination's edges; out[n, h] = sum of alpha' * x[s, h]. No per-edge rows ever
// reach memory. Per-node scalars are Rows of dim 1 (any strides).
struct GatInputs {
  bool v2;          // GATv2 (x_dst, att, edge_feat) or GAT (a_src, a_dst, a_edge)
  Rows x;           // [num_src, heads, dim]: the values (GATv2: x_src, also in the score)
  Rows a_src;       // GAT: [num_src, heads]
  Rows a_dst;       // GAT: [num_dst, heads]
  Rows a_edge;      // GAT: [num_edges, heads], data null when absent
  Rows x_dst;       // GATv2: [num_dst, heads, dim]
  Rows att;         // GATv2: [1, heads, dim] (row_stride 0)
  Rows edge_feat;   // GATv2: [num_edges, heads, dim], data null when absent
  int64_t num_dst, num_edges, heads, dim;
  double negative_slope;
  Dropout dropout;  // element e * heads + h, as graph attention's
};

struct GatForwardArgs {
  GatInputs in;
  AttentionGrouping dst;
  RowChunks dst_chunks;
  void* out;       // [num_dst, heads, dim], contiguous, in the inputs' type
  void* lse;       // [num_dst, heads], accumulation type: -inf for rows without edges
  void* alpha;     // [num_edges, heads] in the inputs' type (before dropout), or null
  void* part_acc;  // [max_slots, heads, dim] accumulation type: a chunk's unnormalised output
  void* part_ml;   // [max_slots, heads, 2]: its running maximum and sum
  Rows residual;   // the output epilogue, as graph attention's (data null: none)
};

// Outputs contiguous (but dx and dx_dst: grad_pack below), in the inputs' type unless said otherwise.
// The dst pass writes delta and GAT: da_dst [num_dst, heads], da_edge [num_edges, heads] (or null);
// GATv2: dx_dst [num_dst, heads, dim], datt_teams [gat_dst_pass_teams(...), dim] (accumulation type:
// each team's share of datt, team k's of head k % heads, summed over teams afterwards), d_edge_feat
// (or null).
// The src pass writes dx [num_src, heads, dim] and, for GAT, da_src [num_src, heads].
struct GatBackwardArgs {
  GatInputs in;
  Rows grad_out, out;  // [num_dst, heads, dim]
  const void* lse;     // [num_dst, heads], accumulation type
  AttentionGrouping dst, src;
  RowChunks dst_chunks, src_chunks;
  void* delta;         // [num_dst, heads], accumulation type: <grad_out, out - residual>, by the dst pass
  Rows residual;       // the forward's residual, or data null
  void* dst_grad;      // GAT: da_dst; GATv2: dx_dst
  void* datt_teams;    // GATv2 only
  void* edge_grad;     // GAT: da_edge; GATv2: d_edge_feat; or null
  void* dx;
  void* da_src;        // GAT only
  // With a src pass: [num_edges * heads] EdgeRecord (alpha and ds, GAT's dz), then GATv2's signs of
  // m, a byte per vector (gat_src_state_bytes); written by the dst pass, read by the src pass. Null
  // otherwise (the src pass then recomputes them).
  void* src_state;
  // Chunk partials (accumulation type) of long rows: [dst max_slots, heads, dst_grad's width (1 or
  // dim)], [src max_slots, heads, dim], [src max_slots, heads, 1].
  void* part_dst_grad;
  void* part_dx;
  void* part_da_src;
  // GATv2: dx's and dx_dst's rows lie grad_pack rows of heads x dim apart: 2 where they are the two
  // sides of one [rows, 2, heads, dim] tensor, else 1 (GAT: always 1).
  int32_t grad_pack = 1;
};

// out, lse (and alpha) over the dst grouping; every element written. dim in 1 .. kAttentionMaxDim.
void launch_gat_forward(const GatForwardArgs& args, ScalarKind scalar, cudaStream_t stream);
// The dst pass (delta, dst_grad, datt_teams, edge_grad), then the src pass (dx, da_src), which reads
// delta, then the merges of both passes' long rows (one launch). Every element of the outputs is
// written: rows without edges as zeros.
void launch_gat_backward_dst(const GatBackwardArgs& args, ScalarKind scalar, cudaStream_t stream);
// Teams of the dst pass (0 when it has no work), with every other field of args set.
int64_t gat_dst_pass_teams(const GatBackwardArgs& args, ScalarKind scalar);
void launch_gat_backward_src(const GatBackwardArgs& args, ScalarKind scalar, cudaStream_t stream);
void launch_gat_backward_merges(const GatBackwardArgs& args, ScalarKind scalar, cudaStream_t stream);
// Bytes of args.src_state the passes need (0: none), with every other field of args set.
int64_t gat_src_state_bytes(const GatBackwardArgs& args, ScalarKind scalar);

// Column sums (common/column_sum.cu): out[c] = sum over r < rows of x[r * row_stride + c] for x of
// `scalar` and out of `out_scalar`, through partial [column_sum_blocks(rows), width] in x's
// accumulation type (rounded once to out's type at the end); the order of the additions is a
// function of rows alone.
int64_t column_sum_blocks(int64_t rows);
void launch_column_sum(const void* x, int64_t rows, int64_t width, int64_t row_stride, void* partial, void* out,
                       ScalarKind scalar, ScalarKind out_scalar, cudaStream_t stream);

// GAT's per-node logits (attention/node_logits.cu), for `count` sides (1 or 2: a layer's source
// and destination attention vectors over the same features). Forward: in[k] is side k's att
// [heads, dim] and out[k] its logits [num_rows, heads], out[k][n, h] = <x[n, h], in[k][h]>. Both
// contiguous in the logits' type: x's `scalar`, or its accumulation type where accum_result; the
// sums are in the accumulation type.
struct LogitSides {
  int64_t count;
  const void* in[2];
  void* out[2];
};
void launch_node_logits(const Rows& x, int64_t heads, int64_t dim, const LogitSides& sides, ScalarKind scalar,
                        bool accum_result, cudaStream_t stream);
// Their gradients, for grads.in[k] side k's logits' gradient [num_rows, heads] (contiguous, the logits'
// type; null: zeros) and att[k] its att: dx [num_rows, heads, dim] = sum over k of grad[k] * att[k] in x's
// type where dx is not null (contiguous; with accumulate, added to the values dx holds), and att's
// gradient datt [count, heads, dim] in the logits' type (through partial,
// [node_logits_blocks(num_rows), count, heads, dim] in the accumulation type) where datt is not null.
int64_t node_logits_blocks(int64_t num_rows);
void launch_node_logits_backward(const LogitSides& grads, const void* const att[2], const Rows& x, int64_t heads,
                                 int64_t dim, void* dx, bool accumulate, void* partial, void* datt,
                                 ScalarKind scalar, bool accum_result, cudaStream_t stream);

}  // namespace edgedot
