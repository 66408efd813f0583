// Edges sorted by row for the sorted reduction: a stable LSD radix sort (CUB) of 32-bit row keys
// over only the bits the row count needs, carrying 32-bit edge positions. Stable, so each row
// keeps its edges in the given order and the result is reproducible.
#include <cub/device/device_radix_sort.cuh>

#include "common.cuh"

namespace edgedot {

// Key of each edge (its row; num_rows for an out-of-range row, which sorts last and is skipped
// by the reduction) and its position.
template <typename RowIdx>
__global__ void __launch_bounds__(kBlockThreads)
row_keys_kernel(const RowIdx* __restrict__ row_idx, int32_t num_edges, int32_t num_rows, int32_t* __restrict__ keys,
                int32_t* __restrict__ positions) {
  const int32_t stride = gridDim.x * blockDim.x;
  for (int32_t e = blockIdx.x * blockDim.x + threadIdx.x; e < num_edges; e += stride) {
    const RowIdx r = row_idx[e];
    keys[e] = in_range(r, num_rows) ? static_cast<int32_t>(r) : num_rows;
    positions[e] = e;
  }
}

namespace {

int key_bits(int32_t num_rows) {
  int bits = 1;
  while (bits < 31 && (int64_t{1} << bits) <= num_rows) ++bits;
  return bits;
}

cudaError_t radix_sort(void* temp, size_t& temp_bytes, cub::DoubleBuffer<int32_t>& keys,
                       cub::DoubleBuffer<int32_t>& positions, int32_t num_edges, int32_t num_rows,
                       cudaStream_t stream) {
  return cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys, positions, num_edges, 0, key_bits(num_rows), stream);
}

}  // namespace

size_t sort_by_row_temp_bytes(int64_t num_edges, int64_t num_rows) {
  cub::DoubleBuffer<int32_t> keys(nullptr, nullptr), positions(nullptr, nullptr);
  size_t bytes = 0;
  radix_sort(nullptr, bytes, keys, positions, static_cast<int32_t>(num_edges), static_cast<int32_t>(num_rows),
             nullptr);
  return bytes;
}

int launch_sort_by_row(const void* row_idx, IndexKind row_index, int64_t num_edges, int64_t num_rows, int32_t* keys,
                       int32_t* positions, void* temp, size_t temp_bytes, cudaStream_t stream) {
  const auto edges = static_cast<int32_t>(num_edges);
  const auto rows = static_cast<int32_t>(num_rows);
  dispatch_index(row_index, [&](auto ri) {
    using RowIdx = decltype(ri);
    auto kernel = row_keys_kernel<RowIdx>;
    kernel<<<grid_blocks(kernel, num_edges), kBlockThreads, 0, stream>>>(static_cast<const RowIdx*>(row_idx), edges,
                                                                        rows, keys, positions);
  });
  cub::DoubleBuffer<int32_t> key_buffers(keys, keys + num_edges), position_buffers(positions, positions + num_edges);
  const cudaError_t status = radix_sort(temp, temp_bytes, key_buffers, position_buffers, edges, rows, stream);
  if (status != cudaSuccess) return -1;
  return key_buffers.selector;
}

}  // namespace edgedot
