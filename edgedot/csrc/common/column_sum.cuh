// The second stage of a column sum: per-block partial sums [blocks, width] added in a fixed order
// (bitwise reproducible, no atomics). A block of 32 x kSumLanes threads per 32 columns: thread
// (col, lane) sums blocks lane, lane + kSumLanes, ... in order, then lane 0 adds the kSumLanes sums
// in lane order and writes the column in the output type.
#pragma once

#include "common/common.cuh"

namespace edgedot {

constexpr int kSumLanes = 32;

template <typename A, typename T>
__global__ void sum_partials_kernel(const A* __restrict__ partial, T* __restrict__ out, int64_t blocks,
                                    int64_t width) {
  __shared__ A sums[kSumLanes][33];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  A sum = 0;
  if (col < width) {
#pragma unroll 4
    for (int64_t b = threadIdx.y; b < blocks; b += kSumLanes) sum += partial[b * width + col];
  }
  sums[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && col < width) {
    A total = 0;
    for (int lane = 0; lane < kSumLanes; ++lane) total += sums[lane][threadIdx.x];
    out[col] = from_accum<T>(total);
  }
}

template <typename A, typename T>
void launch_sum_partials(const A* partial, T* out, int64_t blocks, int64_t width, cudaStream_t stream) {
  sum_partials_kernel<A, T><<<static_cast<unsigned>((width + 31) / 32), dim3(32, kSumLanes), 0, stream>>>(
      partial, out, blocks, width);
}

}  // namespace edgedot
