// Edges sorted by row for the sorted reduction: a stable LSD radix sort (CUB) of 32-bit row keys
// over only the bits the row count needs. Stable, so each row keeps its edges in the given order
// and the result is reproducible. The sort carries either each edge's position, or, when the
// edge's gradient values fit in 32 bits, the pair (other row, gradient bits) itself: the
// reduction then reads every sorted edge in sequence instead of gathering it by position.
#include <cub/device/device_radix_sort.cuh>

#include "common/grouping.cuh"

namespace edgedot {

// The sort's keys and positions (edge_key), one entry per thread.
template <typename RowIdx, typename SecondIdx>
__global__ void __launch_bounds__(kBlockThreads)
row_keys_kernel(const RowIdx* __restrict__ row_idx, const SecondIdx* __restrict__ second_idx, int32_t num_edges,
                int32_t num_rows, int32_t num_second_rows, int32_t* __restrict__ keys,
                int32_t* __restrict__ positions) {
  // 64-bit counter: within one grid stride of 2**31 entries a 32-bit one would wrap negative.
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t num_keys = second_idx == nullptr ? num_edges : 2 * static_cast<int64_t>(num_edges);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < num_keys; i += stride) {
    edge_key(row_idx, second_idx, i, num_edges, num_rows, num_second_rows, keys[i], positions[i]);
  }
}

// Keys and packed pairs (pack_edge in edgedot.h). Word is an unsigned integer of the gradient
// element's size: the values are moved bit for bit.
template <typename RowIdx, typename OtherIdx, typename Word>
__global__ void __launch_bounds__(kBlockThreads)
row_keys_packed_kernel(const RowIdx* __restrict__ row_idx, const OtherIdx* __restrict__ other_idx,
                       int64_t num_other_rows, const Word* __restrict__ grad_out, int heads, int32_t num_edges,
                       int32_t num_rows, int32_t* __restrict__ keys, uint64_t* __restrict__ pairs) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < num_edges; e += stride) {
    keys[e] = row_key(row_idx[e], num_rows);
    const OtherIdx o = other_idx[e];
    uint32_t bits = 0;
    for (int h = 0; h < heads; ++h) {
      bits |= static_cast<uint32_t>(grad_out[e * heads + h]) << (8 * sizeof(Word) * h);
    }
    pairs[e] = pack_edge(in_range(o, num_other_rows) ? static_cast<int32_t>(o) : -1, bits);
  }
}

namespace {

template <typename Value>
cudaError_t radix_sort(void* temp, size_t& temp_bytes, cub::DoubleBuffer<int32_t>& keys,
                       cub::DoubleBuffer<Value>& values, int32_t num_edges, int32_t num_rows, cudaStream_t stream) {
  return cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys, values, num_edges, 0, key_bits(num_rows), stream);
}

template <typename Value>
size_t temp_bytes_for(int64_t num_edges, int64_t num_rows) {
  cub::DoubleBuffer<int32_t> keys(nullptr, nullptr);
  cub::DoubleBuffer<Value> values(nullptr, nullptr);
  size_t bytes = 0;
  radix_sort(nullptr, bytes, keys, values, static_cast<int32_t>(num_edges), static_cast<int32_t>(num_rows), nullptr);
  return bytes;
}

// Sorts keys[0..E) with values[0..E) (second buffers at + num_edges); the buffer that holds the
// result, or -1.
template <typename Value>
int sort_keys(int32_t* keys, Value* values, int64_t num_edges, int64_t num_rows, void* temp, size_t temp_bytes,
              cudaStream_t stream) {
  cub::DoubleBuffer<int32_t> key_buffers(keys, keys + num_edges);
  cub::DoubleBuffer<Value> value_buffers(values, values + num_edges);
  const cudaError_t status = radix_sort(temp, temp_bytes, key_buffers, value_buffers, static_cast<int32_t>(num_edges),
                                        static_cast<int32_t>(num_rows), stream);
  return status == cudaSuccess ? key_buffers.selector : -1;
}

}  // namespace

size_t sort_by_row_temp_bytes(int64_t num_keys, int64_t key_rows, bool packed) {
  return packed ? temp_bytes_for<uint64_t>(num_keys, key_rows) : temp_bytes_for<int32_t>(num_keys, key_rows);
}

int launch_sort_by_row(const void* row_idx, IndexKind row_index, int64_t num_edges, int64_t num_rows, int32_t* keys,
                       int32_t* positions, void* temp, size_t temp_bytes, cudaStream_t stream, const void* second_idx,
                       IndexKind second_index, int64_t num_second_rows) {
  const int64_t num_keys = second_idx == nullptr ? num_edges : 2 * num_edges;
  dispatch_index(row_index, [&](auto ri) {
    dispatch_index(second_idx == nullptr ? row_index : second_index, [&](auto si) {
      using RowIdx = decltype(ri);
      using SecondIdx = decltype(si);
      auto kernel = row_keys_kernel<RowIdx, SecondIdx>;
      kernel<<<grid_blocks(kernel, num_keys), kBlockThreads, 0, stream>>>(
          static_cast<const RowIdx*>(row_idx), static_cast<const SecondIdx*>(second_idx),
          static_cast<int32_t>(num_edges), static_cast<int32_t>(num_rows), static_cast<int32_t>(num_second_rows), keys,
          positions);
    });
  });
  const int64_t key_rows = second_idx == nullptr ? num_rows : num_rows + 1 + num_second_rows;
  return sort_keys(keys, positions, num_keys, key_rows, temp, temp_bytes, stream);
}

int launch_sort_packed_by_row(const GradArgs& a, IndexKind row_index, IndexKind other_index, int grad_bytes,
                              int32_t* keys, uint64_t* pairs, void* temp, size_t temp_bytes, cudaStream_t stream) {
  auto launch = [&](auto word) {
    using Word = decltype(word);
    dispatch_index(row_index, [&](auto ri) {
      dispatch_index(other_index, [&](auto oi) {
        using RowIdx = decltype(ri);
        using OtherIdx = decltype(oi);
        auto kernel = row_keys_packed_kernel<RowIdx, OtherIdx, Word>;
        kernel<<<grid_blocks(kernel, a.num_edges), kBlockThreads, 0, stream>>>(
            static_cast<const RowIdx*>(a.row_idx), static_cast<const OtherIdx*>(a.other_idx), a.other.num_rows,
            static_cast<const Word*>(a.grad_out), static_cast<int>(a.heads), static_cast<int32_t>(a.num_edges),
            static_cast<int32_t>(a.num_rows), keys, pairs);
      });
    });
  };
  if (grad_bytes == 2) launch(uint16_t{}); else launch(uint32_t{});
  return sort_keys(keys, pairs, a.num_edges, a.num_rows, temp, temp_bytes, stream);
}

}  // namespace edgedot
