// Visit order for the forward on shuffled graphs whose rows overflow L2: the edges grouped by
// buckets of 2**shift consecutive rows of one side, so that the forward reads each row of that side
// from DRAM about once instead of once per edge. A counting sort on the bucket alone: one histogram
// pass, one scatter pass, the order inside a bucket left to the atomics, since the forward's values
// do not depend on the order it visits edges in.
//
// Decided on the device, without a host sync: a sample of adjacent edges first tells whether either
// index is already mostly non-decreasing (sorted input has the locality already); if so, the passes
// write nothing and the used flag stays 0, and the forward visits the edges as given.
#include <cub/block/block_scan.cuh>

#include "common/common.cuh"

namespace edgedot {
namespace {

constexpr int kOrderSamples = 4096;            // adjacent pairs sampled per index
constexpr int kOrderedSamples = 3686;          // 90%: at least this many non-decreasing pairs = ordered
constexpr int kScatterEdgesPerThread = 8;
constexpr int kScatterTile = kScatterEdgesPerThread * kBlockThreads;
constexpr int kBucketsPerThread = kMaxOrderBuckets / kBlockThreads;
static_assert(kOrderSamples % kBlockThreads == 0 && kMaxOrderBuckets % kBlockThreads == 0, "block-wide loops");

// Workspace ints: [0] used flag, [1, 1 + buckets) edges per bucket, then each bucket's fill cursor.
__device__ __forceinline__ int* bucket_counts(int* workspace) { return workspace + 1; }
__device__ __forceinline__ int* bucket_cursors(int* workspace, int buckets) { return workspace + 1 + buckets; }

// Out-of-range rows (the forward writes NaN for them) join the last bucket.
template <typename RowIdx>
__device__ __forceinline__ int bucket_of(RowIdx row, int64_t num_rows, int shift, int buckets) {
  return in_range(row, num_rows) ? static_cast<int>(static_cast<int64_t>(row) >> shift) : buckets - 1;
}

// One block: zeroes the counts and cursors, then sets the used flag unless either index looks sorted.
template <typename RowIdx, typename OtherIdx>
__global__ void __launch_bounds__(kBlockThreads)
order_sample_kernel(const RowIdx* __restrict__ row_idx, const OtherIdx* __restrict__ other_idx, int32_t num_edges,
                    int buckets, int* __restrict__ workspace) {
  for (int i = threadIdx.x; i < 2 * buckets; i += blockDim.x) workspace[1 + i] = 0;
  // All of a thread's samples are loaded before any is counted, so their latencies overlap.
  constexpr int kPerThread = kOrderSamples / kBlockThreads;
  bool row_pair[kPerThread], other_pair[kPerThread];
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int64_t e = static_cast<int64_t>(j * kBlockThreads + threadIdx.x) * (num_edges - 1) / kOrderSamples;
    row_pair[j] = row_idx[e] <= row_idx[e + 1];
    other_pair[j] = other_idx[e] <= other_idx[e + 1];
  }
  int row_ordered = 0, other_ordered = 0;
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    row_ordered += __syncthreads_count(row_pair[j]);
    other_ordered += __syncthreads_count(other_pair[j]);
  }
  if (threadIdx.x == 0) workspace[0] = row_ordered < kOrderedSamples && other_ordered < kOrderedSamples;
}

template <typename RowIdx>
__global__ void __launch_bounds__(kBlockThreads)
bucket_count_kernel(const RowIdx* __restrict__ row_idx, int32_t num_edges, int64_t num_rows, int shift, int buckets,
                    int* __restrict__ workspace) {
  __shared__ int count[kMaxOrderBuckets];
  if (workspace[0] == 0) return;
  for (int b = threadIdx.x; b < buckets; b += blockDim.x) count[b] = 0;
  __syncthreads();
  // 64-bit counter: within one grid stride of 2**31 edges a 32-bit one would wrap negative.
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < num_edges; e += stride) {
    atomicAdd(&count[bucket_of(row_idx[e], num_rows, shift, buckets)], 1);
  }
  __syncthreads();
  int* counts = bucket_counts(workspace);
  for (int b = threadIdx.x; b < buckets; b += blockDim.x) {
    if (count[b] != 0) atomicAdd(&counts[b], count[b]);
  }
}

// Tiles of kScatterTile edges: each tile ranks its edges per bucket in shared memory, reserves one
// run per bucket with a global atomic, and writes the edges' positions there.
template <typename RowIdx>
__global__ void __launch_bounds__(kBlockThreads)
bucket_scatter_kernel(const RowIdx* __restrict__ row_idx, int32_t num_edges, int64_t num_rows, int shift,
                      int buckets, int* __restrict__ workspace, int32_t* __restrict__ order) {
  using Scan = cub::BlockScan<int, kBlockThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ int bucket_start[kMaxOrderBuckets];
  __shared__ int tile_slot[kMaxOrderBuckets];  // the tile's count per bucket, then where its run starts
  if (workspace[0] == 0) return;

  int starts[kBucketsPerThread];
  const int* counts = bucket_counts(workspace);
#pragma unroll
  for (int j = 0; j < kBucketsPerThread; ++j) {
    const int b = threadIdx.x * kBucketsPerThread + j;
    starts[j] = b < buckets ? counts[b] : 0;
  }
  Scan(scan_storage).ExclusiveSum(starts, starts);
#pragma unroll
  for (int j = 0; j < kBucketsPerThread; ++j) bucket_start[threadIdx.x * kBucketsPerThread + j] = starts[j];

  int* cursors = bucket_cursors(workspace, buckets);
  for (int64_t tile_begin = static_cast<int64_t>(blockIdx.x) * kScatterTile; tile_begin < num_edges;
       tile_begin += static_cast<int64_t>(gridDim.x) * kScatterTile) {
    for (int b = threadIdx.x; b < buckets; b += blockDim.x) tile_slot[b] = 0;
    __syncthreads();
    int bucket[kScatterEdgesPerThread], rank[kScatterEdgesPerThread];
#pragma unroll
    for (int j = 0; j < kScatterEdgesPerThread; ++j) {
      const int64_t e = tile_begin + j * kBlockThreads + threadIdx.x;
      if (e < num_edges) {
        bucket[j] = bucket_of(row_idx[e], num_rows, shift, buckets);
        rank[j] = atomicAdd(&tile_slot[bucket[j]], 1);
      }
    }
    __syncthreads();
    for (int b = threadIdx.x; b < buckets; b += blockDim.x) {
      if (tile_slot[b] != 0) tile_slot[b] = bucket_start[b] + atomicAdd(&cursors[b], tile_slot[b]);
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kScatterEdgesPerThread; ++j) {
      const int64_t e = tile_begin + j * kBlockThreads + threadIdx.x;
      if (e < num_edges) order[tile_slot[bucket[j]] + rank[j]] = static_cast<int32_t>(e);
    }
    __syncthreads();
  }
}

}  // namespace

int64_t edge_order_workspace_ints(int buckets) { return 1 + 2 * static_cast<int64_t>(buckets); }

void launch_edge_order(const void* row_idx, IndexKind row_index, const void* other_idx, IndexKind other_index,
                       int64_t num_edges, int64_t num_rows, int shift, int32_t* order, int* workspace,
                       cudaStream_t stream) {
  const auto edges = static_cast<int32_t>(num_edges);
  const int buckets = static_cast<int>(((num_rows - 1) >> shift) + 1);
  dispatch_index(row_index, [&](auto ri) {
    using RowIdx = decltype(ri);
    const auto* rows = static_cast<const RowIdx*>(row_idx);
    dispatch_index(other_index, [&](auto oi) {
      using OtherIdx = decltype(oi);
      order_sample_kernel<RowIdx, OtherIdx><<<1, kBlockThreads, 0, stream>>>(
          rows, static_cast<const OtherIdx*>(other_idx), edges, buckets, workspace);
    });
    auto count = bucket_count_kernel<RowIdx>;
    count<<<grid_blocks(count, num_edges), kBlockThreads, 0, stream>>>(rows, edges, num_rows, shift, buckets,
                                                                       workspace);
    auto scatter = bucket_scatter_kernel<RowIdx>;
    const int64_t tiles = (num_edges + kScatterTile - 1) / kScatterTile;
    scatter<<<grid_blocks(scatter, tiles * kBlockThreads), kBlockThreads, 0, stream>>>(
        rows, edges, num_rows, shift, buckets, workspace, order);
  });
}

}  // namespace edgedot
