// Groups edges by row without a comparison sort: a histogram of the rows, its running sum, then
// each edge claims a position in its row's range with an atomic. Rows come out in order; the
// edges of one row in no fixed order, which only the default mode (atomics anyway) accepts.
#include "common.cuh"

namespace edgedot {

// Out-of-range rows share the last bucket, num_rows: they sort last and the reductions skip them.
template <typename Idx>
__device__ __forceinline__ int64_t bucket_of(Idx row, int64_t num_rows) {
  return in_range(row, num_rows) ? static_cast<int64_t>(row) : num_rows;
}

template <typename RowIdx>
__global__ void __launch_bounds__(kBlockThreads)
count_rows_kernel(const RowIdx* __restrict__ row_idx, int64_t num_edges, int64_t num_rows,
                  unsigned long long* __restrict__ counts) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < num_edges; e += stride) {
    atomicAdd(counts + bucket_of(row_idx[e], num_rows), 1ull);
  }
}

// `ends` holds each bucket's end (the inclusive running sum of the counts); every edge takes the
// position below its bucket's current end.
template <typename T, typename RowIdx, typename OtherIdx>
__global__ void __launch_bounds__(kBlockThreads)
scatter_by_row_kernel(GroupArgs a, unsigned long long* __restrict__ ends) {
  const RowIdx* __restrict__ row_idx = static_cast<const RowIdx*>(a.row_idx);
  const OtherIdx* __restrict__ other_idx = static_cast<const OtherIdx*>(a.other_idx);
  const T* __restrict__ grad_out = static_cast<const T*>(a.grad_out);
  auto* __restrict__ rows_out = static_cast<RowIdx*>(a.rows_out);
  auto* __restrict__ other_out = static_cast<OtherIdx*>(a.other_out);
  auto* __restrict__ grad_out_out = static_cast<T*>(a.grad_out_out);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < a.num_edges; e += stride) {
    const int64_t bucket = bucket_of(row_idx[e], a.num_rows);
    const int64_t pos = static_cast<int64_t>(atomicAdd(ends + bucket, ~0ull)) - 1;  // adds -1
    rows_out[pos] = static_cast<RowIdx>(bucket);
    other_out[pos] = other_idx[e];
    for (int64_t h = 0; h < a.heads; ++h) grad_out_out[pos * a.heads + h] = grad_out[e * a.heads + h];
  }
}

void launch_count_rows(const void* row_idx, IndexKind row_index, int64_t num_edges, int64_t num_rows,
                       unsigned long long* counts, cudaStream_t stream) {
  dispatch_index(row_index, [&](auto ri) {
    using RowIdx = decltype(ri);
    auto kernel = count_rows_kernel<RowIdx>;
    kernel<<<grid_blocks(kernel, num_edges), kBlockThreads, 0, stream>>>(static_cast<const RowIdx*>(row_idx), num_edges,
                                                                     num_rows, counts);
  });
}

void launch_scatter_by_row(const GroupArgs& a, unsigned long long* ends, ScalarKind scalar, IndexKind row_index,
                           IndexKind other_index, cudaStream_t stream) {
  dispatch_scalar(scalar, [&](auto t) {
    dispatch_index(row_index, [&](auto ri) {
      dispatch_index(other_index, [&](auto oi) {
        auto kernel = scatter_by_row_kernel<decltype(t), decltype(ri), decltype(oi)>;
        kernel<<<grid_blocks(kernel, a.num_edges), kBlockThreads, 0, stream>>>(a, ends);
      });
    });
  });
}

}  // namespace edgedot
