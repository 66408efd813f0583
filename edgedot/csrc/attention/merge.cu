// The merge of long rows' chunks (for_each_unit in engine.cuh): each chunk of a long row wrote a
// partial result to its slot; here each (long row, head) combines its chunks' partials in chunk
// order and writes the row's final values. One launch serves a list of such merges (a backward's
// gradients), one after the other. Rows of few chunks take a warp each; rows of many (hubs) take a
// whole block, whose warps merge interleaved chunks and then combine in warp order. Every order is
// fixed, so results are bitwise reproducible. The kernel is instantiated for the columns a lane
// holds (kCols): 1 for rows of at most 32 columns (a head of 32, GAT's per-head sums), which then
// keep four times the partials in flight in the same registers (the merge is bound by their
// latency), else kAttentionMaxDim / 32.
#include <type_traits>

#include <cub/block/block_scan.cuh>

#include "attention/engine.cuh"

namespace edgedot {

namespace {

constexpr int kMergeMaxCols = kAttentionMaxDim / 32;  // columns of a row per lane, at most
// Chunks up to which one warp merges a row; beyond, a block of kMergeBlockThreads does.
constexpr int64_t kWarpMergeChunks = 64;
constexpr int kMergeBlockThreads = 512;
constexpr int kMergeWarps = kMergeBlockThreads / 32;
// Partials loaded before any is combined: the merge is bound by their latency. The warp phase takes
// more at a time than the hub phase, whose state lives on through its shared-memory combine; both
// hold kBatch x kCols columns within the 128 registers of a 512-thread block (float64 twice the
// registers: at a batch of 8 and 8 columns the warp phase spills, sm_90). At one column a hub's
// (row, head) keeps 16 warps x 16 partials in flight instead of 16 x 4.
template <typename A, int kCols>
constexpr int kWarpMergeBatch = kCols == 1 ? (sizeof(A) > 4 ? 8 : 16) : (sizeof(A) > 4 ? 2 : 8);
template <typename A, int kCols>
constexpr int kBlockMergeBatch = kCols == 1 ? (sizeof(A) > 4 ? 8 : 16) : 4;

// A lane's share of a merged row: columns lane + 32 * i. Softmax merges also carry the running
// maximum m and sum l (the same on every lane) and whether a chunk was NaN.
template <typename A, bool kSoftmax, int kCols>
struct MergeState {
  A m, l;
  A acc[kCols];
  bool bad;

  __device__ __forceinline__ void init() {
    m = static_cast<A>(-INFINITY);
    l = 0;
    bad = false;
#pragma unroll
    for (int i = 0; i < kCols; ++i) acc[i] = 0;
  }

  // Adds a partial (chunk_max, chunk_sum, cols) where cols[i] is column lane + 32 * i.
  __device__ __forceinline__ void add(A chunk_max, A chunk_sum, const A (&cols)[kCols], int dim, int lane) {
    if constexpr (kSoftmax) {
      if (!(chunk_max == chunk_max) || !(chunk_sum == chunk_sum)) bad = true;
      if (!(chunk_sum > 0)) return;  // a chunk whose edges all scored -inf (or NaN, flagged above)
      const A m_new = chunk_max > m ? chunk_max : m;
      const A a = accurate_exp(m - m_new), b = accurate_exp(chunk_max - m_new);  // a = 0 while m = -inf
      l = l * a + chunk_sum * b;
      m = m_new;
#pragma unroll
      for (int i = 0; i < kCols; ++i)
        if (lane + 32 * i < dim) acc[i] = fma_accum(cols[i], b, acc[i] * a);
    } else {
#pragma unroll
      for (int i = 0; i < kCols; ++i)
        if (lane + 32 * i < dim) acc[i] += cols[i];
    }
  }
};

// Merges slots first + offset, first + offset + stride, ... below last into s, kBatch at a time.
template <int kBatch, typename A, bool kSoftmax, int kCols>
__device__ __forceinline__ void merge_slots(MergeState<A, kSoftmax, kCols>& s, const A* part, const A* part_ml,
                                            int64_t heads, int64_t h, int dim, int64_t first, int64_t last,
                                            int64_t offset, int64_t stride, int lane) {
  for (int64_t base = first + offset; base < last; base += kBatch * stride) {
    A cols[kBatch][kCols], chunk_max[kBatch], chunk_sum[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int64_t slot = base + b * stride;
      const bool has = slot < last;
      const A* row = part + (slot * heads + h) * dim;
#pragma unroll
      for (int i = 0; i < kCols; ++i) cols[b][i] = has && lane + 32 * i < dim ? row[lane + 32 * i] : A(0);
      if constexpr (kSoftmax) {
        chunk_max[b] = has ? part_ml[2 * (slot * heads + h)] : static_cast<A>(-INFINITY);
        chunk_sum[b] = has ? part_ml[2 * (slot * heads + h) + 1] : A(0);
      } else {
        chunk_max[b] = chunk_sum[b] = 0;
      }
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b)
      if (base + b * stride < last) s.add(chunk_max[b], chunk_sum[b], cols[b], dim, lane);
  }
}

// Writes the merged row of (row, h): softmax: out = acc / l (+ plus, a softmax target's residual row
// where not null, rounded once) and lse = m + log(l), NaN when a chunk was NaN or every edge scored
// -inf (a long row has edges); sum: out = acc. NaN either way when the row's slots pass the partial
// buffers (an inconsistent pointer: its chunks were never computed).
template <typename T, bool kSoftmax, int kCols>
__device__ __forceinline__ void write_merged(const MergeState<accum_t<T>, kSoftmax, kCols>& s, T* out, accum_t<T>* lse,
                                             const T* plus, int dim, int lane) {
  using A = accum_t<T>;
  const A nan = static_cast<A>(NAN);
  const bool bad = s.bad || (kSoftmax && !(s.l > 0));
  const A factor = bad ? nan : kSoftmax ? A(1) / s.l : A(1);
#pragma unroll
  for (int i = 0; i < kCols; ++i) {
    if (lane + 32 * i >= dim) continue;
    const A value = plus != nullptr ? fma_accum(s.acc[i], factor, to_accum(plus[lane + 32 * i])) : s.acc[i] * factor;
    out[lane + 32 * i] = from_accum<T>(value);
  }
  if (kSoftmax && lane == 0) *lse = bad ? nan : s.m + accurate_log(s.l);
}

// Where (row, h) of a target is written: its out row (a softmax merge's out is the forward's, rows
// heads x dim apart; a sum's rows are m.pack such rows apart), and a softmax's lse.
template <typename T, bool kSoftmax>
__device__ __forceinline__ T* merged_row(const MergeTarget<T>& m, int64_t heads, int64_t row, int64_t h) {
  return m.out + ((kSoftmax ? row : row * m.pack) * heads + h) * m.dim;
}

// A softmax target's residual row of (row, h), or null.
template <typename T, bool kSoftmax>
__device__ __forceinline__ const T* merged_plus(const MergeTarget<T>& m, int64_t row, int64_t h) {
  return kSoftmax && m.plus.data != nullptr ? row_head<T>(m.plus, row, h) : nullptr;
}

template <typename T, bool kSoftmax>
__device__ __forceinline__ accum_t<T>* merged_lse(const MergeTarget<T>& m, int64_t heads, int64_t row, int64_t h) {
  return kSoftmax ? m.lse + row * heads + h : nullptr;
}

// A block's shared memory for a hub's merge: the scan that lists the hubs, and each warp's merged
// columns, (max, sum) and NaN flag.
template <typename A, int kCols>
struct HubShared {
  typename cub::BlockScan<int, kMergeBlockThreads>::TempStorage scan;
  int32_t hubs[kMergeBlockThreads];
  A warp_acc[kMergeWarps][kCols * 32];
  A warp_ml[kMergeWarps][2];
  bool warp_bad[kMergeWarps];
};

// Every (long row, head) of one merge target. First each warp of the grid takes rows of at most
// kWarpMergeChunks chunks; then each block takes (hub, head) units of more chunks, so that the heads
// and rows of hubs spread over the device: every block lists the hubs the same way (a block-wide
// scan over the long rows, in order) and takes the units j with j % gridDim.x == blockIdx.x. The two
// phases write disjoint rows. Block-uniform control flow throughout (its __syncthreads).
template <typename T, bool kSoftmax, int kCols>
__device__ __forceinline__ void merge_target(const MergeTarget<T>& m, int64_t heads,
                                             HubShared<accum_t<T>, kCols>& shared) {
  using A = accum_t<T>;
  using Scan = cub::BlockScan<int, kMergeBlockThreads>;
  const RowChunks& c = m.chunks;
  const int dim = m.dim;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t num_long = *c.num_long;

  const int64_t grid_warp = static_cast<int64_t>(blockIdx.x) * kMergeWarps + warp;
  const int64_t grid_warps = static_cast<int64_t>(gridDim.x) * kMergeWarps;
  for (int64_t u = grid_warp; u < num_long * heads; u += grid_warps) {
    const int64_t k = u / heads, h = u - k * heads;
    const int64_t row = c.long_rows[k];
    const int64_t first = c.first_chunk[row], last = c.first_chunk[row + 1];
    if (last - first > kWarpMergeChunks) continue;
    MergeState<A, kSoftmax, kCols> s;
    s.init();
    s.bad = last > c.max_slots;
    if (!s.bad) merge_slots<kWarpMergeBatch<A, kCols>>(s, m.part, m.part_ml, heads, h, dim, first, last, 0, 1, lane);
    write_merged<T, kSoftmax, kCols>(s, merged_row<T, kSoftmax>(m, heads, row, h),
                                     merged_lse<T, kSoftmax>(m, heads, row, h), merged_plus<T, kSoftmax>(m, row, h),
                                     dim, lane);
  }

  int64_t hubs_before = 0;  // hubs listed in earlier passes
  for (int64_t base = 0; base < num_long; base += kMergeBlockThreads) {
    const int64_t k = base + threadIdx.x;
    int32_t row = -1;
    if (k < num_long) {
      row = c.long_rows[k];
      if (c.first_chunk[row + 1] - c.first_chunk[row] <= kWarpMergeChunks) row = -1;
    }
    int position, found;
    Scan(shared.scan).ExclusiveSum(row >= 0 ? 1 : 0, position, found);
    if (row >= 0) shared.hubs[position] = row;
    __syncthreads();
    const int64_t blocks = gridDim.x, block = blockIdx.x;
    // Hub unit hubs_before * heads + j is this block's when it is block modulo blocks.
    for (int64_t j = (block - hubs_before * heads % blocks + blocks) % blocks; j < found * heads; j += blocks) {
      const int64_t hub = shared.hubs[j / heads], h = j % heads;
      const int64_t first = c.first_chunk[hub], last = c.first_chunk[hub + 1];
      MergeState<A, kSoftmax, kCols> s;
      s.init();
      s.bad = last > c.max_slots;
      if (!s.bad) {
        merge_slots<kBlockMergeBatch<A, kCols>>(s, m.part, m.part_ml, heads, h, dim, first, last, warp, kMergeWarps,
                                                lane);
      }
#pragma unroll
      for (int i = 0; i < kCols; ++i)
        if (lane + 32 * i < dim) shared.warp_acc[warp][lane + 32 * i] = s.acc[i];
      if (lane == 0) {
        shared.warp_ml[warp][0] = s.m;
        shared.warp_ml[warp][1] = s.l;
        shared.warp_bad[warp] = s.bad;
      }
      __syncthreads();
      if (warp == 0) {
        MergeState<A, kSoftmax, kCols> total;
        total.init();
        for (int w = 0; w < kMergeWarps; ++w) {
          A cols[kCols];
#pragma unroll
          for (int i = 0; i < kCols; ++i) cols[i] = lane + 32 * i < dim ? shared.warp_acc[w][lane + 32 * i] : A(0);
          if (shared.warp_bad[w]) total.bad = true;
          // A warp that merged no chunk holds (-inf, 0): add() skips it.
          total.add(kSoftmax ? shared.warp_ml[w][0] : A(0), kSoftmax ? shared.warp_ml[w][1] : A(0), cols, dim, lane);
        }
        write_merged<T, kSoftmax, kCols>(total, merged_row<T, kSoftmax>(m, heads, hub, h),
                                         merged_lse<T, kSoftmax>(m, heads, hub, h),
                                         merged_plus<T, kSoftmax>(m, hub, h), dim, lane);
      }
      __syncthreads();
    }
    hubs_before += found;
    __syncthreads();  // hubs[] and the scan's storage are reused by the next pass
  }
}

// Target i of a list, picked by constant indices: indexing the kernel's parameters by a variable
// would copy them to local memory.
template <typename T>
__device__ __forceinline__ MergeTarget<T> target_at(const MergeList<T>& list, int i) {
  static_assert(kMaxMerges == 3, "one pick per target");
  return i == 0 ? list.at[0] : i == 1 ? list.at[1] : list.at[2];
}

// Every (long row, head) of every target of the list, in one launch (small calls are bound by the
// host's launches), the targets one after the other. A softmax merge (the forward's) has one target,
// merged without the loop, whose live target costs its larger state registers.
template <typename T, bool kSoftmax, int kCols>
__global__ void __launch_bounds__(kMergeBlockThreads) merge_kernel(MergeList<T> list, int64_t heads) {
  __shared__ HubShared<accum_t<T>, kCols> shared;
  if constexpr (kSoftmax) {
    merge_target<T, true, kCols>(list.at[0], heads, shared);
  } else {
    for (int i = 0; i < list.count; ++i) merge_target<T, false, kCols>(target_at(list, i), heads, shared);
  }
}

// Blocks for the merge: the number of long rows is known only on the device, so a fixed grid
// strides over them.
int merge_blocks() { return sm_count() * 2; }

// merge_kernel for the targets of rows of at most 32 columns (a lane holds one, and keeps more
// partials in flight: GAT's per-head sums, heads of up to 32) and, in a second launch where the list
// has any, for the wider ones (kMergeMaxCols a lane): one class's batches would slow the other's.
template <typename T, bool kSoftmax>
void launch_merge(const MergeList<T>& list, int64_t heads, cudaStream_t stream) {
  MergeList<T> narrow{}, wide{};
  for (int i = 0; i < list.count; ++i) {
    MergeList<T>& to = list.at[i].dim <= 32 ? narrow : wide;
    to.at[to.count++] = list.at[i];
  }
  if (narrow.count > 0) {
    merge_kernel<T, kSoftmax, 1><<<merge_blocks(), kMergeBlockThreads, 0, stream>>>(narrow, heads);
  }
  if (wide.count > 0) {
    merge_kernel<T, kSoftmax, kMergeMaxCols><<<merge_blocks(), kMergeBlockThreads, 0, stream>>>(wide, heads);
  }
}

}  // namespace

template <typename T>
void launch_merge_softmax(const RowChunks& c, int64_t heads, int64_t dim, const accum_t<T>* part,
                          const accum_t<T>* part_ml, T* out, accum_t<T>* lse, const Rows& plus,
                          cudaStream_t stream) {
  MergeList<T> list{};
  list.at[0] = MergeTarget<T>{c, static_cast<int>(dim), part, part_ml, out, lse, 1, plus};
  list.count = 1;
  launch_merge<T, true>(list, heads, stream);
}

template <typename T>
void launch_merge_sums(const MergeList<T>& merges, int64_t heads, cudaStream_t stream) {
  launch_merge<T, false>(merges, heads, stream);
}

#define EDGEDOT_MERGE(T)                                                                                          \
  template void launch_merge_softmax<T>(const RowChunks&, int64_t, int64_t, const accum_t<T>*, const accum_t<T>*, \
                                        T*, accum_t<T>*, const Rows&, cudaStream_t);                              \
  template void launch_merge_sums<T>(const MergeList<T>&, int64_t, cudaStream_t);
EDGEDOT_MERGE(float)
EDGEDOT_MERGE(double)
EDGEDOT_MERGE(__half)
EDGEDOT_MERGE(__nv_bfloat16)
#undef EDGEDOT_MERGE

}  // namespace edgedot
