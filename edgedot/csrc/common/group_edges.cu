// The grouping of edgedot.runtime.plan.build_side and group_offsets from the keys and positions of
// launch_sort_by_row, in one kernel: order, row_other and the row offsets, bit for bit as the
// tensor operations build them.
#include "common/common.cuh"

namespace edgedot {
namespace {

// The first of keys[0..num_edges) (non-decreasing) that is >= row: torch.searchsorted's left side.
// A binary search per row rather than a scan of the run boundaries, which would leave a whole gap
// of rows without edges (say the last hop's nodes of a sampled subgraph) to one thread.
__device__ __forceinline__ int32_t first_at_least(const int32_t* __restrict__ keys, int32_t num_edges, int64_t row) {
  int32_t lo = 0, hi = num_edges;
  while (lo < hi) {
    const int32_t mid = lo + (hi - lo) / 2;
    if (keys[mid] < row) lo = mid + 1; else hi = mid;
  }
  return lo;
}

template <typename OtherIdx>
__global__ void __launch_bounds__(kBlockThreads)
group_edges_kernel(const int32_t* __restrict__ keys, const int32_t* __restrict__ positions,
                   const OtherIdx* __restrict__ other_idx, int32_t num_edges, int64_t num_rows, int64_t num_other,
                   int64_t* __restrict__ order, uint64_t* __restrict__ row_other, int64_t* __restrict__ offsets) {
  // 64-bit counters: num_rows + 1 reaches 2**31.
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = first; i < num_edges; i += stride) {
    const int32_t e = positions[i];
    const OtherIdx o = other_idx[e];
    const int32_t other = in_range(o, num_other) ? static_cast<int32_t>(o) : -1;
    order[i] = e;
    // Keys lie in [0, num_rows]: out-of-range rows were sorted as num_rows.
    row_other[i] = static_cast<uint64_t>(static_cast<uint32_t>(keys[i])) << 32 | static_cast<uint32_t>(other);
  }
  for (int64_t r = first; r <= num_rows; r += stride) offsets[r] = first_at_least(keys, num_edges, r);
}

}  // namespace

void launch_group_edges(const int32_t* keys, const int32_t* positions, const void* other_idx, IndexKind other_index,
                        int64_t num_edges, int64_t num_rows, int64_t num_other, int64_t* order, uint64_t* row_other,
                        int64_t* offsets, cudaStream_t stream) {
  dispatch_index(other_index, [&](auto oi) {
    using OtherIdx = decltype(oi);
    auto kernel = group_edges_kernel<OtherIdx>;
    const int64_t threads = num_edges > num_rows + 1 ? num_edges : num_rows + 1;
    kernel<<<grid_blocks(kernel, threads), kBlockThreads, 0, stream>>>(
        keys, positions, static_cast<const OtherIdx*>(other_idx), static_cast<int32_t>(num_edges), num_rows,
        num_other, order, row_other, offsets);
  });
}

}  // namespace edgedot
